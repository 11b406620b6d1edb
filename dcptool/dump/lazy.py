"""Row columns of several files read on demand (MergedRows): a few files mapped at once, each checked unchanged."""

from __future__ import annotations

import os
import threading

import numpy as np

from dcptool.dump import files
from dcptool.dump.schema import (
    fail,
)

# --------------------------------------------------------------------------------------------
# Several files in bounded memory: row columns read on demand from the files


def _max_open_files() -> int:
    """Mapped files kept open at once by a merged bounded dump: each mapping holds a descriptor (Python's
    mmap keeps a duplicate), so a quarter of the soft RLIMIT_NOFILE, at least 4 and at most 256."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY or soft < 0:
            soft = 1024
    except (ImportError, OSError, ValueError):
        soft = 1024
    return max(4, min(256, soft // 4))


class MappedFiles:
    """The files of a merged bounded dump, each mapped read-only on demand (a few at once, least recently
    used closed first) and checked to be the file that was read and validated: same device, inode, size
    and modification time, else DumpError ("changed while being read")."""

    def __init__(self, paths: list[str], idents: list[tuple]):
        from collections import OrderedDict

        self.paths, self.idents = paths, idents
        self.open: OrderedDict[int, object] = OrderedDict()
        self.cap = _max_open_files()
        self.lock = threading.Lock()  # the scan may read from several threads

    def clear(self) -> None:
        """Unmap every file (each closes once no read holds it)."""
        with self.lock:
            self.open.clear()

    def map(self, f: int):
        with self.lock:
            m = self.open.get(f)
            if m is not None:
                self.open.move_to_end(f)
                return m
            return self._map(f)

    def _map(self, f: int):
        import mmap

        p = self.paths[f]
        try:
            with open(p, "rb") as fh:
                st = os.fstat(fh.fileno())
                if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != self.idents[f]:
                    raise fail(p, None, "changed while being read (replaced, or its size or modification time "
                                         "differ from when it was opened); read it again once it is complete")
                m = mmap.mmap(fh.fileno(), st.st_size, access=mmap.ACCESS_READ)
        except OSError as e:
            raise fail(p, None, f"cannot read: {e.strerror or e}") from None
        self.open[f] = m
        while len(self.open) > self.cap:
            self.open.popitem(last=False)  # closed once no array views it (gathers copy out, so at once)
        return m


class MergedRows:
    """One row column of several files merged in the order of docs/format.md, never held whole: reads (a slice,
    an index array, a scalar) gather the rows from the files' mappings and drop the pages they touched, so a
    set of files larger than memory is scanned like one bounded file. np.asarray() builds the whole column
    (correct, not bounded: for the rare caller that needs it all).

    Merged observation k's rows sit at [offs[k], offs[k+1]) here and at src[k] + (that - offs[k]) in the
    files' rows laid end to end; file f's rows start there at base[f]."""

    PIECE = 1 << 16  # rows gathered per file between page drops (a sparse gather maps whole folios)
    MARGIN = 2 << 20  # bytes dropped around what a read touched (see _from_file)
    RUNS = 64  # a slice of at most this many runs is copied run by run; more (files interleaved): gathered

    def __init__(self, files: MappedFiles, parts: list[tuple[int, int] | None], dtype, offs: np.ndarray,
                 src: np.ndarray, base: np.ndarray):
        self.files, self.parts, self.dtype = files, parts, np.dtype(dtype)  # parts[f]: (byte offset, count)
        self.offs, self.src, self.base = offs, src, base
        self.size = int(offs[-1])
        self.shape = (self.size,)
        self.ndim = 1

    def __len__(self) -> int:
        return self.size

    def __array__(self, dtype=None, copy=None):
        out = self[0 : self.size]
        return out if dtype is None else out.astype(dtype, copy=False)

    def _from_file(self, f: int, local: np.ndarray | slice, out: np.ndarray, at) -> None:
        import mmap

        off, count = self.parts[f]
        m = self.files.map(f)
        arr = np.frombuffer(m, self.dtype, count, off)
        if isinstance(local, slice):
            out[at] = arr[local]
            lo, hi = local.start, local.stop
        else:
            out[at] = arr[local]
            lo, hi = int(local.min()), int(local.max()) + 1
        del arr
        # Outward, with a margin: a fault maps a whole folio around the row read (fault-around, large
        # folios: up to 2 MB), and this read-only mapping has nothing of its own to lose.
        a = max(off + lo * self.dtype.itemsize - self.MARGIN, 0)
        b = min(off + hi * self.dtype.itemsize + self.MARGIN, len(m))
        files.release_pages((m, 0, 1), a // mmap.PAGESIZE * mmap.PAGESIZE, b)

    def _gather(self, pos: np.ndarray) -> np.ndarray:
        """Rows at merged positions pos (int64, in range)."""
        out = np.empty(pos.size, self.dtype)
        for k in range(0, pos.size, self.PIECE):
            p = pos[k : k + self.PIECE]
            o = np.searchsorted(self.offs, p, side="right") - 1
            s = self.src[o] + (p - self.offs[o])
            f = np.searchsorted(self.base, s, side="right") - 1
            for g in np.unique(f).tolist():
                sel = np.flatnonzero(f == g)
                self._from_file(g, s[sel] - self.base[g], out[k : k + p.size], sel)
        return out

    def __getitem__(self, key):
        if isinstance(key, slice):
            a, b, step = key.indices(self.size)
            if step != 1:
                return self[np.arange(a, b, step)]
            if b <= a:
                return np.zeros(0, self.dtype)
            # The common case (rollover files, steps in order): the range is a few runs of observations that
            # lie end to end in the files too (constant shift), each copied as slices, split at file ends.
            k0 = int(np.searchsorted(self.offs, a, side="right")) - 1
            k1 = int(np.searchsorted(self.offs, b - 1, side="right")) - 1
            lens = self.offs[k0 + 1 : k1 + 2] - self.offs[k0 : k1 + 1]
            ks = np.flatnonzero(lens > 0) + k0
            shift = self.src[ks] - self.offs[ks]
            runs = np.concatenate([[0], np.flatnonzero(np.diff(shift)) + 1])
            if runs.size <= self.RUNS:
                out = np.empty(b - a, self.dtype)
                ends = [int(self.offs[ks[r]]) for r in runs[1:].tolist()] + [b]
                for r, p1 in zip(runs.tolist(), ends):
                    p0 = max(a, int(self.offs[ks[r]]))
                    s0, s1 = p0 + int(shift[r]), p1 + int(shift[r])
                    while s0 < s1:
                        f = int(np.searchsorted(self.base, s0, side="right")) - 1
                        e = min(s1, int(self.base[f + 1]))
                        lo = s0 - int(self.base[f])
                        self._from_file(f, slice(lo, lo + e - s0), out, slice(p0 - a, p0 - a + e - s0))
                        p0, s0 = p0 + e - s0, e
                return out
            return self._gather(np.arange(a, b, dtype=np.int64))
        if isinstance(key, (int, np.integer)):
            i = int(key) + (self.size if key < 0 else 0)
            if not 0 <= i < self.size:
                raise IndexError(f"index {int(key)} out of range for {self.size} rows")
            return self._gather(np.array([i], np.int64))[0]
        idx = np.asarray(key)
        if idx.dtype == bool:
            idx = np.flatnonzero(idx)
        idx = idx.astype(np.int64, copy=False)
        flat = idx.reshape(-1)
        if flat.size and (flat.min() < -self.size or flat.max() >= self.size):
            raise IndexError(f"index out of range for {self.size} rows")
        return self._gather(np.where(flat < 0, flat + self.size, flat)).reshape(idx.shape)
