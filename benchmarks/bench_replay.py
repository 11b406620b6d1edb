"""Replay speed against reading the dump and against a per-observation loop, at 10^4..10^6 observations.

    python benchmarks/bench_replay.py                    # 1e4, 1e5, 1e6 (dumps cached in bench-data/)
    python benchmarks/bench_replay.py --sizes 1e4,1e5 --backend torch
    python benchmarks/bench_replay.py --sizes 1e5,1e6,dense --no-baseline-above 1e5 --phases   # performance.md

`dense` is the finding-dense legacy recording (`simulate --dcp 8 --steps 3000 --pipeline
legacy`: 99,008 observations, 138,839 findings), made once into bench-data/. `--phases` adds the time of
each replay phase and its cost in observation-scan units (the progress bar's weights, replay.W_*).
The peak memory of replay is also measured with tracemalloc in a run of its own (numpy's buffers are
traced): traced peak / dump size is the "≤ 2x the dump" goal.

Each measurement runs in its own child process so its peak memory (ru_maxrss) is its own, and
times exclude interpreter/torch start-up except the end-to-end CLI run. Prints one table: time,
rows per second, peak memory, and the ratios replay/baseline and replay/load. The findings of
the library call, the CLI and the baseline must agree (checked; the run fails otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

N, I = 4, 16  # DCP 4, interleave 16: a common DeepSeek-style layout
CHUNK_OBS = 100_000


def make_dump(path: Path, n: int, seed: int = 0) -> None:
    """n observations, 64-512 rows each, about 1% of them planted wrong (None, wrong rows, -1 padding, short)."""
    from dcptool.check.replay import local_np
    from dcptool.dump import DumpConfig, write_dump

    rng = np.random.default_rng(seed)
    # every step is one batch seen by its N ranks (as an engine records it: rank-agree has nothing to say)
    steps = -(-n // N)
    lens = rng.choice([64, 128, 192, 256, 320, 384, 448, 512], size=steps).astype(np.int64)
    lens += rng.integers(-8, 9, steps)
    lens = np.repeat(lens, N)[:n]
    pad = np.repeat(rng.integers(0, 8, steps), N)[:n]
    nreq = np.maximum(lens - pad, 0)
    rank = (np.arange(n) % N).astype(np.int32)
    rows = np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=rows[1:])
    seq = np.zeros(rows[-1], np.int32)
    dcp = np.zeros(rows[-1], np.int32)
    for lo in range(0, n, CHUNK_OBS):  # chunked so 10^6 observations stay within a few GB
        hi = min(n, lo + CHUNK_OBS)
        a, b = rows[lo], rows[hi]
        obs = np.repeat(np.arange(lo, hi), lens[lo:hi])
        j = np.arange(a, b) - rows[obs]
        real = j < nreq[obs]
        step = obs // N  # the same seq_lens on every rank of a step: a hash of (step, row), not a draw per row
        h = (step * 2654435761 + j * 40503 + seed) % ((1 << 17) - 1)
        s = np.where(real, h + 1, 0).astype(np.int32)
        seq[a:b] = s
        dcp[a:b] = np.where(real, local_np(s, N, rank[obs], I), 0)
    has = np.ones(n, np.uint8)
    planted = rng.choice(n, size=max(4, n // 100), replace=False)
    kinds = planted % 4
    has[planted[kinds == 0]] = 0  # None
    for i in planted[kinds == 1]:  # a wrong real row
        if nreq[i]:
            dcp[rows[i] + rng.integers(0, nreq[i])] += 1
    for i in planted[kinds == 2]:  # -1 sentinel in padding
        if lens[i] > nreq[i]:
            dcp[rows[i + 1] - 1] = -1
    dlen = np.where(has == 1, lens, 0)
    short = planted[kinds == 3]
    dlen[short] = np.maximum(lens[short] - 2, 0)  # a view sliced too short
    mask = np.ones(rows[-1], bool)
    for i in np.flatnonzero(dlen != lens):
        mask[rows[i] + dlen[i] : rows[i + 1]] = False
    dcp_rows = np.zeros(n + 1, np.int64)
    np.cumsum(dlen, out=dcp_rows[1:])
    cols = {"obs.step": np.arange(n, dtype=np.int64) // 4, "obs.site": np.zeros(n, np.int32), "obs.rank": rank,
            "obs.ubatch": np.full(n, -1, np.int32), "obs.num_reqs": nreq.astype(np.int32),
            "obs.num_reqs_padded": lens.astype(np.int32), "obs.rows": rows, "obs.has_dcp": has,
            "obs.dcp_rows": dcp_rows, "rows.seq_lens": seq, "rows.dcp_local_seq_lens": dcp[mask]}
    write_dump(path, DumpConfig(dcp_size=N, cp_interleave=I, sites=("attn_metadata",), note="bench"), cols)


# --- children: each prints one JSON line -------------------------------------------------------

def child_load(path: str) -> dict:
    from dcptool.dump import read_dump

    t = time.perf_counter()
    d = read_dump(path)
    acc = 0
    for v in d.columns.values():  # touch every byte once: the floor any replay pays
        acc += int(v.max()) if v.size else 0
    return {"seconds": time.perf_counter() - t, "check": acc}


def _value_keys(findings) -> list:
    """Findings reduced to what the baseline can say: (obs, missing|shape|padding|wrong-rows)."""
    value = {"missing", "padding", "shape"}
    return sorted({(f["obs"], f["rule"] if f["rule"] in value else "wrong") for f in findings
                   if f["rule"] in value | {"stale", "global", "wrong-rank", "wrong-interleave", "mismatch"}})


def child_phases(path: str, backend: str) -> dict:
    """Each phase of replay timed alone (warm), as replay runs them; costs per observation, wrong view, finding."""
    import torch  # noqa: F401

    from dcptool.check.findings import FindingTable
    from dcptool.check.plan import plan, run_check
    from dcptool.check.problems import problems
    from dcptool.check.provenance import Provenance
    from dcptool.check.ranks import rank_pairs
    from dcptool.check.replay import obs_grid, replay
    from dcptool.check.scan import scan
    from dcptool.dcp import rules as R
    from dcptool.dump import open_dumps

    replay(open_dumps([path]), backend)  # warm
    d = open_dumps([path])
    T: dict[str, float] = {}

    def timed(name, f, *a):
        t = time.perf_counter()
        r = f(*a)
        T[name] = T.get(name, 0.0) + time.perf_counter() - t
        return r

    p = plan(d)
    pairs = rank_pairs(d) if p.runs("rank-agree") else None
    st = timed("scan", lambda: scan(d, backend, pairs=None if pairs is None else pairs.prev))
    wrong = st.obs[st.n_wrong > 0]
    prov = Provenance(d)
    if p.runs("mismatch"):
        timed("provenance", prov.prepare, wrong)
    inputs = {R.VERSION: d.config.engine_version, R.SCAN: st, R.WRONG: wrong, R.PAIRS: pairs, R.DIFFER: st.differ,
              R.PROVENANCE: prov}
    phase = {R.RULE["mismatch"].check: "provenance", R.RULE["slots"].check: "slots", R.RULE["pages"].check: "findings"}
    parts = [timed(phase.get(check, "checks"), run_check, d, rules[0], inputs) for check, rules in p.run.items()]
    timed("checks", obs_grid, d)
    t = timed("findings", FindingTable.concat, d, parts)
    timed("findings", problems, d, t)
    lines = timed("json", lambda: sum(1 for _ in t.json_lines()))
    from dcptool.report.html import render_html

    res = replay(d, backend, views=200)
    timed("html", render_html, res)
    return {"phases": T, "obs": d.n, "wrong": int(wrong.size), "scanned": int(st.obs.size), "findings": lines,
            "html_rows": min(lines, 5000), "views": len(res.views)}


def child_memory(path: str, backend: str) -> dict:
    """replay's peak traced memory (tracemalloc: Python objects and numpy's buffers), the dump's read included."""
    import tracemalloc

    import torch  # noqa: F401

    from dcptool.check.replay import replay
    from dcptool.dump import open_dumps

    replay(open_dumps([path], stream=True), backend)  # warm: one-time allocations are not the replay's
    tracemalloc.start()
    res = replay(open_dumps([path], stream=True), backend)  # (read as the command line reads: streamed)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"traced_peak_mb": peak / 1e6, "findings": len(res.findings)}


