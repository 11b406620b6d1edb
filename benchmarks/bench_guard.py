"""What the Guard costs and what it catches, in bench_record's engine-like loop: eager and in a captured CUDA graph.

    python benchmarks/bench_guard.py [--shapes decode256,decode1024,prefill8192] [--fields all]
                                     [--steps 300] [--reps 5] [--replays 1000]     (a GPU: the table)
    python benchmarks/bench_guard.py --smoke                                      (CPU: the same code paths, tiny)
    python benchmarks/bench_guard.py --python [--before REV]                      (any machine: observe()'s Python)

Shapes (guard_engine.SHAPES): decode steps of 256 and 1,024 requests (one query token each) and a prefill step of 8
prompts whose query lengths sum to 8,192 tokens, half of them behind a context. Each step: an in-place refresh of the
metadata buffers (seq_lens, the DCP view, positions, the slot mappings, the per-group lengths) and of their host
mirror, 3 queued bf16 4096x4096 matmuls and 4 builds, each handed to the Guard as the vLLM plugin hands it
(Guard.record of state.observe's Record) with the keywords of --fields (guard_engine: `all`, the default, is every
field the plugin's hooks pass, so every check of the Guard runs; `flashinfer`, `flash_attn`, `mla` one backend's set;
`fast` the fast path's three rows). Guard off vs on vs the floor (an empty kernel launched per build instead: what any
check launched per build costs at least), interleaved in one run. Eager: ms per step (median of --reps), the added
µs per build over off for the Guard and for the floor and their ratio (the goal: at most 2), CPU µs per build in the
loop. Graph: the same step captured once (the builds inside the captured region, graph=FULL_CAPTURE), replayed
--replays times: the same columns per replay; the device counter must have counted every replay's builds. Host
synchronisations are counted with torch.cuda.set_sync_debug_mode("warn") over the guarded loops (close() excluded).
Then what it catches: a wrong view eager and inside a replayed graph (one dump each, replay names the rule), and every
simulate fault replay reports per observation, CUDA tensors through the kernel, against the host path's first wrong
observation and rule (tests/engine/guard/test_guard.py's workloads).

--smoke: CPU tensors through the kernel under Triton's interpreter (64x64 float32 matmuls, every shape scaled down:
8 and 16 decode rows, 8 prompts of 64 tokens; 3 steps, no graph: capture needs CUDA; two faults): it proves the
script runs and stays clean with every field, not what anything costs.

--python: the Python part of one eager observe() on the device path (the fast path's keywords, 256 rows), the launch
replaced by a stand-in (CPU tensors: no GPU needed), µs per observe, best of 9 x 50,000; and the same for the
dcptool of git revision --before (default: the Guard before the kernel decided host-copy and plan-pages), in a
subprocess; then the same for a build as the plugin hands it (Guard.record) with the fast keywords and with --fields'
(best of 9 x 2,000, this checkout and --before's dcptool with this checkout's guard_engine). A GPU adds the launch
itself (the launcher's C entry: a few µs) to the eager figure; nothing of the device is read back (the host copy of
seq_lens and FlashInfer's plans reach the kernel through host memory it reads).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests" / "engine" / "guard"),
                str(ROOT / "tests" / "model")]

import guard_engine as ge  # noqa: E402

from dcptool.check.replay import replay  # noqa: E402
from dcptool.dump import read_dump  # noqa: E402
from dcptool.engine.guard.guard import Guard  # noqa: E402

VARIANTS = ("off", "on", "floor")
BUILDS = 4  # builds a step (the first three behind a matmul each)


def _make(which: str, tmp: Path, name: str):
    """The loop's observer: none (off), a Guard dumping into tmp/name (on, the plugin's settings), or the floor's
    stand-in."""
    if which == "off":
        return None
    if which == "on":
        return Guard(tmp / name, ge.N, ge.INTERLEAVE, kernel=True, **ge.guard_config())
    return ge.Floor(tmp / f"{name}-floor.safetensors")


def eager(e: ge.Engine, dev, steps: int, reps: int, tmp: Path) -> dict:
    """Per-step time off, on and at the floor (interleaved), CPU per build, host syncs, the Guard's own counts."""
    per: dict = {v: [] for v in VARIANTS}
    cpu: dict = {"on": [], "floor": []}
    syncs, counts = 0, []
    for r in range(reps + 1):  # (the first: warm-up, not counted)
        for v in VARIANTS:
            g = _make(v, tmp, f"eager{r}")
            e.reset()
            ge.sync(dev)
            with ge.SyncCount(dev) as sc:
                t0 = time.perf_counter()
                for s in range(steps):
                    e.step(s, g, BUILDS)
                ge.sync(dev)
                dt = (time.perf_counter() - t0) / steps
            if g is not None:
                g.close()
                if v == "on":
                    counts.append((g.count - BUILDS * steps, g.wrong, g.dumped, g.dropped))
            if r:
                per[v].append(dt)
                if g is not None:
                    cpu[v].append(e.spent / (BUILDS * steps))
                syncs += sc.n if v == "on" else 0
    out = {v: float(np.median(per[v])) for v in VARIANTS}
    return dict(out, cpu=float(np.median(cpu["on"])), cpu_floor=float(np.median(cpu["floor"])), syncs=syncs,
                counts=counts)


