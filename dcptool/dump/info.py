"""What `dcptool inspect` shows of a dump: config, extent, optional columns."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcptool.dump.read import Dump
from dcptool.dump.schema import (
    FORMAT_VERSION,
    OPTIONAL,
    DumpConfig,
)


@dataclass
class DumpInfo:
    """What `dcptool inspect` shows: a dump's config, extent and which optional columns it holds."""

    files: list[str]
    format: str
    bytes: int
    config: DumpConfig
    observations: int
    with_view: int
    without_view: int
    steps: tuple[int, int] | None
    distinct_steps: int
    sites: dict[str, int]
    ranks: dict[int, int]
    ubatches: dict[int, int]
    seq_rows: int
    dcp_rows: int
    max_num_reqs: int
    max_num_reqs_padded: int
    optional: list[str]
    injected: dict[str, list[int]]
    capped: int | None = None  # the size cap (bytes) its recording stopped at (dcptool.capped); None: it did not
    transfers: int = 0  # KV transfer plans (dump.transfer)

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        if d["capped"] is None:
            del d["capped"]  # (absent unless a recording stopped at its cap)
        d["config"] = self.config.to_json()
        d["steps"] = list(self.steps) if self.steps else None
        d["ranks"] = {str(k): v for k, v in self.ranks.items()}
        d["ubatches"] = {str(k): v for k, v in self.ubatches.items()}
        return d


def describe(d: Dump) -> DumpInfo:
    def counts(a: np.ndarray) -> dict[int, int]:
        v, n = np.unique(a, return_counts=True)
        return {int(x): int(y) for x, y in zip(v, n)}

    step = d["obs.step"]
    has = int(d["obs.has_dcp"].sum())
    injected: dict[str, list[int]] = {}
    for inj in d.injected:
        for k, v in (inj or {}).items():
            injected.setdefault(k, []).extend(v)
    return DumpInfo(files=d.files, format=FORMAT_VERSION, bytes=sum(d.sizes), config=d.config, observations=d.n,
                    with_view=has, without_view=d.n - has,
                    steps=(int(step.min()), int(step.max())) if d.n else None,
                    distinct_steps=int(np.unique(step).size),
                    sites={d.config.sites[k]: v for k, v in counts(d["obs.site"]).items()},
                    ranks=counts(d["obs.rank"]), ubatches=counts(d["obs.ubatch"]),
                    seq_rows=int(d["rows.seq_lens"].size), dcp_rows=int(d["rows.dcp_local_seq_lens"].size),
                    max_num_reqs=int(d["obs.num_reqs"].max()) if d.n else 0,
                    max_num_reqs_padded=int(d["obs.num_reqs_padded"].max()) if d.n else 0,
                    optional=[k for k in OPTIONAL if k in d.columns], injected=injected,
                    capped=next((c for c in d.capped if c is not None), None),
                    transfers=int(d["obs.xfer"][-1]) if "obs.xfer" in d.columns else 0)
