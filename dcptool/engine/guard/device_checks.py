"""The Guard's device path: one check kernel per observe, a device ring of the last `keep`, a host-mapped flag."""

from __future__ import annotations

import numpy as np

from dcptool.dcp.backend import load
from dcptool.dump import Record
from dcptool.dump.observation import NAMES
from dcptool.engine.arguments import host_copy, host_fast
from dcptool.engine.guard.host_checks import CHECKS, DEVICE_HALVES, HOST_CHECKS, NOT_KEPT, late_bits
from dcptool.engine.snapshot.layout import HOST_ROWS as LAYOUT_HOST_ROWS
from dcptool.engine.snapshot.ring import SnapshotRing

# Ring slot layout (int32 words): HEAD header words, then six sections of `cap` rows each (seq_lens, the DCP
# view, query_start_loc, kv_pages, dcp_query_start_loc, dcp_tot_seq_lens) and `tcap` words of slot entries
# (positions, then slot_mapping [groups, tokens]). Header: 0 index + 1 (0: never written), 1 rule bits, 2 step,
# 3 site id, 4 rank, 5 ubatch, 6 num_reqs, 7 num_reqs_padded, 8 parent, 9 req_start, 10 tok_start, 11 tok_stop,
# 12 num_tokens_padded, 13 graph, 14-15 buffer (low, high), 16-23 counts (the six sections, tokens, groups;
# -1 absent), 24 kept (0: larger than the slot, checked but not kept), 25 the launch's host index (its host values
# are kept on the host under it: GuardDevice.extras).
HEAD = 32
W_COUNTS = 16
W_KEPT = 24
W_HOST = 25
SECTIONS = 6
# What a kept slot holds of each field of the observation (dump.observation.FIELDS_TABLE): a scalar at its header
# word (the site as its id, the buffer as two words, low and high), a row field as its section, the slot entries in
# the token area. Every field is kept (a field the Guard did not keep would be missing from its dumps: the import
# fails until the kernel keeps it); the kernel's arguments follow (device_checks_tl checks them against KERNEL_ARGS).
HEAD_WORDS = {"step": 2, "site": 3, "rank": 4, "ubatch": 5, "num_reqs": 6, "num_reqs_padded": 7, "parent": 8,
              "req_start": 9, "tok_start": 10, "tok_stop": 11, "num_tokens_padded": 12, "graph": 13, "buffer": 14}
ROW_SECTIONS = ("seq_lens", "dcp_local_seq_lens", "query_start_loc", "kv_pages", "dcp_query_start_loc",
                "dcp_tot_seq_lens")
TOKEN_AREA = ("positions", "slot_mapping")
# The host values (the row fields after the last device section: addresses, ...): checked on the host as observe() is
# called where they need nothing of the device (their verdict reaches the kernel as `hbits`), by the kernel where they
# are compared with the device's seq_lens and query_start_loc (DEVICE_HALVES: handed to it in a slot of the host-values
# ring, HostValues), and kept on the host under the launch's host index. NOT_KEPT:
# the fields replay's rules read and the Guard does not check (the chunked context, ...).
HOST_ROWS = tuple(f.name for f in LAYOUT_HOST_ROWS)
# ... of which those every replay of a captured launch shares (what the graph itself reads: the metadata tensors'
# addresses and their buffers' capacities, the block sizes its slot mapping was dealt by). The others describe the
# captured build alone (the host copy of seq_lens it read, its FlashInfer plans): no replay runs on them (each later
# step's build passes its own, checked eagerly), so a captured launch is checked and kept without them.
GRAPH_HOST_ROWS = ("attn_addrs", "graph_addrs", "attn_caps", "kv_block_sizes")
_CAPTURED_BUILD_ONLY = dict.fromkeys(f for f in HOST_ROWS if f not in GRAPH_HOST_ROWS)
_KEPT = (*HEAD_WORDS, *ROW_SECTIONS, *TOKEN_AREA, *HOST_ROWS, *NOT_KEPT)
if sorted(_KEPT) != sorted(NAMES) or len(ROW_SECTIONS) != SECTIONS or not set(GRAPH_HOST_ROWS) <= set(HOST_ROWS):
    raise ImportError("guard.device_checks: the Guard's slot keeps every field of dump.observation.FIELDS_TABLE; "
                      f"it keeps {sorted(_KEPT)} and leaves out {NOT_KEPT}, the table has {sorted(NAMES)}")
