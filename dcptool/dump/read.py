"""Dump (a run's columns, numpy) and read_dump: one file read whole, mapped, or streamed."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from dcptool.dump import files
from dcptool.dump.lazy import MergedRows
from dcptool.dump.ref import obs_ref
from dcptool.dump.schema import (
    COLUMN_GROUPS,
    COLUMNS,
    DTYPES,
    RAGGED,
    REQUIRED,
    DumpConfig,
    check_entries,
    check_packed,
    check_row_values,
    fail,
    parse_capped,
    parse_config,
    validate_columns,
)
from dcptool.dump.stream import Reader, Streamed


@dataclass
class Dump:
    """Observations of one or more files, merged in the order docs/format.md gives; columns are numpy."""

    files: list[str]
    config: DumpConfig
    columns: dict[str, np.ndarray]
    file_index: np.ndarray  # [n] int32: which file each observation came from
    file_obs: np.ndarray  # [n] int64: the observation's index inside its file
    injected: list[dict[str, list[int]] | None] = field(default_factory=list)
    capped: list[int | None] = field(default_factory=list)  # per file: the size cap its recording stopped at
    sizes: list[int] = field(default_factory=list)  # bytes of each file
    maps: dict[str, tuple] = field(default_factory=dict)  # bounded: key -> (mmap, byte offset, itemsize)
    bounded: bool = False  # scan with bounded memory (pages dropped after each chunk): a dump too big for RAM
    idents: list[tuple] = field(default_factory=list)  # (st_dev, st_ino, size, mtime_ns) of each file as read
    row_parts: dict[str, tuple[int, int]] = field(default_factory=dict)  # see _obs_only
    reader: Reader | None = None  # read_dump(stream=True): the thread still reading the row columns

    def upto(self, key: str, n: int) -> np.ndarray:
        """self[key] when only its first n values are needed now: a streamed dump waits for those alone (the
        scan follows the read chunk by chunk); self[key] waits for the whole column."""
        if self.reader is None:
            return self.columns[key]
        self.reader.wait(key, n)
        return dict.__getitem__(self.columns, key)

    def finish(self) -> None:
        """A streamed dump: wait until every column is read and the file validated whole (its DumpError if not);
        nothing for a dump read at once."""
        if self.reader is not None:
            self.reader.finish()
            self.columns, self.reader = dict(self.columns), None  # (all in: plain columns from now on)

    def close(self) -> None:
        """A streamed dump whose caller failed before it needed the rows: stop reading them, so no thread of the
        read outlives the command; nothing for a dump read at once."""
        if self.reader is not None:
            self.reader.stop()

    @property
    def n(self) -> int:
        return int(self.columns["obs.step"].shape[0])

    def __getitem__(self, key: str) -> np.ndarray:
        return self.columns[key]

    def has(self, *keys: str) -> bool:
        return all(k in self.columns for k in keys)

    def seq_lens_of(self, i: int) -> np.ndarray:
        r = self.columns["obs.rows"]
        return self.columns["rows.seq_lens"][r[i] : r[i + 1]]

    def dcp_of(self, i: int) -> np.ndarray | None:
        if not self.columns["obs.has_dcp"][i]:
            return None
        r = self.columns["obs.dcp_rows"]
        return self.columns["rows.dcp_local_seq_lens"][r[i] : r[i + 1]]

    def qsl_of(self, i: int) -> np.ndarray | None:
        return self._ragged_of("obs.qsl", "rows.query_start_loc", i)

    def kv_pages_of(self, i: int) -> np.ndarray | None:
        if "rows.kv_pages" not in self.columns:
            return None
        r = self.columns["obs.rows"]
        return self.columns["rows.kv_pages"][r[i] : r[i + 1]]

    def _ragged_of(self, offs_key: str, rows_key: str, i: int) -> np.ndarray | None:
        if offs_key not in self.columns:
            return None
        q = self.columns[offs_key]
        return self.columns[rows_key][q[i] : q[i + 1]]

    def dqsl_of(self, i: int) -> np.ndarray | None:
        """rows.dcp_query_start_loc of observation i (None: the dump lacks the column; empty: not recorded)."""
        return self._ragged_of("obs.dqsl", "rows.dcp_query_start_loc", i)

    def tot_of(self, i: int) -> np.ndarray | None:
        """rows.dcp_tot_seq_lens of observation i (None: the dump lacks the column)."""
        return self._ragged_of("obs.tot", "rows.dcp_tot_seq_lens", i)

    def site_name(self, i: int) -> str:
        return self.config.sites[int(self.columns["obs.site"][i])]

    def file_of(self, i: int) -> str:
        return self.files[int(self.file_index[i])]

    def ref(self, i: int) -> str:
        """Observation i as the reports name it, `FILE:I` (dump.obs_ref)."""
        return obs_ref(self.file_of(i), int(self.file_obs[i]))

    def index_of(self, file: int, k: int) -> int | None:
        """The merged position of observation `k` of file number `file`, or None when it has none."""
        hit = np.flatnonzero((self.file_index == file) & (self.file_obs == k))
        return int(hit[0]) if hit.size else None

    # Paging (bounded dumps): reads that drop the mapped pages they touched, so a dump bigger than RAM is
    # read in bounded memory. Internal to the pipeline: callers use them instead of indexing columns.

    def take(self, key: str, idx: np.ndarray) -> np.ndarray:
        """self[key][idx]; a dump still being read waits for the values up to idx's largest, not the whole
        column. In a bounded dump the gather goes in pieces, each piece's pages dropped after use: the kernel
        maps whole page-cache folios on a fault, so even a sparse gather across a big file would otherwise map
        most of it."""
        arr = self.upto(key, int(idx.max()) + 1) if self.reader is not None and idx.size else self[key]
        if not self.bounded or key not in self.maps or idx.size == 0:
            return arr[idx]
        out = np.empty(idx.size, arr.dtype)
        step = 1 << 16
        for k in range(0, idx.size, step):
            part = idx[k : k + step]
            out[k : k + part.size] = arr[part]
            files.release_pages(self.maps[key], int(part.min()), int(part.max()) + 1)
        return out

    def every(self, items, k: int = 256):
        """Iterate items; in a bounded dump, drop every mapped page after each k of them (per-finding
        work reads scattered rows, and each read maps a whole page-cache folio)."""
        for n, x in enumerate(items, 1):
            yield x
            if self.bounded and n % k == 0:
                self.release(0, self.n)

    def release(self, lo: int, hi: int) -> None:
        """Forget the row pages of observations [lo, hi): bounded memory for scans of huge dumps."""
        for v in self.columns.values():
            if isinstance(v, MergedRows):  # several files read lazily: each read drops its pages; unmap all too
                v.files.clear()
        for offs, key in ((o, k) for o, ks in RAGGED.items() for k in ks):
            if key in self.maps:
                o = self.columns[offs]
                files.release_pages(self.maps[key], int(o[lo]), int(o[hi]))


def read_dump(path: str | os.PathLike, bounded: bool | None = None, stream: bool = False) -> Dump:
    """Open one dump after validating all of docs/format.md; the file's descriptor is closed on return.

    The data is copied into memory (one read), so a file truncated or rewritten while dcptool runs
    cannot change what it reports or end it with SIGBUS; a change during the read itself (size,
    mtime or inode differ after it) is a DumpError. `bounded` (default: when the file is over half
    the memory available now) maps the file instead (one copy-on-write mapping, no descriptor kept
    by numpy) and drops the pages of each validated chunk again, so opening and scanning a dump
    larger than RAM stays flat; such a mapping is the one case a truncation can still interrupt
    (docs/limits.md).

    `stream` (replay's read, not bounded): the per-observation columns are read and validated before this
    returns; the row columns are read on a thread of their own (the scan's columns in step with each other),
    and the whole file validated once they are in. Reading a column waits until it is read (`Dump.upto`
    waits for its first values only); `Dump.finish()` waits for the rest and raises the file's DumpError.
    """
    p = str(path)
    try:
        f = files.open_file(p)
    except OSError as e:
        raise fail(p, None, f"cannot read: {e.strerror or e}") from None
    try:
        got = _read_dump(p, f, bounded, stream)
    except BaseException:
        f.close()
        raise
    if got.reader is None:
        f.close()
    return got


def _read_dump(p: str, f, bounded: bool | None, stream: bool) -> Dump:
    """read_dump on the open file f (which a streamed read's thread closes when done)."""
    before = os.fstat(f.fileno())
    header, data_start, size = files.header_of(p, f)
    if bounded is None:
        avail = files.available_memory()
        bounded = avail is not None and size > avail // 2
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise fail(p, "__metadata__", "must map strings to strings")
    entries = check_entries(p, header, data_start, size)
    cfg, injected = parse_config(p, meta)
    capped = parse_capped(p, meta)
    for key in REQUIRED:
        if key not in entries:
            raise fail(p, key, "missing")
    for group in COLUMN_GROUPS:
        present = [k for k in group if k in entries]
        if present and len(present) != len(group):
            raise fail(p, (set(group) - set(present)).pop(), f"missing (it goes with {present[0]})")
    for key, (dt, shape, _a, _b) in entries.items():
        if key not in COLUMNS:
            continue  # unknown keys are allowed: a newer writer may add columns
        if len(shape) != 1:
            raise fail(p, key, f"must be 1-D, got shape {shape}")
        if dt != COLUMNS[key][0]:
            raise fail(p, key, f"dtype must be {COLUMNS[key][0]}, got {dt}")
    check_packed(p, entries)
    stream = stream and not bounded and size > data_start
    try:
        if bounded and size > data_start:
            import mmap

            # One mapping for the whole file (a numpy memmap per column would hold a descriptor each).
            buf = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
            base = 0
        elif stream:  # the per-observation columns now, the rows on the reader's thread
            buf, base = np.empty(size - data_start, np.uint8), data_start
            for key, (_dt, _shape, a, b) in entries.items():
                if key in COLUMNS and COLUMNS[key][1] in ("n", "n+1"):
                    files.pread(p, f, buf, data_start + a, b - a, base, size)
        else:
            buf, base = files.read_data(p, f, data_start, size, before), data_start
    except OSError as e:
        raise fail(p, None, f"cannot read: {e.strerror or e}") from None
    cols: dict[str, np.ndarray] = {}
    maps: dict[str, tuple] = {}
    for key, (dt, shape, a, _b) in entries.items():
        if key not in COLUMNS:
            continue
        if shape[0] == 0:
            cols[key] = np.zeros(0, DTYPES[dt])
        else:
            cols[key] = np.frombuffer(buf, dtype=DTYPES[dt], count=shape[0], offset=data_start + a - base)
            if bounded:
                maps[key] = (buf, data_start + a, DTYPES[dt].itemsize)
    drop = (lambda key, lo, hi: files.release_pages(maps[key], lo, hi) if key in maps else None) if bounded else None
    validate_columns(p, cfg, cols, injected, release=drop, row_values=not stream)
    n = cols["obs.step"].shape[0]
    reader = None
    if stream:
        reader = Reader(p, f, buf, base, entries, before, lambda: check_row_values(p, cfg, cols))
    return Dump(files=[p], config=cfg, columns=Streamed(cols, reader) if reader else cols,
                file_index=np.zeros(n, np.int32), file_obs=np.arange(n, dtype=np.int64), injected=[injected],
                capped=[capped], sizes=[size], maps=maps, bounded=bool(bounded), reader=reader,
                idents=[(before.st_dev, before.st_ino, size, before.st_mtime_ns)])
