"""What recording costs: the Recorder per observation (256-row batch) and simulate's observations per second.

    python benchmarks/bench_record.py [--obs 20000] [--sim-steps 400]

Baselines in the same run: for the Recorder, the bare host copies any recorder must make (three
numpy copies of the same arrays) — the ratio is the Recorder's overhead over that floor; for
simulate, writing the same observations' columns with one write_dump call (no simulation).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dcptool.dump import read_dump, write_dump  # noqa: E402
from dcptool.record import Recorder  # noqa: E402
from dcptool.simulate import SimConfig, simulate  # noqa: E402


def bench_recorder(n: int, tmp: Path) -> None:
    rng = np.random.default_rng(0)
    seq = torch.from_numpy(rng.integers(1, 1 << 17, 256).astype(np.int32))
    dcp = torch.from_numpy(rng.integers(1, 1 << 15, 256).astype(np.int32))
    qsl = torch.arange(257, dtype=torch.int32)
    t = time.perf_counter()
    keep = []
    for _ in range(n):  # the floor: three private host copies per observation
        keep.append((seq.numpy().copy(), dcp.numpy().copy(), qsl.numpy().copy()))
    floor = (time.perf_counter() - t) / n
    del keep
    with Recorder(tmp / "r.safetensors", dcp_size=2) as rec:
        t = time.perf_counter()
        for i in range(n):
            rec.observe(step=i, site="attn_metadata", rank=i % 2, seq_lens=seq, num_reqs=250, num_reqs_padded=256,
                        dcp_local_seq_lens=dcp, query_start_loc=qsl)
        per = (time.perf_counter() - t) / n
        t = time.perf_counter()
    close = time.perf_counter() - t
    assert read_dump(tmp / "r.safetensors").n == n
    print(f"| Recorder.observe, 256 rows (torch CPU tensors) | {per * 1e6:.1f} µs/obs | host-copy floor "
          f"{floor * 1e6:.1f} µs/obs | {per / floor:.1f}x | close() wrote {n:,} obs in {close:.2f} s |")


def bench_simulate(steps: int, tmp: Path) -> None:
    cfg = SimConfig(dcp=8, steps=steps, pipeline="legacy")
    t = time.perf_counter()
    res = simulate(cfg, tmp / "s.safetensors", force=True)
    sec = time.perf_counter() - t
    d = read_dump(tmp / "s.safetensors")
    cols = {k: np.array(v) for k, v in d.columns.items()}
    t = time.perf_counter()
    write_dump(tmp / "w.safetensors", d.config, cols, d.injected[0])
    write = time.perf_counter() - t
    print(f"| simulate --dcp 8 --steps {steps} --pipeline legacy | {res.observations:,} obs in {sec:.1f} s = "
          f"{res.observations / sec:,.0f} obs/s | write_dump of the same columns {write:.2f} s | "
          f"{sec / max(write, 1e-9):.0f}x | {(tmp / 's.safetensors').stat().st_size / 1e6:.0f} MB |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--obs", type=int, default=20000)
    ap.add_argument("--sim-steps", type=int, default=4000)
    args = ap.parse_args()
    print("| what | cost | baseline | ratio | notes |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        bench_recorder(args.obs, Path(d))
        bench_simulate(args.sim_steps, Path(d))


if __name__ == "__main__":
    main()
