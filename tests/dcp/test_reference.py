"""The torch formula against docs/dcp.md's examples, its properties, and a brute-force owner count."""

import numpy as np
import pytest
import torch

from dcptool.dcp.reference import (
    dcp_local_seq_lens,
    dcp_local_seq_lens_all_ranks,
    expected_rows,
    local_np,
    local_of,
    prepare_dcp_local_seq_lens,
)


def brute(L: int, N: int, r: int, I: int) -> int:
    """Number of positions p in [0, L) owned by rank r: owner(p) = (p // I) % N."""
    return sum(1 for p in range(L) if (p // I) % N == r)


@pytest.mark.parametrize("N", range(1, 9))
@pytest.mark.parametrize("I", [1, 2, 3, 16, 64])
def test_formula_matches_brute_force_owner_count(N, I):
    L = torch.arange(0, 601)
    allr = dcp_local_seq_lens_all_ranks(L, N, I)
    # brute force by counting owners of every position once per (N, I): cumulative counts per rank
    owner = (torch.arange(600) // I) % N
    counts = torch.zeros(601, N, dtype=torch.int64)
    for r in range(N):
        counts[1:, r] = torch.cumsum(owner == r, 0)
    assert torch.equal(allr.to(torch.int64), counts)
    for Lx in (0, 1, 7, 127, 128, 129, 599):
        for r in range(N):
            assert int(allr[Lx, r]) == brute(Lx, N, r, I)


@pytest.mark.parametrize("N,I", [(2, 1), (4, 16), (8, 64), (3, 3), (1, 1)])
def test_properties_sum_and_monotone(N, I, rng):
    L = torch.from_numpy(rng.integers(0, 100_000, 5000))
    allr = dcp_local_seq_lens_all_ranks(L, N, I).to(torch.int64)
    assert torch.equal(allr.sum(1), L)
    assert bool((allr[:, :-1] >= allr[:, 1:]).all())
    base = (L // (N * I)) * I
    assert bool((allr >= base[:, None]).all()) and bool((allr <= (base + I)[:, None]).all())


def test_design_examples():
    # empty shard: N=2, I=16, L=7 -> [7, 0]
    assert dcp_local_seq_lens_all_ranks(torch.tensor([7]), 2, 16).tolist() == [[7, 0]]
    # PCP example: local seq_lens [17, 25], N=2, I=1, rank 0 -> [9, 13]; padded to 4 rows
    buf = torch.full((4,), -1, dtype=torch.int32)
    view = prepare_dcp_local_seq_lens(buf, torch.tensor([17, 25, 0, 0]), 2, 2, 0, 1, num_reqs_padded=4)
    assert view.tolist() == [9, 13, 0, 0]
    # worked micro-batch example: [64, 96, 507] -> [32,48,254] on rank 0, [32,48,253] on rank 1
    s = torch.tensor([64, 96, 507])
    assert dcp_local_seq_lens(s, 2, 0, 1).tolist() == [32, 48, 254]
    assert dcp_local_seq_lens(s, 2, 1, 1).tolist() == [32, 48, 253]
    assert dcp_local_seq_lens(torch.tensor([512]), 2, 0, 1).tolist() == [256]


def test_prepare_zeroes_the_whole_buffer_and_returns_a_view():
    buf = torch.full((10,), 77, dtype=torch.int32)
    v = prepare_dcp_local_seq_lens(buf, torch.tensor([5, 6, 7, 8, 9]), 3, 2, 1, 1, num_reqs_padded=5)
    assert v.data_ptr() == buf.data_ptr() and v.shape == (5,)
    assert buf.tolist() == [2, 3, 3, 0, 0, 0, 0, 0, 0, 0]
    assert prepare_dcp_local_seq_lens(buf, torch.tensor([5]), 1, 2, 0).shape == (10,)  # None -> whole buffer


def test_no_overflow_near_int32_max():
    L = torch.tensor([2**31 - 1], dtype=torch.int32)
    assert int(dcp_local_seq_lens_all_ranks(L, 8, 1024).to(torch.int64).sum()) == 2**31 - 1


def test_bad_parameters_raise():
    with pytest.raises(ValueError):
        dcp_local_seq_lens(torch.tensor([1]), 0, 0, 1)
    with pytest.raises(ValueError):
        dcp_local_seq_lens(torch.tensor([1]), 2, 0, 0)


def test_expected_rows_layout():
    seq = torch.tensor([17, 25, 3, 100, 1, 2, 3], dtype=torch.int32)
    offs = torch.tensor([0, 3, 3, 7])
    out = expected_rows(seq, offs, torch.tensor([2, 0, 3]), torch.tensor([0, 1, 1]), 2, 1)
    assert out.tolist() == [9, 13, 0, 50, 0, 1, 0]


def test_local_np_matches_reference():
    L = np.arange(0, 3000)
    for N, I in ((2, 1), (4, 16), (3, 5)):
        for r in range(N):
            assert np.array_equal(local_np(L, N, r, I), dcp_local_seq_lens(torch.from_numpy(L), N, r, I).numpy())


def test_local_of_python_ints_match_the_arrays():
    """One value (a finding's row) stays in Python ints and agrees with the numpy form."""
    L = np.arange(0, 300)
    for N, I in ((2, 1), (4, 16), (3, 5)):
        for r in range(N):
            got = [local_of(int(x), r, N, I) for x in L]
            assert all(type(v) is int for v in got) and got == local_np(L, N, r, I).tolist()


class _NoDivide(np.ndarray):
    """An array that refuses // (so a test sees which path rounds_rem took)."""

    def __floordiv__(self, other):
        raise AssertionError("division path taken")


@pytest.mark.parametrize("span_of", [int, np.int64, lambda x: np.asarray(x, np.int64)],
                         ids=["int", "numpy-scalar", "0-d-array"])
@pytest.mark.parametrize("N,I", [(1, 1), (4, 16), (8, 1), (2, 64)])
def test_rounds_rem_shifts_for_a_power_of_two_span_whatever_its_type(span_of, N, I):
    """local_np hands the interleave over as a 0-d int64 array: that too is a shift and a mask (it was a
    division on int64), with floor semantics on negative lengths."""
    from dcptool.dcp.reference import rounds_rem

    L = np.array([-129, -1, 0, 1, 63, 64, 65, 1000, 2**31 - 1], np.int64)
    rounds, rem = rounds_rem(L.view(_NoDivide), N, span_of(I))
    assert np.array_equal(rounds, L // (N * I)) and np.array_equal(rem, L % (N * I))
