"""The Recorder an engine calls: copy each observation to host memory at once, write dumps atomically."""

from __future__ import annotations

import atexit
import os
import re
import warnings
from pathlib import Path

import numpy as np

from dcptool.dump import (
    INT32_MAX,
    DumpConfig,
    DumpError,
    Observation,
    OutputExistsError,
    WriteError,
    check_config,
    pack,
    write_dump,
)

GRAPH = {"eager": 0, "piecewise": 1, "capture": 2, "full-capture": 2, "replay": 3, "full-replay": 3}
_I32 = (-(2**31), INT32_MAX)
_I64 = (-(2**63), 2**63 - 1)


def _host(x, name: str, lo: int = _I32[0], hi: int = _I32[1]) -> np.ndarray | None:
    """A private int32 host copy of a tensor / array / list (never a view of engine memory).

    Values int32 cannot hold raise (the observation is dropped) instead of wrapping silently.
    """
    if x is None:
        return None
    if hasattr(x, "detach"):  # torch.Tensor, on any device: .cpu() syncs on that device's stream
        x = x.detach().to("cpu").numpy()
    a = np.asarray(x).reshape(-1)
    if a.dtype.kind not in "iub":
        raise ValueError(f"{name}: integer values expected, got dtype {a.dtype}")
    if a.size and (int(a.min()) < lo or int(a.max()) > hi):
        raise ValueError(f"{name}: values must lie in [{lo}, {hi}], got [{int(a.min())}, {int(a.max())}]")
    return np.array(a, dtype=np.int32, copy=True)


def _int(v, name: str, lo: int, hi: int = INT32_MAX) -> int:
    v = int(v)
    if not lo <= v <= hi:
        raise ValueError(f"{name} = {v} outside [{lo}, {hi}]")
    return v


def _opt(v, name: str, lo: int = -1, hi: int = INT32_MAX) -> int | None:
    return None if v is None else _int(v, name, lo, hi)


def buffer_id(t) -> int:
    """Identity of the storage a tensor view aliases (0 when unknown): its storage's base address."""
    try:
        return int(t.untyped_storage().data_ptr())
    except Exception:
        return 0