# The check kernel's arguments: the ring's and the spec's (fixed while they are), then the observation's: each scalar
# under the kernel's short name, each row section's address and count, the slot entries.
KERNEL_ARGS = ("ring", "state", "flag", "keep", "words", "cap", "tcap", "N", "I", "page", "step", "site", "rank",
               "ubatch", "nr", "nrp", "parent", "req_start", "tok_start", "tok_stop", "ntp", "graph", "buf_lo",
               "buf_hi", "seq_p", "n_seq", "dcp_p", "n_dcp", "qsl_p", "n_qsl", "kv_p", "n_kv", "dq_p", "n_dq",
               "tot_p", "n_tot", "pos_p", "n_pos", "map_p", "n_groups", "shard_mask", "wide", "map_stride", "hv_p",
               "n_hs", "n_pre", "n_last", "hbits", "hidx")
GUARD_BLOCK = 1024  # rows a block: one pass of loads for up to 1,024 requests
GUARD_BLOCK_INTERPRETED = 256  # (rows or tokens) under Triton's interpreter (device_checks_tl.py says why)
GUARD_WARPS = 8  # (4 rows a thread)
# The slot mapping's groups checked in one pass over the tokens ([groups, tokens] tiles; more groups: another pass),
# and the tokens a block of that pass (vLLM's models have one KV-cache group, hybrids two or three)
GUARD_GROUPS = 2
GUARD_TOKEN_BLOCK = 2048
# One bit per check of the Guard (host_checks.CHECKS: the rule table's names and order); the kernel sets each of its
# own by its name (device_checks_tl) and those of DEVICE_HALVES, the host those of the host values (HOST_CHECKS:
# launched as `hbits`), the first set in table order is the one reported
BIT = {name: 1 << k for k, name in enumerate(CHECKS)}
KERNEL_CHECKS = ("missing", "values", "padding", "shape", "pages", "empty-mask", "tot-lens", "slots")
if set(KERNEL_CHECKS) | set(HOST_CHECKS) != set(CHECKS) or len(CHECKS) > 31 or not set(DEVICE_HALVES) <= set(
        HOST_CHECKS):
    raise ImportError(f"guard.device_checks: the rule table's device checks are {list(CHECKS)}; the check kernel "
                      f"decides {list(KERNEL_CHECKS)} and the host {list(HOST_CHECKS)} (at most 31: one word)")
EXTRAS_KEPT = 4  # host values kept: the last EXTRAS_KEPT * keep launches' and those of captured launches'
# The host-values ring (int32 words of pinned host memory, made at the first build that passes any): 3 int64 values a
# request row, so about 170 builds of 1,024 requests in flight before a build finds it full
HOST_VALUE_WORDS = 1 << 20
_HOST_AT = NAMES.index(HOST_ROWS[0]) if HOST_ROWS else len(NAMES)  # the host values' place in a Record (the last)
if NAMES[_HOST_AT:] != HOST_ROWS:
    raise ImportError("guard.device_checks: the host values are the Record's last fields")
_TL = "dcptool.engine.guard.device_checks_tl"
_NONE = -1  # a scalar not given
_HOST_IN_CAPTURE = -2  # _sec's count of a host array met inside capture (not read)


def rule_of(bits: int) -> str:
    """The first check (table order) of a slot's rule bits."""
    return next(name for name in CHECKS if bits & BIT[name])


_CHECKED: dict = {}  # CUDA device index -> (go, how): the launch that proved itself there (_launcher)


def _launcher(dev: GuardDevice) -> tuple:
    """(go, how): the cheapest launch of the check kernel that writes, on known values, exactly what Triton's
    dispatch writes (ring, state and flag compared word by word, once per process and device; one synchronisation
    each): the launcher's C entry called directly, then Triton's compiled launcher (launch.cheapest); else
    Triton's dispatch, saying why. Called outside capture (where the ring is first allocated)."""
    from dcptool.engine.snapshot.launch import cheapest

    key = dev.did
    if key not in _CHECKED:
        try:
            probe = _Probe(dev)
            with dev.torch.cuda.device(dev.device):
                ck = _probe_check(probe, dev.dispatch)  # (compiles it; what it writes is the reference)
                go, how, why = cheapest(probe, _probe_check, ck, variadic=True)
        except Exception as e:  # (the dispatch stays: it launched the kernel before this stop too)
            go, how, why = None, "", [repr(e)]
        if go is None:
            how = f"Triton's dispatch ({'; '.join(why)})"
        elif why:
            how += f" ({'; '.join(why)})"  # (the ways tried first, and why they were not taken)
        _CHECKED[key] = (go, how)
    go, how = _CHECKED[key]
    return (dev.dispatch, how) if go is None else (go, how)


