"""view_rows: the exact row comparisons provenance confirms its hash hits with, against a per-pair numpy reference
on seeded random dumps (views of 0 to 130 rows, copies of other observations' rows among them)."""

import numpy as np
import pytest
from test_provenance import _coincidental_dump, _expected

from dcptool.check.view_rows import parent_rows, zero_ext_equal


def _pairs(d, rng, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """k random (q, s) pairs, half of them q paired with an observation whose expected rows it may copy, and m:
    q's recorded rows, at most its num_reqs."""
    n = d.n
    q = rng.integers(0, n, k)
    s = np.where(rng.random(k) < 0.5, rng.integers(0, n, k), np.maximum(q - 1, 0))
    m = np.minimum(np.diff(d["obs.dcp_rows"])[q], d["obs.num_reqs"][q].astype(np.int64))
    return q, s, m


def _rec(d, i: int, m: int, rows: int) -> np.ndarray:
    out = np.zeros(rows, np.int64)
    out[:min(m, rows)] = d.dcp_of(i)[: min(m, rows)]
    return out


@pytest.mark.parametrize(("seed", "max_rows"), [(0, 0), (1, 1), (2, 4), (3, 127), (4, 128), (5, 129)])
def test_zero_ext_equal_against_the_per_pair_reference(tmp_path, seed, max_rows):
    d = _coincidental_dump(tmp_path / "d.safetensors", seed, max_rows)
    rng = np.random.default_rng(seed)
    q, s, m = _pairs(d, rng, 300)
    L = m + rng.integers(0, 4, q.size) * (rng.random(q.size) < 0.5)  # past m: zeros on the recorded side
    rank = d["obs.rank"]
    got = zero_ext_equal(d, q, m, s, L)
    want = [np.array_equal(_rec(d, a, b, c), _expected(d, t, int(rank[t]), c)) for a, t, b, c in zip(q, s, m, L)]
    assert got.tolist() == want
    assert zero_ext_equal(d, q[:0], m[:0], s[:0], L[:0]).size == 0


@pytest.mark.parametrize(("seed", "max_rows"), [(0, 1), (1, 4), (2, 127), (3, 129)])
def test_parent_rows_against_the_per_pair_reference(tmp_path, seed, max_rows):
    d = _coincidental_dump(tmp_path / "d.safetensors", seed, max_rows)
    rng = np.random.default_rng(seed)
    q, p, m = _pairs(d, rng, 300)
    rs = rng.integers(0, 3, q.size)
    rank = d["obs.rank"]
    got = parent_rows(d, q, m, p, rs)
    want = []
    for a, t, b, r in zip(q, p, m, rs):
        rec = _rec(d, a, b, b)
        pv = d.dcp_of(t)
        copy = pv is not None and pv.size - r >= b and np.array_equal(pv[r : r + b], rec)
        want.append(np.array_equal(_expected(d, t, int(rank[t]), r + b)[r:], rec) or bool(copy))
    assert got.tolist() == want
    assert any(want) and not all(want)  # both outcomes are exercised
