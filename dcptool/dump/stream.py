"""The streamed read: row columns read on a thread of their own, the scan following chunk by chunk. One file, or
several read end to end into one array per column (open_dumps): file f's rows of a column follow file f - 1's."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from itertools import zip_longest

import numpy as np

from dcptool.dump import files
from dcptool.dump.schema import (
    fail,
)

STREAM_PIECE = 8 << 20  # bytes per read of a streamed row column: the grain at which the scan follows the read
# the columns the scan reads chunk by chunk, read in step with each other (the rest after them, whole)
SCAN_ROWS = ("rows.seq_lens", "rows.dcp_local_seq_lens", "rows.kv_pages")


@dataclass(frozen=True)
class Source:
    """One file of a streamed read: where its row columns lie in it and where they go, and the check of their
    values once they are in.

    `rows`: key -> (file offset, values, destination): the column's bytes in the file, and the uint8 array they
    are read into (a view of the file's buffer, or of the column of several files); `before`: the file's stat when
    its header was read (the file must still be that file); `validate`: the row values' rules, called once all of
    this file's rows are in; `f`: the file, open since its header was read (read from it, whatever its path names
    now, and closed by the reader), or None: opened again by path, refused unless it is still that file."""

    p: str
    rows: dict[str, tuple[int, int, np.ndarray]]
    before: os.stat_result
    validate: Callable[[], None]
    f: object | None = None


@dataclass(frozen=True)
class Piece:
    """One read: bytes [at, at + nbytes) of file `src` into `into`; then the first `upto` values of `key` (the whole
    column, every file) are in."""

    src: int
    key: str
    at: int
    nbytes: int
    into: memoryview
    upto: int


def plan(sources: list[Source]) -> list[Piece]:
    """The reads in order: first the scan's columns of every file in turn, cut into pieces of STREAM_PIECE bytes and
    taken piece by piece (piece k of each before piece k + 1 of any), then each file's other columns in pieces. A
    column's values come in from its first to its last, file after file (what `upto` counts)."""
    got: dict[str, int] = {}

    def cut(s: int, k: str, parts: int) -> list[Piece]:
        at, count, dest = sources[s].rows[k]
        item = dest.size // max(count, 1)
        edges = [count * i // parts for i in range(parts + 1)]
        base = got.get(k, 0)
        got[k] = base + count
        view = memoryview(dest)
        return [Piece(s, k, at + lo * item, (hi - lo) * item, view[lo * item : hi * item], base + hi)
                for lo, hi in zip(edges, edges[1:]) if hi > lo]

    def parts(s: int, *keys: str) -> int:  # pieces of STREAM_PIECE bytes for the largest of the columns
        return max(1, -(-max(sources[s].rows[k][2].size for k in keys) // STREAM_PIECE))

    out: list[Piece] = []
    for s, src in enumerate(sources):
        scan = [k for k in SCAN_ROWS if k in src.rows]
        if scan:
            n = parts(s, *scan)
            out += [x for step in zip_longest(*(cut(s, k, n) for k in scan)) for x in step if x is not None]
    for s, src in enumerate(sources):
        out += [x for k in src.rows if k not in SCAN_ROWS for x in cut(s, k, parts(s, k))]
    return out


class Reader:
    """The row columns of `sources` read on a thread of their own (`plan`), each file checked unchanged and its
    values validated once its rows are in. wait(key, n) blocks until the first n values of key are read; an error
    (a short or changed file, a rule of docs/format.md) wakes every waiter and is raised by wait() and finish()."""

    def __init__(self, sources: list[Source]) -> None:
        self.sources = sources
        self.need: dict[str, int] = {}  # values of each row column (every file)
        for s in sources:
            for k, (_at, count, _dest) in s.rows.items():
                self.need[k] = self.need.get(k, 0) + count
        self.got = dict.fromkeys(self.need, 0)
        self.pending = {k for k, n in self.need.items() if n}  # columns not read whole yet
        self.error: BaseException | None = None
        self.done = False
        self.stopped = False  # stop(): the caller failed before it needed the rows
        self.cond = threading.Condition()
        self.plan = self._plan()
        self.thread = threading.Thread(target=self._run, daemon=True, name="dcptool-read")
        self.thread.start()

    def _plan(self) -> list[Piece]:
        return plan(self.sources)

    def _run(self) -> None:
        last = {x.src: i for i, x in enumerate(self.plan)}  # each file's last read: then it is checked
        open_ = {s: src.f for s, src in enumerate(self.sources) if src.f is not None}
        cur = -1
        try:
            for i, x in enumerate(self.plan):
                if self.stopped:
                    return
                src, cur = self.sources[x.src], x.src
                f = open_.get(x.src)
                if f is None:
                    for s in [s for s in open_ if self.sources[s].f is None]:  # (one file opened by path at a time)
                        open_.pop(s).close()
                    f = open_[x.src] = self._open(src)
                files.pread(src.p, f, x.into, x.at, x.nbytes, x.at, src.before.st_size)
                if last[x.src] == i:
                    files.check_unchanged(src.p, f, src.before)
                    open_.pop(x.src).close()
                    src.validate()
                with self.cond:
                    self.got[x.key] = x.upto
                    if x.upto == self.need[x.key]:
                        self.pending.discard(x.key)
                    self.cond.notify_all()
            for s, src in enumerate(self.sources):
                if s not in last:  # (no row bytes to read: its values are checked all the same)
                    src.validate()
        except OSError as e:
            self.error = fail(self.sources[max(cur, 0)].p, None, f"cannot read: {e.strerror or e}")
        except BaseException as e:  # a DumpError, or what the caller should see as this read's failure
            self.error = e
        finally:
            for f in open_.values():
                f.close()
            for src in self.sources:  # (a file never read: the read stopped or failed first)
                if src.f is not None:
                    src.f.close()
            with self.cond:
                self.done = True
                self.cond.notify_all()

    @staticmethod
    def _open(src: Source):
        """src's file opened again, refused unless it is still the file whose header was read."""
        f = files.open_file(src.p)
        try:
            files.check_unchanged(src.p, f, src.before)
        except BaseException:
            f.close()
            raise
        return f

    def wait(self, key: str, n: int | None = None) -> None:
        """Until the first n values of `key` are read (None: all of it); raises the read's error."""
        need = self.need.get(key, 0) if n is None else min(int(n), self.need.get(key, 0))
        with self.cond:
            while self.got.get(key, need) < need and self.error is None and not self.done:
                self.cond.wait()
        if self.error is not None:
            raise self.error
        if self.got.get(key, need) < need:  # (the read ended without these values: never hand out unread bytes)
            raise RuntimeError(f"{self.sources[0].p}: {key}: the streamed read ended at value {self.got[key]} of "
                               f"{need}")

    def finish(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        """End the read after the piece in hand, and wait for the thread (it closes the file)."""
        self.stopped = True
        self.thread.join()


class Streamed(dict):
    """A streamed dump's columns: reading one waits until it is read (Dump.upto waits for its first values)."""

    def __init__(self, cols: dict, reader: Reader) -> None:
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
