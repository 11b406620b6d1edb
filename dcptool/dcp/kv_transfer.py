"""Where a request's KV lives on each side of a transfer, and what a destination rank must receive: the oracle of the
`transfer` rule (docs/dcp.md, "KV transfers").

A side shards a group's token positions over its CP world W with interleave I: position p lives on shard
(p // I) % W, at local index (p // (W*I)) * I + p % I, the rank's local positions in order. W is pcp * dcp when the
side's PCP ranks hold distinct shards (a worker's shard pcp_rank * dcp + dcp_rank), else dcp (every PCP rank keeps a
replica of its DCP shard, vLLM's model runner V2). A replicated group (not sharded on that side) keeps every position
on every worker, local index p. Local index l lies in the request's block l // B (B the manager's block size), kernel
block (l % B) // k of it (k the kernel block size) at slot l % k; a table of the request's logical block ids names
each block, a kernel block id is logical id * (B // k) + the kernel block's index in it.

Everything is vectorised over positions (numpy); `plan` is the reference a connector's plan is checked against.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dcptool.dcp.reference import local_np
from dcptool.dump.transfer import GROUP_KINDS, MAMBA, GroupPlan
from dcptool.dump.transfer import Side as TransferSide

# What the `transfer` rule finds (replay.md), in the order a transfer's finding is named by (its first kind present):
KINDS = (
    "partial-store",  # a keyed store claims the request's tokens but holds another shard's, or only some of them
    "wrong-source",  # a destination position read from a source worker whose shard does not hold it
    "past-sequence",  # a destination position filled from a source slot past the sequence length
    "not-owner",  # a source position sent to a destination rank that does not own it
    "block-ids",  # a copy names a block its group's table does not hold (ids scaled, or another group's), a group the
    #               transfer lacks, runs past its kernel block, or pairs blocks that carry other positions
    "twice",  # a destination position received more than once
    "never",  # a position the destination rank must hold never transferred
)


class Layout(NamedTuple):
    """One side's sharding of a group: CP world W, interleave I, and whether it shards the group at all."""

    world: int
    interleave: int
    sharded: bool

    @classmethod
    def of(cls, pcp: int, dcp: int, interleave: int, cp_shards: bool, sharded: bool = True) -> Layout:
        return cls(pcp * dcp if cp_shards else dcp, interleave, sharded)


def shard_of(worker, dcp, cp_shards):
    """The shard a worker (its CP coordinates pcp_rank * dcp + dcp_rank) holds: all of them with cp_shards, else its
    DCP rank (its PCP rank keeps a replica)."""
    worker = np.asarray(worker, np.int64)
    return np.where(np.asarray(cp_shards, bool), worker, worker % np.asarray(dcp, np.int64))


