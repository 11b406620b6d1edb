"""The Recorder an engine calls: each observation checked, copied without stopping the engine, written atomically."""

from __future__ import annotations

import operator
import os
import threading
import warnings
from pathlib import Path

import numpy as np

from dcptool.dump import DumpConfig, Record, Scalars, check_config
from dcptool.dump.observation import R, keyword_door
from dcptool.dump.schema import KVGroup
from dcptool.dump.transfer import TransferRecord, levels_of, transfer_door
from dcptool.engine.arguments import (
    NO_SLOTS,
    Groups,
    NoTensor,
    buffer_id,
    check_own,
    device_slots,
    integer,
    optional_integer,
    scalars,
    tensor_type,
)
from dcptool.engine.recorder.host import HostPath, of_rank
from dcptool.engine.recorder.settings import Options, settings
from dcptool.engine.recorder.writer import Writer
from dcptool.engine.snapshot.device import LATE_ROWS, DevicePath
from dcptool.engine.snapshot.device import find_torch as _device_torch
from dcptool.engine.snapshot.harvest import Harvest

_NEW = tuple.__new__
_BUF = R["buffer"]  # (the Record's buffer position)
_late_rows = operator.itemgetter(*LATE_ROWS)  # the host values past the sections, in HOST_ROWS order
_EMPTY = np.zeros(0, np.int32)  # a transfer observation's rows: none (every observation rule holds for it)
_TENSOR: type = NoTensor  # torch.Tensor once torch is imported (the engine package does not import it)


def find_torch() -> None:
    """Look for torch.Tensor again (torch may be imported after the Recorder was made): here and on the device path."""
    global _TENSOR
    _TENSOR = tensor_type()
    _device_torch()


# The Recorder's attributes its parts keep (the part that owns each is the one that changes it): name -> (part, doc).
_KEPT_BY = {
    "path": ("_writer", "Where it records: requested_path, or STEM.pPID.SUFFIX where that is held."),
    "requested_path": ("_writer", "The path it was given."),
    "rollover": ("_writer", "Observations per numbered file; None: one file, at close()."),
    "files": ("_writer", "The files written so far."),
    "write_errors": ("_writer", "Failed writes (each retried later); the last in last_error."),
    "last_error": ("_writer", "The last failed write's error (None: none failed)."),
    "injected": ("_writer", "simulate's injected faults {fault: [index]}, written with the dump."),
    "config": ("_writer", "The DumpConfig written (its sites grow as observations name new ones)."),
    "max_bytes": ("_writer", "The size cap of the recording in bytes (None: none)."),
    "capped": ("_writer", "Observations not recorded because the recording reached max_bytes."),
    "cuda_mode": ("_device", '"async" (the snapshot ring) or "sync" (where the ring cannot run).'),
    "skipped_capture": ("_device", "Observations made inside CUDA-graph capture (not recorded)."),
    "ring_full": ("_harvest", 'What a full ring does: "wait" or "drop".'),
    "ring_drops": ("_harvest", 'Device observations dropped because the ring was full ("drop").'),
}