class _Probe:
    """The known launch _launcher checks each way with: a 2-slot ring of its own, an unaligned seq_lens view, a
    DCP view two rows wrong (the values bit), query_start_loc, int64 positions and a strided int64 slot mapping of
    two sharded groups, the second written at every position (the slots bit), a right host copy of seq_lens in
    host memory: every argument, the int64 reads and the row stride exercised."""

    def __init__(self, dev: GuardDevice):
        t, d = dev.torch, dev.device
        self.torch, self.device = t, d
        cap, tcap = 8, 32
        words = HEAD + SECTIONS * cap + tcap
        self.ring = t.zeros((2, words), dtype=t.int32, device=d)
        self.state = t.zeros(4, dtype=t.int32, device=d)
        self.flag = t.zeros(2, dtype=t.int32, pin_memory=True)
        seq = (t.arange(1, 6, dtype=t.int32, device=d) * 5)[1:]  # 10, 15, 20, 25 (a view, 4 bytes in)
        self.host = t.tensor([10, 15, 20, 25], dtype=t.int64, pin_memory=dev.cuda)  # (its host copy, right)
        self.held = [seq, t.tensor([5, 8, 10, 13], dtype=t.int32, device=d),  # rank 1 of 2: 5, 7, 10, 12
                     t.tensor([0, 1, 2, 3, 4], dtype=t.int32, device=d), t.arange(4, dtype=t.int64, device=d),
                     t.tensor([[-1, 7, -1, 9, 0, 0], [3, 4, 5, 6, 0, 0]], dtype=t.int64, device=d)]
        (sq, dc, qs, pos, sm), nil = self.held, self.state.data_ptr()
        self.args = (self.ring.data_ptr(), nil, self.flag.data_ptr(), 2, words, cap, tcap, 2, 1, 0, 12345, 0, 1, -1,
                     4, 4, -1, -1, -1, -1, -1, 2, 77, 0, sq.data_ptr(), 4, dc.data_ptr(), 4, qs.data_ptr(), 5, nil,
                     -1, nil, -1, nil, -1, pos.data_ptr(), 4, sm.data_ptr(), 2, 3, 3, 6, self.host.data_ptr(), 4, -1,
                     -1, 0, 0)
        self.want = None


def _probe_check(p: _Probe, go):
    """Launch through `go` on the probe's values (ring, state and flag zeroed first) and compare with what the
    first launch (Triton's dispatch) wrote; that one itself is checked on words known beforehand."""
    t = p.torch
    for x in (p.ring, p.state, p.flag):
        x.zero_()
    got = go(t._C._cuda_getCurrentRawStream(p.device.index), 1, *p.args)
    t.cuda.synchronize(p.device)
    have = np.concatenate([p.ring.cpu().numpy().ravel(), p.state.cpu().numpy(), p.flag.numpy()])
    if p.want is None:
        w = p.ring[0].cpu().numpy()
        if (w[:3].tolist() != [1, BIT["values"] | BIT["slots"], 12345] or p.state[:3].tolist() != [1, 1, 1]
                or p.flag[0].item() != 1 or w[HEAD:HEAD + 4].tolist() != [10, 15, 20, 25]):
            raise RuntimeError(f"guard kernel self-check (dispatch) wrote {w[:HEAD + 4].tolist()}")
        p.want = have
    elif not np.array_equal(have, p.want):
        raise RuntimeError("guard kernel self-check: this launch wrote other words than Triton's dispatch")
    return got


