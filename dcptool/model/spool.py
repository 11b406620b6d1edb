"""A long simulate run streamed to its files: the Recorders write a part every few thousand observations (cut at a step
boundary, so a micro-batch's parent is in its part), each part's columns are appended to a file per column, and at
the end each dump is written from those files, header first, byte for byte what one Recorder writes at close().
Memory holds one part, never the run."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from dcptool.dump import COLUMNS, OPTIONAL_FIELDS, DumpConfig, WriteError, check_config, encode_header, read_dump

PART_BYTES = 8 << 20  # a part's size on disk, about (memory holds ~10x that: the Recorder's observations as it keeps
# them, and the part before being appended on the part thread meanwhile)
FIRST_PART_OBS = 1024  # observations of the first part; later parts are sized from the bytes an observation took
CHUNK = 8 << 20  # bytes copied at a time from the column files into the dump
_UNKNOWN = {key: unknown for key, _, unknown in OPTIONAL_FIELDS.values()}  # (as dump.columns fills them)


class Column:
    """One dump's columns so far, each in a file of its own: what dump.columns would make of every observation seen."""

    def __init__(self, where: Path):
        self.where = where
        self.n = 0  # observations
        self.rows: dict[str, int] = {}  # offsets column -> its rows so far
        self.lengths: dict[str, tuple[np.dtype, int]] = {}  # column -> (dtype, values so far)
        self.config: DumpConfig | None = None
        self.bytes = 0

    def _put(self, key: str, a: np.ndarray) -> None:
        dtype, length = self.lengths[key]
        a = np.ascontiguousarray(a, dtype=dtype)
        with open(self.where / key, "ab") as f:
            f.write(memoryview(a).cast("B"))
        self.lengths[key] = (dtype, length + a.size)
        self.bytes += a.nbytes

    def add(self, part: Path) -> int:
        """Append the observations of a part file (then removed); returns how many it held."""
        d = read_dump(part)
        if self.config is None:
            self.config = d.config
        elif d.config != self.config:  # (the Recorders are given every site up front: a part cannot add one)
            raise RuntimeError(f"{part}: its config differs from the parts before it")
        c, n = d.columns, d.n
        seq, seq_before = int(c["obs.rows"][-1]), self.rows.get("obs.rows", 0)
        for key in sorted(set(c) | set(self.lengths)):
            kind = COLUMNS[key][1]
            if key not in self.lengths:  # first seen: what the observations before held (dump.columns's fill)
                self._backfill(key, kind, c[key].dtype, seq_before)
            if kind == "n":
                v = c[key] if key in c else np.full(n, _UNKNOWN[key], self.lengths[key][0])
                self._put(key, np.where(v >= 0, v + self.n, -1) if key == "obs.parent" and key in c else v)
            elif kind == "n+1":
                total = self.rows[key]
                self._put(key, c[key][1:] + total if key in c else np.full(n, total, np.int64))
                self.rows[key] = total + (int(c[key][-1]) if key in c else 0)
            elif key in c:
                self._put(key, c[key])
            elif key == "rows.kv_pages":  # (the rows of observations without kv_pages hold -1)
                self._put(key, np.full(seq, -1, self.lengths[key][0]))
        self.n += n
        del d, c
        part.unlink()
        return n

    def _backfill(self, key: str, kind: str, dtype: np.dtype, seq: int) -> None:
        self.lengths[key] = (dtype, 0)
        if kind == "n":
            self._put(key, np.full(self.n, _UNKNOWN.get(key, 0), dtype))  # (a required column: from the first part)
        elif kind == "n+1":
            self._put(key, np.zeros(self.n + 1, dtype))
            self.rows[key] = 0
        elif key == "rows.kv_pages":
            self._put(key, np.full(seq, -1, dtype))

    def chunks(self, injected: dict | None, path: Path, done: Callable[[int], None] | None = None) -> Iterator[bytes]:
        """The dump: its header, then each column from its file (removed once copied)."""
        check_config(path, self.config, injected)
        if injected is not None and any(i >= self.n for v in injected.values() for i in v):
            raise RuntimeError(f"{path}: an injected index past the {self.n} observations")
        yield encode_header(self.lengths, self.config, injected)
        for key in sorted(self.lengths):
            f = self.where / key
            with open(f, "rb") as src:
                while block := src.read(CHUNK):
                    yield block
                    if done is not None:
                        done(len(block))
            f.unlink()


class Parts:
    """Where a run's parts go: a hidden directory beside its first output (same file system), removed in any case. A
    part handed over is written and appended on a thread of its own while the run records the next (one part at a
    time: memory holds at most two)."""

    def __init__(self, outputs: list[Path]):
        first = outputs[0]
        self.outputs = outputs
        self.dir = Path(tempfile.mkdtemp(prefix=f".{first.name}.", suffix=".parts", dir=first.parent or Path(".")))
        self.columns = []
        for k in range(len(outputs)):
            (self.dir / str(k)).mkdir()
            self.columns.append(Column(self.dir / str(k)))
        self.count = 0
        self.part_obs = FIRST_PART_OBS
        self._recorded = [0] * len(outputs)  # observations handed over, per output
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dcptool-simulate-part")
        self._pending: Future | None = None

    def next(self) -> list[Path]:
        """The paths of the next part, one per output."""
        self.count += 1
        return [self.dir / f"{k}.part{self.count:06d}.safetensors" for k in range(len(self.columns))]

    def hand_over(self, recorders: list) -> list[int]:
        """The Recorders of a part (one per output, none recording any more): closed, and their files appended to the
        dumps' columns, on the part thread once the part before is done. Returns the observation count each output had
        before them (a Recorder keeps every observation it indexed: host values, checked as observe() took them)."""
        self.wait()
        before = list(self._recorded)
        self._recorded = [n + len(r) for n, r in zip(self._recorded, recorders)]
        self._pending = self._pool.submit(self._add, recorders)
        return before

    def wait(self) -> None:
        """Until the part handed over last is appended (its error raised here)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _add(self, recorders: list) -> None:
        parts = []
        for out, rec in zip(self.outputs, recorders):
            try:
                parts += rec.close()
            except WriteError:  # one line: the dump and the problem, not the Recorder's advice to call close() again
                rec.discard()
                raise WriteError(f"{out}: {rec.last_error}") from None
        size = [os.path.getsize(p) for p in parts]
        got = [c.add(p) for c, p in zip(self.columns, parts)]
        per_obs = max((s / g for s, g in zip(size, got) if g), default=0)
        if per_obs:  # the next parts sized from the bytes an observation took
            self.part_obs = int(min(1 << 18, max(64, PART_BYTES // per_obs)))

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self.columns)

    def close(self) -> None:
        """Wait for the part thread (whatever it raised: the caller fails already, or is done); remove the parts."""
        try:
            self.wait()
        except BaseException:
            pass
        self._pool.shutdown(wait=True)
        shutil.rmtree(self.dir, ignore_errors=True)
