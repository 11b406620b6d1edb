"""The row scan end to end, CPU against GPU (host columns in, sparse results out, transfers included),
at 10^3..10^7 observations, and where the GPU starts to win: the number behind scan.GPU_MIN_OBS.

    python benchmarks/bench_scan.py                          # 1e3 .. 1e7 (about 35 GB of host memory at 1e7)
    python benchmarks/bench_scan.py --sizes 1e3,1e4,1e5      # CPU only where there is no GPU

One process, one data set (observations of 56-520 rows, ~288 on average, DCP 4, interleave 16, page
counts, ~1% of observations wrong), every size a prefix of it. Columns per size:
- cpu s: `scan(d, "torch")`, the CPU path (one thread), best of a few runs;
- gpu s: `scan(d, "triton")` on CUDA: pinned double-buffered staging, copies on a side stream
  overlapped with the check (warm: the process has run the kernels before);
- old gpu s: the path before the pipelined transfer, in the same run (one pageable copy of each column,
  then one launch): the baseline for the transfer work;
- gpu / cpu, gpu / old: ratios (< 1: faster).
A process's first GPU scan also pays CUDA start-up and Triton's kernel load, once: printed as
`start-up s`. The crossover is the smallest size from which the GPU wins, warm and with the start-up
added (a CLI replay runs in a fresh process: that one is what `auto` uses). All paths must give the
same findings (checked).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

N, I, PAGE = 4, 16, 16
BASE_OBS = 100_000  # distinct observations generated; larger sizes repeat them (the scan does not care)


def make_columns(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    from dcptool.dcp.reference import local_np

    rng = np.random.default_rng(seed)
    m = min(n, BASE_OBS)
    lens = rng.choice([64, 128, 192, 256, 320, 384, 448, 512], size=m).astype(np.int64) + rng.integers(-8, 9, m)
    nreq = np.maximum(lens - rng.integers(0, 8, m), 0)
    rank = rng.integers(0, N, m).astype(np.int32)
    rows = np.zeros(m + 1, np.int64)
    np.cumsum(lens, out=rows[1:])
    obs = np.repeat(np.arange(m), lens)
    real = np.arange(rows[-1]) - rows[obs] < nreq[obs]
    seq = np.where(real, rng.integers(1, 1 << 17, rows[-1]), 0).astype(np.int32)
    local = local_np(seq, N, rank[obs], I).astype(np.int32)
    dcp = np.where(real, local, 0).astype(np.int32)
    kv = np.where(real, -(-local // PAGE), -1).astype(np.int32)
    wrong = rng.choice(m, size=max(1, m // 100), replace=False)
    dcp[rows[wrong] + np.minimum(nreq[wrong], 1) - 1] += 1  # a wrong real row (or a bad padded one)
    reps = -(-n // m)
    R = int(rows[-1])
    big_rows = (rows[:-1][None, :] + R * np.arange(reps)[:, None]).reshape(-1)[:n]
    end = int(rows[n - (reps - 1) * m] + (reps - 1) * R) if n else 0
    offs = np.append(big_rows, end).astype(np.int64)
    tile = lambda a: np.tile(a, reps)[: (n if a.size == m else end)]  # noqa: E731
    return {"obs.step": np.arange(n, dtype=np.int64), "obs.site": np.zeros(n, np.int32),
            "obs.rank": tile(rank), "obs.ubatch": np.full(n, -1, np.int32),
            "obs.num_reqs": tile(nreq.astype(np.int32)), "obs.num_reqs_padded": tile(lens.astype(np.int32)),
            "obs.rows": offs, "obs.has_dcp": np.ones(n, np.uint8), "obs.dcp_rows": offs,
            "rows.seq_lens": tile(seq), "rows.dcp_local_seq_lens": tile(dcp), "rows.kv_pages": tile(kv)}


def prefix(cols: dict[str, np.ndarray], n: int):
    from dcptool.dump import Dump, DumpConfig

    r = int(cols["obs.rows"][n])
    c = {k: (v[: n + 1] if k in ("obs.rows", "obs.dcp_rows") else v[:r] if k.startswith("rows.") else v[:n])
         for k, v in cols.items()}
    return Dump(files=["bench"], config=DumpConfig(dcp_size=N, cp_interleave=I, sites=("x",), page_size=PAGE),
                columns=c, file_index=np.zeros(n, np.int32), file_obs=np.arange(n, dtype=np.int64))


def old_gpu(d):
    """The GPU scan without the pipelined transfer: each column copied whole through pageable memory, one launch."""
    import torch

    from dcptool.dcp.fused import check_rows

    c = d.config
    t = lambda x: torch.from_numpy(np.ascontiguousarray(x)).to("cuda")  # noqa: E731
    st = check_rows(t(d["rows.seq_lens"]), t(d["obs.rows"]), t(d["rows.dcp_local_seq_lens"]), t(d["obs.dcp_rows"]),
                    t(d["obs.num_reqs"]), t(d["obs.num_reqs_padded"]), t(d["obs.rank"]), c.dcp_size, c.cp_interleave,
                    kv_pages=t(d["rows.kv_pages"]), page_size=c.page_size)
    return type(st)(*st.stacked().cpu().numpy().astype(np.int64)).sparse()


STARTUP = """
import sys, time
sys.path[:0] = [{root!r}, {bench!r}]
import torch
from bench_scan import make_columns, prefix
from dcptool.check.scan import scan
d = prefix(make_columns(1000), 1000)
t = time.perf_counter(); scan(d, "triton"); first = time.perf_counter() - t
t = time.perf_counter(); scan(d, "triton"); warm = time.perf_counter() - t
print(first - warm)
"""


def measure_startup() -> float:
    """What a fresh process pays once for its first GPU scan (a child process; Triton's cache is warm:
    the first child fills it on a new machine, which is why the best of several runs is taken)."""
    import subprocess

    code = STARTUP.format(root=str(ROOT), bench=str(ROOT / "benchmarks"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def timed(fn, reps: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def same(a, b) -> bool:
    return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)


def cpu_sweep(d) -> None:
    """The CPU scan on 1-8 threads at two chunk sizes, against one thread at scan.CHUNK_ROWS (same run)."""
    import os

    from dcptool.check import scan as scan_mod

    default = scan_mod.CHUNK_ROWS
    base, want = timed(lambda: scan_mod.scan(d, "torch", threads=1), 3)
    print(f"CPU scan, {d.n:,} observations, {int(d['obs.rows'][-1]):,} rows, {os.cpu_count()} cores: one thread at "
          f"CHUNK_ROWS {default:,}: {base:.4f} s (baseline)")
    print("| chunk rows | threads | s | / baseline |")
    print("|---|---|---|---|")
    for chunk in (default, 4 * default):
        scan_mod.CHUNK_ROWS = chunk
        for k in (1, 2, 4, 8):
            s, got = timed(lambda k=k: scan_mod.scan(d, "torch", threads=k), 3)
            assert same(got, want), f"the scan on {k} threads disagrees"
            print(f"| {chunk:,} | {k} | {s:.4f} | {s / base:.2f} |", flush=True)
    scan_mod.CHUNK_ROWS = default


def main() -> None:
    import torch

    from dcptool.check.scan import GPU_MIN_OBS, scan

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1e3,3e3,1e4,3e4,1e5,3e5,1e6,3e6,1e7")
    ap.add_argument("--no-old", action="store_true", help="skip the old GPU path (it holds the whole dump on the GPU)")
    ap.add_argument("--cpu-threads", action="store_true",
                    help="only the CPU scan's thread and chunk sweep at the largest size (baseline: 1 thread, "
                         "scan.CHUNK_ROWS, same run)")
    args = ap.parse_args()
    sizes = sorted(int(float(x)) for x in args.sizes.split(","))
    gpu = torch.cuda.is_available()
    torch.set_num_threads(1)
    print(f"{torch.cuda.get_device_name() if gpu else 'no GPU'}  torch {torch.__version__}  "
          f"scan.GPU_MIN_OBS = {GPU_MIN_OBS:,}", flush=True)
    t0 = time.perf_counter()
    cols = make_columns(sizes[-1])
    print(f"data: {sizes[-1]:,} observations, {cols['obs.rows'][-1]:,} rows, made in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    if args.cpu_threads:
        cpu_sweep(prefix(cols, sizes[-1]))
        return
    startup = 0.0
    if gpu:
        startup = min(measure_startup() for _ in range(3))
        print(f"start-up s (a fresh process's first GPU scan less a warm one: CUDA context, Triton's kernel "
              f"load from its cache, pinned buffers; best of 3): {startup:.3f}")
        scan(prefix(cols, sizes[0]), "triton")  # this process's own start-up, not timed below
    print("| obs | rows | MB | cpu s | gpu s | old gpu s | gpu / cpu | gpu / old | gpu + start-up / cpu |")
    print("|---|---|---|---|---|---|---|---|---|")
    warm_x = cold_x = None
    for n in sizes:
        d = prefix(cols, n)
        rows = int(d["obs.rows"][-1])
        mb = (rows * 12 + n * 37) / 1e6
        reps = 5 if rows < 1e7 else 2 if rows < 3e8 else 1
        cpu_s, want = timed(lambda d=d: scan(d, "torch"), reps)
        line = f"| {n:,} | {rows / 1e6:.1f}M | {mb:,.0f} | {cpu_s:.4f} |"
        if gpu:
            gpu_s, got = timed(lambda d=d: scan(d, "triton"), reps + 1)
            assert same(got, want), f"GPU scan disagrees with the CPU scan at {n}"
            if args.no_old:
                old_s = float("nan")
            else:
                old_s, old = timed(lambda d=d: old_gpu(d), reps)
                assert same(old, want), f"old GPU scan disagrees at {n}"
                torch.cuda.empty_cache()
            line += (f" {gpu_s:.4f} | {old_s:.4f} | {gpu_s / cpu_s:.2f} | {gpu_s / old_s:.2f} | "
                     f"{(gpu_s + startup) / cpu_s:.2f} |")
            if gpu_s < cpu_s and warm_x is None:
                warm_x = n
            if gpu_s + startup < cpu_s and cold_x is None:
                cold_x = n
        else:
            line += " - | - | - | - | - |"
        print(line, flush=True)
    if gpu:
        from dcptool.gpu import staging

        n = max([x for x in sizes if x <= 1_000_000] or sizes[:1])
        d = prefix(cols, n)
        default = staging.STAGE_THREADS
        print(f"\nstaging threads at {n:,} observations (staging.STAGE_THREADS = {default}):")
        print("| threads | gpu s | GB/s (dump bytes / gpu s) |")
        print("|---|---|---|")
        for k in (1, 2, 4, 8):
            staging.STAGE_THREADS = k
            s, _ = timed(lambda: scan(d, "triton"), 3)
            print(f"| {k} | {s:.4f} | {(int(d['obs.rows'][-1]) * 12 + n * 37) / s / 1e9:.1f} |")
        staging.STAGE_THREADS = default
        say = lambda x: f"{x:,} observations" if x is not None else "not within the sizes run"  # noqa: E731
        print(f"crossover, warm (GPU already started): {say(warm_x)}")
        print(f"crossover, fresh process (start-up included; what `auto` should use): {say(cold_x)}")
        print(f"set dcptool/scan.py GPU_MIN_OBS to {cold_x if cold_x is not None else 'a size past the last run'}"
              f" (now {GPU_MIN_OBS:,})")


if __name__ == "__main__":
    main()
