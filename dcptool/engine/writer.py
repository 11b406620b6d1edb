"""Where a Recorder's observations go: the path it holds, what it keeps until written, numbered files, atomic writes."""

from __future__ import annotations

import atexit
import errno
import hashlib
import json
import os
import re
import socket
import sys
import threading
import warnings
from pathlib import Path

from dcptool.dump import FIELDS, ROW_FIELDS, DumpConfig, DumpError, OutputExistsError, WriteError, columns, write_dump
from dcptool.engine.arguments import Fields
from dcptool.engine.ring import FENCE_EVERY, _Slot

CAP_EVERY = 1024  # observations kept between two size checks of a capped recording without rollover


class Writer:
    """A Recorder's observations from their index to a file, and the path they go to.

    Holds `path` on this host for the Recorder's life (a second Recorder for it records beside it), keeps each
    observation (its scalars, site and rows) until it is written, writes `rollover` observations per numbered
    file (all at close() without rollover) and keeps what it could not write for a later retry; a Recorder
    that was never closed is closed at interpreter exit. With `max_bytes`, the recording stops at that size
    (_stop). The owner (the Recorder, its DevicePath) calls append() and lost() under `lock`; `device` (set by
    the owner) holds the slots in flight and their copies.
    """

    def __init__(self, path: str | os.PathLike, config: DumpConfig, rollover: int | None, force: bool,
                 lock: threading.RLock, max_bytes: int | None = None):
        self.requested_path = Path(path)
        self.config = config
        self.rollover = rollover
        self._lock = lock
        self.device = None  # the owner's DevicePath
        self._claim_sock = None
        self.path = self.requested_path
        self._stale = self._claim(force)
        self.injected: dict[str, list[int]] | None = None
        self.write_errors = 0  # failed writes (each retried later); the last one in `last_error`
        self.last_error: str | None = None
        self.files: list[Path] = []
        # One tuple of scalars and one of row arrays per observation, turned into columns only at write
        # time (zip(*)): observe() stays a couple of appends, close() a handful of concatenations. A row
        # entry is a _Slot while its device values are in flight, None once dropped at harvest.
        self._vals: list[Fields] = []
        self._sites: list[str] = []
        self._rows: list = []  # per dump.ROW_FIELDS: (seq_lens, dcp_local_seq_lens, query_start_loc, kv_pages, ...)
        self.count = 0  # observation indices handed out over all files
        self.late = 0  # of them, dropped at harvest
        self._file_start = 0  # global index of the current file's first observation
        self.max_bytes = max_bytes
        self.bytes = 0  # of the files written
        self.capped = 0  # observations not recorded because the recording reached max_bytes
        self.stopped = False  # closed, or max_bytes reached: nothing more is recorded
        self._meta: dict[str, str] | None = None  # the last file's `dcptool.capped` once max_bytes is reached
        self._est = (0, 0)  # (kept observations sized, their estimated bytes): the size cap's running estimate
        self._every = rollover or (CAP_EVERY if max_bytes is not None else sys.maxsize)
        self._retry_at = self._every  # pending observations that trigger the next write (or size check)
        self._warned_write = False
        self.closed = False
        atexit.register(self._at_exit)

    def append(self, vals: Fields, site: str, row) -> int:
        """Under the lock: give the observation its index and keep it; roll over when a file is full."""
        self._vals.append(vals)
        self._sites.append(site)
        self._rows.append(row)
        self.count += 1
        if len(self._sites) >= self._retry_at:
            self._due()
        return self.count - 1

    def _due(self) -> None:
        """Under the lock: a file is full (rollover), or a capped recording's size is to be checked."""
        if self.max_bytes is not None and self.bytes + self._kept_bytes() >= self.max_bytes:
            self._stop()
        elif self.rollover is not None:
            self._flush(raise_errors=False)
        else:
            self._retry_at = len(self._sites) + CAP_EVERY

    def _kept_bytes(self) -> int:
        """The kept observations' bytes in a file, estimated (their rows, or their ring slots, and ~100 bytes of
        scalars each), adding the observations kept since the last call."""
        k, b = self._est
        for r in self._rows[k:]:
            b += 100 + (4 * r[2] if type(r) is _Slot else 0 if r is None else
                        sum(a.nbytes for a in r if a is not None))
        self._est = (len(self._rows), b)
        return b

    def _stop(self) -> None:
        """Under the lock: the recording reached max_bytes. What is kept is written as its last file, whose
        metadata says so (`dcptool.capped`); observe() records nothing more and counts what it refuses."""
        self.stopped = True
        self._meta = {"dcptool.capped": json.dumps({"max_bytes": self.max_bytes})}
        try:
            self.device.harvest(wait=True)  # (once: the slots in flight land, so the last file holds them)
        except Exception as e:
            self.device.abandon(e)
        warnings.warn(f"dcptool Recorder: the recording reached its size cap ({self.max_bytes:,} bytes: max_bytes=, "
                      "DCPTOOL_RECORD_MAX_GB); it records nothing more (counted in `capped`)", RuntimeWarning,
                      stacklevel=5)
        self._flush(raise_errors=False)

    def refuse(self, n: int = 1) -> None:
        """observe() once nothing more is recorded: RuntimeError after close(), else (the size cap) count them."""
        if self.closed:
            raise RuntimeError("observe() after close()")
        with self._lock:
            self.capped += n

    def lost(self, index: int) -> None:
        """Under the lock: observation `index` (not written yet) is dropped after all (its device values)."""
        self._rows[index - self._file_start] = None
        self.late += 1

    # ---- one recording per path -----------------------------------------------------------------

    def _earlier_files(self, path: Path) -> list[Path]:
        """What an earlier recording at this path left: the file, or with rollover its numbered files."""
        if self.rollover is None:
            return [path] if os.path.lexists(path) else []
        pat = re.compile(re.escape(path.stem) + r"\.\d{5}" + re.escape(path.suffix or ".safetensors"))
        try:
            return sorted(path.parent / n for n in os.listdir(path.parent) if pat.fullmatch(n))
        except OSError:
            return []  # the directory may not exist yet; writing will say so

    @staticmethod
    def _hold(path: Path):
        """Hold `path` for this Recorder's life: an abstract Unix socket named after it (this host, this
        network namespace), which the kernel releases when the process dies, so a killed recording
        leaves no lock file behind. None when another Recorder holds it; True where there are no such
        sockets (the per-write existence check still guards)."""
        try:
            where = os.path.join(os.path.realpath(path.parent), path.name)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except (OSError, AttributeError):
            return True
        try:
            s.bind(b"\0dcptool-recorder:" + hashlib.sha1(os.fsencode(where)).hexdigest().encode())
        except OSError as e:
            s.close()
            return None if e.errno == errno.EADDRINUSE else True  # held by another; else: no such sockets
        return s

    def _claim(self, force: bool, taken: str | None = None) -> list[Path]:
        """Take `self.path` (or, when another writer has it, the first free STEM.pPID[-k] beside it) and
        return the earlier recording it replaces. Raises OutputExistsError for one without force."""
        base = self.requested_path
        suffix = base.suffix or ".safetensors"
        for k in range(1000):
            cand = base if k == 0 and taken is None else base.with_name(
                f"{base.stem}.p{os.getpid()}{'' if k < 2 else f'-{k}'}{suffix}")
            if k == 1 and taken is None:
                taken = f"{base} is being recorded by another Recorder"
            if cand == self.path and taken is not None:
                continue
            held = self._hold(cand)
            if held is None:
                continue
            stale = self._earlier_files(cand)
            if stale and (taken is not None or not force):
                if held is not True:
                    held.close()
                if taken is None:
                    raise OutputExistsError(f"{stale[0]}: exists (an earlier recording; pass force=True to replace it)")
                continue  # a separated recording never replaces anything
            if self._claim_sock is not None and self._claim_sock is not True:
                self._claim_sock.close()
            self._claim_sock = held
            self.path = cand
            if taken is not None:
                warnings.warn(f"dcptool Recorder: {taken}; recording to {cand} instead", RuntimeWarning, stacklevel=4)
            return stale
        raise OutputExistsError(f"{base}: no free name beside it for a second recording")

    def _release(self) -> None:
        if self._claim_sock is not None and self._claim_sock is not True:
            self._claim_sock.close()
        self._claim_sock = None

    # ---- the files ---------------------------------------------------------------------------------

    def _target(self) -> Path:
        if self.rollover is None:
            return self.path
        return self.path.with_name(f"{self.path.stem}.{len(self.files):05d}{self.path.suffix or '.safetensors'}")

    def _pack(self, n: int) -> tuple[dict, list | None]:
        """The first n observations since the last file, as dump columns (site indices stable across rolled
        files), and the file row of each kept observation (None when all were kept)."""
        vals, sites, rows = self._vals[:n], self._sites[:n], self._rows[:n]
        if any(type(r) is _Slot for r in rows):  # harvested device observations: their rows from the copies
            pending = self.device.ring.pending
            rows = self.device.landed.rows(rows, pending[0][0] if pending else None)
        fs = self._file_start
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
        self.config, cols = columns(self.config, sites, cv, cr)
        return cols, where

    def _write_current(self, n: int | None = None) -> None:
        """Write the first n observations kept (all by default) to the next file."""
        target = self._target()
        n = len(self._sites) if n is None else n
        cols, where = self._pack(n)
        injected = None
        if self.injected is not None:
            lo, hi = self._file_start, self._file_start + n
            injected = {k: [i - lo if where is None else where[i - lo] for i in v if lo <= i < hi
                            and (where is None or where[i - lo] >= 0)] for k, v in self.injected.items()}
        replace = target in self._stale  # force=True: the earlier recording goes when this one has a file
        for f in self._stale:
            if f != target:
                f.unlink(missing_ok=True)
        if not replace and os.path.lexists(target):  # someone else wrote our file: never replace it
            self._claim(False, taken=f"{target} was written by another writer")
            target = self._target()
        write_dump(target, self.config, cols, injected, extra_metadata=self._meta)
        self.bytes += os.path.getsize(target)
        self._est = (0, 0)
        self._stale = []
        self.files.append(target)
        self._file_start += n
        self.device.landed.written(self._file_start)  # (the copies no observation still to write points into)
        self._vals, self._sites, self._rows = self._vals[n:], self._sites[n:], self._rows[n:]

    def _flush(self, *, raise_errors: bool) -> None:
        n = None
        ring = self.device.ring
        if ring is not None and ring.pending:  # device values still in flight: write the observations before
            self.device.harvest(wait=raise_errors)
            if ring.pending:
                ring.fence()  # (so that they land soon)
                n = ring.pending[0][0] - self._file_start
                if n == 0:
                    # try again once some have landed (a rolled file may hold a few more than `rollover`)
                    self._retry_at = len(self._sites) + min(FENCE_EVERY, self.rollover or FENCE_EVERY)
                    return
        try:
            if n is None:
                self._write_current()
            else:
                self._write_current(n)  # (the first n: the rest is still in flight)
        except (OSError, DumpError) as e:
            self.write_errors += 1
            self.last_error = str(e)
            if self.rollover is not None:
                self._retry_at = len(self._sites) + self.rollover  # keep them; try again a rollover later
            if raise_errors:
                raise WriteError(f"{e} ({len(self._sites)} observations kept in memory; call close() again "
                                 "once the problem is fixed)") from None
            if not self._warned_write:
                self._warned_write = True
                warnings.warn(f"dcptool Recorder could not write ({e}); keeping the observations and retrying "
                              "at the next rollover and at close()", RuntimeWarning, stacklevel=4)
            return
        self._retry_at = self._every

    def close(self) -> list[Path]:
        """Recorder.close(): write what is left once the device values in flight have landed."""
        with self._lock:
            if self.closed:
                return self.files
            try:
                self.device.harvest(wait=True)
            except Exception as e:  # the device is gone (a CUDA error, interpreter exit): keep the rest
                self.device.abandon(e)
            if self._sites or not self.files:
                self._flush(raise_errors=True)
            self.closed = self.stopped = True
            self._release()
            atexit.unregister(self._at_exit)
            return self.files

    def discard(self) -> None:
        """Recorder.discard(): write nothing more, not even at exit."""
        self._vals, self._sites, self._rows = [], [], []
        self.closed = self.stopped = True
        atexit.unregister(self._at_exit)

    def _at_exit(self) -> None:
        try:
            self.close()
        except WriteError as e:
            warnings.warn(f"dcptool Recorder lost {len(self._sites)} observations at exit: {e}", RuntimeWarning,
                          stacklevel=1)
