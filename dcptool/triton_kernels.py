"""The Triton kernels, at module level; imported as a unit by kernel._triton() only, after it has
switched on the interpreter where there is no GPU (TRITON_INTERPRET must be set before triton is imported).

`_local` is the formula (DESIGN §1) every kernel uses; the launchers are in kernel.py.
"""

import triton
import triton.language as tl

from dcptool.kernel import SNAP_BLOCK, SNAP_ENTRY, SNAP_FIXED, SNAP_HEAD_READ


@triton.jit
def _local(seq, rank, span, cp_interleave):
    # reference.local_of in Triton (the one body of DESIGN §1; tests hold the two equal)
    rounds = seq // span
    rem = seq - rounds * span
    rem = tl.minimum(tl.maximum(rem - rank * cp_interleave, 0), cp_interleave)
    return rounds * cp_interleave + rem


@triton.jit
def dcp_local_seq_lens_kernel(out_ptr, seq_lens_ptr, dcp_size, dcp_rank, cp_interleave, num_reqs,
                              max_num_reqs, BLOCK_SIZE: tl.constexpr):
    # vLLM's semantics: rows < num_reqs get the formula, every other row of the buffer is 0.
    block = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    real = block < num_reqs
    # int64 inside: dcp_size * cp_interleave and dcp_rank * cp_interleave are products of int32
    # arguments that may pass 2**31 (the scalars are widened through the int64 row values).
    seq = tl.load(seq_lens_ptr + block, mask=real, other=0).to(tl.int64)
    wide = tl.zeros_like(seq)  # scalars widened through an int64 vector (a 1 may arrive as a constexpr)
    local = _local(seq, wide + dcp_rank, (wide + dcp_size) * cp_interleave, cp_interleave)
    local = tl.where(real, local, 0).to(tl.int32)
    tl.store(out_ptr + block, local, mask=block < max_num_reqs)


