"""What the Guard costs and what it catches, in bench_record's engine-like loop: eager and in a captured CUDA graph.

    python benchmarks/bench_guard.py [--steps 300] [--reps 5] [--replays 1000]    (a GPU: the H200 table)
    python benchmarks/bench_guard.py --smoke                                      (CPU: the same code paths, tiny)
    python benchmarks/bench_guard.py --python [--before REV]                      (any machine: observe()'s Python)

Each step: an in-place update of the seq_lens buffer (and the DCP view the engine derives from it), 3 queued
bf16 4096x4096 matmuls and 4 builds of 256 rows (seq_lens, dcp_local_seq_lens, query_start_loc as CUDA tensors),
guard off vs on vs the floor (an empty kernel launched per observe instead: what any check launched per
observation costs at least), interleaved in one run. Eager: ms per step (median of --reps), its slowdown, CPU µs per
observe() in the loop. Graph: the same step captured once (the observes inside the captured region), replayed
--replays times: ms per replay, slowdown, and the device counter, which must have counted every replay's builds
(each in its own ring slot). Host synchronisations are counted with torch.cuda.set_sync_debug_mode("warn") over
the guarded loops (close() excluded). Then what it catches: a wrong view eager and inside a replayed graph (one
dump each, replay names the rule), and every simulate fault replay reports per observation, CUDA tensors through
the kernel, against the host path's first wrong observation and rule (tests/engine/guard/test_guard.py's workloads).

--smoke: CPU tensors through the kernel under Triton's interpreter (64x64 float32 matmuls, 8 rows, 3 steps, no
graph: capture needs CUDA, and two faults): it proves the script runs, not what anything costs.

--python: the Python part of one eager observe() on the device path (the loop's keywords, 256 rows), the launch
replaced by a stand-in (CPU tensors: no GPU needed), µs per observe, best of 9 x 50,000; and the same for the
dcptool of git revision --before (default: the Guard before its launch went through launch.py), in a subprocess.
A GPU adds the launch itself (the launcher's C entry: a few µs) to the eager figure.
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
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "engine" / "guard"), str(ROOT / "tests" / "model")]

from dcptool.check.replay import replay  # noqa: E402
from dcptool.dcp.reference import dcp_local_seq_lens  # noqa: E402
from dcptool.dump import read_dump  # noqa: E402
from dcptool.engine.guard.guard import Guard  # noqa: E402


class Engine:
    """bench_record's loop: the buffers and one step's work, with or without a Guard."""

    def __init__(self, dev: torch.device, rows: int, dim: int, dtype):
        torch.manual_seed(0)
        self.a = torch.randn(dim, dim, dtype=dtype, device=dev)
        self.b = torch.randn(dim, dim, dtype=dtype, device=dev)
        self.c = torch.empty_like(self.a)
        self.base = torch.randint(1, 1 << 17, (rows,), dtype=torch.int32, device=dev)
        self.seq = self.base.clone()
        self.dcp = torch.empty_like(self.seq)
        self.qsl = torch.arange(rows + 1, dtype=torch.int32, device=dev)
        self.rows = rows
        self.spent = 0.0

    def reset(self) -> None:
        self.seq.copy_(self.base)
        self.spent = 0.0

    def step(self, s: int, guard: Guard | None) -> None:
        self.seq.add_(1)  # the engine refreshes its metadata on the stream every step
        self.dcp.copy_(dcp_local_seq_lens(self.seq, 2, 0, 1))
        for k in range(4):
            if k < 3:
                torch.mm(self.a, self.b, out=self.c)
            if guard is not None:
                t = time.perf_counter()
                self.observe(guard, s)
                self.spent += time.perf_counter() - t

    def observe(self, guard: Guard, s: int) -> None:
        """One build, with the keywords the vLLM plugin's _observe passes."""
        guard.observe(step=s, site="attn_metadata", rank=0, seq_lens=self.seq, num_reqs=self.rows,
                      num_reqs_padded=self.rows, dcp_local_seq_lens=self.dcp, query_start_loc=self.qsl)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


class SyncCount:
    """Host synchronisations torch reports (set_sync_debug_mode "warn") while it is entered; 0 off CUDA."""

    def __init__(self, dev: torch.device):
        self.on = dev.type == "cuda"
        self.n = 0

    def __enter__(self):
        if self.on:
            self._w = warnings.catch_warnings(record=True)
            self.got = self._w.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self.on:
            torch.cuda.set_sync_debug_mode("default")
            self._w.__exit__(*exc)
            self.n = sum("synchroniz" in str(w.message) for w in self.got)


