"""dcp/kernel_tl.py: vLLM's per-batch Triton kernel launched directly (no launcher: any block size, a grid one
program too many), under the interpreter on the CPU or on the GPU, against dcptool.dcp.reference: rows below
num_reqs hold the formula, the rest of the buffer 0, nothing at or past max_num_reqs written."""

import numpy as np
import pytest
import torch

from dcptool.dcp import reference
from dcptool.dcp.backend import device, load

pytestmark = pytest.mark.kernel
SIZES = [0, 1, 127, 128, 129, 1000]
INT32_MAX = 2**31 - 1
POISON = -7  # what the buffer holds before the launch: every row the kernel owes must be written


@pytest.fixture(scope="module")
def tl():
    return load("dcptool.dcp.kernel_tl")


def launch(tl, seq: torch.Tensor, max_num_reqs: int, num_reqs: int, N: int, rank: int, I: int, block: int):
    """One launch over a buffer of max_num_reqs rows with 64 rows more after it: the whole allocation, poisoned."""
    dev = device()
    out = torch.full((max_num_reqs + 64,), POISON, dtype=torch.int32, device=dev)
    grid = (-(-max_num_reqs // block) + 1,)  # one program past the buffer: the store's mask must hold it back
    tl.dcp_local_seq_lens_kernel[grid](out, seq.to(dev), N, rank, I, num_reqs, max_num_reqs, BLOCK_SIZE=block)
    return out.cpu()


def want(seq: torch.Tensor, max_num_reqs: int, num_reqs: int, N: int, rank: int, I: int) -> torch.Tensor:
    ref = torch.full((max_num_reqs + 64,), POISON, dtype=torch.int32)
    reference.prepare_dcp_local_seq_lens(ref[:max_num_reqs], seq, num_reqs, N, rank, I)
    return ref


@pytest.mark.parametrize("block", [16, 128])
@pytest.mark.parametrize("max_num_reqs", SIZES)
@pytest.mark.parametrize("N,I", [(1, 1), (2, 1), (4, 16), (3, 3)])
def test_kernel_matches_the_reference_at_awkward_sizes(tl, max_num_reqs, N, I, block):
    rng = np.random.default_rng(max_num_reqs * 131 + N * 17 + I * 3 + block)
    seq = torch.from_numpy(rng.integers(0, 200_000, max_num_reqs, dtype=np.int32))
    for num_reqs in sorted({0, max_num_reqs // 2, max_num_reqs}):
        for rank in sorted({0, N - 1, int(rng.integers(0, N))}):  # 1 may reach Triton as a constexpr: ranks 0..N-1
            got = launch(tl, seq, max_num_reqs, num_reqs, N, rank, I, block)
            assert torch.equal(got, want(seq, max_num_reqs, num_reqs, N, rank, I)), (num_reqs, rank)


@pytest.mark.parametrize("N,I", [(4096, 1 << 20), (3, INT32_MAX // 2), (2, INT32_MAX)])
def test_int32_products_of_the_arguments_do_not_overflow(tl, N, I):
    """dcp_size * cp_interleave and dcp_rank * cp_interleave past 2**31 (the kernel widens them to int64), with
    seq_lens up to INT32_MAX."""
    rng = np.random.default_rng(N)
    edges = [min(x, INT32_MAX) for x in (0, 1, I - 1, I, I + 1, INT32_MAX - 1, INT32_MAX)]
    seq = torch.tensor(edges + rng.integers(0, INT32_MAX, 129 - len(edges)).tolist(), dtype=torch.int32)
    for rank in (0, 1, N - 1):
        got = launch(tl, seq, 129, 129, N, rank, I, 128)
        assert torch.equal(got, want(seq, 129, 129, N, rank, I)), rank
    assert torch.equal(got[:2], torch.tensor([0, 0], dtype=torch.int32))  # the last rank: the round's tail only
