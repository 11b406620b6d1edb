"""The Guard's per-observation checks on host arrays (numpy): what replay checks per observation, from the inputs."""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from dcptool.dcp.reference import last_page, local_np, misdealt
from dcptool.dcp.rules import DEVICE_CHECKS
from dcptool.dump import Record
from dcptool.dump.schema import GraphMode

# The fields replay's rules read and the Guard's kernel does not check (the chunked context across ranks, the KV-cache
# groups' lengths, the verify bounds, sparse MLA's top-k): the Guard neither keeps them in its slots nor writes them
# into its dumps (Guard.record drops them), so an engine that passes them pays nothing for them under the Guard.
NOT_KEPT = ("ctx_chunks", "group_seq_lens", "verify_row_lens", "sparse_topk")


class Spec(NamedTuple):
    """What the checks need of the run: DCP size, interleave, page size, per KV-cache group whether DCP shards it."""

    dcp_size: int
    cp_interleave: int
    page_size: int | None
    sharded: tuple[bool, ...] | None  # None: every group sharded (a dump's kv_groups unnamed)


# The Guard's checks, named, ordered and chosen by the rule table: the errors among its device checks (a warning
# never makes an observation wrong). The kernel (device_checks) decides the same ones.
CHECKS = tuple(c.name for c in DEVICE_CHECKS if c.severity == "error")
# Of the checks of the host values (HOST_CHECKS, below: the row fields after the slot entries, host integers such as
# the metadata tensors' addresses), on the device path the host decides those that read host values alone (late_bits
# gives the kernel their verdict); the kernel decides the comparisons of host values with the device's seq_lens and
# query_start_loc (DEVICE_HALVES: host-copy's stale half, plan-pages), from the host values its launch is handed
DEVICE_HALVES = ("host-copy", "plan-pages")


class _Obs(NamedTuple):
    """One observation's host arrays as the checks read them; `local` is the formula on its real rows."""

    s: Spec
    rank: int
    nr: int
    nrp: int
    seq: np.ndarray
    dcp: np.ndarray | None
    qsl: np.ndarray | None
    kv: np.ndarray | None
    dqsl: np.ndarray | None
    tot: np.ndarray | None
    slots: tuple
    local: np.ndarray
    r: Record  # the observation (its host values)


def _aligned(o: _Obs) -> bool:
    """Replay compares the values of a view aligned with seq_lens only."""
    return o.dcp is not None and o.dcp.size == o.seq.size


