"""Where a Recorder's observations go: the path it holds, what it keeps until written, numbered files, atomic writes."""

from __future__ import annotations

import atexit
import json
import os
import re
import sys
import threading
import warnings
from pathlib import Path

from dcptool.dump import DumpConfig, DumpError, OutputExistsError, Scalars, WriteError, write_dump
from dcptool.engine.recorder.claim import Claim
from dcptool.engine.recorder.rolled import Batch, Rolled, pack
from dcptool.engine.snapshot.harvest import Harvest
from dcptool.engine.snapshot.ring import FENCE_EVERY, Slot

CAP_EVERY = 1024  # observations kept between two size checks of a capped recording without rollover


class Writer:
    """A Recorder's observations from their index to a file, and the path they go to.

    Holds `path` on this host for the Recorder's life (claim.Claim: a second Recorder for it records beside it),
    keeps each observation (its scalars, site and rows) until it is written, writes `rollover` observations per
    numbered file (all at close() without rollover; a rolled file on a background thread: Rolled) and keeps what
    it could not write for a later retry; a Recorder that was never closed is closed at interpreter exit. With
    `max_bytes`, the recording stops at that size (_stop). The owner (the Recorder, its device path) calls
    append() and lost() under `lock`; `harvest` holds the device observations in flight and their copies.
    """

    def __init__(self, path: str | os.PathLike, config: DumpConfig, harvest: Harvest, lock: threading.RLock, *,
                 rollover: int | None = None, force: bool = False, max_bytes: int | None = None):
        self.requested_path = Path(path)
        self.config = config
        self.rollover = rollover
        self._lock = lock
        self._harvest = harvest
        self._claim_held: Claim | None = None
        self.path = self.requested_path
        self._stale = self._claim(force)
        self.injected: dict[str, list[int]] | None = None
        self.files: list[Path] = []
        # Per observation (its scalars, its site, its rows in dump.ROW_FIELDS order), turned into columns only at
        # write time (zip(*)): observe() stays one append, close() a handful of concatenations. The rows are a Slot
        # while its device values are in flight, None once dropped at harvest.
        self._kept: list[tuple[Scalars, str, tuple | Slot | None]] = []
        self._transfers: dict[int, dict] = {}  # global index -> a transfer observation's rows (dump.transfer)
        self.max_group = -1  # the highest KV-cache group index recorded (slot entries)
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
        self._index = 0  # the next file's number, reserved when its observations are taken
        self._rolled = Rolled(lock, self._write)
        self.closed = False
        atexit.register(self._at_exit)

    def append(self, vals: Scalars, site: str, row, transfer: dict | None = None) -> int:
        """Under the lock: give the observation its index and keep it (with a transfer observation's rows, by level:
        dump.transfer.levels_of); roll over when a file is full."""
        kept = self._kept
        kept.append((vals, site, row))
        if transfer is not None:
            self._transfers[self.count] = transfer
        self.count += 1
        if len(kept) >= self._retry_at:
            self._due()
        return self.count - 1

    def _due(self) -> None:
        """Under the lock: a file is full (rollover), or a capped recording's size is to be checked."""
        cap = self.max_bytes
        if cap is not None and self.bytes + self._rolled.queued_bytes() + self._kept_bytes() >= cap:
            self._stop()
        elif self.rollover is not None:
            self._flush(raise_errors=False)
        else:
            self._retry_at = len(self._kept) + CAP_EVERY

    def _kept_bytes(self) -> int:
        """The kept observations' bytes in a file, estimated (their rows, or their ring slots, and ~100 bytes of
        scalars each), adding the observations kept since the last call."""
        k, b = self._est
        for _, _, r in self._kept[k:]:
            b += 100 + (4 * r[2] if type(r) is Slot else 0 if r is None else
                        sum(a.nbytes for a in r if a is not None))
        self._est = (len(self._kept), b)
        return b

    def _stop(self) -> None:
        """Under the lock: the recording reached max_bytes. What is kept is written as its last file, whose
        metadata says so (`dcptool.capped`); observe() records nothing more and counts what it refuses."""
        self.stopped = True
        self._meta = {"dcptool.capped": json.dumps({"max_bytes": self.max_bytes})}
        try:
            self._harvest.harvest(wait=True)  # (once: the slots in flight land, so the last file holds them)
        except Exception as e:
            self._harvest.abandon(e)
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

    def saw_group(self, group: int) -> None:
        """Under the lock: an observation's slot entries name KV-cache group `group`."""
        if group > self.max_group:
            self.max_group = group

    def lost(self, index: int) -> None:
        """Under the lock: observation `index` (not written yet) is dropped after all (its device values)."""
        i = index - self._file_start
        vals, site, _ = self._kept[i]
        self._kept[i] = (vals, site, None)
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
            held = Claim.take(cand)
            if held is None:
                continue
            stale = self._earlier_files(cand)
            if stale and (taken is not None or not force):
                held.release()
                if taken is None:
                    raise OutputExistsError(f"{stale[0]}: exists (an earlier recording; pass force=True to replace it)")
                continue  # a separated recording never replaces anything
            self._release()
            self._claim_held = held
            self.path = cand
            if taken is not None:
                warnings.warn(f"dcptool Recorder: {taken}; recording to {cand} instead", RuntimeWarning, stacklevel=4)
            return stale
        raise OutputExistsError(f"{base}: no free name beside it for a second recording")

    def _release(self) -> None:
        if self._claim_held is not None:
            self._claim_held.release()
        self._claim_held = None

    # ---- the files ---------------------------------------------------------------------------------

    def _target(self, index: int) -> Path:
        if self.rollover is None:
            return self.path
        return self.path.with_name(f"{self.path.stem}.{index:05d}{self.path.suffix or '.safetensors'}")

    def _take(self, n: int | None = None) -> Batch:
        """Under the lock: the first n observations kept (all by default) as the next file's batch, its number
        reserved; packing and writing it happen outside the lock (Rolled)."""
        n = len(self._kept) if n is None else n
        vals, sites, rows = (list(x) for x in zip(*self._kept[:n])) if n else ([], [], [])
        if any(type(r) is Slot for r in rows):  # harvested device observations: their rows from the copies
            rows = self._harvest.rows(rows)
        est = self._kept_bytes() if self.max_bytes is not None else 0
        lo = self._file_start
        injected = None if self.injected is None else {
            k: [i - lo for i in v if lo <= i < lo + n] for k, v in self.injected.items()}
        moved = [i for i in self._transfers if i < lo + n]
        b = Batch(self._index, lo, vals, sites, rows, injected, self._meta,
                  transfers={i - lo: self._transfers.pop(i) for i in moved})
        del self._kept[:n]
        self._index += 1
        self._file_start += n
        self._est = (0, 0)
        if self.max_bytes is not None:
            b.est = est - self._kept_bytes()
        return b

    def _flush(self, *, raise_errors: bool) -> None:
        n = None
        oldest = self._harvest.settle(wait=raise_errors)
        if oldest is not None:  # device values still in flight: write the observations before
            n = oldest - self._file_start
            if n == 0:
                # try again once some have landed (a rolled file may hold a few more than `rollover`)
                self._retry_at = len(self._kept) + min(FENCE_EVERY, self.rollover or FENCE_EVERY)
                return
        self._retry_at = self._every
        rolled = self._rolled
        if self._kept or not (self.files or rolled.queue):  # (the first n: the rest is still in flight)
            b = self._take(n)
            if not (raise_errors or self.stopped):  # a rollover: the thread writes it, the engine goes on
                rolled.report(stacklevel=5)  # (an earlier rolled file that failed: warned once)
                rolled.hand_over(b)
                return
            rolled.queue.append(b)
        rolled.write_all(raise_errors=raise_errors, kept=len(self._kept))  # close(), the size cap: here

    def close(self) -> list[Path]:
        """Recorder.close(): write what is left once the device values in flight have landed."""
        with self._lock:
            if self.closed:
                return self.files
            try:
                self._harvest.harvest(wait=True)
            except Exception as e:  # the device is gone (a CUDA error, interpreter exit): keep the rest
                self._harvest.abandon(e)
            self._flush(raise_errors=True)
            self.closed = self.stopped = True
            self._release()
            atexit.unregister(self._at_exit)
            return self.files

    def flush(self) -> None:
        """Recorder.flush(): wait until every rolled file handed over is written (or its write failed)."""
        with self._lock:
            self._rolled.wait()
            self._rolled.report(stacklevel=4)

    def discard(self) -> None:
        """Recorder.discard(): write nothing more, not even at exit."""
        self._kept = []
        self._transfers = {}
        self._rolled.queue.clear()
        self.closed = self.stopped = True
        atexit.unregister(self._at_exit)
        self._release()  # (the path is free again: a new Recorder of it records there, not beside it)

    @property
    def write_errors(self) -> int:
        """Failed writes (each retried later); the last one in `last_error`."""
        return self._rolled.write_errors

    @property
    def last_error(self) -> str | None:
        return self._rolled.last_error

    def _write(self, b: Batch) -> None:
        """Pack and write one batch as its numbered file (outside the lock; Rolled calls it in file order), then,
        under the lock, account for it. Raises WriteError (naming the file) when it cannot be written."""
        with self._lock:
            config = self.config
        target = self._target(b.index)
        try:
            config, target, size = self._write_file(b, config, target)
        except (OSError, DumpError) as e:
            raise WriteError(f"{target}: {e}" if str(target) not in str(e) else str(e)) from None
        with self._lock:
            self.config = DumpConfig(**{**self.config.__dict__, "sites": config.sites})  # (kv_groups may change)
            self.bytes += size
            self._stale = []
            self.files.append(Path(target))
            b.vals = b.rows = []  # (their copies' chunks go back to the pool once nothing refers to them)
            self._harvest.written(b.start + len(b.sites))  # (the copies no observation still to write points into)

    def _write_file(self, b: Batch, config: DumpConfig, target: Path) -> tuple[DumpConfig, Path, int]:
        """The batch's file at `target` (or, where another writer made that, beside it); its config, path, size."""
        config, cols, where = pack(config, b)
        injected = None
        if b.injected is not None:
            injected = {k: [i if where is None else where[i] for i in v if where is None or where[i] >= 0]
                        for k, v in b.injected.items()}
        replace = target in self._stale  # force=True: the earlier recording goes when this one has a file
        for f in self._stale:
            if f != target:
                f.unlink(missing_ok=True)
        if not replace and os.path.lexists(target):  # someone else wrote our file: never replace it
            with self._lock:
                self._claim(False, taken=f"{target} was written by another writer")
            target = self._target(b.index)
        write_dump(target, config, cols, injected, extra_metadata=b.meta)
        return config, target, os.path.getsize(target)

    def _at_exit(self) -> None:
        try:
            self.close()
        except WriteError as e:
            lost = len(self._kept) + self._rolled.kept()
            warnings.warn(f"dcptool Recorder lost {lost} observations at exit: {e}", RuntimeWarning, stacklevel=1)
