"""Replay of what the vLLM plugin records (one file per DCP rank, rolled over) beside one file of the same
observations: fresh `dcptool replay` processes against the read floor, with a baseline checkout in the same run.

    python benchmarks/bench_layout.py --obs 1e6                                   # 4 ranks, 1% wrong, text and --json
    python benchmarks/bench_layout.py --obs 1e6 --wrong 0.01,1 --roll 1,4 --base /tmp/base-main
    python benchmarks/bench_layout.py --obs 1e7 --layouts rank1 --bounded --formats json   # the bounded path forced

Layouts (layout_data.py, made once into --data): `one` (one file), `rankR` (rank<r>.NNNNN.safetensors, each rank's
observations rolled into R files; --roll lists the R). For each layout and format (text: the whole report to a pipe;
json: --json) every run is a new process (`dcptool replay FILES --backend B`), peak memory its VmHWM (read as it
exits). `--base DIR` times DIR's dcptool too (PYTHONPATH=DIR: e.g. `git worktree add /tmp/base-main main`), in
the same rounds. `--bounded` adds this checkout with DCPTOOL_BOUNDED=1 (the bounded path forced). The floor is `cat`
of the layout's files (after a warm read: the page cache holds them), the start-up a replay of a tiny dump (100
observations, the same shape) in a fresh process; goal: replay <= 1.5 x (floor + start-up). Each round takes the
runs in a rotated order; the tables show medians (min-max over --runs). The runs of one layout must agree on the exit
code and the findings (checked on --json: each finding's rule, step, rank, ubatch, row and source step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import layout_data  # noqa: E402

# a dcptool command line that says its peak resident memory (VmHWM) on stderr as it exits: ru_maxrss of a child
# would count this process's pages too (a fork's child starts with them; the layouts were made in this process)
PEAK = ("import atexit, runpy, sys; atexit.register(lambda: sys.stderr.write(next(x for x in open('/proc/self/status') "
        "if x.startswith('VmHWM')))); sys.argv = ['dcptool', *sys.argv[1:]]; runpy.run_module('dcptool', "
        "run_name='__main__')")


def child(cmd: list[str], env: dict, out, cwd: str | None = None) -> tuple[float, float, int, float]:
    """(seconds, peak MB, exit code, CPU seconds) of one process (`dcptool ARGS` when cmd starts with "dcptool",
    else cmd) run in `cwd` (a dcptool's checkout: the working directory comes first on a child's sys.path, before
    PYTHONPATH); stdout to `out` (a file, or DEVNULL). The CPU seconds (user + system, every thread) move less than
    the wall time on a machine shared with other work."""
    import resource
    import tempfile

    dcptool = cmd[0] == "dcptool"
    if dcptool:
        cmd = [sys.executable, "-c", PEAK, *cmd[1:]]
    with tempfile.TemporaryFile() as err:
        t, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        code = subprocess.run(cmd, stdout=out, stderr=err, env=env, cwd=cwd).returncode
        sec, after = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN)
        err.seek(0)
        text = err.read().decode(errors="replace")
    if code not in (0, 1) or "Traceback (most recent call last)" in text:  # (1 is also Python's exit on a traceback)
        raise SystemExit(f"{' '.join(cmd[:6])} ... exited {code}: {text[-800:]}")
    peak = next((int(x.split()[1]) / 1024 for x in text.splitlines() if x.startswith("VmHWM")), float("nan"))
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return sec, peak, code, cpu


def keys(path: str) -> list[tuple]:
    """What must be the same between layouts: each finding's rule and observation, by (step, rank, ubatch)."""
    out, summary = [], None
    with open(path) as f:
        for line in f:
            x = json.loads(line)
            if x["type"] == "finding":
                src = x["source"] or {}
                out.append((x["step"], x["rank"], x["ubatch"], x["rule"], x["row"], x["recorded"], src.get("step")))
            elif x["type"] == "summary":
                summary = x
    if summary is None or summary["findings"] != len(out):
        raise SystemExit(f"{path}: not a whole `replay --json` report ({len(out)} findings, summary {summary})")
    return out


def env_for(code: str, bounded: bool = False) -> dict:
    # the checkout timed first; what the caller's PYTHONPATH adds (packages installed beside the image's) after it
    e = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (code, os.environ.get("PYTHONPATH"))))}
    e.pop("DCPTOOL_BOUNDED", None)
    if bounded:
        e["DCPTOOL_BOUNDED"] = "1"
    return e


def layout_files(data: Path, n: int, ranks: int, wrong: float, name: str) -> list[str]:
    if name == "one":
        got = layout_data.one_file(data, n, ranks, wrong)
    else:
        got = layout_data.per_rank(data, n, ranks, int(name.removeprefix("rank")), wrong)
    return [os.path.abspath(p) for p in got]


