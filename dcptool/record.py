"""The Recorder an engine calls: copy each observation to host memory at once, write dumps atomically."""

from __future__ import annotations

import atexit
import os
import re
import warnings
from pathlib import Path

import numpy as np

from dcptool.dump import (
    FIELDS,
    INT32_MAX,
    ROW_FIELDS,
    DumpConfig,
    DumpError,
    OutputExistsError,
    WriteError,
    _text_ok,
    check_config,
    columns,
    write_dump,
)
from dcptool.schema import GraphMode

_I64 = 2**63 - 1


def _int32(a: np.ndarray) -> np.ndarray:
    """A private int32 copy; values int32 cannot hold raise (the observation is dropped), never wrap."""
    if a.dtype == np.int32:
        return a.copy()
    if a.dtype.kind not in "iub":
        raise ValueError(f"integer values expected, got dtype {a.dtype}")
    b = a.astype(np.int32)
    if a.dtype.itemsize >= 4 and not np.array_equal(b, a):  # one pass; only wider types can wrap
        raise ValueError(f"values must fit int32, got [{int(a.min())}, {int(a.max())}]")
    return b


def _host(x) -> np.ndarray | None:
    """A private host copy of a tensor / array / list (never a view of engine memory)."""
    if x is None:
        return None
    if hasattr(x, "detach"):  # torch.Tensor, on any device: .cpu() syncs on that device's stream
        x = x.detach().to("cpu").numpy()
    a = np.asarray(x)
    return _int32(a if a.ndim == 1 else a.reshape(-1))


