"""Always on, proved: the Guard over 10^6 builds of bench_guard's engine-like loop, eager and inside a captured CUDA
graph, then a fault planted near the end, caught and dumped.

    python benchmarks/soak_guard.py [--builds 1000000] [--fault-at BUILDS-1000] [--keep 64] [--per-step 8]
                                    [--shape decode256] [--fields device] [--modes eager,graph] [--samples 64]
    python benchmarks/soak_guard.py --fields all --builds 200000          (a GPU: every host value too, fewer builds)
    python benchmarks/soak_guard.py --smoke [--fields all]   (CPU: 2,000 builds eager under Triton's interpreter, the
                                                              fault at 1,500, keep 16, 4 a step; graph: needs CUDA)

Each step refreshes the batch's metadata buffers and their host mirror (guard_engine.Engine, no matmuls: the soak
proves properties, bench_guard.py times them) and hands the Guard --per-step builds with the keywords of --fields, as
the vLLM plugin hands them (Guard.record). The default, `device`, is every device tensor the plugin passes (every
check of the kernel); `all` adds the host values (the host checks of addresses, capacities, host copies, plans and
block sizes: their Python costs several times the rest a build, hence fewer builds in the same time). Eager: --builds
builds, each observed from the host, step = the build's index. Graph: one step run eagerly (the ring allocated, the
kernel compiled), one step captured (graph=FULL_CAPTURE), replayed until --builds builds were checked; the device
counter counts every replay's builds. In both, over the clean builds before the fault: host RSS (/proc/self/statm)
and the device's memory_allocated / memory_reserved, sampled --samples times, flat (the last quarter's highest sample
at most the first quarter's plus a tolerance: host 4 MiB, allocated 0, reserved 2 MiB: one segment of the caching
allocator); host synchronisations counted (torch.cuda.set_sync_debug_mode("warn"), counted as warned); no build
whose host values (--fields all: the host copy of seq_lens, FlashInfer's plans) found the Guard's host-values ring
full (their device comparisons then left undecided: Guard.host_undecided); nothing
written (the Guard's directory absent or empty, no dump). Then the fault: the DCP view one row off at build
--fault-at (eager: that build alone; graph: the replay holding it, so the first build of that replay, --fault-at
rounded down to a multiple of --per-step, is the first wrong one), the run goes on to --builds. The Guard must name
that build and rule, and its dump, read back with read_dump, must hold the last --keep builds in order, the fault
last (each observation's seq_lens and, eager, its step are those of its build), and replay of the dump must report
the fault's rule (mismatch) and nothing else.

Prints one table (a row per property, a column per mode) and exits 1 if any property fails (0: all hold). The
eager loop is bound by the host (observe()'s Python and the step's refresh): each mode's line as it ends, and the
table's builds/s row, say what it ran at, so --builds can be chosen for another budget.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import guard_engine as ge  # noqa: E402

from dcptool.check.replay import replay  # noqa: E402
from dcptool.dump import read_dump  # noqa: E402
from dcptool.engine.guard.guard import Guard  # noqa: E402

MIB = 1 << 20
TOLERANCE = {"host RSS": 4 * MIB, "device allocated": 0, "device reserved": 2 * MIB}
FAULT_RULE, REPLAY_RULE = "values", "mismatch"  # the Guard's check a view one row off breaks, and replay's rule


def rss() -> int:
    """The process's resident set now, in bytes (/proc; where there is none, the peak, which a leak raises too)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def sample(dev: torch.device) -> tuple[int, int, int]:
    """(host RSS, device memory allocated, reserved); no synchronisation."""
    if dev.type != "cuda":
        return rss(), 0, 0
    return rss(), torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)


