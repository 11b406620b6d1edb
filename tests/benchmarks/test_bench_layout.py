"""benchmarks/bench_layout.py and layout_data.py: the plugin's layout made in parallel byte for byte as made one file
at a time, and a small run of the benchmark: every layout and path measured, with the same findings."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import layout_data  # noqa: E402


@pytest.mark.parametrize("n,ranks", [(1, 2), (127, 4), (1000, 8)])
def test_layouts_made_in_parallel_are_the_files_made_one_at_a_time(tmp_path, n, ranks):
    specs = [(n, ranks, 0.01, "one"), (n, ranks, 0.01, "rank3"), (n, ranks, 1.0, "rank1")]
    layout_data.make(tmp_path / "par", specs, jobs=2)
    serial = [layout_data.one_file(tmp_path / "ser", n, ranks, 0.01), layout_data.per_rank(tmp_path / "ser", n, ranks,
              3, 0.01), layout_data.per_rank(tmp_path / "ser", n, ranks, 1, 1.0)]
    assert [len(x) for x in serial] == [1, 3 * ranks, ranks]
    for path in (p for paths in serial for p in paths):
        assert Path(path.replace("/ser/", "/par/")).read_bytes() == Path(path).read_bytes(), path


def test_a_small_run_measures_every_layout_and_finds_the_same(tmp_path):
    # a PYTHONPATH of several entries, as on a machine with packages installed beside its image's
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path / "site")])}
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_layout.py"), "--obs", "2000", "--ranks", "2",
                        "--layouts", "one,rank3", "--wrong", "0.01,1", "--formats", "json", "--runs", "1",
                        "--bounded", "--backend", "torch", "--jobs", "2", "--data", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [r.split(" | ") for r in p.stdout.splitlines() if re.match(r"\| 2,000 ", r)]
    assert [(r[1], r[2], r[3]) for r in rows] == [("0.01", "one", "1"), ("0.01", "rank3", "6"), ("1", "one", "1"),
                                                  ("1", "rank3", "6")]
    found = [int(r[5].replace(",", "")) for r in rows]
    # 1%: at least the 4 planted observations; every observation planted: most of them found (a -1 planted in the
    # padding of an observation without padding rows changes nothing)
    assert found[0] == found[1] >= 4 and found[2] == found[3] >= 1800, found
    # the replays (this checkout, the bounded path): wall and CPU seconds measured (the floor of a few kB may be 0.00)
    assert all(float(r[k].split()[0]) > 0 for r in rows for k in (7, 8, 9, 12, 13)), rows
