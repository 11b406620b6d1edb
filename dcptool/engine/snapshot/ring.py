"""The snapshot ring: a slot's layout, the row columns it holds, the pinned ring of slots in flight, their copies."""

from __future__ import annotations

import bisect
import struct
from collections import deque
from typing import NamedTuple

import numpy as np

from dcptool.dump import ROW_FIELDS
from dcptool.engine.arguments import Groups
from dcptool.engine.snapshot.arena import ARENA_WORDS, CHUNKS, unused

# Ring slots (int32 words; a slot starts at a multiple of 8 words, 32 bytes; the CPU writes the header before the
# launch (observe()'s fast path: its kernel writes it), the kernel writes `flags` and `done`; a slot describes
# itself, so a later fused check kernel can read, or extend, it):
#
#     word 0      seqno        the observation's index & 0x7fffffff (CPU)
#     word 1      done         -1 (CPU); the kernel writes seqno here last (checked at harvest)
#     word 2      num_reqs
#     word 3      num_reqs_padded
#     word 4      nsec         K, the number of section entries (= len(SECTIONS))
#     word 5      flags        0 (CPU); kernel: bit 0 a value int32 cannot hold, bit 1 a negative value in
#                              a section that forbids them (seq_lens, dcp_tot_seq_lens, positions)
#     word 6      words        the slot's size in words (header and rows, rounded up to 8)
#     word 7      0            (reserved)
#     words 8+4k .. 11+4k      section k, in dump.ROW_FIELDS order (SECTIONS): source address (int64,
#                              words 8+4k and 9+4k), count (word 10+4k; -1: absent, or held on the host),
#                              mode (word 11+4k; bit 0 int64 source, bit 1 negatives flagged)
#     then the rows of the sections with count >= 0, back to back, from word 8+4K.
#
# A row column is a SECTIONS entry (its observe() keyword, its length rule): the kernel loops over the header's
# entries and needs no edit.
FIXED = 8  # = snapshot.SNAP_FIXED: the fixed header words of a slot (described here without importing triton)
ENTRY = 4  # = snapshot.SNAP_ENTRY: header words per section
HEAD_READ = 64  # = snapshot.SNAP_HEAD_READ: words the kernel reads at a slot's start (the ring is padded by it)
ABSENT = (0, -1, 0)  # a header entry of an absent section (or one the host holds): address, count, mode
FEW = 8  # a harvest of up to FEW slots checks them in plain Python (Landed._take_few)
FENCE_EVERY = 64  # device observations between CUDA events (an event per launch would double the CPU cost)
DEFAULT_RING_BYTES = 4 << 20  # ~1,300 observations of 256 requests in flight


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
            # issue 15: slot entries (positions, slot mapping, KV-cache group). Device tensors are snapshotted raw
            # (the positions once, the slot mapping rows of the groups back to back) and the entries built at
            # harvest (slot_rows, dump.slot_entries' layout); the group column is always the host's (Groups)
            Section("pos", "positions", ANY, nonneg=True), Section("slot", "slot_mapping", ANY),
            Section("sgrp", "slot_group", ANY))
if tuple(s.field for s in SECTIONS) != ROW_FIELDS:
    raise ImportError(f"ring.SECTIONS {[s.field for s in SECTIONS]} must follow dump.ROW_FIELDS {ROW_FIELDS}")
# observe()'s fast path (snapshot.snapshot_args_kernel): sections 0-7 as kernel arguments (the slot group column is
# the host's), their negative-value flags at bits 8 + k of its `modes` argument (bit k: int64, set per observation)
ARGS_SECTIONS = 8  # = snapshot.SNAP_ARGS_SECTIONS
if tuple(s.name for s in SECTIONS[ARGS_SECTIONS:]) != ("slot_group",):
    raise ImportError("ring.SECTIONS: the fast path's kernel takes every section but the last (slot_group)")
ARGS_NEG = sum(1 << (8 + k) for k, s in enumerate(SECTIONS[:ARGS_SECTIONS]) if s.nonneg)


def head_struct(k: int) -> struct.Struct:
    """A slot header with k section entries (the fixed words, then address, count, mode per section)."""
    return struct.Struct("<8i" + "qii" * k)


def _tables(sections: tuple[Section, ...]) -> tuple:
    """What the device path derives from the section table (once, not per observation): the section count, the
    header's struct and words, each section's header mode, the (k, section) pairs with a rule, the sections of
    ROWS_PLUS_1 and of ROWS length, the (k, setting) pairs that need a config setting, the fast path's slot words,
    its host-held padding and its kernel's `modes` argument (without the int64 bits)."""
    k = len(sections)
    return (k, head_struct(k),
            FIXED + ENTRY * k + 7,  # (+ 7: rounded down to 8 words at the end)
            tuple(2 if x.nonneg else 0 for x in sections),  # header mode bit 1: negatives flagged
            tuple((j, x) for j, x in enumerate(sections) if x.length != ANY or x.needs or x.nonneg),
            tuple(j for j, x in enumerate(sections) if x.length == ROWS_PLUS_1),
            tuple(j for j, x in enumerate(sections) if x.length == ROWS),
            tuple((j, x.needs) for j, x in enumerate(sections) if x.needs),
            FIXED + ENTRY * k + 7,  # (the fast path's slot, before its rows)
            (None,) * (k - 3), k << 16 | ARGS_NEG)


