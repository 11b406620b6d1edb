"""Triton: the Recorder's snapshot kernels (kernels.py says what they do, layout.py the slot they write). Imported
only through dcp.backend.load."""

import triton
import triton.language as tl

from dcptool.engine.snapshot.kernels import SNAP_ARGS_BLOCK, SNAP_BLOCK
from dcptool.engine.snapshot.layout import ENTRY, FIXED, HEAD_READ

_SNAP_BLOCK = tl.constexpr(SNAP_BLOCK)
_SNAP_FIXED = tl.constexpr(FIXED)
_SNAP_ENTRY = tl.constexpr(ENTRY)
_SNAP_LANES = tl.constexpr(HEAD_READ // 2)


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
    # The slot's header describes the copy (layout.py): one vector read of it (the ring is
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


_SNAP_HEAD = tl.constexpr(HEAD_READ)
_ARGS_BLOCK = tl.constexpr(SNAP_ARGS_BLOCK)


@triton.jit
def _pick(k, v0, v1, v2, v3, v4, v5, v6, v7, other):
    # v_k where k (a tensor of section numbers) is k, `other` past section 7
    return tl.where(k == 0, v0, tl.where(k == 1, v1, tl.where(k == 2, v2, tl.where(k == 3, v3, tl.where(
        k == 4, v4, tl.where(k == 5, v5, tl.where(k == 6, v6, tl.where(k == 7, v7, other))))))))


@triton.jit(do_not_specialize=["slot", "seqno", "nr", "nrp", "modes", "words", "s0", "n0", "s1", "n1", "s2", "n2",
                               "s3", "n3", "s4", "n4", "s5", "n5", "s6", "n6", "s7", "n7"])
def snapshot_args_kernel(slot: tl.int64, seqno: tl.int32, nr: tl.int32, nrp: tl.int32, modes: tl.int32,
                         words: tl.int32, s0: tl.int64, n0: tl.int32, s1: tl.int64, n1: tl.int32, s2: tl.int64,
                         n2: tl.int32, s3: tl.int64, n3: tl.int32, s4: tl.int64, n4: tl.int32, s5: tl.int64,
                         n5: tl.int32, s6: tl.int64, n6: tl.int32, s7: tl.int64, n7: tl.int32):
    # observe()'s fast path (kernels.snapshot_args_dispatch says when): the header comes as arguments (no read of
    # host memory before the copy can start) and program 0 writes it into the slot, the same layout as the CPU
    # writes for snapshot_kernel: sections 0-7 from the arguments (address, count; -1 absent), the other K - 8
    # absent. modes: K << 16 | (bit 8 + k: section k flags negatives) | (bit k: section k is int64). The rows of
    # all sections are one run of values; program p copies values [p * BLOCK, (p + 1) * BLOCK) of it, each
    # gathered from whichever section it lies in (one load of every value in flight at once, narrowed to int32).
    # Flags: with one program, program 0 writes them; with several, the CPU zeroed the word before the launch
    # and a program writes it only when it found something (racing writes are all non-zero). `done` (word 1)
    # last from program 0: the harvest reads a slot only after the CUDA event, when every program is done.
    p32 = slot.to(tl.pointer_type(tl.int32))
    pid = tl.program_id(0)
    nsec = modes >> 16
    c0 = tl.maximum(n0, 0)
    c1 = tl.maximum(n1, 0)
    c2 = tl.maximum(n2, 0)
    c3 = tl.maximum(n3, 0)
    c4 = tl.maximum(n4, 0)
    c5 = tl.maximum(n5, 0)
    c6 = tl.maximum(n6, 0)
    e0 = c0
    e1 = e0 + c1
    e2 = e1 + c2
    e3 = e2 + c3
    e4 = e3 + c4
    e5 = e4 + c5
    e6 = e5 + c6
    e7 = e6 + tl.maximum(n7, 0)
    if pid == 0:
        lane = tl.arange(0, _SNAP_HEAD)
        k = tl.maximum(lane - _SNAP_FIXED, 0) // _SNAP_ENTRY  # the section of an entry word (fixed words: masked)
        j = lane % _SNAP_ENTRY  # address low, address high, count, mode
        src = _pick(k, s0, s1, s2, s3, s4, s5, s6, s7, 0)
        cnt = _pick(k, n0, n1, n2, n3, n4, n5, n6, n7, -1)
        mode = ((modes >> k) & 1) | (((modes >> (8 + k)) & 1) * 2)  # header mode: bit 0 int64, bit 1 negatives
        src = tl.where(cnt < 0, 0, src)  # an absent section's entry: (0, -1, 0), as the CPU writes it
        mode = tl.where(cnt < 0, 0, mode)
        ent = tl.where(j == 0, src & 0xFFFFFFFF, tl.where(j == 1, src >> 32, tl.where(j == 2, cnt, mode)))
        fixed = tl.where(lane == 0, seqno, tl.where(lane == 2, nr, tl.where(lane == 3, nrp, tl.where(
            lane == 4, nsec, tl.where(lane == 6, words, 0)))))
        head = tl.where(lane < _SNAP_FIXED, fixed.to(tl.int64), ent).to(tl.int32)
        tl.store(p32 + lane, head, mask=(lane < _SNAP_FIXED + _SNAP_ENTRY * nsec) & (lane != 1) & (lane != 5))
    idx = pid * _ARGS_BLOCK + tl.arange(0, _ARGS_BLOCK)
    m = idx < e7
    k = ((idx >= e0).to(tl.int32) + (idx >= e1).to(tl.int32) + (idx >= e2).to(tl.int32) + (idx >= e3).to(tl.int32)
         + (idx >= e4).to(tl.int32) + (idx >= e5).to(tl.int32) + (idx >= e6).to(tl.int32))
    start = _pick(k, 0, e0, e1, e2, e3, e4, e5, e6, 0)
    wide = (modes >> k) & 1
    addr = _pick(k, s0, s1, s2, s3, s4, s5, s6, s7, 0) + (idx - start).to(tl.int64) * (4 + 4 * wide)
    v32 = tl.load(addr.to(tl.pointer_type(tl.int32)), mask=m & (wide == 0), other=0).to(tl.int64)
    v64 = tl.load(addr.to(tl.pointer_type(tl.int64)), mask=m & (wide != 0), other=0)
    v = tl.where(wide != 0, v64, v32)
    w = v.to(tl.int32)
    over = ((w.to(tl.int64) != v) & m).to(tl.int32)
    neg = ((v < 0) & m & (((modes >> (8 + k)) & 1) != 0)).to(tl.int32)
    tl.store(p32 + _SNAP_FIXED + _SNAP_ENTRY * nsec + idx, w, mask=m)
    flags = tl.max(over, axis=0) | (tl.max(neg, axis=0) * 2)
    if tl.num_programs(0) == 1:
        tl.store(p32 + 5, flags)
    elif flags != 0:
        tl.store(p32 + 5, flags)
    if pid == 0:
        tl.store(p32 + 1, seqno)
