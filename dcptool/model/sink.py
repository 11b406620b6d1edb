"""Where simulate records: one Recorder for all ranks, or one per rank (--per-rank), and the observations each
fault touched."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dcptool.dump import Record
from dcptool.dump.observation import HOST_ROWS
from dcptool.dump.transfer import TransferRecord
from dcptool.engine.recorder.record import Recorder
from dcptool.model.config import PAIR_SITES, SITES, SimConfig, kv_groups_of
from dcptool.model.handed import TENSORS, tensor_faults


def output_paths(cfg: SimConfig, out: Path, per_rank: bool) -> list[Path]:
    """The files a run writes: `out`, or with per_rank one per recording process (OUT.rankR / OUT.pcpP.rankR)."""
    if not per_rank:
        return [out]
    names = [f".pcp{p}.rank{r}" if cfg.pcp > 1 else f".rank{r}" for p in range(cfg.pcp) for r in range(cfg.dcp)]
    return [out.with_name(f"{out.stem}{n}{out.suffix or '.safetensors'}") for n in names]


# the host values (the row fields after the last device one): one row every rank shares, or [ranks, values]
_LATE = tuple(f.name for f in HOST_ROWS)


def _of_rank(r: Record, i: int, slots: tuple | None, odd_seq: np.ndarray | None) -> Record:
    """Rank i's observation of a batch record that holds every rank's (Sink.record)."""
    def row(x):
        return None if x is None else x[i]

    kv, last, ctx = r.kv_pages, i == len(r.rank) - 1, r.ctx_chunks
    gl, vl = r.group_seq_lens, r.verify_row_lens
    late = {f: x if x.ndim == 1 else x[i] for f in _LATE if (x := getattr(r, f)) is not None}
    return r._replace(rank=r.rank[i], seq_lens=odd_seq if odd_seq is not None and last else r.seq_lens,
                      dcp_local_seq_lens=row(r.dcp_local_seq_lens), parent=row(r.parent), buffer=r.buffer[i],
                      kv_pages=None if kv is None else kv if kv.ndim == 1 else kv[i],
                      dcp_query_start_loc=row(r.dcp_query_start_loc), dcp_tot_seq_lens=row(r.dcp_tot_seq_lens),
                      positions=None if slots is None else slots[0],
                      slot_mapping=None if slots is None else slots[1][i],
                      ctx_chunks=ctx[i] if isinstance(ctx, list) else ctx, group_seq_lens=row(gl),
                      verify_row_lens=row(vl), sparse_topk=row(r.sparse_topk), **late)


class Sink:
    """A run's Recorders (one, or one per process with --per-rank), the observations each fault touched per file, and
    the observation count per site. The Recorders record to `record_to` (one path per output file); `reopen` starts
    new ones (simulate streams a long run to the files in parts)."""

    def __init__(self, cfg: SimConfig, record_to: list[Path], per_rank: bool):
        P, N = cfg.pcp, cfg.dcp
        version = cfg.engine_version or f"vLLM model runner V2 model ({cfg.pipeline} pipeline)"
        sites = SITES if cfg.kv_connector == "none" else PAIR_SITES
        self._kw = dict(dcp_size=N, cp_interleave=cfg.interleave, sites=sites, pcp_size=P, page_size=cfg.page_size,
                        engine="dcptool simulate", engine_version=version, note=cfg.command(),
                        kv_groups=kv_groups_of(cfg),
                        **({"attn_tensors": TENSORS} if tensor_faults(cfg.faults) else {}))
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

    def record(self, p: int, r: Record, slots: tuple | None, odd_seq: np.ndarray | None = None) -> list[int]:
        """Record one batch on every DCP rank of PCP rank p; returns the indices per rank. `r` holds per rank its
        rank (range(N)), parent and buffer (lists or None) and its rows ([N, ...]; kv_pages may be one row every
        rank shares); `slots`: (positions, slot mappings [N, groups, tokens]) or None; `odd_seq`: the last rank's
        seq_lens where it differs from the others' (one call per rank then, as where ctx_chunks is a list: each rank's
        chunked-context schedule where they differ)."""
        N = len(r.rank)
        if odd_seq is None and self.shared and not isinstance(r.ctx_chunks, list):
            # every rank in one file: one call records the batch on all N ranks
            if slots is not None:
                r = r._replace(positions=slots[0], slot_mapping={g: slots[1][:, g] for g in range(slots[1].shape[1])})
            return self.recorders[0].record_many(r)
        return [self.recorders[self.file_of[proc]].record(_of_rank(r, i, slots, odd_seq))
                for i, proc in enumerate(range(p * N, p * N + N))]

    def record_transfer(self, proc: int, t: TransferRecord) -> int:
        """Record one transfer plan at recording process `proc` (PCP rank * N + DCP rank); returns its index."""
        self.by_site[t.site] = self.by_site.get(t.site, 0) + 1
        return self.recorders[self.file_of[proc]].record_transfer(t)

    def mark(self, proc: int, idx: int, fault: str) -> None:
        """fault, or "fault:shape" where a stale fault left the rows that exist right but the length wrong."""
        self.touched[self.file_of[proc]].setdefault(fault, []).append(idx)
