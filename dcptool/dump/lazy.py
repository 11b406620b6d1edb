"""Row columns of several files read on demand (ConcatRows): a few files mapped at once, each checked unchanged."""

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


def max_open_files() -> int:
    """Files kept open at once by a dump of several files (mapped, or held open for the streamed read): each holds
    a descriptor (a mapping two: Python's mmap keeps a duplicate), so a quarter of the soft RLIMIT_NOFILE, at least
    4 and at most 256."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY or soft < 0:
            soft = 1024
    except (ImportError, OSError, ValueError):
        soft = 1024
    return max(4, min(256, soft // 4))


class MappedFiles:
    """The files of a bounded dump of several files, each mapped read-only on demand (a few at once, least recently
    used closed first) and checked to be the file that was read and validated: same device, inode, size
    and modification time, else DumpError ("changed while being read")."""

    def __init__(self, paths: list[str], idents: list[tuple]):
        from collections import OrderedDict

        self.paths, self.idents = paths, idents
        self.open: OrderedDict[int, object] = OrderedDict()
        self.cap = max_open_files()
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


class ConcatRows:
    """One row column of several files end to end (file f's rows after file f - 1's), never held whole: reads (a
    slice, an index array, a scalar) copy the rows out of the files' mappings and drop the pages they touched, so
    a set of files larger than memory is scanned like one bounded file: a slice, as the scan reads, is a few
    sequential reads of one or two files. np.asarray() builds the whole column (correct, not bounded: for the rare
    caller that needs it all). File f's rows are [base[f], base[f + 1]) here."""

    PIECE = 1 << 16  # rows gathered per file between page drops (a sparse gather maps whole folios)
    MARGIN = 2 << 20  # bytes dropped around what a read touched (see _from_file)

    def __init__(self, files: MappedFiles, parts: list[tuple[int, int] | None], dtype, base: np.ndarray):
        self.files, self.parts, self.dtype = files, parts, np.dtype(dtype)  # parts[f]: (byte offset, count)
        self.base = base
        self.size = int(base[-1])
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
        out[at] = arr[local]
        if isinstance(local, slice):
            lo, hi = local.start, local.stop
        else:
            lo, hi = int(local.min()), int(local.max()) + 1
        del arr
        # Outward, with a margin: a fault maps a whole folio around the row read (fault-around, large
        # folios: up to 2 MB), and this read-only mapping has nothing of its own to lose.
        a = max(off + lo * self.dtype.itemsize - self.MARGIN, 0)
        b = min(off + hi * self.dtype.itemsize + self.MARGIN, len(m))
        files.release_pages((m, 0, 1), a // mmap.PAGESIZE * mmap.PAGESIZE, b)

    def _gather(self, pos: np.ndarray) -> np.ndarray:
        """Rows at positions pos (int64, in range)."""
        out = np.empty(pos.size, self.dtype)
        for k in range(0, pos.size, self.PIECE):
            p = pos[k : k + self.PIECE]
            f = np.searchsorted(self.base, p, side="right") - 1
            for g in np.unique(f).tolist():
                sel = np.flatnonzero(f == g)
                self._from_file(g, p[sel] - self.base[g], out[k : k + p.size], sel)
        return out

    def __getitem__(self, key):
        if isinstance(key, slice):
            a, b, step = key.indices(self.size)
            if step != 1:
                return self[np.arange(a, b, step)]
            out = np.empty(max(b - a, 0), self.dtype)
            while a < b:  # a slice of each file it spans
                f = int(np.searchsorted(self.base, a, side="right")) - 1
                e = min(b, int(self.base[f + 1]))
                lo = a - int(self.base[f])
                self._from_file(f, slice(lo, lo + e - a), out, slice(out.size - (b - a), out.size - (b - e)))
                a = e
            return out
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
