"""The Recorder's snapshot kernels (kernels_tl.py), launched through Triton's dispatch: one launch copies an
observation's device tensors into a ring slot. The slot's layout, which these kernels and the host share:
layout.py. launch.py picks the cheapest launch that writes what these do."""

from __future__ import annotations

from dcptool.dcp.backend import interpreted, load

_TL = "dcptool.engine.snapshot.kernels_tl"
SNAP_BLOCK = 512  # values the descriptor kernel copies per step of a section's loop
SNAP_WARPS = 1  # one warp: reading the header's fields out of its one vector load is then warp shuffles only
SNAP_ARGS_BLOCK = 1024  # row values per program of snapshot_args_kernel (one load of each in flight)
SNAP_ARGS_WARPS = 4


def snapshot_dispatch(raw_stream: int, slot: int):
    """One launch of the descriptor kernel (snapshot_kernel) through Triton's dispatch on the current stream
    (raw_stream is that stream); returns the compiled kernel, whose launcher launch.py then calls directly.

    One argument, the slot's address (a runtime integer: one compiled kernel serves every slot). The CPU writes
    the slot's header first: which sources to copy (address, count, int64 or int32, negatives flagged or not), up
    to layout.MAX_SECTIONS sections. One program reads that header in one go, copies every section into the slot
    back to back (int64 narrowed to int32; engine views need not be aligned), flags values int32 cannot hold and
    forbidden negatives, and writes `done` last."""
    return load(_TL).snapshot_kernel[(1,)](slot, num_warps=SNAP_WARPS)


def snapshot_args_grid(values: int) -> int:
    """Programs of snapshot_args_kernel for `values` row values in all (at least one: it writes the header)."""
    return (values + SNAP_ARGS_BLOCK - 1) // SNAP_ARGS_BLOCK or 1


def snapshot_args_dispatch(raw_stream: int, grid: int, *args):
    """One launch of observe()'s fast path kernel (snapshot_args_kernel) on `grid` programs through Triton's
    dispatch (on the current stream); returns the compiled kernel.

    Every device section of layout.ARGS_SECTIONS (seq_lens ... slot_mapping) is a contiguous int32 or int64 device
    tensor or absent, the rest absent. The header comes as arguments (slot, seqno, num_reqs, num_reqs_padded,
    modes = K << 16 | negative-value flags << 8 | int64 flags, words, then address and count of each of the eight)
    and program 0 writes it into the slot: the same slot as the descriptor kernel's, without the GPU's read of the
    header from host memory and without the CPU's write of it. Launched on snapshot_args_grid(values) programs of
    SNAP_ARGS_BLOCK values each (a prefill's slot mapping is copied by many programs at once); with more than one
    the CPU zeroes the flags word first."""
    k = load(_TL)
    if interpreted() and 0 in args[6::2]:
        # the interpreter types a 0 argument int32 whatever the annotation and cannot make it a pointer (an
        # empty tensor's address is 0): any readable address, none of it is read (count 0 or -1)
        args = (*args[:6], *(a or args[0] if i % 2 == 0 else a for i, a in enumerate(args[6:])))
    return k.snapshot_args_kernel[(grid,)](*args, num_warps=SNAP_ARGS_WARPS)
