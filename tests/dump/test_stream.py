"""dump/stream.py: replay's streamed read (the scan follows the read): the one read's columns and findings, a slow
read, a bad or truncated file, no preadv, never an unread value."""

import os

import numpy as np
import pytest
from conftest import obs, write
from dump_cases import _bad, _set

from dcptool.dump import DumpError, files, read_dump, stream


def _replay_lines(d, backend="torch", **kw) -> list[str]:
    from dcptool.check.replay import replay

    return list(replay(d, backend, **kw).findings.json_lines())


@pytest.mark.parametrize("piece", [64, 4096, 1 << 20])
@pytest.mark.parametrize("seed", range(2))
def test_streamed_read_gives_the_one_reads_columns_and_findings(tmp_path, monkeypatch, piece, seed):
    """Pieces of any size (the scan's columns interleaved, the rest after them): every column as one read
    gives it, and the same findings from a replay on one thread and on background threads."""
    from conftest import random_dump

    import dcptool.check.scan as scan_mod

    monkeypatch.setattr(stream, "STREAM_PIECE", piece)
    monkeypatch.setattr(scan_mod, "CHUNK_ROWS", 1000)
    path = tmp_path / "r.safetensors"
    want = random_dump(path, np.random.default_rng(seed), 300, 4, 16)
    got = read_dump(path, stream=True)
    assert got.reader is not None and got.n == want.n
    for key in want.columns:
        assert np.array_equal(got[key], want[key]), key
    got.finish()
    assert got.reader is None and type(got.columns) is dict  # (plain columns once all is in)
    lines = _replay_lines(want)
    assert lines and _replay_lines(read_dump(path, stream=True)) == lines
    assert _replay_lines(read_dump(path, stream=True), bounded=True) == lines  # (one thread)


def test_the_scan_follows_a_slow_read(tmp_path, monkeypatch):
    """With a read held back (its second piece waits for the scan's first request) the scan's chunks go on while
    later rows are still being read (Dump.upto waits for its chunk alone), and the findings are those of one
    read."""
    import threading

    from conftest import random_dump

    import dcptool.check.scan as scan_mod
    import dcptool.dump as dump_mod

    monkeypatch.setattr(stream, "STREAM_PIECE", 2048)
    monkeypatch.setattr(scan_mod, "CHUNK_ROWS", 500)
    monkeypatch.setattr(scan_mod, "CHUNK_ROWS_THREADED", 500)  # (a many-core host scans on several threads)
    path = tmp_path / "r.safetensors"
    want = _replay_lines(random_dump(path, np.random.default_rng(7), 400, 4, 16))
    real_pread, real_upto = files.pread, dump_mod.Dump.upto
    ahead, asked, reads = [], threading.Event(), []

    def held(*a):  # the read's second piece waits until the scan asked for rows: it asks while the read goes on
        if threading.current_thread().name == "dcptool-read":
            reads.append(1)
            if len(reads) > 1:
                assert asked.wait(30)
        return real_pread(*a)

    def upto(self, key, n):
        if self.reader is not None:
            ahead.append(key in self.reader.pending)  # the column was still being read when a chunk asked
        asked.set()
        return real_upto(self, key, n)

    monkeypatch.setattr(files, "pread", held)
    monkeypatch.setattr(dump_mod.Dump, "upto", upto)
    assert _replay_lines(read_dump(path, stream=True)) == want
    assert ahead and any(ahead)


def test_a_streamed_bad_file_is_its_dump_error_not_a_checks_exception(tmp_path, monkeypatch):
    """A row value the read finds bad only once it is in (a negative seq_len): replay raises the file's
    DumpError, also when a check has meanwhile raised on those rows; the command line: exit 2, one line."""
    from typer.testing import CliRunner

    import dcptool.check.values as replay_mod  # (replay finds each check in its module, by the rule table)
    from dcptool.cli import app

    p = _bad(tmp_path, _set("rows.seq_lens", [17, 25, 0, 0, 17, -25, 0, 0, 17, 25, 0, 0]))
    with pytest.raises(DumpError, match="rows.seq_lens: negative length -25 at row 5"):
        _replay_lines(read_dump(p, stream=True))

    def broken(d):
        raise IndexError("a check tripped over the unchecked rows")

    monkeypatch.setattr(replay_mod, "check_shape", broken)
    with pytest.raises(DumpError, match="negative length"):
        _replay_lines(read_dump(p, stream=True))
    r = CliRunner().invoke(app, ["replay", p, "--json"])
    assert r.exit_code == 2 and r.stdout == "" and r.stderr.count("\n") == 1, (r.stdout, r.stderr)
    assert r.stderr.startswith(f"dcptool: {p}: rows.seq_lens: negative length -25 at row 5"), r.stderr


