"""benchmarks/bench_record.py --sets --cpu: the GPU table's code paths on the CPU (the kernel under the interpreter),
the floor row (an empty launch per observe) among them, and set (e): every field the vLLM plugin passes the Recorder,
with a NIXL transfer plan recorded each step."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.kernel


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU: bench_record.py --sets runs for real there")
def test_sets_smoke_prints_every_set_with_its_floor():
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCPTOOL_")}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_record.py"), "--sets", "--cpu"],
                       capture_output=True, text=True, env=env, timeout=600, cwd=ROOT / "benchmarks")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "another Recorder" not in p.stderr  # (each run's Recorder frees its name: closed or discarded)
    rows = [line.split(" | ") for line in p.stdout.splitlines() if line.startswith("| ") and " tok | " in line]
    labels = ("off", "sync (baseline)", "device snapshot", "floor: an empty launch per observe")
    assert len(rows) == 2 * 6 * len(labels)  # 2 workloads x 6 sets x (off, sync, snapshot, floor)
    assert [r[2] for r in rows] == list(labels) * 12
    assert [r[1][:3] for r in rows[::4]] == ["(a)", "(b)", "(b)", "(c)", "(d)", "(e)"] * 2
    for r in rows:
        assert float(r[3]) > 0  # ms/step
        if r[2] == "device snapshot":
            assert r[8] == "0" and int(r[9].replace(",", "")) > 0  # no host slot copy; recorded
        if r[2] == "floor: an empty launch per observe":
            assert float(r[5]) > 0 and r[9] == "-"  # CPU per launch measured; nothing recorded
        recording = r[2] in ("sync (baseline)", "device snapshot")
        if r[1].startswith("(e)") and recording:  # a transfer plan made and recorded each step, timed apart
            assert float(r[11].rstrip(" |")) > 0 and int(r[9].replace(",", "")) == 4 * 4 + 1 + 4  # 4 steps + warm
        else:
            assert r[11].rstrip(" |") == "-"
    for w in ("decode 256 req x 768 tok", "prefill 16 req x 8192 tok"):  # the set's values are right by every rule
        assert (f"set (e), {w}: 10 observations (0 dropped), 2 of them transfers, recorded and replayed: no finding"
                in p.stdout)


@pytest.mark.parametrize("workload", ["decode 256 req x 768 tok", "prefill 16 req x 8192 tok"])
def test_set_e_at_full_size_replays_with_no_finding(workload, tmp_path):
    """Set (e) at the GPU table's sizes (the smoke run's decode workload has no speculative tokens): the decode step's 3
    query tokens a request are prefill rows to FlashInfer's split at threshold 1, so its dcp_query_start_loc and
    page counts are those of a batch without FlashInfer decode rows; replay of a recording finds nothing."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_record_sets import WORKLOADS, _arguments, _replayed

    reqs, toks = WORKLOADS[workload]
    kw, seq = _arguments("e", reqs, toks, torch.device("cpu"), None)
    got = _replayed(kw, seq, tmp_path / "e.safetensors")
    assert got.endswith("recorded and replayed: no finding") and "(0 dropped)" in got, got


def test_sets_python_prints_every_set_and_the_transfer_parts():
    """--sets --python (observe()'s Python per set, the launch a stand-in) runs every set, (e) included, and times
    the transfer's parts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCPTOOL_")}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_record.py"), "--sets", "--python", "--obs",
                        "500", "--reps", "1"], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [line.strip("| ").split(" | ") for line in p.stdout.splitlines() if line.startswith("| (")]
    assert [r[0][:3] for r in rows] == ["(a)", "(b)", "(b)", "(c)", "(d)", "(e)"]
    assert all(float(v) > 0 for r in rows for v in r[1:3])
    parts = [line.strip("| ").split(" | ") for line in p.stdout.splitlines()
             if line.startswith(("| the plan", "| recorded", "| both"))]
    assert len(parts) == 3 and all(float(v) > 0 for _, v in parts)
