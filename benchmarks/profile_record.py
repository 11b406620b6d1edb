"""Where observe()'s CPU time goes for one argument set in bench_record_sets' loop (a GPU): the parts timed alone.

    python benchmarks/profile_record.py [--set b1] [--workload prefill] [--steps 300]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bench_record_sets import WORKLOADS, _arguments, _recorder

from dcptool.engine.snapshot import device as D


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", default="b1")
    ap.add_argument("--workload", default="prefill")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    wname = next(k for k in WORKLOADS if k.startswith(args.workload))
    reqs, toks = WORKLOADS[wname]
    dev = torch.device("cuda")
    kw, seq = _arguments(args.set, reqs, toks, dev, np.random.default_rng(0))
    a, b, c = (torch.randn(4096, 4096, dtype=torch.bfloat16, device=dev) for _ in range(3))
    spent: dict = {}

    def timed(name, fn):
        def wrapped(*x, **k):
            t = time.perf_counter()
            try:
                return fn(*x, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
        return wrapped

    later = D._later_sections
    with tempfile.TemporaryDirectory() as d:
        for profile in (False, True):
            rec = _recorder(Path(d) / "p.safetensors", "async", False)
            obs = dict(site="attn_metadata", rank=0, num_reqs=reqs, num_reqs_padded=reqs, **kw)
            rec.observe(step=0, **obs)
            dp = rec._device
            dp.harvest = timed("harvest", dp.harvest)
            ring = dp.ring
            ring.go3 = timed("launch (go3)", ring.go3)
            D._later_sections = timed("_later_sections", later)
            spent.clear()
            ev = torch.cuda.Event()
            pr = cProfile.Profile()
            total = 0.0
            for s in range(args.steps):
                seq.add_(1)
                for k in range(4):
                    if k < 3:
                        torch.mm(a, b, out=c)
                    if profile:
                        pr.enable()
                    t = time.perf_counter()
                    rec.observe(step=s, **obs)
                    total += time.perf_counter() - t
                    if profile:
                        pr.disable()
                ev.record()
                ev.synchronize()
            n = 4 * args.steps
            print(f"{wname}, set {args.set}, {'under cProfile' if profile else 'no profiler'}: observe "
                  f"{total / n * 1e6:.1f} µs; " + ", ".join(f"{k} {v / n * 1e6:.1f} µs" for k, v in spent.items())
                  + f"; ring waits {ring.waits}, fences {len(ring.fences)}")
            D._later_sections = later
            rec.discard()
            if profile:
                pstats.Stats(pr).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
