"""A Recorder's rolled files packed and written on a background thread, in order, so observe() does not stall."""

from __future__ import annotations

import threading
import warnings
from collections import deque
from dataclasses import dataclass, field

from dcptool.dump import FIELDS, ROW_FIELDS, DumpConfig, DumpError, WriteError, columns
from dcptool.dump import transfer as transfers


@dataclass
class Batch:
    """The observations of one file, taken from the Writer under its lock: the file's number is reserved then,
    so the files stay in observation order whatever fails and is retried."""

    index: int  # the file's number (rollover)
    start: int  # global index of its first observation
    vals: list
    sites: list
    rows: list  # host rows, or None (dropped at harvest)
    injected: dict | None  # simulate's faults {fault: [index in the batch]}
    meta: dict | None
    est: int = 0  # estimated bytes (the size cap)
    transfers: dict = field(default_factory=dict)  # index in the batch -> a transfer observation's rows


def pack(config: DumpConfig, b: Batch) -> tuple[DumpConfig, dict, list | None]:
    """The batch as dump columns (site indices stable across rolled files: config grows), and the file row of
    each kept observation (None when all were kept)."""
    vals, sites, rows, fs = b.vals, b.sites, b.rows, b.start
    where = None
    if any(r is None for r in rows):  # dropped at harvest: renumber the rest and their parents
        where, k = [], 0
        for r in rows:
            where.append(k if r is not None else -1)
            k += r is not None
        keep = [i for i, r in enumerate(rows) if r is not None]
        vals = [vals[i] for i in keep]
        sites = [sites[i] for i in keep]
        rows = [rows[i] for i in keep]
    out = []
    for v in vals:  # parent: index in this file, -1 when it went to an earlier file or was dropped
        p = v[5]
        if p is not None:
            p = p - fs if p >= fs else -1
            if where is not None and p >= 0:
                p = where[p]
            v = (*v[:5], p, *v[6:])
        out.append(v)
    n = len(sites)
    cv = dict(zip(FIELDS, zip(*out))) if n else {f: () for f in FIELDS}
    cr = dict(zip(ROW_FIELDS, zip(*rows))) if n else {k: () for k in ROW_FIELDS}
    config, cols = columns(config, sites, cv, cr)
    moved = b.transfers if where is None else {where[i]: t for i, t in b.transfers.items() if where[i] >= 0}
    cols.update(transfers.columns(n, moved))
    return config, cols, where


class Rolled:
    """The batches handed over and not written yet, oldest first, and the daemon thread that writes them in order
    through `write(batch)` (the Writer's: it packs and writes the batch's file, raising OSError or DumpError when
    it cannot, and accounts for it under the lock).

    One batch is written at a time, by the thread or (close(), the size cap) by the Writer's caller holding
    the lock once the thread is idle. A failed write keeps its batch at the head: the thread stops until the
    next hand-over (a rollover) or close() retries it inline. Bookkeeping under the Writer's lock (`cond`).
    """

    def __init__(self, lock, write):
        self.cond = threading.Condition(lock)
        self.queue: deque[Batch] = deque()
        self.busy = False  # a batch is being written (outside the lock)
        self.failed: tuple[Batch, str] | None = None  # the head's last failure, until the next hand-over
        self.write_errors = 0  # failed writes (each retried later); the last one in `last_error`
        self.last_error: str | None = None
        self.reported = 0  # write_errors already warned about
        self.warned = False
        self.sync = False  # write inline (the benchmark's baseline)
        self._write_batch = write
        self._thread: threading.Thread | None = None

    def kept(self) -> int:
        return sum(len(b.sites) for b in self.queue)

    def queued_bytes(self) -> int:
        return sum(b.est for b in self.queue)

    def hand_over(self, b: Batch) -> None:
        """Under the lock: queue the batch and wake the thread (which retries a failed head first)."""
        self.queue.append(b)
        self.failed = None
        if self.sync:
            self.write_all(raise_errors=False)
            return
        if self._thread is None:  # (a running thread takes the new batch after the ones before it)
            self._thread = threading.Thread(target=self._run, name="dcptool-recorder-writer", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        """Write the head batch until the queue is empty or a write failed; then end (the next hand-over starts
        another thread: none is left behind idle)."""
        while True:
            with self.cond:
                if not self.queue or self.failed is not None:
                    self._thread = None
                    self.cond.notify_all()
                    return
                b, self.busy = self.queue[0], True
            try:
                self._write(b)
            except Exception as e:  # (a bug: the thread stops, close() retries the batch inline and raises)
                self._failed(b, repr(e))
            finally:
                with self.cond:
                    self.busy = False
                    self.cond.notify_all()

    def wait(self) -> None:
        """Under the lock (released while waiting): until the thread is idle and has nothing it can write."""
        while self.busy or (self.queue and self.failed is None and self._thread is not None and not self.sync):
            self.cond.wait(0.1)

    def write_all(self, *, raise_errors: bool, kept: int = 0) -> None:
        """Under the lock, the thread idle: write the queued batches here, in order (close(), the size cap);
        `kept`: the observations the Writer keeps beside them (said in the error)."""
        self.wait()
        self.failed = None
        while self.queue:
            self._write(self.queue[0])
            if self.failed is not None:
                if not raise_errors:
                    self.report(stacklevel=5)
                else:
                    raise WriteError(f"{self.failed[1]} ({kept + self.kept()} observations kept in memory; call "
                                     "close() again once the problem is fixed)") from None
                return

    def report(self, stacklevel: int = 4) -> None:
        """Warn once about a failed write (from the engine's thread, where warnings are seen)."""
        if self.write_errors > self.reported:
            self.reported = self.write_errors
            if not self.warned:
                self.warned = True
                warnings.warn(f"dcptool Recorder could not write ({self.last_error}); keeping the observations and "
                              "retrying at the next rollover and at close()", RuntimeWarning, stacklevel=stacklevel)

    def _write(self, b: Batch) -> None:
        """Write one batch (the head), then drop it; a failure keeps it at the head."""
        try:
            self._write_batch(b)
        except (OSError, DumpError) as e:
            self._failed(b, str(e))
            return
        with self.cond:
            if self.queue and self.queue[0] is b:  # (else discard() emptied the queue meanwhile)
                self.queue.popleft()

    def _failed(self, b: Batch, why: str) -> None:
        with self.cond:
            self.write_errors += 1
            self.last_error = why
            self.failed = (b, why)
