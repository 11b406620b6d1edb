"""Dump format v1: columnar observations in one safetensors file; reads validated by schema.py, merges,
atomic writes, paging (over 450 lines: reading, merging and writing one format, with the file-system care
each needs)."""

from __future__ import annotations

import json
import os
import stat
import struct
import tempfile
import threading
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path

import numpy as np

from dcptool.schema import (  # noqa: F401 - DumpConfig, the errors and the limits are re-exported: dump's API
    _DTYPE_NAMES,
    _DTYPES,
    _GROUPS,
    COLUMNS,
    FORMAT_VERSION,
    INT32_MAX,
    MAX_DCP_SIZE,
    MAX_HEADER_BYTES,
    OPTIONAL,
    RAGGED,
    REQUIRED,
    DumpConfig,
    DumpError,
    OutputExistsError,
    WriteError,
    _check_entries,
    _clean,
    _fail,
    _loads,
    _parse_config,
    _sniff,
    _text_ok,
    check_row_values,
    validate_columns,
)


@dataclass
class Observation:
    """One attention-metadata build as an engine saw it (the row form of the columnar dump)."""

    step: int
    site: str
    rank: int
    num_reqs: int
    num_reqs_padded: int
    seq_lens: np.ndarray
    dcp_local_seq_lens: np.ndarray | None
    ubatch: int = -1
    parent: int | None = None
    req_start: int | None = None
    tok_start: int | None = None
    tok_stop: int | None = None
    query_start_loc: np.ndarray | None = None
    num_tokens_padded: int | None = None
    buffer: int | None = None
    graph: int | None = None
    kv_pages: np.ndarray | None = None
    dcp_query_start_loc: np.ndarray | None = None  # issue 15: Q of the empty-shard mask (None: not recorded)
    dcp_tot_seq_lens: np.ndarray | None = None  # issue 15: the global companion (None: not recorded)
    # issue 15 (slots): each token's position, and the slot this rank writes per token (-1: none) for KV-cache
    # group 0 (1-D), for groups 0.. ([groups, tokens]), or as {group index: 1-D} (see slot_entries)
    positions: np.ndarray | None = None
    slot_mapping: np.ndarray | dict | None = None


@dataclass
class Dump:
    """Observations of one or more files, merged in the order DESIGN §2 gives; columns are numpy."""

    files: list[str]
    config: DumpConfig
    columns: dict[str, np.ndarray]
    file_index: np.ndarray  # [n] int32: which file each observation came from
    file_obs: np.ndarray  # [n] int64: the observation's index inside its file
    injected: list[dict[str, list[int]] | None] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)  # bytes of each file
    maps: dict[str, tuple] = field(default_factory=dict)  # bounded: key -> (mmap, byte offset, itemsize)
    bounded: bool = False  # scan with bounded memory (pages dropped after each chunk): a dump too big for RAM
    idents: list[tuple] = field(default_factory=list)  # (st_dev, st_ino, size, mtime_ns) of each file as read
    row_parts: dict[str, tuple[int, int]] = field(default_factory=dict)  # see _obs_only
    reader: _Reader | None = None  # read_dump(stream=True): the thread still reading the row columns

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
            _release(self.maps[key], int(part.min()), int(part.max()) + 1)
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
                _release(self.maps[key], int(o[lo]), int(o[hi]))


# --------------------------------------------------------------------------------------------
# Reading


def _open(p: str):
    """Open a dump file for reading: a regular file, else DumpError (a FIFO would block, a directory fail)."""
    st = os.stat(p)
    if stat.S_ISDIR(st.st_mode):
        raise _fail(p, None, "is a directory, not a dump file")
    if not stat.S_ISREG(st.st_mode):  # a FIFO or a device would block or never end
        raise _fail(p, None, "is not a regular file (a pipe, socket or device); save the dump to a file first")
    f = open(p, "rb")
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # replaced between the stat and the open
        f.close()
        raise _fail(p, None, "is not a regular file (a pipe, socket or device); save the dump to a file first")
    return f


def _header_of(p: str, f) -> tuple[dict, int, int]:
    """Parse and check the safetensors header of the open file f; returns (header, data start, file size)."""
    try:
        size = os.fstat(f.fileno()).st_size
        f.seek(0)
        start = f.read(72)
        if size < 8 or len(start) < 8:
            raise _fail(p, None, f"not a safetensors file ({size} bytes; a dump starts with an 8-byte "
                                 "header length)" if size else "not a safetensors file (empty: 0 bytes)")
        if start.startswith(b"version ") and b"git-lfs" in start.split(b"\n")[0]:
            raise _fail(p, None, "is a Git LFS pointer, not the dump itself (run `git lfs pull`)")
        if start[8:9] not in (b"", b"{"):  # a safetensors header is a JSON object
            raise _fail(p, None, f"not a safetensors file ({_sniff(start)})")
        (hlen,) = struct.unpack("<Q", start[:8])
        f.seek(8)
        if hlen > MAX_HEADER_BYTES:
            raise _fail(p, None, f"not a safetensors file, or header too large ({hlen} bytes > "
                                 f"{MAX_HEADER_BYTES})")
        if 8 + hlen > size:
            raise _fail(p, None, f"truncated: header declares {hlen} bytes but the file has {size - 8}")
        raw = f.read(hlen)
        if len(raw) != hlen:
            raise _fail(p, None, f"truncated while reading: header declares {hlen} bytes, read {len(raw)}")
    except OSError as e:
        raise _fail(p, None, f"cannot read: {e.strerror or e}") from None
    header = _loads(p, None, raw, "not a safetensors file (header is not UTF-8 JSON)")
    if not isinstance(header, dict):
        raise _fail(p, None, "not a safetensors file (header is not a JSON object)")
    bad = next((k for k in header if not _text_ok(k)), None)
    if bad is not None:
        raise _fail(p, bad, "tensor name is not valid Unicode (a lone surrogate escape)")
    return header, 8 + hlen, size


