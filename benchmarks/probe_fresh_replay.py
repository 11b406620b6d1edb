"""Where a fresh `dcptool replay --backend triton` process spends its time, on a GPU machine (on a CPU it runs, the
triton backend there being the interpreter).

    python benchmarks/probe_fresh_replay.py [--obs 1e6]

Prints: the read floor and each backend as fresh processes; a fresh process's start-up steps timed one after the
other (the driver's start-up, cuda-core and the primary context, the kernels from dcptool's cubin cache, pinned
memory, a copy's speed; torch's import last, for comparison); and the cumulative profile of a fresh
`--backend triton` process (its main thread: the waits on the read and on the GPU show as such).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from bench_auto import FLOOR, env, timed, warm_dump  # noqa: E402

STEPS = r"""
import time; t = [time.perf_counter()]
def lap(name): t.append(time.perf_counter()); print(f"  {name:<40} {t[-1] - t[-2]:6.3f} s", flush=True)
import numpy as np; lap("import numpy")
import dcptool.dump, dcptool.check.replay; lap("import dcptool's replay")
from dcptool.gpu import cuda
ok = cuda.available(); lap(f"the driver: cuInit, devices ({ok})")
if ok:
    g = cuda.gpu(); lap("cuda.core, primary context (cuda.gpu())")
    from dcptool.gpu.scan_cuda import Fn
    c = dict(DCP_SIZE=4, INTERLEAVE=1, PAGE=16, HAS_PAGES=True, BLOCK=256)
    Fn(g, "flag_rows_kernel", c, 2); Fn(g, "check_rows_kernel", c, 4); Fn(g, "differ_rows_kernel", {"BLOCK": 256}, 2)
    lap("3 kernels (dcptool's cubin cache)")
    h = [g.pinned(1 << 24, np.int32)[0] for _ in range(6)]; lap("6 x 64 MB pinned (cuMemAllocHost)")
    s = g.stream(); d = g.alloc(1 << 26, s); g.sync(s); h[0][:] = 1; lap("touch 64 MB pinned")
    t0 = time.perf_counter(); [g.to_device(d, h[0], s) for _ in range(16)]; g.sync(s)
    print(f"  H2D from pinned: {16 * 64 / 1024 / (time.perf_counter() - t0):.1f} GB/s", flush=True); lap("copies")
import sys; print("  torch imported so far:", "torch" in sys.modules)
import torch; lap("import torch (for comparison: no longer on the path)")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--obs", default="1e6")
    ap.add_argument("--data", default=str(ROOT / "bench-data"))
    a = ap.parse_args()
    p = warm_dump(a.data, int(float(a.obs)))
    for name, cmd in [("floor", [sys.executable, "-c", FLOOR, p])] + [
            (b, [sys.executable, "-m", "dcptool", "replay", p, "--json", "--backend", b]) for b in ("torch", "triton")]:
        print(f"{name}: " + ", ".join(f"{timed(cmd)[0]:.2f}" for _ in range(2)) + " s", flush=True)
    print("a fresh process's start-up, step by step:", flush=True)
    subprocess.run([sys.executable, "-c", STEPS], env=env())
    print("cProfile of a fresh --backend triton process (main thread, cumulative):", flush=True)
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "cProfile", "-s", "cumtime", "-m", "dcptool", "replay", p, "--json",
                          "--backend", "triton"], capture_output=True, text=True, env=env())
    print(f"(wall {time.perf_counter() - t:.2f} s)")
    lines = out.stdout.splitlines()
    start = next((i for i, s in enumerate(lines) if "cumtime" in s), 0)
    print("\n".join(lines[start:start + 60]))


if __name__ == "__main__":
    main()
