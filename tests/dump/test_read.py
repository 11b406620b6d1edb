"""dump/read.py: one file read (one copy in memory, or one mapping when bounded), its descriptor closed once read,
and the Dump's accessors."""

import json
import os

import numpy as np
from conftest import obs, write

from dcptool.dump import open_dumps, read_dump


def test_round_trip_one_read_or_one_mapping(tmp_path):
    """Read: every column is a view of one in-memory copy of the file (no mapping a truncation could
    fault). Bounded (a dump larger than RAM): views of one mapping of the whole file."""
    import mmap

    p = write(tmp_path / "a.safetensors", [obs(step=s, rank=r) for s in range(4) for r in range(2)])
    d = read_dump(p)
    assert d.n == 8 and d.config.dcp_size == 2 and d.config.sites == ("attn_metadata",)
    assert not d.maps and not d.bounded
    assert len({id(d[k].base) for k in d.columns if d[k].size}) == 1
    copy = d["rows.seq_lens"].base
    assert isinstance(copy, np.ndarray) and copy.base is None and copy.dtype == np.uint8  # our own copy
    b = read_dump(p, bounded=True)
    assert b.bounded and set(b.maps) == {k for k in b.columns if b[k].size}
    assert {id(m[0]) for m in b.maps.values()} == {id(b[k].base.obj) for k in b.maps}
    assert isinstance(b["obs.step"].base.obj, mmap.mmap)
    assert all(np.array_equal(b[k], d[k]) for k in d.columns)
    assert d.seq_lens_of(3).tolist() == [17, 25, 0, 0]
    assert d.dcp_of(3).tolist() == [9, 13, 0, 0] if d["obs.rank"][3] == 0 else [8, 12, 0, 0]


def _rollover_dir(tmp_path, n: int):
    """n rollover files of 2 observations each (copies of one small dump: the reader sees n files)."""
    import shutil

    d = tmp_path / "rec"
    d.mkdir()
    first = write(d / "run.00000.safetensors", [obs(step=0, rank=0), obs(step=0, rank=1, view=None)])
    for k in range(1, n):
        shutil.copyfile(first, d / f"run.{k:05d}.safetensors")
    return d


def test_2000_rollover_files_under_ulimit_256(tmp_path):
    """Each file's descriptor is closed once it is read: 2,000 files replay, inspect and diff with 256
    descriptors (a numpy memmap per column kept 11 per file: EMFILE after ~20 files)."""
    import resource
    import subprocess
    import sys

    from conftest import ROOT

    d = _rollover_dir(tmp_path, 2000)

    def run(*args):
        return subprocess.run([sys.executable, "-m", "dcptool", *args], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300,
                              preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)))

    r = run("replay", str(d), "--json")
    assert r.returncode == 1 and r.stderr == "", r.stderr[-2000:]
    s = json.loads(r.stdout.splitlines()[-1])
    assert s["observations"] == 4000 and s["by_rule"] == {"missing": 2000} and len(s["files"]) == 2000
    r = run("inspect", str(d), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["observations"] == 4000, r.stderr[-2000:]
    r = run("diff", str(d), str(d), "--json")
    assert r.returncode == 0 and json.loads(r.stdout.splitlines()[-1])["compared"] == 4000, r.stderr[-2000:]


def test_file_truncated_after_it_was_read_cannot_crash_the_replay(tmp_path):
    """Once read, a dump no longer depends on its file: truncated to 0 bytes (or rewritten) before the
    replay, the report is the one of what was read. A mapping would fault (SIGBUS) here: a subprocess."""
    import subprocess
    import sys

    from conftest import ROOT

    p = write(tmp_path / "run.safetensors", [obs(step=s, rank=s % 2, view=None if s == 7 else "auto")
                                             for s in range(5000)])
    script = f"""
import os, json
from dcptool.dump import open_dumps
from dcptool.check.replay import replay
d = open_dumps([{p!r}])
os.truncate({p!r}, 0)
res = replay(d, "torch")
print(json.dumps(res.by_rule()), d.n, int(d["rows.seq_lens"].sum()))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.split() == ['{"missing":', "1}", "5000", str(5000 * 42)]


def test_index_of_finds_an_observation_of_a_file_in_the_run(tmp_path):
    from conftest import obs, write

    a = write(tmp_path / "a.safetensors", [obs(step=1), obs(step=3)])
    b = write(tmp_path / "b.safetensors", [obs(step=2, rank=1)])
    d = open_dumps([a, b])  # end to end: a0, a1, b0
    assert [d.index_of(0, 0), d.index_of(1, 0), d.index_of(0, 1)] == [0, 2, 1]
    assert d.index_of(1, 1) is None and d.index_of(2, 0) is None
