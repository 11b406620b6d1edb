"""benchmarks/bench_guard.py --smoke: the GPU benchmark's code paths on the CPU (the kernel under the interpreter),
every shape (decode 256 and 1,024 requests, prefill 8,192 tokens, scaled down) with every keyword the vLLM plugin
hands the Guard."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.kernel
SHAPES = ("decode256", "decode1024", "prefill8192")


def run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCPTOOL_")}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_guard.py"), *args], capture_output=True,
                          text=True, env=env, timeout=600)


# On a GPU machine the benchmark runs for real (its table is in docs/performance.md); the smoke is the CPU's view of
# it under Triton's interpreter, which on the GPU image (triton 3.6, numpy 2.5) cannot run loops bounded by a loaded
# value (tools/accelerator_suite.sh): there the same fault comparison ran compiled, on the GPU, and agreed.
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU: bench_guard.py runs for real there")
def test_smoke_runs_every_shape_clean_and_prints_the_table():
    p = run("--smoke")
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    assert "fields all (20 keywords a build)" in out
    table = _table(out, "shape / mode")
    assert [k.split(" (")[0] + k.split(")")[-1] for k in table] == [f"{s} / {m}" for s in SHAPES
                                                                   for m in ("eager", "graph")]
    for label, row in table.items():
        assert len(row) == 8  # (every column filled)
        if label.endswith("graph"):
            assert list(row.values()) == ["-"] * 7 + ["capture needs CUDA"]
            continue
        assert all(float(row[k]) > 0 for k in ("off ms", "on ms", "floor ms"))  # off, on and the floor each timed
        ratio = float(row["on − off µs/build"]) / float(row["floor − off µs/build"])
        assert float(row["added: on / floor"]) == pytest.approx(ratio, abs=0.011)  # (the two added costs' ratio)
        assert row["host syncs (on)"] == "n/a"
    for s in SHAPES:  # the builds the loop makes are right by every rule of replay, not by the Guard's alone
        assert f"the builds of {s}, recorded and replayed: 4 builds, 0 dropped, no finding" in out
    assert "clean runs: every build counted, none wrong, none dropped, nothing written: True" in out
    assert "a wrong view, eager (decode256): 1 warning, 1 dump of 5 observations, replay: mismatch\n" in out
    # a check of the host values runs on every build
    host = "a wrong host copy of seq_lens, eager (decode256): 1 warning, 1 dump of 5 observations, replay: host-copy\n"
    assert host in out
    assert out.count("kernel vs host path: same") == 2 and "DIFFERENT" not in out


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU: bench_guard.py runs for real there")
def test_smoke_of_one_shape_with_the_fast_path_keywords():
    p = run("--smoke", "--shapes", "prefill8192", "--fields", "fast")
    assert p.returncode == 0, p.stderr[-3000:]
    assert [k.split(" (")[0] for k in _table(p.stdout, "shape / mode")] == ["prefill8192"] * 2
    assert "fields fast (3 keywords a build)" in p.stdout and "a wrong host copy" not in p.stdout


def test_python_mode_measures_the_fast_keywords_and_a_backend_s():
    p = run("--python", "--fields", "flashinfer")
    assert p.returncode == 0, p.stderr[-3000:]
    got = re.findall(r"--fields (\w+) \((\d+) keywords\), 256 rows, launch a stand-in: ([\d.]+) µs", p.stdout)
    assert [(f, int(n)) for f, n, _ in got] == [("fast", 3), ("flashinfer", 15)] and all(float(u) > 0 for *_, u in got)
    assert re.search(r"Python per eager observe\(\), launch a stand-in: now [\d.]+ µs", p.stdout)


def test_an_unknown_shape_is_refused_in_one_line():
    p = run("--smoke", "--shapes", "decode256,decode99")
    assert p.returncode == 2 and "--shapes: decode99: choose among decode256, decode1024, prefill8192" in p.stderr
    assert "Traceback" not in p.stderr


def _table(out: str, first: str) -> dict[str, dict[str, str]]:
    """The markdown table of `out` whose first column is named `first`: its rows by their first cell, each row's
    cells by column name (the names as the benchmark prints them, whatever they are)."""
    lines = [line.strip().strip("|").split("|") for line in out.splitlines() if line.startswith("|")]
    head = next(i for i, c in enumerate(lines) if c[0].strip() == first)
    names = [c.strip() for c in lines[head]]
    rows = {}
    for cells in lines[head + 2:]:
        if len(cells) != len(names):
            break
        rows[cells[0].strip()] = {n: c.strip() for n, c in zip(names[1:], cells[1:])}
    return rows