def graph(e: ge.Engine, replays: int, reps: int, tmp: Path) -> dict:
    """The step captured (builds inside), replayed: per-replay time off, on and at the floor, syncs, the device
    counter."""
    per: dict = {v: [] for v in VARIANTS}
    syncs, counted = 0, []
    for r in range(reps + 1):
        for v in VARIANTS:
            g = _make(v, tmp, f"graph{r}")
            e.reset()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                e.step(0, g, BUILDS)  # warm: compilation and the ring, outside capture
            torch.cuda.current_stream().wait_stream(s)
            cg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cg):
                e.step(1, g, BUILDS, capture=True)
            torch.cuda.synchronize()
            with ge.SyncCount(e.a.device) as sc:
                t0 = time.perf_counter()
                for _ in range(replays):
                    cg.replay()
                torch.cuda.synchronize()
                dt = (time.perf_counter() - t0) / replays
            if g is not None:
                g.close()
                if v == "on":  # (the warm step's builds; the capture launches nothing)
                    counted.append((g.count - BUILDS - BUILDS * replays, g.wrong, g.dumped, g.dropped))
            if r:
                per[v].append(dt)
                syncs += sc.n if v == "on" else 0
    return dict({v: float(np.median(per[v])) for v in VARIANTS}, syncs=syncs, counts=counted)


def caught(e: ge.Engine, dev, tmp: Path, in_graph: bool, host_copy: bool = False) -> str:
    """A wrong view (one row off) eager, or set after capture and seen by a replay, or (host_copy) a host copy of
    seq_lens one row off, eager (a check of the host values): one dump, replay's rules."""
    g = Guard(tmp / f"caught-{in_graph}-{host_copy}", ge.N, ge.INTERLEAVE, kernel=True, **ge.guard_config())
    e.reset()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        e.step(0, g, BUILDS)
        if in_graph:
            cg = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            e.captured()
            with torch.cuda.graph(cg):
                for _ in range(BUILDS):
                    e.observe(g, 1)
            for _ in range(10):
                cg.replay()
            e.dcp[3] += 1  # what a stale buffer does between replays
            cg.replay()
        elif host_copy:
            e.kv["host_seq_lens"] = e.kv["host_seq_lens"] + (np.arange(e.rows) == 3)
            e.observe(g, 1)
        else:
            e.dcp[3] += 1
            e.observe(g, 1)
        path = g.close()
    n = sum("dcptool Guard" in str(x.message) for x in w)
    if path is None:
        return "NOT CAUGHT"
    rules = sorted({f.rule for f in replay(read_dump(path), "torch").findings})
    return f"{n} warning, 1 dump of {read_dump(path).n} observations, replay: {', '.join(rules)}"


def replayed(e: ge.Engine, tmp: Path) -> str:
    """The builds the loop hands the Guard, recorded (a Recorder, the same settings: every field kept) over one
    step and replayed: every rule of replay, the Guard's and the rest, finds nothing in them."""
    from dcptool.engine.recorder.record import Recorder

    rec = Recorder(tmp / "replayed.safetensors", dcp_size=ge.N, cp_interleave=ge.INTERLEAVE, force=True,
                   **ge.guard_config())
    e.reset()
    e.step(0, rec, BUILDS)
    files = rec.close()
    found = replay(read_dump(files[0]), "torch").findings
    rules = sorted({f.rule for f in found})
    return f"{len(rec)} builds, {rec.dropped} dropped, " + (f"FINDINGS: {', '.join(rules)}" if rules else "no finding")


def faults(dev, tmp: Path, which: list[str]) -> list[tuple[str, str]]:
    """Each per-observation simulate fault, CUDA tensors (or CPU under the interpreter) through the kernel, eager:
    the same first wrong observation and rule as the host path."""
    from test_guard import guard_of, observations, run_sim

    out = []
    for f in which:
        (tmp / f).mkdir()
        d = run_sim(tmp / f, f)
        res = {}
        for kernel in (False, True):
            g = guard_of(d, tmp / f / str(kernel), kernel=kernel, on_wrong="count")
            for kw in observations(d, True):
                g.observe(**{k: v.to(dev) if kernel and isinstance(v, torch.Tensor) else
                             {j: m.to(dev) for j, m in v.items()} if kernel and isinstance(v, dict) else v
                             for k, v in kw.items()})
                if g.first_rule is not None or (kernel and g._dev is not None and g._dev.wrong_seen()):
                    break
            g.close()
            res[kernel] = (g.first_index, g.first_rule)
        out.append((f, "same" if res[True] == res[False] and res[True][1] else f"DIFFERENT: {res}"))
    return out