def flat(samples: list) -> dict[str, tuple[int, int, bool]]:
    """Per quantity: the first quarter's and the last quarter's highest sample, and whether it stayed flat."""
    a = np.array(samples, np.int64).reshape(-1, 3)
    q = max(1, len(a) // 4)
    out = {}
    for k, name in enumerate(TOLERANCE):
        first, last = int(a[:q, k].max()), int(a[-q:, k].max())
        out[name] = (first, last, last - first <= TOLERANCE[name])
    return out


def _guard(tmp: Path, name: str, keep: int) -> Guard:
    return Guard(tmp / name, ge.N, ge.INTERLEAVE, keep=keep, kernel=True, **ge.guard_config())


def _written(g: Guard) -> bool:
    return g.dumped is not None or (g.dir.exists() and any(g.dir.iterdir()))


def _marks(first: int, stop: int, samples: int) -> set[int]:
    """The steps (replays) after which memory is sampled: `samples` of them, evenly over [first, stop)."""
    return {int(x) for x in np.linspace(first, max(first, stop - 1), samples)}


def soak_eager(e: ge.Engine, dev, tmp: Path, a) -> dict:
    """--builds builds observed from the host, the fault at build --fault-at alone."""
    g = _guard(tmp, "eager", a.keep)
    e.reset()
    per, fault_step, fault_j = a.per_step, *divmod(a.fault_at, a.per_step)
    marks, mem, b = _marks(1, fault_step, a.samples), [], 0
    with ge.SyncCount(dev) as sc:
        t0 = time.perf_counter()
        for s in range(fault_step):
            e.update()
            for _ in range(per):
                e.observe(g, b)
                b += 1
            if s in marks:
                mem.append(sample(dev))
        ge.sync(dev)
        took = time.perf_counter() - t0
    written = _written(g)
    for s in range(fault_step, a.builds // per):
        e.update()
        for j in range(per):
            if s == fault_step and j == fault_j:
                e.dcp[3] += 1  # what a stale buffer does: this build's view one row off
                e.observe(g, b)
                e.dcp[3] -= 1
            else:
                e.observe(g, b)
            b += 1
    return _verdict(g, e, dict(builds=b, clean=a.fault_at, seconds=took, syncs=sc.n, sync_at=sc.first, mem=mem,
                               written=written, fault=a.fault_at, per=per, steps=True))


def soak_graph(e: ge.Engine, dev, tmp: Path, a) -> dict:
    """One step eager, one captured, replayed until --builds builds; the fault in the replay holding --fault-at."""
    g = _guard(tmp, "graph", a.keep)
    e.reset()
    e.faultable = True  # (the captured refresh adds e.fault to one row of the view: 0 until the fault's replay)
    per = a.per_step
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        e.update()
        for b in range(per):
            e.observe(g, b)  # warm: the ring and the launch, outside capture
    torch.cuda.current_stream().wait_stream(side)
    cg = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cg):
        e.update()
        e.captured()
        for _ in range(per):
            e.observe(g, per)
    torch.cuda.synchronize()
    replays, fault_replay = a.builds // per - 1, a.fault_at // per - 1  # (replay k checks builds (k + 1) * per ...)
    marks, mem = _marks(1, fault_replay, a.samples), []
    with ge.SyncCount(dev) as sc:
        t0 = time.perf_counter()
        for k in range(fault_replay):
            cg.replay()
            if k in marks:
                mem.append(sample(dev))
        torch.cuda.synchronize()
        took = time.perf_counter() - t0
    written = _written(g)
    e.fault.fill_(1)
    cg.replay()
    e.fault.fill_(0)
    for _ in range(fault_replay + 1, replays):
        cg.replay()
    e.faultable = False
    return _verdict(g, e, dict(builds=per * (replays + 1), clean=(fault_replay + 1) * per, seconds=took,
                               syncs=sc.n, sync_at=sc.first, mem=mem, written=written,
                               fault=(fault_replay + 1) * per, per=per,
                               steps=False))


def _verdict(g: Guard, e: ge.Engine, r: dict) -> dict:
    """Close the Guard; its counts, its first wrong build and rule, and its dump read back: the last `keep` builds
    in order, the fault last (seq_lens[0] of build b is the base's + 1 + b // per; eager, step b), replay's rules."""
    path = g.close()
    r.update(count=g.count, dropped=g.dropped, first=(g.first_index, g.first_rule), path=path,
             undecided=g.host_undecided)
    if path is None:
        return dict(r, kept=0, in_order=False, rules=[])
    d = read_dump(path)
    want = np.arange(r["fault"] - d.n + 1, r["fault"] + 1)
    seq0 = np.array([int(d.seq_lens_of(i)[0]) for i in range(d.n)])
    order = np.array_equal(seq0, int(e.base_np[0]) + 1 + want // r["per"])
    if r["steps"]:
        order &= np.array_equal(d.columns["obs.step"].astype(np.int64), want)
    rules = sorted({f.rule for f in replay(d, "torch").findings})
    return dict(r, kept=d.n, in_order=bool(order), rules=rules)


def _mib(x: int) -> str:
    return f"{x / MIB:.1f}"


def table(results: dict, a) -> bool:
    """Print the properties, a column per mode; True when every one holds."""
    modes = list(results)
    rows, ok = [], True

    def row(name: str, cells: list[tuple[str, bool | None]]) -> None:
        nonlocal ok
        ok &= all(c[1] is not False for c in cells)
        rows.append(f"| {name} | " + " | ".join(v + ("" if c is None else " ✓" if c else " ✗ FAIL")
                                                  for v, c in cells) + " |")

    def each(f) -> list[tuple[str, bool | None]]:
        return [f(results[m]) if results[m] is not None else ("- (capture needs CUDA)", None) for m in modes]

    row("builds checked (the Guard's count)", each(lambda r: (f"{r['count']:,} of {r['builds']:,}",
                                                              r["count"] == r["builds"] and r["dropped"] == 0)))
    row("clean builds / s", each(lambda r: (f"{r['clean'] / r['seconds']:,.0f} ({r['seconds']:.1f} s)", None)))
    for name in TOLERANCE:
        row(f"{name}, first → last quarter's highest (MiB; tolerance {_mib(TOLERANCE[name])})",
            each(lambda r, name=name: (lambda f: (f"{_mib(f[0])} → {_mib(f[1])}", f[2]))(flat(r["mem"])[name])
                 if a.cuda or name == "host RSS" else ("n/a (CPU)", None)))
    row("host syncs over the clean builds", each(lambda r: (str(r["syncs"]), r["syncs"] == 0) if a.cuda
                                                 else ("n/a (CPU)", None)))
    row("builds whose host values found no room (host-copy / plan-pages undecided)", each(
        lambda r: (f"{r['undecided']:,}", r["undecided"] == 0)))
    row("nothing written before the fault", each(lambda r: ("nothing" if not r["written"] else "WRITTEN",
                                                            not r["written"])))
    row("first wrong build, rule (want: the fault's)", each(lambda r: (
        f"{r['first'][0]:,}, {r['first'][1]} (fault at {r['fault']:,})",
        r["first"] == (r["fault"], FAULT_RULE))))
    row("dump: builds kept, in order, the fault last", each(lambda r: (
        f"{r['kept']} of keep {a.keep}, {'in order' if r['in_order'] else 'NOT in order'}",
        r["kept"] == a.keep and r["in_order"])))
    row(f"replay of the dump (want: {REPLAY_RULE} alone)", each(lambda r: (", ".join(r["rules"]) or "nothing",
                                                                          r["rules"] == [REPLAY_RULE])))
    print("| property | " + " | ".join(modes) + " |")
    print("|---|" + "---|" * len(modes))
    print("\n".join(rows))
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--builds", type=float, default=1e6, help="builds per mode (default 10^6)")
    ap.add_argument("--fault-at", type=float, default=None, help="the faulty build (default: --builds - 1000)")
    ap.add_argument("--keep", type=int, default=64, help="the Guard's flight recorder: builds a dump holds")
    ap.add_argument("--per-step", type=int, default=8, help="builds a step (a replay of the captured graph)")
    ap.add_argument("--shape", default="decode256", choices=list(ge.SHAPES))
    ap.add_argument("--fields", default="device", choices=list(ge.FIELDS), help="the keywords each build passes")
    ap.add_argument("--modes", default="eager,graph", help="comma-separated, of eager, graph")
    ap.add_argument("--samples", type=int, default=64, help="memory samples over the clean builds")
    ap.add_argument("--smoke", action="store_true", help="CPU: 2,000 builds, the fault at 1,500, keep 16")
    a = ap.parse_args()
    if a.smoke:
        a.builds, a.fault_at, a.keep, a.per_step, a.samples = 2000, 1500, 16, 4, 16
    a.builds = int(a.builds)
    a.fault_at = a.builds - 1000 if a.fault_at is None else int(a.fault_at)
    steps = a.builds // a.per_step
    if a.per_step < 1 or a.keep < 1 or a.builds % a.per_step:
        ap.error("--builds must be a multiple of --per-step (both >= 1), --keep >= 1")
    if not (a.keep + 2 * a.per_step <= a.fault_at < a.builds):
        ap.error(f"--fault-at must leave --keep builds and two steps before it and be below --builds: {a.fault_at}")
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"eager", "graph"}:
        ap.error(f"--modes: {a.modes!r}: choose among eager, graph")
    if steps >= ge.SPAN - (1 << 17):
        ap.error(f"--builds / --per-step = {steps:,} steps: the lengths would outgrow a request's slots ({ge.SPAN})")
    a.cuda = torch.cuda.is_available() and not a.smoke
    if not a.cuda and "eager" not in modes:
        ap.error("--modes: a graph needs CUDA (--smoke runs the eager mode on the CPU)")
    dev = torch.device("cuda" if a.cuda else "cpu")
    sizes = ge.SHAPES if a.cuda else ge.SMOKE
    e = ge.Engine(dev, sizes[a.shape], 8, torch.float32, a.fields, matmuls=0)
    name = torch.cuda.get_device_name() if a.cuda else "CPU (smoke: Triton's interpreter)"
    print(f"Guard soak on {name}: {a.shape} ({e.rows} req, {e.tokens} tok), fields {a.fields}, {a.builds:,} builds a "
          f"mode, {a.per_step} a step, keep {a.keep}, the fault (the view one row off) at build {a.fault_at:,}",
          flush=True)
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        warm = _guard(tmp, "warm", a.keep)  # (the kernel's compilation and the launch's one-time check: not soaked)
        e.reset()
        e.update()
        e.observe(warm, 0)
        warm.close()
        results: dict = {}
        for m in modes:
            if m == "graph" and not a.cuda:
                results[m] = None
                continue
            results[m] = r = (soak_eager if m == "eager" else soak_graph)(e, dev, tmp, a)
            print(f"{m}: {r['count']:,} builds checked, the clean {r['clean']:,} in {r['seconds']:.1f} s "
                  f"({r['clean'] / r['seconds']:,.0f} builds/s), host syncs: "
                  f"{format(r['syncs'], ',') if a.cuda else 'n/a (CPU)'}"
                  + (f" (the first at {r['sync_at']})" if r.get("sync_at") else ""), flush=True)
        ok = table(results, a)
    print("every property holds" if ok else "a property FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
