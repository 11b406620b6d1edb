"""Nothing lost: the Recorder under SIGKILL and garbage values, writers on a full disk.

A recording process is killed with SIGKILL at random points (between observations, and at every
stage of an atomic write); what remains must read and replay, hold exactly the observations of
the files that were completed, and no temporary may ever replace a good file. A full disk (a tiny
tmpfs in a private mount namespace where we may mount one, else RLIMIT_FSIZE, which turns writes
past the limit into EFBIG) must give one clear error and leave the previous file untouched.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, cli, count_fuzz, obs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcptool.dump import (
    DumpConfig,
    DumpError,
    OutputExistsError,
    WriteError,
    atomic_write,
    open_dumps,
    read_dump,
    write_observations,
)
from dcptool.engine.recorder.record import Recorder

# The recording child: deterministic observations, so the parent knows exactly what each file holds.
GEN = '''
import numpy as np

def gen(i):
    """Observation i of the recording (a micro-batch every third, with its parent)."""
    rng = np.random.default_rng(i)
    nr = int(rng.integers(0, 6))
    nrp = nr + int(rng.integers(0, 3))
    seq = rng.integers(1, 5000, nrp).astype(np.int32)
    seq[nr:] = 0
    rank = i % 2
    span = 2
    local = (seq // span) + np.clip(seq % span - rank, 0, 1)
    local[nr:] = 0
    view = None if i % 7 == 3 else local.astype(np.int32)
    return dict(step=i // 4, site=("attn_metadata", "ubatch", "dummy")[i % 3], rank=rank, seq_lens=seq,
                num_reqs=nr, num_reqs_padded=nrp, dcp_local_seq_lens=view,
                ubatch=0 if i % 3 == 1 else -1, parent=i - 1 if i % 3 == 1 else None)
'''
CHILD = GEN + '''
import os, signal, sys, tempfile, time
import dcptool.dump.write as dump
from dcptool.engine.recorder.record import Recorder

def die(*_):
    os.kill(os.getpid(), signal.SIGKILL)

def main(path, rollover, kill_at, stage, force, sleep):
    """Record until observation kill_at; with a stage, die inside the write that follows it."""
    writes = [0]
    if stage == "after-mkstemp":
        real = tempfile.mkstemp
        def mkstemp(*a, **k):
            r = real(*a, **k)
            if writes[0] >= arm[0]:
                die()
            return r
        dump.tempfile.mkstemp = mkstemp
    elif stage == "mid-write":
        real_fdopen = os.fdopen
        class Half:
            def __init__(self, f): self.f = f
            def __enter__(self): return self
            def __exit__(self, *e): return self.f.__exit__(*e)
            def fileno(self): return self.f.fileno()
            def flush(self): self.f.flush()
            def write(self, b):
                if writes[0] >= arm[0]:
                    b = memoryview(b).cast("B")
                    self.f.write(b[: len(b) // 2]); self.f.flush(); die()
                return self.f.write(b)
        dump.os.fdopen = lambda *a, **k: Half(real_fdopen(*a, **k))
    elif stage in ("before-rename", "after-rename"):
        real_replace = os.replace
        def replace(a, b):
            if writes[0] >= arm[0] and stage == "before-rename":
                die()
            real_replace(a, b)
            if writes[0] >= arm[0]:
                die()
        dump.os.replace = replace
    arm = [10**9]
    r = Recorder(path, 2, sites=("attn_metadata", "ubatch", "dummy"), rollover=rollover or None, force=force)
    real_write = r._writer._rolled._write  # (a rolled file is written on the Recorder's thread)
    def counted(*a):
        real_write(*a)
        writes[0] += 1
    r._writer._rolled._write = counted
    i = 0
    while True:
        if i == kill_at:
            if not stage:
                die()
            arm[0] = writes[0]  # the next write dies at `stage`
        r.observe(**gen(i))
        if sleep:
            time.sleep(sleep)
        else:
            r.flush()  # killed between observations: once the files they rolled over are written
        i += 1
        if stage and i > kill_at + 2 * (rollover or 1) + 5:
            r.close()  # without rollover the only write is close()
            die()

main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5] == "1", float(sys.argv[6]))
'''


def _gen():
    ns: dict = {}
    exec(GEN, ns)
    return ns["gen"]


gen = _gen()


def record_child(path: Path, rollover: int, kill_at: int, stage: str = "", force: bool = False,
                 sleep: float = 0.0, timeout: float = 120) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(rollover), str(kill_at), stage,
                             "1" if force else "0", str(sleep)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def check_remains(d: Path, stem: str, rollover: int) -> int:
    """Every numbered file reads, they are numbered without gaps, each holds exactly `rollover`
    observations, equal to what the recording saw; returns how many observations survived."""
    files = sorted(d.glob(f"{stem}.*.safetensors"))
    assert [f.name for f in files] == [f"{stem}.{k:05d}.safetensors" for k in range(len(files))]
    for f in d.iterdir():  # anything else is a hidden temporary of the killed write, or its path's lock, never a dump
        assert f in files or (f.name.startswith(f".{stem}.") and f.name.endswith(".tmp")) or (
            f.name == f".{stem}.safetensors.lock"), f.name
    if not files:
        return 0
    dump = open_dumps(files)
    assert dump.n == rollover * len(files)
    rows = dump["obs.rows"]
    for i in range(dump.n):  # merged order is (step, file, index): steps rise with i here
        want = gen(i)
        assert int(dump["obs.step"][i]) == want["step"] and int(dump["obs.rank"][i]) == want["rank"]
        assert dump.site_name(i) == want["site"]
        assert np.array_equal(dump["rows.seq_lens"][rows[i] : rows[i + 1]], want["seq_lens"])
        v = dump.dcp_of(i)
        assert (v is None) == (want["dcp_local_seq_lens"] is None)
        if v is not None:
            assert np.array_equal(v, want["dcp_local_seq_lens"])
    return dump.n


def replay_clean(files: list[Path]) -> None:
    """What survived replays: the dumps hold correct views, so only `missing` (None views) is reported."""
    from dcptool.check.replay import replay

    res = replay(open_dumps(files), "torch")
    # (gen's two ranks record unrelated batches at one step: rank-agree, says so; not a damaged file)
    assert {f.rule for f in res.findings} <= {"missing", "rank-agree"}
    assert sum(f.rule == "missing" for f in res.findings) == sum(
        gen(i)["dcp_local_seq_lens"] is None for i in range(res.observations))


# --------------------------------------------------------------------------------------------
# SIGKILL


@pytest.mark.parametrize("kill_at", [0, 1, 6, 7, 13, 29, 44])
def test_sigkill_between_observations(kill_at, tmp_path):
    """Killed right before observation kill_at: every completed rollover file survives intact."""
    rollover = 7
    p = record_child(tmp_path / "run.safetensors", rollover, kill_at)
    p.wait(timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr.read().decode()
    n = check_remains(tmp_path, "run", rollover)
    assert n == kill_at // rollover * rollover
    if n:
        replay_clean(sorted(tmp_path.glob("run.*.safetensors")))
    count_fuzz("sigkill")


@pytest.mark.parametrize("stage", ["after-mkstemp", "mid-write", "before-rename", "after-rename"])
@pytest.mark.parametrize("kill_at", [3, 10])
def test_sigkill_inside_a_write(stage, kill_at, tmp_path):
    """Killed inside the atomic write of a rollover file: that file is complete or absent, never torn."""
    rollover = 4
    p = record_child(tmp_path / "run.safetensors", rollover, kill_at, stage)
    p.wait(timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr.read().decode()
    n = check_remains(tmp_path, "run", rollover)
    done = kill_at // rollover + 1  # files whose write started before the kill, the killed one included
    assert n == (done if stage == "after-rename" else done - 1) * rollover
    temps = [f for f in tmp_path.iterdir() if f.name.endswith(".tmp")]
    assert len(temps) == (0 if stage == "after-rename" else 1)  # the killed writer's, ignored by readers
    if n:
        replay_clean(sorted(tmp_path.glob("run.*.safetensors")))
    count_fuzz("sigkill")


@pytest.mark.parametrize("stage", ["after-mkstemp", "mid-write", "before-rename"])
def test_sigkill_while_replacing_a_good_file(stage, tmp_path):
    """A single-file recording (force=True over an earlier good one) killed inside close(): the
    earlier file is still there, byte for byte, and still reads."""
    target = tmp_path / "run.safetensors"
    write_observations(target, [obs(step=s) for s in range(3)], DumpConfig(dcp_size=2))
    before = target.read_bytes()
    p = record_child(target, 0, 5, stage, force=True)
    p.wait(timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr.read().decode()
    assert target.read_bytes() == before and read_dump(target).n == 3
    count_fuzz("sigkill")


@pytest.mark.parametrize("seed", range(6))
def test_sigkill_at_a_random_time(seed, tmp_path):
    """An outside SIGKILL at a random moment of a running recording (seeded delays), once its first rollover
    file exists: what it left is checked, never an empty directory (the child's start-up time varies)."""
    import time

    rollover = 5
    delay = float(np.random.default_rng(seed).uniform(0.0, 0.5))
    p = record_child(tmp_path / "run.safetensors", rollover, 10**9, sleep=0.002)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("run.*.safetensors")):
        if p.poll() is not None:
            pytest.fail(f"recorder exited early: {p.stderr.read().decode()}")
        if time.monotonic() > deadline:
            p.kill()
            pytest.fail("the recorder wrote no rollover file in 120 s")
        time.sleep(0.01)
    time.sleep(delay)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL
    n = check_remains(tmp_path, "run", rollover)
    assert n >= rollover  # at least the first file, complete
    replay_clean(sorted(tmp_path.glob("run.*.safetensors")))
    count_fuzz("sigkill")


