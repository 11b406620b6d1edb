"""Harvesting the ring (harvest.py): a full ring waits for the oldest slots or drops and counts, as told; a large
slot is fenced early, so a full ring waits for the oldest slot only; a slot that cannot be read is dropped."""

import numpy as np
import pytest
import torch
from conftest import hostring

from dcptool.dump import read_dump
from dcptool.engine.recorder.record import Recorder
from dcptool.engine.snapshot.layout import ENTRY, FIXED, SECTIONS
from dcptool.engine.snapshot.ring import HostEvent


def _slot_words(rows: int) -> int:
    """Words of a ring slot holding one section of `rows` values (the header grows with SECTIONS)."""
    return (FIXED + ENTRY * len(SECTIONS) + rows + 7) & ~7


@hostring
@pytest.mark.kernel
def test_a_full_ring_waits_and_loses_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(HostEvent, "hold", True)  # no launch finishes until waited for
    monkeypatch.setattr(HostEvent, "waits", 0)
    rec = Recorder(tmp_path / "w.safetensors", dcp_size=2)
    rec._device.use_host_ring(3 * _slot_words(300) + 8)
    seen = []
    for i in range(12):
        seen.append(np.arange(i, i + 300, dtype=np.int32))
        assert rec.observe(step=i, site="x", rank=0, seq_lens=torch.from_numpy(seen[-1]), num_reqs=300,
                           num_reqs_padded=300) == i
    # 3 slots fit, each past 1/32 of the ring and so fenced alone: the 4th to the 12th each waited for the
    # oldest slot only (not for all in flight)
    assert HostEvent.waits == 9
    rec.close()
    d = read_dump(tmp_path / "w.safetensors")
    assert rec.dropped == 0 and d.n == 12 and all(np.array_equal(d.seq_lens_of(i), seen[i]) for i in range(12))


@hostring
@pytest.mark.kernel
def test_a_full_ring_drops_and_counts_when_told_to(tmp_path, monkeypatch):
    monkeypatch.setattr(HostEvent, "hold", True)
    rec = Recorder(tmp_path / "d.safetensors", dcp_size=2, ring_full="drop")
    rec._device.use_host_ring(3 * _slot_words(300) + 8)
    with pytest.warns(RuntimeWarning, match="snapshot ring is full"):
        got = [rec.observe(step=i, site="x", rank=0, seq_lens=torch.full((300,), i, dtype=torch.int32),
                           num_reqs=300, num_reqs_padded=300) for i in range(6)]
    assert got == [0, 1, 2, -1, -1, -1] and rec.ring_drops == rec.dropped == 3
    rec.close()
    d = read_dump(tmp_path / "d.safetensors")
    assert d.n == 3 and [int(d.seq_lens_of(i)[0]) for i in range(3)] == [0, 1, 2]  # the kept ones, intact


@hostring
@pytest.mark.kernel
def test_slots_in_flight_that_cannot_be_read_are_dropped_and_counted(tmp_path, monkeypatch):
    monkeypatch.setattr(HostEvent, "hold", True)
    rec = Recorder(tmp_path / "a.safetensors", dcp_size=2)
    rec._device.use_host_ring(4 * _slot_words(300) + 8)
    for i in range(3):
        assert rec.observe(step=i, site="x", rank=0, seq_lens=torch.full((300,), i, dtype=torch.int32),
                           num_reqs=300, num_reqs_padded=300) == i
    with rec._lock, pytest.warns(RuntimeWarning, match="cannot be read"):
        rec._harvest.abandon(RuntimeError("device lost"))
    assert rec.dropped == 3 and not rec._device.ring.pending and not rec._device.ring.fences
    rec.close()
    assert read_dump(tmp_path / "a.safetensors").n == 0


@hostring
@pytest.mark.kernel
def test_settle_names_the_oldest_in_flight_and_rows_come_from_the_copies(tmp_path, monkeypatch):
    """Before a file the writer settles what is in flight: nothing in flight, None; held launches, the oldest index
    (its fence recorded); once they land, their rows from the copies, equal to what was observed."""
    monkeypatch.setattr(HostEvent, "hold", True)
    rec = Recorder(tmp_path / "s.safetensors", dcp_size=2)
    rec._device.use_host_ring(1 << 14)
    h = rec._harvest
    with rec._lock:
        assert h.settle(wait=False) is None
    seqs = [torch.arange(i, i + 5, dtype=torch.int32) for i in range(3)]
    for i, s in enumerate(seqs):
        assert rec.observe(step=i, site="x", rank=0, seq_lens=s, num_reqs=5, num_reqs_padded=5) == i
    with rec._lock:
        assert h.settle(wait=False) == 0 and h.ring.fences  # (held: still in flight, fenced)
        monkeypatch.setattr(HostEvent, "hold", False)
        assert h.settle(wait=True) is None and not h.ring.pending
        rows = h.rows([e[2] for e in rec._writer._kept])
    assert [r[0].tolist() for r in rows] == [s.tolist() for s in seqs]
    rec.discard()