def test_a_file_truncated_while_streamed_is_one_dump_error(tmp_path, monkeypatch):
    """Truncated after its per-observation columns were read, while its rows are: DumpError naming the file
    (from the read's thread, raised by whoever waits and by finish()), never a partly read replay."""

    p = write(tmp_path / "run.safetensors", [obs(step=s, rank=s % 2) for s in range(50)])
    size = os.path.getsize(p)
    real = stream.Reader._run

    def cut_then_read(self):
        os.truncate(p, size - 40)
        real(self)

    monkeypatch.setattr(stream.Reader, "_run", cut_then_read)
    d = read_dump(p, stream=True)
    with pytest.raises(DumpError, match=f"^{p}: changed while being read"):
        d["rows.dcp_local_seq_lens"]
    with pytest.raises(DumpError, match="changed while being read"):
        _replay_lines(d)


def test_streamed_read_without_preadv(tmp_path, monkeypatch):
    """Where os.preadv is missing (older macOS), the streamed read copies what os.pread returns: the same columns."""

    monkeypatch.setattr(stream, "STREAM_PIECE", 100)
    p = write(tmp_path / "run.safetensors", [obs(step=s, rank=s % 2) for s in range(30)])
    want = read_dump(p)
    monkeypatch.delattr(os, "preadv")
    got = read_dump(p, stream=True)
    got.finish()
    assert all(np.array_equal(got[k], want[k]) for k in want.columns)


def test_a_streamed_read_never_hands_out_unread_values(tmp_path, monkeypatch):
    """A read plan that missed some values (a bug, not a file error) raises when they are asked for, instead of
    handing out the buffer's unread bytes."""

    p = write(tmp_path / "run.safetensors", [obs(step=s, rank=s % 2) for s in range(30)])
    real = stream.Reader._plan
    monkeypatch.setattr(stream.Reader, "_plan", lambda self: real(self)[:-1])  # (the last piece lost)
    d = read_dump(p, stream=True)
    d.reader.thread.join()
    lost = [k for k, n in d.reader.need.items() if d.reader.got[k] < n]
    assert lost
    with pytest.raises(RuntimeError, match="the streamed read ended at value"):
        d[lost[0]]


def test_take_on_a_streamed_dump_waits_for_what_it_gathers_only(tmp_path, monkeypatch):
    """Dump.take on a dump still being read returns once the values up to its largest index are in (provenance's
    lead follows the read so), while the rest of the column is still held back."""
    import threading


    monkeypatch.setattr(stream, "STREAM_PIECE", 64)
    p = write(tmp_path / "run.safetensors", [obs(step=s, rank=s % 2) for s in range(60)])
    want = read_dump(p)
    go, real, calls = threading.Event(), files.pread, []

    def held(*a):
        if threading.current_thread().name == "dcptool-read":  # (the per-observation columns come first, here)
            calls.append(a)
            if len(calls) > 2:  # the reader's first pieces only, then it waits
                assert go.wait(10)
        return real(*a)

    monkeypatch.setattr(files, "pread", held)
    d = read_dump(p, stream=True)
    got = d.take("rows.seq_lens", np.array([0, 1, 2]))
    assert got.tolist() == want["rows.seq_lens"][:3].tolist()
    assert "rows.seq_lens" in d.reader.pending  # (the column is not read whole yet)
    go.set()
    d.finish()
    assert np.array_equal(d["rows.seq_lens"], want["rows.seq_lens"])


# --------------------------------------------------------------------------------------------
# Hardening III item 5: a dump rewritten in place while replay reads it is exit 2 and one line, every time


def _dcptool_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("dcptool-") and t.is_alive()]


