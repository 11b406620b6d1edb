"""When each check of one replay starts and ends, and on which thread: where a replay's time goes.

    python benchmarks/timeline_replay.py bench-data/bench-1000000.safetensors --backend triton

Reads and replays the dump twice in this process, as the command line does (the allocator setting, the
streamed read: the scan follows the read of the rows; the second run is printed, so one-time costs stay
out; --first prints the first), with the read, each check, the scan, provenance and the problem grouping
wrapped in a timer, and prints the spans over 5 ms in start order, relative to the start of the read.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's dcptool, run from anywhere

import importlib

import dcptool.check.problems as problems_mod
import dcptool.check.provenance as provenance_mod
import dcptool.check.replay as replay_mod
import dcptool.check.scan as scan_mod
import dcptool.dump.stream as stream_mod
import dcptool.gpu.scan_cuda as scan_cuda_mod
from dcptool.check.plan import checks
from dcptool.dump import open_dumps
from dcptool.memory import keep_freed_memory

spans: list[tuple[float, float, str, str]] = []
t0 = [0.0]


def timed(owner, name: str) -> None:
    f = getattr(owner, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            spans.append((t - t0[0], time.perf_counter() - t0[0], name, threading.current_thread().name))

    setattr(owner, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dump")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--first", action="store_true", help="print the first run (its one-time costs included, as a "
                    "fresh process pays them) rather than the second")
    args = ap.parse_args()
    keep_freed_memory()
    for check in checks():  # (wrapped where replay looks them up: by the rule table's names)
        module, _, name = check.rpartition(".")
        timed(importlib.import_module(f"dcptool.check.{module}"), name)
    timed(replay_mod, "rank_pairs")
    timed(replay_mod, "obs_grid")
    timed(scan_mod, "scan")
    timed(problems_mod, "problems")
    timed(provenance_mod.Provenance, "prepare")
    timed(provenance_mod.Provenance, "lead")
    timed(stream_mod._Reader, "_run")  # the streamed read of the row columns (its own thread)
    # the GPU scan's start-up (context, kernels, pinned staging), its chunks and its end
    for name in ("__init__", "load", "check", "close"):
        timed(scan_cuda_mod.CudaScan, name)
    for _ in range(1 if args.first else 2):
        spans.clear()
        t0[0] = time.perf_counter()
        d = open_dumps([args.dump], stream=True)  # (as the command line reads it: the scan follows the read)
        spans.append((0.0, time.perf_counter() - t0[0], "open (per-observation columns)", "MainThread"))
        res = replay_mod.replay(d, args.backend)
        total = time.perf_counter() - t0[0]
    print(f"replay {total:.3f} s with its read ({res.backend} on {res.device}, {len(res.findings):,} findings)")
    print("| start s | end s | seconds | what | thread |")
    print("|---|---|---|---|---|")
    for s, e, name, th in sorted(spans):
        if e - s > 0.005:
            print(f"| {s:.3f} | {e:.3f} | {e - s:.3f} | {name} | {th} |")


if __name__ == "__main__":
    main()
