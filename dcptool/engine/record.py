"""The Recorder an engine calls: each observation checked, copied without stopping the engine, written atomically."""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

from dcptool.dump import DumpConfig, check_config
from dcptool.dump.schema import KVGroup
from dcptool.engine.arguments import (
    _NEW,
    _NO_SLOTS,
    Fields,
    _batch,
    _check_own,
    _check_shared,
    _device_slots,
    _Groups,
    _host,
    _host_fast,
    _host_slots,
    _int,
    _nonneg,
    _NoTensor,
    _opt,
    _per_rank,
    _scalars,
    buffer_id,
    tensor_type,
)
from dcptool.engine.device import DevicePath
from dcptool.engine.device import _find_torch as _device_torch
from dcptool.engine.ring import DEFAULT_RING_BYTES
from dcptool.engine.writer import Writer

_TENSOR: type = _NoTensor  # torch.Tensor once torch is imported (the engine package does not import it)


def _find_torch() -> None:
    """Look for torch.Tensor again (torch may be imported after the Recorder was made): here and on the device path."""
    global _TENSOR
    _TENSOR = tensor_type()
    _device_torch()


def _kept_by(part: str, name: str, doc: str) -> property:
    """A Recorder attribute that one of its parts keeps (`_writer`, `_device`)."""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, v: setattr(getattr(self, part), name, v), doc=doc)