class Floor:
    """The floor of one launch per observation, in place of a Guard: each observe() launches the snapshot kernel with
    no rows (bench_record_sets._empty_launch, through launch.py's launcher), nothing else; its ring is started by
    the first observe() (outside any capture: the loops' warm step)."""

    def __init__(self, path: Path):
        self.path, self.go = path, None

    def observe(self, **kw) -> None:
        if self.go is None:
            from bench_record_sets import _empty_launch

            from dcptool.engine.recorder.record import Recorder

            self.rec = Recorder(self.path, dcp_size=2, cuda_mode="async", force=True)
            if not kw["seq_lens"].is_cuda:
                self.rec._device.use_host_ring(1 << 16)  # (--smoke: host tensors through the interpreted kernel)
            self.rec.observe(**kw)
            self.go = _empty_launch(self.rec, kw["seq_lens"])
        self.go()

    def close(self) -> None:
        if self.go is not None:
            self.rec.discard()


VARIANTS = ("off", "on", "floor")


def _make(which: str, tmp: Path, name: str):
    """The loop's observer: none (off), a Guard dumping into tmp/name (on), or the floor's stand-in."""
    if which == "off":
        return None
    return Guard(tmp / name, 2, 1, kernel=True) if which == "on" else Floor(tmp / f"{name}-floor.safetensors")


def eager(e: Engine, dev, steps: int, reps: int, tmp: Path) -> dict:
    """Per-step time off, on and at the floor (interleaved), CPU per observe, host syncs, the Guard's own counts."""
    per: dict = {v: [] for v in VARIANTS}
    cpu: dict = {"on": [], "floor": []}
    syncs, counts = 0, []
    for r in range(reps + 1):  # (the first: warm-up, not counted)
        for v in VARIANTS:
            g = _make(v, tmp, f"eager{r}")
            e.reset()
            _sync(dev)
            with SyncCount(dev) as sc:
                t0 = time.perf_counter()
                for s in range(steps):
                    e.step(s, g)
                _sync(dev)
                dt = (time.perf_counter() - t0) / steps
            if g is not None:
                g.close()
                if v == "on":
                    counts.append((g.count, g.wrong, g.dumped))
            if r:
                per[v].append(dt)
                if g is not None:
                    cpu[v].append(e.spent / (4 * steps))
                syncs += sc.n if v == "on" else 0
    out = {v: float(np.median(per[v])) for v in VARIANTS}
    return dict(out, cpu=float(np.median(cpu["on"])), cpu_floor=float(np.median(cpu["floor"])), syncs=syncs,
                counts=counts)


def graph(e: Engine, replays: int, reps: int, tmp: Path) -> dict:
    """The step captured (observes inside), replayed: per-replay time off, on and at the floor, syncs, the device
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
                e.step(0, g)  # warm: compilation and the ring, outside capture
            torch.cuda.current_stream().wait_stream(s)
            cg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cg):
                e.step(1, g)
            torch.cuda.synchronize()
            with SyncCount(e.a.device) as sc:
                t0 = time.perf_counter()
                for _ in range(replays):
                    cg.replay()
                torch.cuda.synchronize()
                dt = (time.perf_counter() - t0) / replays
            if g is not None:
                g.close()
                if v == "on":
                    counted.append(g.count - 4 - 4 * replays)  # (the warm step's 4; the capture launches nothing)
            if r:
                per[v].append(dt)
                syncs += sc.n if v == "on" else 0
    return dict({v: float(np.median(per[v])) for v in VARIANTS}, syncs=syncs, counted=counted)


def caught(e: Engine, dev, tmp: Path, in_graph: bool) -> str:
    """A wrong view (one row off) eager, or set after capture and seen by a replay: one dump, replay's rule."""
    g = Guard(tmp / ("caught-graph" if in_graph else "caught-eager"), 2, 1, kernel=True)
    e.reset()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        e.step(0, g)
        if in_graph:
            cg = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(cg):
                for _ in range(4):
                    e.observe(g, 1)
            for _ in range(10):
                cg.replay()
            e.dcp[3] += 1  # what a stale buffer does between replays
            cg.replay()
        else:
            e.dcp[3] += 1
            e.observe(g, 1)
        path = g.close()
    n = sum("dcptool Guard" in str(x.message) for x in w)
    if path is None:
        return "NOT CAUGHT"
    rules = sorted({f.rule for f in replay(read_dump(path), "torch").findings})
    return f"{n} warning, 1 dump of {read_dump(path).n} observations, replay: {', '.join(rules)}"


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


