"""The alias rule: micro-batches of a step sharing a DCP buffer, full-graph replays reading another buffer."""

from __future__ import annotations

import numpy as np

from dcptool.check.findings import ALIAS_GRAPH, ALIAS_UB, FindingTable
from dcptool.dump import Dump
from dcptool.dump.schema import GraphMode

CAPTURE, REPLAY = GraphMode.FULL_CAPTURE, GraphMode.FULL_REPLAY


def _segments(keys: list[np.ndarray], ties: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Stable sort by keys (last key most significant; ties keep their order, or go by `ties`); returns (order,
    start of each element's run of equal keys)."""
    order = np.lexsort(keys if ties is None else [ties, *keys])
    if order.size == 0:
        return order, order
    change = np.zeros(order.size, bool)
    change[0] = True
    for k in keys:
        ks = k[order]
        change[1:] |= ks[1:] != ks[:-1]
    run = np.maximum.accumulate(np.where(change, np.arange(order.size), 0))
    return order, run


def check_alias(d: Dump) -> FindingTable:
    """Micro-batches of one step sharing a DCP buffer; full-graph replays reading another buffer
    than their capture (same recording: a file or the files it rolled over into; rank, num_reqs_padded and
    micro-batch). A dense recording has one on a
    quarter of its observations: built as columns, messages rendered when read (findings.ALIAS_*)."""
    out: list[FindingTable] = []
    buf, ub, has = d["obs.buffer"], d["obs.ubatch"].astype(np.int64), d["obs.has_dcp"]
    fidx, rank, step = d.recording_index(), d["obs.rank"].astype(np.int64), d["obs.step"]  # (a process's recording)
    sel = np.flatnonzero((ub >= 0) & (has == 1) & (buf != 0))
    if sel.size:
        order, run = _segments([buf[sel], rank[sel], step[sel], fidx[sel]])
        s = sel[order]
        # same step, rank and buffer as an earlier member of its run, but another micro-batch
        first = s[run]
        k = np.flatnonzero(ub[s] != ub[first])
        out.append(FindingTable.build(d, s[k], "alias", ALIAS_UB, a0=first[k]))
    if "obs.graph" in d.columns:
        g = d["obs.graph"]
        sel = np.flatnonzero(((g == CAPTURE) | (g == REPLAY)) & (buf != 0))
        if sel.size:
            nrp = d["obs.num_reqs_padded"].astype(np.int64)
            # Every buffer captured for a key counts: a drafter (DFlash) captures graphs of the same sizes on
            # its own buffers, and several PCP ranks of one DCP rank may share a file; only a replay whose
            # buffer no earlier capture of its key used reads stale values.
            _, key = np.unique(np.stack([fidx[sel], rank[sel], nrp[sel], ub[sel]]), axis=1, return_inverse=True)
            _, pair = np.unique(np.stack([key.ravel(), buf[sel]]), axis=1, return_inverse=True)
            key, pair = key.ravel(), pair.ravel()
            cap = g[sel] == CAPTURE
            at = d.order_of(sel)  # (captures before replays in the run's order: one file's order, or by step)
            big = np.iinfo(np.int64).max
            first_cap = np.full(int(pair.max()) + 1, big)
            np.minimum.at(first_cap, pair[cap], at[cap])
            order, run = _segments([key], ties=at)
            s = sel[order]
            pos = np.arange(s.size)
            last = np.maximum.accumulate(np.where(g[s] == CAPTURE, pos, run - 1))  # latest capture in the run so far
            bad = np.flatnonzero((g[s] == REPLAY) & (last >= run) & (first_cap[pair[order]] > at[order]))
            out.append(FindingTable.build(d, s[bad], "alias", ALIAS_GRAPH, a0=s[last[bad]]))
    return FindingTable.concat(d, out)
