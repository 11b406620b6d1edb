"""Where simulate records: one Recorder for all ranks, or one per rank (--per-rank), and the observations each
fault touched."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from dcptool.dump import Record, exists_error, write_target
from dcptool.engine.recorder.record import Recorder
from dcptool.model.config import KV_GROUPS, SITES, SimConfig


def _of_rank(r: Record, i: int, slots: tuple | None, odd_seq: np.ndarray | None) -> Record:
    """Rank i's observation of a batch record that holds every rank's (Sink.record)."""
    def row(x):
        return None if x is None else x[i]

    kv, last = r.kv_pages, i == len(r.rank) - 1
    return r._replace(rank=r.rank[i], seq_lens=odd_seq if odd_seq is not None and last else r.seq_lens,
                      dcp_local_seq_lens=row(r.dcp_local_seq_lens), parent=row(r.parent), buffer=r.buffer[i],
                      kv_pages=None if kv is None else kv if kv.ndim == 1 else kv[i],
                      dcp_query_start_loc=row(r.dcp_query_start_loc), dcp_tot_seq_lens=row(r.dcp_tot_seq_lens),
                      positions=None if slots is None else slots[0],
                      slot_mapping=None if slots is None else slots[1][i])


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
                raise exists_error(clash[0])
        self.recorders = [Recorder(p, force=force, **kw) for p in self.paths]
        self.shared = not per_rank
        self.touched: list[dict[str, list[int]]] = [{} for _ in self.recorders]
        self.by_site: dict[str, int] = {}

    def record(self, p: int, r: Record, slots: tuple | None, odd_seq: np.ndarray | None = None) -> list[int]:
        """Record one batch on every DCP rank of PCP rank p; returns the indices per rank. `r` holds per rank its
        rank (range(N)), parent and buffer (lists or None) and its rows ([N, ...]; kv_pages may be one row every
        rank shares); `slots`: (positions, slot mappings [N, groups, tokens]) or None; `odd_seq`: the last rank's
        seq_lens where it differs from the others' (one call per rank then)."""
        N = len(r.rank)
        if odd_seq is None and self.shared:  # every rank in one file: one call records the batch on all N ranks
            if slots is not None:
                r = r._replace(positions=slots[0], slot_mapping={g: slots[1][:, g] for g in range(slots[1].shape[1])})
            return self.recorders[0].record_many(r)
        return [self.recorders[self.file_of[proc]].record(_of_rank(r, i, slots, odd_seq))
                for i, proc in enumerate(range(p * N, p * N + N))]

    def mark(self, proc: int, idx: int, fault: str) -> None:
        """fault, or "fault:shape" where a stale fault left the rows that exist right but the length wrong."""
        self.touched[self.file_of[proc]].setdefault(fault, []).append(idx)
