"""benchmarks/bench_simulate.py: a small run of it, this checkout against e12844c (before simulate streamed its dump):
every row measured, and the same bytes from both."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_measures_both_and_finds_the_same_bytes(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_simulate.py"), "--steps", "20", "60",
                        "--before-max", "60", "--dir", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [r for r in p.stdout.splitlines() if re.match(r"\| \d", r)]
    assert [r.split(" | ")[1] for r in rows] == ["now", "e12844c"] * 2
    assert all(float(r.split(" | ")[2].replace(",", "")) > 0 for r in rows)
    assert [r.split(" | ")[5] for r in rows[1::2]] == ["same bytes |"] * 2
    assert list(tmp_path.iterdir()) == []  # nothing left behind
