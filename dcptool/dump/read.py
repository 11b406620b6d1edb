"""Dump (a run's columns, numpy) and read_dump: one file read whole, mapped, or streamed."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from dcptool.dump import files
from dcptool.dump.lazy import ConcatRows
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
from dcptool.dump.stream import Reader, Source, Streamed


@dataclass
class Dump:
    """Observations of one or more files; columns are numpy. Several files lie end to end in the order given (file
    f's observations, and each row column's rows, after file f - 1's), each in its own order: what the checks read.
    The run's order (docs/format.md: by step, then file order, then order in the file; one file: its order) is what
    reports show: order_of() gives it."""

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
    reader: Reader | None = None  # read_dump(stream=True): the thread still reading the row columns
    in_order: bool = True  # the observations are in the run's order already (one file; rolled files in step order)
    recordings: list[int] = field(default_factory=list)  # per file: its recording (merge.recording_ids); []: its own
    memory: files.MemoryPlan | None = None  # open_dumps: read into memory or bounded, and why
    _seq: np.ndarray | None = field(default=None, init=False, repr=False)  # (order_of's positions, made on first use)

    def recording_index(self) -> np.ndarray:
        """[n] int64: the recording of each observation (a file, or the files a Recorder rolled one recording into:
        what one process recorded, as the checks that follow a buffer across steps need it)."""
        f = self.file_index.astype(np.int64)
        return np.asarray(self.recordings, np.int64)[f] if self.recordings else f

    def order_of(self, idx: np.ndarray) -> np.ndarray:
        """Keys that sort observations idx in the run's order: idx itself where the observations are in it, else
        their positions in it (a stable sort by step: file order and order in the file are the order here)."""
        idx = np.asarray(idx, np.int64)
        if self.in_order:
            return idx
        if self._seq is None:
            order = np.argsort(self.columns["obs.step"], kind="stable")  # (few sorted runs: one per file)
            seq = np.empty(order.size, np.int64)
            seq[order] = np.arange(order.size, dtype=np.int64)
            self._seq = seq
        return self._seq[idx]

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
        """The position here of observation `k` of file number `file`, or None when it has none."""
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
            if isinstance(v, ConcatRows):  # several files read lazily: each read drops its pages; unmap all too
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


@dataclass(frozen=True)
class Head:
    """A dump file's header, checked (file_head): where its columns lie and what its metadata says."""

    p: str
    before: os.stat_result  # the file when its header was read (a later read must find it unchanged)
    data_start: int
    size: int
    entries: dict  # key -> (dtype, shape, begin, end) in the data section (check_entries)
    config: DumpConfig
    injected: dict | None
    capped: int | None

    @property
    def ident(self) -> tuple:
        return (self.before.st_dev, self.before.st_ino, self.size, self.before.st_mtime_ns)

    def per_obs(self) -> list[str]:
        """The per-observation columns (one value per observation, or offsets) the file holds."""
        return [k for k in self.entries if k in COLUMNS and COLUMNS[k][1] in ("n", "n+1")]

    def rows(self) -> list[str]:
        """The row columns the file holds."""
        return [k for k in self.entries if k in COLUMNS and COLUMNS[k][1] not in ("n", "n+1")]


def file_head(p: str, f) -> Head:
    """The header of the open dump file f, checked: every rule of docs/format.md that the header alone decides."""
    before = os.fstat(f.fileno())
    header, data_start, size = files.header_of(p, f)
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
    return Head(p, before, data_start, size, entries, cfg, injected, capped)


def _read_dump(p: str, f, bounded: bool | None, stream: bool) -> Dump:
    """read_dump on the open file f (which a streamed read's thread closes when done)."""
    h = file_head(p, f)
    data_start, size, entries, cfg, injected = h.data_start, h.size, h.entries, h.config, h.injected
    if bounded is None:
        bounded = files.memory_plan([p]).bounded
    stream = stream and not bounded and size > data_start
    try:
        if bounded and size > data_start:
            import mmap

            # One mapping for the whole file (a numpy memmap per column would hold a descriptor each).
            buf = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
            base = 0
        elif stream:  # the per-observation columns now, the rows on the reader's thread
            buf, base = np.empty(size - data_start, np.uint8), data_start
            for key in h.per_obs():
                _dt, _shape, a, b = entries[key]
                files.pread(p, f, buf, data_start + a, b - a, base, size)
        else:
            buf, base = files.read_data(p, f, data_start, size, h.before), data_start
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
        rows = {k: (data_start + entries[k][2], int(entries[k][1][0]),
                    buf[entries[k][2] : entries[k][3]]) for k in h.rows()}
        reader = Reader([Source(p, rows, h.before, lambda: check_row_values(p, cfg, cols), f)])
    return Dump(files=[p], config=cfg, columns=Streamed(cols, reader) if reader else cols,
                file_index=np.zeros(n, np.int32), file_obs=np.arange(n, dtype=np.int64), injected=[injected],
                capped=[h.capped], sizes=[size], maps=maps, bounded=bool(bounded), reader=reader, idents=[h.ident])
