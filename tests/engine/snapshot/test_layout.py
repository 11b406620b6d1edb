"""A snapshot slot's layout (layout.py): a row field of the observation is a section, the kernels' constants have
one home, and a harvested slot gives its rows."""

import numpy as np
import pytest
import torch
from conftest import hostring

from dcptool.dump import Record
from dcptool.dump.observation import ROW_TABLE, ROWS, TOKENS, Field
from dcptool.engine.arguments import Groups, scalars
from dcptool.engine.recorder.record import Recorder
from dcptool.engine.snapshot import device
from dcptool.engine.snapshot.layout import (
    ARGS_NEG,
    ARGS_SECTIONS,
    ENTRY,
    FIXED,
    HOST_ROWS,
    MAX_SECTIONS,
    POS,
    SECTIONS,
    SGRP,
    SLOT,
    head_struct,
    layout,
    slot_rows,
)


def test_the_sections_are_the_tables_row_fields():
    assert SECTIONS + HOST_ROWS == ROW_TABLE and len(SECTIONS) <= MAX_SECTIONS
    assert [s.section for s in SECTIONS] == ["seq", "dcp", "qsl", "kv", "dqsl", "tot", "pos", "slot", "sgrp", "ctx",
                                             "gsl", "vrl", "topk"]
    assert not any(f.device for f in HOST_ROWS)  # (host values, held beside the slot: never in its header)
    assert (POS, SLOT, SGRP) == (6, 7, 8) and ARGS_SECTIONS == 8
    assert ARGS_NEG == (1 << 8) | (1 << 13) | (1 << 14)  # seq_lens, dcp_tot_seq_lens, positions: no negatives
    L = layout(SECTIONS)
    assert L.nsec == 13 and L.head.size == 4 * (FIXED + ENTRY * 13) and L.plus1 == (2,) and L.sized == (3,)
    assert L.needs == ((3, "page_size"),) and L.modes == (2, 0, 0, 0, 0, 2, 2, 0, 0, 2, 2, 0, 2)
    assert L.ksec == 13 << 16 | ARGS_NEG and L.fast_pad == (None,) * 10


@pytest.mark.parametrize("tokens, groups", [(0, 1), (1, 1), (129, 2), (1000, 3)])
def test_a_slot_gives_its_rows_and_builds_the_slot_entries(tokens, groups):
    """slot_rows: the sections of the slot back to back (an absent one None, a host-held one the host's), and slot
    sections snapshotted raw turned into dump.slot_entries' entries (the positions tiled per group)."""
    rng = np.random.default_rng(tokens)
    seq, pos = rng.integers(0, 99, 5).astype(np.int32), rng.integers(0, 99, tokens).astype(np.int32)
    sm = rng.integers(-1, 99, groups * tokens).astype(np.int32)
    k = len(SECTIONS)
    counts = [5, -1, -1, -1, -1, -1, tokens, sm.size, -1, -1, -1, -1, -1]
    blk = np.zeros(FIXED + ENTRY * k + 5 + tokens + sm.size, np.int32)
    head_struct(k).pack_into(blk, 0, 1, 1, 5, 5, k, 0, blk.size, 0, *[x for n in counts for x in (0, n, 0)])
    blk[FIXED + ENTRY * k:] = np.concatenate([seq, pos, sm])
    host = [None] * k
    host[2] = np.arange(6, dtype=np.int32)
    host[SGRP] = Groups(range(groups))
    rows = slot_rows(blk, 0, host)
    assert np.array_equal(rows[0], seq) and rows[1] is None and np.array_equal(rows[2], host[2])
    assert np.array_equal(rows[POS], np.tile(pos, groups)) and np.array_equal(rows[SLOT], sm)
    assert rows[SGRP].tolist() == np.repeat(np.arange(groups), tokens).tolist()
    assert rows[k:] == (None,) * len(HOST_ROWS)  # (the host values: none held)
    held = slot_rows(blk, 0, [*host, *(np.arange(j + 1, dtype=np.int32) for j in range(len(HOST_ROWS)))])
    assert [x.tolist() for x in held[k:]] == [list(range(j + 1)) for j in range(len(HOST_ROWS))]


@hostring
@pytest.mark.kernel
def test_a_fifth_section_is_a_table_entry_not_kernel_code(tmp_path, monkeypatch):
    """Adding a row field to the device path: one more section (here two past the table's own: one value per
    token with negatives forbidden, and one value per seq_lens row); the same kernel copies them, and their length
    rules apply. (The table's last sections make room where the header has none for two more.)"""
    base = SECTIONS[:MAX_SECTIONS - 2]
    K = len(base)
    monkeypatch.setattr(device, "SECTIONS", (*base, Field("extra_tokens", TOKENS, "I32", "rows.x1", nonneg=True,
                                                              device=True, section="x1"),
                                             Field("extra_rows", ROWS, "I32", "rows.x2", device=True, section="x2")))
    rec = Recorder(tmp_path / "f.safetensors", dcp_size=2)
    rec._device.use_host_ring(1 << 16)  # (large enough that no observation here is fenced at once)
    assert rec._device._nsec == K + 2
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
        rec._harvest.harvest(wait=True)
    assert rec.dropped == 1  # the negative value, found at harvest
    first, blk, lo = rec._harvest.landed.runs[0]
    rows = slot_rows(blk, 0, None)
    assert first == 0 and len(rows) == K + 2 + len(HOST_ROWS) and rows[1] is None and rows[3] is None
    assert all(r is None for r in rows[4:K])
    assert rows[0].tolist() == [5, 9, 0] and rows[2].tolist() == [0, 1, 2, 2]
    assert rows[K].tolist() == list(range(0, 33, 3)) and rows[K + 1].tolist() == [7, 8, 9]
    rec.discard()
