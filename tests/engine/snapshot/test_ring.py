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


def test_alloc_follows_a_model_of_the_ring(monkeypatch):
    """alloc(): slots in observation order, at the end of the last one or (wrapped) from word 0 up to the oldest in
    flight; None when nothing that long is free. Checked against a model of the free words over random launches and
    fences, the oldest finishing first."""
    import random

    monkeypatch.setattr(HostEvent, "hold", False)
    rng = random.Random(5)
    for words in (64, 256, 1000):
        ring = SnapshotRing(words, None)
        used: list[tuple[int, int]] = []  # (start, words) in flight, oldest first
        for i in range(400):
            need = rng.choice((8, 16, 24, words // 4, words // 2))
            got = ring.alloc(need)
            if not used:
                want = 0 if need <= words else None
            else:
                tail, (s, n) = used[0][0], used[-1]
                head = s + n
                if s >= tail:
                    want = head if head + need <= words else (0 if need <= tail else None)
                else:
                    want = head if head + need <= tail else None
            assert got == want, (i, need, used)
            if got is not None and rng.random() < 0.7:
                slot = Slot((i, got, need, None))
                ring.pending.append(slot)
                ring.unfenced += 1
                ring.stream(0)
                used.append((got, need))
            elif used:  # the oldest fence finishes
                ring.fence()
                for take in ring.finished(wait=True, one=True):
                    del used[:len(take)]
