"""Ragged segments (observation i's rows are [start_i, start_i + count_i)) and the keyed grouping every
columnar rule uses: row hashes summed per segment, dense ids of key tuples."""

from __future__ import annotations

import numpy as np


def ragged(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Segments (start, count) -> (segment of each element, index within it, absolute index)."""
    counts = np.asarray(counts, np.int64)
    seg = np.repeat(np.arange(counts.size), counts)
    j = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return seg, j, np.asarray(starts, np.int64)[seg] + j


def first_per_segment(seg: np.ndarray, hits: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """hits: ascending element indices (into seg, itself ascending) -> (the first hit of each segment that has one,
    the number of hits of each of the n segments)."""
    s = seg[hits]
    return hits[np.r_[True, s[1:] != s[:-1]]] if hits.size else hits, np.bincount(s, minlength=n)


BULK_ROWS = 1 << 20  # rows a vectorised check takes at a time: its temporaries (up to ~130 bytes a row) stay in ~130 MB


def obs_chunks(lens: np.ndarray, step: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of consecutive segments (observations, whole) holding about `step` elements each (one may
    hold more), covering every segment once, in order."""
    if lens.size == 0:
        return []
    step = max(int(step), 1)
    cs = np.cumsum(lens)
    cuts = np.searchsorted(cs, np.arange(step, int(cs[-1]) + step, step), "left") + 1
    edges = np.unique(np.concatenate([[0], np.minimum(cuts, lens.size), [lens.size]]))
    return list(zip(edges[:-1].tolist(), edges[1:].tolist()))


_MIX = ((0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB),
        (0xD6E8FEB86659FD93, 0xA0761D6478BD642F, 0xE7037ED1A0B428DB))


MIX_BLOCK = 1 << 18  # elements hashed at a time: the passes' temporaries stay in cache and are reused


def mix(v: np.ndarray, j: np.ndarray, salt: int) -> np.ndarray:
    """splitmix64 of (value, row), 0 where value is 0; uint64, wrapping arithmetic. v and j: equal lengths.

    In blocks of MIX_BLOCK: on a whole column of millions of rows each of the ~10 passes made a temporary
    past glibc's mmap threshold, mapped afresh and faulted in page by page."""
    v, j = np.asarray(v).ravel(), np.asarray(j).ravel()
    out = np.empty(v.size, np.uint64)
    a, b, c = (np.uint64(x) for x in _MIX[salt])
    with np.errstate(over="ignore"):
        for lo in range(0, v.size, MIX_BLOCK):
            vb, jb = v[lo : lo + MIX_BLOCK], j[lo : lo + MIX_BLOCK]
            x = np.asarray(vb, np.int64).view(np.uint64) * a
            x += np.asarray(jb, np.int64).view(np.uint64) * b
            x += c
            x ^= x >> np.uint64(30)
            x *= b
            x ^= x >> np.uint64(27)
            x *= c
            x ^= x >> np.uint64(31)
            x[vb == 0] = 0
            out[lo : lo + MIX_BLOCK] = x
    return out


def seg_sums(h: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per segment: the wrapping sum of its elements (h in segment order: sum(counts) elements of it).

    One reduceat over h: no prefix-sum column (on millions of rows that was two more passes and two
    temporaries past glibc's mmap threshold)."""
    counts = np.asarray(counts, np.int64)
    out = np.zeros(counts.size, np.uint64)
    nz = np.flatnonzero(counts > 0)
    if nz.size:
        starts = np.cumsum(counts) - counts
        out[nz] = np.add.reduceat(np.asarray(h, np.uint64)[: int(starts[-1] + counts[-1])], starts[nz])
    return out


def group_ids(cols: list[np.ndarray]) -> np.ndarray:
    """One dense id per distinct row of the columns (compared column by column: no packing of values
    into one integer, so keys cannot collide)."""
    n = cols[0].size
    if n == 0:
        return np.zeros(0, np.int64)
    order = np.lexsort(cols[::-1])
    new = np.zeros(n, bool)
    new[0] = True
    for c in cols:
        s = c[order]
        new[1:] |= s[1:] != s[:-1]
    ids = np.empty(n, np.int64)
    ids[order] = np.cumsum(new) - 1
    return ids


def join(c_key: list[np.ndarray], q_key: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Dense ids of candidate and query keys in one id space."""
    ids = group_ids([np.concatenate([a, b]) for a, b in zip(c_key, q_key)])
    return ids[: c_key[0].size], ids[c_key[0].size :]


def member(c_key: list[np.ndarray], q_key: list[np.ndarray]) -> np.ndarray:
    """Per candidate row of the columns c_key: whether some query row of q_key has the same values (exact).

    The columns are packed into one int64 by their value ranges when that fits (no collisions: a mixed
    radix), then looked up in a table when the packed range is small, else by binary search in the
    sorted query keys: O(c + q log q), not a sort of all candidates. Otherwise the general join."""
    n = c_key[0].size
    if n == 0 or q_key[0].size == 0:
        return np.zeros(n, bool)
    lo = [min(int(a.min()), int(b.min())) for a, b in zip(c_key, q_key)]
    span = [max(int(a.max()), int(b.max())) - m + 1 for a, b, m in zip(c_key, q_key, lo)]
    total = 1
    for s in span:
        total *= s
    if total >= 1 << 62:
        ci, qi = join(c_key, q_key)
        return np.isin(ci, qi)

    def pack(cols: list[np.ndarray]) -> np.ndarray:
        key = np.zeros(cols[0].size, np.int64)
        for col, m, s in zip(cols, lo, span):
            key *= s
            key += np.asarray(col, np.int64) - m
        return key

    if total <= 4 * (n + q_key[0].size):  # a table of the packed range: one pass each
        table = np.zeros(total, bool)
        table[pack(q_key)] = True
        return table[pack(c_key)]
    # a few queries among millions of candidates (provenance's searches): a table of one column's values
    # first, so only the candidates it leaves are packed and searched (packing all cost ~3 passes each)
    keep = None  # (all)
    for col, qcol, m, s in zip(c_key, q_key, lo, span):
        if s <= 4 * (n + qcol.size) and (n if keep is None else keep.size) > 4 * qcol.size:
            table = np.zeros(s, bool)
            table[np.asarray(qcol, np.int64) - m] = True
            if 2 * np.count_nonzero(table) > s:  # (a rank column: the queries hold most values, nothing to cut)
                continue
            hit = table[np.asarray(col if keep is None else col[keep], np.int64) - m]
            keep = np.flatnonzero(hit) if keep is None else keep[hit]
    kc, kq = pack(c_key if keep is None else [c[keep] for c in c_key]), pack(q_key)
    u = np.unique(kq)
    at = np.minimum(np.searchsorted(u, kc), u.size - 1)
    if keep is None:
        return u[at] == kc
    out = np.zeros(n, bool)
    out[keep] = u[at] == kc
    return out


def latest_before(c_run: np.ndarray, c_idx: np.ndarray, c_val: np.ndarray, q_run: np.ndarray, q_idx: np.ndarray,
                  q_thr: np.ndarray, c_id: np.ndarray | None = None) -> np.ndarray:
    """For each query: the largest candidate index < q_idx in the same run with value < q_thr (-1 if none); with
    `c_id`, that candidate's id instead of its index (the index an order key, the id an observation).

    All queries at once, O((c + q) log(c + q)): candidates and queries are sorted together by (run,
    index); a sparse table of range minima over the values lets every query step back over the
    longest stretch of candidates whose values are all >= its threshold, by binary lifting.
    """
    nc, nq = c_run.size, q_run.size
    if nq == 0 or nc == 0:
        return np.full(nq, -1, np.int64)
    run = np.concatenate([c_run, q_run]).astype(np.int64)
    idx = np.concatenate([c_idx, q_idx]).astype(np.int64)
    is_c = np.concatenate([np.ones(nc, np.int8), np.zeros(nq, np.int8)])  # at equal index a query sorts first
    order = np.lexsort((is_c, idx, run))
    big = np.iinfo(np.int64).max
    val = np.concatenate([np.asarray(c_val, np.int64), np.full(nq, big, np.int64)])[order]
    n = order.size
    rs = run[order]
    first = np.ones(n, bool)
    first[1:] = rs[1:] != rs[:-1]
    start = np.maximum.accumulate(np.where(first, np.arange(n), 0))
    where = np.empty(n, np.int64)
    where[order] = np.arange(n)
    qpos = where[nc:]
    levels = [val]  # levels[k][p] = min(val[p : p + 2**k])
    while (1 << len(levels)) <= n:
        prev, h = levels[-1], 1 << (len(levels) - 1)
        nxt = prev.copy()
        np.minimum(prev[:-h], prev[h:], out=nxt[:-h])
        levels.append(nxt)
    cur, lo, thr = qpos.copy(), start[qpos], np.asarray(q_thr, np.int64)
    for k in range(len(levels) - 1, -1, -1):
        back = cur - (1 << k)
        ok = back >= lo
        step = ok & (levels[k][np.maximum(back, 0)] >= thr)
        cur = np.where(step, back, cur)
    ans = cur - 1
    hit = (ans >= lo) & (val[np.maximum(ans, 0)] < thr)
    ids = idx if c_id is None else np.concatenate([np.asarray(c_id, np.int64), np.zeros(nq, np.int64)])
    return np.where(hit, ids[order][np.maximum(ans, 0)], -1)


class KeyIndex:
    """Candidates sorted once by the key of each, for many lookups by small sets of query keys (blocks of one
    search): each lookup costs its queries and the candidates it finds, where `member` per block would pass over
    every candidate again. The query keys every lookup may ask are given up front (a lookup names them by
    position), so keys are compared in one id space, exactly (no packing)."""

    def __init__(self, c_key: list[np.ndarray], q_key: list[np.ndarray], rows: np.ndarray | None = None):
        """c_key: the candidates' key columns (at `rows`, the ids a lookup returns: 0..n-1 when None); q_key: every
        query key, by position."""
        n = c_key[0].size
        rows = np.arange(n, dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
        ci, self._qi = join(c_key, q_key)
        order = np.argsort(ci, kind="stable")
        self._ci, self._rows = ci[order], rows[order]

    def rows_of(self, queries: np.ndarray) -> np.ndarray:
        """The candidates (ascending) whose key one of the queries (positions into q_key) has."""
        u = np.unique(self._qi[np.asarray(queries, np.int64)])
        lo = np.searchsorted(self._ci, u, "left")
        _, _, at = ragged(lo, np.searchsorted(self._ci, u, "right") - lo)
        return np.sort(self._rows[at])


def distinct(x: np.ndarray) -> np.ndarray:
    """np.unique(x) of integers, by counting where their range is small (a million of them: a hash or a sort costs
    tens of times more)."""
    if x.size == 0:
        return np.unique(x)
    lo, hi = int(x.min()), int(x.max())
    if hi - lo > 16 * x.size + (1 << 16):  # (the counts: 8 bytes a value of the range)
        return np.unique(x)
    return (np.flatnonzero(np.bincount(x.astype(np.int64) - lo, minlength=hi - lo + 1)) + lo).astype(x.dtype)
