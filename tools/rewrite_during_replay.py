"""Replay a dump while another writer rewrites it in place, many times, and count how each run ended.

    python tools/rewrite_during_replay.py [--runs 200] [--steps 400] [--dir DIR]

Each run starts `python -m dcptool replay DUMP` as a user would and, after a random delay of 10-50% of the time
an untouched replay takes (start-up, then the rows read while the scan follows), rewrites DUMP in place: another
simulated run's bytes over it (the same inode, another length), or a plain truncation, in turn.
Every run must end with exit 0 or 1 (the rewrite came after the read: the report is of the file as read) or exit 2
and one line on stderr (the file changed while being read); anything else (134: an abort, 135: SIGBUS, a
traceback, a second line) is counted as wrong and printed. Hardening III item 5; the test that runs
the same at two fixed points of the read is tests/dump/test_stream.py.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_dumps(d: Path, steps: int) -> tuple[Path, Path]:
    """Two recordings of every column (simulate, seeds 0 and 1): the replayed one and the bytes written over it."""
    sys.path.insert(0, str(ROOT))
    from dcptool.model.simulate import SimConfig, simulate

    a, b = d / "run.safetensors", d / "other.safetensors"
    for seed, p in ((0, a), (1, b)):
        simulate(SimConfig(steps=steps, max_num_reqs=128, pipeline="legacy", seed=seed), p, force=True)
    return a, b


def one_run(p: Path, original: bytes, other: bytes, how: str | None, delay: float) -> tuple[int, str]:
    """One replay of p (written anew from `original`), rewritten `how` after `delay` s (None: left alone)."""
    p.write_bytes(original)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DCPTOOL_DEBUG": ""}
    proc = subprocess.Popen([sys.executable, "-m", "dcptool", "replay", str(p)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    time.sleep(delay)
    if how is None:
        pass
    elif how == "truncate":
        os.truncate(p, len(original) // 3)
    else:
        with open(p, "r+b") as f:  # in place: other bytes over the same inode, then cut to their length
            f.write(other)
            f.truncate(len(other))
    err = proc.communicate()[1]
    return proc.returncode, err


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--steps", type=int, default=400, help="simulate steps of the replayed recording")
    ap.add_argument("--dir", type=Path, default=None, help="where to write the recordings (default: a temporary one)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = args.dir or Path(tmp)
        d.mkdir(parents=True, exist_ok=True)
        p, q = make_dumps(d, args.steps)
        original, other = p.read_bytes(), q.read_bytes()
        t0 = time.perf_counter()
        rc, _ = one_run(p, original, other, None, 0.0)  # how long a replay takes, untouched
        took = time.perf_counter() - t0
        print(f"{p.stat().st_size:,} bytes, a replay takes {took:.2f} s here (exit {rc})", flush=True)
        counts: collections.Counter = collections.Counter()
        wrong = []
        rnd = random.Random(0)
        for k in range(args.runs):
            how = ("rewrite", "truncate")[k % 2]
            code, err = one_run(p, original, other, how, rnd.uniform(0.1, 0.5) * took)
            lines = err.splitlines()
            ok = code in (0, 1) and not err or code == 2 and len(lines) == 1 and err.startswith("dcptool: ")
            counts[(code, lines[0].split(": ", 2)[-1][:40] if code == 2 and lines else "")] += 1
            if not ok:
                wrong.append((k, how, code, err[-2000:]))
        for (code, what), n in sorted(counts.items()):
            print(f"exit {code}: {n} runs{f'  ({what}...)' if what else ''}")
        print(f"{args.runs} runs, {len(wrong)} wrong")
        for k, how, code, err in wrong:
            print(f"--- run {k} ({how}): exit {code}\n{err}")
        return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