def test_unclosed_recorder_is_written_at_exit(tmp_path):
    """A process that exits without close() (an exception, sys.exit) still leaves its recording."""
    target = tmp_path / "run.safetensors"
    code = GEN + textwrap.dedent(f"""
        from dcptool.engine.recorder.record import Recorder
        r = Recorder({str(target)!r}, 2)
        for i in range(9):
            r.observe(**gen(i))
        raise SystemExit(3)
    """)
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, timeout=120)
    assert p.returncode == 3, p.stderr.decode()
    assert read_dump(target).n == 9


# --------------------------------------------------------------------------------------------
# The Recorder never raises into the engine and never writes what cannot be read

GARBAGE = st.one_of(st.none(), st.integers(-(2**64), 2**64), st.sampled_from([1.5, "x", [1, 2], -1, 2**31]))
ARRAYS = st.one_of(
    st.none(),
    st.lists(st.integers(-(2**40), 2**40), max_size=6),
    st.lists(st.integers(0, 5000), max_size=6),
    st.sampled_from([np.array([1.5, 2.0]), np.array([[1, 2]]), np.array([2**40]), "abc", 7,
                     np.array([True, False]), np.array([3, 4], np.uint64)]),
)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(calls=st.lists(st.fixed_dictionaries({
    "step": st.one_of(st.integers(-3, 5), GARBAGE), "site": st.sampled_from(["a", "b", "", "x\ny", "\ud800", 5]),
    "rank": st.one_of(st.integers(-1, 3), GARBAGE), "seq_lens": ARRAYS,
    "num_reqs": st.one_of(st.integers(-1, 7), GARBAGE), "num_reqs_padded": st.one_of(st.integers(-1, 9), GARBAGE),
    "dcp_local_seq_lens": ARRAYS, "ubatch": st.integers(-3, 2), "parent": st.one_of(st.none(), st.integers(-2, 12)),
    "query_start_loc": ARRAYS, "kv_pages": ARRAYS, "graph": st.sampled_from([None, 0, 3, 4, -1, "capture", "eager"]),
    "buffer": st.one_of(st.none(), st.integers(-(2**64), 2**64)), "tok_stop": st.one_of(st.none(), GARBAGE),
}), max_size=12), rollover=st.sampled_from([None, 1, 3]), page=st.sampled_from([None, 16]))
def test_recorder_takes_anything_and_writes_only_readable_files(calls, rollover, page, tmp_path_factory):
    d = tmp_path_factory.mktemp("rec")
    r = Recorder(d / "run.safetensors", 2, page_size=page, rollover=rollover)
    got = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for kw in calls:
            got.append(r.observe(**kw))
    files = r.close()
    kept = [g for g in got if g >= 0]
    assert kept == list(range(len(kept))) and r.dropped == len(got) - len(kept) and len(r) == len(kept)
    assert open_dumps(files).n == len(kept)  # raises DumpError if anything unreadable was written
    count_fuzz("recorder")


