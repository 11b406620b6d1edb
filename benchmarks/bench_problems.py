"""Problem grouping against replay itself, in one run (CPU).

    python benchmarks/bench_problems.py [--steps 400,1600]

Simulates a legacy recording (DCP 4, PCP 2: every fault), replays it, then times the grouping of its findings into
problems (problems.problems: the keys read from the findings' columns, the vectorised grouping) against, as the
baseline, the replay that made the findings. Prints findings, problems, the times and grouping's share of the
replay.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dcptool.check.problems import problems  # noqa: E402
from dcptool.check.replay import replay  # noqa: E402
from dcptool.dump import open_dumps
from dcptool.model.simulate import SimConfig, simulate  # noqa: E402


def best(f, k: int = 3) -> tuple[float, object]:
    out, t = None, float("inf")
    for _ in range(k):
        t0 = time.perf_counter()
        out = f()
        t = min(t, time.perf_counter() - t0)
    return t, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default="400,1600")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for steps in (int(s) for s in args.steps.split(",")):
            path = Path(tmp) / f"legacy{steps}.safetensors"
            simulate(SimConfig(pipeline="legacy", dcp=4, pcp=2, steps=steps), path)
            measure(open_dumps([str(path)]), steps)


def measure(d, steps: int) -> None:
    t_rep, res = best(lambda: replay(d, "torch"), 1)
    t_grp, probs = best(lambda: problems(d, res.findings))
    print(f"steps {steps}: {d.n} observations, {len(res.findings)} findings -> {len(probs)} problems; "
          f"replay {t_rep:.3f} s, grouping {t_grp * 1e3:.1f} ms ({t_grp / t_rep:.1%} of the replay)")


if __name__ == "__main__":
    main()
