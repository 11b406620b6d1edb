"""Triton kernels for DCP-local lengths: vLLM's per-batch kernel and fused whole-dump kernels.

The only module that imports triton, and only on first use: `dcptool --help`, `inspect` and the
torch backend never pay for it. Without a GPU the kernels run in Triton's interpreter, which must
be switched on before triton is imported (TRITON_INTERPRET=1); `_triton()` does that.
"""

from __future__ import annotations

import functools
import os
import sys
from types import ModuleType

import torch

from dcptool.reference import RowStats
from dcptool.schema import DcptoolError

BLOCK_SIZE = 128  # vLLM's launch: BLOCK_SIZE 128, grid cdiv(max_num_reqs, 128)
FUSED_BLOCK = 256  # rows per inner step of the fused kernels (observations hold ~64-512 rows)
FUSED_WARPS = 2
INT32_MAX = 2**31 - 1


class BackendError(DcptoolError, RuntimeError):
    """The requested backend cannot run here (says why and what to use instead)."""


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=1)
def _triton() -> ModuleType:
    """Import the kernels (switching on the interpreter first when there is no GPU)."""
    if not torch.cuda.is_available():
        if "triton" in sys.modules and not interpreted():
            raise BackendError("triton was imported without TRITON_INTERPRET=1 and there is no GPU; "
                               "set TRITON_INTERPRET=1 before starting, or use --backend torch")
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        from dcptool import triton_kernels
    except ImportError as e:  # pragma: no cover - triton is a Linux dependency
        raise BackendError(f"triton is not installed ({e}); use --backend torch") from None
    return triton_kernels


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
        k.dcp_local_seq_lens_kernel[grid](buf, seq, dcp_size, dcp_rank, cp_interleave, num_reqs, max_num_reqs,
                                          BLOCK_SIZE=BLOCK_SIZE)
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
        _triton().expected_rows_kernel[(n,)](out, _as(seq_lens, torch.int32, dev), _as(offsets, torch.int64, dev),
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
    if dcp_size < 1 or cp_interleave < 1 or page_size < 1 or dcp_size * cp_interleave > INT32_MAX \
            or page_size > INT32_MAX:
        # the fused kernels compute in int32 (ranks < N, so rank * I < N * I): the reader's bounds
        raise ValueError(f"need 1 <= dcp_size * cp_interleave <= 2**31-1 and 1 <= page_size <= 2**31-1, got "
                         f"{dcp_size}, {cp_interleave}, {page_size}")
    n = num_reqs.shape[0]
    stats = torch.zeros(6, n, dtype=torch.int32, device=dev)
    stats[1::2] = -1
    if n == 0:
        return RowStats(*stats)
    k = _triton()
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
        k.check_rows_kernel[(ids.numel(),)](sub, ids, ids.numel(), *args, **const, BLOCK=FUSED_BLOCK)
        stats[:, ids] = sub.view(6, -1)
    return RowStats(*stats)


# --------------------------------------------------------------------------------------------
# The Recorder's device snapshot (dcptool.record): one launch copies an observation's device tensors

SNAP_FIXED = 8  # int32 words of a ring slot's fixed header (layout: dcptool.record, "Ring slots")
SNAP_ENTRY = 4  # int32 words per section entry in the header (address: 2, count, mode)
SNAP_HEAD_READ = 64  # int32 words the kernel reads at once: the fixed header and up to 14 section entries
SNAP_MAX_SECTIONS = (SNAP_HEAD_READ - SNAP_FIXED) // SNAP_ENTRY
SNAP_BLOCK = 512
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
    return _triton().snapshot_kernel


def snapshot_dispatch(raw_stream: int, slot: int):
    """One snapshot launch through Triton's dispatch (on the current stream: raw_stream is that stream);
    returns the compiled kernel, whose launcher record.py then calls directly."""
    return _triton().snapshot_kernel[(1,)](slot, num_warps=SNAP_WARPS)


def snapshot_args_kernel():
    """The snapshot kernel for the engine's common case: sections 0-2 of the slot (seq_lens,
    dcp_local_seq_lens, query_start_loc) contiguous int32 device tensors or absent, the rest absent. The
    header comes as twelve arguments (slot, seqno, num_reqs, num_reqs_padded, K | negative-value flags << 16,
    words, then address and count of each of the three) and the kernel writes it into the slot itself: the
    same slot as snapshot_kernel's, without the GPU's read of the header from host memory before the copy
    and without the CPU's write of it."""
    return _triton().snapshot_args_kernel


def snapshot_args_dispatch(raw_stream: int, *args):
    """One launch of snapshot_args_kernel through Triton's dispatch (on the current stream); returns the
    compiled kernel."""
    k = _triton()
    if interpreted() and 0 in args[6::2]:
        # the interpreter types a 0 argument int32 whatever the annotation and cannot make it a pointer (an
        # empty tensor's address is 0): any readable address, none of it is read (count 0 or -1)
        args = (*args[:6], *(a or args[0] if i % 2 == 0 else a for i, a in enumerate(args[6:])))
    return k.snapshot_args_kernel[(1,)](*args, num_warps=SNAP_WARPS)
