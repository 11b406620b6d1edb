"""The streamed read: row columns read on a thread of their own, the scan following chunk by chunk."""

from __future__ import annotations

import os
import threading
from itertools import zip_longest

import numpy as np

from dcptool.dump import files
from dcptool.dump.schema import (
    COLUMNS,
    fail,
)

STREAM_PIECE = 8 << 20  # bytes per read of a streamed row column: the grain at which the scan follows the read
# the columns the scan reads chunk by chunk, read in step with each other (the rest after them, whole)
SCAN_ROWS = ("rows.seq_lens", "rows.dcp_local_seq_lens", "rows.kv_pages")


class Reader:
    """read_dump(stream=True)'s thread: the row columns in pieces (the scan's in step with each other, piece k of
    each before piece k + 1 of any), then the file unchanged and the whole validated. wait(key, n) blocks until
    the first n values of key are read; an error (a short or changed file, a rule of docs/format.md) wakes every
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
        self.stopped = False  # stop(): the caller failed before it needed the rows
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
                if self.stopped:
                    return
                files.pread(self.p, self.f, self.buf, at, nbytes, self.base, self.before.st_size)
                with self.cond:
                    self.got[key] = upto
                    if upto == self.need[key]:
                        self.pending.discard(key)
                    self.cond.notify_all()
            files.check_unchanged(self.p, self.f, self.before)
            self.validate()
        except OSError as e:
            self.error = fail(self.p, None, f"cannot read: {e.strerror or e}")
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