@triton.jit
def expected_rows_kernel(out_ptr, seq_lens_ptr, offsets_ptr, num_reqs_ptr, ranks_ptr, dcp_size,
                         cp_interleave, BLOCK: tl.constexpr):
    # One program per observation: its rows in BLOCK steps; real rows formula, the rest 0.
    obs = tl.program_id(0).to(tl.int64)
    start = tl.load(offsets_ptr + obs)
    length = tl.load(offsets_ptr + obs + 1) - start
    nreq = tl.load(num_reqs_ptr + obs)
    rank = tl.load(ranks_ptr + obs)
    span = dcp_size * cp_interleave
    for j0 in range(0, length, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        inb = j < length
        seq = tl.load(seq_lens_ptr + start + j, mask=inb, other=0)
        local = tl.where(j < nreq, _local(seq, rank, span, cp_interleave), 0)
        tl.store(out_ptr + start + j, local, mask=inb)


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _obs(obs, rows_ptr, dcp_rows_ptr, num_reqs_ptr, num_reqs_padded_ptr, ranks_ptr, HAS_PAGES: tl.constexpr):
    # One observation's layout: where its rows start, real rows, rank, view rows to compare (m),
    # and how far to read (page counts cover every real row, also past a short view).
    seq_start = tl.load(rows_ptr + obs)
    dcp_start = tl.load(dcp_rows_ptr + obs)
    dcp_len = (tl.load(dcp_rows_ptr + obs + 1) - dcp_start).to(tl.int32)
    nreq = tl.load(num_reqs_ptr + obs)
    m = tl.minimum(dcp_len, tl.load(num_reqs_padded_ptr + obs))
    end = tl.maximum(m, nreq) if HAS_PAGES else m
    return seq_start, dcp_start, nreq, tl.load(ranks_ptr + obs), m, end


@triton.jit
def _rows(j, seq_start, dcp_start, nreq, rank, m, seq_lens_ptr, dcp_ptr, kv_ptr, DCP_SIZE: tl.constexpr,
          INTERLEAVE: tl.constexpr, PAGE: tl.constexpr, HAS_PAGES: tl.constexpr):
    # Rows j of one observation: real rows, view rows that differ from the formula (padded rows
    # must be 0), and real rows whose page count is not cdiv(local, PAGE).
    real = j < nreq
    seq = tl.load(seq_lens_ptr + seq_start + j, mask=real, other=0)
    local = _local(seq, rank, DCP_SIZE * INTERLEAVE, INTERLEAVE)
    inb = j < m
    rec = tl.load(dcp_ptr + dcp_start + j, mask=inb, other=0)
    bad = inb & (rec != tl.where(real, local, 0))
    if HAS_PAGES:
        kv = tl.load(kv_ptr + seq_start + j, mask=real, other=-1)
        # cdiv without `local + PAGE - 1`, which overflows int32 near 2**31 (a false finding)
        bad_pg = real & (kv >= 0) & (kv != local // PAGE + (local % PAGE != 0).to(tl.int32))
    else:
        bad_pg = j < 0
    return real, bad, bad_pg


@triton.jit
def flag_rows_kernel(flags_ptr, seq_lens_ptr, rows_ptr, dcp_ptr, dcp_rows_ptr, num_reqs_ptr,
                     num_reqs_padded_ptr, ranks_ptr, kv_ptr, DCP_SIZE: tl.constexpr,
                     INTERLEAVE: tl.constexpr, PAGE: tl.constexpr, HAS_PAGES: tl.constexpr, BLOCK: tl.constexpr):
    # Pass 1, the bandwidth-bound one: per observation only a bit mask (1 wrong real row, 2 bad
    # padded row, 4 bad page count), one reduction; exact counts come from pass 2 on the few flagged.
    obs = tl.program_id(0).to(tl.int64)
    seq_start, dcp_start, nreq, rank, m, end = _obs(obs, rows_ptr, dcp_rows_ptr, num_reqs_ptr,
                                                    num_reqs_padded_ptr, ranks_ptr, HAS_PAGES)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for j0 in range(0, end, BLOCK):
        real, bad, bad_pg = _rows(j0 + tl.arange(0, BLOCK), seq_start, dcp_start, nreq, rank, m, seq_lens_ptr,
                                  dcp_ptr, kv_ptr, DCP_SIZE, INTERLEAVE, PAGE, HAS_PAGES)
        acc |= tl.where(bad, tl.where(real, 1, 2), 0) | tl.where(bad_pg, 4, 0)
    tl.store(flags_ptr + obs, tl.reduce(acc, 0, _or))


@triton.jit
def check_rows_kernel(stats_ptr, ids_ptr, n_ids, seq_lens_ptr, rows_ptr, dcp_ptr, dcp_rows_ptr, num_reqs_ptr,
                      num_reqs_padded_ptr, ranks_ptr, kv_ptr, DCP_SIZE: tl.constexpr,
                      INTERLEAVE: tl.constexpr, PAGE: tl.constexpr, HAS_PAGES: tl.constexpr,
                      BLOCK: tl.constexpr):
    # Pass 2: exact [wrong real rows, first, bad padded rows, first, bad page counts, first] of
    # the observations listed in ids (one program each).
    k = tl.program_id(0).to(tl.int64)
    obs = tl.load(ids_ptr + k).to(tl.int64)
    seq_start, dcp_start, nreq, rank, m, end = _obs(obs, rows_ptr, dcp_rows_ptr, num_reqs_ptr,
                                                    num_reqs_padded_ptr, ranks_ptr, HAS_PAGES)
    big = 2147483647
    n_wrong = tl.zeros([BLOCK], dtype=tl.int32)
    first_wrong = tl.full([BLOCK], big, dtype=tl.int32)
    n_pad = tl.zeros([BLOCK], dtype=tl.int32)
    first_pad = tl.full([BLOCK], big, dtype=tl.int32)
    n_pg = tl.zeros([BLOCK], dtype=tl.int32)
    first_pg = tl.full([BLOCK], big, dtype=tl.int32)
    for j0 in range(0, end, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        real, bad, bad_pg = _rows(j, seq_start, dcp_start, nreq, rank, m, seq_lens_ptr, dcp_ptr, kv_ptr,
                                  DCP_SIZE, INTERLEAVE, PAGE, HAS_PAGES)
        bad_real = bad & real
        bad_pad = bad & (j >= nreq)
        n_wrong += bad_real.to(tl.int32)
        first_wrong = tl.minimum(first_wrong, tl.where(bad_real, j, big))
        n_pad += bad_pad.to(tl.int32)
        first_pad = tl.minimum(first_pad, tl.where(bad_pad, j, big))
        n_pg += bad_pg.to(tl.int32)
        first_pg = tl.minimum(first_pg, tl.where(bad_pg, j, big))
    fw = tl.min(first_wrong, axis=0)
    fp = tl.min(first_pad, axis=0)
    fg = tl.min(first_pg, axis=0)
    tl.store(stats_ptr + k, tl.sum(n_wrong, axis=0))
    tl.store(stats_ptr + n_ids + k, tl.where(fw == big, -1, fw))
    tl.store(stats_ptr + 2 * n_ids + k, tl.sum(n_pad, axis=0))
    tl.store(stats_ptr + 3 * n_ids + k, tl.where(fp == big, -1, fp))
    tl.store(stats_ptr + 4 * n_ids + k, tl.sum(n_pg, axis=0))
    tl.store(stats_ptr + 5 * n_ids + k, tl.where(fg == big, -1, fg))


# --------------------------------------------------------------------------------------------
# The Recorder's device snapshot (dcptool.record; kernel.snapshot_kernel() says what it does)

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
    # The slot's header describes the copy (layout: dcptool.record): one vector read of it (the ring is
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
