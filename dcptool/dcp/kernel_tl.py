"""Triton: `local_of`, the formula (docs/dcp.md) every kernel uses, and vLLM's per-batch kernel. Imported only through
dcp.backend.load (TRITON_INTERPRET must be set before triton is imported)."""

import triton
import triton.language as tl


@triton.jit
def local_of(seq, rank, span, cp_interleave):
    # reference.local_of in Triton (the one body of the formula; tests hold the two equal)
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
    local = local_of(seq, wide + dcp_rank, (wide + dcp_size) * cp_interleave, cp_interleave)
    local = tl.where(real, local, 0).to(tl.int32)
    tl.store(out_ptr + block, local, mask=block < max_num_reqs)
