"""kernel.py: vLLM's prepare_dcp_local_seq_lens kernel == the torch reference on seeded random inputs and past int32
(interpreter on CPU, real on CUDA)."""

import numpy as np
import pytest
import torch
from conftest import EXTREME_SEQ, I32

from dcptool.dcp import kernel, reference

pytestmark = pytest.mark.kernel
SIZES = [0, 1, 127, 128, 129, 1000, 1537]


@pytest.mark.parametrize("max_num_reqs", SIZES)
@pytest.mark.parametrize("N,I", [(2, 1), (4, 16), (8, 64), (3, 3)])
def test_vllm_shaped_kernel_matches_reference(dev, max_num_reqs, N, I):
    g = torch.Generator().manual_seed(max_num_reqs * 31 + N * 7 + I)
    seq = torch.randint(0, 200_000, (max_num_reqs,), generator=g, dtype=torch.int32)
    for num_reqs in sorted({0, max_num_reqs // 2, max_num_reqs}):
        rank = int(torch.randint(0, N, (1,), generator=g))
        nrp = min(max_num_reqs, num_reqs + 3)
        buf = torch.full((max_num_reqs,), -7, dtype=torch.int32, device=dev)  # poisoned: every row must be written
        ref = torch.full((max_num_reqs,), -7, dtype=torch.int32)
        out = kernel.prepare_dcp_local_seq_lens(buf, seq.to(dev), num_reqs, N, rank, I, num_reqs_padded=nrp)
        want = reference.prepare_dcp_local_seq_lens(ref, seq, num_reqs, N, rank, I, num_reqs_padded=nrp)
        assert out.data_ptr() == buf.data_ptr() and out.shape == (nrp,)
        assert torch.equal(buf.cpu(), ref), (num_reqs, rank)
        assert torch.equal(out.cpu(), want)


def test_vllm_kernel_validates(dev):
    buf = torch.zeros(4, dtype=torch.int32, device=dev)
    with pytest.raises(ValueError):
        kernel.prepare_dcp_local_seq_lens(buf, torch.zeros(8, dtype=torch.int32, device=dev), 5, 2, 0, 1)
    with pytest.raises(ValueError):
        kernel.prepare_dcp_local_seq_lens(buf, torch.zeros(4, dtype=torch.int32, device=dev), 2, 2, 2, 1)
    with pytest.raises(ValueError):
        kernel.prepare_dcp_local_seq_lens(buf.long(), torch.zeros(4, dtype=torch.int32, device=dev), 2, 2, 0, 1)


@pytest.mark.parametrize("N,I,rank", [(2, 2**30, 1), (I32, 1, I32 - 1), (65536, 65536, 65535), (3, 2**30, 2)])
def test_vllm_kernel_products_past_int32(dev, N, I, rank):
    """The vLLM-shaped kernel takes N, I and the rank as arguments: N*I and rank*I may pass 2**31."""
    seq = torch.tensor(EXTREME_SEQ, dtype=torch.int32)
    buf = torch.full((len(EXTREME_SEQ) + 2,), -7, dtype=torch.int32, device=dev)
    out = kernel.prepare_dcp_local_seq_lens(buf, seq.to(dev), seq.numel(), N, rank, I)
    want = np.array([int(x) for x in EXTREME_SEQ], dtype=object)
    rounds, rem = want // (N * I), want % (N * I)
    want = [int(r * I + min(max(m - rank * I, 0), I)) for r, m in zip(rounds, rem)]
    assert out.cpu().tolist()[: seq.numel()] == want and buf.cpu().tolist()[seq.numel():] == [0, 0]