class HostValues:
    """The host values the kernel compares with the device's seq_lens and query_start_loc (DEVICE_HALVES: the host
    copy of seq_lens a build read, FlashInfer's prefill page counts and last pages; each on the build's first
    num_reqs rows), handed to the launch without a wait: written as int64 into a slot of a snapshot ring (the
    Recorder's: host memory, pinned on a GPU, that the kernel reads through its device address; slots fenced by CUDA
    events), the slot's address and the three counts (-1: not given) among the launch's arguments.

    No write overtakes the read: a slot's words are written only once alloc() hands them out, alloc() hands out only
    words no slot in `pending` holds, and a slot is queued in `pending` after its launch (launched()) and leaves it
    only when the fence recorded after that launch, on every stream that launched since the fence before, has
    completed (finished(wait=False)): the launch that read the slot ran. A full ring is never waited for: the build's
    DEVICE_HALVES are left undecided (`full` counts those builds), as inside capture; slots of ended launches are
    collected at each fence and when the ring is full. The ring is made at the first build that passes any of the
    values (outside capture: a captured build passes none, _CAPTURED_BUILD_ONLY) or a row section as a host array
    (numpy: FlashInfer's page counts), which the same slot carries as int32 (post's `secs`)."""

    def __init__(self, device: int | None, words: int = HOST_VALUE_WORDS):
        self.device, self.words = device, words
        self.ring: SnapshotRing | None = None
        self.full = 0

    def post(self, r: Record | None, nr: int, secs: tuple = ()) -> tuple | None:
        """None where the build passes none of the values and no `secs`, or the ring is full; else the slot's
        address, its start and words (0 and 0: nothing written), the counts of the three written (-1: not given;
        all -1 for r None), then the addresses of `secs` (host arrays among the row sections, written as int32 after
        the values: the kernel reads them through the ring's device address, no pinned copy launched per array)."""
        arrays = (None,) * 3 if r is None else (r.host_seq_lens, r.kv_prefill_pages, r.kv_last_page)
        if arrays[0] is None and arrays[1] is None and arrays[2] is None and not secs:
            return None
        ns = tuple(-1 if a is None else min(len(a), nr) for a in arrays)
        n = sum(k for k in ns if k > 0)
        m = sum(len(a) for a in secs)
        ring = self.ring
        if ring is None:
            ring = self.ring = SnapshotRing(self.words, self.device)
        if n == 0 and m == 0:
            return ring.base, 0, 0, *ns, *(ring.base,) * len(secs)
        need = 2 * n + 1 + m  # (a word to align the int64 values: the buffer itself is aligned)
        start = ring.alloc(need)
        if start is None:
            ring.fence()
            self._collect()
            start = ring.alloc(need)
            if start is None:
                self.full += r is not None
                return None
        at = start + (start & 1)
        v = ring.np[at:at + 2 * n].view(np.int64)
        o = 0
        for a, k in zip(arrays, ns):
            if k > 0:
                v[o:o + k] = a[:k]
                o += k
        at += 2 * n
        out = []
        for a in secs:
            k = len(a)
            ring.np[at:at + k] = a  # (int32, as GuardDevice._i32 narrows)
            out.append(ring.base + 4 * at)
            at += k
        return ring.base + 4 * (start + (start & 1)), start, need, *ns, *out

    def place(self, r: Record | None, nr: int, at, rows: tuple, ps: list, held: list, copy, nil: int) -> tuple:
        """post() for a launch: its host values (r None: none) and its row sections `at` (indices into `rows`, host
        arrays) in one slot; (post's tuple or None, `ps` with the sections' addresses). A full ring: those sections
        copied with `copy` (kept in `held` until the launch), the host values left undecided."""
        hv = self.post(r, nr, tuple(rows[k] for k in at))
        got = hv[6:] if hv is not None else [copy(rows[k]) for k in at]
        if hv is None and at:
            held += got
            got = [x.data_ptr() or nil for x in got]
        for k, a in zip(at, got):
            ps[k] = a
        if r is None:
            hv = None if hv is None or not hv[2] else (nil, hv[1], hv[2], -1, -1, -1)
        return hv, ps

    def launched(self, raw: int, start: int, need: int) -> None:
        """The launch that reads the slot at `start` is queued on stream `raw`: the slot stays until it ran."""
        if self.ring.queued(raw, (-1, start, need, None)):
            self._collect()

    def _collect(self) -> None:
        for _ in self.ring.finished(wait=False):
            pass


