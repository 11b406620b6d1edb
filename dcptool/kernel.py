"""Triton kernels for DCP-local lengths: vLLM's per-batch kernel and fused whole-dump kernels.

The only module that imports triton, and only on first use: `dcptool --help`, `inspect` and the
torch backend never pay for it. Without a GPU the kernels run in Triton's interpreter, which must
be switched on before triton is imported (TRITON_INTERPRET=1); `_triton()` does that.
"""

from __future__ import annotations

import functools
import os
import sys
from types import SimpleNamespace

import torch

BLOCK_SIZE = 128  # vLLM's launch: BLOCK_SIZE 128, grid cdiv(max_num_reqs, 128)
FUSED_BLOCK = 256  # rows per inner step of the fused kernels (observations hold ~64-512 rows)
FUSED_WARPS = 2
INT32_MAX = 2**31 - 1


class BackendError(RuntimeError):
    """The requested backend cannot run here (says why and what to use instead)."""


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=1)
def _triton() -> SimpleNamespace:
    """Import triton (switching on the interpreter when there is no GPU) and define the kernels."""
    if not torch.cuda.is_available():
        if "triton" in sys.modules and not interpreted():
            raise BackendError("triton was imported without TRITON_INTERPRET=1 and there is no GPU; "
                               "set TRITON_INTERPRET=1 before starting, or use --backend torch")
        os.environ["TRITON_INTERPRET"] = "1"
    # Kernels resolve names through the module's globals, so triton, tl and the shared jitted
    # helper are bound there (not as closure variables of this function).
    global triton, tl, _local, _or, _obs, _rows
    try:
        import triton
        import triton.language as tl
    except ImportError as e:  # pragma: no cover - triton is a Linux dependency
        raise BackendError(f"triton is not installed ({e}); use --backend torch") from None

    @triton.jit
    def _dcp_local_seq_lens_kernel(out_ptr, seq_lens_ptr, dcp_size, dcp_rank, cp_interleave, num_reqs,
                                   max_num_reqs, BLOCK_SIZE: tl.constexpr):
        # vLLM's semantics: rows < num_reqs get the formula, every other row of the buffer is 0.
        block = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        real = block < num_reqs
        # int64 inside: dcp_size * cp_interleave and dcp_rank * cp_interleave are products of int32
        # arguments that may pass 2**31 (the scalars are widened through the int64 row values).
        seq = tl.load(seq_lens_ptr + block, mask=real, other=0).to(tl.int64)
        rounds = seq // dcp_size // cp_interleave  # floor(floor(L / N) / I) == floor(L / (N * I))
        rem = seq - rounds * dcp_size * cp_interleave
        rem = tl.minimum(tl.maximum(rem - (tl.zeros_like(seq) + dcp_rank) * cp_interleave, 0), cp_interleave)
        local = tl.where(real, rounds * cp_interleave + rem, 0).to(tl.int32)
        tl.store(out_ptr + block, local, mask=block < max_num_reqs)

    @triton.jit
    def _local_fn(seq, rank, span, cp_interleave):
        rounds = seq // span
        rem = seq - rounds * span
        rem = tl.minimum(tl.maximum(rem - rank * cp_interleave, 0), cp_interleave)
        return rounds * cp_interleave + rem

    _local = _local_fn

    @triton.jit
    def _expected_rows_kernel(out_ptr, seq_lens_ptr, offsets_ptr, num_reqs_ptr, ranks_ptr, dcp_size,
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
    def _or_fn(a, b):
        return a | b

    _or = _or_fn

    @triton.jit
    def _obs_fn(obs, rows_ptr, dcp_rows_ptr, num_reqs_ptr, num_reqs_padded_ptr, ranks_ptr, HAS_PAGES: tl.constexpr):
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
    def _rows_fn(j, seq_start, dcp_start, nreq, rank, m, seq_lens_ptr, dcp_ptr, kv_ptr, DCP_SIZE: tl.constexpr,
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

    _obs = _obs_fn
    _rows = _rows_fn

    @triton.jit
    def _flag_rows_kernel(flags_ptr, seq_lens_ptr, rows_ptr, dcp_ptr, dcp_rows_ptr, num_reqs_ptr,
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
    def _check_rows_kernel(stats_ptr, ids_ptr, n_ids, seq_lens_ptr, rows_ptr, dcp_ptr, dcp_rows_ptr, num_reqs_ptr,
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

    return SimpleNamespace(triton=triton, dcp=_dcp_local_seq_lens_kernel, expected=_expected_rows_kernel,
                           flag=_flag_rows_kernel, check=_check_rows_kernel)


def device() -> torch.device:
    """Where the Triton kernels run: the GPU when there is one, else the CPU (interpreter)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def prepare_dcp_local_seq_lens(buf: torch.Tensor, seq_lens: torch.Tensor, num_reqs: int, dcp_size: int,
                               dcp_rank: int, cp_interleave: int = 1, *,
                               num_reqs_padded: int | None = None) -> torch.Tensor:
    """vLLM's helper: one launch over the whole persistent buffer; returns buf[:num_reqs_padded]."""
    if buf.dtype != torch.int32 or buf.dim() != 1:
        raise ValueError(f"buf must be a 1-D int32 buffer, got {buf.dtype} {tuple(buf.shape)}")
    if dcp_size < 1 or cp_interleave < 1 or not 0 <= dcp_rank < dcp_size:
        raise ValueError(f"need dcp_size >= 1, 0 <= dcp_rank < dcp_size, cp_interleave >= 1; got "
                         f"{dcp_size}, {dcp_rank}, {cp_interleave}")
    max_num_reqs = buf.shape[0]
    if not 0 <= num_reqs <= max_num_reqs or seq_lens.shape[0] < num_reqs:
        raise ValueError(f"num_reqs {num_reqs} must be <= buffer length {max_num_reqs} and <= seq_lens rows "
                         f"{seq_lens.shape[0]}")
    if num_reqs_padded is not None and not num_reqs <= num_reqs_padded <= max_num_reqs:
        raise ValueError(f"num_reqs_padded {num_reqs_padded} must lie in [num_reqs, buffer length]")
    if seq_lens.device != buf.device:
        raise ValueError(f"seq_lens on {seq_lens.device} but buf on {buf.device}")
    k = _triton()
    seq = seq_lens.to(torch.int32).contiguous()
    grid = (k.triton.cdiv(max_num_reqs, BLOCK_SIZE),)
    if max_num_reqs:
        k.dcp[grid](buf, seq, dcp_size, dcp_rank, cp_interleave, num_reqs, max_num_reqs, BLOCK_SIZE=BLOCK_SIZE)
    return buf[:num_reqs_padded]


def _as(t: torch.Tensor, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    return t.to(device=dev, dtype=dtype).contiguous()


def expected_rows(seq_lens: torch.Tensor, offsets: torch.Tensor, num_reqs: torch.Tensor, ranks: torch.Tensor,
                  dcp_size: int, cp_interleave: int = 1) -> torch.Tensor:
    """Fused: the expected rows of every observation in one launch (same contract as the reference)."""
    if dcp_size < 1 or cp_interleave < 1 or dcp_size * cp_interleave > INT32_MAX:
        raise ValueError(f"need 1 <= dcp_size * cp_interleave <= 2**31-1, got {dcp_size}, {cp_interleave}")
    dev = seq_lens.device
    n = num_reqs.shape[0]
    out = torch.empty(seq_lens.shape[0], dtype=torch.int32, device=dev)
    if n and seq_lens.shape[0]:
        _triton().expected[(n,)](out, _as(seq_lens, torch.int32, dev), _as(offsets, torch.int64, dev),
                                 _as(num_reqs, torch.int32, dev), _as(ranks, torch.int32, dev), dcp_size,
                                 cp_interleave, BLOCK=FUSED_BLOCK)
    return out


def check_rows(seq_lens: torch.Tensor, rows: torch.Tensor, dcp: torch.Tensor, dcp_rows: torch.Tensor,
               num_reqs: torch.Tensor, num_reqs_padded: torch.Tensor, ranks: torch.Tensor, dcp_size: int,
               cp_interleave: int = 1, *, kv_pages: torch.Tensor | None = None, page_size: int = 1) -> torch.Tensor:
    """Fused check of recorded views (and page counts) against the formula; [6, n] int32, the same
    contract as reference.check_rows. Two launches: a flag pass over every observation (one read of
    every row), then exact counts for the flagged few."""
    dev = seq_lens.device
    tensors = [seq_lens, rows, dcp, dcp_rows, num_reqs, num_reqs_padded, ranks]
    tensors += [] if kv_pages is None else [kv_pages]
    gpu_only = dev.type != "cuda" and not interpreted() and torch.cuda.is_available()
    if any(t.device != dev for t in tensors) or gpu_only:
        raise ValueError(f"all tensors must be on one device the kernel can run on (got "
                         f"{sorted({str(t.device) for t in tensors})}); use CUDA tensors on a GPU machine")
    if dcp_size < 1 or cp_interleave < 1 or page_size < 1 or dcp_size * cp_interleave > INT32_MAX \
            or page_size > INT32_MAX:
        # the fused kernels compute in int32 (ranks < N, so rank * I < N * I): the reader's bounds
        raise ValueError(f"need 1 <= dcp_size * cp_interleave <= 2**31-1 and 1 <= page_size <= 2**31-1, got "
                         f"{dcp_size}, {cp_interleave}, {page_size}")
    n = num_reqs.shape[0]
    stats = torch.zeros(6, n, dtype=torch.int32, device=dev)
    stats[1::2] = -1
    if n == 0:
        return stats
    k = _triton()
    has_pages = kv_pages is not None
    args = (_as(seq_lens, torch.int32, dev), _as(rows, torch.int64, dev), _as(dcp, torch.int32, dev),
            _as(dcp_rows, torch.int64, dev), _as(num_reqs, torch.int32, dev), _as(num_reqs_padded, torch.int32, dev),
            _as(ranks, torch.int32, dev), _as(kv_pages, torch.int32, dev) if has_pages else stats)
    # N, I and the page size are compile-time constants: division by them becomes a multiply and a
    # shift (a runtime integer division is ~20 instructions a row, enough to make the pass compute-bound).
    const = dict(DCP_SIZE=dcp_size, INTERLEAVE=cp_interleave, PAGE=page_size, HAS_PAGES=has_pages)
    flags = torch.empty(n, dtype=torch.int32, device=dev)
    k.flag[(n,)](flags, *args, **const, BLOCK=FUSED_BLOCK, num_warps=FUSED_WARPS)
    ids = torch.nonzero(flags).flatten()
    if ids.numel():
        sub = torch.empty(6 * ids.numel(), dtype=torch.int32, device=dev)
        k.check[(ids.numel(),)](sub, ids, ids.numel(), *args, **const, BLOCK=FUSED_BLOCK)
        stats[:, ids] = sub.view(6, -1)
    return stats


# --------------------------------------------------------------------------------------------
# The Recorder's device snapshot (dcptool.record): one launch copies an observation's device tensors

SNAP_HEADER = 8  # int32 words before the rows in a ring slot (layout: dcptool.record, "Ring slots")
SNAP_BLOCK = 512


@functools.lru_cache(maxsize=1)
def snapshot_kernel():
    """The Triton kernel behind Recorder.observe with CUDA tensors (compiled on first use).

    Every argument is a runtime integer (addresses too: engine views need not be 16-byte aligned, and a
    kernel that never specialises on them can be launched again through its compiled launcher with no
    dispatch). One program copies up to four int32/int64 sources into one int32 ring slot, flags values
    int32 cannot hold and negative seq_lens, and writes the slot's header last.
    """
    _triton()
    global _snap_section, _SNAP_BLOCK, _SNAP_HEADER
    _SNAP_BLOCK = tl.constexpr(SNAP_BLOCK)
    _SNAP_HEADER = tl.constexpr(SNAP_HEADER)

    @triton.jit
    def _snap_section_fn(dst, src, n, wide):
        # n < 0: no such section (a None value, or one the host holds); wide: 1 for int64 sources
        out = dst.to(tl.pointer_type(tl.int32))
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

    _snap_section = _snap_section_fn
    names = ["slot", "seqno", "num_reqs", "num_reqs_padded", "src0", "n0", "w0", "src1", "n1", "w1", "src2", "n2",
             "w2", "src3", "n3", "w3"]

    @triton.jit(do_not_specialize=names)
    def _snapshot_kernel(slot, seqno, num_reqs, num_reqs_padded, src0, n0, w0, src1, n1, w1, src2, n2, w2,
                         src3, n3, w3):
        # sections follow the header in this order, each as long as its n (absent ones take no room)
        d0 = slot + 4 * _SNAP_HEADER
        o0, g0 = _snap_section(d0, src0, n0, w0)
        d1 = d0 + 4 * tl.maximum(n0, 0).to(tl.int64)
        o1, g1 = _snap_section(d1, src1, n1, w1)
        d2 = d1 + 4 * tl.maximum(n1, 0).to(tl.int64)
        o2, g2 = _snap_section(d2, src2, n2, w2)
        d3 = d2 + 4 * tl.maximum(n2, 0).to(tl.int64)
        o3, g3 = _snap_section(d3, src3, n3, w3)
        flags = (o0 | o1 | o2 | o3) | (g0 * 2)  # bit 0: a value int32 cannot hold; bit 1: a negative seq_len
        h = tl.arange(0, _SNAP_HEADER)
        head = tl.where(h == 0, seqno, tl.where(h == 1, num_reqs, tl.where(h == 2, num_reqs_padded, tl.where(
            h == 3, n0, tl.where(h == 4, n1, tl.where(h == 5, n2, tl.where(h == 6, n3, flags)))))))
        tl.store(slot.to(tl.pointer_type(tl.int32)) + h, head)

    return _snapshot_kernel
