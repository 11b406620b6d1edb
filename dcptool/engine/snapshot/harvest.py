"""Collecting a DevicePath's finished ring slots: harvested when their CUDA events say so, waited for when full."""

from __future__ import annotations

from dcptool.engine.snapshot.ring import Slot, SnapshotRing


class Harvest:
    """DevicePath's side of the ring's slots in flight (its `ring`, `landed`, `ring_full`, `ring_drops`, `_w` and
    `_drop`): make room for a slot, copy the finished ones out, drop those that cannot be read. Always under the
    Recorder's lock."""

    def _room(self, ring: SnapshotRing, words: int) -> int:
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
        """Under the lock: copy the finished slots out of the ring (wait: finish all in flight first; one: the
        slots of one fence only)."""
        ring = self.ring
        if ring is not None:
            for take in ring.finished(wait=wait, one=one):
                self._resolve(ring, take)

    def _resolve(self, ring: SnapshotRing, take: list[Slot]) -> None:
        """Finished slots into `landed`; an observation whose slot does not hold it is dropped (counted, warned)."""
        for s, f in self.landed.take(ring, take):
            self._w.lost(s[0])
            why = ("a negative value where none may be (seq_lens, dcp_tot_seq_lens, positions)" if f & 2
                   else "a value int32 cannot hold" if f & 1 else "a ring slot that does not hold it")
            self._drop(ValueError(f"observation {s[0]}: the device values hold {why}"))

    def abandon(self, e: Exception) -> None:
        """The slots in flight cannot be harvested: drop those observations (counted, warned)."""
        ring = self.ring
        while ring.pending:
            s = ring.pending.popleft()
            self._w.lost(s[0])
            self._drop(ValueError(f"observation {s[0]}: its device snapshot cannot be read ({e})"))
        ring.fences.clear()