def host_rules(rules: tuple, config, ent: list, host: list, rows: int, words: int) -> int:
    """The section table's length rules when the host holds some sections (`rules`: the (k, section) pairs that
    have one; `ent`: the header's entries, 3 per section, `host`: the host-held arrays, both updated); returns the
    slot's words."""
    for k, sec in rules:
        n = ent[3 * k + 1]
        h = host[k]
        size = n if n >= 0 else -1 if h is None else h.size
        if size < 0:
            continue
        if sec.needs and getattr(config, sec.needs) is None:
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


class Slot(tuple):
    """One observation in flight: (index, start, words, host); host holds, per section, the array of a
    section the host holds (None: none does)."""

    __slots__ = ()


def slot_rows(blk: np.ndarray, o: int, host: list | None) -> tuple:
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
    g = out[-1]
    if type(g) is Groups:  # slot sections snapshotted raw: dump.slot_entries' entries, one per token and group
        pos = out[-3]
        return (*out[:-3], np.tile(pos, len(g)), out[-2], np.repeat(np.array(g, np.int32), pos.size))
    return tuple(out)


class HostEvent:
    """The host ring's stand-in for a CUDA event (CPU tests): done at once, unless a test sets `hold`;
    synchronize() finishes it (and counts the wait)."""

    hold = False
    waits = 0

    def __init__(self):
        self.done = True

    def record(self, stream=None) -> None:
        self.done = not HostEvent.hold

    def query(self) -> bool:
        return self.done or not HostEvent.hold  # (released: the "GPU" caught up)

    def synchronize(self) -> None:
        if not self.done:
            HostEvent.waits += 1
        self.done = True


class SnapshotRing:
    """A circular buffer of int32 words (pinned host memory the GPU writes into) holding slots in flight.

    Slots are allocated in observation order; a fence is one CUDA event per stream that launched
    slots since the last fence, and every slot before it is complete once its events are.
    `go(raw_stream, slot_address)` launches the kernel on one slot; `how` says through what (launch.py picks).
    """

    def __init__(self, words: int, device: int | None):
        import torch

        self.device = device  # CUDA device index; None: the host ring of the CPU tests (interpreted kernel)
        self.torch = torch
        self.words = 0
        self.pending: deque[Slot] = deque()
        self.fences: deque[tuple[list, int]] = deque()  # (its events, the slots launched before it since the last)
        self.unfenced = 0  # slots launched since the last fence
        self.unfenced_words = 0  # ... and their words (a fence every fence_words too: large slots fill the ring)
        self.waits = 0  # fences the host waited for (a full ring, close(): the GPU was behind)
        self.streams: dict = {}  # raw stream -> stream object, for streams with slots not yet fenced
        self.known: dict = {}
        self.free_events: list = []
        self.kernel = None
        self.go = None
        self.how = ""
        self.go3 = None  # go3(raw, grid, *args): snapshot.snapshot_args_kernel (observe()'s fast path); None: none
        self.how3 = ""
        self.did = -1 if device is None else device  # what get_device() says of a tensor this ring snapshots
        self.i32 = torch.int32
        self.i64 = torch.int64
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
        # a fence every 1/32 of the ring at least: a full ring has fences to wait for, and no harvest (inside an
        # observe()) copies more than that at once: one large copy would hold the engine thread for 100s of µs
        self.fence_words = words // 32
        self.absent5 = (self.base, -1) * 5  # snapshot_args_kernel's sections 3-7, absent (any readable address)

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
        return self.torch.cuda.Event() if self.device is not None else HostEvent()

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
        self.unfenced = self.unfenced_words = 0

    def finished(self, *, wait: bool, one: bool = False):
        """The slots of each fence whose launches are done, oldest first, one list a fence (wait: fence and wait
        for all in flight; one: only the oldest fence's, waiting for it if need be)."""
        if wait and not one:
            self.fence()
        while self.fences:
            evs, n = self.fences[0]
            if not all(ev.query() for ev in evs):
                if not wait:
                    return
                self.waits += 1
                for ev in evs:
                    ev.synchronize()
            self.fences.popleft()
            self.free_events.extend(evs)
            pop = self.pending.popleft  # (the n slots launched before this fence: the oldest in flight)
            yield [pop() for _ in range(n)]
            if one:
                return

    def stream(self, raw: int):
        s = self.known.get(raw)
        if s is None:
            s = self.known[raw] = self.torch.cuda.current_stream(self.device) if self.device is not None else None
        self.streams[raw] = s


