"""The Guard's per-observation checks on host arrays (numpy): what replay checks per observation, from the inputs."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dcptool.dcp.reference import local_np
from dcptool.dump import Record
from dcptool.dump.schema import GraphMode


class Spec(NamedTuple):
    """What the checks need of the run: DCP size, interleave, page size, per KV-cache group whether DCP shards it."""

    dcp_size: int
    cp_interleave: int
    page_size: int | None
    sharded: tuple[bool, ...] | None  # None: every group sharded (a dump's kv_groups unnamed)


def first_wrong(s: Spec, r: Record, slots: tuple) -> str | None:
    """The first replay rule (table order) one observation breaks, or None; `r` holds host arrays (the Guard's
    copies), `slots` its slot entries (dump.slot_entries' three arrays, or three None); real rows first.

    The rules: missing (no view with dcp_size > 1), the values (the view's real rows vs the formula on the
    observation's own seq_lens, where the view has one row per seq_lens row), padding (rows num_reqs ..
    num_reqs_padded are 0), shape (num_reqs_padded rows), pages (cdiv(local, page_size) per real row),
    empty-mask (Q = query_start_loc[:len(Q)]), tot-lens (the global companion equals seq_lens on its real
    rows), slots (a sharded group's position p is written by rank (p // I) % N only, a replicated group's by
    every rank; padded tokens write nothing), then the rules of the host values (late_wrong)."""
    return _early_wrong(s, r, slots) or late_wrong(s, r)


def late_wrong(s: Spec, r: Record) -> str | None:
    """The first rule the observation's host values break (the fields after the slot entries: host integers the
    Guard checks as observe() is called, on either path), or None: graph-addr (a full-graph replay whose build
    handed attention a metadata tensor at another address than the graph captured)."""
    graph = GraphMode.parse(r.graph) if isinstance(r.graph, str) else r.graph
    if graph == GraphMode.FULL_REPLAY and r.attn_addrs is not None and r.graph_addrs is not None:
        if not np.array_equal(np.asarray(r.attn_addrs), np.asarray(r.graph_addrs)):
            return "graph-addr"
    return None


def late_bits(s: Spec, r: Record, bits: dict) -> int:
    """late_wrong's verdict as the Guard kernel's rule bit (`bits`: rule -> bit), 0 when right."""
    rule = late_wrong(s, r)
    return 0 if rule is None else bits[rule]


def _early_wrong(s: Spec, r: Record, slots: tuple) -> str | None:
    rank, nr, num_reqs_padded, seq, dcp = r.rank, r.num_reqs, r.num_reqs_padded, r.seq_lens, r.dcp_local_seq_lens
    qsl, kv_pages, dqsl, tot = r.query_start_loc, r.kv_pages, r.dcp_query_start_loc, r.dcp_tot_seq_lens
    N, I_ = s.dcp_size, s.cp_interleave
    local = local_np(seq[:nr].astype(np.int64), N, rank, I_)
    if dcp is None:
        if N > 1:
            return "missing"
    else:
        if dcp.size == seq.size:  # (replay compares the values of a view aligned with seq_lens only)
            if not np.array_equal(dcp[:nr], local):
                return "values"  # stale, global, wrong-rank ... mismatch: replay says which
            if np.any(dcp[nr:num_reqs_padded] != 0):
                return "padding"
        if dcp.size != num_reqs_padded:
            return "shape"
    if kv_pages is not None and s.page_size:
        kv = kv_pages[:nr]
        if np.any((kv != -(-local // s.page_size)) & (kv >= 0)):  # (-1: a count not recorded)
            return "pages"
    if N > 1 and dqsl is not None and dqsl.size and qsl is not None and qsl.size:
        if dqsl.size > qsl.size or not np.array_equal(dqsl, qsl[:dqsl.size]):
            return "empty-mask"
    if N > 1 and tot is not None and tot.size:
        k = min(tot.size, nr)
        if not np.array_equal(tot[:k], seq[:k]):
            return "tot-lens"
    if slots[0] is not None and slots[0].size and _slots_wrong(s, rank, nr, qsl, *slots):
        return "slots"
    return None


def _slots_wrong(s: Spec, rank: int, nr: int, qsl, pos: np.ndarray, slot: np.ndarray, grp: np.ndarray) -> bool:
    """Slot ownership per entry (dump.slot_entries' layout: every group's tokens in turn, groups ascending)."""
    N, I_ = s.dcp_size, s.cp_interleave
    groups, start = np.unique(grp, return_index=True)
    n_tok = pos.size // groups.size
    real = n_tok if qsl is None or not qsl.size or nr >= qsl.size else int(qsl[nr])
    tok = np.arange(pos.size) % n_tok
    is_real = tok < real
    if np.any(~is_real & (slot != -1)) or np.any(slot < -1):
        return True
    sharded = np.ones(groups.size, bool) if s.sharded is None else np.array(
        [s.sharded[g] if g < len(s.sharded) else True for g in groups.tolist()])
    mine = ((pos // I_) % N == rank) | ~np.repeat(sharded, n_tok)
    w = slot >= 0
    writes = np.repeat(np.logical_or.reduceat(is_real & w, start), n_tok)  # the rank writes in that group
    return bool(np.any(is_real & ((w & ~mine) | ((slot == -1) & mine & writes))))
