"""Harvested copies (landed.py): each slot's rows from the copies, a slot in flight refused, few slots and many
checked and copied alike."""

import pytest
from test_ring import _launched

from dcptool.engine.snapshot.landed import Landed
from dcptool.engine.snapshot.layout import ENTRY, FIXED
from dcptool.engine.snapshot.ring import Slot, SnapshotRing


def test_landed_copies_give_each_slot_its_rows_and_refuse_one_in_flight():
    ring = SnapshotRing(256, None)
    slots = [_launched(ring, i, 16) for i in range(3)]
    for s in slots:  # one section of 3 rows each
        ring.np[s[1] + 4], ring.np[s[1] + FIXED + 2] = 1, 3
        ring.np[s[1] + FIXED + ENTRY:s[1] + FIXED + ENTRY + 3] = [s[0], 10 + s[0], 20 + s[0]]
    ring.np[slots[1][1] + 5] = 2  # flags: a forbidden negative in slot 1
    landed = Landed()
    assert landed.take(ring, slots[:2]) == [(slots[1], 2)] and landed.take(ring, []) == []
    rows = landed.rows([slots[0], None, "host row"], in_flight=2)
    assert rows[0][0].tolist() == [0, 10, 20] and rows[1:] == [None, "host row"]
    with pytest.raises(RuntimeError, match="observation 2 is written before it landed"):
        landed.rows([slots[2]], in_flight=2)
    landed.written(2)
    assert len(landed.runs) == 1  # (kept: the last run starting at or before the next to write may hold it)


@pytest.mark.parametrize("n", [1, 3, 8, 9, 20])
def test_a_harvest_of_few_slots_and_of_many_checks_and_copies_alike(monkeypatch, n):
    """take() checks up to FEW slots in plain Python and more with numpy: on the same slots (a gap in the middle, as
    where the ring wrapped, a wrong `done`, flags) both give the same bad slots and the same copies."""
    from dcptool.engine.snapshot import landed as R

    got = []
    for few in (0, 100):
        monkeypatch.setattr(R, "FEW", few)
        ring = SnapshotRing(16 * (n + 2), None)
        ring.np[:] = 0
        slots = []
        for i in range(n):
            at = 16 * (i + (i >= n // 2))  # (a gap of one slot: two runs to copy)
            ring.np[at], ring.np[at + 1], ring.np[at + 8] = i, i, 100 + i
            slots.append(Slot((i, at, 16, None)))
        for k in range(0, n, 3):
            ring.np[slots[k][1] + 5] = 1 + k % 3  # flags
        if n > 1:
            ring.np[slots[1][1] + 1] = -1  # `done` not written: a slot that does not hold its observation
        landed = Landed()
        bad = landed.take(ring, slots)
        got.append(([(s[0], f) for s, f in bad], [(f, b.tolist(), lo) for f, b, lo in landed.runs]))
    assert got[0] == got[1]
    assert [i for i, _ in got[0][0]] == sorted({*range(0, n, 3), *([1] if n > 1 else [])})
    assert len(got[0][1]) == (2 if n > 1 else 1)
