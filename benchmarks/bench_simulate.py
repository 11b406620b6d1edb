"""simulate's peak memory as the steps grow: `dcptool simulate --steps N -o FILE` as a fresh process each time, its
peak resident memory (ru_maxrss of the child, from os.wait4), wall time and file size.

    python benchmarks/bench_simulate.py [--steps 1000 10000 100000] [--args "--dcp 8 --pipeline legacy"]
                                        [--before REV] [--before-max 10000] [--dir DIR] [--keep]

Baseline in the same run: the same command of git revision --before (default e12844c, which held every observation
in memory until it wrote the file at close()), extracted with `git archive` and run the same way, interleaved, for the
step counts up to --before-max (its memory grows with the steps: 100,000 would need ~20 GB); where both ran, the two
files must be byte for byte the same (sha256). The files go to --dir (default: the system temporary directory); a
100,000-step run writes ~9.7 GB and needs twice that free while it is written.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(tree: Path, steps: int, out: Path, args: list[str]) -> tuple[float, float, int]:
    """(peak MB, seconds, bytes) of one `simulate --steps N ARGS -o out` in a fresh process of the code in `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "dcptool", "simulate", "--steps", str(steps), *args, "-o", str(out),
                          "--force"], env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - t
    err = p.stderr.read().decode()
    p.stderr.close()
    if p.returncode != 0:
        raise SystemExit(f"{tree}: simulate --steps {steps} failed ({p.returncode}): {err[-2000:]}")
    return usage.ru_maxrss / 1024, seconds, out.stat().st_size  # (ru_maxrss: KiB on Linux)


def sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--args", default="", help="more simulate options, e.g. \"--dcp 8 --pipeline legacy\"")
    ap.add_argument("--before", default="e12844c")
    ap.add_argument("--before-max", type=int, default=10000)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--keep", action="store_true", help="keep the files written")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-simulate-", dir=a.dir))
    try:
        before = work / "before"
        before.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", a.before], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
        args = a.args.split()
        print(f"simulate {a.args + ' ' if args else ''}-o, a fresh process per run; before = {a.before}, now = this "
              "checkout")
        print("| steps | code | peak MB | s | file MB | sha256 |")
        print("|---:|---|---:|---:|---:|---|")
        for steps in a.steps:
            out = work / f"now-{steps}.safetensors"
            peak, s, size = run(ROOT, steps, out, args)
            digest = sha(out)
            print(f"| {steps:,} | now | {peak:,.0f} | {s:.1f} | {size / 1e6:,.0f} | {digest} |", flush=True)
            if steps <= a.before_max:
                old = work / f"before-{steps}.safetensors"
                bpeak, bs, bsize = run(before, steps, old, args)
                same = sha(old) == digest
                print(f"| {steps:,} | {a.before} | {bpeak:,.0f} | {bs:.1f} | {bsize / 1e6:,.0f} | "
                      f"{'same bytes' if same else 'DIFFERENT'} |", flush=True)
                if not same:
                    raise SystemExit(f"simulate --steps {steps}: the files differ")
                if not a.keep:
                    old.unlink()
            if not a.keep:
                out.unlink()
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"files in {work}")


if __name__ == "__main__":
    main()
