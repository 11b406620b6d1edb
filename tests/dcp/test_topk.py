"""dcp/topk.py: the fingerprint, the owned counts and the row state, numpy against torch (the engine's form) on seeded
random sets of awkward sizes; simulate's model indexer against its explicit ids; the rule's reference."""

import numpy as np
import pytest
import torch

from dcptool.dcp import topk as K
from dcptool.dcp.reference import local_np

SIZES = [0, 1, 127, 128, 129, 1000, 2048]


def _sets(rng, T: int, k: int, n: int) -> np.ndarray:
    """[T, k] distinct global ids in [0, n) per row, some rows -1 padded at random places (the indexer's buffer)."""
    ids = np.argsort(rng.random((T, max(n, k))), axis=1)[:, :k].astype(np.int64)
    ids[ids >= n] = -1
    pad = rng.random((T, k)) < rng.random((T, 1)) * 0.5
    ids[pad] = -1
    return ids


@pytest.mark.parametrize("T", SIZES)
@pytest.mark.parametrize("k", [1, 64, 2048])
def test_numpy_and_torch_agree_and_the_fingerprint_is_order_free(T, k):
    rng = np.random.default_rng(T * 31 + k)
    ids = _sets(rng, T, k, 5000)
    fp = K.fingerprint(ids)
    assert fp.shape == (T,) and ((0 <= fp) & (fp <= K.MASK31)).all()
    assert np.array_equal(K.fingerprint(torch.from_numpy(ids)).numpy(), fp)
    shuffled = np.take_along_axis(ids, np.argsort(rng.random((T, k)), axis=1), axis=1)
    assert np.array_equal(K.fingerprint(shuffled), fp)
    few = ids[:40]  # (the plain count on a few rows; numpy and torch on all)
    for N, I_ in ((1, 1), (4, 1), (4, 16), (3, 7)):
        for r in range(N):
            want = np.array([sum(1 for x in row if x >= 0 and (x // I_) % N == r) for row in few.tolist()], np.int64)
            got = K.owned(ids, r, N, I_)
            assert np.array_equal(got[:40], want)
            assert np.array_equal(K.owned(torch.from_numpy(ids), r, N, I_).numpy(), got)


def test_a_set_differing_in_one_entry_changes_the_fingerprint():
    """One tied entry swapped for another (the tie broken another way), one entry dropped: another fingerprint."""
    rng = np.random.default_rng(5)
    ids = rng.choice(1 << 20, 2048, replace=False)[None, :].repeat(1000, 0).astype(np.int64)
    swapped = ids.copy()
    swapped[np.arange(1000), rng.integers(0, 2048, 1000)] = (1 << 20) + np.arange(1000)
    dropped = ids.copy()
    dropped[:, 0] = -1
    fp = K.fingerprint(ids)
    assert (K.fingerprint(swapped) != fp).all() and (K.fingerprint(dropped) != fp).all()


@pytest.mark.parametrize("T", SIZES)
def test_row_state_numpy_and_torch(T):
    """Rows with no entry (output 0, LSE -inf), attended rows, NaN outputs (0 x NaN), +inf and NaN LSEs."""
    rng = np.random.default_rng(T)
    out = rng.standard_normal((T, 4, 8)).astype(np.float32)
    lse = rng.standard_normal((T, 4)).astype(np.float32)
    kind = rng.integers(0, 5, T)
    out[kind == 1] = 0
    lse[kind == 1] = -np.inf
    out[kind == 2, 1, 3] = np.nan
    lse[kind == 2] = -np.inf
    lse[kind == 3, 2] = np.inf
    lse[kind == 4, 0] = np.nan
    want = np.select([kind == 0, kind == 1, kind == 2, kind == 3, kind == 4],
                     [0, K.EMPTY_STATE, K.LSE_NEG_INF | K.NON_FINITE, K.NON_FINITE, K.NON_FINITE])
    assert np.array_equal(K.row_state(out, lse), want)
    assert np.array_equal(K.row_state(torch.from_numpy(out), torch.from_numpy(lse)).numpy(), want)
    if T:
        half = lse.copy()
        half[0, :2] = -np.inf  # some heads -inf, not all: not LSE_NEG_INF
        half[0, 2:] = 1.0
        assert K.row_state(np.ones_like(out[:1]), half[:1])[0] == 0


@pytest.mark.parametrize("lowest", [True, False])
def test_the_model_indexer_is_its_ids(lowest):
    """model_bounds' intervals as ids: k entries (or L where L <= k), distinct, within [0, L); the two tie-breaks
    agree exactly where L <= k; the prefix sums give the ids' fingerprint and local_np the owned counts."""
    L = np.r_[0, 1, 2, 127, 128, 129, 1000, 2047, 2048, 2049, 2100, 2303, 2304, 2305, 5000,
              np.random.default_rng(1).integers(1, 60000, 300)]
    b = K.model_bounds(L, lowest)
    ids = K.model_ids(b)
    n = (ids >= 0).sum(1)
    assert np.array_equal(n, np.minimum(L, K.TOPK))
    assert all(len(set(r[r >= 0].tolist())) == c and (r[r >= 0] < x).all() for r, c, x in zip(ids, n, L))
    P = K.Prefix(int(L.max()) + 1)
    assert np.array_equal(P.fingerprint(b), K.fingerprint(ids))
    other = K.fingerprint(K.model_ids(K.model_bounds(L, not lowest)))
    assert np.array_equal(other == K.fingerprint(ids), L <= K.TOPK)
    ranks = np.arange(4).reshape(-1, 1)
    for N, I_ in ((4, 1), (4, 16), (2, 64)):
        got = K.model_owned(b, ranks[:N], N, I_)
        assert np.array_equal(got, np.stack([K.owned(ids, r, N, I_) for r in range(N)]))
        assert (got.sum(0) == n).all()
    assert np.array_equal(K.model_owned(K.model_bounds(L[:6]), 0, 1, 1), local_np(L[:6], 1, 0, 1))


def _problem(o: int, s: int) -> str:
    if s & ~7:
        return "state"
    if o == 0:
        return "" if s == 3 else "empty"
    return "lse" if s & 5 else ""


def test_state_problem_is_the_plain_rule():
    rng = np.random.default_rng(9)
    owned, state = rng.integers(0, 3, 5000), rng.integers(0, 10, 5000)
    assert K.state_problem(owned, state).tolist() == [_problem(o, s) for o, s in zip(owned.tolist(), state.tolist())]


@pytest.mark.cuda
def test_on_the_gpu_the_fields_are_the_cpu_ones():
    """What an engine computes on the device (torch on CUDA tensors) is what the numpy reference computes."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (to verify on the H200)")
    rng = np.random.default_rng(3)
    ids = _sets(rng, 4096, 2048, 1 << 17)
    dev = torch.from_numpy(ids).cuda()
    assert np.array_equal(K.fingerprint(dev).cpu().numpy(), K.fingerprint(ids))
    assert np.array_equal(K.owned(dev, 3, 8, 16).cpu().numpy(), K.owned(ids, 3, 8, 16))
    out = torch.zeros(4096, 16, 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.full((4096, 16), float("-inf"), device="cuda")
    out[1::2] = 1
    lse[1::2] = 0.5
    assert K.row_state(out, lse).cpu().tolist() == [K.EMPTY_STATE, 0] * 2048
