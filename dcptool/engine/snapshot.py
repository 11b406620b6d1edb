"""The Recorder's device snapshot: one launch copies an observation's device tensors into a ring slot (kernels in
snapshot_tl.py)."""

from __future__ import annotations

from dcptool.dcp.backend import interpreted, load

# --------------------------------------------------------------------------------------------
# The Recorder's device snapshot (dcptool.engine.device): one launch copies an observation's device tensors

SNAP_FIXED = 8  # int32 words of a ring slot's fixed header (layout: dcptool.engine.ring, "Ring slots")
SNAP_ENTRY = 4  # int32 words per section entry in the header (address: 2, count, mode)
SNAP_HEAD_READ = 64  # int32 words the kernel reads at once: the fixed header and up to 14 section entries
SNAP_MAX_SECTIONS = (SNAP_HEAD_READ - SNAP_FIXED) // SNAP_ENTRY
SNAP_BLOCK = 512
_TL = "dcptool.engine.snapshot_tl"
SNAP_WARPS = 1  # one warp: reading the header's fields out of its one vector load is then warp shuffles only


def snapshot_kernel():
    """The Triton kernel behind Recorder.observe with CUDA tensors (compiled on first use).

    One argument, the slot's address (a runtime integer: one compiled kernel serves every slot, launched
    through Triton's compiled launcher with no dispatch). The CPU writes the slot's header first: which
    sources to copy (address, count, int64 or int32, negatives flagged or not), any number of sections up
    to SNAP_MAX_SECTIONS. One program reads that header in one go, copies every section into the slot
    back to back (int64 narrowed to int32; engine views need not be aligned), flags values int32 cannot
    hold and forbidden negatives, and writes `done` last.
    """
    return load(_TL).snapshot_kernel


def snapshot_dispatch(raw_stream: int, slot: int):
    """One snapshot launch through Triton's dispatch (on the current stream: raw_stream is that stream);
    returns the compiled kernel, whose launcher launch.py then calls directly."""
    return load(_TL).snapshot_kernel[(1,)](slot, num_warps=SNAP_WARPS)


def snapshot_args_kernel():
    """The snapshot kernel for the engine's common case: sections 0-2 of the slot (seq_lens,
    dcp_local_seq_lens, query_start_loc) contiguous int32 device tensors or absent, the rest absent. The
    header comes as twelve arguments (slot, seqno, num_reqs, num_reqs_padded, K | negative-value flags << 16,
    words, then address and count of each of the three) and the kernel writes it into the slot itself: the
    same slot as snapshot_kernel's, without the GPU's read of the header from host memory before the copy
    and without the CPU's write of it."""
    return load(_TL).snapshot_args_kernel


def snapshot_args_dispatch(raw_stream: int, *args):
    """One launch of snapshot_args_kernel through Triton's dispatch (on the current stream); returns the
    compiled kernel."""
    k = load(_TL)
    if interpreted() and 0 in args[6::2]:
        # the interpreter types a 0 argument int32 whatever the annotation and cannot make it a pointer (an
        # empty tensor's address is 0): any readable address, none of it is read (count 0 or -1)
        args = (*args[:6], *(a or args[0] if i % 2 == 0 else a for i, a in enumerate(args[6:])))
    return k.snapshot_args_kernel[(1,)](*args, num_warps=SNAP_WARPS)
