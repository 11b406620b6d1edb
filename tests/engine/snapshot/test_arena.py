"""The harvest's chunks (arena.py): ready chunks come with their pages touched, written chunks come back only when
nothing refers to them, and a rolling recording through the ring reuses them with every value intact."""

import time

import numpy as np
import pytest
import torch
from conftest import hostring

from dcptool.dump import open_dumps
from dcptool.engine.recorder.record import Recorder
from dcptool.engine.snapshot import arena, landed
from dcptool.engine.snapshot.arena import ARENA_WORDS, Chunks, unused


def _ready(pool: Chunks, n: int) -> None:
    t0 = time.monotonic()
    while len(pool._ready) < n and time.monotonic() - t0 < 10:
        time.sleep(0.01)
    assert len(pool._ready) == n


def test_the_pool_keeps_spare_chunks_ready_and_takes_back_written_ones():
    pool = Chunks(spare=2)
    first = pool.take()  # (none ready yet: allocated here)
    assert first.dtype == np.int32 and first.size == ARENA_WORDS and pool.fresh == 1
    _ready(pool, 2)
    a = pool.take()
    assert pool.fresh == 1 and (a[::1024] == 0).all()  # a ready one: every page touched by the thread
    _ready(pool, 2)
    pool.give(first)
    pool.give(np.empty(10, np.int32))  # not a chunk: dropped
    assert len(pool._ready) == 3 and pool.recycled == 1
    for _ in range(3):
        pool.give(np.empty(ARENA_WORDS, np.int32))
    assert len(pool._ready) == 4  # at most twice `spare` kept


def test_a_chunk_with_a_view_left_is_not_unused():
    chunks = [np.empty(100, np.int32), np.empty(100, np.int32)]
    view = chunks[0][3:9]
    assert [c is chunks[1] for c in unused(chunks)] == [True]
    del view
    assert len(unused(chunks)) == 2
    other = chunks[1]  # (one more reference, e.g. the arena in use)
    assert len(unused(chunks)) == 1 and len(unused(chunks, held=1)) == 2 and other is chunks[1]


@hostring
@pytest.mark.kernel
def test_a_rolling_recording_reuses_its_chunks_and_keeps_every_value(tmp_path, monkeypatch):
    """Small chunks (2,048 words), a ring that wraps, a file every 12 observations: the harvest's chunks come back
    after each write and are used again, and every file holds what the host path records."""
    pool = Chunks(spare=1)
    monkeypatch.setattr(arena, "ARENA_WORDS", 2048)
    monkeypatch.setattr(landed, "ARENA_WORDS", 2048)
    monkeypatch.setattr(landed, "CHUNKS", pool)
    a = Recorder(tmp_path / "a.safetensors", dcp_size=2, rollover=12)
    b = Recorder(tmp_path / "b.safetensors", dcp_size=2, rollover=12)
    b._device.use_host_ring(4096)
    rng = np.random.default_rng(5)
    for i in range(60):
        rows = int(rng.integers(1, 300))
        seq = torch.from_numpy(rng.integers(0, 1 << 20, rows).astype(np.int32))
        kw = dict(step=i, site="attn_metadata", rank=i % 2, seq_lens=seq, num_reqs=rows, num_reqs_padded=rows,
                  dcp_local_seq_lens=seq // 2)
        assert a.observe(**kw) == b.observe(**kw) == i
    fa, fb = a.close(), b.close()
    assert len(fa) >= 5 and len(fb) >= 5 and pool.recycled >= 3  # (a rolled file may hold a few in flight more)
    da, db = open_dumps(fa), open_dumps(fb)
    assert da.n == db.n == 60
    assert all(np.array_equal(np.asarray(da.columns[k]), np.asarray(db.columns[k])) for k in da.columns
               if k != "obs.buffer")
