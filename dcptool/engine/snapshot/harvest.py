"""The ring's slots in flight: room for a new one, the finished ones copied out, their rows for the writer."""

from __future__ import annotations

from dcptool.engine.snapshot.landed import Landed
from dcptool.engine.snapshot.ring import Slot, SnapshotRing


class Harvest:
    """The device observations between their launch and their write: the ring they are in flight in (`ring`, set
    by the device path once its ring runs), their copies once finished (`landed`), and what a full ring does
    (`ring_full`: "wait" for the oldest launches, or "drop" the new observation, counted in `ring_drops`).

    The device path asks it for room and harvests as it launches; the writer asks it to settle what is in flight
    before a file and for the rows of what landed. An observation whose slot does not hold it (a value int32 cannot
    hold, a forbidden negative, a slot the kernel did not finish) is reported to on_lost(index, error). Every
    method runs under the Recorder's lock."""

    def __init__(self, ring_full: str, on_lost):
        self.ring_full = ring_full
        self.ring_drops = 0
        self.ring: SnapshotRing | None = None
        self.landed = Landed()
        self._on_lost = on_lost

    def room(self, ring: SnapshotRing, words: int) -> int:
        """Start of a free slot of `words`: harvest finished slots, wait for the oldest or drop when full."""
        start = ring.alloc(words)
        if start is not None:
            return start
        if words > ring.words:  # bigger than the whole ring: finish what is in flight, then grow it
            self.harvest(wait=True)
            ring.resize(max(2 * ring.words, 2 * words))
            return 0
        self.harvest(wait=False)
        while (start := ring.alloc(words)) is None:
            if self.ring_full == "drop":
                self.ring_drops += 1
                raise ValueError("the snapshot ring is full (the GPU is far behind); ring_full='wait' waits instead")
            ring.fence()
            self.harvest(wait=True, one=True)
        return start

    def harvest(self, *, wait: bool, one: bool = False) -> None:
        """Copy the finished slots out of the ring (wait: finish all in flight first; one: the slots of one fence
        only)."""
        ring = self.ring
        if ring is not None:
            for take in ring.finished(wait=wait, one=one):
                self._resolve(ring, take)

    def _resolve(self, ring: SnapshotRing, take: list[Slot]) -> None:
        """Finished slots into `landed`; an observation whose slot does not hold it is lost."""
        for s, f in self.landed.take(ring, take):
            why = ("a negative value where none may be (seq_lens, dcp_tot_seq_lens, positions)" if f & 2
                   else "a value int32 cannot hold" if f & 1 else "a ring slot that does not hold it")
            self._on_lost(s[0], ValueError(f"observation {s[0]}: the device values hold {why}"))

    def abandon(self, e: Exception) -> None:
        """The slots in flight cannot be harvested (the device is gone): their observations are lost."""
        ring = self.ring
        if ring is None:
            return
        while ring.pending:
            s = ring.pending.popleft()
            self._on_lost(s[0], ValueError(f"observation {s[0]}: its device snapshot cannot be read ({e})"))
        ring.fences.clear()

    def settle(self, *, wait: bool) -> int | None:
        """Before a file: harvest what finished (wait: all in flight); the index of the oldest observation still in
        flight (its fence recorded, so that it lands soon), or None when none is."""
        ring = self.ring
        if ring is None or not ring.pending:
            return None
        self.harvest(wait=wait)
        if not ring.pending:
            return None
        ring.fence()
        return ring.pending[0][0]

    def rows(self, rows: list) -> list:
        """rows with each Slot replaced by its rows from the landed copies (none may still be in flight)."""
        pending = None if self.ring is None else self.ring.pending
        return self.landed.rows(rows, pending[0][0] if pending else None)

    def written(self, file_start: int) -> None:
        """Observations before file_start are written: their copies can go."""
        self.landed.written(file_start)
