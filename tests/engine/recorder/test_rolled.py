"""Rolled files written on the Recorder's background thread (rolled.py): observe() does not wait for the write,
a failed write keeps its observations and is retried, and the files are those of an inline recording."""

import errno
import threading

import numpy as np
import pytest

import dcptool.engine.recorder.writer as writer
from dcptool.dump import WriteError, open_dumps, read_dump
from dcptool.engine.recorder.record import Recorder


def _observe(rec, rng, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        rows = int(rng.integers(1, 40))
        seq = rng.integers(1, 1 << 16, rows).astype(np.int32)
        parent = int(rng.integers(0, i)) if i and rng.random() < 0.5 else None
        assert rec.observe(step=i, site=f"s{i % 3}", rank=i % 2, seq_lens=seq, num_reqs=rows, num_reqs_padded=rows,
                           dcp_local_seq_lens=seq // 2, parent=parent, positions=np.arange(rows),
                           slot_mapping=np.arange(rows)[None]) == i


def test_a_rollover_does_not_wait_for_its_write(tmp_path, monkeypatch):
    """The observe() that rolls over returns while the write is blocked; later observations keep coming (another
    rollover is handed over behind it); close() waits and returns every file, in order."""
    started, go, real = threading.Event(), threading.Event(), writer.write_dump

    def blocked(*a, **k):
        started.set()
        assert go.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(writer, "write_dump", blocked)
    rec = Recorder(tmp_path / "r.safetensors", dcp_size=2, rollover=5)
    rng = np.random.default_rng(0)
    _observe(rec, rng, 5)
    assert started.wait(30) and rec.files == []  # the write is under way, observe() returned
    _observe(rec, rng, 7, start=5)
    assert rec.files == [] and len(rec) == 12
    go.set()
    files = rec.close()
    assert [f.name for f in files] == [f"r.0000{i}.safetensors" for i in range(3)]
    assert [read_dump(f).n for f in files] == [5, 5, 2] and open_dumps(files)["obs.step"].tolist() == list(range(12))


def test_a_failed_background_write_keeps_its_observations(tmp_path, monkeypatch):
    """Disk full on the thread: warned once (at flush() or the next rollover), retried at the next rollover, kept in
    memory; close() raises WriteError naming the file while it still fails, and a later close() writes them."""
    full, real = [True], writer.write_dump

    def write(*a, **k):
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(writer, "write_dump", write)
    rec = Recorder(tmp_path / "r.safetensors", dcp_size=2, rollover=4)
    rng = np.random.default_rng(1)
    with pytest.warns(RuntimeWarning, match="could not write") as caught:
        _observe(rec, rng, 4)
        rec.flush()
        _observe(rec, rng, 5, start=4)  # the next rollover retries the first file, then writes none behind it
        rec.flush()
    assert len(caught) == 1 and rec.files == [] and rec.write_errors >= 2
    with pytest.raises(WriteError, match=r"r\.00000\.safetensors.*No space left.*9 observations kept"):
        rec.close()
    full[0] = False
    files = rec.close()
    assert [f.name for f in files] == [f"r.0000{i}.safetensors" for i in range(3)]
    assert [read_dump(f).n for f in files] == [4, 4, 1] and open_dumps(files)["obs.step"].tolist() == list(range(9))


@pytest.mark.parametrize("seed", range(3))
def test_background_files_equal_an_inline_recording(tmp_path, monkeypatch, seed):
    """Seeded observations (parents across files, sites first seen late) over several rollovers, the writes slowed
    at random: the files hold what the same observations written inline give, file for file."""
    real, delays = writer.write_dump, np.random.default_rng(seed)

    def slow(*a, **k):
        threading.Event().wait(float(delays.random()) * 0.01)
        return real(*a, **k)

    got = []
    for inline in (True, False):
        rec = Recorder(tmp_path / f"{inline}.safetensors", dcp_size=2, rollover=7)
        rec._writer._rolled.sync = inline
        if not inline:
            monkeypatch.setattr(writer, "write_dump", slow)
        _observe(rec, np.random.default_rng(seed), 40)
        got.append([read_dump(f) for f in rec.close()])
    (a, b) = got
    assert len(a) == len(b) == 6
    for x, y in zip(a, b):
        assert x.config == y.config and x.n == y.n
        assert sorted(x.columns) == sorted(y.columns)
        for k in x.columns:
            assert np.array_equal(x.columns[k], y.columns[k]), k
