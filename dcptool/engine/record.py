"""The Recorder an engine calls: copy each observation to the host without stopping the engine; atomic writes.
(Over 450 lines: the host path, the CUDA snapshot ring and the file rollover share one Recorder's state.)

CUDA tensors are not copied with `.to("cpu")` (that waits for the engine's stream): observe() writes
a descriptor of the observation into the header of a slot of a pinned, device-mapped host ring and
launches one Triton kernel on the engine's current stream with one argument, the slot's address; the
kernel reads the descriptor and copies every device section into the slot, so the values are those at
observe() time. The engine's usual call (seq_lens, the DCP view and query_start_loc as int32 device
tensors: Recorder._observe_fast) launches kernel.snapshot_args_kernel instead, with the header as
arguments: that kernel writes the same header into the slot itself (no CPU write, no GPU read of it).
Slots are harvested later (every FENCE_EVERY observations, at a rollover and at close()) once a CUDA
event says the launch finished. `cuda_mode="sync"` keeps the synchronous copy.

Ring slots (int32 words; a slot starts at a multiple of 8 words, 32 bytes; the CPU writes the
header before the launch (the fast path's kernel writes it), the kernel writes `flags` and `done`; a
slot describes itself, so a later fused check kernel can read, or extend, it):

    word 0      seqno        the observation's index & 0x7fffffff (CPU)
    word 1      done         -1 (CPU); the kernel writes seqno here last (checked at harvest)
    word 2      num_reqs
    word 3      num_reqs_padded
    word 4      nsec         K, the number of section entries (= len(SECTIONS))
    word 5      flags        0 (CPU); kernel: bit 0 a value int32 cannot hold, bit 1 a negative value in
                             a section that forbids them (seq_lens)
    word 6      words        the slot's size in words (header and rows, rounded up to 8)
    word 7      0            (reserved)
    words 8+4k .. 11+4k      section k, in dump.ROW_FIELDS order (SECTIONS): source address (int64,
                             words 8+4k and 9+4k), count (word 10+4k; -1: absent, or held on the host),
                             mode (word 11+4k; bit 0 int64 source, bit 1 negatives flagged)
    then the rows of the sections with count >= 0, back to back, from word 8+4K.

A row column is a SECTIONS entry (its observe() keyword, its length rule): the kernel loops over the
header's entries and needs no edit.
"""

from __future__ import annotations

import atexit
import bisect
import errno
import hashlib
import operator
import os
import re
import socket
import struct
import sys
import threading
import warnings
from collections import deque
from pathlib import Path
from typing import NamedTuple

import numpy as np

from dcptool.dump import (
    FIELDS,
    INT32_MAX,
    ROW_FIELDS,
    DumpConfig,
    DumpError,
    OutputExistsError,
    WriteError,
    check_config,
    columns,
    slot_entries,
    write_dump,
)
from dcptool.dump.schema import GraphMode, KVGroup, _text_ok

_ABSENT = (0, -1, 0)  # a header entry of an absent section (or one the host holds): address, count, mode
_CHECKED: dict = {}  # CUDA device -> (compiled kernel whose launcher proved itself, or None; why not)
_I64 = 2**63 - 1
_I64_MIN = -(2**63)
# One observation's scalars, in dump.FIELDS order (step, rank, ubatch, num_reqs, num_reqs_padded, then the optional
# fields parent ... graph): Python ints, None where unknown.
Fields = NamedTuple("Fields", [(f, "int | None") for f in FIELDS])
_NEW = tuple.__new__  # Fields without its Python-level __new__ on the per-observation path (0.3 us -> 0.1 us)
FIXED = 8  # = kernel.SNAP_FIXED: the fixed header words of a slot (record.py describes a slot without triton)
ENTRY = 4  # = kernel.SNAP_ENTRY: header words per section
HEAD_READ = 64  # = kernel.SNAP_HEAD_READ: words the kernel reads at a slot's start (the ring is padded by it)
FENCE_EVERY = 64  # device observations between CUDA events (an event per launch would double the CPU cost)
ARENA_WORDS = 1 << 20  # the harvest's copies are cut from chunks of 4 MiB


class Section(NamedTuple):
    """One row column as observe() takes it and a ring slot holds it."""

    field: str  # its dump.ROW_FIELDS name
    name: str  # observe()'s keyword
    length: int  # ANY; ROWS: one value per seq_lens row, else the observation is dropped; ROWS_PLUS_1: else
    #              the section is not recorded (a query_start_loc that does not cover the rows)
    nonneg: bool = False  # a negative value drops the observation
    needs: str | None = None  # the DumpConfig setting it needs (else the observation is dropped)


ANY, ROWS, ROWS_PLUS_1 = 0, 1, 2
# The device path's row columns, in dump.ROW_FIELDS order; a new column is one entry here (and its keyword
# in observe()'s `srcs`), no kernel code.
SECTIONS = (Section("seq", "seq_lens", ANY, nonneg=True), Section("dcp", "dcp_local_seq_lens", ANY),
            Section("qsl", "query_start_loc", ROWS_PLUS_1), Section("kv", "kv_pages", ROWS, needs="page_size"),
            # issue 15: the empty-shard mask's Q and the global companion (device sections like the others)
            Section("dqsl", "dcp_query_start_loc", ANY), Section("tot", "dcp_tot_seq_lens", ANY, nonneg=True),
            # issue 15: slot entries (positions, slot mapping, KV-cache group), built on the host from the
            # per-group slot mappings (dump.slot_entries), so always host-held sections
            Section("pos", "positions", ANY), Section("slot", "slot_mapping", ANY), Section("sgrp", "slot_group", ANY))
if tuple(s.field for s in SECTIONS) != ROW_FIELDS:
    raise ImportError(f"record.SECTIONS {[s.field for s in SECTIONS]} must follow dump.ROW_FIELDS {ROW_FIELDS}")
_NO_SLOTS = (None, None, None)  # observe() without slot entries
# observe()'s fast path (kernel.snapshot_args_kernel): sections 0-2 as kernel arguments, their negative-value modes
if tuple(s.name for s in SECTIONS[:3]) != ("seq_lens", "dcp_local_seq_lens", "query_start_loc"):
    raise ImportError("record.SECTIONS must start with seq_lens, dcp_local_seq_lens, query_start_loc (the fast path)")
_FAST_NEG = sum(1 << (16 + k) for k, s in enumerate(SECTIONS[:3]) if s.nonneg)  # snapshot_args_kernel's ksec
DEFAULT_RING_BYTES = 4 << 20  # ~1,300 observations of 256 requests in flight


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


def _per_rank(x, k: int) -> np.ndarray | None:
    """observe_many's per-rank rows (kv_pages, issue 15's): one shared row (a read-only view of the private
    copy for every rank) or [ranks, rows]."""
    if x is None:
        return None
    flat = _host(x)
    one = (x.ndim if hasattr(x, "ndim") else np.ndim(x)) == 1
    return np.broadcast_to(flat, (k, flat.size)) if one else flat.reshape(k, -1)


def _nonneg(a: np.ndarray | None, name: str) -> np.ndarray | None:
    if a is not None and a.size and a.min() < 0:
        raise ValueError(f"negative {name}")
    return a