def child_replay(path: str, backend: str) -> dict:
    import torch  # noqa: F401  (start-up, not measured)

    from dcptool.check.replay import replay
    from dcptool.dump import open_dumps

    t = time.perf_counter()
    res = replay(open_dumps([path], stream=True), backend)
    cold = time.perf_counter() - t  # includes one-time work: Triton's JIT load, thread pool start
    t = time.perf_counter()
    res = replay(open_dumps([path], stream=True), backend)
    sec = time.perf_counter() - t
    from dcptool.check.scan import scan

    d = open_dumps([path])
    t = time.perf_counter()
    scan(d, res.backend)  # the row pass alone: every view and page count against the formula
    scan_s = time.perf_counter() - t
    import json as js

    return {"seconds": sec, "cold": cold, "scan": scan_s,
            "keys": _value_keys([js.loads(x) for x in res.findings.json_lines()]), "findings": len(res.findings),
            "backend": res.backend, "device": res.device}


def child_bounded(path: str, backend: str) -> dict:
    """Replay with bounded=True: each chunk's pages are dropped after use (dumps larger than RAM)."""
    import torch  # noqa: F401

    from dcptool.check.replay import replay
    from dcptool.dump import open_dumps

    t = time.perf_counter()
    res = replay(open_dumps([path], bounded=True), backend, bounded=True)
    import json as js

    return {"seconds": time.perf_counter() - t, "keys": _value_keys([js.loads(x) for x in res.findings.json_lines()])}