def read_header(path: str | os.PathLike) -> tuple[dict, int, int]:
    """Parse and check the safetensors header; returns (header, data start, file size)."""
    p = os.fspath(path)
    try:
        f = _open(p)
    except OSError as e:
        raise _fail(p, None, f"cannot read: {e.strerror or e}") from None
    with f:
        return _header_of(p, f)


def available_memory() -> int | None:
    """Bytes of physical memory available now (None where the OS does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _check_unchanged(p: str, f, before: os.stat_result) -> None:
    """DumpError if the open file f is no longer what was stat'ed as `before` (size, mtime, inode, device)."""
    after = os.fstat(f.fileno())
    if (before.st_size, before.st_mtime_ns, before.st_ino, before.st_dev) != (
            after.st_size, after.st_mtime_ns, after.st_ino, after.st_dev):
        raise _fail(p, None, "changed while being read (size or modification time differ from when it was "
                             "opened); read it again once it is complete")


def _read_data(p: str, f, data_start: int, size: int, before: os.stat_result) -> np.ndarray:
    """The file's data section, copied into memory, and proof that the file did not change meanwhile."""
    # np.empty, not bytearray: no zero-filling pass before the read, and numpy asks for huge pages on large
    # blocks (half the read time of a 234 MB dump here: 0.06 s against 0.13 s)
    buf = np.empty(size - data_start, np.uint8)
    _pread(p, f, buf, data_start, size - data_start, data_start, size)
    _check_unchanged(p, f, before)
    return buf