def _int(v, name: str) -> int:
    """An integer scalar as a Python int. 1.9, "7", 2.0, True and float arrays raise (the observation is
    dropped and counted): a wrong type is a bug in the caller, and coercing it would record a made-up value.
    numpy integer scalars and 0-d integer host tensors are integers."""
    if type(v) is int:
        return v
    if isinstance(v, (bool, np.bool_)):
        raise ValueError(f"{name} must be an integer, got the bool {v!r}")
    if hasattr(v, "detach") and (v.ndim or v.is_cuda or not _torch_int(v.dtype)):
        raise ValueError(f"{name} must be an integer, got a tensor ({v.dtype}, {tuple(v.shape)}, {v.device})")
    try:
        return operator.index(v)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {type(v).__name__} {v!r}") from None


def _opt(v, name: str) -> int | None:
    return None if v is None else _int(v, name)


def _torch_int(dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex) and str(dtype) != "torch.bool"


class _NoTensor:
    pass


_TENSOR: type = _NoTensor  # torch.Tensor once torch is imported (record.py does not import it)


def _find_torch() -> None:
    global _TENSOR
    torch = sys.modules.get("torch")
    if torch is not None:
        _TENSOR = torch.Tensor


class _Torch:
    """torch, looked up on first use (record.py does not import it: a CPU-only engine may not have it)."""

    def __getattr__(self, name):
        import torch

        for k in ("int32", "int64", "cuda", "_C"):
            setattr(self, k, getattr(torch, k))
        return getattr(torch, name)


_T = _Torch()


def _narrowed(x):
    """A device tensor as a contiguous 1-D int32/int64 one (a copy on the stream when it is not): (tensor, wide)."""
    x = x.reshape(-1)
    dt = x.dtype
    if dt is _T.int64:
        wide = 1
    elif dt is _T.int32:
        wide = 0
    elif not _torch_int(dt):
        raise ValueError(f"integer values expected, got dtype {dt}")
    else:
        x, wide = x.to(_T.int32), 0  # a narrower integer type: no value can be lost
    return (x if x.is_contiguous() else x.contiguous()), wide


def buffer_id(t) -> int:
    """Identity of the storage a tensor view aliases (0 when unknown): its storage's base address. (Measured
    on CPU tensors: 82 ns, against 148 ns for `data_ptr() - storage_offset() * element_size()`.)"""
    try:
        return int(t.untyped_storage().data_ptr())
    except Exception:
        return 0


def _head_struct(k: int) -> struct.Struct:
    """A slot header with k section entries (the fixed words, then address, count, mode per section)."""
    return struct.Struct("<8i" + "qii" * k)


class _Slot(tuple):
    """One observation in flight: (index, start, words, host); host holds, per section, the array of a
    section the host holds (None: none does)."""

    __slots__ = ()


def _slot_rows(blk: np.ndarray, o: int, host: list | None) -> tuple:
    """A harvested slot's rows, from word o of blk (a private copy of the ring): one entry per section in
    dump.ROW_FIELDS order, a view of the copy, a host array, or None."""
    k = int(blk[o + 4])
    counts = blk[o + FIXED:o + FIXED + ENTRY * k].reshape(k, ENTRY)[:, 2].tolist()
    p = o + FIXED + ENTRY * k
    out = []
    for j, n in enumerate(counts):
        if n >= 0:
            out.append(blk[p:p + n])
            p += n
        else:
            out.append(None if host is None else host[j])
    return tuple(out)


class _HostEvent:
    """The host ring's stand-in for a CUDA event (CPU tests): done at once, unless a test sets `hold`;
    synchronize() finishes it (and counts the wait)."""

    hold = False
    waits = 0

    def __init__(self):
        self.done = True

    def record(self, stream=None) -> None:
        self.done = not _HostEvent.hold

    def query(self) -> bool:
        return self.done or not _HostEvent.hold  # (released: the "GPU" caught up)

    def synchronize(self) -> None:
        if not self.done:
            _HostEvent.waits += 1
        self.done = True


class _SnapshotRing:
    """A circular buffer of int32 words (pinned host memory the GPU writes into) holding slots in flight.

    Slots are allocated in observation order; a fence is one CUDA event per stream that launched
    slots since the last fence, and every slot before it is complete once its events are.
    `go(raw_stream, slot_address)` launches the kernel on one slot; `how` says through what.
    """

    def __init__(self, words: int, device: int | None):
        import torch

        self.device = device  # CUDA device index; None: the host ring of the CPU tests (interpreted kernel)
        self.torch = torch
        self.words = 0
        self.pending: deque[_Slot] = deque()
        self.fences: deque[tuple[list, int]] = deque()  # (its events, the slots launched before it since the last)
        self.unfenced = 0  # slots launched since the last fence
        self.streams: dict = {}  # raw stream -> stream object, for streams with slots not yet fenced
        self.known: dict = {}
        self.free_events: list = []
        self.kernel = None
        self.go = None
        self.how = ""
        self.go3 = None  # the launch of kernel.snapshot_args_kernel (observe()'s fast path); None: not here
        self.how3 = ""
        self.did = -1 if device is None else device  # what get_device() says of a tensor this ring snapshots
        self.i32 = torch.int32
        # the engine's current raw stream (the CPU tests' host ring has none)
        self.raw = torch._C._cuda_getCurrentRawStream if device is not None else (lambda d: 0)
        self.resize(words)

    def resize(self, words: int) -> None:
        assert not self.pending
        # padded: the kernel reads HEAD_READ words from a slot's start in one go, also from the last slot
        self.buf = self.torch.empty(words + HEAD_READ, dtype=self.torch.int32, pin_memory=self.device is not None)
        self.np = self.buf.numpy()
        self.base = self.buf.data_ptr()
        self.words = words

    def alloc(self, need: int) -> int | None:
        """Start of `need` free words, or None when the ring is full."""
        if not self.pending:
            return 0 if need <= self.words else None
        tail = self.pending[0][1]
        last = self.pending[-1]
        head = last[1] + last[2]
        if last[1] >= tail:  # not wrapped: room at the end, else at the start before the oldest slot
            if head + need <= self.words:
                return head
            return 0 if need <= tail else None
        return head if head + need <= tail else None

    def event(self):
        if self.free_events:
            return self.free_events.pop()
        return self.torch.cuda.Event() if self.device is not None else _HostEvent()

    def fence(self) -> None:
        if not self.unfenced:
            return
        evs = []
        for s in self.streams.values():
            ev = self.event()
            ev.record(s)
            evs.append(ev)
        self.streams.clear()
        self.fences.append((evs, self.unfenced))
        self.unfenced = 0

    def stream(self, raw: int):
        s = self.known.get(raw)
        if s is None:
            s = self.known[raw] = self.torch.cuda.current_stream(self.device) if self.device is not None else None
        self.streams[raw] = s


