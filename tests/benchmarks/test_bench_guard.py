"""benchmarks/bench_guard.py --smoke: the H200 benchmark's code paths on the CPU (the kernel under the interpreter)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.kernel


# On a GPU machine the benchmark runs for real (its table is in docs/performance.md); the smoke is the CPU's view of
# it under Triton's interpreter, which on the GPU image (triton 3.6, numpy 2.5) cannot run loops bounded by a loaded
# value (tools/accelerator_suite.sh): there the same fault comparison ran compiled, on the GPU, and agreed.
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU: bench_guard.py runs for real there")
def test_smoke_runs_and_prints_the_table():
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCPTOOL_")}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_guard.py"), "--smoke"], capture_output=True,
                       text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    table = _table(out, "mode")
    assert set(table) == {"eager", "graph"}
    eager, graph = table["eager"], table["graph"]
    assert len(eager) == len(graph) >= 7  # (a row a mode, every column filled)
    timed = [k for k in eager if k.endswith(" ms")]
    assert len(timed) >= 3 and all(float(eager[k]) > 0 for k in timed)  # off, on and the floor each ran and were timed
    assert "capture needs CUDA" in graph.values() and all(v in ("-", "capture needs CUDA") for v in graph.values())
    assert "clean runs wrote nothing: True" in out
    assert "a wrong view, eager: 1 warning, 1 dump of 5 observations, replay: mismatch" in out
    assert out.count("kernel vs host path: same") == 2 and "DIFFERENT" not in out


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
