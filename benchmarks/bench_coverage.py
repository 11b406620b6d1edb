"""What the decode and cross-rank checks (empty-mask, tot-lens, rank-agree) add to a replay, on a simulated clean dump.

    python benchmarks/bench_coverage.py                  # DCP 4, PCP 2, 400 steps, decodes without drafts
    python benchmarks/bench_coverage.py --steps 2000
    python benchmarks/bench_coverage.py --slots          # slots + slot-partition, old vs new
    python benchmarks/bench_coverage.py --slots --inject slot-wrong-group,slot-all-ranks   # with findings
    python benchmarks/bench_coverage.py --slots --dump x.safetensors

--slots: on a dense recording (DCP 8, 3000 steps, fixed pipeline: 99,008 observations, 86 million slot
entries, 1.1 GB) prints each slot check's time, old (the whole-column implementation), chunked (main d07e667's,
before the screen; both kept in tests/slot_reference.py) and new, that they agree, and per variant a replay
in a fresh process: load time, replay time, replay/load ratio and its peak RSS against the dump's size.
The new pass (slot_pass) computes slot-partition's members with the slots findings, so "both" is the figure to
compare.

    python benchmarks/bench_coverage.py --slots --no-old --dump bench-data/legacy-dcp8-3000.safetensors

Prints the replay time with and without the three checks (best of 5, same process, same dump) and their
ratio, then each check's own time. The dump records dcp_query_start_loc and the global companion on every
FlashInfer decode build, so empty-mask and tot-lens run on most observations.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
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
    import dcptool.check.decode as DEC
    import dcptool.check.ranks as RK
    import dcptool.check.replay as R
    from dcptool.check.findings import Written
    from dcptool.dump import open_dumps
    from dcptool.model.simulate import SimConfig, simulate

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--slots", action="store_true", help="time slots and slot-partition, old vs new")
    ap.add_argument("--inject", default="", help="--slots: faults to inject (simulate's --inject)")
    ap.add_argument("--dump", help="--slots: this recording instead of a simulated one")
    ap.add_argument("--no-old-replay", action="store_true", help="--slots: skip the old replay (~1 min, 16 GB)")
    ap.add_argument("--no-old", action="store_true", help="--slots: skip the whole-column variant altogether")
    a = ap.parse_args()
    if a.slots:
        return slots(a)
    with tempfile.TemporaryDirectory() as tmp:
        res = simulate(SimConfig(dcp=4, pcp=2, steps=a.steps, spec_tokens=0, cudagraph="piecewise"),
                       Path(tmp) / "b.safetensors", force=True)
        d = open_dumps(res.files)
    # (replay finds each check by the name the rule table gives: replaced there, they find nothing)
    names = {"empty-mask": (DEC, "check_empty_mask"), "tot-lens": (DEC, "check_tot_lens"),
             "rank-agree": (RK, "check_rank_agree")}
    checks = tuple(getattr(m, n) for m, n in names.values())
    assert R.replay(d, a.backend).findings == []
    with_ = best(lambda: R.replay(d, a.backend))
    for m, n in names.values():
        setattr(m, n, lambda d, *_: Written(d).table())
    try:
        without = best(lambda: R.replay(d, a.backend))
    finally:
        for (m, n), f in zip(names.values(), checks):
            setattr(m, n, f)
    print(f"{d.n} observations, {int(d['rows.seq_lens'].size)} seq_lens rows, "
          f"{int(d['rows.dcp_query_start_loc'].size)} dcp_query_start_loc rows")
    print(f"replay: {with_:.3f} s with the three checks, {without:.3f} s without (ratio {with_ / without:.2f})")
    for name, f in zip(("empty-mask", "tot-lens", "rank-agree"), checks):
        print(f"  {name}: {best(lambda f=f: f(d)):.4f} s")


_REPLAY = """
import json, resource, sys, time
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
import dcptool.check.replay as R
import dcptool.check.slots as S
from dcptool.check.findings import FindingTable
from dcptool.dump import open_dumps
if {variant!r} != "new":
    import slot_reference as ref
    S.check_slot_rules = lambda d: FindingTable.concat(d, [getattr(ref, {variant!r} + "_check_slots")(d),
                                                           getattr(ref, {variant!r} + "_check_slot_partition")(d)])
t0 = time.perf_counter(); d = open_dumps([{path!r}]); t1 = time.perf_counter()
res = R.replay(d, {backend!r}); t2 = time.perf_counter()
# VmHWM: this process's own peak (ru_maxrss also counts the parent's RSS at fork: Linux keeps it over exec)
hwm = [int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM:")]
rss = hwm[0] * 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({{"load": t1 - t0, "replay": t2 - t1, "findings": len(res.findings), "rss": rss}}))
"""


def slots(a) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import slot_reference as ref
    from typer.testing import CliRunner

    import dcptool.check.slots as R
    from dcptool.check.slot_pass import slot_pass
    from dcptool.cli import app
    from dcptool.dump import open_dumps

    with tempfile.TemporaryDirectory() as tmp:
        path = a.dump
        if path is None:
            path = str(Path(tmp) / "dense.safetensors")
            args = ["simulate", "--dcp", "8", "--steps", "3000", "--pipeline", "fixed", "-o", path, "--force"]
            r = CliRunner().invoke(app, args + (["--inject", a.inject] if a.inject else []))  # as the CLI makes it
            assert r.exit_code == 0, r.output
        size = os.path.getsize(path)
        d = open_dumps([path])
        print(f"{d.n} observations, {int(d['obs.slots'][-1])} slot entries, {size / 2**30:.2f} GiB")
        variants = ("chunked", "new") if a.no_old else ("old", "chunked", "new")
        impl = {v: (getattr(ref, v + "_check_slots"), getattr(ref, v + "_check_slot_partition")) for v in variants[:-1]}
        pair: dict = {}  # the new: one pass for both rules (slot_pass, as check_slot_rules), timed under check_slots
        impl["new"] = (lambda d: pair.setdefault("r", slot_pass(d))[0],
                       lambda d: R.check_slot_partition(d, pair.pop("r")[1]))
        tot = dict.fromkeys(variants, 0.0)
        got = {}
        for v in variants:
            for k, name in enumerate(("check_slots", "check_slot_partition")):
                t0 = time.perf_counter()
                got[v, k] = impl[v][k](d)
                tot[v] += (dt := time.perf_counter() - t0)
                print(f"  {v} {name}: {dt:.2f} s, {len(got[v, k])} findings")
        for v in variants[:-1]:
            same = all(got[v, k] == got["new", k] for k in (0, 1))
            print(f"  both: {v} {tot[v]:.2f} s, new {tot['new']:.2f} s (ratio {tot[v] / tot['new']:.1f}), "
                  f"{'same' if same else 'DIFFERENT'} findings")
        del d, got
        for variant in variants:
            if variant == "old" and a.no_old_replay:
                continue
            code = _REPLAY.format(root=str(ROOT), tests=str(ROOT / "tests"), variant=variant, path=path,
                                  backend=a.backend)
            r = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                          check=True).stdout.strip().splitlines()[-1])
            print(f"replay ({variant} slot checks, fresh process): load {r['load']:.2f} s, replay {r['replay']:.2f} s "
                  f"(replay/load {r['replay'] / r['load']:.1f}), {r['findings']} findings, peak RSS "
                  f"{r['rss'] / 2**30:.2f} GiB = {r['rss'] / size:.2f}x the dump")


if __name__ == "__main__":
    main()
