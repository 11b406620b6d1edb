"""The snapshot ring (ring.py): a row column is a section table entry, a full ring waits or drops, fences hand
over finished slots oldest first, and the harvested copies give each slot its rows."""

import pytest
import torch
from conftest import hostring

from dcptool.dump import Record
from dcptool.engine.arguments import scalars
from dcptool.engine.recorder.record import Recorder
from dcptool.engine.snapshot import device
from dcptool.engine.snapshot.ring import (
    ANY,
    ENTRY,
    FIXED,
    ROWS,
    SECTIONS,
    HostEvent,
    Landed,
    Section,
    Slot,
    SnapshotRing,
    slot_rows,
)


@hostring
@pytest.mark.kernel
def test_a_fifth_section_is_a_table_entry_not_kernel_code(tmp_path, monkeypatch):
    """Adding a row column to the device path: one SECTIONS entry (here two more past the table's own: one
    value per token with negatives forbidden, and one value per seq_lens row); the same kernel copies them,
    and their length rules apply."""
    from dcptool.engine.snapshot.kernels import snapshot_kernel

    kernel = snapshot_kernel()
    K = len(SECTIONS)
    monkeypatch.setattr(device, "SECTIONS", (*SECTIONS, Section("x1", "extra_tokens", ANY, nonneg=True),
                                             Section("x2", "extra_rows", ROWS)))
    rec = Recorder(tmp_path / "f.safetensors", dcp_size=2)
    ring = rec._device.use_host_ring(1 << 16)  # (large enough that no observation here is fenced at once)
    assert ring.kernel is kernel and rec._device._nsec == K + 2
    seq = torch.tensor([5, 9, 0], dtype=torch.int32)
    pos = torch.arange(11, dtype=torch.int64) * 3
    tot = torch.tensor([7, 8, 9], dtype=torch.int32)
    vals = scalars(Record(0, "x", 1, 2, 3, None))
    pad = (None,) * (K - 4)
    srcs = (seq, None, torch.tensor([0, 1, 2, 2], dtype=torch.int32), None, *pad, pos, tot)
    assert rec._observe_device(vals, "x", srcs) == 0
    with pytest.raises(ValueError, match="one value per seq_lens row"):  # (observe() drops and counts it)
        rec._observe_device(vals, "x", (*srcs[:K + 1], tot[:2]))
    bad = torch.tensor([1, -4], dtype=torch.int64)
    assert rec._observe_device(vals, "x", (*srcs[:K], bad, tot)) == 1
    with rec._lock, pytest.warns(RuntimeWarning, match="a negative"):
        rec._device.harvest(wait=True)
    assert rec.dropped == 1  # the negative value, found at harvest
    first, blk, lo = rec._device.landed.runs[0]
    rows = slot_rows(blk, 0, None)
    assert first == 0 and len(rows) == K + 2 and rows[1] is None and rows[3] is None
    assert all(r is None for r in rows[4:K])
    assert rows[0].tolist() == [5, 9, 0] and rows[2].tolist() == [0, 1, 2, 2]
    assert rows[K].tolist() == list(range(0, 33, 3)) and rows[K + 1].tolist() == [7, 8, 9]
    rec.discard()


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
    from dcptool.engine.snapshot import ring as R

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