class Landed:
    """Harvested slots: one private copy of each contiguous run of the ring, kept until every observation whose
    rows lie in it is written (the rows are cut out of the copy at the write)."""

    def __init__(self):
        self.runs: list[tuple[int, np.ndarray, int]] = []  # (first index, copy, its ring word)
        self._arena: np.ndarray | None = None  # where _keep cuts the copies from
        self._arena_at = 0

    def take(self, ring: SnapshotRing, take: list[Slot]) -> list[tuple[Slot, int]]:
        """Copy finished slots out of the ring, their headers checked at once (done == seqno, flags); returns
        the slots that do not hold their observation, each with its flags."""
        bad_slots: list[tuple[Slot, int]] = []
        if not take:
            return bad_slots
        if len(take) <= FEW:
            return self._take_few(ring, take)
        cols = tuple(zip(*take))  # (one pass over the slots, in C)
        index, starts, words = np.array(cols[0], np.int64), np.array(cols[1], np.int64), np.array(cols[2], np.int64)
        ends = starts + words
        cut = (np.flatnonzero(starts[1:] != ends[:-1]) + 1).tolist()  # (where the ring wrapped)
        for i, j in zip([0, *cut], [*cut, len(take)]):
            lo = int(starts[i])
            blk = self._keep(ring.np[lo:int(ends[j - 1])])
            self.runs.append((take[i][0], blk, lo))
            offs = starts[i:j] - lo
            seqno = index[i:j] & 0x7FFFFFFF
            flags = blk[offs + 5]
            bad = (blk[offs + 1] != seqno) | (flags != 0)
            if bad.any():
                bad_slots += [(take[i + k], int(flags[k])) for k in np.flatnonzero(bad).tolist()]
        return bad_slots

    def _take_few(self, ring: SnapshotRing, take: list[Slot]) -> list[tuple[Slot, int]]:
        """take() for a few slots (a harvest every slot or two, as large slots are fenced): the same copies and
        checks without take()'s dozen numpy calls, which cost more than the checks of a few slots."""
        bad_slots = []
        n = len(take)
        i = 0
        while i < n:
            j = i + 1
            while j < n and take[j][1] == take[j - 1][1] + take[j - 1][2]:  # (contiguous: one copy)
                j += 1
            lo = take[i][1]
            blk = self._keep(ring.np[lo:take[j - 1][1] + take[j - 1][2]])
            self.runs.append((take[i][0], blk, lo))
            for s in take[i:j]:
                o = s[1] - lo
                f = int(blk[o + 5])
                if f or int(blk[o + 1]) != s[0] & 0x7FFFFFFF:
                    bad_slots.append((s, f))
            i = j
        return bad_slots

    def _keep(self, src: np.ndarray) -> np.ndarray:
        """A private copy of src, cut from a chunk of ARENA_WORDS words (arena.CHUNKS: its pages touched ahead of
        use, so the copy costs no page fault on the engine's thread; one allocation per ~1,000 observations instead
        of one per harvest); a chunk is given back once no harvested run still to write lies in it (written())."""
        a, pos, n = self._arena, self._arena_at, src.size
        if a is None or pos + n > a.size:
            a = self._arena = CHUNKS.take() if n <= ARENA_WORDS else np.empty(n, np.int32)
            pos = 0
        out = a[pos:pos + n]
        np.copyto(out, src)
        self._arena_at = pos + n
        return out

    def rows(self, rows: list, in_flight: int | None) -> list:
        """rows with each Slot replaced by its rows (slot_rows) from the copies; in_flight: the index of the
        oldest slot not harvested yet (None: none), which no slot to write may reach."""
        firsts = [x[0] for x in self.runs]
        rows = list(rows)
        for i, r in enumerate(rows):
            if type(r) is Slot:
                first, blk, lo = self.runs[bisect.bisect_right(firsts, r[0]) - 1]
                if first > r[0] or (in_flight is not None and in_flight <= r[0]):
                    raise RuntimeError(f"dcptool Recorder: observation {r[0]} is written before it landed")
                rows[i] = slot_rows(blk, r[1] - lo, r[3])
        return rows

    def written(self, file_start: int) -> None:
        """Observations before file_start are written: drop the copies none still to write points into, and give
        their chunks back where nothing refers to them any more."""
        if self.runs:
            firsts = [x[0] for x in self.runs]
            k = max(0, bisect.bisect_right(firsts, file_start) - 1)
            gone = {id(r[1].base): r[1].base for r in self.runs[:k] if r[1].base is not None}
            del self.runs[:k]
            for r in self.runs:
                gone.pop(id(r[1].base), None)
            gone.pop(id(self._arena), None)
            chunks = list(gone.values())
            gone.clear()
            for c in unused(chunks):
                CHUNKS.give(c)