def _pages(o: _Obs) -> bool:
    if o.kv is None or not o.s.page_size:
        return False
    kv = o.kv[:o.nr]
    return bool(np.any((kv != -(-o.local // o.s.page_size)) & (kv >= 0)))  # (-1: a count not recorded)


def _empty_mask(o: _Obs) -> bool:
    if o.s.dcp_size == 1 or o.dqsl is None or not o.dqsl.size or o.qsl is None or not o.qsl.size:
        return False
    return o.dqsl.size > o.qsl.size or not np.array_equal(o.dqsl, o.qsl[:o.dqsl.size])


def _tot_lens(o: _Obs) -> bool:
    if o.s.dcp_size == 1 or o.tot is None or not o.tot.size:
        return False
    k = min(o.tot.size, o.nr)
    return not np.array_equal(o.tot[:k], o.seq[:k])


# Each check by the name the table gives it: missing (no view with dcp_size > 1), values (the view's real rows vs the
# formula on the observation's own seq_lens, where the view has one row per seq_lens row: replay says which of stale
# ... mismatch), padding (rows num_reqs .. num_reqs_padded are 0), shape (num_reqs_padded rows), pages
# (cdiv(local, page_size) per real row), empty-mask (Q = query_start_loc[:len(Q)]), tot-lens (the global companion
# equals seq_lens on its real rows), slots (a sharded group's position p is written by rank (p // I) % N only, a
# replicated group's by every rank; padded tokens write nothing).
_CHECK = {
    "missing": lambda o: o.dcp is None and o.s.dcp_size > 1,
    "values": lambda o: _aligned(o) and not np.array_equal(o.dcp[:o.nr], o.local),
    "padding": lambda o: _aligned(o) and bool(np.any(o.dcp[o.nr:o.nrp] != 0)),
    "shape": lambda o: o.dcp is not None and o.dcp.size != o.nrp,
    "pages": _pages,
    "empty-mask": _empty_mask,
    "tot-lens": _tot_lens,
    "slots": lambda o: o.slots[0] is not None and o.slots[0].size > 0 and _slots_wrong(o.s, o.rank, o.nr, o.qsl,
                                                                                       *o.slots),
}
# The checks of the host values (HOST_CHECKS): graph-addr (a full-graph replay whose build handed attention a metadata
# tensor at another address than the graph captured), capacity (a build needing more request rows than the buffer
# behind one holds), host-copy (the host copy of seq_lens a build read is not the device's, or the build wrote it in
# place), plan-pages (a native plan's prefill page count or last-page length not the local length's; -1: not recorded,
# as is a row past the plan's values), kernel-block (a DCP-sharded group's slot mapping dealing positions to the ranks
# by another block than the KV-cache manager's where that moves a position). Host arrays here (the host path's
# copies); the device path's kernel decides the halves that read seq_lens and query_start_loc (DEVICE_HALVES).
_HOST = {
    "graph-addr": lambda s, r: _graph(r.graph) == GraphMode.FULL_REPLAY and r.attn_addrs is not None
    and r.graph_addrs is not None and not _equal(r.attn_addrs, r.graph_addrs),
    "capacity": lambda s, r: r.attn_caps is not None and any(c < r.num_reqs_padded
                                                             for c in np.asarray(r.attn_caps).ravel().tolist()),
    "host-copy": lambda s, r: r.host_seq_lens is not None and _host_copy_wrong(r),
    "plan-pages": lambda s, r: (r.kv_prefill_pages is not None or r.kv_last_page is not None) and _plan_wrong(s, r),
    "kernel-block": lambda s, r: r.kv_block_sizes is not None and _misdealt(s, np.asarray(r.kv_block_sizes)),
}
HOST_CHECKS = tuple(_HOST)  # the checks of the host values, by name
_CHECK.update((name, lambda o, f=f: f(o.s, o.r)) for name, f in _HOST.items())
if set(_CHECK) != set(CHECKS):
    raise ImportError(f"guard.host_checks: the rule table's device checks are {list(CHECKS)}; the host path decides "
                      f"{list(_CHECK)}")


def _host_copy_wrong(r: Record) -> bool:
    """host-copy on one observation: its real rows of rows.host_seq_lens against seq_lens and against
    rows.host_seq_lens_after (host arrays)."""
    if _written_in_place(r):
        return True
    host, seq = np.asarray(r.host_seq_lens), np.asarray(r.seq_lens)
    k = min(int(r.num_reqs), host.size, seq.size)
    return not _equal(host[:k], seq[:k])


def _written_in_place(r: Record) -> bool:
    """host-copy's half of host values alone: the host copy of seq_lens a build read is not the one it left."""
    after = r.host_seq_lens_after
    if after is None:
        return False
    host = np.asarray(r.host_seq_lens)
    k = min(int(r.num_reqs), host.size, len(after))
    return not _equal(host[:k], np.asarray(after)[:k])


def _equal(a, b) -> bool:
    """np.array_equal of two integer arrays (or sequences); those of one dtype and shape compared as bytes (a few
    values an observation, eagerly: array_equal's dispatch is most of its cost)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == b.dtype and a.dtype.kind in "iub":
        return a.shape == b.shape and a.tobytes() == b.tobytes()
    return bool(np.array_equal(a, b))


def _plan_rows(x, nr: int) -> np.ndarray:
    """A plan's values on the first `nr` rows, int64 (-1: not recorded, as is a row past its values)."""
    a = np.full(nr, -1, np.int64) if x is None else np.asarray(x, np.int64)[:nr]
    return a if a.size == nr else np.concatenate([a, np.full(nr - a.size, -1, np.int64)])


def _plan_wrong(s: Spec, r: Record) -> bool:
    """plan-pages on one observation (its real rows; -1: not recorded)."""
    seq, qsl, nr = r.seq_lens, r.query_start_loc, int(r.num_reqs)
    if seq is None or qsl is None or np.size(qsl) < nr + 1 or not s.page_size or nr == 0:
        return False
    seq, qsl = np.asarray(seq), np.asarray(qsl)
    pre, last = _plan_rows(r.kv_prefill_pages, nr), _plan_rows(r.kv_last_page, nr)
    covered = np.where(pre >= 0, seq[:nr] - np.diff(qsl[:nr + 1]), seq[:nr]).astype(np.int64)
    local = local_np(np.maximum(covered, 0), s.dcp_size, r.rank, s.cp_interleave)
    page = s.page_size
    return bool(np.any((pre >= 0) & (pre != -(-local // page))) or np.any((last >= 0) & (last != last_page(local,
                                                                                                          page))))


def _misdealt(s: Spec, sizes: np.ndarray) -> bool:
    """kernel-block on one observation's rows.kv_block_sizes (three per group: manager, kernel, dealt by)."""
    if s.dcp_size == 1 or sizes.size < 3:
        return False
    v = sizes.ravel().tolist()
    if len(v) % 3:
        raise ValueError(f"kv_block_sizes: {len(v)} values; three a KV-cache group (manager, kernel, dealt by)")
    for g, (mgr, _, dealt) in enumerate(zip(v[0::3], v[1::3], v[2::3])):
        sharded = s.sharded is None or g >= len(s.sharded) or s.sharded[g]
        if sharded and dealt != mgr and mgr > 0 and dealt > 0 and _deal_moves(dealt, mgr, s.dcp_size,
                                                                               s.cp_interleave):
            return True
    return False


@functools.cache
def _deal_moves(dealt: int, manager: int, dcp_size: int, cp_interleave: int) -> bool:
    return misdealt(dealt, manager, dcp_size, cp_interleave) >= 0


def _graph(g) -> int | None:
    return GraphMode.parse(g) if isinstance(g, str) else g


def first_wrong(s: Spec, r: Record, slots: tuple) -> str | None:
    """The first of the Guard's checks (CHECKS, the rule table's order) one observation breaks, or None; `r` holds
    host arrays (the Guard's copies) and ints, `slots` its slot entries (dump.slot_entries' three arrays, or three
    None); real rows first."""
    seq, nr = r.seq_lens, r.num_reqs
    local = local_np(seq[:nr].astype(np.int64), s.dcp_size, r.rank, s.cp_interleave)
    o = _Obs(s, r.rank, nr, r.num_reqs_padded, seq, r.dcp_local_seq_lens, r.query_start_loc, r.kv_pages,
             r.dcp_query_start_loc, r.dcp_tot_seq_lens, slots, local, r)
    return next((name for name in CHECKS if _CHECK[name](o)), None)


# What the host decides of the host values' checks on the device path (the kernel: DEVICE_HALVES' comparisons)
_HOST_ALONE = {**_HOST, "host-copy": lambda s, r: r.host_seq_lens is not None and _written_in_place(r),
               "plan-pages": lambda s, r: False}


def late_bits(s: Spec, r: Record, bits: dict) -> int:
    """The kernel's rule bits (`bits`: check -> bit) of the host values' checks an observation breaks on host values
    alone: the Guard's device path decides them on the host as observe() is called, and hands the kernel the host
    values DEVICE_HALVES compare with the device's seq_lens and query_start_loc (nothing of the device read here)."""
    return sum(bits[name] for name, f in _HOST_ALONE.items() if f(s, r))


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
