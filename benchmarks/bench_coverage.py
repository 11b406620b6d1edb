"""What issue 15's checks (empty-mask, tot-lens, rank-agree) add to a replay, on a simulated clean dump.

    python benchmarks/bench_coverage.py                  # DCP 4, PCP 2, 400 steps, decodes without drafts
    python benchmarks/bench_coverage.py --steps 2000

Prints the replay time with and without the three checks (best of 5, same process, same dump) and their
ratio, then each check's own time. The dump records dcp_query_start_loc and the global companion on every
FlashInfer decode build, so empty-mask and tot-lens run on most observations.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def best(f, k: int = 5) -> float:
    out = float("inf")
    for _ in range(k):
        t0 = time.perf_counter()
        f()
        out = min(out, time.perf_counter() - t0)
    return out


def main() -> None:
    import dcptool.replay as R
    from dcptool.dump import open_dumps
    from dcptool.simulate import SimConfig, simulate

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--backend", default="torch")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        res = simulate(SimConfig(dcp=4, pcp=2, steps=a.steps, spec_tokens=0, cudagraph="piecewise"),
                       Path(tmp) / "b.safetensors", force=True)
        d = open_dumps(res.files)
    checks = (R.check_empty_mask, R.check_tot_lens, R.check_rank_agree)
    assert R.replay(d, a.backend).findings == []
    with_ = best(lambda: R.replay(d, a.backend))
    R.check_empty_mask = R.check_tot_lens = R.check_rank_agree = lambda d: []
    try:
        without = best(lambda: R.replay(d, a.backend))
    finally:
        R.check_empty_mask, R.check_tot_lens, R.check_rank_agree = checks
    print(f"{d.n} observations, {int(d['rows.seq_lens'].size)} seq_lens rows, "
          f"{int(d['rows.dcp_query_start_loc'].size)} dcp_query_start_loc rows")
    print(f"replay: {with_:.3f} s with the issue-15 checks, {without:.3f} s without (ratio {with_ / without:.2f})")
    for name, f in zip(("empty-mask", "tot-lens", "rank-agree"), checks):
        print(f"  {name}: {best(lambda f=f: f(d)):.4f} s")


if __name__ == "__main__":
    main()