def test_recorder_refuses_an_earlier_recording_unless_forced(tmp_path):
    base = tmp_path / "run.safetensors"
    r = Recorder(base, 2, rollover=2)
    for i in range(5):
        r.observe(**gen(i))
    assert [f.name for f in r.close()] == [f"run.{k:05d}.safetensors" for k in range(3)]
    with pytest.raises(OutputExistsError, match=r"run\.00000\.safetensors: exists"):
        Recorder(base, 2, rollover=2)
    r = Recorder(base, 2, rollover=2, force=True)  # replaces the whole earlier run, stale files too
    r.observe(**gen(0))
    assert [f.name for f in r.close()] == ["run.00000.safetensors"]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["run.00000.safetensors"]
    r = Recorder(tmp_path / "one.safetensors", 2)
    r.close()
    assert read_dump(tmp_path / "one.safetensors").n == 0  # an empty recording is still a valid dump
    with pytest.raises(OutputExistsError):
        Recorder(tmp_path / "one.safetensors", 2)
    with pytest.raises(DumpError, match="dcp_size must be >= 1"):
        Recorder(tmp_path / "bad.safetensors", 0)  # a bad config fails at once, not at close()


# --------------------------------------------------------------------------------------------
# Full disk

FSIZE_CHILD = GEN + '''
import json, os, resource, signal, sys, warnings
from dcptool.dump import WriteError, read_dump
from dcptool.engine.recorder.record import Recorder

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG instead
path, limit, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
out = {}
if mode == "close":
    r = Recorder(path, 2, force=True)
    for i in range(400):
        r.observe(**gen(i))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
        r.close()
    except WriteError as e:
        out["error"] = str(e)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    r.close()  # room again: the kept observations are written now
    out["after"] = read_dump(path).n
else:  # rollover: a rollover write fails inside observe(), which must not raise
    r = Recorder(path, 2, rollover=50)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for i in range(120):
            assert r.observe(**gen(i)) == i
        r.flush()  # (the rolled files are written on the Recorder's thread)
    out["warnings"] = [str(x.message) for x in w]
    out["write_errors"] = r.write_errors
    out["files_while_full"] = len(r.files)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    out["files"] = [str(f) for f in r.close()]
print(json.dumps(out))
'''