def _host_fast(x) -> np.ndarray | None:
    """_host for the common case (None or a numpy array), without the attribute probing."""
    if x is None:
        return None
    if type(x) is np.ndarray and x.ndim == 1:
        return _int32(x)
    return _host(x)


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
        # One tuple of scalars and one of row arrays per observation, turned into columns only at write
        # time (zip(*)): observe() stays a couple of appends, close() a handful of concatenations.
        self._vals: list[tuple] = []  # dump.FIELDS
        self._sites: list[str] = []
        self._rows: list[tuple] = []  # (seq_lens, dcp_local_seq_lens, query_start_loc, kv_pages)
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

    def _check_shared(self, vals: tuple, site, kv: np.ndarray | None, rows: int) -> None:
        """What the dump format cannot hold (DESIGN §2) raises here and in _check_own, so a write never
        fails on it: the values one batch's observations share."""
        step, _, ubatch, _, nrp, _, rs, ts, te, ntp, _, graph = vals
        # any name a reader accepts (reports show markup and control characters literally); not lone surrogates
        if type(site) is not str or not _text_ok(site):
            raise ValueError(f"site must be a string of valid Unicode, got {site!r}")
        if not (-_I64 - 1 <= step <= _I64 and -1 <= ubatch <= INT32_MAX and nrp <= INT32_MAX):
            raise ValueError(f"step {step}, ubatch {ubatch} or num_reqs_padded {nrp} out of range")
        for v in (rs, ts, te, ntp):
            if v is not None and not -1 <= v <= INT32_MAX:
                raise ValueError(f"req_start/tok_start/tok_stop/num_tokens_padded {v} out of range")
        if graph is not None and not 0 <= graph <= 3:
            raise ValueError(f"graph {graph} is not 0..3")
        if kv is not None and (self.config.page_size is None or kv.size != rows):
            raise ValueError(f"kv_pages needs page_size in the config and one value per seq_lens row ({rows})")

    def _check_own(self, rank: int, parent: int | None, buffer: int | None, index: int) -> None:
        """... and the values of one rank's observation (index: the one it will get)."""
        if not 0 <= rank < self.config.dcp_size:
            raise ValueError(f"rank {rank} out of range for dcp_size {self.config.dcp_size}")
        if parent is not None and parent >= index:
            raise ValueError(f"parent {parent} is not an earlier observation")
        if buffer is not None and not -_I64 - 1 <= buffer <= _I64:
            raise ValueError(f"buffer {buffer} does not fit int64")

    def observe(self, *, step: int, site: str, rank: int, seq_lens, num_reqs: int, num_reqs_padded: int,
                dcp_local_seq_lens=None, ubatch: int = -1, parent: int | None = None, req_start: int | None = None,
                tok_start: int | None = None, tok_stop: int | None = None, query_start_loc=None,
                num_tokens_padded: int | None = None, buffer: int | None = None, graph: int | str | None = None,
                kv_pages=None) -> int:
        """Record one attention-metadata build; returns its index (pass it as `parent=` later), -1 if dropped."""
        try:
            seq, nr, nrp, qsl, graph = self._batch(seq_lens, num_reqs, num_reqs_padded, query_start_loc, graph)
            if buffer is None and dcp_local_seq_lens is not None and hasattr(dcp_local_seq_lens, "untyped_storage"):
                buffer = buffer_id(dcp_local_seq_lens)
            p = None if parent is None or parent < 0 else int(parent)  # made file-relative in _append
            vals = (int(step), int(rank), int(ubatch), nr, nrp, p,
                    None if req_start is None else int(req_start), None if tok_start is None else int(tok_start),
                    None if tok_stop is None else int(tok_stop),
                    None if num_tokens_padded is None else int(num_tokens_padded),
                    None if buffer is None else int(buffer), None if graph is None else int(graph))
            row = (seq, _host_fast(dcp_local_seq_lens), qsl, _host_fast(kv_pages))
            self._check_shared(vals, site, row[3], seq.size)
            self._check_own(vals[1], p, vals[10], self._count)
        except Exception as e:  # never break the engine
            self._drop(e)
            return -1
        return self._append(vals, site, row)

    def observe_many(self, *, step: int, site: str, ranks, seq_lens, num_reqs: int, num_reqs_padded: int,
                     dcp_local_seq_lens=None, ubatch: int = -1, parents=None, req_start: int | None = None,
                     tok_start: int | None = None, tok_stop: int | None = None, query_start_loc=None,
                     num_tokens_padded: int | None = None, buffers=None, graph: int | str | None = None,
                     kv_pages=None) -> list[int]:
        """Record one batch as seen by several ranks: one observation per entry of `ranks`.

        What the ranks share (seq_lens, query_start_loc and the scalars) is copied once;
        dcp_local_seq_lens and kv_pages are [ranks, rows] (kv_pages may also be one shared row);
        parents and buffers are per rank. For a simulator or a harness that holds every rank's
        metadata at once (an engine process records its own rank with observe()). Returns the
        indices; a batch that cannot be stored is dropped whole ([-1] * len(ranks)).
        """
        ranks = list(ranks)
        k = len(ranks)
        try:
            seq, nr, nrp, qsl, graph = self._batch(seq_lens, num_reqs, num_reqs_padded, query_start_loc, graph)
            dcp = None if dcp_local_seq_lens is None else _host(dcp_local_seq_lens).reshape(k, -1)
            kv = None
            if kv_pages is not None:
                flat = _host(kv_pages)
                one = (kv_pages.ndim if hasattr(kv_pages, "ndim") else np.ndim(kv_pages)) == 1
                # one shared row: a read-only view of the private copy for every rank
                kv = np.broadcast_to(flat, (k, flat.size)) if one else flat.reshape(k, -1)
            parents = [None] * k if parents is None else list(parents)
            buffers = [None] * k if buffers is None else list(buffers)
            if len(parents) != k or len(buffers) != k or (kv is not None and kv.shape[0] != k):
                raise ValueError(f"{k} ranks but {len(parents)} parents, {len(buffers)} buffers")
            common = (None if req_start is None else int(req_start), None if tok_start is None else int(tok_start),
                      None if tok_stop is None else int(tok_stop),
                      None if num_tokens_padded is None else int(num_tokens_padded))
            step, ubatch = int(step), int(ubatch)
            graph = None if graph is None else int(graph)
            ranks = [int(r) for r in ranks]
            self._check_shared((step, 0, ubatch, nr, nrp, None, *common, None, graph), site,
                               None if kv is None else kv[0], seq.size)
            batch = []
            for i in range(k):
                p = None if parents[i] is None or parents[i] < 0 else int(parents[i])
                b = None if buffers[i] is None else int(buffers[i])
                self._check_own(ranks[i], p, b, self._count + i)
                batch.append(((step, ranks[i], ubatch, nr, nrp, p, *common, b, graph),
                              (seq, None if dcp is None else dcp[i], qsl, None if kv is None else kv[i])))
        except Exception as e:
            self._drop(e, k)
            return [-1] * k
        return [self._append(vals, site, row) for vals, row in batch]

    def _batch(self, seq_lens, num_reqs, num_reqs_padded, query_start_loc, graph):
        """Checks and host copies shared by observe() and observe_many(); raises on what cannot be stored."""
        if self._closed:
            raise RuntimeError("observe() after close()")
        seq = _host_fast(seq_lens)
        nr, nrp = int(num_reqs), int(num_reqs_padded)  # (their int32 range: _check)
        if not 0 <= nr <= nrp or seq.size < nr or (seq.size and seq.min() < 0):
            raise ValueError(f"num_reqs {nr}, num_reqs_padded {nrp}, {seq.size} seq_lens rows")
        qsl = _host_fast(query_start_loc)
        if qsl is not None and qsl.size != seq.size + 1:
            qsl = None  # a query_start_loc that does not cover the rows is of no use to replay
        return seq, nr, nrp, qsl, GraphMode.parse(graph) if isinstance(graph, str) else graph

    def _drop(self, e: Exception, n: int = 1) -> None:
        self.dropped += n
        if not self._warned:
            self._warned = True
            warnings.warn(f"dcptool Recorder dropped an observation it cannot store ({e}); "
                          "counting further drops silently", RuntimeWarning, stacklevel=3)

    def _append(self, vals: tuple, site: str, row: tuple) -> int:
        parent = vals[5]
        if parent is not None:  # index in this file; -1 when the parent went to an earlier file
            vals = (*vals[:5], parent - self._file_start if parent >= self._file_start else -1, *vals[6:])
        self._vals.append(vals)
        self._sites.append(site)
        self._rows.append(row)
        self._count += 1
        if self.rollover is not None and len(self._sites) >= self._retry_at:
            self._flush(raise_errors=False)
        return self._count - 1

    def _target(self) -> Path:
        if self.rollover is None:
            return self.path
        return self.path.with_name(f"{self.path.stem}.{len(self.files):05d}{self.path.suffix or '.safetensors'}")

    def _pack(self) -> dict[str, np.ndarray]:
        """The observations since the last file, as dump columns (site indices stable across rolled files)."""
        n = len(self._sites)
        vals = dict(zip(FIELDS, zip(*self._vals))) if n else {f: () for f in FIELDS}
        rows = dict(zip(ROW_FIELDS, zip(*self._rows))) if n else {k: () for k in ROW_FIELDS}
        self.config, cols = columns(self.config, self._sites, vals, rows)
        return cols

    def _write_current(self) -> None:
        target = self._target()
        n = len(self._sites)
        cols = self._pack()
        injected = None
        if self.injected is not None:
            lo, hi = self._file_start, self._file_start + n
            injected = {k: [i - lo for i in v if lo <= i < hi] for k, v in self.injected.items()}
        if self._stale:  # force=True: the earlier recording goes when this one has its first file
            for f in self._stale:
                if f != target:
                    f.unlink(missing_ok=True)
            self._stale = []
        write_dump(target, self.config, cols, injected)
        self.files.append(target)
        self._file_start += n
        self._vals, self._sites, self._rows = [], [], []

    def _flush(self, *, raise_errors: bool) -> None:
        try:
            self._write_current()
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
        self._retry_at = self.rollover

    def close(self) -> list[Path]:
        """Write what is left (atomically); returns the files written. Safe to call twice.

        Raises WriteError (naming the file) when the last file cannot be written; the observations
        stay in memory and a later close() tries again.
        """
        if self._closed:
            return self.files
        if self._sites or not self.files:
            self._flush(raise_errors=True)
        self._closed = True
        atexit.unregister(self._at_exit)
        return self.files

    def discard(self) -> None:
        """Write nothing more, not even at exit, and drop what is not written yet: for a run that failed or
        was interrupted (simulate), whose dump would look complete but is not."""
        self._vals, self._sites, self._rows = [], [], []
        self._closed = True
        atexit.unregister(self._at_exit)

    def _at_exit(self) -> None:
        try:
            self.close()
        except WriteError as e:
            warnings.warn(f"dcptool Recorder lost {len(self._sites)} observations at exit: {e}", RuntimeWarning,
                          stacklevel=1)
