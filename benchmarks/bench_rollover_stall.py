"""observe()'s stall at a rollover: the rolled file written inline (the old way) against the background thread.

    python benchmarks/bench_rollover_stall.py [--obs 30000] [--rollover 10000] [--reqs 256] [--tokens 768]

Decode-like observations on host tensors (the vLLM plugin's Recorder: rollover=10,000): seq_lens of --reqs
requests, --tokens positions and a [1, tokens] slot mapping. Both ways run in this process, one after the
other, into a temporary directory; each observe() is timed alone. Prints the median, 99.9th percentile and
max observe() time, the observe() calls that rolled over, and close()'s time (which waits for the last
background write); the files of both ways must hold the same observations (checked).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from dcptool.dump import open_dumps  # noqa: E402
from dcptool.engine.recorder.record import Recorder  # noqa: E402


def run(path: Path, args, inline: bool) -> dict:
    rng = np.random.default_rng(0)
    rec = Recorder(path, dcp_size=2, rollover=args.rollover)
    rec._writer._rolled.sync = inline  # (the baseline: the rolled file packed and written inside observe())
    seq = torch.from_numpy(rng.integers(1, 1 << 16, args.reqs).astype(np.int32))
    pos = torch.from_numpy(rng.integers(0, 1 << 16, args.tokens).astype(np.int64))
    slots = torch.from_numpy(rng.integers(0, 1 << 20, (1, args.tokens)).astype(np.int64))
    times = np.empty(args.obs)
    for i in range(args.obs):
        t = time.perf_counter()
        rec.observe(step=i, site="attn_metadata", rank=0, seq_lens=seq, num_reqs=args.reqs,
                    num_reqs_padded=args.reqs, dcp_local_seq_lens=seq, positions=pos, slot_mapping=slots)
        times[i] = time.perf_counter() - t
    t = time.perf_counter()
    files = rec.close()
    closing = time.perf_counter() - t
    rolled = times[args.rollover - 1::args.rollover]
    return {"files": files, "median": np.median(times), "p999": np.quantile(times, 0.999), "max": times.max(),
            "rolled": rolled.max() if rolled.size else 0.0, "close": closing}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--obs", type=int, default=30_000)
    ap.add_argument("--rollover", type=int, default=10_000)
    ap.add_argument("--reqs", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=768)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        got = {name: run(Path(d) / f"{name}.safetensors", args, inline)
               for name, inline in (("inline", True), ("background", False))}
        a, b = (open_dumps([str(f) for f in got[k]["files"]]) for k in ("inline", "background"))
        assert a.n == b.n == args.obs and a["obs.step"].tolist() == b["obs.step"].tolist()
        print(f"{args.obs:,} observe() calls, rollover={args.rollover:,}, {args.reqs} requests, {args.tokens} tokens "
              f"(host tensors); {len(got['inline']['files'])} files each")
        print(f"{'write':<12}{'median ms':>11}{'p99.9 ms':>11}{'max ms':>10}{'rolling ms':>12}{'close() ms':>12}")
        for name, r in got.items():
            print(f"{name:<12}{r['median'] * 1e3:>11.3f}{r['p999'] * 1e3:>11.3f}{r['max'] * 1e3:>10.1f}"
                  f"{r['rolled'] * 1e3:>12.1f}{r['close'] * 1e3:>12.1f}")


if __name__ == "__main__":
    main()
