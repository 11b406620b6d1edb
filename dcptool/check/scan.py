"""Chunked row scans, the hot path of replay: every recorded view and page count against the formula.

One pass over the dump's rows in chunks of ~256K rows (cache-sized) on the CPU, or on the GPU with
the fused Triton kernels (a flag pass per chunk of ~4M rows: gpu.scan_cuda). Only observations with a wrong row
come back (sparse RowStats), so clean dumps produce no Python work per observation. With `bounded=True` each
chunk's pages are dropped from this process after use, so memory stays flat however large the dump is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from dcptool.dcp.reference import RowStats, local_of
from dcptool.dcp.segments import BULK_ROWS, obs_chunks, ragged
from dcptool.dump import Dump

CHUNK_ROWS = 1 << 18  # CPU: ~1 MB of int32 per array, so the passes over a chunk stay in L2
CHUNK_ROWS_THREADED = 1 << 20  # CPU, several threads: longer numpy calls (GIL released), less waiting for it
# `auto` scans on the GPU from this many observations, on the CPU below: under it the GPU's start-up (the driver, the
# primary context, the kernels from dcptool's cubin cache, pinned staging) and its transfers cost more than the CPU
# scan saves (benchmarks/bench_auto.py measures where fresh `dcptool replay` processes cross; docs/performance.md);
# a process that has started CUDA already can only cross lower.
GPU_MIN_OBS = 500_000
T = TypeVar("T")


def rows_differ(d: Dump, offs_key: str, rows_key: str, idx: np.ndarray, other: np.ndarray,
                step: int = 1 << 16) -> np.ndarray:
    """For each observation idx[k]: its rows differ from observation other[k]'s (length or any value); exact,
    in chunks of about `step` rows (pages released in a bounded dump)."""
    offs = d[offs_key]
    lens = np.diff(offs)
    out = lens[idx] != lens[other]
    for lo, hi in obs_chunks(np.where(out, 0, lens[idx]), step):
        sel = np.arange(lo, hi)[~out[lo:hi]]
        seg, j, at = ragged(offs[idx[sel]], lens[idx[sel]])
        bad = d.take(rows_key, at) != d.take(rows_key, offs[other[sel]][seg] + j)
        out[sel[np.unique(seg[bad])]] = True
        if d.bounded:
            d.release(0, d.n)
    return out


class _Pairs:
    """scan(pairs=): each observation's seq_lens rows against those of pairs[i] (-1: none), exactly, in the
    chunk loop while its rows are at hand (rank-agree's comparison without a second pass over the rows).
    A pair of different lengths differs without a read. A pair before the chunk (another rank's file, or a
    chunk's edge) is compared in the chunk too where the column is in memory; in a bounded dump, or on the GPU
    (whose chunk holds only its own rows), it is kept for `settle` (the rows a host thread compares).

    `pairs` returns that array when first called, by the first chunk: scan() hands in an array's or a
    future's (replay computes rank_pairs on another thread while the scan sets up: buffers, pinned staging).
    The first chunk waits for it rather than scanning ahead: a chunk scanned without the pairs would have its
    rows read again after the scan to compare them."""

    def __init__(self, rows: np.ndarray, pairs: Callable[[], np.ndarray]):
        self.rows, self.src = rows, pairs  # (called once, by the first chunk)
        self.other: np.ndarray | None = None
        self.found: list[np.ndarray] = []
        self.late: list[np.ndarray] = []
        self.lock = threading.Lock()  # (the CPU scan's threads ask at once)

    def _known(self) -> None:
        if self.other is not None:
            return
        with self.lock:
            if self.other is not None:
                return
            pairs = np.asarray(self.src(), np.int64)
            lens = np.diff(self.rows)
            other = np.where(pairs >= 0, pairs, np.arange(pairs.size))
            self.found.append(np.flatnonzero(lens[other] != lens))
            # rows back to the pair's first row (negative: forward); 0: nothing to read (no pair, other lengths)
            self.shift = np.where(lens[other] == lens, self.rows[:-1] - self.rows[other], 0)
            self.other = other  # (last: a thread that sees `other` set finds the rest set)

    def cut(self, lo: int, hi: int, whole: bool = False) -> np.ndarray:
        """Chunk [lo, hi)'s shifts; unless `whole` (every row at hand), 0 where the pair lies outside the chunk,
        kept for settle()."""
        self._known()
        sh = self.shift[lo:hi]
        if whole:
            return sh
        o = self.other[lo:hi]
        away = (o < lo) | (o >= hi)
        late = np.flatnonzero(away & (sh != 0))
        if late.size:
            with self.lock:
                self.late.append(late + lo)
            sh = np.where(away, 0, sh)
        return sh

    def settle(self, d: Dump) -> None:
        """Compare the pairs kept by cut() so far (their rows are read: a pair comes before its observation)."""
        with self.lock:
            late, self.late = self.late, []
        if not late:
            return
        late = np.sort(np.concatenate(late))
        need = max(int(self.rows[late + 1].max()), int(self.rows[self.other[late] + 1].max()))
        col = d["rows.seq_lens"] if d.bounded else d.upto("rows.seq_lens", need)
        # spans of late observations (a gap of a few observations compared as 0 shifts: rows against themselves)
        cut = np.flatnonzero(np.diff(late) > 64) + 1
        for a, b in zip(np.r_[0, cut].tolist(), np.r_[cut, late.size].tolist()):
            lo, hi = int(late[a]), int(late[b - 1]) + 1
            sh = np.zeros(hi - lo, np.int64)
            sh[late[a:b] - lo] = self.shift[late[a:b]]
            self.found.append(shifted_differ(col, self.rows, lo, hi, sh))
            if d.bounded:
                d.release(0, d.n)

    def differ(self, d: Dump) -> np.ndarray:
        self._known()
        self.settle(d)
        return np.unique(np.concatenate(self.found))


RUN_ROWS = 1 << 16  # rows of a run of one shift from which it is compared as two slices (no index per row)
BLOCK_ROWS = 1 << 22  # rows compared at a time


def shifted_differ(col, offs: np.ndarray, lo: int, hi: int, sh: np.ndarray, at: int = 0) -> np.ndarray:
    """Observations i of [lo, hi) whose rows [offs[i], offs[i + 1]) differ from the rows sh[i - lo] before them
    (0: not compared), exactly; `col` holds row x at x - at (a chunk's rows, or the column). Runs of observations of
    one shift (a rank's file against the rank before it) are compared as two slices; the rest through an index per
    row."""
    if not sh.any():
        return np.zeros(0, np.int64)
    edge = np.flatnonzero(np.diff(sh)) + 1
    r0, r1 = np.r_[0, edge], np.r_[edge, sh.size]  # runs of one shift, relative to lo
    rows = offs[lo + r1] - offs[lo + r0]
    by_slice = (sh[r0] != 0) & (rows >= RUN_ROWS)
    bad = []
    for u, v in zip(r0[by_slice].tolist(), r1[by_slice].tolist()):
        s = int(sh[u])
        x0, x1 = int(offs[lo + u]), int(offs[lo + v])
        for y in range(x0, x1, BLOCK_ROWS):
            z = min(x1, y + BLOCK_ROWS)
            ne = np.flatnonzero(np.asarray(col[y - at : z - at]) != np.asarray(col[y - s - at : z - s - at]))
            if ne.size:
                bad.append(ne + y)
    rest = sh.copy()
    for u, v in zip(r0[by_slice].tolist(), r1[by_slice].tolist()):
        rest[u:v] = 0
    if rest.any():
        lens = np.diff(offs[lo : hi + 1])
        for a, b in obs_chunks(lens, BLOCK_ROWS):
            if not rest[a:b].any():
                continue
            x0, x1 = int(offs[lo + a]), int(offs[lo + b])
            dt = np.int32 if x1 < 1 << 31 else np.int64  # (half the bytes per row on the common size)
            src = np.repeat(rest[a:b].astype(dt), lens[a:b])
            np.subtract(np.arange(x0 - at, x1 - at, dtype=dt), src, out=src)
            got = np.take(col, src) if isinstance(col, np.ndarray) else col[src]  # (np.take: twice as fast as [])
            ne = np.flatnonzero(got != np.asarray(col[x0 - at : x1 - at]))
            if ne.size:
                bad.append(ne + x0)
    if not bad:
        return np.zeros(0, np.int64)
    pos = np.concatenate(bad)
    return np.unique(np.searchsorted(offs, pos, "right") - 1)


def _padded_positions(rows: np.ndarray, nr: np.ndarray, lo: int, hi: int, base: int) -> np.ndarray:
    """Row positions (relative to `base`) of padded rows [num_reqs, rows) of observations lo..hi."""
    cnt = (rows[lo + 1 : hi + 1] - rows[lo:hi]) - nr[lo:hi]
    total = int(cnt.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    starts = rows[lo:hi] + nr[lo:hi] - base
    return np.repeat(starts - (np.cumsum(cnt) - cnt), cnt) + np.arange(total)


def _first_per_obs(pos: np.ndarray, rows: np.ndarray, lo: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bad row positions (absolute, ascending) -> (observations, count, first row within obs)."""
    o = np.searchsorted(rows, pos, side="right") - 1
    uo, first_idx, cnt = np.unique(o, return_index=True, return_counts=True)
    return uo, cnt, pos[first_idx] - rows[uo]


class _CpuScan:
    def __init__(self, d: Dump, pairs: _Pairs | None = None):
        self.pairs = pairs
        c = d.config
        self.d = d
        self.N, self.I, self.page = c.dcp_size, c.cp_interleave, c.page_size
        self.rows, self.drows = d["obs.rows"], d["obs.dcp_rows"]
        self.nr, self.nrp = d["obs.num_reqs"].astype(np.int64), d["obs.num_reqs_padded"].astype(np.int64)
        self.rank, self.has = d["obs.rank"], d["obs.has_dcp"]
        lens = np.diff(self.rows)
        dlen = np.diff(self.drows)
        # An aligned view has exactly one value per seq_lens row, so its rows line up with them.
        self.aligned = (self.has == 1) & (dlen == lens)
        self.one_rank = bool(d.n == 0 or (self.rank == self.rank[0]).all())
        self.kv = "rows.kv_pages" in d.columns

    def chunk(self, lo: int, hi: int) -> RowStats:
        d, rows, drows = self.d, self.rows, self.drows
        a, b = int(rows[lo]), int(rows[hi])
        # (d.upto: a streamed dump is still being read; this chunk waits for its own rows only)
        seq = np.asarray(d.upto("rows.seq_lens", b)[a:b])  # read once from the map; the passes below stay in cache
        if self.pairs is not None:
            whole = not d.bounded  # (in memory: a pair in an earlier chunk, another rank's file, is read already)
            sh = self.pairs.cut(lo, hi, whole)
            if whole:
                far = int(rows[self.pairs.other[lo:hi] + 1].max(initial=b))
                got = shifted_differ(d.upto("rows.seq_lens", max(far, b)), rows, lo, hi, sh)
            else:
                got = shifted_differ(seq, rows, lo, hi, sh, at=a)
            if got.size:
                self.pairs.found.append(got)
        rank = self.rank[lo:hi]
        ri = (int(rank[0]) if self.one_rank or (rank == rank[0]).all() else  # (a rank's file: one rank a chunk)
              np.repeat(rank.astype(np.int32), rows[lo + 1 : hi + 1] - rows[lo:hi]))
        exp = local_of(seq, ri, self.N, self.I)
        pad = _padded_positions(rows, self.nr, lo, hi, a)
        exp[pad] = 0
        out = []
        # Recorded rows laid over the expected ones: runs of consecutive aligned observations are
        # contiguous in both arrays; everything else keeps the expected value (compares equal).
        al = self.aligned[lo:hi]
        view = d.upto("rows.dcp_local_seq_lens", int(drows[hi]))
        if al.all():
            bad = np.flatnonzero(view[drows[lo] : drows[hi]] != exp)
        else:  # compared run by run (a few per chunk), nothing copied; rows outside the runs compare equal
            ne = np.zeros(exp.size, bool)
            edges = np.flatnonzero(np.diff(np.concatenate([[0], al.view(np.int8), [0]])))
            for u, v in zip((edges[::2] + lo).tolist(), (edges[1::2] + lo).tolist()):
                at = slice(int(rows[u]) - a, int(rows[v]) - a)
                np.not_equal(view[drows[u] : drows[v]], exp[at], out=ne[at])
            bad = np.flatnonzero(ne)
        wrong = pad_bad = np.zeros(0, np.int64)
        if bad.size:
            o = np.searchsorted(rows, bad + a, side="right") - 1
            j = bad + a - rows[o]
            # rows past num_reqs_padded (a view longer than the batch) are `shape`, not values
            keep = j < self.nrp[o]
            real = (j < self.nr[o]) & keep
            wrong, pad_bad = bad[real] + a, bad[~real & keep] + a
        pages = np.zeros(0, np.int64)
        if self.kv:
            kv = d.upto("rows.kv_pages", b)[a:b]
            allowed = -(-exp // self.page)
            badp = (kv != allowed) & (kv >= 0)
            badp[pad] = False  # page counts are checked on real rows only
            pages = np.flatnonzero(badp) + a
        for kind, pos in (("wrong", wrong), ("pad", pad_bad), ("pages", pages)):
            if pos.size:
                o, cnt, first = _first_per_obs(pos, rows, lo)
                out.append((kind, o, cnt, first))
        return _assemble(out)


def _assemble(parts: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]) -> RowStats:
    """(kind, observations, counts, first rows) per kind (wrong, pad, pages) -> one sparse RowStats."""
    if not parts:
        return RowStats.empty()
    obs = np.unique(np.concatenate([p[1] for p in parts]))
    cols = {k: np.zeros(obs.size, np.int64) for k in ("n_wrong", "n_pad", "n_pages")}
    firsts = {k: np.full(obs.size, -1, np.int64) for k in ("first_wrong", "first_pad", "first_pages")}
    for kind, o, cnt, first in parts:
        idx = np.searchsorted(obs, o)
        cols[f"n_{kind}"][idx] = cnt
        firsts[f"first_{kind}"][idx] = first
    return RowStats(**cols, **firsts, obs=obs)


def _irregular(d: Dump, sel: np.ndarray) -> RowStats:
    """Views whose length differs from their seq_lens rows (`shape` findings): row j < min(view length,
    num_reqs_padded) against local(seq_lens[j], rank) on real rows and 0 on padded ones, as check_rows (the
    torch reference) does; numpy, so a CPU replay never imports torch. In blocks of BULK_ROWS view rows (a
    recording whose views are mostly short holds a few bytes a row, this check tens)."""
    lens = np.diff(d["obs.dcp_rows"])[sel]
    return RowStats.concat([_irregular_block(d, sel[a:b]) for a, b in obs_chunks(lens, BULK_ROWS)])


def _irregular_block(d: Dump, sel: np.ndarray) -> RowStats:
    if sel.size == 0:
        return RowStats.empty()
    c = d.config
    rows, drows = d["obs.rows"], d["obs.dcp_rows"]
    seg, j, at = ragged(drows[:-1][sel], np.diff(drows)[sel])
    nr, nrp = d["obs.num_reqs"][sel].astype(np.int64)[seg], d["obs.num_reqs_padded"][sel].astype(np.int64)[seg]
    real = j < nr
    exp = np.zeros(j.size, np.int64)
    k = np.flatnonzero(real)
    exp[k] = local_of(d.take("rows.seq_lens", rows[:-1][sel][seg[k]] + j[k]).astype(np.int64),
                      d["obs.rank"][sel].astype(np.int64)[seg[k]], c.dcp_size, c.cp_interleave)
    bad = (j < nrp) & (d.take("rows.dcp_local_seq_lens", at).astype(np.int64) != exp)
    out = []
    for kind, b in (("wrong", np.flatnonzero(bad & real)), ("pad", np.flatnonzero(bad & ~real))):
        if b.size:  # (j ascends within an observation: its first bad row is its first in b)
            o, first, cnt = np.unique(seg[b], return_index=True, return_counts=True)
            out.append((kind, sel[o], cnt.astype(np.int64), j[b][first]))
    return _assemble(out)


def _merge(a: RowStats, b: RowStats) -> RowStats:
    """Combine two sparse results that may name the same observation (values from one, pages from the other)."""
    parts = []
    for st in (a, b):
        for kind in RowStats.KINDS:
            n, first = getattr(st, f"n_{kind}"), getattr(st, f"first_{kind}")
            keep = n > 0
            parts.append((kind, st.obs[keep], n[keep], first[keep]))
    return _assemble([p for p in parts if p[1].size])


def default_threads(bounded: bool = False) -> int:
    """The CPU scan's threads when not told: one on a machine of up to 3 cores (replay's background checks
    take the other) or for a bounded dump, else half the cores, at most 4. The chunk passes are numpy calls
    that release the GIL only while they run, so a thread pays off only with a core to spare
    (benchmarks/bench_scan.py --cpu-threads; docs/performance.md)."""
    import os

    cores = os.cpu_count() or 1
    return 1 if bounded or cores < 4 else min(4, cores // 2)


def in_order(fn: Callable[[int, int], T], spans: list[tuple[int, int]], workers: int) -> list[T]:
    """fn(lo, hi) for every span, the results in span order: on `workers` threads when more than one and there
    are several spans (the CPU scan's chunks, the slot pass's), else in this thread."""
    if workers > 1 and len(spans) > 1:
        with ThreadPoolExecutor(workers) as ex:
            return list(ex.map(lambda lohi: fn(*lohi), spans))
    return [fn(lo, hi) for lo, hi in spans]


def scan(d: Dump, backend: str, *, bounded: bool = False, threads: int | None = None,
         progress: Callable[[int], None] | None = None, pairs=None) -> RowStats:
    """Check every DCP view (observations with has_dcp, dcp_size > 1) and every page count: the observations with
    something wrong.

    `pairs` ([n] int64, -1: none): also compare each observation's seq_lens rows with those of observation
    pairs[i] (exactly, while the rows are read); RowStats.differ lists the observations whose rows differ. It
    may be a future of that array (result()), asked for when the first chunk is read."""
    check_views = d.config.dcp_size > 1
    pp = None if pairs is None else _Pairs(d["obs.rows"], pairs.result if hasattr(pairs, "result") else lambda: pairs)
    if backend == "triton":
        from dcptool.gpu.scan_cuda import gpu_scan

        res = gpu_scan(d, check_views, progress, bounded, pp)
        if pp is not None:
            res.differ = pp.differ(d)
        return res
    s = _CpuScan(d, pp)
    if not check_views:
        s.aligned = np.zeros_like(s.aligned)
    workers = threads or default_threads(bounded)
    spans = obs_chunks(np.diff(s.rows), CHUNK_ROWS if workers == 1 else CHUNK_ROWS_THREADED)

    def one(lo: int, hi: int) -> RowStats:
        r = s.chunk(lo, hi)
        if bounded:
            d.release(lo, hi)
        if progress:
            progress(hi - lo)
        return r

    res = RowStats.concat(in_order(one, spans, workers))
    if check_views:
        irregular = np.flatnonzero((s.has == 1) & ~s.aligned)
        res = _merge(res, _irregular(d, irregular))
    if pp is not None:
        res.differ = pp.differ(d)
    return res
