"""What the GPU scan stages per chunk: the columns of whole observations, offsets made chunk-relative, and
the threaded copy into staging buffers (shared by the scan on cuda-core and the interpreter's)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from dcptool.dump import Dump

STAGE_THREADS = 4  # host threads filling a staging buffer (one memcpy thread does ~10 GB/s)
PIECE = 1 << 20  # elements: a staging copy is split in pieces of at least this many, one per thread


class Chunks:
    """The dump's chunks [lo, hi) of observations and each staged column's largest size and dtype.

    Columns: seq (seq_lens rows), rows (offsets, n+1), dcp (the views' rows), drows, nr, nrp, rank, kv
    (page counts, when recorded) and shift (rank-agree's pair shifts, when `pairs` is given: an object with
    cut(lo, hi), the scan's pairs)."""

    def __init__(self, d: Dump, chunks: list[tuple[int, int]], pairs=None):
        self.d, self.chunks, self.pairs = d, chunks, pairs
        self.rows, self.drows = d["obs.rows"], d["obs.dcp_rows"]
        self.kv = "rows.kv_pages" in d.columns
        lo = np.array([c[0] for c in chunks], np.int64)
        hi = np.array([c[1] for c in chunks], np.int64)
        most = lambda o: int((o[hi] - o[lo]).max()) if chunks else 0  # noqa: E731
        nobs = int((hi - lo).max()) if chunks else 0
        i32, i64 = np.dtype(np.int32), np.dtype(np.int64)
        self.sizes = {"seq": (most(self.rows), i32), "rows": (nobs + 1, i64), "dcp": (most(self.drows), i32),
                      "drows": (nobs + 1, i64), "nr": (nobs, i32), "nrp": (nobs, i32), "rank": (nobs, i32)}
        if self.kv:
            self.sizes["kv"] = (most(self.rows), i32)
        if pairs is not None:
            self.sizes["shift"] = (nobs, i64)
        self.most_obs = nobs
        self.pool = ThreadPoolExecutor(STAGE_THREADS) if STAGE_THREADS > 1 else None  # (threads start on use)

    def sources(self, k: int) -> dict[str, np.ndarray]:
        """Chunk k's columns, offsets made relative to the chunk."""
        d, rows, drows = self.d, self.rows, self.drows
        lo, hi = self.chunks[k]
        a, e, da, de = int(rows[lo]), int(rows[hi]), int(drows[lo]), int(drows[hi])
        src = {"seq": d.upto("rows.seq_lens", e)[a:e], "rows": rows[lo : hi + 1] - a,
               "dcp": d.upto("rows.dcp_local_seq_lens", de)[da:de], "drows": drows[lo : hi + 1] - da,
               "nr": d["obs.num_reqs"][lo:hi], "nrp": d["obs.num_reqs_padded"][lo:hi], "rank": d["obs.rank"][lo:hi]}
        if self.kv:
            src["kv"] = d.upto("rows.kv_pages", e)[a:e]
        if self.pairs is not None:
            src["shift"] = self.pairs.cut(lo, hi)
        return src

    def fill(self, k: int, host: dict[str, np.ndarray]) -> dict[str, int]:
        """Copy chunk k's columns into the staging arrays `host` (at their start); the element count of each."""
        n = {}
        for key, v in self.sources(k).items():
            v = np.asarray(v)
            self._copy(host[key][: v.size], v)
            n[key] = int(v.size)
        return n

    def _copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        if self.pool is None or src.size < 2 * PIECE:
            np.copyto(dst, src, casting="unsafe")
            return
        # numpy releases the GIL for a plain copy: the pieces run in parallel
        step = max(PIECE, -(-src.size // STAGE_THREADS))
        list(self.pool.map(lambda i: np.copyto(dst[i : i + step], src[i : i + step], casting="unsafe"),
                           range(0, src.size, step)))

    def close(self) -> None:
        if self.pool is not None:  # (every copy has returned: the idle threads end on their own, nothing to wait for)
            self.pool.shutdown(wait=False)
