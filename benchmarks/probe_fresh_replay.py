"""Where a fresh `dcptool replay --backend triton` process spends its time (issue 28 item 9), on a GPU machine
(written for the next GPU session: on a CPU it runs, the triton backend there being the interpreter).

    python benchmarks/probe_fresh_replay.py [--obs 1e6]

Prints: the read floor and each backend as fresh processes; a fresh process's start-up steps timed one after the
other (import torch, CUDA's start-up, triton's import, the scan kernel's load); and the cumulative profile of a
fresh `--backend triton` process (its main thread: the waits on the read and on the GPU show as such).
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
def lap(name): t.append(time.perf_counter()); print(f"  {name:<34} {t[-1] - t[-2]:6.3f} s")
import numpy; lap("import numpy")
import dcptool.dump, dcptool.check.replay; lap("import dcptool's replay")
import torch; lap("import torch")
torch.cuda.is_available(); lap("torch.cuda.is_available()")
if torch.cuda.is_available():
    torch.zeros(1, device="cuda"); torch.cuda.synchronize(); lap("CUDA start-up (first tensor)")
import triton; lap("import triton")
import dcptool.dcp.backend; lap("dcptool.dcp.backend")
import dcptool.check.gpu; lap("import check.gpu")
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
