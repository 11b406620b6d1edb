"""One recording per path (claim.py): an exclusive flock on a hidden lock file beside the path, held between
processes and within one, released when its holder dies, removed on release."""

import os
import signal
import subprocess
import sys

import pytest
from conftest import ROOT

from dcptool.engine.recorder.claim import Claim

HOLD = """
import sys, time
from pathlib import Path
from dcptool.engine.recorder.claim import Claim
c = Claim.take(Path(sys.argv[1]))
print("held" if c is not None and c.held else "refused", flush=True)
if sys.argv[2] == "wait":
    time.sleep(600)
"""


def _hold(path, mode: str) -> tuple[subprocess.Popen, str]:
    """A process that takes the path's claim (and, with "wait", keeps it until killed); what it answered."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(path), mode], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    return p, p.stdout.readline().strip()


def test_a_path_is_held_against_another_process_and_freed_when_it_dies(tmp_path):
    """Another process holds the path: this one is refused; the holder killed (no release() ran: SIGKILL), the
    lock it left is free, taken here, and removed on release."""
    path = tmp_path / "run.safetensors"
    holder, said = _hold(path, "wait")
    assert said == "held"
    try:
        assert Claim.take(path) is None
        other = subprocess.run([sys.executable, "-c", HOLD, str(path), "once"], capture_output=True, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert other.stdout.strip() == "refused"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (tmp_path / ".run.safetensors.lock").exists()  # (left by the killed holder: unlocked)
    c = Claim.take(path)
    assert c is not None and c.held
    c.release()
    c.release()  # (twice: nothing)
    assert os.listdir(tmp_path) == []


def test_two_claims_in_one_process_exclude_each_other(tmp_path):
    path = tmp_path / "r.safetensors"
    a = Claim.take(path)
    assert a.held and Claim.take(path) is None
    assert Claim.take(tmp_path / "other.safetensors").held  # (another path: its own lock)
    a.release()
    b = Claim.take(path)
    assert b.held
    b.release()


def test_a_lock_file_replaced_under_a_contender_is_not_taken(tmp_path, monkeypatch):
    """A contender that locked a file its holder removed meanwhile (the holder released between the contender's
    open and its lock) finds the path names another file, and takes the lock of the file there now."""
    path = tmp_path / "r.safetensors"
    lock = tmp_path / ".r.safetensors.lock"
    real_stat = os.stat
    swapped = []

    def stat(p, *a, **k):
        if str(p) == str(lock) and not swapped:  # the holder released and a new holder made the file again
            swapped.append(1)
            os.unlink(lock)
            lock.write_bytes(b"")
        return real_stat(p, *a, **k)

    monkeypatch.setattr(os, "stat", stat)
    c = Claim.take(path)
    assert swapped and c.held and os.path.samestat(os.fstat(c._fd), real_stat(lock))
    c.release()


def test_where_no_lock_can_be_made_the_claim_holds_nothing(tmp_path):
    c = Claim.take(tmp_path / "missing" / "r.safetensors")  # (the directory is made later, or never)
    assert c is not None and not c.held
    c.release()


@pytest.mark.parametrize("n", [2, 5])
def test_only_one_of_many_processes_holds_a_path(tmp_path, n):
    path = tmp_path / "r.safetensors"
    procs = [_hold(path, "wait") for _ in range(n)]
    try:
        assert [said for _, said in procs].count("held") == 1 and Claim.take(path) is None
    finally:
        for p, _ in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()