def _kept_by(part: str, name: str, doc: str) -> property:
    """A Recorder attribute that one of its parts keeps."""
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
    intact, at most a hidden `.NAME.*.tmp` temporary that no reader uses, and its path's `.NAME.lock` unlocked (the
    next recording of the path takes and removes it).

    With `max_bytes` the recording stops at that size (checked at each rollover, else every 1,024 observations;
    it may pass it by that much): the last file's metadata says so (`dcptool.capped`), a RuntimeWarning says so
    once, and later observations are not recorded (-1, counted in `capped`).
    """

    def __init__(self, path: str | os.PathLike, dcp_size: int | None = None, cp_interleave: int = 1, *,
                 config: DumpConfig | None = None, options: Options | None = None, **kw):
        """Record into `path`. The keywords (settings.settings): DumpConfig's fields (sites, pcp_size, page_size,
        engine, engine_version, note, kv_groups: what the dump says of the run) and Options' (rollover, force,
        cuda_mode, ring_bytes, ring_full, max_bytes: how it records), or a whole `config=` / `options=`."""
        config, opts = settings(dcp_size, cp_interleave, config, options, kw)
        check_config(Path(path), config)  # a bad config fails here, not hours later at close()
        self._ranks = config.dcp_size
        self._lock = threading.RLock()
        self.dropped = 0
        self._site_ok: set[str] = set()  # site names already checked (by the host and the device path)
        self._warned = False
        self._fast = None  # observe()'s fast path (DevicePath.observe_fast) once the ring runs with its kernel
        find_torch()
        self._harvest = h = Harvest(opts.ring_full, self._lost)
        self._writer = w = Writer(path, config, h, self._lock, rollover=opts.rollover, force=opts.force,
                                  max_bytes=opts.max_bytes)
        self._append = w.append
        self._host = HostPath(w, self._lock, self._site_ok)
        self._device = DevicePath(w, h, self._lock, self._site_ok, self._drop, opts.cuda_mode, opts.ring_bytes)
        self._observe_device = self._device.observe_device  # (bench_record.py counts its calls by replacing it)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return self._writer.count - self._writer.late

    observe = keyword_door("observe", "record", """Record one attention-metadata build; returns its index (pass it as
        `parent=` later), -1 if dropped.

        The keywords are the observation's fields (dump.observation.FIELDS_TABLE, docs/format.md says what each
        holds; `graph` also takes a name: "eager", "piecewise", "capture", "replay"). dcp_query_start_loc /
        dcp_tot_seq_lens (None: not recorded): the Q the DCP decode path hands the empty-shard mask, and the global
        companion of the local lengths (device sections, like the other rows). `positions` (each token's position
        in its sequence) and `slot_mapping` (the KV slot this rank writes per token, -1 for none: a 1-D tensor for
        KV-cache group 0, a [groups, tokens] tensor, or a dict {group index: 1-D tensor}) go together: CUDA
        tensors of the device path are snapshotted raw (no waiting; the entries are built at harvest), host
        tensors, numpy arrays and lists copied on the host.""", fast="_fast")

    def record(self, r: Record) -> int:
        """observe() for a caller that builds the observation's Record itself (the vLLM plugin, simulate)."""
        fast = self._fast
        if fast is not None:  # the engine's common case (DevicePath.observe_fast: None for what it does not take)
            got = fast(r)
            if got is not None:
                return got
        return self._record_general(r)

    def _record_general(self, r: Record) -> int:
        """The general path of record(): its index, -1 when dropped or skipped."""
        try:
            got = self._general(r)
        except Exception as e:  # never break the engine
            self._drop(e)
            return -1
        if type(got) is int:
            return got
        vals, site, row = got
        w = self._writer
        with self._lock:
            try:
                if w.stopped:
                    w.refuse()  # (raises after close(); counts it past the size cap)
                    return -1
                check_own(vals[1], vals[5], vals[10], w.count, self._ranks)  # (rank, parent, buffer)
            except Exception as e:
                self._drop(e)
                return -1
            return self._append(vals, site, row)

    def _general(self, r: Record) -> int | tuple:
        """observe()'s general path: the device snapshot where a tensor of the device path is given (its index, or -1
        when skipped), else the observation's host copies, checked: (scalars, site, rows) for the writer. Raises
        what cannot be stored."""
        if self._writer.stopped:  # (closed, or past the size cap: nothing to copy)
            self._writer.refuse()
            return -1
        dev = self._device
        if _TENSOR is NoTensor:
            find_torch()  # (torch imported after the Recorder was made)
        slots = NO_SLOTS if r.positions is None and r.slot_mapping is None else None  # None: not copied yet
        dcp = r.dcp_local_seq_lens
        if dev.device_tensors(r):
            if dev.capturing():
                dev.skip_capture()
                return -1
            if r.buffer is None and dcp is not None:
                r = _NEW(Record, (*r[:_BUF], buffer_id(dcp), *r[_BUF + 1:]))  # (cheaper than _replace)
            vals = scalars(r)
            if dev.cuda_mode == "async":
                got, slots = self._snapshot(r, vals, slots)
                if got is not None:
                    return got
        else:
            if r.buffer is None and dcp is not None and hasattr(dcp, "untyped_storage"):
                r = r._replace(buffer=buffer_id(dcp))
            vals = scalars(r)
        return vals, r.site, self._host.row(r, vals, slots)

    def _snapshot(self, r: Record, vals: Scalars, slots: tuple | None) -> tuple[int | None, tuple | None]:
        """The device snapshot of an observation (DevicePath.observe_device): (its index, or None where the host
        path must copy it; the slot entries the host path then keeps, None: not copied yet)."""
        dev = self._device
        if slots is None:  # the slot sections on the device too when they all are (no host copy)
            slots = (device_slots(r.positions, r.slot_mapping, self._writer.config.kv_groups, _TENSOR, dev.on,
                                   self._host.groups_seen) or self._host.slots(r.positions, r.slot_mapping))
        got = self._observe_device(vals, r.site, (r.seq_lens, r.dcp_local_seq_lens, r.query_start_loc, r.kv_pages,
                                                  r.dcp_query_start_loc, r.dcp_tot_seq_lens, *slots, r.ctx_chunks,
                                                  r.group_seq_lens, r.verify_row_lens, r.sparse_topk,
                                                  *_late_rows(r)))
        self._fast = dev.fast
        return got, None if slots is not None and type(slots[2]) is Groups else slots

    observe_many = keyword_door("observe_many", "record_many", """Record one batch as seen by several ranks: one
        observation per entry of `ranks`.

        What the ranks share (seq_lens, query_start_loc and the scalars) is copied once;
        dcp_local_seq_lens and kv_pages are [ranks, rows] (kv_pages may also be one shared row);
        parents and buffers are per rank; dcp_query_start_loc and dcp_tot_seq_lens are one row
        shared by every rank or [ranks, rows]. For a simulator or a harness that holds every rank's
        metadata at once (an engine process records its own rank with observe(); CUDA tensors are
        copied here with `.to("cpu")`, which waits for the stream). Returns the indices; a batch that
        cannot be stored is dropped whole ([-1] * len(ranks)). `positions` are shared; `slot_mapping` is
        per rank: [ranks, tokens] for group 0, or a dict {group index: [ranks, tokens]}.""",
                                {"rank": "ranks", "parent": "parents", "buffer": "buffers"}, "list[int]")

    def record_many(self, r: Record) -> list[int]:
        """observe_many() for a caller that builds the Record itself: its `rank`, `parent` and `buffer` hold one
        entry per rank (None: none), its rows as observe_many() takes them."""
        ranks = list(r.rank)
        k = len(ranks)
        try:
            common, rows = self._host.many(r, k)
            parents = [None] * k if r.parent is None else list(r.parent)
            buffers = [None] * k if r.buffer is None else list(r.buffer)
            if len(parents) != k or len(buffers) != k or (rows[3] is not None and rows[3].shape[0] != k):
                raise ValueError(f"{k} ranks but {len(parents)} parents, {len(buffers)} buffers")
            ranks = [integer(x, "rank") for x in ranks]
            parents = [optional_integer(p, "parent") for p in parents]
            parents = [None if p is None or p < 0 else p for p in parents]
            buffers = [optional_integer(b, "buffer") for b in buffers]
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
                    check_own(ranks[i], parents[i], buffers[i], w.count + i, self._ranks)
            except Exception as e:
                self._drop(e, k)
                return [-1] * k
            step, _, nr, nrp, ubatch, _, rs, ts, te, ntp, _, graph = common  # Scalars, in order
            return [self._append(_NEW(Scalars, (step, ranks[i], nr, nrp, ubatch, parents[i], rs, ts, te, ntp,
                                                buffers[i], graph)), r.site, of_rank(rows, i)) for i in range(k)]

    transfer = transfer_door("record_transfer", """Record one KV transfer plan: what a connector moved for one request
        to one destination rank (docs/recording.md, "KV transfers"); returns its index, -1 if dropped.

        `step`, `rank`: the engine step and the recording worker's DCP rank (the destination's for a pull, the
        storing rank's for a store); `request`, `source`: the request's and the source engine's ids (ints, or
        strings stored as their 64-bit hash); `src`, `dst`: both sides' layouts (dump.transfer.Side or a dict of
        its fields: tp, pcp, dcp, interleave, cp_shards); `groups`: one dump.transfer.GroupPlan (or dict) per
        KV-cache group: its kind, both sides' block tables and block sizes; `seq_len`: the tokens the source
        computed (-1: unknown); `dst_rank`: the destination worker's pcp_rank * dcp + dcp_rank (default: `rank`,
        0 for a store); the plan as `reads` ([(source worker, source kernel block ids per group, destination
        kernel block ids per group)], whole kernel blocks, as NIXL's ReadSpec) or `copies` ([k, 7]: group,
        source worker, source kernel block id, offset, destination kernel block id, offset, slots); `store`: the
        destination is a keyed store claiming tokens [0, seq_len). Host values (lists, numpy, tensors copied to
        the host); never raises into the engine (a plan it cannot store is dropped and counted in `dropped`).""")

    def record_transfer(self, t: TransferRecord) -> int:
        """transfer() for a caller that builds the TransferRecord itself (the vLLM plugin, simulate)."""
        try:
            levels = levels_of(t)
            r = Record(step=t.step, site=t.site, rank=t.rank, num_reqs=0, num_reqs_padded=0, seq_lens=_EMPTY,
                       dcp_local_seq_lens=_EMPTY if self._ranks > 1 else None)
            vals = scalars(r)
            row = self._host.row(r, vals, NO_SLOTS)
        except Exception as e:  # never break the engine
            self._drop(e)
            return -1
        w = self._writer
        with self._lock:
            try:
                if w.stopped:
                    w.refuse()
                    return -1
                check_own(vals[1], None, None, w.count, self._ranks)
            except Exception as e:
                self._drop(e)
                return -1
            return w.append(vals, r.site, row, levels)

    def set_kv_groups(self, kv_groups) -> None:
        """Name the KV-cache groups (and whether DCP shards each) once they are known, e.g. by an engine
        plugin after the KV cache is set up; ValueError if they do not cover the groups recorded so far."""
        groups = tuple(KVGroup.of(g) for g in kv_groups)
        with self._lock:
            if len(groups) <= self._writer.max_group:
                raise ValueError(f"{len(groups)} KV-cache groups, but group {self._writer.max_group} was recorded")
            w = self._writer
            w.config = DumpConfig(**{**w.config.__dict__, "kv_groups": groups})
            check_config(w.requested_path, w.config)

    def _lost(self, index: int, e: Exception) -> None:
        """Under the lock: a device observation whose values cannot be stored, found at harvest (Harvest)."""
        self._writer.lost(index)
        self._drop(e)

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
            self._harvest.harvest(wait=False)

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


for _name, (_part, _doc) in _KEPT_BY.items():
    setattr(Recorder, _name, _kept_by(_part, _name, _doc))