def test_a_failed_replay_ends_no_thread_of_its_own_running(tmp_path, monkeypatch):
    """The file is cut short while its rows are read and a check runs beside the scan: the error is one line,
    exit 2, and by then every check thread has ended (was: the checks ran on, daemon threads, as the process
    exited over them, which can abort it). A failure before the scan stops the read's thread too."""
    import threading

    from conftest import cli

    import dcptool.check.values as replay_mod  # (replay finds each check in its module, by the rule table)

    monkeypatch.setattr(stream, "STREAM_PIECE", 256)
    p = write(tmp_path / "run.safetensors", [obs(step=s, rank=s % 2) for s in range(400)])
    size = os.path.getsize(p)
    real_pread, real_shape = files.pread, replay_mod.check_shape
    pieces, short = [], threading.Event()

    def cut_after_the_first_pieces(*a, **k):
        if threading.current_thread().name == "dcptool-read":
            pieces.append(1)
            if len(pieces) == 3:
                os.truncate(p, size // 2)  # another process rewrites it: first it truncates
        try:
            return real_pread(*a, **k)
        except Exception:
            short.set()  # the read met the short file
            raise

    def slow_shape(d):
        short.wait(30)  # still running when the read meets the short file
        return real_shape(d)

    monkeypatch.setattr(files, "pread", cut_after_the_first_pieces)
    monkeypatch.setattr(replay_mod, "check_shape", slow_shape)
    r = cli("replay", p)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r
    assert r.stderr.startswith(f"dcptool: {p}: changed while being read"), r.stderr
    assert _dcptool_threads() == []
    # --obs refused before the replay starts: the read's thread is stopped, not left reading
    q = write(tmp_path / "other.safetensors", [obs(step=s, rank=s % 2) for s in range(400)])
    monkeypatch.setattr(files, "pread", real_pread)
    r = cli("replay", q, "--obs", "9999")
    assert r.returncode == 2 and "has no observation 9999" in r.stderr and _dcptool_threads() == []


REWRITE = """
import os, sys, threading
from dcptool.dump import files, stream
p, other, at = sys.argv[1], open(sys.argv[2], "rb").read(), int(sys.argv[3])
stream.STREAM_PIECE = 4096
real, pieces, go, done = files.pread, [], threading.Event(), threading.Event()

def read(*a, **k):  # once the read's thread is `at` pieces in, another writer rewrites the file in place
    if threading.current_thread().name == "dcptool-read":
        pieces.append(1)
        if len(pieces) == at:
            go.set()
            done.wait(30)
    return real(*a, **k)

def rewrite():
    go.wait()
    with open(p, "r+b") as f:  # in place: the same inode, other bytes, another length
        f.write(other)
        f.truncate(len(other))
    done.set()

files.pread = read
threading.Thread(target=rewrite, daemon=True).start()
live = lambda: [t.name for t in threading.enumerate() if t.name.startswith("dcptool-")]  # noqa: E731
threading._register_atexit(lambda: print("live:", live()))  # (before non-daemon threads are joined at exit)
sys.argv = ["dcptool", "replay", p]
from dcptool.cli import main
main()
"""


def test_a_dump_rewritten_in_place_during_replay_is_exit_2_in_one_line(tmp_path):
    """A real process, its file rewritten in place by another writer while the rows are read (early and late in
    the read): exit 2, one line naming the file, no dcptool thread alive as the process exits, never an abort.
    tools/rewrite_during_replay.py runs the same without the hooks, timed at random, as many times as asked."""
    import subprocess
    import sys

    from conftest import ROOT

    from dcptool.model.simulate import SimConfig, simulate

    p, other = tmp_path / "run.safetensors", tmp_path / "other.safetensors"
    simulate(SimConfig(steps=24, max_num_reqs=64), p)  # every column, checks on threads beside the scan
    simulate(SimConfig(steps=24, max_num_reqs=64, seed=1), other)
    original = p.read_bytes()
    for at in (2, 40):
        p.write_bytes(original)
        r = subprocess.run([sys.executable, "-c", REWRITE, str(p), str(other), str(at)], capture_output=True,
                           text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), "DCPTOOL_DEBUG": ""})
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (at, r.returncode, r.stderr[-3000:])
        assert r.stderr.startswith(f"dcptool: {p}: ") and "Traceback" not in r.stderr, r.stderr
        assert r.stdout == "live: []\n", r.stdout
