"""observe()'s path for CUDA tensors: one kernel launch copies them into a slot of the ring, harvested later."""

from __future__ import annotations

import warnings

import numpy as np

from dcptool.dump import INT32_MAX, Record, Scalars
from dcptool.dump.observation import NAMES, R
from dcptool.engine.arguments import (
    I64_MAX,
    I64_MIN,
    TORCH,
    Groups,
    NoTensor,
    check_own,
    check_vals,
    copied_row,
    host_fast,
    int32_copy,
    narrowed,
    tensor_type,
)
from dcptool.engine.snapshot.arm import arm
from dcptool.engine.snapshot.harvest import Harvest
from dcptool.engine.snapshot.kernels import SNAP_ARGS_BLOCK
from dcptool.engine.snapshot.layout import ABSENT, ARGS_SECTIONS, HOST_ROWS, SECTIONS, SGRP, host_rules, layout
from dcptool.engine.snapshot.ring import Slot, SnapshotRing

_NEW = tuple.__new__
# observe_fast unpacks the record in this order (a new field of the table: read it there, and decline it while the
# fast path's kernel cannot take it)
_FAST_FIELDS = ("step", "site", "rank", "num_reqs", "num_reqs_padded", "seq_lens", "dcp_local_seq_lens", "ubatch",
                "parent", "req_start", "tok_start", "tok_stop", "query_start_loc", "num_tokens_padded", "buffer",
                "graph", "kv_pages", "dcp_query_start_loc", "dcp_tot_seq_lens", "positions", "slot_mapping",
                "ctx_chunks", "group_seq_lens", "verify_row_lens", "sparse_topk", "attn_addrs", "graph_addrs",
                "attn_caps", "host_seq_lens", "host_seq_lens_after", "kv_prefill_pages", "kv_last_page",
                "kv_block_sizes")
# The fields past slot_mapping (device sections: the chunked context ...; host values: the metadata tensors'
# addresses ...): an observation that gives any goes the general path, which takes the sections and holds the host
# values beside its slot (one that gives none pays an identity test each)
LATE_ROWS = tuple(R[f.name] for f in HOST_ROWS)  # the host values' Record positions, in the table's order
_LATE_AT = R["slot_mapping"] + 1


def _late_given(r: Record) -> bool:
    """Any field past the slot mapping given (identity tests: an array's == would compare its elements)."""
    for x in r[_LATE_AT:]:
        if x is not None:
            return True
    return False


if NAMES != _FAST_FIELDS or SECTIONS[ARGS_SECTIONS].section != "sgrp":
    raise ImportError("snapshot.device: observe_fast unpacks the Record as _FAST_FIELDS; the table's fields changed")
_TENSOR: type = NoTensor  # torch.Tensor once torch is imported (the Recorder's find_torch says when)


def find_torch() -> None:
    global _TENSOR
    _TENSOR = tensor_type()


def _capturing() -> bool:
    """Inside CUDA-graph capture on the current stream (only asked once a CUDA tensor was seen)."""
    return TORCH._C._cuda_isCurrentStreamCapturing()  # (torch.cuda.is_current_stream_capturing)


def _later_sections(ring: SnapshotRing, config, rows: int, kv, dq, tot, pos, sm) -> tuple | None:
    """The fast path's sections 3-7 (kv_pages, dcp_query_start_loc, dcp_tot_seq_lens, positions, slot_mapping):
    (their kernel arguments, their values in all, their int64 bits of `modes`, the slot mapping's KV-cache groups
    or 0), checked as the general path checks them from the shapes alone (the values: by the kernel, at harvest);
    None where the general path must take the observation (and raise what it cannot store)."""
    did, i32, i64, base = ring.did, ring.i32, ring.i64, ring.base
    out: list = []
    n_all = wide = 0
    for k, x in ((3, kv), (4, dq), (5, tot), (6, pos), (7, sm)):
        if x is None:
            out += (base, -1)
            continue
        if type(x) is not _TENSOR or x.get_device() != did or not x.is_contiguous():
            return None
        dt = x.dtype
        if dt is i64:
            wide |= 1 << k
        elif dt is not i32:
            return None
        n = x.numel()
        out += (x.data_ptr(), n)
        n_all += n
    if kv is not None and (out[1] != rows or config.page_size is None):
        return None
    groups = 0
    if pos is not None or sm is not None:
        if pos is None or sm is None or pos.dim() != 1:
            return None
        t = out[7]  # (positions' count)
        nd = sm.dim()
        if nd == 1:
            groups = 1 if out[9] == t else 0
        elif nd == 2:
            g, tt = sm.shape
            groups = g if tt == t else 0
        if not groups or (config.kv_groups is not None and groups > len(config.kv_groups)):
            return None
    return out, n_all, wide, groups


