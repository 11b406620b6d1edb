"""The snapshot ring (ring.py): fences hand over finished slots oldest first."""

from dcptool.engine.snapshot.ring import HostEvent, Slot, SnapshotRing


def _launched(ring: SnapshotRing, index: int, words: int) -> Slot:
    """A slot allocated and "launched" on the host ring (the kernel's part done by hand: done = seqno)."""
    start = ring.alloc(words)
    ring.np[start:start + words] = 0
    ring.np[start], ring.np[start + 1], ring.np[start + 4] = index, index, 0
    slot = Slot((index, start, words, None))
    ring.pending.append(slot)
    ring.unfenced += 1
    ring.stream(0)
    return slot


def test_fences_hand_over_finished_slots_oldest_first(monkeypatch):
    """finished(): nothing while the launches before the oldest fence run (without waiting), then each fence's
    slots in launch order; one=True stops after one fence, wait=True fences and waits for all."""
    monkeypatch.setattr(HostEvent, "hold", True)
    monkeypatch.setattr(HostEvent, "waits", 0)
    ring = SnapshotRing(256, None)
    a, b = _launched(ring, 0, 8), _launched(ring, 1, 8)
    ring.fence()
    c = _launched(ring, 2, 8)
    ring.fence()
    d = _launched(ring, 3, 8)
    assert list(ring.finished(wait=False)) == [] and HostEvent.waits == 0 and len(ring.pending) == 4
    assert list(ring.finished(wait=True, one=True)) == [[a, b]] and HostEvent.waits == 1
    assert list(ring.finished(wait=True)) == [[c], [d]] and not ring.pending and not ring.fences
    assert HostEvent.waits == 3 and ring.alloc(256) == 0  # (empty again: the whole ring is free)
