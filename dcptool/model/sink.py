"""Where simulate records: one Recorder for all ranks, or one per rank (--per-rank), and the observations each
fault touched."""

from __future__ import annotations

import os
from pathlib import Path

from dcptool.dump import write_target
from dcptool.engine.record import Recorder
from dcptool.model.config import KV_GROUPS, SITES, SimConfig


class Sink:
    """A run's Recorders (one, or one per process with --per-rank), the file each process writes, the observations
    each fault touched per file, and the observation count per site."""

    def __init__(self, cfg: SimConfig, out: Path, per_rank: bool, force: bool = False):
        P, N = cfg.pcp, cfg.dcp
        version = cfg.engine_version or f"vLLM model runner V2 model ({cfg.pipeline} pipeline)"
        kw = dict(dcp_size=N, cp_interleave=cfg.interleave, sites=SITES, pcp_size=P, page_size=cfg.page_size,
                  engine="dcptool simulate", engine_version=version, note=cfg.command(),
                  kv_groups=[{"name": n, "dcp": dcp, "block_size": cfg.page_size} for n, dcp in KV_GROUPS])
        if per_rank:
            names = [f".pcp{p}.rank{r}" if P > 1 else f".rank{r}" for p in range(P) for r in range(N)]
            self.paths = [out.with_name(f"{out.stem}{n}{out.suffix or '.safetensors'}") for n in names]
            self.file_of = list(range(P * N))
        else:
            self.paths = [out]
            self.file_of = [0] * (P * N)
        for p in self.paths:  # before hours of work: only regular files are replaced (no /dev/null, FIFO...)
            write_target(p)
        if not force:  # (the Recorder refuses too; this says it in the CLI's words)
            clash = [str(p) for p in self.paths if os.path.lexists(p)]
            if clash:
                raise FileExistsError(f"{clash[0]}: exists (use --force to overwrite)")
        self.recorders = [Recorder(p, force=force, **kw) for p in self.paths]
        self.shared = not per_rank
        self.touched: list[dict[str, list[int]]] = [{} for _ in self.recorders]
        self.by_site: dict[str, int] = {}

    def mark(self, proc: int, idx: int, fault: str) -> None:
        """fault, or "fault:shape" where a stale fault left the rows that exist right but the length wrong."""
        self.touched[self.file_of[proc]].setdefault(fault, []).append(idx)
