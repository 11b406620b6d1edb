"""The fused whole-dump kernels' launch shape and limits, shared by their torch launchers (fused.py) and the
cuda-core scan (gpu.scan_cuda): nothing here imports torch, which a fresh GPU replay never loads."""

from __future__ import annotations

TL = "dcptool.dcp.fused_tl"
FUSED_BLOCK = 256  # rows per inner step of the fused whole-dump kernels (observations hold ~64-512 rows)
FUSED_WARPS = 2  # their flag pass's warps
CHECK_WARPS = 4  # the exact pass's on the flagged few (Triton's default)


def fused_limits(dcp_size: int, cp_interleave: int, page_size: int) -> None:
    """Refuse a layout the fused kernels cannot check: they compute in int32 (ranks < N, so rank * I < N * I),
    the reader's bounds."""
    if dcp_size < 1 or cp_interleave < 1 or page_size < 1 or dcp_size * cp_interleave > 2**31 - 1 \
            or page_size > 2**31 - 1:
        raise ValueError(f"need 1 <= dcp_size * cp_interleave <= 2**31-1 and 1 <= page_size <= 2**31-1, got "
                         f"{dcp_size}, {cp_interleave}, {page_size}")