def measure(args, n: int, wrong: float, codes: dict[str, tuple[str, bool]]) -> list[dict]:
    """Every layout of (n, wrong): floor, start-up, and each code and format, --runs rounds."""
    data = Path(args.data)
    tiny = layout_files(data, 100, args.ranks, wrong, "one")
    rows, same = [], None
    for name in args.layouts.split(","):
        paths = layout_files(data, n, args.ranks, wrong, name)
        subprocess.run(["cat", *paths], stdout=subprocess.DEVNULL, check=True)  # warm: the page cache holds them
        got: dict[str, list] = {}
        found: dict[str, list] = {}
        jobs = [("floor", None), ("start", None)] + [(c, f) for c in codes for f in args.formats.split(",")]
        for r in range(args.runs):
            for job in jobs[r % len(jobs):] + jobs[: r % len(jobs)]:
                what, fmt = job
                if what == "floor":
                    got.setdefault("floor", []).append(child(["cat", *paths], dict(os.environ), subprocess.DEVNULL))
                    continue
                if what == "start":
                    cmd = ["dcptool", "replay", *tiny, "--json", "--backend", args.backend]
                    got.setdefault("start", []).append(child(cmd, env_for(str(ROOT)), subprocess.DEVNULL, str(ROOT)))
                    continue
                code, bounded = codes[what]
                cmd = ["dcptool", "replay", *paths, "--backend", args.backend]
                cmd += ["--json"] if fmt == "json" else []
                out = Path(args.data) / f"out-{what}-{fmt}.txt"
                with open(out, "w") as fh:
                    got.setdefault(f"{what}/{fmt}", []).append(child(cmd, env_for(code, bounded), fh, code))
                if fmt == "json" and r == 0:
                    found[what] = keys(str(out))
        for k, v in found.items():  # every code and layout: the same findings, in the same order
            if same is not None and v != same:
                raise SystemExit(f"{name}, {k}: other findings than the first layout's ({len(v)} against {len(same)})")
            same = v
        rows.append({"obs": n, "wrong": wrong, "layout": name, "files": len(paths),
                     "mb": layout_data.size_of(paths) / 1e6, "findings": len(next(iter(found.values()), [])),
                     "runs": got})
        print(f"{n:,} {wrong:g} {name}: " + ", ".join(
            f"{k} {statistics.median(x[0] for x in v):.2f} s" for k, v in got.items()), flush=True)
    return rows


def table(rows: list[dict], codes: list[str], formats: list[str]) -> None:
    med = lambda v, i: statistics.median(x[i] for x in v)  # noqa: E731
    rng = lambda v: f"{min(x[0] for x in v):.2f}-{max(x[0] for x in v):.2f}"  # noqa: E731
    print("\n| obs | wrong | layout | files | dump MB | findings | floor s | start-up s | "
          + " | ".join(f"{c} {f} s (range)" for c in codes for f in formats)
          + " | " + " | ".join(f"{c} {f} / (floor + start-up)" for c in codes for f in formats)
          + " | " + " | ".join(f"{c} {f} CPU s" for c in codes for f in formats)
          + " | " + " | ".join(f"{c} peak MB / dump" for c in codes) + " |")
    print("|" + "---|" * (8 + 3 * len(codes) * len(formats) + len(codes)))
    for r in rows:
        g = r["runs"]
        floor, start = med(g["floor"], 0), med(g["start"], 0)
        cells = [f"{med(g[f'{c}/{f}'], 0):.2f} ({rng(g[f'{c}/{f}'])})" for c in codes for f in formats]
        ratios = [f"{med(g[f'{c}/{f}'], 0) / (floor + start):.2f}" for c in codes for f in formats]
        cpus = [f"{med(g[f'{c}/{f}'], 3):.2f}" for c in codes for f in formats]
        peaks = [f"{max(med(g[f'{c}/{f}'], 1) for f in formats):,.0f} / {r['mb']:,.0f} = "
                 f"{max(med(g[f'{c}/{f}'], 1) for f in formats) / r['mb']:.2f}" for c in codes]
        print(f"| {r['obs']:,} | {r['wrong']:g} | {r['layout']} | {r['files']} | {r['mb']:,.0f} | {r['findings']:,} | "
              f"{floor:.2f} | {start:.2f} | " + " | ".join(cells + ratios + cpus + peaks) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--obs", default="1e6", help="observation counts, e.g. 1e6,1e7")
    ap.add_argument("--ranks", type=int, default=4, help="DCP ranks (one file each, and the batch size in ranks)")
    ap.add_argument("--roll", default="1,4", help="files per rank of the per-rank layouts")
    ap.add_argument("--layouts", default=None, help="which layouts (default: one and rankR for each --roll)")
    ap.add_argument("--wrong", default="0.01", help="fractions of observations planted wrong (1: every one)")
    ap.add_argument("--formats", default="text,json")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--base", default=None, help="a baseline checkout, timed in the same rounds")
    ap.add_argument("--bounded", action="store_true", help="also this checkout with the bounded path forced")
    ap.add_argument("--data", default=str(ROOT / "bench-data"))
    ap.add_argument("--jobs", type=int, default=os.cpu_count(), help="files made at a time (a process each)")
    args = ap.parse_args()
    if args.layouts is None:
        args.layouts = ",".join(["one"] + [f"rank{r}" for r in args.roll.split(",")])
    codes: dict[str, tuple[str, bool]] = {"this": (str(ROOT), False)}
    if args.base:
        codes = {"main": (str(Path(args.base).resolve()), False), **codes}
    if args.bounded:
        codes["bounded"] = (str(ROOT), True)
    sizes, wrongs = [int(float(x)) for x in args.obs.split(",")], [float(w) for w in args.wrong.split(",")]
    t = time.perf_counter()
    layout_data.make(Path(args.data), [(n, args.ranks, w, name) for n in [100, *sizes] for w in wrongs
                                       for name in (["one"] if n == 100 else args.layouts.split(","))], args.jobs)
    print(f"layouts made in {time.perf_counter() - t:.1f} s ({args.jobs} at a time)", flush=True)
    rows = []
    for spec in args.obs.split(","):
        for wrong in (float(w) for w in args.wrong.split(",")):
            rows += measure(args, int(float(spec)), wrong, codes)
    load = os.getloadavg()
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, load {load[0]:.1f} {load[1]:.1f} "
          f"{load[2]:.1f}, backend {args.backend}, {args.ranks} ranks, {args.runs} runs")
    table(rows, list(codes), args.formats.split(","))


if __name__ == "__main__":
    main()