def _held(host: list | None, late: tuple, rows: int, config) -> list | None:
    """The host-held sections (None: none) with the HOST_ROWS' host copies after them, where any is given."""
    if all(x is None for x in late):
        return host
    return [*(host or (None,) * len(SECTIONS)), *(copied_row(f, x, rows, config) for f, x in zip(HOST_ROWS, late))]


_GROUPS: dict[tuple[int, int], tuple] = {}  # (sections, groups) -> the host-held sections with only the groups


def _with_groups(host: tuple | None, nsec: int, groups: int) -> tuple:
    """The fast path's host-held sections (None: none) with the slot group column of `groups` KV-cache groups (0 ..
    groups - 1: the harvest builds the entries from the snapshotted rows, layout.slot_rows)."""
    only = _GROUPS.get((nsec, groups))
    if only is None:
        only = _GROUPS[nsec, groups] = (*(None,) * SGRP, Groups(range(groups)), *(None,) * (nsec - SGRP - 1))
    return only if host is None else (*host[:SGRP], only[SGRP], *host[SGRP + 1:])


class DevicePath:
    """A Recorder's CUDA tensors, snapshotted without stopping the engine; it owns the ring.

    CUDA tensors are not copied with `.to("cpu")` (that waits for the engine's stream): observe_device writes a
    descriptor of the observation into the header of a slot of a pinned, device-mapped host ring (layout.py) and
    launches one Triton kernel on the engine's current stream with the slot's address; the kernel copies every
    device section into the slot, so the values are those at observe() time. Slots are harvested later (every
    FENCE_EVERY observations, at a rollover and at close(): Harvest) once a CUDA event says the launch finished.

    The fast path (observe_fast, the Recorder's `fast` once the ring runs with its kernel) takes what an engine
    passes each step: seq_lens (and dcp_local_seq_lens, query_start_loc when given) contiguous int32 tensors on the
    ring's device, or query_start_loc a 1-D numpy array (held on the host), plain int scalars (buffer= None: the
    view's storage); kv_pages, dcp_query_start_loc, dcp_tot_seq_lens, positions (1-D) and slot_mapping (1-D, or
    [groups, tokens]) contiguous int32 or int64 tensors on the ring's device, or None. One launch of
    snapshot_args_kernel with the header as arguments (its program 0 writes it into the slot): no header packed on
    the CPU, no section loop, no host copy, the same checks as the general path. A tensor's get_device() equal to
    the ring's also says it is a device tensor (-1: the CPU tests' host ring). The fields past the slot mapping go
    the general path. It appends to the Recorder's writer under its lock, checks sites against the Recorder's
    checked names (site_ok, shared with its host path) and reports what it cannot store to drop(error).
    """

    def __init__(self, writer, harvest: Harvest, lock, site_ok: set, drop, cuda_mode: str, ring_bytes: int):
        self.cuda_mode = cuda_mode  # "sync" once a ring cannot run here
        self.skipped_capture = 0  # observations made inside CUDA-graph capture (not recorded)
        self.ring: SnapshotRing | None = None
        self.fast = None  # observe_fast once the ring runs with its kernel (the Recorder's fast path)
        self.on = "is_cuda"  # the tensor attribute that sends a value through the ring (CPU tests: "is_cpu")
        self.capturing = _capturing
        self._ring_words = max(1024, int(ring_bytes) // 4)
        self._w = writer
        self._harvest = harvest
        self._ranks = writer.config.dcp_size
        self._lock = lock
        self._acquire, self._release_lock = lock.acquire, lock.release
        self._site_ok = site_ok
        self._drop = drop  # drop(error): an observation the fast path cannot store (counted and warned by the owner)
        self._append = writer.append
        L = self._layout = layout(SECTIONS)
        self._nsec, self._head, self._head_words, self._modes = L.nsec, L.head, L.head_words, L.modes
        self._fast_pad, self._ksec = L.fast_pad, L.ksec

    def device_tensors(self, r: Record) -> bool:
        """The record holds a tensor of the device path (seq_lens first: the engine's case at once)."""
        on, t = self.on, _TENSOR
        return any(isinstance(x, t) and getattr(x, on) for x in (r[5], r[6], r[12], *r[16:20], *r[21:]))

    def skip_capture(self) -> None:
        """An observation made inside CUDA-graph capture: not recorded, counted."""
        with self._lock:
            self.skipped_capture += 1

    def observe_device(self, vals: Scalars, site: str, srcs: tuple) -> int | None:
        """Snapshot the observation's device tensors in one launch (None: take the host path); `srcs`: the sections'
        values, then the HOST_ROWS' (held beside the slot). The header's entries are collected (_entries), checked
        (_length_rules), and written with the rest of the header into the slot just before the launch."""
        got = self._entries(srcs[:self._nsec])
        if got is None:
            return None
        ent, host, words, device, keep = got
        nr, nrp = vals[2], vals[3]
        rows = ent[1] if ent[1] >= 0 or host is None or host[0] is None else host[0].size
        if rows < nr or not 0 <= nr <= nrp:
            raise ValueError(f"num_reqs {nr}, num_reqs_padded {nrp}, {rows} seq_lens rows")
        words = self._length_rules(ent, host, rows, words)
        host = _held(host, srcs[self._nsec:], rows, self._w.config)
        check_vals(vals, site, self._site_ok)
        words &= ~7
        w = self._w
        with self._lock:
            if w.stopped:
                w.refuse()  # (raises after close(); counts it past the size cap)
                return -1
            index = w.count
            check_own(vals[1], vals[5], vals[10], index, self._ranks)  # (rank, parent, buffer)
            ring = self._ring_on(None if device < 0 else device)  # (-1: the host ring of the CPU tests)
            if ring is None:
                return None
            start = ring.alloc(words)
            if start is None:
                start = self._harvest.room(ring, words)
            self._head.pack_into(ring.np, 4 * start, index & 0x7FFFFFFF, -1, nr, nrp, self._nsec, 0, words, 0, *ent)
            raw = ring.raw(ring.device)
            ring.go(raw, ring.base + 4 * start)
            del keep
            return self._queued(ring, raw, index, start, words, host, vals, site)

    def _entries(self, srcs: tuple) -> tuple | None:
        """The header's section entries of observe_device: (address, count, mode per section, count -1 for an
        absent section or one the host holds; the host-held sections or None; the slot's words so far; the device
        index; the converted copies, kept alive until the launch is queued); None: tensors on two devices."""
        on = self.on
        i32, i64 = TORCH.int32, TORCH.int64
        modes = self._modes
        ent: list = []
        host = None
        words = self._head_words
        device = -2
        keep = None
        for k, x in enumerate(srcs):
            if x is None:
                ent += ABSENT
            elif isinstance(x, _TENSOR) and getattr(x, on):
                d = x.get_device()
                if d != device:
                    if device != -2:
                        return None  # tensors on two devices: the host path copies them
                    device = d
                dt = x.dtype
                if (dt is i32 or dt is i64) and x.is_contiguous():  # (contiguous: numel() values at data_ptr)
                    n = x.numel()
                    ent += (x.data_ptr(), n, modes[k] | (dt is i64))  # (int64: narrowed's wide bit)
                else:
                    x, wide = narrowed(x)
                    keep = [x] if keep is None else [*keep, x]
                    n = x.numel()
                    ent += (x.data_ptr(), n, modes[k] | wide)
                words += n
            else:
                if host is None:
                    host = [None] * len(srcs)
                host[k] = x if type(x) is Groups else host_fast(x)  # (Groups: the slot sections' groups)
                ent += ABSENT
        return ent, host, words, device, keep

    def _length_rules(self, ent: list, host: list | None, rows: int, words: int) -> int:
        """The sections' length rules and config settings on the header's counts (and the host-held sections);
        returns the slot's words. Raises what cannot be stored."""
        config, L = self._w.config, self._layout
        if host is not None:
            return host_rules(L.rules, config, ent, host, rows, words)
        for k in L.plus1:
            n = ent[3 * k + 1]
            if n >= 0 and n != rows + 1:  # of no use to replay (as on the host path)
                ent[3 * k + 1] = -1
                words -= n
        for k in L.sized:
            n = ent[3 * k + 1]
            if n >= 0 and n != rows:
                raise ValueError(f"{SECTIONS[k].name} needs one value per seq_lens row ({rows}), got {n}")
        for k, need in L.needs:
            if ent[3 * k + 1] >= 0 and getattr(config, need) is None:
                raise ValueError(f"{SECTIONS[k].name} needs {need} in the config")
        return words

    def _ring_on(self, device: int | None) -> SnapshotRing | None:
        """Under the lock: the ring for tensors of `device` (started on the first); None where it cannot take them
        (the host path copies them)."""
        ring = self.ring
        if ring is None:
            if device != TORCH.cuda.current_device():
                return None  # (the ring's launcher is bound to the current device's context)
            return self._start_ring(device)
        return ring if ring.device == device else None

    def _queued(self, ring: SnapshotRing, raw: int, index: int, start: int, words: int, host, vals, site: str) -> int:
        """Under the lock, once a snapshot is launched (either path): keep its slot as the observation's row, and
        fence every FENCE_EVERY launches (collecting the slots finished by then)."""
        slot = _NEW(Slot, (index, start, words, host))
        fenced = ring.queued(raw, slot)
        self._append(vals, site, slot)
        if fenced:
            self._harvest.harvest(wait=False)
        return index

    def observe_fast(self, r: Record) -> int | None:
        """observe() for what an engine passes each step, once the ring runs (the class says which); None: the general
        path takes it (and raises what it cannot store); -1, dropped and counted (it never raises into the engine)."""
        (step, site, rank, nr, nrp, seq, dcp, ub, parent, rs, ts, te, qsl, ntp, buf, graph, kv, dq, tot, pos,
         sm) = r[:_LATE_AT]
        try:
            ring = self.ring
            did = ring.did
            if type(seq) is not _TENSOR or seq.get_device() != did or _late_given(r):  # (past the slots: general)
                return None
            if self.capturing():
                self.skip_capture()
                return -1
            if not (type(step) is type(rank) is type(nr) is type(nrp) is type(ub) is int and seq.dtype is ring.i32
                    and seq.is_contiguous()):  # (int scalars and an int32 contiguous seq_lens; else the general path)
                return None
            rows = total = seq.numel()  # (total: the row values the kernel copies)
            i32, base = ring.i32, ring.base
            if dcp is None:
                dp, dn, buffer = base, -1, None  # (absent: count -1, any readable address)
            elif type(dcp) is _TENSOR and dcp.get_device() == did and dcp.dtype is i32 and dcp.is_contiguous():
                dp = dcp.data_ptr()
                dn = dcp.numel()
                buffer = dp - 4 * dcp.storage_offset()  # (= buffer_id(dcp): its storage's base address)
                total += dn
            else:
                return None
            host = None
            if qsl is None:
                qp, qn = base, -1
            elif type(qsl) is _TENSOR:
                if not (qsl.get_device() == did and qsl.dtype is i32 and qsl.is_contiguous()):
                    return None
                qp = qsl.data_ptr()
                qn = qsl.numel()
                if qn == rows + 1:
                    total += qn
                else:
                    qn = -1  # a query_start_loc that does not cover the rows is of no use to replay (not recorded)
            elif type(qsl) is np.ndarray and qsl.ndim == 1:
                qp, qn = base, -1
                if qsl.size == rows + 1:
                    host = (None, None, int32_copy(qsl), *self._fast_pad)
            else:
                return None
            if parent is not None:
                if type(parent) is not int:
                    return None
                if parent < 0:
                    parent = None
            if not (0 <= nr <= nrp <= INT32_MAX and nr <= rows and I64_MIN <= step <= I64_MAX
                    and -1 <= ub <= INT32_MAX and site in self._site_ok
                    and (graph is None or (type(graph) is int and 0 <= graph <= 3))
                    and (buf is None or (type(buf) is int and I64_MIN <= buf <= I64_MAX))):
                return None
            if rs is not None or ts is not None or te is not None or ntp is not None:
                for v in (rs, ts, te, ntp):
                    if v is not None and not (type(v) is int and -1 <= v <= INT32_MAX):
                        return None
            modes = self._ksec
            groups = 0
            if kv is None and dq is None and tot is None and pos is None and sm is None:
                rest = ring.absent5
            else:
                got = _later_sections(ring, self._w.config, rows, kv, dq, tot, pos, sm)
                if got is None:
                    return None
                rest, n, wide, groups = got
                total += n
                modes |= wide
                if groups:
                    host = _with_groups(host, self._nsec, groups)
            words = (self._head_words + total) & ~7
            sp = seq.data_ptr()
            w = self._w
            self._acquire()  # (the lock's acquire/release called directly: cheaper than `with`)
            try:
                index = w.count
                if w.stopped or not 0 <= rank < self._ranks or (parent is not None and parent >= index):
                    return None
                start = ring.alloc(words)
                if start is None:
                    start = self._harvest.room(ring, words)
                if total > SNAP_ARGS_BLOCK:
                    ring.np[start + 5] = 0  # (several programs: each writes the flags word only if it found something)
                if groups > w.max_group + 1:
                    w.saw_group(groups - 1)
                raw = ring.raw(did)
                ring.go3(raw, (total + SNAP_ARGS_BLOCK - 1) // SNAP_ARGS_BLOCK or 1, ring.base + 4 * start,
                         index & 0x7FFFFFFF, nr, nrp, modes, words, sp, rows, dp, dn, qp, qn, *rest)
                # (a plain tuple in Scalars order: the writer reads the values by position; cheaper than a Scalars)
                vals = (step, rank, nr, nrp, ub, parent, rs, ts, te, ntp, buffer if buf is None else buf, graph)
                return self._queued(ring, raw, index, start, words, host, vals, site)
            finally:
                self._release_lock()
        except Exception as e:  # never break the engine
            self._drop(e)
            return -1

    def _start_ring(self, device: int | None) -> SnapshotRing | None:
        """The ring, its kernel and its launches, checked (arm.arm); None, and sync mode, where they fail."""
        ring = SnapshotRing(self._ring_words, device)
        try:
            arm(ring)
        except Exception as e:
            return self._no_ring(e)
        self._run(ring)
        if self.capturing is _capturing and device is not None:
            self.capturing = ring.torch._C._cuda_isCurrentStreamCapturing  # (no Python frame per observe)
        return ring

    def _run(self, ring: SnapshotRing) -> None:
        """Take `ring` into use; observe() takes the fast path from now on where the ring has its kernel."""
        self.ring = self._harvest.ring = ring
        if ring.go3 is not None:
            self.fast = self.observe_fast

    def use_host_ring(self, words: int = 4096) -> SnapshotRing:
        """For the CPU tests: send host torch tensors through a (non-pinned) ring and the interpreted kernel."""
        self.on = "is_cpu"
        self.capturing = lambda: False  # (a CPU build of torch has no capture to ask about)
        ring = SnapshotRing(words, None)
        arm(ring)
        self._run(ring)
        return ring

    def _no_ring(self, e: Exception) -> None:
        self.cuda_mode = "sync"
        warnings.warn(f"dcptool Recorder cannot snapshot CUDA tensors asynchronously here ({e}); copying them "
                      "with .to('cpu'), which waits for the stream", RuntimeWarning, stacklevel=4)
        return None