class GuardDevice:
    """The ring (device int32 [keep, words]), the device state (observation counter, frozen-at index + 1, wrong
    count) and the flag (pinned host memory the kernel writes through its device address; the host reads it
    without a sync). Slots are sized from `max_rows` / `max_tokens` or from the first observation (twice its rows,
    at least 64; twice its slot words, at least 256); a larger observation grows the ring (device copies on the
    stream, no sync) except once a launch was captured in a CUDA graph (the graph holds the ring's address): it is
    then checked in full but not kept (its slot says so, and the dump leaves it out). The ring is allocated
    outside capture: observations captured before the first eager one are skipped (vLLM runs eager profile and
    warm-up builds before it captures).

    `go(raw_stream, 1, *args)` launches the kernel on one program: on a GPU the cheapest launch that wrote what
    Triton's dispatch writes on known values (checked once per process and device, when the ring is first
    allocated: _launcher), else Triton's dispatch (`dispatch`, always under the interpreter); `how` says which."""

    def __init__(self, torch, device, keep: int, spec, max_rows: int | None, max_tokens: int | None):
        self.torch = torch
        self.device = device
        self.cuda = device.type == "cuda"
        self.did = device.index if self.cuda else -1  # what get_device() says of a tensor on this device
        self.keep = keep
        self.cap = max_rows
        self.tcap = max_tokens
        self.ring = None
        self.state = torch.zeros(4, dtype=torch.int32, device=device)
        self.flag = torch.zeros(2, dtype=torch.int32, pin_memory=self.cuda)
        self.flag_np = self.flag.numpy()  # a view: reading it is no sync
        self.frozen = False  # a launch was captured: the ring keeps its address
        self.sites: dict[str, int] = {}
        self.site_names: list[str] = []
        self.kernel = load(_TL).guard_kernel
        self.go, self.how = self.dispatch, "Triton's dispatch"
        # (the C functions behind torch.cuda.is_current_stream_capturing / current_stream: no Python frame each)
        self.capturing = torch._C._cuda_isCurrentStreamCapturing if self.cuda else (lambda: False)
        self.raw = torch._C._cuda_getCurrentRawStream if self.cuda else (lambda d: 0)
        self._tensor, self._i32t, self._i64t = torch.Tensor, torch.int32, torch.int64
        self._nil = self.state.data_ptr()  # the address an absent section is launched with (never read)
        self._no_hv = (self._nil, -1, -1, -1)  # the host-values arguments of a launch handed none
        self._fixed: tuple = ()  # the launch's leading arguments, fixed while the ring and the spec are (_refix)
        self._masks: dict[int, int] = {}  # groups -> the sharded-group bit mask under this spec
        self.hidx = 0  # the next launch's host index
        self.extras: dict[int, tuple] = {}  # host index -> the launch's host values (HOST_ROWS), where it had any
        self.pinned: set[int] = set()  # the host indices of launches captured in a graph (replayed: kept for good)
        self.host_values = HostValues(self.did if self.cuda else None)  # (DEVICE_HALVES' host values to the kernel)
        self.spec = spec

    @property
    def spec(self):
        return self._spec

    @spec.setter
    def spec(self, spec) -> None:
        self._spec = spec
        self._masks = {}
        self._refix()

    def _refix(self) -> None:
        s = self._spec
        if self.ring is not None:
            self._fixed = (self.ring.data_ptr(), self.state.data_ptr(), self.flag.data_ptr(), self.keep, self._words(),
                           self.cap, self.tcap, s.dcp_size, s.cp_interleave, s.page_size or 0)

    def dispatch(self, raw: int, grid: int, *args):
        """One launch through Triton's dispatch, on the current stream (raw: that stream), on `grid` programs (1);
        returns the compiled kernel (the launcher's C entry is then called with the same arguments: _launcher)."""
        return self.kernel[(grid,)](*args, num_warps=GUARD_WARPS)

    def _words(self) -> int:
        return HEAD + SECTIONS * self.cap + self.tcap

    def _fit(self, rows: int, tokens: int) -> bool:
        """Allocate the ring, or grow it for a larger observation (not once a graph holds its address); False:
        there is no ring and this is inside capture (its allocation and zeroing would be captured)."""
        if self.ring is not None and rows <= self.cap and tokens <= self.tcap:
            return True
        if self.capturing():
            if self.ring is None:
                return False
            return True
        if self.ring is not None and self.frozen:
            return True
        t = self.torch
        cap = max(self.cap or 0, 64, 2 * rows)
        tcap = max(self.tcap or 0, 256, 2 * tokens)
        old, oc, ot = self.ring, self.cap, self.tcap
        self.cap, self.tcap = cap, tcap
        self.ring = t.zeros((self.keep, self._words()), dtype=t.int32, device=self.device)
        if old is not None:  # (device copies, queued on the stream)
            self.ring[:, :HEAD] = old[:, :HEAD]
            for k in range(SECTIONS):
                self.ring[:, HEAD + k * cap:HEAD + k * cap + oc] = old[:, HEAD + k * oc:HEAD + (k + 1) * oc]
            self.ring[:, HEAD + SECTIONS * cap:HEAD + SECTIONS * cap + ot] = old[:, HEAD + SECTIONS * oc:]
        elif self.cuda:
            self.go, self.how = _launcher(self)
        self._refix()
        return True

    def _i32(self, x):
        """x as a contiguous 1-D int32 tensor on the device, a copy on the stream (what the launch does not take as
        it is). On a GPU a host array (the vLLM plugin's query_start_loc and page counts are numpy) goes through
        pinned memory without waiting for the stream: a plain copy would synchronise, and inside capture break the
        graph (callers leave host arrays out there: _in_capture)."""
        t = self.torch
        if self.cuda and not (isinstance(x, t.Tensor) and x.is_cuda):
            return t.from_numpy(host_copy(x)).pin_memory().to(self.device, non_blocking=True)
        if not isinstance(x, t.Tensor):
            x = t.as_tensor(np.asarray(x))
        if x.dtype != t.int32 or not x.is_contiguous() or x.device != self.device:
            x = x.to(device=self.device, dtype=t.int32).contiguous()
        return x.reshape(-1)

    def _in_capture(self, x) -> bool:
        """x is a host array met inside capture: not read (a graph replay could only re-read its capture value)."""
        return self.cuda and not (isinstance(x, self._tensor) and x.is_cuda) and self.capturing()

    def _sec(self, x, held: list) -> tuple[int, int]:
        """(address, count) of a row section (count -1: absent, _HOST_IN_CAPTURE: a host array inside capture,
        not read; address None: a host array, which launch() places in the host-values slot). An int32 contiguous
        tensor on the device is launched as it is; another tensor on it is copied first (_i32; `held` keeps the copy
        until the launch)."""
        if x is None:
            return self._nil, -1
        if not (type(x) is self._tensor and x.get_device() == self.did and x.dtype is self._i32t
                and x.is_contiguous()):
            if self._in_capture(x):
                return self._nil, _HOST_IN_CAPTURE
            if type(x) is not self._tensor or x.get_device() != self.did:  # (a host array: launch() places it)
                return None, len(x)
            x = self._i32(x)
            held.append(x)
        return x.data_ptr() or self._nil, x.numel()  # (an empty tensor's address may be 0: never read)

    def _slot_args(self, positions, slot_mapping, held: list) -> tuple[int, int, int, int, int, int] | None:
        """(positions' address, tokens, the slot mapping's address, groups, int64 bits, row stride); None: host
        arrays inside capture (not read: _in_capture). Positions 1-D and the slot mapping [groups, tokens] (rows of
        contiguous tokens) int32 or int64 on the device are read as they are, the kernel narrows them (vLLM's are
        int64: no conversion per observe); a dict {group: tokens} (groups 0..G-1) or anything else is copied."""
        T, did, i32, i64 = self._tensor, self.did, self._i32t, self._i64t
        wide = 0
        if positions is None:
            raise ValueError("slot_mapping needs positions on the device path")
        maps = slot_mapping.values() if isinstance(slot_mapping, dict) else (slot_mapping,)
        if self.cuda and self.capturing() and any(self._in_capture(x) for x in (positions, *maps) if x is not None):
            return None
        if type(positions) is T and positions.get_device() == did and positions.dim() == 1 and (
                positions.dtype is i32 or positions.dtype is i64) and positions.is_contiguous():
            wide = int(positions.dtype is i64)
        else:
            positions = self._i32(positions)
            held.append(positions)
        n_pos = positions.numel()
        pp = positions.data_ptr() or self._nil
        if slot_mapping is None:
            return pp, n_pos, self._nil, 0, wide, 0
        sm = slot_mapping
        if type(sm) is T and sm.get_device() == did and sm.dim() == 2 and (sm.dtype is i32 or sm.dtype is i64) \
                and sm.shape[1] == n_pos and (sm.stride(1) == 1 or n_pos <= 1):
            wide |= 2 * (sm.dtype is i64)
        else:
            if isinstance(sm, dict):
                keys = sorted(sm)
                if keys != list(range(len(keys))):
                    raise ValueError("slot_mapping's groups must be 0..G-1 on the device path")
                sm = self.torch.stack([self._i32(sm[g]) for g in keys])
            else:  # [groups, tokens], or flat: groups of n_pos tokens (with no token: one empty group)
                sm = self._i32(sm).reshape(sm.shape[0] if getattr(sm, "ndim", 1) == 2 else -1 if n_pos else 1, n_pos)
            held.append(sm)
        return pp, n_pos, sm.data_ptr() or self._nil, sm.shape[0], wide, sm.stride(0)

    def _mask(self, groups: int) -> int:
        """Bit g: group g is sharded by DCP (the spec's, every group where it names none)."""
        m = self._masks.get(groups)
        if m is None:
            sh = self._spec.sharded
            m = self._masks[groups] = sum(1 << g for g in range(groups) if sh is None or g >= len(sh) or sh[g])
        return m

    def _keep_host(self, r, hidx: int) -> None:
        """The launch's host values (HOST_ROWS, host copies) under its host index, where it has any; those of the
        last EXTRAS_KEPT * keep launches and of every captured one are kept."""
        late = r[_HOST_AT:]
        self.extras[hidx] = tuple(map(host_fast, late))
        if self.capturing():
            self.pinned.add(hidx)
        if len(self.extras) > 2 * EXTRAS_KEPT * self.keep + len(self.pinned):
            old = hidx - EXTRAS_KEPT * self.keep
            for k in [k for k in self.extras if k < old and k not in self.pinned]:
                del self.extras[k]

    def launch(self, vals, r) -> bool:
        """One check-and-keep launch on the current stream; nothing read back. False: skipped (_fit). No torch
        op on the engine's tensors where they are int32 contiguous on the device (slot entries: int64 too).
        vals: the record's Scalars (checked). The host values are checked here (host_checks.late_bits: one
        comparison when there are none) and their verdict launched as `hbits`."""
        (_, site, _, _, _, seq_lens, dcp, _, _, _, _, _, qsl, _, _, _, kv, dqsl, tot, positions, slot_mapping,
         *_) = r
        sid = self.sites.get(site)
        if sid is None:
            sid = self.sites[site] = len(self.site_names)
            self.site_names.append(site)
        held: list = []  # copies made for this launch, alive until it is queued
        nil, sec = self._nil, self._sec
        sp, ns = sec(seq_lens, held)
        dp, nd = sec(dcp, held)
        qp, nq = sec(qsl, held)
        kp, nk = sec(kv, held)
        yp, ny = sec(dqsl, held)
        tp, nt = sec(tot, held)
        at = ()  # host arrays among them (address None): written into the host-values slot (post)
        if sp is None or dp is None or qp is None or kp is None or yp is None or tp is None:
            at = [k for k, a in enumerate((sp, dp, qp, kp, yp, tp)) if a is None]
        if min(nd, nq, nk, ny, nt) == _HOST_IN_CAPTURE:  # (host arrays inside capture: those checks left out)
            if nd == _HOST_IN_CAPTURE:
                return False  # (without its view nothing of it can be checked: skipped, as before the ring)
            if nq == _HOST_IN_CAPTURE:  # the slot check's real tokens come from query_start_loc
                nq, positions, slot_mapping = -1, None, None
            nk, ny, nt = (-1 if n == _HOST_IN_CAPTURE else n for n in (nk, ny, nt))
        if positions is None and slot_mapping is None:
            pp, npos, mp, groups, wide, stride, mask = nil, -1, nil, 0, 0, 0, 0
        else:
            got = self._slot_args(positions, slot_mapping, held)
            pp, npos, mp, groups, wide, stride = (nil, -1, nil, 0, 0, 0) if got is None else got
            mask = self._mask(groups)
        rows = max(ns, nd, nq, nk, ny, nt)
        tokens = max(npos, 0) * (groups + 1)
        if self.ring is None or rows > self.cap or tokens > self.tcap:
            if not self._fit(rows, tokens):
                return False
        if not self.frozen and self.capturing():
            self.frozen = True
        hidx = self.hidx
        self.hidx = (hidx + 1) & 0x7FFFFFFF  # (a header word)
        step, rank, nr, nrp, ubatch, parent, rs, ts, te, ntp, buf, graph = vals  # (Scalars order)
        hbits, hv, late = 0, None, any(x is not None for x in r[_HOST_AT:])
        if late:
            if self.capturing():
                r = r._replace(**_CAPTURED_BUILD_ONLY)
            hbits = late_bits(self._spec, r, BIT)
            self._keep_host(r, hidx)
        if late or at:
            hv, (sp, dp, qp, kp, yp, tp) = self.host_values.place(r if late else None, nr, at, (
                seq_lens, dcp, qsl, kv, dqsl, tot), [sp, dp, qp, kp, yp, tp], held, self._i32, nil)
        buf = _NONE if buf is None else buf
        raw = self.raw(self.did)
        self.go(raw, 1, *self._fixed, step, sid, rank, ubatch, nr, nrp,
                _NONE if parent is None else parent, _NONE if rs is None else rs, _NONE if ts is None else ts,
                _NONE if te is None else te, _NONE if ntp is None else ntp, _NONE if graph is None else graph,
                (buf & 0xFFFFFFFF) - ((buf & 0x80000000) << 1), buf >> 32, sp, ns, dp, nd, qp, nq, kp, nk, yp, ny,
                tp, nt, pp, max(npos, 0), mp, groups, mask, wide, stride, *(self._no_hv if hv is None else
                                                                          (hv[0], *hv[3:6])), hbits, hidx)
        if hv is not None and hv[2]:
            self.host_values.launched(raw, hv[1], hv[2])
        return True

    def wrong_seen(self) -> bool:
        """The flag, read from host memory without a sync (the kernel's write lands there)."""
        return bool(self.flag_np[0])

    def kept(self) -> tuple[list[tuple[int, int, Record | None]], int, int]:
        """Wait for the stream; the ring's observations up to the first wrong one, oldest first, as (index, rule
        bits, the Record or None for one larger than its slot); the number seen, the number wrong."""
        t = self.torch
        if self.device.type == "cuda":
            t.cuda.synchronize(self.device)
        count, stop, wrong = (int(v) for v in self.state[:3].cpu().tolist())
        if self.ring is None:
            return [], count, wrong
        last = (stop or count) - 1
        ring = self.ring.cpu().numpy()
        out = []
        for i in range(max(0, last - self.keep + 1), last + 1):
            w = ring[i % self.keep]
            if w[0] == i + 1:
                out.append((i, int(w[1]), _decode(w, self.cap, self.site_names, self.extras) if w[W_KEPT] else None))
        return out, count, wrong

    def counts(self) -> tuple[int, int]:
        """Wait for the stream; (observations seen, wrong ones) by the kernel's counters."""
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)
        count, _, wrong = (int(v) for v in self.state[:3].cpu().tolist())
        return count, wrong


