"""The snapshot ring: pinned host memory the GPU writes slots into, allocated in observation order, fenced by CUDA
events (a slot's layout: layout.py; the copies harvested out of it: landed.py)."""

from __future__ import annotations

from collections import deque

from dcptool.engine.snapshot.layout import HEAD_READ

FENCE_EVERY = 64  # device observations between CUDA events (an event per launch would double the CPU cost)
DEFAULT_RING_BYTES = 4 << 20  # ~1,300 observations of 256 requests in flight


class Slot(tuple):
    """One observation in flight: (index, start, words, host); host holds, per section, the array of a
    section the host holds (None: none does)."""

    __slots__ = ()


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

    def queued(self, raw: int, slot: tuple) -> bool:
        """The launch that reads `slot` ((index, start, words, host)) is queued on stream `raw`: the slot stays in
        flight until a fence recorded after it has completed. True: a fence was recorded now (every FENCE_EVERY
        launches, and every fence_words words): the caller collects what finished by then."""
        if raw not in self.streams:
            self.stream(raw)
        self.pending.append(slot)
        self.unfenced += 1
        self.unfenced_words += slot[2]
        if self.unfenced >= FENCE_EVERY or self.unfenced_words >= self.fence_words:
            self.fence()
            return True
        return False

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
