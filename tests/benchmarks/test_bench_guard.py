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
    assert ("| mode | off ms | on ms | slowdown | floor ms | floor slowdown | CPU µs/observe (floor) "
            "| host syncs (on) |") in out
    assert "| eager |" in out and "| graph | - | - | - | - | - | - | capture needs CUDA |" in out
    eager = next(line for line in out.splitlines() if line.startswith("| eager |")).split("|")
    assert all(float(eager[i]) > 0 for i in (2, 3, 5))  # off, on and the floor each ran and were timed
    assert "clean runs wrote nothing: True" in out
    assert "a wrong view, eager: 1 warning, 1 dump of 5 observations, replay: mismatch" in out
    assert out.count("kernel vs host path: same") == 2 and "DIFFERENT" not in out
