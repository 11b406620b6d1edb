"""segments.member: exact membership of key tuples, on every path (table, binary search, general join)."""

import numpy as np
import pytest

from dcptool.dcp import segments
from dcptool.dcp.segments import member


def _naive(c_key, q_key):
    q = set(zip(*(k.tolist() for k in q_key)))
    return np.array([t in q for t in zip(*(k.tolist() for k in c_key))], bool)


@pytest.mark.parametrize("nc,nq", [(0, 5), (5, 0), (1, 1), (127, 3), (128, 128), (129, 1), (1000, 37), (5000, 4000)])
@pytest.mark.parametrize("spread", [4, 1000, 10**9, 2**40], ids=["table", "mid", "search", "wide"])
@pytest.mark.parametrize("seed", range(3))
def test_member_agrees_with_a_set(nc, nq, spread, seed):
    rng = np.random.default_rng(seed)
    cols = 3
    c_key = [rng.integers(-spread, spread, nc) for _ in range(cols)]
    q_key = [rng.integers(-spread, spread, nq) for _ in range(cols)]
    if nc and nq:  # some true hits on every path
        k = rng.integers(0, nc, min(nc, nq))
        for qc, cc in zip(q_key, c_key):
            qc[: k.size] = cc[k]
    got = member(c_key, q_key)
    assert got.dtype == bool and got.shape == (nc,)
    assert (got == _naive(c_key, q_key)).all()


def test_member_never_confuses_tuples_that_a_packing_would():
    """(rank 1, step 0) and (rank 0, step 2**48): one integer under `rank * 2**48 + step`, two keys here."""
    c = [np.array([0, 1, 1]), np.array([2**48, 0, 5])]
    q = [np.array([1]), np.array([0])]
    assert member(c, q).tolist() == [False, True, False]


def test_member_falls_back_to_the_join_past_int64(monkeypatch):
    """Ranges whose product passes 2**62 cannot be packed: the general join answers, exactly."""
    calls = []
    real = segments.join
    monkeypatch.setattr(segments, "join", lambda a, b: calls.append(1) or real(a, b))
    big = np.array([-(2**62), 2**62, 7], np.int64)
    c = [big, np.array([1, 2, 3])]
    q = [np.array([7, 2**62]), np.array([3, 1])]
    assert member(c, q).tolist() == [False, False, True]
    assert calls == [1]


def test_member_uses_a_table_for_a_small_range(monkeypatch):
    """Small packed range: no np.unique of the queries (the table path)."""
    monkeypatch.setattr(np, "unique", lambda *a, **k: pytest.fail("binary-search path taken"))
    assert member([np.array([3, 4, 5])], [np.array([4])]).tolist() == [False, True, False]


@pytest.mark.parametrize("seed", range(3))
def test_member_cuts_candidates_by_a_selective_column_first(monkeypatch, seed):
    """Provenance's shape, a few queries among many candidates: (rank, step, a wide value). The step column's
    table leaves only the queried steps' candidates to pack and search; the rank column, whose values the
    queries nearly all hold, is not used to cut. Exact either way."""
    rng = np.random.default_rng(seed)
    n = 20_000
    i = np.arange(n)
    c = [i % 4, i // 4, rng.integers(0, 10**12, n)]
    k = rng.choice(n, 6, replace=False)
    q = [np.r_[c[0][k], 0, 3], np.r_[c[1][k], 17, 4000], np.r_[c[2][k], 5, c[2][3]]]  # (the last: other step)
    searched = []
    real = np.searchsorted
    monkeypatch.setattr(np, "searchsorted", lambda a, v, *r, **kw: searched.append(np.size(v)) or real(a, v, *r, **kw))
    got = member(c, q)
    assert (got == _naive(c, q)).all() and got.sum() == 6
    assert searched and max(searched) <= 4 * 8  # the queried steps' 4 ranks, not 20,000


def test_member_pre_cut_that_leaves_nothing():
    c = [np.arange(10_000) // 4, np.arange(10_000) * 10**8]
    q = [np.array([2600]), np.array([3])]  # a step no candidate has (within the table's range)
    assert not member(c, q).any()


def _splitmix(v: int, j: int, salt: int) -> int:
    """mix's definition, one value at a time in Python integers (mod 2**64)."""
    if v == 0:
        return 0
    a, b, c = segments._MIX[salt]
    m = (1 << 64) - 1
    x = ((v & m) * a + (j & m) * b + c) & m
    x = ((x ^ (x >> 30)) * b) & m
    x = ((x ^ (x >> 27)) * c) & m
    return x ^ (x >> 31)


@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 1000])
@pytest.mark.parametrize("salt", [0, 1])
def test_mix_in_blocks_is_splitmix_per_element(monkeypatch, n, salt):
    """Blocks of 128 elements (so 129 and 1000 cross block edges): every element as the scalar definition,
    zeros 0, negative values and int32 input as their int64 bit pattern."""
    monkeypatch.setattr(segments, "MIX_BLOCK", 128)
    rng = np.random.default_rng(n + salt)
    v = rng.integers(-(2**31), 2**31, n).astype(np.int32)
    v[::5] = 0
    j = rng.integers(0, 2**40, n)
    got = segments.mix(v, j, salt)
    assert got.dtype == np.uint64
    assert got.tolist() == [_splitmix(int(a), int(b), salt) for a, b in zip(v, j)]