def _fsize_child(path: Path, limit: int, mode: str) -> dict:
    p = subprocess.run([sys.executable, "-c", FSIZE_CHILD, str(path), str(limit), mode], capture_output=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert p.returncode == 0, p.stderr.decode()
    return json.loads(p.stdout)


def test_full_disk_at_close_keeps_the_old_file_and_the_data(tmp_path):
    """RLIMIT_FSIZE: close() fails with one clear error, the previous file survives byte for byte,
    no temporary is left, and a later close() writes everything."""
    target = tmp_path / "run.safetensors"
    write_observations(target, [obs(step=s) for s in range(3)], DumpConfig(dcp_size=2))
    before = target.read_bytes()
    # the limit is checked in the child only after its observations are made; the old file is small
    out = _fsize_child(target, 4096, "close")
    err = out["error"]
    assert err.startswith(f"{target}: cannot write: File too large") and "\n" not in err, err
    assert "previous file is unchanged" in err and "400 observations kept" in err
    assert out["after"] == 400
    assert [f.name for f in tmp_path.iterdir()] == ["run.safetensors"]  # no temporary behind
    assert read_dump(target).n == 400 and target.read_bytes() != before


def test_full_disk_at_rollover_does_not_raise_and_loses_nothing(tmp_path):
    out = _fsize_child(tmp_path / "run.safetensors", 2048, "rollover")
    assert out["files_while_full"] == 0 and out["write_errors"] >= 1
    assert len(out["warnings"]) == 1 and "could not write" in out["warnings"][0]
    assert open_dumps(out["files"]).n == 120
    assert not [f for f in tmp_path.iterdir() if f.name.endswith(".tmp")]


def _limit_fsize(limit: int):
    def pre():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    return pre


def test_full_disk_for_a_writing_command(tmp_path):
    """`replay --html OUT --force` past RLIMIT_FSIZE: exit 2, one line naming OUT, the old OUT intact,
    no temporary left."""
    dump = tmp_path / "run.safetensors"
    shutil.copy(ROOT / "samples" / "handmade.safetensors", dump)
    out = tmp_path / "report.html"
    out.write_text("the previous report\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    r = subprocess.run([sys.executable, "-m", "dcptool", "replay", str(dump), "--html", str(out), "--force"],
                       capture_output=True, text=True, env=env, timeout=300, preexec_fn=_limit_fsize(8192))
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"dcptool replay: --html: {out}: cannot write: File too large (the previous file is unchanged)\n"
    assert out.read_text() == "the previous report\n"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["report.html", "run.safetensors"]


TMPFS_CHILD = GEN + '''
import json, os, sys
from dcptool.dump import DumpConfig, WriteError, read_dump, write_observations
from dcptool.engine.recorder.record import Recorder

d = sys.argv[1]
target = os.path.join(d, "run.safetensors")
r = Recorder(target, 2)
for i in range(20):
    r.observe(**gen(i))
r.close()
before = open(target, "rb").read()
r = Recorder(target, 2, force=True)
for i in range(20000):  # far more than the tmpfs holds
    r.observe(**gen(i))
out = {}
try:
    r.close()
except WriteError as e:
    out["error"] = str(e)
out["intact"] = open(target, "rb").read() == before and read_dump(target).n == 20
out["files"] = sorted(os.listdir(d))
print(json.dumps(out))
'''


def test_full_tmpfs(tmp_path):
    """A real full filesystem: a 256 kB tmpfs mounted in a private mount namespace (needs root or
    user namespaces; the mount vanishes with the process)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1): cannot mount a private tmpfs here (RLIMIT_FSIZE tests cover the logic)")
    d = tmp_path / "small"
    d.mkdir()
    script = tmp_path / "child.py"
    script.write_text(TMPFS_CHILD)
    flags = ["-m"] if os.geteuid() == 0 else ["-r", "-m"]
    probe = subprocess.run([unshare, *flags, "sh", "-c", f"mount -t tmpfs -o size=256k tmpfs {d}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a private namespace here: {probe.stderr.strip()}")
    r = subprocess.run([unshare, *flags, "sh", "-c", 'mount -t tmpfs -o size=256k tmpfs "$1" && exec "$2" "$3" "$1"',
                        "sh", str(d), sys.executable, str(script)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["error"].startswith(f"{d}/run.safetensors: cannot write: No space left on device"), out
    assert out["intact"] and out["files"] == [".run.safetensors.lock", "run.safetensors"], out  # (still recording)
    assert list(d.iterdir()) == []  # the tmpfs lived only in the child's namespace


# --------------------------------------------------------------------------------------------
# Writers: never an input, never an existing output without force, no temporaries on failure


def test_atomic_write_refuses_inputs_and_existing_outputs(tmp_path):
    src = tmp_path / "in.safetensors"
    src.write_bytes(b"input")
    alias = tmp_path / "alias.safetensors"
    alias.symlink_to(src)
    hard = tmp_path / "hard.safetensors"
    os.link(src, hard)
    for target in (src, alias, hard):  # the same file under any name, even with force
        with pytest.raises(WriteError, match="is also an input"):
            atomic_write(target, [b"x"], force=True, inputs=[src])
    with pytest.raises(OutputExistsError, match=r"exists \(use --force to overwrite\)"):
        atomic_write(src, [b"x"], force=False)
    assert src.read_bytes() == b"input"
    atomic_write(tmp_path / "new", [b"a", b"b"], force=False)
    assert (tmp_path / "new").read_bytes() == b"ab" and (tmp_path / "new").stat().st_mode & 0o777 == 0o644
    with pytest.raises(WriteError, match="cannot write: No such file or directory"):
        atomic_write(tmp_path / "no" / "such" / "dir", [b"x"])
    assert sorted(f.name for f in tmp_path.iterdir()) == ["alias.safetensors", "hard.safetensors",
                                                           "in.safetensors", "new"]


def test_atomic_write_no_clobber_is_atomic(tmp_path, monkeypatch):
    """force=False holds even when the output appears between the check and the rename (a racing writer)."""
    import dcptool.dump.write as dump

    target = tmp_path / "out"
    real = dump.tempfile.mkstemp

    def racing_mkstemp(*a, **k):
        target.write_bytes(b"the other writer's")
        return real(*a, **k)

    monkeypatch.setattr(dump.tempfile, "mkstemp", racing_mkstemp)
    with pytest.raises(OutputExistsError):
        atomic_write(target, [b"mine"], force=False)
    assert target.read_bytes() == b"the other writer's"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["out"]


def test_failed_chunk_leaves_no_temporary(tmp_path):
    """An error while producing the data (not only while writing it) removes the temporary too."""
    target = tmp_path / "out"
    target.write_bytes(b"old")

    def chunks():
        yield b"partial"
        raise RuntimeError("renderer failed")

    with pytest.raises(RuntimeError):
        atomic_write(target, chunks())
    assert target.read_bytes() == b"old" and sorted(f.name for f in tmp_path.iterdir()) == ["out"]


def test_writer_refuses_values_the_format_cannot_hold(tmp_path):
    """write_dump never wraps an int64 into int32 silently: the reader would see other numbers."""
    o = obs()
    o.seq_lens = np.array([2**31 + 5, 25, 0, 0], np.int64)
    with pytest.raises(DumpError, match=r"x.safetensors: rows.seq_lens: value 2147483653 does not fit I32"):
        write_observations(tmp_path / "x.safetensors", [o], DumpConfig(dcp_size=2))
    assert not list(tmp_path.iterdir())


def test_html_output_never_replaces_an_input(tmp_path):
    dump = tmp_path / "run.safetensors"
    shutil.copy(ROOT / "samples" / "handmade.safetensors", dump)
    before = dump.read_bytes()
    r = cli("replay", dump, "--html", dump, "--force")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "dcptool never modifies its input" in r.stderr
    assert dump.read_bytes() == before