class Recorder:
    """Record observations; `close()` (or leaving a `with` block) writes the dump atomically.

    `observe()` never raises into the engine: a value it cannot store is counted in `dropped` and
    warned about once. With `rollover=K`, every K observations go to a new numbered file
    (`run.00000.safetensors`, `run.00001.safetensors`, ...) so a long run never risks one huge file and
    everything up to the last rollover survives a killed process. Read the files together.

    Nothing is lost quietly: an existing recording at `path` (or its numbered files) is refused
    unless `force=True`, which replaces it (numbered files included); a rollover file that cannot
    be written (disk full) is kept in memory, warned about, and retried at the next rollover and at
    close(), which raises WriteError if it still fails (call it again once there is room). A
    Recorder that was never closed is closed at interpreter exit. A killed process leaves every
    file it completed intact, and at most a hidden `.NAME.*.tmp` temporary that no reader uses.
    """

    def __init__(self, path: str | os.PathLike, dcp_size: int, cp_interleave: int = 1, *,
                 sites: tuple[str, ...] = (), pcp_size: int = 1, page_size: int | None = None,
                 engine: str | None = None, engine_version: str | None = None, note: str | None = None,
                 rollover: int | None = None, force: bool = False):
        self.path = Path(path)
        self.config = DumpConfig(dcp_size=dcp_size, cp_interleave=cp_interleave, sites=tuple(sites),
                                 pcp_size=pcp_size, page_size=page_size, engine=engine,
                                 engine_version=engine_version, note=note)
        check_config(self.path, self.config)  # a bad config fails here, not hours later at close()
        if rollover is not None and rollover < 1:
            raise ValueError(f"rollover must be >= 1, got {rollover}")
        self.rollover = rollover
        self._stale = self._earlier_files()
        if self._stale and not force:
            raise OutputExistsError(f"{self._stale[0]}: exists (an earlier recording; pass force=True to replace it)")
        self.injected: dict[str, list[int]] | None = None
        self.dropped = 0
        self.write_errors = 0  # failed writes (each retried later); the last one in `last_error`
        self.last_error: str | None = None
        self.files: list[Path] = []
        self._obs: list[Observation] = []
        self._count = 0  # observations accepted over all files
        self._file_start = 0  # global index of the current file's first observation
        self._retry_at = rollover  # pending observations that trigger the next write
        self._warned = False
        self._warned_write = False
        self._closed = False
        atexit.register(self._at_exit)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return self._count

    def _earlier_files(self) -> list[Path]:
        """What an earlier recording at this path left: the file, or with rollover its numbered files."""
        if self.rollover is None:
            return [self.path] if os.path.lexists(self.path) else []
        pat = re.compile(re.escape(self.path.stem) + r"\.\d{5}" + re.escape(self.path.suffix or ".safetensors"))
        try:
            return sorted(self.path.parent / n for n in os.listdir(self.path.parent) if pat.fullmatch(n))
        except OSError:
            return []  # the directory may not exist yet; writing will say so

    def observe(self, *, step: int, site: str, rank: int, seq_lens, num_reqs: int, num_reqs_padded: int,
                dcp_local_seq_lens=None, ubatch: int = -1, parent: int | None = None, req_start: int | None = None,
                tok_start: int | None = None, tok_stop: int | None = None, query_start_loc=None,
                num_tokens_padded: int | None = None, buffer: int | None = None, graph: int | str | None = None,
                kv_pages=None) -> int:
        """Record one attention-metadata build; returns its index (pass it as `parent=` later), -1 if dropped."""
        try:
            o = self._observation(step, site, rank, seq_lens, num_reqs, num_reqs_padded, dcp_local_seq_lens,
                                  ubatch, parent, req_start, tok_start, tok_stop, query_start_loc,
                                  num_tokens_padded, buffer, graph, kv_pages)
        except Exception as e:  # never break the engine
            self.dropped += 1
            if not self._warned:
                self._warned = True
                warnings.warn(f"dcptool Recorder dropped an observation it cannot store ({e}); "
                              "counting further drops silently", RuntimeWarning, stacklevel=2)
            return -1
        self._obs.append(o)
        self._count += 1
        if self.rollover is not None and len(self._obs) >= self._retry_at:
            self._flush(raise_errors=False)
        return self._count - 1

    def _observation(self, step, site, rank, seq_lens, num_reqs, num_reqs_padded, dcp_local_seq_lens, ubatch,
                     parent, req_start, tok_start, tok_stop, query_start_loc, num_tokens_padded, buffer, graph,
                     kv_pages) -> Observation:
        """Check every value against what the dump format can hold (DESIGN §2), so close() never fails on it."""
        if self._closed:
            raise RuntimeError("observe() after close()")
        c = self.config
        if not isinstance(site, str) or not site.isprintable():
            raise ValueError(f"site must be a printable string, got {site!r}")
        seq = _host(seq_lens, "seq_lens", 0)
        nr = _int(num_reqs, "num_reqs", 0)
        nrp = _int(num_reqs_padded, "num_reqs_padded", nr)
        if seq.size < nr:
            raise ValueError(f"{seq.size} seq_lens rows for num_reqs {nr}")
        if buffer is None and dcp_local_seq_lens is not None and hasattr(dcp_local_seq_lens, "untyped_storage"):
            buffer = buffer_id(dcp_local_seq_lens)
        if isinstance(graph, str):
            graph = GRAPH[graph]
        qsl = _host(query_start_loc, "query_start_loc")
        if qsl is not None and qsl.size != seq.size + 1:
            qsl = None  # a query_start_loc that does not cover the rows is of no use to replay
        kv = _host(kv_pages, "kv_pages")
        if kv is not None and (c.page_size is None or kv.size != seq.size):
            raise ValueError(f"kv_pages needs page_size in the config and one value per seq_lens row ({seq.size})")
        idx = self._count
        p = None
        if parent is not None and int(parent) >= 0:
            parent = _int(parent, "parent", 0, idx - 1)
            p = parent - self._file_start if parent >= self._file_start else -1  # -1: in an earlier file
        return Observation(step=_int(step, "step", *_I64), site=site, rank=_int(rank, "rank", 0, c.dcp_size - 1),
                           num_reqs=nr, num_reqs_padded=nrp, seq_lens=seq,
                           dcp_local_seq_lens=_host(dcp_local_seq_lens, "dcp_local_seq_lens"),
                           ubatch=_int(ubatch, "ubatch", -1), parent=p, req_start=_opt(req_start, "req_start"),
                           tok_start=_opt(tok_start, "tok_start"), tok_stop=_opt(tok_stop, "tok_stop"),
                           query_start_loc=qsl, num_tokens_padded=_opt(num_tokens_padded, "num_tokens_padded"),
                           buffer=_opt(buffer, "buffer", *_I64), graph=_opt(graph, "graph", 0, 3), kv_pages=kv)

    def _target(self) -> Path:
        if self.rollover is None:
            return self.path
        return self.path.with_name(f"{self.path.stem}.{len(self.files):05d}{self.path.suffix or '.safetensors'}")

    def _write_current(self) -> None:
        target = self._target()
        cfg, cols = pack(self._obs, self.config)
        injected = None
        if self.injected is not None:
            lo, hi = self._file_start, self._file_start + len(self._obs)
            injected = {k: [i - lo for i in v if lo <= i < hi] for k, v in self.injected.items()}
        if self._stale:  # force=True: the earlier recording goes when this one has its first file
            for f in self._stale:
                if f != target:
                    f.unlink(missing_ok=True)
            self._stale = []
        write_dump(target, cfg, cols, injected)
        self.config = cfg  # keep site indices stable across rolled files
        self.files.append(target)
        self._file_start += len(self._obs)
        self._obs = []

    def _flush(self, *, raise_errors: bool) -> None:
        try:
            self._write_current()
        except (OSError, DumpError) as e:
            self.write_errors += 1
            self.last_error = str(e)
            if self.rollover is not None:
                self._retry_at = len(self._obs) + self.rollover  # keep them; try again a rollover later
            if raise_errors:
                raise WriteError(f"{e} ({len(self._obs)} observations kept in memory; call close() again "
                                 "once the problem is fixed)") from None
            if not self._warned_write:
                self._warned_write = True
                warnings.warn(f"dcptool Recorder could not write ({e}); keeping the observations and retrying "
                              "at the next rollover and at close()", RuntimeWarning, stacklevel=3)
            return
        self._retry_at = self.rollover

    def close(self) -> list[Path]:
        """Write what is left (atomically); returns the files written. Safe to call twice.

        Raises WriteError (naming the file) when the last file cannot be written; the observations
        stay in memory and a later close() tries again.
        """
        if self._closed:
            return self.files
        if self._obs or not self.files:
            self._flush(raise_errors=True)
        self._closed = True
        atexit.unregister(self._at_exit)
        return self.files

    def _at_exit(self) -> None:
        try:
            self.close()
        except WriteError as e:
            warnings.warn(f"dcptool Recorder lost {len(self._obs)} observations at exit: {e}", RuntimeWarning,
                          stacklevel=1)