def child_baseline(path: str) -> dict:
    """What a user would write: for each observation, compute its expected rows and compare."""
    import torch

    from dcptool.dump import read_dump

    d = read_dump(path)
    cuda = torch.cuda.is_available()
    if cuda:
        from dcptool.dcp.kernel import prepare_dcp_local_seq_lens as prep
    else:
        from dcptool.dcp.reference import prepare_dcp_local_seq_lens as prep
    dev = "cuda" if cuda else "cpu"
    buf = torch.zeros(1024, dtype=torch.int32, device=dev)
    c = d.config
    keys = []
    t = time.perf_counter()
    for i in range(d.n):
        nr, nrp = int(d["obs.num_reqs"][i]), int(d["obs.num_reqs_padded"][i])
        view = d.dcp_of(i)
        if view is None:
            keys.append((i, "missing"))
            continue
        seq = torch.from_numpy(np.asarray(d.seq_lens_of(i))).to(dev)
        exp = prep(buf, seq, nr, c.dcp_size, int(d["obs.rank"][i]), c.cp_interleave, num_reqs_padded=nrp).cpu()
        rec = torch.from_numpy(np.asarray(view))
        m = min(rec.numel(), nrp)
        bad = exp[:m] != rec[:m]
        if bool(bad[: min(m, nr)].any()):
            keys.append((i, "wrong"))
        if bool(bad[nr:m].any()):
            keys.append((i, "padding"))
        if rec.numel() != nrp:
            keys.append((i, "shape"))
    return {"seconds": time.perf_counter() - t, "keys": sorted(set(keys)), "device": dev}


def peak_mb() -> float:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss it is not inherited across exec)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_child(kind: str, *args: str) -> dict:
    code = (f"import json, sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'benchmarks')!r}]; "
            # every child runs with the allocator setting the command line makes (the load's child too)
            f"from dcptool.memory import keep_freed_memory; keep_freed_memory(); "
            f"from bench_replay import child_{kind} as f, peak_mb; r = f(*sys.argv[1:]); "
            f"r['peak_mb'] = peak_mb(); print(json.dumps(r))")
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_cli(path: str, backend: str) -> dict:
    t = time.perf_counter()
    # /usr/bin/time would be simpler; a wrapper that execs the CLI and prints VmHWM at exit is portable
    wrap = ("import atexit, sys, runpy; sys.path.insert(0, {!r}); from bench_replay import peak_mb; "
            "atexit.register(lambda: sys.stderr.write('PEAK_MB %f\\n' % peak_mb())); "
            "sys.argv = ['dcptool'] + sys.argv[1:]; runpy.run_module('dcptool', run_name='__main__')").format(str(
                ROOT / "benchmarks"))
    p = subprocess.run([sys.executable, "-c", wrap, "replay", path, "--json", "--backend", backend],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    sec = time.perf_counter() - t
    if p.returncode not in (0, 1):
        raise RuntimeError(p.stderr)
    lines = [json.loads(x) for x in p.stdout.splitlines()]
    peak = float(p.stderr.rsplit("PEAK_MB", 1)[1].split()[0]) if "PEAK_MB" in p.stderr else float("nan")
    return {"seconds": sec, "keys": _value_keys([x for x in lines if x["type"] == "finding"]), "peak_mb": peak}


def make_dense(path: Path) -> None:
    """The finding-dense recording: vLLM's legacy ordering, DCP 8, 3,000 steps."""
    subprocess.run([sys.executable, "-m", "dcptool", "simulate", "--dcp", "8", "--steps", "3000", "--pipeline",
                    "legacy", "-o", str(path), "--force"], check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})


UNIT = {"provenance": "wrong", "checks": "obs", "slots": "obs", "findings": "scanned", "json": "findings",
        "html": "html_rows"}


