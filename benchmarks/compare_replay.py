"""`dcptool replay` of this checkout against a baseline checkout, byte for byte: a speed-up must not change a report.

    git worktree add /tmp/base-main main
    python benchmarks/compare_replay.py --base /tmp/base-main samples/*.safetensors --simulate
    python benchmarks/compare_replay.py --base /tmp/base-main bench-data/layout-1000000-r4-w1-s0/one.safetensors

Each dump is replayed by both checkouts in fresh processes (PYTHONPATH=checkout), as text and as --json; the reports
must be equal but for the time they took (the summary's "seconds", the text's `backend ... on ..., X s` line) and
the exit codes too. `--simulate` adds simulated legacy dumps (every pre-fix fault) and fixed ones with the faults
whose wrong views provenance explains by each rule (another rank, an earlier step, a wrong buffer), written to a
temporary directory. Prints one line a dump and exits 1 on the first difference.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (pipeline, options): the legacy pipeline, and the fixed one with faults of each provenance rule
SIMULATIONS = (
    ("legacy", ["--dcp", "2"]),
    ("legacy", ["--dcp", "4", "--interleave", "16", "--pcp", "2"]),
    ("legacy", ["--dcp", "8", "--spec-tokens", "3", "--ubatches", "2"]),
    ("fixed", ["--dcp", "4", "--inject", "rank-disagree,graph-stale,capture-wrong-buffer,sentinel"]),
    ("fixed", ["--dcp", "8", "--interleave", "4", "--inject", "ubatch-parent-rows,pcp-stale", "--pcp", "2"]),
)
TIMING = re.compile(r"^(backend \S+ on \S+), [0-9.]+ s$", re.M)


def replay(code: str, dump: str, fmt: str) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": code}
    cmd = [sys.executable, "-m", "dcptool", "replay", dump, *(["--json"] if fmt == "json" else [])]
    got = subprocess.run(cmd, env=env, cwd=code, capture_output=True, text=True)
    if "Traceback (most recent call last)" in got.stderr:
        raise SystemExit(f"{code}: replay {dump} ended in a traceback:\n{got.stderr[-2000:]}")
    return got.returncode, normalise(got.stdout, fmt)


def normalise(out: str, fmt: str) -> str:
    """The report without the time it took."""
    if fmt == "text":
        return TIMING.sub(r"\1, - s", out)
    lines = out.splitlines()
    for i, line in enumerate(lines):
        x = json.loads(line)
        if x.get("type") == "summary":
            x.pop("seconds", None)
            lines[i] = json.dumps(x)
    return "\n".join(lines)


def simulate(where: Path) -> list[str]:
    out = []
    for k, (pipeline, opts) in enumerate(SIMULATIONS):
        path = where / f"sim{k}-{pipeline}.safetensors"
        subprocess.run([sys.executable, "-m", "dcptool", "simulate", "--pipeline", pipeline, *opts, "--steps", "48",
                        "-o", str(path)], cwd=ROOT, check=True, capture_output=True)
        out.append(str(path))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dumps", nargs="*")
    ap.add_argument("--base", required=True, help="the baseline checkout (e.g. a worktree of main)")
    ap.add_argument("--simulate", action="store_true", help="also simulated legacy and fault-injected dumps")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dumps = [os.path.abspath(d) for d in args.dumps] + (simulate(Path(tmp)) if args.simulate else [])
        for dump in dumps:
            for fmt in ("json", "text"):
                a, b = replay(os.path.abspath(args.base), dump, fmt), replay(str(ROOT), dump, fmt)
                if a != b:
                    print(f"DIFFERENT {fmt}: {dump} (exit {a[0]} against {b[0]}, {len(a[1])} against {len(b[1])} "
                          "characters)")
                    raise SystemExit(1)
                print(f"same {fmt}: {dump} (exit {a[0]}, {len(a[1]):,} characters)", flush=True)


if __name__ == "__main__":
    main()