class Recorder:
    """Record observations; `close()` (or leaving a `with` block) writes the dump atomically.

    `observe()` never raises into the engine: a value it cannot store (a bad length, a value int32 cannot hold, a
    scalar that is not an integer: `step=1.9`, `rank="7"` and bools are dropped, never coerced) is counted in
    `dropped` and warned about once; an observation made inside CUDA-graph capture is not recorded and counted in
    `skipped_capture`. observe() is thread-safe: index allocation, appending and rollover happen under one lock.

    With `rollover=K`, every K observations go to a new numbered file (`run.00000.safetensors`,
    `run.00001.safetensors`, ...), written in order on a background thread (the observe() that rolls over
    only hands its observations over; `flush()` waits for those), so a long run never risks one huge file
    and everything up to the last file written survives a killed process. Read the files together.

    CUDA tensors (`cuda_mode="async"`, the default) are snapshotted on the engine's current stream with no host
    synchronisation (see device.DevicePath); their values are checked when the slot is harvested, and an observation
    whose device values cannot be stored (a negative seq_len, an int64 value int32 cannot hold) is dropped then:
    counted in `dropped`, and the index observe() returned for it is not in the file (a `parent=` pointing at it is
    recorded as unknown). A full ring waits for the oldest launches (`ring_full="wait"`) or drops the observation
    and counts it in `ring_drops` (`ring_full="drop"`). `cuda_mode="sync"` copies with `.to("cpu")` as before.

    Nothing is lost quietly: an existing recording at `path` (or its numbered files) is refused unless `force=True`,
    which replaces it (numbered files included). While a Recorder is open it holds `path` on this host: a second
    Recorder (another process, or this one) for the same path records to `STEM.pPID.SUFFIX` instead, says so in a
    RuntimeWarning, and `path` names where it writes (`requested_path` what was asked for); every write also checks
    its file is still absent (or the earlier recording being replaced) and moves to such a name if another writer
    made it. A rollover file that cannot be written (disk full) is kept in memory, warned about, and retried at the
    next rollover and at close(), which raises WriteError if it still fails (call it again once there is room). A
    Recorder that was never closed is closed at interpreter exit. A killed process leaves every file it completed
    intact, and at most a hidden `.NAME.*.tmp` temporary that no reader uses.

    With `max_bytes` the recording stops at that size (checked at each rollover, else every 1,024 observations;
    it may pass it by that much): the last file's metadata says so (`dcptool.capped`), a RuntimeWarning says so
    once, and later observations are not recorded (-1, counted in `capped`).
    """

    path = _kept_by("_writer", "path", "Where it records: requested_path, or STEM.pPID.SUFFIX where that is held.")
    requested_path = _kept_by("_writer", "requested_path", "The path it was given.")
    rollover = _kept_by("_writer", "rollover", "Observations per numbered file; None: one file, at close().")
    files = _kept_by("_writer", "files", "The files written so far.")
    write_errors = _kept_by("_writer", "write_errors", "Failed writes (each retried later); the last in last_error.")
    last_error = _kept_by("_writer", "last_error", "The last failed write's error (None: none failed).")
    injected = _kept_by("_writer", "injected", "simulate's injected faults {fault: [index]}, written with the dump.")
    config = _kept_by("_writer", "config", "The DumpConfig written (its sites grow as observations name new ones).")
    cuda_mode = _kept_by("_device", "cuda_mode", '"async" (the snapshot ring) or "sync" (where the ring cannot run).')
    ring_full = _kept_by("_device", "ring_full", 'What a full ring does: "wait" or "drop".')
    max_bytes = _kept_by("_writer", "max_bytes", "The size cap of the recording in bytes (None: none).")
    capped = _kept_by("_writer", "capped", "Observations not recorded because the recording reached max_bytes.")
    ring_drops = _kept_by("_device", "ring_drops", 'Device observations dropped because the ring was full ("drop").')

    def __init__(self, path: str | os.PathLike, dcp_size: int, cp_interleave: int = 1, *,
                 sites: tuple[str, ...] = (), pcp_size: int = 1, page_size: int | None = None,
                 engine: str | None = None, engine_version: str | None = None, note: str | None = None,
                 rollover: int | None = None, force: bool = False, cuda_mode: str = "async",
                 ring_bytes: int = DEFAULT_RING_BYTES, ring_full: str = "wait", kv_groups=None,
                 max_bytes: int | None = None):
        config = DumpConfig(dcp_size=dcp_size, cp_interleave=cp_interleave, sites=tuple(sites), pcp_size=pcp_size,
                            page_size=page_size, engine=engine, engine_version=engine_version, note=note,
                            kv_groups=None if kv_groups is None else tuple(KVGroup.of(g) for g in kv_groups))
        check_config(Path(path), config)  # a bad config fails here, not hours later at close()
        if rollover is not None and rollover < 1:
            raise ValueError(f"rollover must be >= 1, got {rollover}")
        if cuda_mode not in ("async", "sync"):
            raise ValueError(f"cuda_mode must be 'async' or 'sync', got {cuda_mode!r}")
        if max_bytes is not None and (type(max_bytes) is not int or max_bytes < 1):
            raise ValueError(f"max_bytes must be an integer >= 1, got {max_bytes!r}")
        if ring_full not in ("wait", "drop"):
            raise ValueError(f"ring_full must be 'wait' or 'drop', got {ring_full!r}")
        self._ranks = dcp_size
        self._lock = threading.RLock()
        self._acquire, self._release_lock = self._lock.acquire, self._lock.release
        self.dropped = 0
        self.skipped_capture = 0  # observations made inside CUDA-graph capture (not recorded)
        self._site_ok: set[str] = set()  # site names already checked
        self._max_group = -1  # the highest KV-cache group index recorded (slot entries)
        self._warned = False
        self._fast = None  # observe()'s fast path (DevicePath.observe_fast) once the ring runs with its kernel
        _find_torch()
        self._writer = w = Writer(path, config, rollover, force, self._lock, max_bytes)
        self._append = w.append
        self._device = w.device = DevicePath(self, w, cuda_mode, ring_bytes, ring_full)
        self._observe_device = self._device.observe_device  # (bench_record.py counts its calls by replacing it)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return self._writer.count - self._writer.late

    def observe(self, *, step: int, site: str, rank: int, seq_lens, num_reqs: int, num_reqs_padded: int,
                dcp_local_seq_lens=None, ubatch: int = -1, parent: int | None = None, req_start: int | None = None,
                tok_start: int | None = None, tok_stop: int | None = None, query_start_loc=None,
                num_tokens_padded: int | None = None, buffer: int | None = None, graph: int | str | None = None,
                kv_pages=None, dcp_query_start_loc=None, dcp_tot_seq_lens=None, positions=None,
                slot_mapping=None) -> int:
        """Record one attention-metadata build; returns its index (pass it as `parent=` later), -1 if dropped.

        dcp_query_start_loc / dcp_tot_seq_lens (issue 15; None: not recorded): the Q the DCP decode path
        hands the empty-shard mask, and the global companion of the local lengths (device sections, like
        the other rows). `positions` (each token's position in its sequence) and `slot_mapping` (the KV
        slot this rank writes per token, -1 for none: a 1-D tensor for KV-cache group 0, a [groups, tokens]
        tensor, or a dict {group index: 1-D tensor}) go together: CUDA
        tensors of the device path are snapshotted raw (no waiting; the entries are built at harvest), host
        tensors, numpy arrays and lists copied on the host)."""
        fast = self._fast
        if fast is not None and type(seq_lens) is _TENSOR:
            try:  # the engine's common case (see DevicePath.observe_fast); None: the general path below
                got = fast(step, site, rank, seq_lens, num_reqs, num_reqs_padded, dcp_local_seq_lens, ubatch, parent,
                           req_start, tok_start, tok_stop, query_start_loc, num_tokens_padded, graph, buffer, kv_pages,
                           dcp_query_start_loc, dcp_tot_seq_lens, positions, slot_mapping)
            except Exception as e:  # never break the engine
                self._drop(e)
                return -1
            if got is not None:
                return got
        try:
            if self._writer.stopped:  # (closed, or past the size cap: nothing to copy)
                self._writer.refuse()
                return -1
            slots = _NO_SLOTS if positions is None and slot_mapping is None else None  # None: not copied yet
            # SECTIONS (dump.ROW_FIELDS) order, without the slot entries
            srcs = (seq_lens, dcp_local_seq_lens, query_start_loc, kv_pages, dcp_query_start_loc, dcp_tot_seq_lens)
            dev = self._device
            on = dev.on
            if _TENSOR is _NoTensor:
                _find_torch()  # (torch imported after the Recorder was made)
            x = seq_lens
            if not (isinstance(x, _TENSOR) and getattr(x, on)):  # (the engine's case at once)
                for x in (*srcs, positions):
                    if isinstance(x, _TENSOR) and getattr(x, on):
                        break  # a device tensor: the device path
                else:
                    x = None
            if x is not None:
                if dev.capturing():
                    with self._lock:
                        self.skipped_capture += 1
                    return -1
                if buffer is None and dcp_local_seq_lens is not None:
                    buffer = buffer_id(dcp_local_seq_lens)
                vals = _scalars(step, rank, ubatch, num_reqs, num_reqs_padded, parent, req_start, tok_start,
                                tok_stop, num_tokens_padded, buffer, graph)
                if dev.cuda_mode == "async":
                    if slots is None:  # the slot sections on the device too when they all are (no host copy)
                        slots = (_device_slots(positions, slot_mapping, self._writer.config.kv_groups, _TENSOR, on,
                                               self._groups_seen) or self._slots(positions, slot_mapping))
                    got = self._observe_device(vals, site, (*srcs, *slots))
                    if got is not None:
                        return got
                    if slots is not None and type(slots[2]) is _Groups:
                        slots = None  # (the host path copies them after all)
            else:
                if buffer is None and dcp_local_seq_lens is not None and hasattr(dcp_local_seq_lens,
                                                                                 "untyped_storage"):
                    buffer = buffer_id(dcp_local_seq_lens)
                vals = _scalars(step, rank, ubatch, num_reqs, num_reqs_padded, parent, req_start, tok_start,
                                tok_stop, num_tokens_padded, buffer, graph)
            if slots is None:
                slots = self._slots(positions, slot_mapping)
            seq, qsl = _batch(seq_lens, vals.num_reqs, vals.num_reqs_padded, query_start_loc)
            row = (seq, _host_fast(dcp_local_seq_lens), qsl, _host_fast(kv_pages), _host_fast(dcp_query_start_loc),
                   _nonneg(_host_fast(dcp_tot_seq_lens), "dcp_tot_seq_lens"), *slots)
            _check_shared(vals, site, self._site_ok, None if row[3] is None else row[3].size, seq.size,
                          self._writer.config.page_size)
        except Exception as e:  # never break the engine
            self._drop(e)
            return -1
        w = self._writer
        with self._lock:
            try:
                if w.stopped:
                    w.refuse()  # (raises after close(); counts it past the size cap)
                    return -1
                _check_own(vals.rank, vals.parent, vals.buffer, w.count, self._ranks)
            except Exception as e:
                self._drop(e)
                return -1
            return self._append(vals, site, row)

    def observe_many(self, *, step: int, site: str, ranks, seq_lens, num_reqs: int, num_reqs_padded: int,
                     dcp_local_seq_lens=None, ubatch: int = -1, parents=None, req_start: int | None = None,
                     tok_start: int | None = None, tok_stop: int | None = None, query_start_loc=None,
                     num_tokens_padded: int | None = None, buffers=None, graph: int | str | None = None,
                     kv_pages=None, dcp_query_start_loc=None, dcp_tot_seq_lens=None, positions=None,
                     slot_mapping=None) -> list[int]:
        """Record one batch as seen by several ranks: one observation per entry of `ranks`.

        What the ranks share (seq_lens, query_start_loc and the scalars) is copied once;
        dcp_local_seq_lens and kv_pages are [ranks, rows] (kv_pages may also be one shared row);
        parents and buffers are per rank; dcp_query_start_loc and dcp_tot_seq_lens (issue 15) are one row
        shared by every rank or [ranks, rows]. For a simulator or a harness that holds every rank's
        metadata at once (an engine process records its own rank with observe(); CUDA tensors are
        copied here with `.to("cpu")`, which waits for the stream). Returns the indices; a batch that
        cannot be stored is dropped whole ([-1] * len(ranks)). `positions` are shared; `slot_mapping` is
        per rank: [ranks, tokens] for group 0, or a dict {group index: [ranks, tokens]}.
        """
        ranks = list(ranks)
        k = len(ranks)
        try:
            if slot_mapping is None:
                extras = [self._slots(positions, None)] * k
            else:
                per = slot_mapping if isinstance(slot_mapping, dict) else {0: slot_mapping}
                per = {g: _host(m).reshape(k, -1) for g, m in per.items()}
                extras = [self._slots(positions, {g: m[i] for g, m in per.items()}) for i in range(k)]
            common = _scalars(step, 0, ubatch, num_reqs, num_reqs_padded, None, req_start, tok_start,
                              tok_stop, num_tokens_padded, None, graph)
            step, _, ubatch, nr, nrp, _, rs, ts, te, ntp, _, graph = common  # Fields, in order
            seq, qsl = _batch(seq_lens, nr, nrp, query_start_loc)
            dcp = None if dcp_local_seq_lens is None else _host(dcp_local_seq_lens).reshape(k, -1)
            kv = _per_rank(kv_pages, k)
            extra = [_per_rank(dcp_query_start_loc, k), _nonneg(_per_rank(dcp_tot_seq_lens, k), "dcp_tot_seq_lens")]
            parents = [None] * k if parents is None else list(parents)
            buffers = [None] * k if buffers is None else list(buffers)
            if len(parents) != k or len(buffers) != k or (kv is not None and kv.shape[0] != k):
                raise ValueError(f"{k} ranks but {len(parents)} parents, {len(buffers)} buffers")
            ranks = [_int(r, "rank") for r in ranks]
            parents = [_opt(p, "parent") for p in parents]
            parents = [None if p is None or p < 0 else p for p in parents]
            buffers = [_opt(b, "buffer") for b in buffers]
            _check_shared(common, site, self._site_ok, None if kv is None else kv.shape[1], seq.size,
                          self._writer.config.page_size)
        except Exception as e:
            self._drop(e, k)
            return [-1] * k
        w = self._writer
        with self._lock:
            try:
                if w.stopped:
                    w.refuse(k)
                    return [-1] * k
                for i in range(k):
                    _check_own(ranks[i], parents[i], buffers[i], w.count + i, self._ranks)
            except Exception as e:
                self._drop(e, k)
                return [-1] * k
            return [self._append(_NEW(Fields, (step, ranks[i], ubatch, nr, nrp, parents[i], rs, ts, te, ntp,
                                               buffers[i], graph)), site, (seq, None if dcp is None else dcp[i], qsl,
                                                       None if kv is None else kv[i],
                                                       *(None if x is None else x[i] for x in extra), *extras[i]))
                    for i in range(k)]

    def _slots(self, positions, slot_mapping) -> tuple:
        """arguments._host_slots for this recording's KV-cache groups; notes the highest group recorded."""
        if positions is None and slot_mapping is None:
            return _NO_SLOTS
        kvg = self._writer.config.kv_groups
        out = _host_slots(positions, slot_mapping, None if kvg is None else len(kvg))
        self._groups_seen(out[2][-1:].tolist())
        return out

    def _groups_seen(self, groups) -> None:
        """Note the highest KV-cache group of an observation's slot entries (groups ascending)."""
        if groups:
            with self._lock:
                self._max_group = max(self._max_group, groups[-1])

    def set_kv_groups(self, kv_groups) -> None:
        """Name the KV-cache groups (and whether DCP shards each) once they are known, e.g. by an engine
        plugin after the KV cache is set up; ValueError if they do not cover the groups recorded so far."""
        groups = tuple(KVGroup.of(g) for g in kv_groups)
        with self._lock:
            if len(groups) <= self._max_group:
                raise ValueError(f"{len(groups)} KV-cache groups, but group {self._max_group} was recorded")
            w = self._writer
            w.config = DumpConfig(**{**w.config.__dict__, "kv_groups": groups})
            check_config(w.requested_path, w.config)

    def _drop(self, e: Exception, n: int = 1) -> None:
        with self._lock:
            self.dropped += n
            if self._warned:
                return
            self._warned = True
        warnings.warn(f"dcptool Recorder dropped an observation it cannot store ({e}); "
                      "counting further drops silently", RuntimeWarning, stacklevel=3)

    def harvest(self) -> None:
        """Copy the finished device snapshots out of the ring now (no waiting): for a step boundary."""
        with self._lock:
            self._device.harvest(wait=False)

    def flush(self) -> None:
        """Wait until every rolled file is written (a failed write warns once and keeps its observations)."""
        self._writer.flush()

    def close(self) -> list[Path]:
        """Write what is left (atomically); returns the files written. Safe to call twice.

        Waits for the device snapshots still in flight. Raises WriteError (naming the file) when the
        last file cannot be written; the observations stay in memory and a later close() tries again.
        """
        return self._writer.close()

    def discard(self) -> None:
        """Write nothing more, not even at exit, and drop what is not written yet: for a run that failed or
        was interrupted (simulate), whose dump would look complete but is not."""
        self._writer.discard()
