"""benchmarks/soak_guard.py: its --smoke run on the CPU (the kernel under the interpreter) holds every property, and
its verdict fails a run that leaks, synchronises, writes while clean, misses the fault or dumps the wrong builds."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import soak_guard  # noqa: E402

MIB = 1 << 20


@pytest.mark.kernel
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU: soak_guard.py runs for real there")
def test_smoke_with_every_field_holds_every_property():
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCPTOOL_")}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak_guard.py"), "--smoke", "--fields", "all"],
                       capture_output=True,
                       text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = _rows(p.stdout)
    assert all(graph == "- (capture needs CUDA)" for _, graph in rows.values())
    eager = {k: v[0] for k, v in rows.items()}
    assert eager["builds checked (the Guard's count)"] == "2,000 of 2,000 ✓"
    assert eager["nothing written before the fault"] == "nothing ✓"
    assert eager["first wrong build, rule (want: the fault's)"] == "1,500, values (fault at 1,500) ✓"
    assert eager["dump: builds kept, in order, the fault last"] == "16 of keep 16, in order ✓"
    assert eager["replay of the dump (want: mismatch alone)"] == "mismatch ✓"
    assert eager["host RSS, first → last quarter's highest (MiB; tolerance 4.0)"].endswith(" ✓")
    assert "FAIL" not in p.stdout and p.stdout.rstrip().endswith("every property holds")
    assert "fields all, 2,000 builds a mode, 4 a step, keep 16" in p.stdout
    assert "eager: 2,000 builds checked, the clean 1,500 in " in p.stdout
    # the one warning: the dump, named
    assert p.stderr.count("dcptool Guard: wrong DCP metadata (values) at step 1500: the last 16 observations") == 1


def test_a_graph_alone_on_the_cpu_is_refused_in_one_line():
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak_guard.py"), "--smoke", "--modes", "graph"],
                       capture_output=True, text=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), timeout=600)
    assert p.returncode == 2 and "--modes: a graph needs CUDA" in p.stderr and "Traceback" not in p.stderr


def _run(**changes) -> dict:
    """A run as soak_eager returns it, every property holding, with `changes`."""
    r = dict(builds=2000, clean=1500, seconds=1.0, syncs=0, mem=[(100 * MIB, 10 * MIB, 20 * MIB)] * 16,
             written=False, fault=1500, per=4, steps=True, count=2000, dropped=0, first=(1500, "values"), path=None,
             kept=16, in_order=True, rules=["mismatch"])
    return dict(r, **changes)


def _grow(quantity: int, by: int) -> list:
    """16 samples, `quantity` (0 host, 1 allocated, 2 reserved) growing by `by` bytes a sample."""
    out = []
    for k in range(16):
        s = [100 * MIB, 10 * MIB, 20 * MIB]
        s[quantity] += k * by
        out.append(tuple(s))
    return out


@pytest.mark.parametrize("changes", [
    {}, {"mem": _grow(0, MIB // 8)}, {"mem": _grow(1, -4096)}, {"mem": _grow(2, MIB // 8)}],
    ids=["clean", "host within 4 MiB", "allocated falls", "reserved within 2 MiB"])
def test_a_run_that_holds_passes(changes, capsys):
    args = type("A", (), {"cuda": True, "keep": 16})
    assert soak_guard.table({"eager": _run(**changes), "graph": _run(**changes)}, args)
    assert "FAIL" not in capsys.readouterr().out


@pytest.mark.parametrize("changes, row", [
    ({"mem": _grow(0, MIB)}, "host RSS"),
    ({"mem": _grow(1, 512)}, "device allocated"),
    ({"mem": _grow(2, MIB)}, "device reserved"),
    ({"syncs": 3}, "host syncs"),
    ({"written": True}, "nothing written"),
    ({"first": (1501, "values")}, "first wrong build"),
    ({"first": (1500, "padding")}, "first wrong build"),
    ({"first": (-1, None), "path": None, "kept": 0, "in_order": False, "rules": []},
     ("first wrong build", "dump: builds kept", "replay of the dump")),  # (not caught: no dump either)
    ({"kept": 15}, "dump: builds kept"),
    ({"in_order": False}, "dump: builds kept"),
    ({"rules": ["mismatch", "slots"]}, "replay of the dump"),
    ({"count": 1999}, "builds checked"),
    ({"dropped": 1}, "builds checked"),
])
def test_a_broken_property_fails_its_row_alone(changes, row, capsys):
    want = row if isinstance(row, tuple) else (row,)
    args = type("A", (), {"cuda": True, "keep": 16})
    assert not soak_guard.table({"eager": _run(), "graph": _run(**changes)}, args)
    rows = _rows(capsys.readouterr().out)
    failed = [k for k, (eager, graph) in rows.items() if "FAIL" in eager + graph]
    assert len(failed) == len(want) and all(f.startswith(w) for f, w in zip(failed, want))
    assert all("FAIL" not in rows[f][0] and "FAIL" in rows[f][1] for f in failed)  # (the graph column's alone)


def _rows(out: str) -> dict[str, list[str]]:
    """The property table: its rows by property, each the cells of the modes (eager, graph)."""
    lines = [line.strip().strip("|").split("|") for line in out.splitlines() if line.startswith("| ")]
    return {c[0].strip(): [x.strip() for x in c[1:]] for c in lines[1:] if c[0].strip() != "property"}


@pytest.mark.parametrize("message, counted", [
    ("called a synchronizing CUDA operation", 1),
    ("Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations", 0),
    ("an unrelated warning", 0),
])
def test_a_sync_is_counted_and_the_modes_prototype_warning_is_not(message, counted):
    import guard_engine as ge
    import torch

    sc = ge.SyncCount(torch.device("cpu"))
    sc._count(message, UserWarning, "/x/y.py", 7)
    assert (sc.n, sc.first) == (counted, "/x/y.py:7" if counted else "")