def print_phases(rows: list) -> None:
    """Phase times and their cost in observation-scan units per item (the progress bar's weights)."""
    print()
    print("| dump | scan s | " + " | ".join(f"{p} s (units per {UNIT[p]})" for p in UNIT) + " |")
    print("|" + "---|" * (2 + len(UNIT)))
    for name, r in rows:
        T = r["phases"]
        per_obs = T["scan"] / r["obs"]
        cells = []
        for p, what in UNIT.items():
            n = r[what] + (4 * r["views"] if p == "html" else 0)
            cells.append(f"{T.get(p, 0):.3f} ({T.get(p, 0) / per_obs / max(n, 1):.2f})")
        print(f"| {name} | {T['scan']:.3f} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1e4,1e5,1e6", help="observation counts, and `dense` for the legacy recording")
    ap.add_argument("--data", default=str(ROOT / "bench-data"))
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--no-baseline-above", type=float, default=float("inf"),
                    help="skip the per-observation baseline for larger dumps")
    ap.add_argument("--no-cli", action="store_true", help="skip the end-to-end CLI run")
    ap.add_argument("--phases", action="store_true", help="also time each phase (the progress bar's weights)")
    args = ap.parse_args()
    Path(args.data).mkdir(exist_ok=True)
    table, phases = [], []
    for spec in args.sizes.split(","):
        dense = spec == "dense"
        path = Path(args.data) / ("legacy-dcp8-3000.safetensors" if dense else f"bench-{int(float(spec))}.safetensors")
        if not path.exists():
            t = time.perf_counter()
            make_dense(path) if dense else make_dump(path, int(float(spec)))
            print(f"made {path} ({path.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t:.1f} s", flush=True)
        mb = path.stat().st_size / 1e6
        p = str(path)
        from dcptool.dump import read_dump

        size = read_dump(p).n
        rows = int(read_dump(p)["obs.rows"][-1])
        run_child("load", p)  # warm the page cache once, so every path reads from memory
        load = run_child("load", p)
        lib = run_child("replay", p, args.backend)
        mem = run_child("memory", p, args.backend)
        bnd = run_child("bounded", p, args.backend)
        cli = None if args.no_cli else run_cli(p, args.backend)
        base = run_child("baseline", p) if size <= args.no_baseline_above and not dense else None
        same = [[tuple(k) for k in r["keys"]] for r in (lib, cli, base, bnd) if r]
        if any(s != same[0] for s in same):
            raise SystemExit(f"findings differ at {spec}: lib {len(lib['keys'])}, "
                             f"cli {len(cli['keys']) if cli else '-'}, baseline {len(base['keys']) if base else '-'}")
        if args.phases:
            phases.append((path.stem, run_child("phases", p, args.backend)))
        name = "dense legacy" if dense else f"{size:,}"
        table.append((name, size, rows, mb, load, lib, cli, base, bnd, mem))
        base_s = f"{base['seconds']:.2f} s" if base else "skipped"
        cli_s = f"{cli['seconds']:.2f} s" if cli else "skipped"
        print(f"{name:>12} obs: load {load['seconds']:.3f} s, replay {lib['seconds']:.3f} s "
              f"(first call {lib['cold']:.3f} s, {lib['backend']} on {lib['device']}), cli {cli_s}, "
              f"baseline {base_s}", flush=True)
    print()
    print("| dump | obs | findings | dump MB | load s | row scan s | replay s | rows/s | replay CLI s | baseline s "
          "| peak MB load/replay/base (VmHWM) | replay traced peak MB | bounded replay s, peak MB | replay/baseline "
          "| scan/load | **replay/load** | **traced peak/dump** |")
    print("|" + "---|" * 17)
    for name, size, rows, mb, load, lib, cli, base, bnd, mem in table:
        bs = f"{base['seconds']:.2f}" if base else "-"
        speed = f"{base['seconds'] / lib['seconds']:.0f}x faster" if base else "-"
        bpk = f"{base['peak_mb']:.0f}" if base else "-"
        cs = f"{cli['seconds']:.2f}" if cli else "-"
        print(f"| {name} | {size:,} | {lib['findings']:,} | {mb:.0f} | {load['seconds']:.3f} | {lib['scan']:.3f} | "
              f"{lib['seconds']:.3f} | {rows / lib['seconds'] / 1e6:.0f}M | {cs} | {bs} | "
              f"{load['peak_mb']:.0f}/{lib['peak_mb']:.0f}/{bpk} | {mem['traced_peak_mb']:.0f} | "
              f"{bnd['seconds']:.2f}, {bnd['peak_mb']:.0f} | {speed} | {lib['scan'] / load['seconds']:.2f} | "
              f"**{lib['seconds'] / load['seconds']:.2f}** | **{mem['traced_peak_mb'] / mb:.2f}** |")
    print(f"(backend {table[0][5]['backend']} on {table[0][5]['device']})" if table else "")
    if phases:
        print_phases(phases)


if __name__ == "__main__":
    main()