BEFORE = "7f80754"  # the Guard launching through Triton's dispatch with tensor arguments (82.5 µs on the H200)


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


def python_before(rev: str) -> float | None:
    """python_cost() against the dcptool of git revision rev (git archive into a temporary directory); None when
    it cannot run there."""
    import inspect
    import os
    import subprocess

    with tempfile.TemporaryDirectory() as t:
        arch = subprocess.run(["git", "archive", rev, "dcptool"], cwd=ROOT, capture_output=True)
        if arch.returncode:
            print(f"(revision {rev}: {arch.stderr.decode().strip()})")
            return None
        subprocess.run(["tar", "-x", "-C", t], input=arch.stdout, check=True)
        code = "from __future__ import annotations\n" + inspect.getsource(python_cost) + "print(python_cost())\n"
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=t,  # (not this tree's)
                           env={**os.environ, "PYTHONPATH": t})
        if p.returncode:
            print(f"(revision {rev} did not run: {p.stderr.strip().splitlines()[-1:]})")
            return None
        return float(p.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--replays", type=int, default=1000)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny: the code paths, not the costs")
    ap.add_argument("--python", action="store_true", help="observe()'s Python, the launch a stand-in (no GPU needed)")
    ap.add_argument("--before", default=BEFORE, help="with --python: the git revision to compare with")
    a = ap.parse_args()
    if a.python:
        now, before = python_cost(), python_before(a.before)
        was = "n/a" if before is None else f"{before:.2f} µs (without the launch it made through Triton's dispatch)"
        print(f"Python per eager observe(), launch a stand-in: now {now:.2f} µs; {a.before}: {was}")
        return
    cuda = torch.cuda.is_available() and not a.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    if a.smoke:
        a.steps, a.reps = 3, 1
    e = Engine(dev, 256 if cuda else 8, 4096 if cuda else 64, torch.bfloat16 if cuda else torch.float32)
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        r = eager(e, dev, a.steps, a.reps, tmp)
        name = torch.cuda.get_device_name() if cuda else "CPU (smoke: Triton's interpreter, not a cost)"
        print(f"Guard in an engine-like loop on {name}: {a.steps} steps x {a.reps} runs, off/on/floor interleaved "
              "(floor: an empty kernel launched per observe in place of the Guard)")
        print("| mode | off ms | on ms | slowdown | floor ms | floor slowdown | CPU µs/observe (floor) "
              "| host syncs (on) |")
        print("|---|---|---|---|---|---|---|---|")
        print(f"| eager | {r['off'] * 1e3:.3f} | {r['on'] * 1e3:.3f} | {(r['on'] / r['off'] - 1) * 100:+.1f}% | "
              f"{r['floor'] * 1e3:.3f} | {(r['floor'] / r['off'] - 1) * 100:+.1f}% | {r['cpu'] * 1e6:.1f} "
              f"({r['cpu_floor'] * 1e6:.1f}) | {r['syncs'] if cuda else 'n/a'} |")
        clean = all(w == 0 and p is None for _, w, p in r["counts"])
        if cuda:
            gr = graph(e, a.replays, a.reps, tmp)
            print(f"| graph ({a.replays} replays) | {gr['off'] * 1e3:.3f} | {gr['on'] * 1e3:.3f} | "
                  f"{(gr['on'] / gr['off'] - 1) * 100:+.1f}% | {gr['floor'] * 1e3:.3f} | "
                  f"{(gr['floor'] / gr['off'] - 1) * 100:+.1f}% | 0 (no Python per replay) | {gr['syncs']} |")
            print(f"every replay's builds counted by the device counter: {all(c == 0 for c in gr['counted'])} "
                  f"(missing per run: {gr['counted']})")
        else:
            print("| graph | - | - | - | - | - | - | capture needs CUDA |")
        print(f"clean runs wrote nothing: {clean}")
        print(f"a wrong view, eager: {caught(e, dev, tmp, False)}")
        if cuda:
            print(f"a wrong view, in a replayed graph: {caught(e, dev, tmp, True)}")
        from test_guard import PER_OBS_FAULTS

        for f, verdict in faults(dev, tmp, PER_OBS_FAULTS[:2] if a.smoke else PER_OBS_FAULTS):
            print(f"fault {f}: kernel vs host path: {verdict}")


if __name__ == "__main__":
    main()