def read_dump(path: str | os.PathLike, bounded: bool | None = None, stream: bool = False) -> Dump:
    """Open one dump after validating all of DESIGN §2; the file's descriptor is closed on return.

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
        f = _open(p)
    except OSError as e:
        raise _fail(p, None, f"cannot read: {e.strerror or e}") from None
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
    header, data_start, size = _header_of(p, f)
    if bounded is None:
        avail = available_memory()
        bounded = avail is not None and size > avail // 2
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise _fail(p, "__metadata__", "must map strings to strings")
    entries = _check_entries(p, header, data_start, size)
    cfg, injected = _parse_config(p, meta)
    for key in REQUIRED:
        if key not in entries:
            raise _fail(p, key, "missing")
    for group in _GROUPS:
        present = [k for k in group if k in entries]
        if present and len(present) != len(group):
            raise _fail(p, (set(group) - set(present)).pop(), f"missing (it goes with {present[0]})")
    for key, (dt, shape, _a, _b) in entries.items():
        if key not in COLUMNS:
            continue  # unknown keys are allowed: a newer writer may add columns
        if len(shape) != 1:
            raise _fail(p, key, f"must be 1-D, got shape {shape}")
        if dt != COLUMNS[key][0]:
            raise _fail(p, key, f"dtype must be {COLUMNS[key][0]}, got {dt}")
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
                    _pread(p, f, buf, data_start + a, b - a, base, size)
        else:
            buf, base = _read_data(p, f, data_start, size, before), data_start
    except OSError as e:
        raise _fail(p, None, f"cannot read: {e.strerror or e}") from None
    cols: dict[str, np.ndarray] = {}
    maps: dict[str, tuple] = {}
    for key, (dt, shape, a, _b) in entries.items():
        if key not in COLUMNS:
            continue
        if shape[0] == 0:
            cols[key] = np.zeros(0, _DTYPES[dt])
        else:
            cols[key] = np.frombuffer(buf, dtype=_DTYPES[dt], count=shape[0], offset=data_start + a - base)
            if bounded:
                maps[key] = (buf, data_start + a, _DTYPES[dt].itemsize)
    drop = (lambda key, lo, hi: _release(maps[key], lo, hi) if key in maps else None) if bounded else None
    validate_columns(p, cfg, cols, injected, release=drop, row_values=not stream)
    n = cols["obs.step"].shape[0]
    reader = None
    if stream:
        reader = _Reader(p, f, buf, base, entries, before, lambda: check_row_values(p, cfg, cols))
    return Dump(files=[p], config=cfg, columns=_Streamed(cols, reader) if reader else cols,
                file_index=np.zeros(n, np.int32), file_obs=np.arange(n, dtype=np.int64), injected=[injected],
                sizes=[size], maps=maps, bounded=bool(bounded), reader=reader,
                idents=[(before.st_dev, before.st_ino, size, before.st_mtime_ns)])


def _pread(p: str, f, buf: np.ndarray, at: int, nbytes: int, base: int, size: int) -> None:
    """Bytes [at, at + nbytes) of the file (of `size` bytes when opened) into buf[at - base:] (os.preadv: no
    shared file position, and the GIL released while the kernel copies); DumpError if it ends early."""
    view = memoryview(buf)[at - base : at - base + nbytes]
    got = 0
    while got < nbytes:
        if hasattr(os, "preadv"):
            k = os.preadv(f.fileno(), [view[got:]], at + got)
        else:  # (a system without preadv: one more copy)
            b = os.pread(f.fileno(), min(nbytes - got, 1 << 26), at + got)
            k = len(b)
            view[got : got + k] = b
        if not k:
            raise _fail(p, None, f"changed while being read: the file ended after {at + got} of {size} bytes "
                                 "(truncated by another process?); read it again once it is complete")
        got += k


STREAM_PIECE = 8 << 20  # bytes per read of a streamed row column: the grain at which the scan follows the read
# the columns the scan reads chunk by chunk, read in step with each other (the rest after them, whole)
SCAN_ROWS = ("rows.seq_lens", "rows.dcp_local_seq_lens", "rows.kv_pages")


class _Reader:
    """read_dump(stream=True)'s thread: the row columns in pieces (the scan's in step with each other, piece k of
    each before piece k + 1 of any), then the file unchanged and the whole validated. wait(key, n) blocks until
    the first n values of key are read; an error (a short or changed file, a rule of DESIGN §2) wakes every
    waiter and is raised by wait() and finish()."""

    def __init__(self, p: str, f, buf: np.ndarray, base: int, entries: dict, before: os.stat_result,
                 validate) -> None:
        self.p, self.f, self.buf, self.base, self.before, self.validate = p, f, buf, base, before, validate
        rows = {k: e for k, e in entries.items() if k in COLUMNS and COLUMNS[k][1] not in ("n", "n+1")}
        self.need = {k: int(e[1][0]) for k, e in rows.items()}  # values of each row column
        self.got = dict.fromkeys(rows, 0)
        self.pending = {k for k, n in self.need.items() if n}  # columns not read whole yet
        self.error: BaseException | None = None
        self.done = False
        self.cond = threading.Condition()
        self.plan = self._plan(rows)
        self.thread = threading.Thread(target=self._run, daemon=True, name="dcptool-read")
        self.thread.start()

    def _plan(self, rows: dict) -> list[tuple[str, int, int, int]]:
        """(key, file offset, bytes, values read once it is in) per read, in reading order: the scan's columns
        cut into the same number of pieces and taken piece by piece, then each other column in pieces."""

        def cut(k: str, parts: int) -> list[tuple[str, int, int, int]]:
            _dt, shape, a, b = rows[k]
            item = (b - a) // max(shape[0], 1)
            edges = [shape[0] * i // parts for i in range(parts + 1)]
            return [(k, self.base + a + lo * item, (hi - lo) * item, hi) for lo, hi in zip(edges, edges[1:]) if hi > lo]

        def parts(*keys: str) -> int:  # pieces of STREAM_PIECE bytes for the largest of the columns
            return max(1, -(-max(rows[k][3] - rows[k][2] for k in keys) // STREAM_PIECE))

        scan = [k for k in SCAN_ROWS if k in rows]
        out = [x for step in zip_longest(*(cut(k, parts(*scan)) for k in scan)) for x in step if x is not None]
        return out + [x for k in rows if k not in scan for x in cut(k, parts(k))]

    def _run(self) -> None:
        try:
            for key, at, nbytes, upto in self.plan:
                _pread(self.p, self.f, self.buf, at, nbytes, self.base, self.before.st_size)
                with self.cond:
                    self.got[key] = upto
                    if upto == self.need[key]:
                        self.pending.discard(key)
                    self.cond.notify_all()
            _check_unchanged(self.p, self.f, self.before)
            self.validate()
        except OSError as e:
            self.error = _fail(self.p, None, f"cannot read: {e.strerror or e}")
        except BaseException as e:  # a DumpError, or what the caller should see as this read's failure
            self.error = e
        finally:
            self.f.close()
            with self.cond:
                self.done = True
                self.cond.notify_all()

    def wait(self, key: str, n: int | None = None) -> None:
        """Until the first n values of `key` are read (None: all of it); raises the read's error."""
        need = self.need.get(key, 0) if n is None else min(int(n), self.need.get(key, 0))
        with self.cond:
            while self.got.get(key, need) < need and self.error is None and not self.done:
                self.cond.wait()
        if self.error is not None:
            raise self.error
        if self.got.get(key, need) < need:  # (the read ended without these values: never hand out unread bytes)
            raise RuntimeError(f"{self.p}: {key}: the streamed read ended at value {self.got[key]} of {need}")

    def finish(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


class _Streamed(dict):
    """A streamed dump's columns: reading one waits until it is read (Dump.upto waits for its first values)."""

    def __init__(self, cols: dict, reader: _Reader) -> None:
        super().__init__(cols)
        self.reader = reader

    def __getitem__(self, key: str) -> np.ndarray:
        if key in self.reader.pending:  # (a set lookup once it is read: per-finding code reads columns often)
            self.reader.wait(key)
        return dict.__getitem__(self, key)

    def get(self, key: str, default=None):
        return self[key] if key in self else default

    def values(self):
        return [self[k] for k in self]

    def items(self):
        return [(k, self[k]) for k in self]


def unique_files(paths: list[str | os.PathLike]) -> list[str | os.PathLike]:
    """paths without a file named again (the same path, a symlink to it, a hard link, a directory's file
    listed beside the directory): each file is read once, at its first name, never double-counted.
    A path that cannot be stat'ed is kept, for the reader to report."""
    seen: set[tuple[int, int]] = set()
    out = []
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            out.append(p)
            continue
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            out.append(p)
    return out


def open_dumps(paths: list[str | os.PathLike], bounded: bool | None = None, stream: bool = False) -> Dump:
    """Read several files as one run: ordered by step, then file order, then order within a file.

    `stream`: one file read in memory is read as read_dump(stream=True) does (replay: the scan follows the
    read); the caller calls Dump.finish() before it reports. Several files are read at once as before.

    Files that together take more than half the memory available now (or `bounded=True`) are merged
    lazily: each is validated in bounded mode, its per-observation columns are merged in memory (tens of
    bytes an observation), and its row columns stay in the file, read on demand (MergedRows), so the
    set replays in bounded memory like one large file. Otherwise everything is merged in memory.
    """
    if not paths:
        raise DumpError("no dump files given")
    paths = unique_files(paths)
    lazy = bool(bounded) and len(paths) > 1
    if bounded is None and len(paths) > 1:
        avail = available_memory()
        total = 0
        for p in paths:
            try:
                total += os.stat(p).st_size
            except OSError:
                pass  # read_dump reports it
        lazy = avail is not None and total > avail // 2
    if len(paths) == 1:
        return read_dump(paths[0], bounded, stream=stream)
    dumps = [_obs_only(read_dump(p, True)) if lazy else read_dump(p, bounded) for p in paths]
    if len(dumps) == 1:
        return dumps[0]
    base = dumps[0].config
    for d in dumps[1:]:
        c = d.config
        for k in ("dcp_size", "cp_interleave", "pcp_size", "page_size", "kv_groups"):
            if getattr(c, k) != getattr(base, k):
                raise DumpError(f"{d.files[0]}: dcptool.config: {k} = {getattr(c, k)} but {dumps[0].files[0]} "
                                f"has {getattr(base, k)}; these files are not one run")
    site_index = {s: i for i, s in enumerate(base.sites)}  # a dict: site lists may be long (no quadratic merge)
    for d in dumps[1:]:
        for s in d.config.sites:
            site_index.setdefault(s, len(site_index))
    sites = list(site_index)
    cfg = DumpConfig(**{**base.__dict__, "sites": tuple(sites)})
    keys = [k for k in COLUMNS if all(k in d.columns for d in dumps)]
    # Stable sort by (step, file): observations of one step keep file order, then in-file order.
    step = np.concatenate([d["obs.step"] for d in dumps])
    fidx = np.concatenate([np.full(d.n, i, np.int32) for i, d in enumerate(dumps)])
    fobs = np.concatenate([np.arange(d.n, dtype=np.int64) for d in dumps])
    order = np.lexsort((fobs, fidx, step))
    starts = np.cumsum([0] + [d.n for d in dumps])
    inv = np.empty_like(order)
    inv[order] = np.arange(order.size)
    cols: dict[str, np.ndarray] = {}
    for key in keys:
        kind = COLUMNS[key][1]
        if kind == "n":
            parts = []
            for i, d in enumerate(dumps):
                v = d[key]
                if key == "obs.site":
                    remap = np.array([site_index[s] for s in d.config.sites], np.int32)
                    v = remap[v]
                elif key == "obs.parent":
                    v = np.where(v >= 0, v + starts[i], -1)
                parts.append(v)
            v = np.concatenate(parts)
            if key == "obs.parent":
                v = np.where(v >= 0, inv[np.maximum(v, 0)], -1)
            cols[key] = v[order]
    files = _Files([d.files[0] for d in dumps], [d.idents[0] for d in dumps]) if lazy else None
    in_order = bool((order == np.arange(order.size)).all())
    for offs_key, row_keys in RAGGED.items():
        if offs_key not in keys:
            continue
        lens = np.concatenate([np.diff(d[offs_key]) for d in dumps])
        before = np.cumsum([0] + [int(d[offs_key][-1]) for d in dumps])  # rows of the files before each
        starts_rows = np.concatenate([d[offs_key][:-1] + before[i] for i, d in enumerate(dumps)])
        lens_o = lens[order]
        new_offs = np.zeros(order.size + 1, np.int64)
        np.cumsum(lens_o, out=new_offs[1:])
        cols[offs_key] = new_offs
        for rk in row_keys:
            if rk not in keys:
                continue
            if lazy:  # the rows stay in the files
                cols[rk] = MergedRows(files, [d.row_parts.get(rk) for d in dumps], _DTYPES[COLUMNS[rk][0]],
                                      new_offs, starts_rows[order], before.astype(np.int64))
            elif in_order:  # rollover files with steps in order: the merge is the files end to end
                cols[rk] = np.concatenate([d[rk] for d in dumps])
            else:  # gather every row run in the new order with one vectorised index build
                src = np.repeat(starts_rows[order] - new_offs[:-1], lens_o) + np.arange(new_offs[-1])
                cols[rk] = np.concatenate([d[rk] for d in dumps])[src]
    return Dump(files=[f for d in dumps for f in d.files], config=cfg, columns=cols, file_index=fidx[order],
                file_obs=fobs[order], injected=[d.injected[0] for d in dumps], sizes=[d.sizes[0] for d in dumps],
                bounded=lazy, idents=[d.idents[0] for d in dumps])


def _obs_only(d: Dump) -> Dump:
    """A validated bounded dump without its mapping: per-observation columns copied out, row columns
    replaced by where they lie in the file (row_parts: key -> (byte offset, count)); the mapping (and its
    descriptor) is closed once nothing views it, so thousands of files need no descriptor each."""
    parts: dict[str, tuple[int, int]] = {}
    cols: dict[str, np.ndarray] = {}
    for key, v in d.columns.items():
        if key.startswith("obs."):
            cols[key] = np.array(v)  # a copy: the mapping goes
        else:
            parts[key] = (d.maps[key][1], int(v.size)) if key in d.maps else (0, 0)
            cols[key] = np.zeros(0, v.dtype)  # present (for the merge's key list), never read
    return Dump(files=d.files, config=d.config, columns=cols, file_index=d.file_index, file_obs=d.file_obs,
                injected=d.injected, sizes=d.sizes, idents=d.idents, row_parts=parts)


# --------------------------------------------------------------------------------------------
# Several files in bounded memory: row columns read on demand from the files (issue 16 item 5)


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


class _Files:
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
                    raise _fail(p, None, "changed while being read (replaced, or its size or modification time "
                                         "differ from when it was opened); read it again once it is complete")
                m = mmap.mmap(fh.fileno(), st.st_size, access=mmap.ACCESS_READ)
        except OSError as e:
            raise _fail(p, None, f"cannot read: {e.strerror or e}") from None
        self.open[f] = m
        while len(self.open) > self.cap:
            self.open.popitem(last=False)  # closed once no array views it (gathers copy out, so at once)
        return m


class MergedRows:
    """One row column of several files merged in the order of DESIGN §2, never held whole: reads (a slice,
    an index array, a scalar) gather the rows from the files' mappings and drop the pages they touched, so a
    set of files larger than memory is scanned like one bounded file. np.asarray() builds the whole column
    (correct, not bounded: for the rare caller that needs it all).

    Merged observation k's rows sit at [offs[k], offs[k+1]) here and at src[k] + (that - offs[k]) in the
    files' rows laid end to end; file f's rows start there at base[f]."""

    PIECE = 1 << 16  # rows gathered per file between page drops (a sparse gather maps whole folios)
    MARGIN = 2 << 20  # bytes dropped around what a read touched (see _from_file)
    RUNS = 64  # a slice of at most this many runs is copied run by run; more (files interleaved): gathered

    def __init__(self, files: _Files, parts: list[tuple[int, int] | None], dtype, offs: np.ndarray,
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
        _release((m, 0, 1), a // mmap.PAGESIZE * mmap.PAGESIZE, b)

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


# --------------------------------------------------------------------------------------------
# Writing


# Optional per-observation columns: field -> (key, dtype, value written where unknown).
OPTIONAL_FIELDS = {"parent": ("obs.parent", "<i8", -1), "req_start": ("obs.req_start", "<i4", -1),
                   "tok_start": ("obs.tok_start", "<i4", -1), "tok_stop": ("obs.tok_stop", "<i4", -1),
                   "num_tokens_padded": ("obs.num_tokens_padded", "<i4", -1), "buffer": ("obs.buffer", "<i8", 0),
                   "graph": ("obs.graph", "i1", 0)}
FIELDS = ("step", "rank", "ubatch", "num_reqs", "num_reqs_padded", *OPTIONAL_FIELDS)
# seq_lens, dcp_local_seq_lens, query_start_loc, kv_pages; issue 15: dcp_query_start_loc, dcp_tot_seq_lens, and
# the slot entries positions, slot_mapping, slot_group (per token and KV-cache group)
ROW_FIELDS = ("seq", "dcp", "qsl", "kv", "dqsl", "tot", "pos", "slot", "sgrp")
# the row fields with an offsets column of their own, written when any observation has them
_OWN_OFFSETS = {"qsl": ("obs.qsl", "rows.query_start_loc"), "dqsl": ("obs.dqsl", "rows.dcp_query_start_loc"),
                "tot": ("obs.tot", "rows.dcp_tot_seq_lens")}


def columns(config: DumpConfig, sites: list[str], vals: dict, rows: dict) -> tuple[DumpConfig, dict[str, np.ndarray]]:
    """Row-form observations -> dump columns (DESIGN §2): the one place both writers (pack, Recorder) go through.

    sites: one site name per observation (added to the config's list in order of first use);
    vals: FIELDS -> one value per observation (None where unknown); rows: ROW_FIELDS -> one 1-D
    array per observation (None: a `None` DCP view, or an unknown query_start_loc / kv_pages).
    Optional columns are written when any observation knows them; the others get -1 ("unknown";
    0 for obs.buffer and obs.graph), so checks needing them skip those observations.
    """
    n = len(sites)
    names = list(config.sites)
    for site in dict.fromkeys(sites):
        if site not in names:
            names.append(site)
    cfg = DumpConfig(**{**config.__dict__, "sites": tuple(names)})
    index = {site: i for i, site in enumerate(names)}

    def col(field: str, dtype: str, unknown: int = -1) -> np.ndarray:
        v = [unknown if x is None else x for x in vals[field]]
        try:
            return np.array(v, dtype=dtype)
        except OverflowError:  # a Python int the column cannot hold
            bad = next(x for x in v if not np.iinfo(dtype).min <= int(x) <= np.iinfo(dtype).max)
            raise DumpError(f"{field}: value {bad} does not fit {np.dtype(dtype).name}") from None

    def offsets(arrs) -> np.ndarray:
        out = np.zeros(n + 1, np.int64)
        np.cumsum(np.fromiter((0 if a is None else a.size for a in arrs), np.int64, n), out=out[1:])
        return out

    def cat(arrs, key: str) -> np.ndarray:
        got = [a for a in arrs if a is not None]
        return _narrow(np.concatenate(got), np.dtype("<i4"), key) if got else np.zeros(0, "<i4")

    cols = {"obs.step": col("step", "<i8"), "obs.site": np.array([index[x] for x in sites], "<i4"),
            "obs.rank": col("rank", "<i4"), "obs.ubatch": col("ubatch", "<i4"),
            "obs.num_reqs": col("num_reqs", "<i4"), "obs.num_reqs_padded": col("num_reqs_padded", "<i4"),
            "obs.rows": offsets(rows["seq"]), "rows.seq_lens": cat(rows["seq"], "rows.seq_lens"),
            "obs.has_dcp": np.array([a is not None for a in rows["dcp"]], "u1"),
            "obs.dcp_rows": offsets(rows["dcp"]),
            "rows.dcp_local_seq_lens": cat(rows["dcp"], "rows.dcp_local_seq_lens")}
    for name, (key, dtype, unknown) in OPTIONAL_FIELDS.items():
        if any(v is not None for v in vals[name]):
            cols[key] = col(name, dtype, unknown)
    if any(a is not None for a in rows["kv"]):
        cols["rows.kv_pages"] = cat([np.full(q.size, -1, np.int32) if k is None else k
                                     for k, q in zip(rows["kv"], rows["seq"])], "rows.kv_pages")
    for name, (offs_key, row_key) in _OWN_OFFSETS.items():  # (absent from a caller that predates them: none)
        got = rows.get(name)
        if got is not None and any(a is not None for a in got):
            cols[offs_key] = offsets(got)
            cols[row_key] = cat(got, row_key)
    if any(a is not None for a in rows["pos"]):  # issue 15: slot entries (None: not recorded, 0 entries)
        cols["obs.slots"] = offsets(rows["pos"])
        for f, key in (("pos", "rows.positions"), ("slot", "rows.slot_mapping"), ("sgrp", "rows.slot_group")):
            cols[key] = cat(rows[f], key)
    return cfg, cols


def slot_entries(positions, slot_mapping, groups: int | None = None) -> tuple:
    """(positions, slot_mapping, slot_group) per entry of the slot columns: one entry per token and KV-cache
    group, groups ascending; or (None, None, None) when neither is given. `slot_mapping`: 1-D (group 0),
    [groups, tokens], or {group index: 1-D}; host arrays (numpy or lists). ValueError for what cannot be
    stored: one without the other, a length that is not one per position, a group outside [0, groups)."""
    if positions is None and slot_mapping is None:
        return (None, None, None)
    if positions is None or slot_mapping is None:
        raise ValueError("positions and slot_mapping go together")
    pos = np.asarray(positions).reshape(-1)
    if isinstance(slot_mapping, dict):
        maps = slot_mapping
    else:
        m = np.asarray(slot_mapping)
        maps = {0: m} if m.ndim == 1 else dict(enumerate(m))  # [groups, tokens]
    keys = sorted(int(g) for g in maps)
    hi = INT32_MAX if groups is None else groups - 1
    if keys and not (0 <= keys[0] and keys[-1] <= hi):
        raise ValueError(f"KV-cache group {keys[0] if keys[0] < 0 else keys[-1]} out of range")
    slots = [np.asarray(maps[g]).reshape(-1) for g in keys]
    if any(x.size != pos.size for x in slots):
        raise ValueError(f"a slot mapping does not have one value per position ({pos.size})")
    return (np.tile(pos, len(keys)), np.concatenate(slots) if slots else pos[:0],
            np.repeat(np.array(keys, np.int64), pos.size))


def pack(observations: list[Observation], config: DumpConfig) -> tuple[DumpConfig, dict[str, np.ndarray]]:
    """Observation dataclasses -> columns (see columns())."""
    def arr(x):
        return None if x is None else np.asarray(x).reshape(-1)

    vals = {f: [getattr(o, f) for o in observations] for f in FIELDS}
    rows = {"seq": [arr(o.seq_lens) for o in observations], "dcp": [arr(o.dcp_local_seq_lens) for o in observations],
            "qsl": [arr(o.query_start_loc) for o in observations], "kv": [arr(o.kv_pages) for o in observations],
            "dqsl": [arr(o.dcp_query_start_loc) for o in observations],
            "tot": [arr(o.dcp_tot_seq_lens) for o in observations],
            **dict(zip(("pos", "slot", "sgrp"), zip(*[slot_entries(o.positions, o.slot_mapping)
                                                    for o in observations]) if observations else ((), (), ())))}
    return columns(config, [o.site for o in observations], vals, rows)


def encode(config: DumpConfig, columns: dict[str, np.ndarray], injected: dict | None = None,
           extra_metadata: dict[str, str] | None = None) -> tuple[bytes, list[tuple[str, np.ndarray]]]:
    """The safetensors header and the tensors to follow it, in a fixed (sorted) order."""
    meta = {"dcptool.format": FORMAT_VERSION, "dcptool.config": json.dumps(config.to_json(), sort_keys=True)}
    if injected is not None:
        meta["dcptool.injected"] = json.dumps({k: sorted(v) for k, v in sorted(injected.items())})
    meta.update(extra_metadata or {})
    header: dict = {"__metadata__": meta}
    tensors = []
    off = 0
    for key in sorted(columns):
        want = COLUMNS[key][0] if key in COLUMNS else None
        arr = np.ascontiguousarray(columns[key])
        if want is not None:
            arr = arr.astype(_DTYPES[want], copy=False)
        header[key] = {"dtype": _DTYPE_NAMES[arr.dtype.newbyteorder("<") if arr.dtype.itemsize > 1 else arr.dtype],
                       "shape": [int(arr.shape[0])], "data_offsets": [off, off + arr.nbytes]}
        off += arr.nbytes
        tensors.append((key, arr))
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes with spaces
    return struct.pack("<Q", len(raw)) + raw, tensors


def _link_no_clobber(tmp: str, p: Path) -> None:
    """Move tmp to p unless p exists, atomically where the filesystem has hard links."""
    try:
        os.link(tmp, p)  # fails if p exists, even if another writer created it a moment ago
    except FileExistsError:
        raise OutputExistsError(f"{_clean(p)}: exists (use --force to overwrite)") from None
    except OSError:  # no hard links here (some FUSE / SMB mounts): check, then rename
        if os.path.lexists(p):
            raise OutputExistsError(f"{_clean(p)}: exists (use --force to overwrite)") from None
        os.replace(tmp, p)
        return
    os.unlink(tmp)


_KINDS = ((stat.S_ISDIR, "directory"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
          (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "special file")


def write_target(path: str | os.PathLike) -> Path:
    """The file a write to `path` may replace: `path` when it is absent or a regular file; for a symbolic
    link to a regular file, that file (replaced atomically in its own directory; the link stays a link).
    Anything else is a WriteError: a directory, a device (`/dev/null`), a FIFO, a socket, a link to one
    of them (`/proc/self/fd/1`) or a dangling link. A rename would swap such a node for a regular file."""
    p = Path(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return p
    except OSError as e:
        raise WriteError(f"{_clean(p)}: cannot write: {e.strerror or e}") from None
    if stat.S_ISREG(st.st_mode):
        return p
    if not stat.S_ISLNK(st.st_mode):
        raise WriteError(f"{_clean(p)}: is a {_kind(st.st_mode)}, not a regular file; dcptool only replaces "
                         "regular files")
    try:
        target = os.stat(p)
    except OSError:
        raise WriteError(f"{_clean(p)}: is a symbolic link to nothing; dcptool only writes regular files") from None
    if not stat.S_ISREG(target.st_mode):
        raise WriteError(f"{_clean(p)}: is a symbolic link to a {_kind(target.st_mode)}, not a regular file; "
                         "dcptool only replaces regular files")
    real = Path(os.path.realpath(p))
    try:  # a /proc/self/fd link to a deleted or unnamed file resolves to no path that is that file
        same = os.path.samefile(real, p)
    except OSError:
        same = False
    if not same:
        raise WriteError(f"{_clean(p)}: is a symbolic link whose target cannot be replaced by name")
    return real


def atomic_write(path: str | os.PathLike, chunks, *, force: bool = True, inputs=()) -> None:
    """Write chunks (bytes-like) to a temporary file beside `path`, fsync, then rename it into place.

    A crash, a kill or a full disk leaves the old file (or none), never a torn one; on an error the
    temporary is removed and WriteError names the file. force=False refuses an existing `path`
    (OutputExistsError); `path` is never one of `inputs`, even with force. Only a regular file (or
    an absent path) is ever replaced; a symbolic link to a regular file replaces that file
    (write_target).
    """
    p = Path(path)
    shown = p
    for q in inputs:
        try:
            same = os.path.samefile(p, q)
        except OSError:  # either does not exist: not the same file
            same = False
        if same:
            raise WriteError(f"{_clean(p)}: is also an input; write the output to another file")
    p = write_target(p)
    existed = os.path.lexists(p)
    if existed and not force:
        raise OutputExistsError(f"{_clean(shown)}: exists (use --force to overwrite)")
    d = p.parent
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=d)
        with os.fdopen(fd, "wb") as f:
            # mkstemp makes 0600 files; a dump is for sharing: keep the old file's mode, else rw-r--r--
            os.fchmod(f.fileno(), (os.stat(p).st_mode & 0o777) if existed and p.is_file() else 0o644)
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        if force:
            os.replace(tmp, p)
        else:
            _link_no_clobber(tmp, p)
        tmp = None
    except OutputExistsError:
        raise
    except OSError as e:
        keep = " (the previous file is unchanged)" if existed else ""
        raise WriteError(f"{_clean(shown)}: cannot write: {e.strerror or e}{keep}") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    try:
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass  # some filesystems refuse directory fsync; the rename itself is still atomic


def check_config(path: str | os.PathLike, config: DumpConfig, injected: dict | None = None) -> None:
    """Raise the DumpError a reader would raise for this config (so nothing unreadable is written)."""
    meta = {"dcptool.format": FORMAT_VERSION, "dcptool.config": json.dumps(config.to_json())}
    if injected is not None:
        meta["dcptool.injected"] = json.dumps(injected)
    _parse_config(os.fspath(path), meta)


def _narrow(a: np.ndarray, want: np.dtype, key: str) -> np.ndarray:
    """a in dtype `want`; a value it cannot hold is a DumpError (astype would wrap or truncate it silently)."""
    if a.size and a.dtype != want:
        if a.dtype.kind == "f" and not np.array_equal(a, np.trunc(a)):  # NaN, inf and 1.5 are not lengths
            bad = a[~(a == np.trunc(a))][0]
            raise DumpError(f"{key}: value {bad} is not an integer")
        if a.dtype.kind not in "iubf":
            raise DumpError(f"{key}: integer values expected, got dtype {a.dtype}")
        info = np.iinfo(want)
        lo, hi = a.min(), a.max()
        if lo < info.min or hi > info.max:
            raise DumpError(f"{key}: value {int(lo) if lo < info.min else int(hi)} does not fit {_DTYPE_NAMES[want]}")
    return a.astype(want, copy=False)


def _column(p: str, key: str, v) -> np.ndarray:
    """A column in its format dtype (checked: see _narrow)."""
    a = np.asarray(v)
    if key not in COLUMNS:
        return a
    try:
        return _narrow(a, _DTYPES[COLUMNS[key][0]], key)
    except DumpError as e:
        raise _fail(p, None, str(e)) from None


def write_dump(path: str | os.PathLike, config: DumpConfig, columns: dict[str, np.ndarray],
               injected: dict | None = None, *, force: bool = True, inputs=()) -> None:
    """Validate config and columns (so every dump we write reads back) and write them atomically."""
    p = os.fspath(path)
    check_config(p, config, injected)
    cols = {k: _column(p, k, v) for k, v in columns.items()}
    validate_columns(p, config, cols, injected)
    header, tensors = encode(config, cols, injected)
    atomic_write(path, [header] + [memoryview(a).cast("B") for _, a in tensors if a.nbytes], force=force,
                 inputs=inputs)


def write_observations(path: str | os.PathLike, observations: list[Observation], config: DumpConfig,
                       injected: dict | None = None, *, force: bool = True, inputs=()) -> DumpConfig:
    try:
        cfg, cols = pack(observations, config)
    except DumpError as e:
        raise _fail(os.fspath(path), None, str(e)) from None
    write_dump(path, cfg, cols, injected, force=force, inputs=inputs)
    return cfg


@dataclass
class DumpInfo:
    """What `dcptool inspect` shows: a dump's config, extent and which optional columns it holds."""

    files: list[str]
    format: str
    bytes: int
    config: DumpConfig
    observations: int
    with_view: int
    without_view: int
    steps: tuple[int, int] | None
    distinct_steps: int
    sites: dict[str, int]
    ranks: dict[int, int]
    ubatches: dict[int, int]
    seq_rows: int
    dcp_rows: int
    max_num_reqs: int
    max_num_reqs_padded: int
    optional: list[str]
    injected: dict[str, list[int]]

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["config"] = self.config.to_json()
        d["steps"] = list(self.steps) if self.steps else None
        d["ranks"] = {str(k): v for k, v in self.ranks.items()}
        d["ubatches"] = {str(k): v for k, v in self.ubatches.items()}
        return d


def describe(d: Dump) -> DumpInfo:
    def counts(a: np.ndarray) -> dict[int, int]:
        v, n = np.unique(a, return_counts=True)
        return {int(x): int(y) for x, y in zip(v, n)}

    step = d["obs.step"]
    has = int(d["obs.has_dcp"].sum())
    injected: dict[str, list[int]] = {}
    for inj in d.injected:
        for k, v in (inj or {}).items():
            injected.setdefault(k, []).extend(v)
    return DumpInfo(files=d.files, format=FORMAT_VERSION, bytes=sum(d.sizes), config=d.config, observations=d.n,
                    with_view=has, without_view=d.n - has,
                    steps=(int(step.min()), int(step.max())) if d.n else None,
                    distinct_steps=int(np.unique(step).size),
                    sites={d.config.sites[k]: v for k, v in counts(d["obs.site"]).items()},
                    ranks=counts(d["obs.rank"]), ubatches=counts(d["obs.ubatch"]),
                    seq_rows=int(d["rows.seq_lens"].size), dcp_rows=int(d["rows.dcp_local_seq_lens"].size),
                    max_num_reqs=int(d["obs.num_reqs"].max()) if d.n else 0,
                    max_num_reqs_padded=int(d["obs.num_reqs_padded"].max()) if d.n else 0,
                    optional=[k for k in OPTIONAL if k in d.columns], injected=injected)


def _release(m: tuple, lo: int, hi: int) -> None:
    """Drop the pages holding elements [lo, hi) of a mapped column (mmap, byte offset, itemsize) from
    this process (the file is untouched)."""
    mm, off, itemsize = m
    if hi <= lo or not hasattr(mm, "madvise"):
        return
    import mmap

    a = off + lo * itemsize
    b = off + hi * itemsize
    page = mmap.PAGESIZE
    a = -(-a // page) * page
    b = b // page * page
    if b > a:
        mm.madvise(mmap.MADV_DONTNEED, a, b - a)