# the Guard deciding host-copy and plan-pages on the host, reading the device's seq_lens and query_start_loc (the
# revisions before the guard package no longer run python_cost: their modules moved)
BEFORE = "6889c30"


def python_cost() -> float:
    """µs of Python per eager observe(): the device path with the launch replaced by a stand-in (self-contained:
    --before runs it in a subprocess against another revision's dcptool)."""
    import tempfile
    import timeit

    import numpy as np
    import torch

    from dcptool.engine.guard.device_checks import GuardDevice
    from dcptool.engine.guard.guard import Guard

    class Stand:  # (the old launch: kernel[grid](...))
        def __getitem__(self, grid):
            return lambda *a, **k: None

    rows = 256
    seq = torch.from_numpy(np.random.default_rng(0).integers(1, 1 << 17, rows).astype(np.int32))
    dcp = (seq + 1) // 2
    qsl = torch.arange(rows + 1, dtype=torch.int32)
    g = Guard(tempfile.mkdtemp(), 2, 1, kernel=True, on_wrong="count")
    g._dev = dev = GuardDevice(torch, seq.device, g.keep, g._spec, None, None)
    dev.kernel = Stand()
    dev.go = lambda *a: None
    kw = dict(site="attn_metadata", rank=0, seq_lens=seq, num_reqs=rows, num_reqs_padded=rows, dcp_local_seq_lens=dcp,
              query_start_loc=qsl)
    n = 50_000
    t = min(timeit.repeat(lambda: g.observe(step=1, **kw), number=n, repeat=9)) / n
    if g.dropped or g.count < n:
        raise RuntimeError(f"observe() dropped {g.dropped} of {g.count + g.dropped}")
    return t * 1e6


def python_fields(fields: str, n: int = 2000) -> float:
    """µs of Python per eager build as the plugin hands it (Guard.record of a Record with the keywords of `fields`,
    decode256's 256 rows, CPU tensors), the launch a stand-in: best of 9 x n (this checkout only)."""
    import timeit

    from dcptool.engine.guard.device_checks import GuardDevice

    e = ge.Engine(torch.device("cpu"), ge.SHAPES["decode256"], 8, torch.float32, fields, matmuls=0)
    e.update()
    with tempfile.TemporaryDirectory() as t:
        g = Guard(t, ge.N, ge.INTERLEAVE, kernel=True, on_wrong="count", **ge.guard_config())
        g._dev = dev = GuardDevice(torch, e.seq.device, g.keep, g._spec, None, None)
        dev.go = lambda *a: None
        took = min(timeit.repeat(lambda: e.observe(g, 1), number=n, repeat=9)) / n
        if g.dropped or g.first_rule is not None:
            raise RuntimeError(f"observe() dropped {g.dropped}, found {g.first_rule}")
    return took * 1e6


def python_before(rev: str, fields: str | None = None) -> float | None:
    """python_cost() (or, given `fields`, python_fields(fields) with this checkout's guard_engine) against the
    dcptool of git revision rev (git archive into a temporary directory); None when it cannot run there."""
    import inspect
    import os
    import subprocess

    from bench_record_python import revision_tree

    with tempfile.TemporaryDirectory() as t:
        if revision_tree(rev, Path(t)) is None:
            return None
        code = "from __future__ import annotations\n" + inspect.getsource(python_cost) + "print(python_cost())\n"
        if fields is not None:
            code = ("import tempfile\nimport torch\nimport guard_engine as ge\nfrom dcptool.engine.guard.guard import "
                    "Guard\n" + inspect.getsource(python_fields) + f"print(python_fields({fields!r}))\n")
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=t,  # (not this tree's)
                           env={**os.environ, "PYTHONPATH": f"{t}{os.pathsep}{ROOT / 'benchmarks'}"})
        if p.returncode:
            print(f"(revision {rev} did not run: {p.stderr.strip().splitlines()[-1:]})")
            return None
        return float(p.stdout.split()[-1])


def _us(x: float) -> str:
    return f"{x * 1e6:.2f}"


def _row(label: str, r: dict, builds: int, cpu: str) -> str:
    """One table row: per step (or replay) off / on / floor, the added µs per build of the Guard and of the floor,
    their ratio (n/a where the floor is within noise of off), CPU per build, host syncs."""
    on, fl = (r["on"] - r["off"]) / builds, (r["floor"] - r["off"]) / builds
    ratio = f"{on / fl:.2f}" if fl > 0 else "n/a (floor within noise)"
    return (f"| {label} | {r['off'] * 1e3:.3f} | {r['on'] * 1e3:.3f} | {r['floor'] * 1e3:.3f} | {_us(on)} | "
            f"{_us(fl)} | {ratio} | {cpu} | {r['syncs'] if 'syncs' in r else 'n/a'} |")


