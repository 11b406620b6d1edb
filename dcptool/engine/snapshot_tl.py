"""Triton: the Recorder's snapshot kernels (snapshot.py says what they do). Imported only through dcp.backend.load."""

import triton
import triton.language as tl

from dcptool.engine.snapshot import SNAP_BLOCK, SNAP_ENTRY, SNAP_FIXED, SNAP_HEAD_READ

_SNAP_BLOCK = tl.constexpr(SNAP_BLOCK)
_SNAP_FIXED = tl.constexpr(SNAP_FIXED)
_SNAP_ENTRY = tl.constexpr(SNAP_ENTRY)
_SNAP_LANES = tl.constexpr(SNAP_HEAD_READ // 2)


@triton.jit
def _snap_section(out, src, n, wide):
    # Copy n values (int64 when wide, else int32) from the address src to the int32 pointer out;
    # returns (a value int32 cannot hold, a negative value) as 0/1. n < 0 (absent) copies nothing.
    p32 = src.to(tl.pointer_type(tl.int32))
    p64 = src.to(tl.pointer_type(tl.int64))
    over = tl.zeros([_SNAP_BLOCK], tl.int32)
    neg = tl.zeros([_SNAP_BLOCK], tl.int32)
    for off in range(0, n, _SNAP_BLOCK):
        idx = off + tl.arange(0, _SNAP_BLOCK)
        m = idx < n
        if wide != 0:
            v = tl.load(p64 + idx, mask=m, other=0)
        else:
            v = tl.load(p32 + idx, mask=m, other=0).to(tl.int64)
        w = v.to(tl.int32)
        over = over | (w.to(tl.int64) != v).to(tl.int32)
        neg = neg | (v < 0).to(tl.int32)
        tl.store(out + idx, w, mask=m)
    return tl.max(over, axis=0), tl.max(neg, axis=0)


@triton.jit
def _lane(head, lane, k):
    # int64 word k of the header, from the one vector read of it
    return tl.sum(tl.where(lane == k, head, 0), axis=0)


@triton.jit(do_not_specialize=["slot"])
def snapshot_kernel(slot):
    # The slot's header describes the copy (layout: dcptool.engine.ring): one vector read of it (the ring is
    # host memory: one PCIe round trip, not one per field), then each section's rows back to back after
    # the header, then flags and `done` (= seqno) last.
    p32 = slot.to(tl.pointer_type(tl.int32))
    lane = tl.arange(0, _SNAP_LANES)
    head = tl.load(slot.to(tl.pointer_type(tl.int64)) + lane, volatile=True)
    w01 = _lane(head, lane, 0)  # words 0-1: seqno | done
    nsec = _lane(head, lane, 2).to(tl.int32)  # words 4-5: nsec | flags
    out = p32 + _SNAP_FIXED + _SNAP_ENTRY * nsec
    over = nsec * 0
    neg = nsec * 0
    for k in range(nsec):
        src = _lane(head, lane, _SNAP_FIXED // 2 + 2 * k)
        e = _lane(head, lane, _SNAP_FIXED // 2 + 2 * k + 1)  # count | mode
        n = e.to(tl.int32)
        mode = (e >> 32).to(tl.int32)
        o, g = _snap_section(out, src, n, mode & 1)
        over = over | o
        neg = neg | (g & (mode >> 1))  # mode bit 1: negative values are flagged in this section
        out = out + tl.maximum(n, 0)
    tl.store(p32 + 5, over | (neg * 2))  # flags, bit 0: a value int32 cannot hold; bit 1: a forbidden negative
    tl.store(p32 + 1, w01.to(tl.int32))  # done: the seqno, written last


_SNAP_HEAD = tl.constexpr(SNAP_HEAD_READ)


@triton.jit(do_not_specialize=["slot", "seqno", "nr", "nrp", "ksec", "words", "src0", "n0", "src1", "n1", "src2",
                               "n2"])
def snapshot_args_kernel(slot: tl.int64, seqno: tl.int32, nr: tl.int32, nrp: tl.int32, ksec: tl.int32,
                         words: tl.int32, src0: tl.int64, n0: tl.int32, src1: tl.int64, n1: tl.int32,
                         src2: tl.int64, n2: tl.int32):
    # The engine's common case (kernel.snapshot_args_kernel() says when): the header comes as arguments
    # (no read of host memory before the copy can start) and the kernel writes it into the slot itself,
    # the same layout as the CPU writes for snapshot_kernel: sections 0-2 from the arguments, the other
    # K - 3 absent. ksec: K | (bit k: section k flags negatives) << 16 (no constexpr: the launcher is
    # called with exactly these twelve). Words 1 (done) and 5 (flags) are left to the end (one thread
    # writes each). An absent section (count -1) still comes with a readable address (the interpreter
    # converts every address).
    p32 = slot.to(tl.pointer_type(tl.int32))
    nsec = ksec & 0xFFFF
    m0 = (ksec >> 16) & 1
    m1 = (ksec >> 17) & 1
    m2 = (ksec >> 18) & 1
    lane = tl.arange(0, _SNAP_HEAD)
    k = tl.maximum(lane - _SNAP_FIXED, 0) // _SNAP_ENTRY  # the section of an entry word (fixed words: masked)
    j = lane % _SNAP_ENTRY  # address low, address high, count, mode
    src = tl.where(k == 0, src0, tl.where(k == 1, src1, tl.where(k == 2, src2, 0)))
    cnt = tl.where(k == 0, n0, tl.where(k == 1, n1, tl.where(k == 2, n2, -1)))
    mode = tl.where(k == 0, m0, tl.where(k == 1, m1, tl.where(k == 2, m2, 0))) * 2  # mode bit 1; bit 0: int32
    src = tl.where(cnt < 0, 0, src)  # an absent section's entry: (0, -1, 0), as the CPU writes it
    mode = tl.where(cnt < 0, 0, mode)
    ent = tl.where(j == 0, src & 0xFFFFFFFF, tl.where(j == 1, src >> 32, tl.where(j == 2, cnt, mode)))
    fixed = tl.where(lane == 0, seqno, tl.where(lane == 2, nr, tl.where(lane == 3, nrp, tl.where(
        lane == 4, nsec, tl.where(lane == 6, words, 0)))))
    head = tl.where(lane < _SNAP_FIXED, fixed.to(tl.int64), ent).to(tl.int32)
    tl.store(p32 + lane, head, mask=(lane < _SNAP_FIXED + _SNAP_ENTRY * nsec) & (lane != 1) & (lane != 5))
    # The rows: the three sections as one run of e2 values, each block gathered from whichever source its
    # values come from (one load per block for all three, not one dependent round per section: the
    # sources are int32, so nothing to narrow and nothing int32 cannot hold).
    out = p32 + _SNAP_FIXED + _SNAP_ENTRY * nsec
    e0 = tl.maximum(n0, 0)
    e1 = e0 + tl.maximum(n1, 0)
    e2 = e1 + tl.maximum(n2, 0)
    q0 = src0.to(tl.pointer_type(tl.int32))
    q1 = src1.to(tl.pointer_type(tl.int32))
    q2 = src2.to(tl.pointer_type(tl.int32))
    neg = tl.zeros([_SNAP_BLOCK], tl.int32)
    for off in range(0, e2, _SNAP_BLOCK):
        idx = off + tl.arange(0, _SNAP_BLOCK)
        m = idx < e2
        in0 = idx < e0
        in1 = (idx >= e0) & (idx < e1)
        v = tl.load(tl.where(in0, q0 + idx, tl.where(in1, q1 + (idx - e0), q2 + (idx - e1))), mask=m, other=0)
        forbid = tl.where(in0, m0, tl.where(in1, m1, m2))  # the section's negative-value flag
        neg = neg | ((v < 0) & m & (forbid != 0)).to(tl.int32)
        tl.store(out + idx, v, mask=m)
    tl.store(p32 + 5, tl.max(neg, axis=0) * 2)  # flags: bit 1, a forbidden negative (int32 sources: no bit 0)
    tl.store(p32 + 1, seqno)
