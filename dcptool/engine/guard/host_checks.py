"""The Guard's per-observation checks on host arrays (numpy): what replay checks per observation, from the inputs."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dcptool.dcp.reference import local_np

# The fields replay's rules read and the Guard's kernel does not check (the chunked context across ranks, the KV-cache
# groups' lengths and the verify bounds): the Guard neither keeps them in its slots nor writes them into its dumps
# (Guard.record drops them), so an engine that passes them pays nothing for them under the Guard.
NOT_KEPT = ("ctx_chunks", "group_seq_lens", "verify_row_lens")


class Spec(NamedTuple):
    """What the checks need of the run: DCP size, interleave, page size, per KV-cache group whether DCP shards it."""

    dcp_size: int
    cp_interleave: int
    page_size: int | None
    sharded: tuple[bool, ...] | None  # None: every group sharded (a dump's kv_groups unnamed)


def first_wrong(s: Spec, rank: int, num_reqs: int, num_reqs_padded: int, seq: np.ndarray, dcp: np.ndarray | None,
                qsl: np.ndarray | None, kv_pages: np.ndarray | None, dqsl: np.ndarray | None,
                tot: np.ndarray | None, slots: tuple) -> str | None:
    """The first replay rule (table order) one observation breaks, or None; host arrays, real rows first.

    The rules: missing (no view with dcp_size > 1), the values (the view's real rows vs the formula on the
    observation's own seq_lens, where the view has one row per seq_lens row), padding (rows num_reqs ..
    num_reqs_padded are 0), shape (num_reqs_padded rows), pages (cdiv(local, page_size) per real row),
    empty-mask (Q = query_start_loc[:len(Q)]), tot-lens (the global companion equals seq_lens on its real
    rows), slots (a sharded group's position p is written by rank (p // I) % N only, a replicated group's by
    every rank; padded tokens write nothing)."""
    N, I_ = s.dcp_size, s.cp_interleave
    nr = num_reqs
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
