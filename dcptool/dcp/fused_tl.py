"""Triton: the fused whole-dump kernels (expected rows, flag pass, exact counts, rank-agree's row comparison).
Imported through dcp.backend.load (fused.py's launches through torch, the interpreter) or compiled by gpu.cubin (the
GPU scan)."""

import triton
import triton.language as tl

from dcptool.dcp.kernel_tl import local_of


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
        local = tl.where(j < nreq, local_of(seq, rank, span, cp_interleave), 0)
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
    local = local_of(seq, rank, DCP_SIZE * INTERLEAVE, INTERLEAVE)
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


@triton.jit
def differ_rows_kernel(flags_ptr, seq_lens_ptr, rows_ptr, shift_ptr, BLOCK: tl.constexpr):
    # rank-agree's row comparison: 1 where an observation's seq_lens rows differ from the rows `shift` before
    # them (its pair's, in the same chunk; shift 0: nothing to compare). One program per observation.
    obs = tl.program_id(0).to(tl.int64)
    start = tl.load(rows_ptr + obs)
    sh = tl.load(shift_ptr + obs)
    end = tl.where(sh != 0, tl.load(rows_ptr + obs + 1) - start, 0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for j0 in range(0, end, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        inb = j < end
        a = tl.load(seq_lens_ptr + start + j, mask=inb, other=0)
        b = tl.load(seq_lens_ptr + start - sh + j, mask=inb, other=0)
        acc |= (a != b).to(tl.int32)
    tl.store(flags_ptr + obs, tl.max(acc, 0))
