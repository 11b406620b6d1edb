"""Where simulate records: one Recorder for all ranks, or one per rank (--per-rank), and the observations each
fault touched."""

from __future__ import annotations

from pathlib import Path

from dcptool.engine.record import Recorder
from dcptool.model.config import KV_GROUPS, SITES, SimConfig


def output_paths(cfg: SimConfig, out: Path, per_rank: bool) -> list[Path]:
    """The files a run writes: `out`, or with per_rank one per recording process (OUT.rankR / OUT.pcpP.rankR)."""
    if not per_rank:
        return [out]
    names = [f".pcp{p}.rank{r}" if cfg.pcp > 1 else f".rank{r}" for p in range(cfg.pcp) for r in range(cfg.dcp)]
    return [out.with_name(f"{out.stem}{n}{out.suffix or '.safetensors'}") for n in names]


class Sink:
    """A run's Recorders (one, or one per process with --per-rank), the observations each fault touched per file, and
    the observation count per site. The Recorders record to `record_to` (one path per output file); `reopen` starts
    new ones (simulate streams a long run to the files in parts)."""

    def __init__(self, cfg: SimConfig, record_to: list[Path], per_rank: bool):
        P, N = cfg.pcp, cfg.dcp
        version = cfg.engine_version or f"vLLM model runner V2 model ({cfg.pipeline} pipeline)"
        self._kw = dict(dcp_size=N, cp_interleave=cfg.interleave, sites=SITES, pcp_size=P, page_size=cfg.page_size,
                        engine="dcptool simulate", engine_version=version, note=cfg.command(),
                        kv_groups=[{"name": n, "dcp": dcp, "block_size": cfg.page_size} for n, dcp in KV_GROUPS])
        self.file_of = list(range(P * N)) if per_rank else [0] * (P * N)
        self.shared = not per_rank
        self.recorders: list[Recorder] = []
        self.touched: list[dict[str, list[int]]] = []
        self.by_site: dict[str, int] = {}
        self.reopen(record_to)

    def reopen(self, record_to: list[Path]) -> None:
        """Record from now on with new Recorders at these paths (the old ones closed by the caller): observation
        indices and `touched` start again at 0."""
        self.recorders = [Recorder(p, **self._kw) for p in record_to]
        self.touched = [{} for _ in self.recorders]

    def mark(self, proc: int, idx: int, fault: str) -> None:
        """fault, or "fault:shape" where a stale fault left the rows that exist right but the length wrong."""
        self.touched[self.file_of[proc]].setdefault(fault, []).append(idx)