def owner(p, world, interleave):
    """The shard that holds position p."""
    return (np.asarray(p, np.int64) // interleave) % world


def local_index(p, world, interleave):
    """Position p's index among its shard's positions."""
    p = np.asarray(p, np.int64)
    return (p // (np.asarray(world, np.int64) * interleave)) * interleave + p % interleave


def position(local, shard, world, interleave):
    """The position at local index `local` of `shard` (local_index's inverse)."""
    local = np.asarray(local, np.int64)
    return ((local // interleave) * world + shard) * interleave + local % interleave


def positions_of(local, shard, layout_world, layout_interleave, sharded):
    """position() where the group is sharded on that side, else the local index itself (every worker holds all)."""
    return np.where(np.asarray(sharded, bool), position(local, shard, layout_world, layout_interleave),
                    np.asarray(local, np.int64))


def local_count(n, shard, world, interleave, sharded=True):
    """How many of positions [0, n) a shard holds (the DCP local length over world W; n where not sharded)."""
    n = np.maximum(np.asarray(n, np.int64), 0)
    return np.where(np.asarray(sharded, bool), local_np(n, world, shard, interleave), n)


class Side(NamedTuple):
    """One side of one group of a transfer, as the reference plans it: its layout, block and kernel block sizes,
    the request's logical block table and the block index it starts at."""

    layout: Layout
    block: int
    kernel: int
    table: np.ndarray
    first: int = 0


class Slots(NamedTuple):
    """What a destination rank must receive for one group: per slot, the position, the source shard and local
    index, the source and destination kernel block ids and offsets (-1 where a table does not reach)."""

    position: np.ndarray
    src_shard: np.ndarray
    src_local: np.ndarray
    src_block_id: np.ndarray
    src_offset: np.ndarray
    dst_block_id: np.ndarray
    dst_offset: np.ndarray


def needed_range(seq_len: int, shard: int, dst: Side, window: int = 0) -> tuple[int, int]:
    """The destination's local indices [lo, hi) it must receive: its positions below seq_len, from its table's first
    block on, and (a sliding window) those of the last `window` tokens."""
    lay = dst.layout
    hi = int(local_count(seq_len, shard, lay.world, lay.interleave, lay.sharded))
    lo = dst.first * dst.block
    if window:
        lo = max(lo, int(local_count(seq_len - window, shard, lay.world, lay.interleave, lay.sharded)))
    return min(lo, hi), hi


def kernel_ids(local: np.ndarray, side: Side) -> tuple[np.ndarray, np.ndarray]:
    """(kernel block id, offset) of local indices on a side; id -1 where the side's table does not name the block."""
    ratio = side.block // side.kernel
    idx = local // side.block - side.first
    ok = (idx >= 0) & (idx < side.table.size)
    logical = np.where(ok, side.table[np.clip(idx, 0, max(side.table.size - 1, 0))] if side.table.size else -1, -1)
    sub = (local % side.block) // side.kernel
    return np.where(ok & (logical >= 0), logical * ratio + sub, -1), local % side.kernel


def plan(seq_len: int, dst_shard: int, src: Side, dst: Side, window: int = 0) -> Slots:
    """The numpy reference: every slot destination shard `dst_shard` must receive of one group, where it comes from
    on the source side (the shard that holds the position: any for a replicated source, reported as -1) and where
    it goes."""
    lo, hi = needed_range(seq_len, dst_shard, dst, window)
    loc = np.arange(lo, hi, dtype=np.int64)
    dl = dst.layout
    pos = positions_of(loc, dst_shard, dl.world, dl.interleave, dl.sharded)
    sl = src.layout
    if sl.sharded:
        s_shard, s_local = owner(pos, sl.world, sl.interleave), local_index(pos, sl.world, sl.interleave)
    else:
        s_shard, s_local = np.full(pos.size, -1, np.int64), pos
    s_id, s_off = kernel_ids(s_local, src)
    d_id, d_off = kernel_ids(loc, dst)
    return Slots(pos, s_shard, s_local, s_id, s_off, d_id, d_off)


def runs(slots: Slots, workers: np.ndarray, group: int) -> np.ndarray:
    """The reference's slots as copies [k, 7] (group, source worker, source kernel block id, offset, destination
    kernel block id, offset, count): one per run of slots that advance together within one kernel block on both
    sides. `workers`: the source worker each slot is read from."""
    n = slots.position.size
    if n == 0:
        return np.zeros((0, 7), np.int64)
    s_id, s_off, d_id, d_off = slots.src_block_id, slots.src_offset, slots.dst_block_id, slots.dst_offset
    new = np.ones(n, bool)
    new[1:] = ((workers[1:] != workers[:-1]) | (s_id[1:] != s_id[:-1]) | (d_id[1:] != d_id[:-1])
               | (s_off[1:] != s_off[:-1] + 1) | (d_off[1:] != d_off[:-1] + 1))
    start = np.flatnonzero(new)
    count = np.diff(np.append(start, n))
    return np.stack([np.full(start.size, group), workers[start], s_id[start], s_off[start], d_id[start],
                     d_off[start], count], axis=1).astype(np.int64)


def side_of(layout: TransferSide, group: GroupPlan, src: bool) -> Side:
    """One side of one group of a transfer record, as `plan` takes it."""
    pre = "src" if src else "dst"
    block = getattr(group, f"{pre}_block_size")
    kernel = getattr(group, f"{pre}_kernel_block_size") or block
    sharded = getattr(group, f"{pre}_sharded")
    sharded = GROUP_KINDS.index(group.kind) != MAMBA if sharded is None else bool(sharded)
    lay = Layout.of(layout.pcp, layout.dcp, layout.interleave, layout.cp_shards, sharded)
    return Side(lay, block, kernel, np.asarray(getattr(group, f"{pre}_blocks"), np.int64).reshape(-1),
                getattr(group, f"{pre}_first"))


def plan_transfer(seq_len: int, dst_worker: int, src: TransferSide, dst: TransferSide,
                  groups: list[GroupPlan]) -> np.ndarray:
    """The reference plan of a whole transfer as copies [k, 7] (Recorder.transfer's `copies=`): every group's slots
    from the worker that holds them (PCP rank 0's replica where PCP ranks keep replicas; a replicated source group
    from worker dst_shard % workers), in runs; a mamba group block by block, each destination block from the same
    block of the request. Slots whose block a table does not reach are left out."""
    d_shard = int(shard_of(dst_worker, dst.dcp, dst.cp_shards))
    workers = src.pcp * src.dcp
    out = []
    for g, grp in enumerate(groups):
        s, d = side_of(src, grp, True), side_of(dst, grp, False)
        if GROUP_KINDS.index(grp.kind) == MAMBA:
            idx = np.arange(d.table.size) + d.first
            sid = np.where(idx - s.first < s.table.size, s.table[np.clip(idx - s.first, 0, max(s.table.size - 1, 0))]
                           if s.table.size else -1, -1)
            ok = (sid >= 0) & (d.table >= 0) & (idx >= s.first)
            k = int(ok.sum())
            out.append(np.stack([np.full(k, g), np.full(k, d_shard % workers), sid[ok] * (s.block // s.kernel),
                                 np.zeros(k, np.int64), d.table[ok] * (d.block // d.kernel), np.zeros(k, np.int64),
                                 np.full(k, min(s.kernel, d.kernel))], axis=1).astype(np.int64))
            continue
        slots = plan(seq_len, d_shard, s, d, grp.window)
        keep = (slots.src_block_id >= 0) & (slots.dst_block_id >= 0)
        slots = Slots(*(a[keep] for a in slots))
        worker = slots.src_shard if s.layout.sharded else np.full(slots.position.size, d_shard % workers)
        out.append(runs(slots, worker, g))
    return np.concatenate(out) if out else np.zeros((0, 7), np.int64)