class Recorder:
    """Record observations; `close()` (or leaving a `with` block) writes the dump atomically.

    `observe()` never raises into the engine: a value it cannot store (a bad length, a value int32
    cannot hold, a scalar that is not an integer: `step=1.9`, `rank="7"` and bools are dropped, never
    coerced) is counted in `dropped` and warned about once; an observation made inside CUDA-graph
    capture is not recorded and counted in `skipped_capture`. observe() is thread-safe: index
    allocation, appending and rollover happen under one lock.

    With `rollover=K`, every K observations go to a new numbered file (`run.00000.safetensors`,
    `run.00001.safetensors`, ...) so a long run never risks one huge file and everything up to the
    last rollover survives a killed process. Read the files together.

    CUDA tensors (`cuda_mode="async"`, the default) are snapshotted on the engine's current stream
    with no host synchronisation (see the module docstring); their values are checked when the slot
    is harvested, and an observation whose device values cannot be stored (a negative seq_len, an
    int64 value int32 cannot hold) is dropped then: counted in `dropped`, and the index observe()
    returned for it is not in the file (a `parent=` pointing at it is recorded as unknown). A full
    ring waits for the oldest launches (`ring_full="wait"`) or drops the observation and counts it in
    `ring_drops` (`ring_full="drop"`). `cuda_mode="sync"` copies with `.to("cpu")` as before.

    Nothing is lost quietly: an existing recording at `path` (or its numbered files) is refused
    unless `force=True`, which replaces it (numbered files included). While a Recorder is open it
    holds `path` on this host: a second Recorder (another process, or this one) for the same path
    records to `STEM.pPID.SUFFIX` instead, says so in a RuntimeWarning, and `path` names where it
    writes (`requested_path` what was asked for); every write also checks its file is still absent
    (or the earlier recording being replaced) and moves to such a name if another writer made it.
    A rollover file that cannot be written (disk full) is kept in memory, warned about, and retried
    at the next rollover and at close(), which raises WriteError if it still fails (call it again
    once there is room). A Recorder that was never closed is closed at interpreter exit. A killed
    process leaves every file it completed intact, and at most a hidden `.NAME.*.tmp` temporary
    that no reader uses.
    """

    def __init__(self, path: str | os.PathLike, dcp_size: int, cp_interleave: int = 1, *,
                 sites: tuple[str, ...] = (), pcp_size: int = 1, page_size: int | None = None,
                 engine: str | None = None, engine_version: str | None = None, note: str | None = None,
                 rollover: int | None = None, force: bool = False, cuda_mode: str = "async",
                 ring_bytes: int = DEFAULT_RING_BYTES, ring_full: str = "wait", kv_groups=None):
        self.requested_path = Path(path)
        self.config = DumpConfig(dcp_size=dcp_size, cp_interleave=cp_interleave, sites=tuple(sites),
                                 pcp_size=pcp_size, page_size=page_size, engine=engine,
                                 engine_version=engine_version, note=note,
                                 kv_groups=None if kv_groups is None else tuple(KVGroup.of(g) for g in kv_groups))
        check_config(self.requested_path, self.config)  # a bad config fails here, not hours later at close()
        if rollover is not None and rollover < 1:
            raise ValueError(f"rollover must be >= 1, got {rollover}")
        if cuda_mode not in ("async", "sync"):
            raise ValueError(f"cuda_mode must be 'async' or 'sync', got {cuda_mode!r}")
        if ring_full not in ("wait", "drop"):
            raise ValueError(f"ring_full must be 'wait' or 'drop', got {ring_full!r}")
        self.rollover = rollover
        self._ranks = dcp_size
        self.cuda_mode = cuda_mode
        self.ring_full = ring_full
        self._ring_words = max(1024, int(ring_bytes) // 4)
        self._lock = threading.RLock()
        self._acquire, self._release_lock = self._lock.acquire, self._lock.release
        self._claim_sock = None
        self.path = self.requested_path
        self._stale = self._claim(force)
        self.injected: dict[str, list[int]] | None = None
        self.dropped = 0
        self.skipped_capture = 0  # observations made inside CUDA-graph capture (not recorded)
        self.ring_drops = 0  # device observations dropped because the ring was full (ring_full="drop")
        self.write_errors = 0  # failed writes (each retried later); the last one in `last_error`
        self.last_error: str | None = None
        self.files: list[Path] = []
        # One tuple of scalars and one of row arrays per observation, turned into columns only at write
        # time (zip(*)): observe() stays a couple of appends, close() a handful of concatenations. A row
        # entry is a _Slot while its device values are in flight, None once dropped at harvest.
        self._vals: list[Fields] = []
        self._sites: list[str] = []
        self._rows: list = []  # per dump.ROW_FIELDS: (seq_lens, dcp_local_seq_lens, query_start_loc, kv_pages, ...)
        self._count = 0  # observation indices handed out over all files
        self._late = 0  # of them, dropped at harvest
        self._file_start = 0  # global index of the current file's first observation
        self._retry_at = rollover  # pending observations that trigger the next write
        self._ring: _SnapshotRing | None = None
        self._landed: list[tuple[int, np.ndarray, int]] = []  # harvested runs: (first index, copy, its ring word)
        self._arena: np.ndarray | None = None  # where _keep cuts the copies from
        self._arena_at = 0
        self._on = "is_cuda"  # the tensor attribute that sends a value through the ring (CPU tests: "is_cpu")
        _find_torch()
        self._site_ok: set[str] = set()  # site names already checked
        self._sections(SECTIONS)
        self._max_group = -1  # the highest KV-cache group index recorded (slot entries)
        self._warned = False
        self._warned_write = False
        self._closed = False
        atexit.register(self._at_exit)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return self._count - self._late

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
                warnings.warn(f"dcptool Recorder: {taken}; recording to {cand} instead", RuntimeWarning, stacklevel=3)
            return stale
        raise OutputExistsError(f"{base}: no free name beside it for a second recording")

    def _release(self) -> None:
        if self._claim_sock is not None and self._claim_sock is not True:
            self._claim_sock.close()
        self._claim_sock = None

    # ---- checks ----------------------------------------------------------------------------------

    def _sections(self, sections: tuple[Section, ...]) -> None:
        """What the device path derives from the section table (once, not per observation)."""
        self._nsec = len(sections)
        self._head = _head_struct(len(sections))
        self._head_words = FIXED + ENTRY * len(sections) + 7  # (+ 7: rounded down to 8 words at the end)
        self._modes = tuple(2 if x.nonneg else 0 for x in sections)  # header mode bit 1: negatives flagged
        self._rules = tuple((k, x) for k, x in enumerate(sections) if x.length != ANY or x.needs or x.nonneg)
        self._plus1 = tuple(k for k, x in enumerate(sections) if x.length == ROWS_PLUS_1)
        self._sized = tuple(k for k, x in enumerate(sections) if x.length == ROWS)
        self._needs = tuple((k, x.needs) for k, x in enumerate(sections) if x.needs)
        self._fast_words = FIXED + ENTRY * len(sections) + 7  # (the fast path's slot: sections 0-2 only)
        self._fast_pad = (None,) * (len(sections) - 3)
        self._ksec = len(sections) | _FAST_NEG

    def _check_shared(self, vals: Fields, site, kv_rows: int | None, rows: int) -> None:
        """What the dump format cannot hold (DESIGN §2) raises here and in _check_own, so a write never
        fails on it: the values one batch's observations share."""
        self._check_vals(vals, site)
        if kv_rows is not None and (self.config.page_size is None or kv_rows != rows):
            raise ValueError(f"kv_pages needs page_size in the config and one value per seq_lens row ({rows})")

    def _check_vals(self, vals: Fields, site) -> None:
        """The scalars and the site of _check_shared."""
        step, _, ubatch, _, nrp, _, rs, ts, te, ntp, _, graph = vals  # Fields, in order (one unpack: the hot path)
        # any name a reader accepts (reports show markup and control characters literally); not lone surrogates
        if type(site) is not str or site not in self._site_ok:
            if type(site) is not str or not _text_ok(site):
                raise ValueError(f"site must be a string of valid Unicode, got {site!r}")
            if len(self._site_ok) < 1024:
                self._site_ok.add(site)
        if not (-_I64 - 1 <= step <= _I64 and -1 <= ubatch <= INT32_MAX and nrp <= INT32_MAX):
            raise ValueError(f"step {step}, ubatch {ubatch} or num_reqs_padded {nrp} out of range")
        if rs is not None or ts is not None or te is not None or ntp is not None:
            for v in (rs, ts, te, ntp):
                if v is not None and not -1 <= v <= INT32_MAX:
                    raise ValueError(f"req_start/tok_start/tok_stop/num_tokens_padded {v} out of range")
        if graph is not None and not 0 <= graph <= 3:
            raise ValueError(f"graph {graph} is not 0..3")

    def _check_own(self, rank: int, parent: int | None, buffer: int | None, index: int) -> None:
        """... and the values of one rank's observation (index: the one it will get)."""
        if not 0 <= rank < self.config.dcp_size:
            raise ValueError(f"rank {rank} out of range for dcp_size {self.config.dcp_size}")
        if parent is not None and parent >= index:
            raise ValueError(f"parent {parent} is not an earlier observation")
        if buffer is not None and not -_I64 - 1 <= buffer <= _I64:
            raise ValueError(f"buffer {buffer} does not fit int64")

    @staticmethod
    def _scalars(step, rank, ubatch, num_reqs, num_reqs_padded, parent, req_start, tok_start, tok_stop,
                 num_tokens_padded, buffer, graph) -> Fields:
        """dump.FIELDS as Python ints (checked: never coerced); parent None when unknown."""
        if (type(step) is int and type(rank) is int and type(ubatch) is int and type(num_reqs) is int
                and type(num_reqs_padded) is int and (parent is None or type(parent) is int)
                and (req_start is None or type(req_start) is int) and (tok_start is None or type(tok_start) is int)
                and (tok_stop is None or type(tok_stop) is int)
                and (num_tokens_padded is None or type(num_tokens_padded) is int)
                and (buffer is None or type(buffer) is int) and (graph is None or type(graph) is int)):
            # what engines pass: no conversion needed
            return _NEW(Fields, (step, rank, ubatch, num_reqs, num_reqs_padded,
                                 None if parent is None or parent < 0 else parent, req_start, tok_start, tok_stop,
                                 num_tokens_padded, buffer, graph))
        p = _opt(parent, "parent")
        g = int(GraphMode.parse(graph)) if isinstance(graph, str) else _opt(graph, "graph")
        return Fields(_int(step, "step"), _int(rank, "rank"), _int(ubatch, "ubatch"), _int(num_reqs, "num_reqs"),
                      _int(num_reqs_padded, "num_reqs_padded"), None if p is None or p < 0 else p,
                      _opt(req_start, "req_start"), _opt(tok_start, "tok_start"), _opt(tok_stop, "tok_stop"),
                      _opt(num_tokens_padded, "num_tokens_padded"), _opt(buffer, "buffer"), g)

    # ---- observe ---------------------------------------------------------------------------------

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
        tensor, or a dict {group index: 1-D tensor}) go together; they are copied on the host (a CUDA
        tensor there is copied with `.to("cpu")`, which waits for the stream)."""
        ring = self._ring
        if (ring is not None and type(seq_lens) is _TENSOR and ring.go3 is not None and kv_pages is None
                and dcp_query_start_loc is None and dcp_tot_seq_lens is None and positions is None
                and slot_mapping is None and buffer is None):
            try:  # the engine's common case (see _observe_fast); None: the general path below
                got = self._observe_fast(ring, step, site, rank, seq_lens, num_reqs, num_reqs_padded,
                                         dcp_local_seq_lens, ubatch, parent, req_start, tok_start, tok_stop,
                                         query_start_loc, num_tokens_padded, graph)
            except Exception as e:  # never break the engine
                self._drop(e)
                return -1
            if got is not None:
                return got
        try:
            slots = _NO_SLOTS if positions is None and slot_mapping is None else self._slots(positions, slot_mapping)
            # SECTIONS (dump.ROW_FIELDS) order
            srcs = (seq_lens, dcp_local_seq_lens, query_start_loc, kv_pages, dcp_query_start_loc, dcp_tot_seq_lens,
                    *slots)
            on = self._on
            if _TENSOR is _NoTensor:
                _find_torch()  # (torch imported after the Recorder was made)
            x = seq_lens
            if not (isinstance(x, _TENSOR) and getattr(x, on)):  # (the engine's case at once)
                for x in srcs:
                    if isinstance(x, _TENSOR) and getattr(x, on):
                        break  # a device tensor: the device path
                else:
                    x = None
            if x is not None:
                if self._capturing():
                    with self._lock:
                        self.skipped_capture += 1
                    return -1
                if buffer is None and dcp_local_seq_lens is not None:
                    buffer = buffer_id(dcp_local_seq_lens)
                vals = self._scalars(step, rank, ubatch, num_reqs, num_reqs_padded, parent, req_start, tok_start,
                                     tok_stop, num_tokens_padded, buffer, graph)
                if self.cuda_mode == "async":
                    got = self._observe_device(vals, site, srcs)
                    if got is not None:
                        return got
            else:
                if buffer is None and dcp_local_seq_lens is not None and hasattr(dcp_local_seq_lens,
                                                                                 "untyped_storage"):
                    buffer = buffer_id(dcp_local_seq_lens)
                vals = self._scalars(step, rank, ubatch, num_reqs, num_reqs_padded, parent, req_start, tok_start,
                                     tok_stop, num_tokens_padded, buffer, graph)
            seq, qsl = self._batch(seq_lens, vals.num_reqs, vals.num_reqs_padded, query_start_loc)
            row = (seq, _host_fast(dcp_local_seq_lens), qsl, _host_fast(kv_pages), _host_fast(dcp_query_start_loc),
                   _nonneg(_host_fast(dcp_tot_seq_lens), "dcp_tot_seq_lens"), *slots)
            self._check_shared(vals, site, None if row[3] is None else row[3].size, seq.size)
        except Exception as e:  # never break the engine
            self._drop(e)
            return -1
        with self._lock:
            try:
                if self._closed:
                    raise RuntimeError("observe() after close()")
                self._check_own(vals.rank, vals.parent, vals.buffer, self._count)
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
            common = self._scalars(step, 0, ubatch, num_reqs, num_reqs_padded, None, req_start, tok_start,
                                   tok_stop, num_tokens_padded, None, graph)
            step, _, ubatch, nr, nrp, _, rs, ts, te, ntp, _, graph = common  # Fields, in order
            seq, qsl = self._batch(seq_lens, nr, nrp, query_start_loc)
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
            self._check_shared(common, site, None if kv is None else kv.shape[1], seq.size)
        except Exception as e:
            self._drop(e, k)
            return [-1] * k
        with self._lock:
            try:
                if self._closed:
                    raise RuntimeError("observe() after close()")
                for i in range(k):
                    self._check_own(ranks[i], parents[i], buffers[i], self._count + i)
            except Exception as e:
                self._drop(e, k)
                return [-1] * k
            return [self._append(_NEW(Fields, (step, ranks[i], ubatch, nr, nrp, parents[i], rs, ts, te, ntp,
                                               buffers[i], graph)), site, (seq, None if dcp is None else dcp[i], qsl,
                                                       None if kv is None else kv[i],
                                                       *(None if x is None else x[i] for x in extra), *extras[i]))
                    for i in range(k)]

    def _batch(self, seq_lens, nr: int, nrp: int, query_start_loc):
        """Host copies and checks shared by observe() and observe_many(); raises on what cannot be stored."""
        seq = _host_fast(seq_lens)
        if not 0 <= nr <= nrp or seq.size < nr or (seq.size and seq.min() < 0):
            raise ValueError(f"num_reqs {nr}, num_reqs_padded {nrp}, {seq.size} seq_lens rows")
        qsl = _host_fast(query_start_loc)
        if qsl is not None and qsl.size != seq.size + 1:
            qsl = None  # a query_start_loc that does not cover the rows is of no use to replay
        return seq, qsl

    def _slots(self, positions, slot_mapping) -> tuple:
        """dump.slot_entries of host copies (int32-checked); raises on what cannot be stored (dropped)."""
        if positions is None and slot_mapping is None:
            return _NO_SLOTS
        if positions is None or slot_mapping is None:
            raise ValueError("positions and slot_mapping go together")
        pos = _host(positions)
        if pos.size and pos.min() < 0:
            raise ValueError("negative positions")
        if isinstance(slot_mapping, dict):
            maps = {_int(g, "KV-cache group"): _host(m) for g, m in slot_mapping.items()}
        else:
            ndim = slot_mapping.ndim if hasattr(slot_mapping, "ndim") else np.ndim(slot_mapping)
            maps = _host(slot_mapping) if ndim == 1 else dict(enumerate(_host(x) for x in slot_mapping))
        kvg = self.config.kv_groups
        out = slot_entries(pos, maps, None if kvg is None else len(kvg))
        if out[2].size:
            with self._lock:
                self._max_group = max(self._max_group, int(out[2][-1]))
        return out[0], out[1], out[2].astype(np.int32)

    def set_kv_groups(self, kv_groups) -> None:
        """Name the KV-cache groups (and whether DCP shards each) once they are known, e.g. by an engine
        plugin after the KV cache is set up; ValueError if they do not cover the groups recorded so far."""
        groups = tuple(KVGroup.of(g) for g in kv_groups)
        with self._lock:
            if len(groups) <= self._max_group:
                raise ValueError(f"{len(groups)} KV-cache groups, but group {self._max_group} was recorded")
            self.config = DumpConfig(**{**self.config.__dict__, "kv_groups": groups})
            check_config(self.requested_path, self.config)

    @staticmethod
    def _capturing() -> bool:
        """Inside CUDA-graph capture on the current stream (only asked once a CUDA tensor was seen)."""
        return _T._C._cuda_isCurrentStreamCapturing()  # (torch.cuda.is_current_stream_capturing)

    def _drop(self, e: Exception, n: int = 1) -> None:
        with self._lock:
            self.dropped += n
            if self._warned:
                return
            self._warned = True
        warnings.warn(f"dcptool Recorder dropped an observation it cannot store ({e}); "
                      "counting further drops silently", RuntimeWarning, stacklevel=3)

    def _append(self, vals: Fields, site: str, row) -> int:
        """Under the lock: give the observation its index and keep it; roll over when a file is full."""
        self._vals.append(vals)
        self._sites.append(site)
        self._rows.append(row)
        self._count += 1
        if self.rollover is not None and len(self._sites) >= self._retry_at:
            self._flush(raise_errors=False)
        return self._count - 1

    # ---- the device path -------------------------------------------------------------------------

    def _observe_device(self, vals: Fields, site: str, srcs: tuple) -> int | None:
        """Snapshot the observation's device tensors in one launch; None: take the host path instead.

        The header's section entries are collected here, checked by the section table's rules, and written
        with the rest of the header into the slot just before the launch. (Written for speed: this is the
        engine's cost of recording, see benchmarks/bench_record.py --cuda and --cuda-python.)
        """
        on = self._on
        i32 = _T.int32
        modes = self._modes
        ent = []  # address, count, mode per section (count -1: absent, or held on the host)
        host = None  # the sections the host holds (None: none does)
        words = self._head_words
        device = -2
        keep = None  # converted copies: alive until the launch is queued (their memory is reused in stream order)
        for k, x in enumerate(srcs):
            if x is None:
                ent += _ABSENT
            elif isinstance(x, _TENSOR) and getattr(x, on):
                d = x.get_device()
                if d != device:
                    if device != -2:
                        return None  # tensors on two devices: the host path copies them
                    device = d
                if x.dtype is i32 and x.is_contiguous():  # (contiguous: its values are numel() words at data_ptr)
                    n = x.numel()
                    ent += (x.data_ptr(), n, modes[k])
                else:
                    x, wide = _narrowed(x)
                    keep = [x] if keep is None else [*keep, x]
                    n = x.numel()
                    ent += (x.data_ptr(), n, modes[k] | wide)
                words += n
            else:
                if host is None:
                    host = [None] * len(srcs)
                host[k] = _host_fast(x)
                ent += _ABSENT
        nr, nrp = vals[3], vals[4]
        rows = ent[1] if ent[1] >= 0 or host is None or host[0] is None else host[0].size
        if rows < nr or not 0 <= nr <= nrp:
            raise ValueError(f"num_reqs {nr}, num_reqs_padded {nrp}, {rows} seq_lens rows")
        if host is None:  # every section on the device (or absent): the length rules on the header's counts
            for k in self._plus1:
                n = ent[3 * k + 1]
                if n >= 0 and n != rows + 1:  # of no use to replay (as on the host path)
                    ent[3 * k + 1] = -1
                    words -= n
            for k in self._sized:
                n = ent[3 * k + 1]
                if n >= 0 and n != rows:
                    raise ValueError(f"{SECTIONS[k].name} needs one value per seq_lens row ({rows}), got {n}")
            for k, need in self._needs:
                if ent[3 * k + 1] >= 0 and getattr(self.config, need) is None:
                    raise ValueError(f"{SECTIONS[k].name} needs {need} in the config")
        else:
            words = self._host_rules(ent, host, rows, words)
        self._check_vals(vals, site)
        words &= ~7
        if device < 0:
            device = None  # (the host ring of the CPU tests)
        with self._lock:
            if self._closed:
                raise RuntimeError("observe() after close()")
            index = self._count
            rank, parent, buffer = vals[1], vals[5], vals[10]
            if not 0 <= rank < self.config.dcp_size or (parent is not None and parent >= index) or (
                    buffer is not None and not -_I64 - 1 <= buffer <= _I64):
                self._check_own(rank, parent, buffer, index)  # (raises, saying which)
            ring = self._ring
            if ring is None:
                if device != _T.cuda.current_device():
                    return None  # (the ring's launcher is bound to the current device's context)
                ring = self._start_ring(device)
                if ring is None:
                    return None
            elif ring.device != device:
                return None  # tensors of another device than the ring's: the host path copies them
            start = ring.alloc(words)
            if start is None:
                start = self._room(ring, words)
            self._head.pack_into(ring.np, 4 * start, index & 0x7FFFFFFF, -1, nr, nrp, self._nsec, 0, words, 0, *ent)
            raw = ring.raw(device)
            ring.go(raw, ring.base + 4 * start)
            del keep
            return self._queued(ring, raw, index, start, words, host, vals, site)

    def _queued(self, ring: _SnapshotRing, raw: int, index: int, start: int, words: int, host, vals, site: str) -> int:
        """Under the lock, once a snapshot is launched (either path): keep its slot as the observation's row, and
        fence every FENCE_EVERY launches (collecting the slots finished by then)."""
        if raw not in ring.streams:
            ring.stream(raw)
        slot = _NEW(_Slot, (index, start, words, host))
        ring.pending.append(slot)
        ring.unfenced += 1
        self._append(vals, site, slot)
        if ring.unfenced >= FENCE_EVERY:
            ring.fence()
            self._harvest(wait=False)
        return index

    def _observe_fast(self, ring: _SnapshotRing, step, site, rank, seq, nr, nrp, dcp, ubatch, parent, rs, ts, te,
                      qsl, ntp, graph) -> int | None:
        """observe() for what an engine passes each step, once the ring runs: seq_lens (and dcp_local_seq_lens,
        query_start_loc when given) contiguous int32 tensors on the ring's device, or query_start_loc a 1-D numpy
        array (held on the host), plain int scalars, no other row column. One launch of snapshot_args_kernel
        with the header as arguments (the kernel writes it into the slot): no header packed on the CPU, no
        section loop. The same checks as the general path; anything else returns None (the general path
        takes it, and raises what it cannot store). Written for speed (bench_record.py --cuda-python): a
        tensor's get_device() equal to the ring's also says it is a device tensor (-1: the CPU tests' host ring)."""
        did = ring.did
        if seq.get_device() != did:
            return None
        if self._capturing():
            with self._lock:
                self.skipped_capture += 1
            return -1
        i32 = ring.i32
        if not (type(step) is type(rank) is type(nr) is type(nrp) is type(ubatch) is int and seq.dtype is i32
                and seq.is_contiguous()):
            return None
        rows = seq.numel()
        words = self._fast_words + rows
        if dcp is None:
            dp, dn, buffer = ring.base, -1, None  # (absent: count -1, any readable address)
        elif type(dcp) is _TENSOR and dcp.get_device() == did and dcp.dtype is i32 and dcp.is_contiguous():
            dp = dcp.data_ptr()
            dn = dcp.numel()
            buffer = dp - 4 * dcp.storage_offset()  # (= buffer_id(dcp): its storage's base address)
            words += dn
        else:
            return None
        host = None
        if qsl is None:
            qp, qn = ring.base, -1
        elif type(qsl) is _TENSOR:
            if not (qsl.get_device() == did and qsl.dtype is i32 and qsl.is_contiguous()):
                return None
            qp = qsl.data_ptr()
            qn = qsl.numel()
            if qn == rows + 1:
                words += qn
            else:
                qn = -1  # a query_start_loc that does not cover the rows is of no use to replay (not recorded)
        elif type(qsl) is np.ndarray and qsl.ndim == 1:
            qp, qn = ring.base, -1
            if qsl.size == rows + 1:
                host = (None, None, _int32(qsl), *self._fast_pad)
        else:
            return None
        if parent is not None:
            if type(parent) is not int:
                return None
            if parent < 0:
                parent = None
        if not (0 <= nr <= nrp <= INT32_MAX and nr <= rows and _I64_MIN <= step <= _I64 and -1 <= ubatch <= INT32_MAX
                and site in self._site_ok and (graph is None or (type(graph) is int and 0 <= graph <= 3))):
            return None
        if rs is not None or ts is not None or te is not None or ntp is not None:
            for v in (rs, ts, te, ntp):
                if v is not None and not (type(v) is int and -1 <= v <= INT32_MAX):
                    return None
        words &= ~7
        sp = seq.data_ptr()
        self._acquire()  # (the lock's acquire/release called directly: 80 ns less than `with`)
        try:
            index = self._count
            if self._closed or not 0 <= rank < self._ranks or (parent is not None and parent >= index):
                return None
            start = ring.alloc(words)
            if start is None:
                start = self._room(ring, words)
            raw = ring.raw(did)
            ring.go3(raw, ring.base + 4 * start, index & 0x7FFFFFFF, nr, nrp, self._ksec, words, sp, rows, dp, dn,
                     qp, qn)
            # (a plain tuple in Fields order: _pack reads _vals by position; 70 ns less than a Fields)
            return self._queued(ring, raw, index, start, words, host,
                                (step, rank, ubatch, nr, nrp, parent, rs, ts, te, ntp, buffer, graph), site)
        finally:
            self._release_lock()

    def _host_rules(self, ent: list, host: list, rows: int, words: int) -> int:
        """_observe_device's length rules when the host holds some sections; returns the slot's words."""
        for k, sec in self._rules:
            n = ent[3 * k + 1]
            h = host[k]
            size = n if n >= 0 else -1 if h is None else h.size
            if size < 0:
                continue
            if sec.needs and getattr(self.config, sec.needs) is None:
                raise ValueError(f"{sec.name} needs {sec.needs} in the config")
            if sec.length == ROWS_PLUS_1 and size != rows + 1:  # of no use to replay (as on the host path)
                ent[3 * k + 1] = -1
                if n >= 0:
                    words -= n
                else:
                    host[k] = None
            elif sec.length == ROWS and size != rows:
                raise ValueError(f"{sec.name} needs one value per seq_lens row ({rows}), got {size}")
            elif sec.nonneg and h is not None and h.size and h.min() < 0:
                raise ValueError(f"negative {sec.name}")
        return words

    def _start_ring(self, device: int | None) -> _SnapshotRing | None:
        """The ring, its kernel, and on a GPU a one-time check (one synchronisation each) that a launch writes
        what the kernel should, trying the cheapest launch first: the launcher's C entry called directly, then
        Triton's compiled launcher, then Triton's dispatch; else sync mode. The same for the fast path's kernel
        (_fast_launch; without a compiled launcher observe() has no fast path)."""
        from dcptool.engine import snapshot as K

        ring = _SnapshotRing(self._ring_words, device)
        try:
            ring.kernel = K.snapshot_kernel()
        except Exception as e:
            return self._no_ring(e)
        if device is not None and device in _CHECKED:  # (checked once per process and device)
            ring.go, ring.how, ring.go3, ring.how3 = _CHECKED[device]
        elif device is not None:
            try:
                torch = ring.torch
                with torch.cuda.device(device):
                    ck = _self_check(ring, K.snapshot_dispatch)  # (compiles it)
                    go, how, why = _cheapest(ring, _self_check, ck, variadic=False)
                    if go is None:
                        go, how = K.snapshot_dispatch, f"Triton's dispatch ({'; '.join(why)})"
                    elif why:
                        how += f" ({'; '.join(why)})"
                    ring.go, ring.how = go, how
                    ring.go3, ring.how3 = _fast_launch(ring)
                _CHECKED[device] = (ring.go, ring.how, ring.go3, ring.how3)
            except Exception as e:
                return self._no_ring(e)
        self._ring = ring
        if "_capturing" not in self.__dict__ and device is not None:
            self._capturing = ring.torch._C._cuda_isCurrentStreamCapturing  # (no Python frame per observe)
        return ring

    def _no_ring(self, e: Exception) -> None:
        self.cuda_mode = "sync"
        warnings.warn(f"dcptool Recorder cannot snapshot CUDA tensors asynchronously here ({e}); copying them "
                      "with .to('cpu'), which waits for the stream", RuntimeWarning, stacklevel=4)
        return None

    def _room(self, ring: _SnapshotRing, words: int) -> int:
        """Start of a free slot of `words`: harvest finished slots, wait for the oldest or drop when full."""
        start = ring.alloc(words)
        if start is not None:
            return start
        if words > ring.words:  # bigger than the whole ring: finish what is in flight, then grow it
            self._harvest(wait=True)
            ring.resize(max(2 * ring.words, 2 * words))
            return 0
        self._harvest(wait=False)
        while (start := ring.alloc(words)) is None:
            if self.ring_full == "drop":
                self.ring_drops += 1
                raise ValueError("the snapshot ring is full (the GPU is far behind); ring_full='wait' waits instead")
            ring.fence()
            self._harvest(wait=True, one=True)
        return start

    def _harvest(self, *, wait: bool, one: bool = False) -> None:
        """Under the lock: copy the finished slots out of the ring (wait: finish all in flight first)."""
        ring = self._ring
        if ring is None:
            return
        if wait and not one:
            ring.fence()
        while ring.fences:
            evs, n = ring.fences[0]
            if not all(ev.query() for ev in evs):
                if not wait:
                    return
                for ev in evs:
                    ev.synchronize()
            ring.fences.popleft()
            ring.free_events.extend(evs)
            pop = ring.pending.popleft  # (the n slots launched before this fence: the oldest in flight)
            self._resolve(ring, [pop() for _ in range(n)])
            if one:
                return

    def _resolve(self, ring: _SnapshotRing, take: list[_Slot]) -> None:
        """Finished slots: one private copy of each contiguous run of the ring (kept in _landed until written),
        their headers checked at once (done == seqno, flags); the rows are cut out of the copy at the write."""
        if not take:
            return
        cols = tuple(zip(*take))  # (one pass over the slots, in C)
        index, starts, words = np.array(cols[0], np.int64), np.array(cols[1], np.int64), np.array(cols[2], np.int64)
        ends = starts + words
        cut = (np.flatnonzero(starts[1:] != ends[:-1]) + 1).tolist()  # (where the ring wrapped)
        for i, j in zip([0, *cut], [*cut, len(take)]):
            lo = int(starts[i])
            blk = self._keep(ring.np[lo:int(ends[j - 1])])
            self._landed.append((take[i][0], blk, lo))
            offs = starts[i:j] - lo
            seqno = index[i:j] & 0x7FFFFFFF
            flags = blk[offs + 5]
            bad = (blk[offs + 1] != seqno) | (flags != 0)
            if bad.any():
                for k in np.flatnonzero(bad).tolist():
                    s, f = take[i + k], int(flags[k])
                    self._rows[s[0] - self._file_start] = None
                    self._late += 1
                    why = ("a negative seq_len" if f & 2 else "a value int32 cannot hold" if f & 1
                           else "a ring slot that does not hold it")
                    self._drop(ValueError(f"observation {s[0]}: the device values hold {why}"))

    def _keep(self, src: np.ndarray) -> np.ndarray:
        """A private copy of src, cut from a chunk of ARENA_WORDS words (one allocation, and one page-fault run
        of fresh memory, per ~1,000 observations instead of one per harvest: 30% less time per harvested word,
        measured); a chunk is freed once no harvested run still to write lies in it."""
        a, pos, n = self._arena, self._arena_at, src.size
        if a is None or pos + n > a.size:
            a = self._arena = np.empty(max(ARENA_WORDS, n), np.int32)
            pos = 0
        out = a[pos:pos + n]
        np.copyto(out, src)
        self._arena_at = pos + n
        return out

    def _abandon(self, e: Exception) -> None:
        """The slots in flight cannot be harvested: drop those observations (counted, warned)."""
        ring = self._ring
        while ring.pending:
            s = ring.pending.popleft()
            self._rows[s[0] - self._file_start] = None
            self._late += 1
            self._drop(ValueError(f"observation {s[0]}: its device snapshot cannot be read ({e})"))
        ring.fences.clear()

    def _use_host_ring(self, words: int = 4096) -> _SnapshotRing:
        """For the CPU tests: send host torch tensors through a (non-pinned) ring and the interpreted kernel."""

        from dcptool.engine import snapshot as K

        self._on = "is_cpu"
        self._capturing = lambda: False  # (a CPU build of torch has no capture to ask about)
        self._ring = _SnapshotRing(words, None)
        self._ring.kernel = K.snapshot_kernel()
        self._ring.go, self._ring.how = K.snapshot_dispatch, "the Triton interpreter"
        self._ring.go3, self._ring.how3 = K.snapshot_args_dispatch, "the Triton interpreter"
        return self._ring

    def _target(self) -> Path:
        if self.rollover is None:
            return self.path
        return self.path.with_name(f"{self.path.stem}.{len(self.files):05d}{self.path.suffix or '.safetensors'}")

    def _pack(self, n: int) -> tuple[dict[str, np.ndarray], list | None]:
        """The first n observations since the last file, as dump columns (site indices stable across rolled
        files), and the file row of each kept observation (None when all were kept)."""
        vals, sites, rows = self._vals[:n], self._sites[:n], self._rows[:n]
        if any(type(r) is _Slot for r in rows):  # harvested device observations: their rows from the copies
            firsts = [x[0] for x in self._landed]
            rows = list(rows)
            for i, r in enumerate(rows):
                if type(r) is _Slot:
                    first, blk, lo = self._landed[bisect.bisect_right(firsts, r[0]) - 1]
                    if first > r[0] or (self._ring.pending and self._ring.pending[0][0] <= r[0]):
                        raise RuntimeError(f"dcptool Recorder: observation {r[0]} is written before it landed")
                    rows[i] = _slot_rows(blk, r[1] - lo, r[3])
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
        write_dump(target, self.config, cols, injected)
        self._stale = []
        self.files.append(target)
        self._file_start += n
        if self._landed:  # the copies no observation still to write points into
            firsts = [x[0] for x in self._landed]
            del self._landed[:max(0, bisect.bisect_right(firsts, self._file_start) - 1)]
        self._vals, self._sites, self._rows = self._vals[n:], self._sites[n:], self._rows[n:]

    def _flush(self, *, raise_errors: bool) -> None:
        n = None
        ring = self._ring
        if ring is not None and ring.pending:  # device values still in flight: write the observations before
            self._harvest(wait=raise_errors)
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
        self._retry_at = self.rollover

    def harvest(self) -> None:
        """Copy the finished device snapshots out of the ring now (no waiting): for a step boundary."""
        with self._lock:
            self._harvest(wait=False)

    def close(self) -> list[Path]:
        """Write what is left (atomically); returns the files written. Safe to call twice.

        Waits for the device snapshots still in flight. Raises WriteError (naming the file) when the
        last file cannot be written; the observations stay in memory and a later close() tries again.
        """
        with self._lock:
            if self._closed:
                return self.files
            try:
                self._harvest(wait=True)
            except Exception as e:  # the device is gone (a CUDA error, interpreter exit): keep the rest
                self._abandon(e)
            if self._sites or not self.files:
                self._flush(raise_errors=True)
            self._closed = True
            self._release()
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


def _self_check(ring: _SnapshotRing, go):
    """Launch the kernel through `go` once on known values (unaligned, int64, an overflow, an absent section)
    and compare; returns what `go` returned (the compiled kernel, for Triton's dispatch)."""
    torch = ring.torch
    dev = ring.device
    a = torch.arange(1, 7, dtype=torch.int32, device=dev)[1:]  # an unaligned view: 2..6
    b = torch.tensor([7, -2, 2**40], dtype=torch.int64, device=dev)
    ring.np[:HEAD_READ] = -9
    _head_struct(4).pack_into(ring.np, 0, 12345, -1, 5, 6, 4, 0, 40, 0, a.data_ptr(), 5, 2, 0, -1, 0, b.data_ptr(), 3,
                              1, a.data_ptr(), 5, 0)
    got = go(torch._C._cuda_getCurrentRawStream(dev), ring.base)
    torch.cuda.synchronize(dev)
    want = [12345, 12345, 5, 6, 4, 1, 40, 0]
    rows = [2, 3, 4, 5, 6, 7, -2, 0, 2, 3, 4, 5, 6]
    have = ring.np[:FIXED].tolist(), ring.np[FIXED + 4 * ENTRY:FIXED + 4 * ENTRY + len(rows)].tolist()
    if have != (want, rows):
        raise RuntimeError(f"snapshot kernel self-check wrote {have}")
    return got


def _compiled_launch(ck, variadic: bool = False):
    """A launch through Triton's compiled launcher (no dispatch: no argument binding, no cache lookup); variadic:
    go(raw, *args) for a kernel of several arguments, else go(raw, slot)."""
    run, fn, meta = ck.run, ck.function, ck.packed_metadata
    if variadic:
        return lambda raw, *a: run(1, 1, 1, raw, fn, meta, None, None, None, *a)
    return lambda raw, at: run(1, 1, 1, raw, fn, meta, None, None, None, at)


# The Python wrapper (CudaLauncher.__call__) of the launchers whose C entry `launch` is called directly: its
# call of `self.launch`, whitespace removed. Another wrapper (another Triton) is used as it is.
_WRAPPED = {  # triton 3.6: the kernel's arguments unpacked
    "self.launch(gridX,gridY,gridZ,stream,function,self.launch_cooperative_grid,self.launch_pdl,global_scratch,"
    "profile_scratch,*args)": 36,
    # triton 3.9: annotations, a signature and the kernel's arguments as one tuple
    "self.launch(gridX,gridY,gridZ,stream,function,self.launch_cooperative_grid,self.launch_pdl,kernel_metadata,"
    "launch_metadata,launch_enter_hook,launch_exit_hook,global_scratch,profile_scratch,self.arg_annotations,"
    "self.kernel_signature,kernel_args)": 39,
}


def _direct_launch(ck, variadic: bool = False):
    """A launch through the compiled launcher's C entry with the arguments its Python wrapper would pass (2-3 us
    less per launch), for a wrapper known to pass exactly these (_WRAPPED) with no scratch memory to allocate;
    else None. (_start_ring checks it against known values before using it.) variadic: as _compiled_launch."""
    import inspect

    run = ck.run
    launch = getattr(run, "launch", None)
    try:
        src = "".join(inspect.getsource(type(run).__call__).split())
    except (OSError, TypeError):
        return None
    kind = [v for k, v in _WRAPPED.items() if k in src]
    if (launch is None or len(kind) != 1 or getattr(run, "global_scratch_size", 1) != 0
            or getattr(run, "profile_scratch_size", 1) != 0 or getattr(run, "gsan_enabled", False)):
        return None
    fn, meta, coop, pdl = ck.function, ck.packed_metadata, run.launch_cooperative_grid, run.launch_pdl
    if kind[0] == 36:
        if variadic:
            return lambda raw, *a: launch(1, 1, 1, raw, fn, coop, pdl, None, None, meta, None, None, None, *a)
        return lambda raw, at: launch(1, 1, 1, raw, fn, coop, pdl, None, None, meta, None, None, None, at)
    ann, sig = run.arg_annotations, run.kernel_signature
    if variadic:
        return lambda raw, *a: launch(1, 1, 1, raw, fn, coop, pdl, meta, None, None, None, None, None, ann, sig, a)
    return lambda raw, at: launch(1, 1, 1, raw, fn, coop, pdl, meta, None, None, None, None, None, ann, sig, (at,))


def _self_check_args(ring: _SnapshotRing, go):
    """_self_check for the fast path's kernel (snapshot_args_kernel): one launch through `go` on known values (an
    unaligned view, an absent section, a negative where allowed) compared word by word with the slot the CPU
    header and snapshot_kernel make; returns what `go` returned."""
    torch = ring.torch
    dev = ring.device
    a = torch.arange(1, 7, dtype=torch.int32, device=dev)[1:]  # an unaligned view: 2..6
    c = torch.tensor([7, -2, 5, 2**31 - 1], dtype=torch.int32, device=dev)
    k = len(SECTIONS)
    words = (FIXED + ENTRY * k + 9 + 7) & ~7
    ring.np[:HEAD_READ + 16] = -9
    got = go(ring.raw(dev), ring.base, 12345, 5, 6, k | _FAST_NEG, words, a.data_ptr(), 5, ring.base, -1,
             c.data_ptr(), 4)
    if dev is not None:
        torch.cuda.synchronize(dev)
    want = np.full(FIXED + ENTRY * k + 9 + 1, -9, np.int32)
    _head_struct(k).pack_into(want, 0, 12345, 12345, 5, 6, k, 0, words, 0, a.data_ptr(), 5,
                              (_FAST_NEG >> 15) & 2, *_ABSENT, c.data_ptr(), 4, (_FAST_NEG >> 17) & 2,
                              *(_ABSENT * (k - 3)))
    want[FIXED + ENTRY * k:-1] = [2, 3, 4, 5, 6, 7, -2, 5, 2**31 - 1]
    have = ring.np[:want.size]
    if not np.array_equal(have, want):
        raise RuntimeError(f"snapshot_args_kernel self-check wrote {have.tolist()}")
    return got


def _fast_launch(ring: _SnapshotRing) -> tuple:
    """(go3, how3): the cheapest launch of snapshot_args_kernel that writes what it should (checked once, as
    _start_ring does for snapshot_kernel), or (None, why) when neither the launcher's C entry nor the compiled
    launcher does (observe() then has no fast path: through Triton's dispatch it would cost more than the
    general path; the CPU tests' host ring sets the dispatch itself)."""
    from dcptool.engine import snapshot as K

    try:
        ck = _self_check_args(ring, K.snapshot_args_dispatch)  # (compiles it)
    except Exception as e:
        return None, f"none ({e!r})"
    go, how, why = _cheapest(ring, _self_check_args, ck, variadic=True)
    return (go, how) if go is not None else (None, f"none, the general path instead ({'; '.join(why)})")


def _cheapest(ring: _SnapshotRing, check, ck, variadic: bool) -> tuple:
    """(go, how, why): the first launch of compiled kernel `ck` that `check` (_self_check or _self_check_args)
    accepts, trying the launcher's C entry, then Triton's compiled launcher; (None, "", why) when neither does.
    `why` says what each rejected way raised."""
    why = []
    for how, way in (("the launcher's C entry", _direct_launch), ("Triton's compiled launcher", _compiled_launch)):
        try:
            go = way(ck, variadic=variadic)
            if go is None:
                raise RuntimeError("not this Triton's launcher")
            check(ring, go)
            return go, how, why
        except Exception as e:  # not callable so here: the next way
            why.append(f"{how}: {e!r}")
    return None, "", why
