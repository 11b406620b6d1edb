"""The fused whole-dump kernels' launchers through torch: every recorded view and page count against the formula
(kernels in fused_tl.py; the GPU scan launches the same kernels without torch: gpu.scan_cuda)."""

from __future__ import annotations

import torch

from dcptool.dcp.backend import interpreted, load
from dcptool.dcp.fused_spec import CHECK_WARPS, FUSED_BLOCK, FUSED_WARPS, TL, fused_limits
from dcptool.dcp.kernel import INT32_MAX
from dcptool.dcp.reference import RowStats


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
        load(TL).expected_rows_kernel[(n,)](out, _as(seq_lens, torch.int32, dev), _as(offsets, torch.int64, dev),
                                 _as(num_reqs, torch.int32, dev), _as(ranks, torch.int32, dev), dcp_size,
                                 cp_interleave, BLOCK=FUSED_BLOCK)
    return out


def check_rows(seq_lens: torch.Tensor, rows: torch.Tensor, dcp: torch.Tensor, dcp_rows: torch.Tensor,
               num_reqs: torch.Tensor, num_reqs_padded: torch.Tensor, ranks: torch.Tensor, dcp_size: int,
               cp_interleave: int = 1, *, kv_pages: torch.Tensor | None = None, page_size: int = 1) -> RowStats:
    """Fused check of recorded views (and page counts) against the formula: RowStats, the same
    contract as reference.check_rows. Two launches: a flag pass over every observation (one read of
    every row), then exact counts for the flagged few."""
    dev = seq_lens.device
    tensors = [seq_lens, rows, dcp, dcp_rows, num_reqs, num_reqs_padded, ranks]
    tensors += [] if kv_pages is None else [kv_pages]
    gpu_only = dev.type != "cuda" and not interpreted() and torch.cuda.is_available()
    if any(t.device != dev for t in tensors) or gpu_only:
        raise ValueError(f"all tensors must be on one device the kernel can run on (got "
                         f"{sorted({str(t.device) for t in tensors})}); use CUDA tensors on a GPU machine")
    fused_limits(dcp_size, cp_interleave, page_size)
    n = num_reqs.shape[0]
    stats = torch.zeros(6, n, dtype=torch.int32, device=dev)
    stats[1::2] = -1
    if n == 0:
        return RowStats(*stats)
    k = load(TL)
    has_pages = kv_pages is not None
    args = (_as(seq_lens, torch.int32, dev), _as(rows, torch.int64, dev), _as(dcp, torch.int32, dev),
            _as(dcp_rows, torch.int64, dev), _as(num_reqs, torch.int32, dev), _as(num_reqs_padded, torch.int32, dev),
            _as(ranks, torch.int32, dev), _as(kv_pages, torch.int32, dev) if has_pages else stats)
    # N, I and the page size are compile-time constants: division by them becomes a multiply and a
    # shift (a runtime integer division is ~20 instructions a row, enough to make the pass compute-bound).
    const = dict(DCP_SIZE=dcp_size, INTERLEAVE=cp_interleave, PAGE=page_size, HAS_PAGES=has_pages)
    flags = torch.empty(n, dtype=torch.int32, device=dev)
    k.flag_rows_kernel[(n,)](flags, *args, **const, BLOCK=FUSED_BLOCK, num_warps=FUSED_WARPS)
    ids = torch.nonzero(flags).flatten()
    if ids.numel():
        sub = torch.empty(6 * ids.numel(), dtype=torch.int32, device=dev)
        k.check_rows_kernel[(ids.numel(),)](sub, ids, ids.numel(), *args, **const, BLOCK=FUSED_BLOCK,
                                            num_warps=CHECK_WARPS)
        stats[:, ids] = sub.view(6, -1)
    return RowStats(*stats)


def differ_rows(seq_lens: torch.Tensor, rows: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Observations (indices into rows[:-1], ascending) whose seq_lens rows differ from the rows shift[i] before
    them (shift 0: not compared); one launch of fused_tl.differ_rows_kernel (the scan's pairs, rank-agree)."""
    n = shift.shape[0]
    dev = seq_lens.device
    flags = torch.zeros(n, dtype=torch.int32, device=dev)
    if n:
        load(TL).differ_rows_kernel[(n,)](flags, _as(seq_lens, torch.int32, dev), _as(rows, torch.int64, dev),
                                          _as(shift, torch.int64, dev), BLOCK=FUSED_BLOCK, num_warps=FUSED_WARPS)
    return torch.nonzero(flags).flatten()
