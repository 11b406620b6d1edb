"""vLLM's DCP-local-lengths kernel, launched as vLLM launches it (the Triton kernel is in kernel_tl.py; triton is
imported only on first use, through backend.load)."""

from __future__ import annotations

import torch

from dcptool.dcp.backend import load

BLOCK_SIZE = 128  # vLLM's launch: BLOCK_SIZE 128, grid cdiv(max_num_reqs, 128)
INT32_MAX = 2**31 - 1


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
    k = load("dcptool.dcp.kernel_tl")
    seq = seq_lens.to(torch.int32).contiguous()
    grid = (k.triton.cdiv(max_num_reqs, BLOCK_SIZE),)
    if max_num_reqs:
        k.dcp_local_seq_lens_kernel[grid](buf, seq, dcp_size, dcp_rank, cp_interleave, num_reqs, max_num_reqs,
                                          BLOCK_SIZE=BLOCK_SIZE)
    return buf[:num_reqs_padded]
