"""The Recorder's writer (writer.py): rollover, one recording per path, no file replaced that another wrote,
the columns pack() writes, a rollover waiting for the device values of its file, the size cap."""

import warnings

import numpy as np
import pytest
import torch
from conftest import hostring, obs

from dcptool.dump import DumpConfig, open_dumps, pack, read_dump
from dcptool.engine.recorder.record import Recorder
from dcptool.engine.snapshot.ring import HostEvent


def test_rollover_numbers_files_and_rebases_parents(tmp_path):
    with Recorder(tmp_path / "run.safetensors", dcp_size=2, rollover=3) as rec:
        for k in range(7):
            rec.observe(step=k, site="ubatch" if k % 2 else "attn_metadata", rank=0, seq_lens=[k + 1],
                        num_reqs=1, num_reqs_padded=1, dcp_local_seq_lens=[(k + 2) // 2],
                        parent=k - 1 if k % 2 else None)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["run.00000.safetensors", "run.00001.safetensors", "run.00002.safetensors"]
    parents = [read_dump(tmp_path / n).columns.get("obs.parent") for n in names]
    # obs 3's parent (2) is in the first file: unknown (-1); obs 5's parent (4) is in its own file;
    # the last file knows no parent at all, so it has no obs.parent column
    assert [p.tolist() for p in parents[:2]] == [[-1, 0, -1], [-1, -1, 1]] and parents[2] is None
    d = open_dumps([str(tmp_path / n) for n in names])
    assert d.n == 7 and d.config.sites == ("attn_metadata", "ubatch")


def test_refuses_an_earlier_recording_without_force(tmp_path):
    Recorder(tmp_path / "r.safetensors", dcp_size=2).close()
    with pytest.raises(FileExistsError):
        Recorder(tmp_path / "r.safetensors", dcp_size=2)
    Recorder(tmp_path / "r.safetensors", dcp_size=2, force=True).close()


def test_recorder_writes_the_columns_pack_writes(tmp_path):
    """Both writers go through dump.columns(): the same observations, the same columns."""
    o = [obs(step=0), obs(step=1, view=None, ubatch=0, parent=0, req_start=0, tok_start=0, tok_stop=2,
                          query_start_loc=[0, 1, 2, 2, 2], buffer=7, graph=3),
         obs(step=2, site="dummy", kv_pages=[1, 2, 0, 0])]
    _, want = pack(o, DumpConfig(dcp_size=2, page_size=16))
    with Recorder(tmp_path / "r.safetensors", dcp_size=2, page_size=16) as rec:
        for x in o:
            rec.observe(**{k: v for k, v in x.__dict__.items()})
    got = read_dump(tmp_path / "r.safetensors").columns
    assert sorted(got) == sorted(want)
    for k in want:
        assert np.array_equal(got[k], want[k]), k


# --------------------------------------------------------------------------------------------
# No silent loss: one recording per path, threads, scalars that are not integers

CHILD = """
import sys, warnings
import numpy as np
from dcptool.engine.recorder.record import Recorder
warnings.simplefilter("always")
r = Recorder(sys.argv[1], 2, force=True)  # as the vLLM plugin: force, an engine is not stopped for old files
for i in range(5):
    r.observe(step=100 + i, site="child", rank=1, seq_lens=np.array([i + 1], np.int32), num_reqs=1, num_reqs_padded=1)
print(r.close()[0])
"""


def test_two_processes_on_one_path_both_keep_their_recording(tmp_path):
    """While this process records to run.safetensors, a second process (force=True, like the vLLM
    plugin) recording to the same path exits 0 as before, but into its own file and with a warning;
    both recordings are complete (today one of them was gone)."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    path = tmp_path / "run.safetensors"
    rec = Recorder(path, dcp_size=2)
    rec.observe(step=0, site="parent", rank=0, seq_lens=[7], num_reqs=1, num_reqs_padded=1)
    p = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    other = tmp_path / p.stdout.strip().rsplit("/", 1)[-1]
    assert other.name.startswith("run.p") and other.name.endswith(".safetensors") and other != path
    assert "is being recorded by another Recorder" in p.stderr and other.name in p.stderr
    assert rec.close() == [path] and rec.path == path
    mine, theirs = read_dump(path), read_dump(other)
    assert mine.n == 1 and mine.config.sites == ("parent",)
    assert theirs.n == 5 and theirs["obs.step"].tolist() == [100, 101, 102, 103, 104]


def test_second_recorder_in_one_process_is_separated_and_the_name_is_free_after_close(tmp_path):
    path = tmp_path / "r.safetensors"
    a = Recorder(path, dcp_size=2)
    with pytest.warns(RuntimeWarning, match="being recorded by another Recorder"):
        b = Recorder(path, dcp_size=2, force=True)
    assert b.path != path and b.requested_path == path and b.path.parent == tmp_path
    a.observe(step=0, site="a", rank=0, seq_lens=[1], num_reqs=1, num_reqs_padded=1)
    b.observe(step=0, site="b", rank=0, seq_lens=[2], num_reqs=1, num_reqs_padded=1)
    b.close()
    a.close()
    assert read_dump(path).config.sites == ("a",) and read_dump(b.path).config.sites == ("b",)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nobody holds the path now: no separation, no warning
        Recorder(path, dcp_size=2, force=True).close()
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted(["r.safetensors", b.path.name])  # no lock files


@pytest.mark.parametrize("end", ["close", "discard"])
def test_the_name_is_free_after_close_or_discard(tmp_path, end):
    path = tmp_path / "r.safetensors"
    a = Recorder(path, dcp_size=2)
    a.observe(step=0, site="a", rank=0, seq_lens=[1], num_reqs=1, num_reqs_padded=1)
    getattr(a, end)()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a discarded recording holds its name no longer than a closed one
        b = Recorder(path, dcp_size=2, force=True)
    assert b.path == path
    b.close()


def test_a_file_someone_else_wrote_is_never_replaced_at_a_write(tmp_path):
    """Checked at every write, not only at construction: a file that appeared at our next target
    (a writer that is no Recorder) stays, and our observations go to a separate name."""
    from dcptool.dump import write_observations

    path = tmp_path / "run.safetensors"
    rec = Recorder(path, dcp_size=2, rollover=2)
    for k in range(2):
        rec.observe(step=k, site="mine", rank=0, seq_lens=[k + 1], num_reqs=1, num_reqs_padded=1)
    rec.flush()  # (the rolled file is written on the Recorder's thread)
    assert rec.files == [tmp_path / "run.00000.safetensors"]
    write_observations(tmp_path / "run.00001.safetensors", [obs(step=9, site="theirs")], DumpConfig(dcp_size=2))
    with pytest.warns(RuntimeWarning, match=r"run\.00001\.safetensors was written by another writer"):
        for k in range(2, 5):
            rec.observe(step=k, site="mine", rank=0, seq_lens=[k + 1], num_reqs=1, num_reqs_padded=1)
        rec.flush()
    files = rec.close()
    assert read_dump(tmp_path / "run.00001.safetensors").config.sites[0] == "theirs"  # untouched
    assert files[0].name == "run.00000.safetensors" and all(f.name.startswith("run.p") for f in files[1:])
    d = open_dumps(files)
    assert d.n == 5 and sorted(d["obs.step"].tolist()) == [0, 1, 2, 3, 4] and rec.write_errors == 0


@hostring
@pytest.mark.kernel
def test_rollover_waits_for_the_slots_of_its_file(tmp_path, monkeypatch):
    monkeypatch.setattr(HostEvent, "hold", True)
    rec = Recorder(tmp_path / "r.safetensors", dcp_size=2, rollover=3)
    rec._device.use_host_ring()
    for i in range(10):
        rec.observe(step=i, site="x", rank=0, seq_lens=torch.tensor([i], dtype=torch.int32), num_reqs=1,
                    num_reqs_padded=1)
    assert rec.files == []  # their values are still in flight: the write waits, the engine does not
    monkeypatch.setattr(HostEvent, "hold", False)
    for i in range(10, 80):
        rec.observe(step=i, site="x", rank=0, seq_lens=torch.tensor([i], dtype=torch.int32), num_reqs=1,
                    num_reqs_padded=1)
    rec.flush()
    assert len(rec.files) >= 2
    files = rec.close()
    d = open_dumps(files)
    assert d.n == 80 and d["rows.seq_lens"].tolist() == list(range(80)) and rec.write_errors == 0


# --------------------------------------------------------------------------------------------
# The size cap: max_bytes=, DCPTOOL_RECORD_MAX_GB in the plugin


def _observe_n(rec, n: int, start: int = 0) -> list[int]:
    return [rec.observe(step=k, site="attn_metadata", rank=0, seq_lens=np.full(64, k + 1), num_reqs=64,
                        num_reqs_padded=64, dcp_local_seq_lens=np.full(64, k)) for k in range(start, start + n)]


def test_the_size_cap_stops_at_a_rollover_and_says_so_once(tmp_path):
    """Past max_bytes the recorder writes what it holds as its last file (dcptool.capped in its metadata, shown by
    inspect), warns once and records nothing more, counting what it refuses; earlier files carry no marker."""
    from io import StringIO

    from rich.console import Console

    from dcptool.dump import describe
    from dcptool.report.text import inspect_json, render_inspect

    per = 64 * 4 * 2 + 100  # (the writer's estimate of one observation: its rows and ~100 bytes of scalars)
    rec = Recorder(tmp_path / "run.safetensors", dcp_size=2, rollover=10, max_bytes=25 * per)
    with pytest.warns(RuntimeWarning, match="size cap") as caught:
        got = _observe_n(rec, 50)
    assert len([w for w in caught if "size cap" in str(w.message)]) == 1
    assert got == list(range(30)) + [-1] * 20 and rec.capped == 20 and rec.dropped == 0 and len(rec) == 30
    files = rec.close()
    assert [f.name for f in files] == [f"run.0000{i}.safetensors" for i in range(3)] and rec.capped == 20
    assert [read_dump(f).capped for f in files] == [[None], [None], [25 * per]]
    d = open_dumps([str(f) for f in files])
    assert d.n == 30 and d.capped == [None, None, 25 * per] and d["obs.step"].tolist() == list(range(30))
    info = describe(d)
    assert info.capped == 25 * per and '"capped": ' + str(25 * per) in inspect_json(info)
    out = StringIO()
    render_inspect(info, Console(file=out, width=200))
    assert f"stopped at its size cap of {25 * per:,} bytes" in out.getvalue()
    assert "capped" not in inspect_json(describe(read_dump(files[0])))  # (absent unless it stopped)


def test_the_size_cap_without_rollover_checks_every_1024_observations(tmp_path):
    with pytest.warns(RuntimeWarning, match="size cap"):
        with Recorder(tmp_path / "one.safetensors", dcp_size=2, max_bytes=1) as rec:
            got = _observe_n(rec, 1100)
            with pytest.raises(ValueError, match="max_bytes"):
                Recorder(tmp_path / "x.safetensors", dcp_size=2, max_bytes=0)
    assert got == list(range(1024)) + [-1] * 76 and rec.capped == 76
    assert rec.files == [tmp_path / "one.safetensors"] and read_dump(rec.files[0]).n == 1024
    assert read_dump(rec.files[0]).capped == [1]
    with pytest.warns(RuntimeWarning, match="after close"):
        assert rec.observe(step=0, site="x", rank=0, seq_lens=[1], num_reqs=1, num_reqs_padded=1) == -1
    assert rec.capped == 76 and rec.dropped == 1  # after close(): dropped, as before


@hostring
@pytest.mark.kernel
def test_the_size_cap_on_the_device_path(tmp_path):
    """The device path (fast and general) stops too: the slots in flight land in the last file, later observations
    are refused without a launch."""
    rec = Recorder(tmp_path / "dev.safetensors", dcp_size=2, rollover=8, max_bytes=1)
    ring = rec._device.use_host_ring()
    seq = torch.arange(1, 9, dtype=torch.int32)
    kw = dict(site="attn_metadata", rank=0, seq_lens=seq, num_reqs=8, num_reqs_padded=8, dcp_local_seq_lens=seq // 2)
    with pytest.warns(RuntimeWarning, match="size cap"):
        got = [rec.observe(step=k, **kw) for k in range(12)]
    got.append(rec.observe(step=12, **kw, positions=torch.arange(3), slot_mapping=torch.arange(3)))
    assert got == list(range(8)) + [-1] * 5 and rec.capped == 5 and not ring.pending
    files = rec.close()
    d = read_dump(files[0])
    assert len(files) == 1 and d.n == 8 and d.capped == [1] and d.seq_lens_of(7).tolist() == list(range(1, 9))