@pytest.mark.parametrize("seed", range(4))
def test_seg_sums_wraps_like_python_sums(seed):
    """Segments of 0, 1, 127, 128, 129 and 1000 elements in random order (empty ones first, last, in
    between): each sum as Python's mod 2**64."""
    rng = np.random.default_rng(seed)
    counts = rng.permutation(np.array([0, 0, 1, 127, 128, 129, 1000, 0, 3] * 3))
    h = rng.integers(0, 2**64, int(counts.sum()), dtype=np.uint64)
    got = segments.seg_sums(h, counts)
    starts = np.cumsum(counts) - counts
    assert got.dtype == np.uint64
    assert got.tolist() == [sum(h[s : s + c].tolist()) % 2**64 for s, c in zip(starts, counts)]
    assert segments.seg_sums(np.zeros(0, np.uint64), np.zeros(0, np.int64)).size == 0
    assert segments.seg_sums(np.zeros(0, np.uint64), np.zeros(3, np.int64)).tolist() == [0, 0, 0]


@pytest.mark.parametrize("step", [0, 1, 7, 100, 128, 129, 10**6])
@pytest.mark.parametrize("seed", range(3))
def test_obs_chunks_cover_every_segment_once_in_order(seed, step):
    """Chunks of whole segments (empty ones included), cut where the running count passes a multiple of `step`: none
    holds more than step elements plus its last segment's; a step of 0 counts as 1; no segments, no chunk."""
    rng = np.random.default_rng(seed)
    lens = rng.choice([0, 0, 1, 5, 127, 128, 129, 300], rng.integers(0, 200))
    chunks = segments.obs_chunks(lens, step)
    if lens.size == 0:
        assert chunks == []
        return
    assert chunks[0][0] == 0 and chunks[-1][1] == lens.size
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:])) and all(lo < hi for lo, hi in chunks)
    for lo, hi in chunks:
        assert lens[lo : hi - 1].sum() < max(step, 1)
    if step >= lens.sum() > 0:
        assert len(chunks) <= 2


@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 1000])
def test_first_per_segment_against_a_loop(n):
    """The first hit of each segment that has one, and every segment's hit count (none: 0), as a loop finds them."""
    rng = np.random.default_rng(n)
    counts = rng.integers(0, 5, n)
    seg, _, _ = segments.ragged(np.zeros(n, np.int64), counts)
    hits = np.flatnonzero(rng.random(seg.size) < 0.3)
    firsts, nhit = segments.first_per_segment(seg, hits, n)
    want_first, want_n = {}, np.zeros(n, np.int64)
    for h in hits.tolist():
        want_first.setdefault(int(seg[h]), h)
        want_n[seg[h]] += 1
    assert firsts.tolist() == list(want_first.values()) and nhit.tolist() == want_n.tolist()


@pytest.mark.parametrize("nc,nq", [(0, 0), (0, 5), (5, 0), (1, 1), (127, 3), (128, 128), (129, 1), (1000, 37),
                                   (5000, 4000)])
@pytest.mark.parametrize("spread", [3, 1000, 2**40], ids=["few-keys", "mid", "wide"])
@pytest.mark.parametrize("seed", range(3))
def test_key_index_lookups_agree_with_a_set(nc, nq, spread, seed):
    """Each lookup by a subset of the queries (every subset an index sees in one prepare: the whole, blocks,
    single ones, none) returns exactly the candidates whose key one of them has, ascending, each once."""
    rng = np.random.default_rng(seed)
    c_key = [rng.integers(-spread, spread, nc) for _ in range(3)]
    q_key = [rng.integers(-spread, spread, nq) for _ in range(3)]
    if nc and nq:
        k = rng.integers(0, nc, min(nc, nq))
        for qc, cc in zip(q_key, c_key):
            qc[: k.size] = cc[k]
    rows = np.sort(rng.choice(10 * nc + 1, nc, replace=False)).astype(np.int64)  # ids other than 0..n-1
    for given in (None, rows):
        index = segments.KeyIndex(c_key, q_key, given)
        ids = np.arange(nc) if given is None else rows
        subsets = [np.arange(nq), np.zeros(0, np.int64), *np.array_split(rng.permutation(nq), 5)]
        subsets += [np.array([i]) for i in rng.integers(0, nq, min(nq, 4))]
        for pos in subsets:
            want = ids[_naive(c_key, [k[pos] for k in q_key])]
            got = index.rows_of(pos)
            assert got.dtype == np.int64 and got.tolist() == want.tolist()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n,spread", [(0, 1), (1, 1), (50, 3), (1000, 10**3), (1000, 10**9), (200_000, 10**6)])
@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.int64])
def test_distinct_is_np_unique(seed, n, spread, dtype):
    """distinct (problems' distinct steps, ranks, sites and observations: counted where their range is small, else
    np.unique) is np.unique, in value, order and dtype, for ranges narrow and wide, negative values included."""
    rng = np.random.default_rng(seed)
    hi = min(spread, np.iinfo(dtype).max)
    x = rng.integers(-hi // 2, hi, n).astype(dtype)
    got, want = segments.distinct(x), np.unique(x)
    assert got.dtype == want.dtype and got.tolist() == want.tolist()