def _clean(counts: list) -> bool:
    """Every build counted, none wrong, none dropped, nothing written (the Guard's counts of each clean run)."""
    return all(missing == 0 and wrong == 0 and dumped is None and dropped == 0
               for missing, wrong, dumped, dropped in counts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(ge.SHAPES), help=f"comma-separated, of {', '.join(ge.SHAPES)}")
    ap.add_argument("--fields", default="all", choices=list(ge.FIELDS), help="the keywords each build passes")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--replays", type=int, default=1000)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny: the code paths, not the costs")
    ap.add_argument("--python", action="store_true", help="observe()'s Python, the launch a stand-in (no GPU needed)")
    ap.add_argument("--before", default=BEFORE, help="with --python: the git revision to compare with")
    a = ap.parse_args()
    if a.python:
        now, before = python_cost(), python_before(a.before)
        was = "n/a" if before is None else f"{before:.2f} µs"
        print(f"Python per eager observe(), launch a stand-in: now {now:.2f} µs; {a.before}: {was}")
        for f in dict.fromkeys(("fast", a.fields)):
            was = python_before(a.before, f)
            print(f"Python per eager build as the plugin hands it (Guard.record), --fields {f} "
                  f"({len(ge.FIELDS[f])} keywords), 256 rows, launch a stand-in: now {python_fields(f):.1f} µs; "
                  f"{a.before}: {'n/a' if was is None else f'{was:.1f} µs'}")
        return
    shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    bad = [s for s in shapes if s not in ge.SHAPES]
    if bad or not shapes:
        ap.error(f"--shapes: {', '.join(bad) or 'none given'}: choose among {', '.join(ge.SHAPES)}")
    cuda = torch.cuda.is_available() and not a.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    if a.smoke:
        a.steps, a.reps = 3, 1
    sizes = ge.SHAPES if cuda else ge.SMOKE
    name = torch.cuda.get_device_name() if cuda else "CPU (smoke: Triton's interpreter, not a cost)"
    print(f"Guard in an engine-like loop on {name}: fields {a.fields} ({len(ge.FIELDS[a.fields])} keywords a "
          "build), "
          f"{a.steps} steps x {a.reps} runs (graph: {a.replays} replays x {a.reps}), off/on/floor interleaved, "
          f"{BUILDS} builds a step (floor: an empty kernel launched per build in place of the Guard)")
    print("| shape / mode | off ms | on ms | floor ms | on − off µs/build | floor − off µs/build | added: on / floor "
          "| CPU µs/build on (floor) | host syncs (on) |")
    print("|---|---|---|---|---|---|---|---|---|")
    counts: list = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        engines = {}
        for shape in shapes:
            (tmp / shape).mkdir()
            e = engines[shape] = ge.Engine(dev, sizes[shape], 4096 if cuda else 64,
                                        torch.bfloat16 if cuda else torch.float32, a.fields)
            r = eager(e, dev, a.steps, a.reps, tmp / shape)
            counts += r["counts"]
            if not cuda:
                r.pop("syncs")
            label = f"{shape} ({e.rows} req, {e.tokens} tok)"
            print(_row(f"{label} / eager", r, BUILDS, f"{r['cpu'] * 1e6:.1f} ({r['cpu_floor'] * 1e6:.1f})"),
                  flush=True)
            if cuda:
                gr = graph(e, a.replays, a.reps, tmp / shape)
                counts += gr["counts"]
                print(_row(f"{label} / graph", gr, BUILDS, "0 (no Python per replay)"), flush=True)
            else:
                print(f"| {label} / graph | - | - | - | - | - | - | - | capture needs CUDA |")
        for shape in shapes:
            print(f"the builds of {shape}, recorded and replayed: {replayed(engines[shape], tmp / shape)}")
        print(f"clean runs: every build counted, none wrong, none dropped, nothing written: {_clean(counts)}")
        e = engines[shapes[0]]
        print(f"a wrong view, eager ({shapes[0]}): {caught(e, dev, tmp, False)}")
        if "host_seq_lens" in e.kv:
            print(f"a wrong host copy of seq_lens, eager ({shapes[0]}): {caught(e, dev, tmp, False, True)}")
        if cuda:
            print(f"a wrong view, in a replayed graph ({shapes[0]}): {caught(e, dev, tmp, True)}")
        from test_guard import PER_OBS_FAULTS

        for f, verdict in faults(dev, tmp, PER_OBS_FAULTS[:2] if a.smoke else PER_OBS_FAULTS):
            print(f"fault {f}: kernel vs host path: {verdict}")


if __name__ == "__main__":
    main()