def _decode(w: np.ndarray, cap: int, site_names: list[str], extras: dict) -> Record:
    """A slot of the Guard's ring (`cap` rows a section) back to the observation's Record (host arrays)."""
    cnt = w[W_COUNTS:W_COUNTS + 8].tolist()

    def sec(k):
        return None if cnt[k] < 0 else w[HEAD + k * cap:HEAD + k * cap + cnt[k]].copy()

    def opt(v):
        return None if v == _NONE else int(v)

    required = ("step", "rank", "ubatch", "num_reqs", "num_reqs_padded")  # (never _NONE)
    kw = {f: int(w[k]) if f in required else opt(w[k]) for f, k in HEAD_WORDS.items()}
    b = HEAD_WORDS["buffer"]
    kw.update(site=site_names[int(w[HEAD_WORDS["site"]])], buffer=opt((int(w[b + 1]) << 32) | (int(w[b]) & 0xFFFFFFFF)))
    kw.update((f, sec(k)) for k, f in enumerate(ROW_SECTIONS))
    kw.update(zip(HOST_ROWS, extras.get(int(w[W_HOST]), ())))
    tok, groups = cnt[6], cnt[7]
    if groups > 0:
        base = HEAD + SECTIONS * cap
        kw["positions"] = w[base:base + tok].copy()
        kw["slot_mapping"] = w[base + tok:base + tok * (groups + 1)].reshape(groups, tok).copy()
    return Record(**kw)
