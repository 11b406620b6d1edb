"""kernels_tl.py: both snapshot kernels launched directly, without kernels.py's wrappers (any warp count), under the
interpreter on the CPU or on the GPU: the slot a hand-built header describes, and the same slot from the fast path's
arguments; nothing past the slot written."""

import os

import numpy as np
import pytest
import torch

from dcptool.dcp.backend import load
from dcptool.engine.snapshot.layout import ABSENT, ARGS_NEG, ENTRY, FIXED, HEAD_READ, SECTIONS, head_struct

pytestmark = pytest.mark.kernel
POISON = -7  # what the ring holds before the launch


@pytest.fixture(scope="module")
def tl():
    return load("dcptool.engine.snapshot.kernels_tl")


def _device() -> str:
    # raw addresses: host memory under the interpreter, device memory on a GPU
    return "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


@pytest.mark.parametrize("warps", [1, 4])
@pytest.mark.parametrize("n", [1, 5, 600])  # 600: two programs of the args kernel
def test_both_kernels_write_the_slot_their_header_describes(tl, n, warps):
    """seq_lens (negatives flagged), an unaligned DCP view holding a negative (allowed there) and query_start_loc,
    the other sections absent: the descriptor kernel copies what the header written before the launch names, the
    args kernel writes that header itself; both leave the same slot, `done` = seqno and flags 0."""
    dev = _device()
    g = torch.Generator().manual_seed(n * 10 + warps)
    seq = torch.randint(0, 1 << 30, (n,), generator=g, dtype=torch.int32).to(dev)
    dcp = torch.randint(-5, 1 << 20, (n + 1,), generator=g, dtype=torch.int32).to(dev)[1:]  # unaligned
    qsl = torch.arange(n + 1, dtype=torch.int32, device=dev)
    k = len(SECTIONS)
    words = (FIXED + ENTRY * k + 3 * n + 1 + 7) & ~7
    want = np.full(words + HEAD_READ + 16, POISON, np.int32)
    head = (seq.data_ptr(), n, 2, dcp.data_ptr(), n, 0, qsl.data_ptr(), n + 1, 0, *(ABSENT * (k - 3)))
    head_struct(k).pack_into(want, 0, 41, -1, n, n, k, 0, words, 0, *head)
    before = torch.from_numpy(want.copy()).to(dev)
    want[1] = 41  # done: the seqno, written last
    p = FIXED + ENTRY * k
    want[p:p + 3 * n + 1] = np.concatenate([t.cpu().numpy() for t in (seq, dcp, qsl)])

    ring = before.clone()
    tl.snapshot_kernel[(1,)](ring.data_ptr(), num_warps=warps)
    assert np.array_equal(ring.cpu().numpy(), want)

    ring = torch.full_like(before, POISON)
    grid = (3 * n + 1 + 1023) // 1024  # (several programs: the CPU zeroes the flags word first)
    if grid > 1:
        ring[5] = 0
    tl.snapshot_args_kernel[(grid,)](ring.data_ptr(), 41, n, n, k << 16 | ARGS_NEG, words, seq.data_ptr(), n,
                                     dcp.data_ptr(), n, qsl.data_ptr(), n + 1, *(ring.data_ptr(), -1) * 5,
                                     num_warps=warps)
    assert np.array_equal(ring.cpu().numpy(), want)
