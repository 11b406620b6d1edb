"""Replaying a rollover recording (several files) in bounded memory, against one file of the same data.

    python benchmarks/bench_rollover.py [--obs 1e5] [--files 8]

Writes bench_replay's dump of --obs observations (bench-data/, reused) and the same observations cut
into --files rollover files, then replays each way in its own child process (peak memory = VmHWM):
- one file, read into memory (the baseline);
- one file, bounded (mapped, pages dropped per chunk);
- the files merged in memory (what open_dumps does with files that fit);
- the files merged lazily (bounded: rows read from the files on demand; used when the files together
  are over half the memory available).
Times are library calls (open + replay, torch backend), start-up excluded. Findings must be the same
four times (checked). Prints time and peak memory with ratios against the one-file baseline.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def split(src: Path, out: Path, files: int) -> list[str]:
    """The observations of `src` cut into `files` numbered files (a rollover recording)."""
    from dcptool.dump import read_dump, write_dump

    out.mkdir(parents=True, exist_ok=True)
    names = [str(out / f"run.{k:05d}.safetensors") for k in range(files)]
    if all(Path(p).exists() for p in names):
        return names
    d = read_dump(src)
    cuts = np.linspace(0, d.n, files + 1).astype(np.int64)
    for p, a, b in zip(names, cuts[:-1].tolist(), cuts[1:].tolist()):
        cols = {}
        for k, v in d.columns.items():
            if k in ("obs.rows", "obs.dcp_rows"):
                cols[k] = v[a : b + 1] - v[a]
            elif k.startswith("obs."):
                cols[k] = v[a:b]
        for offs, keys in (("obs.rows", ("rows.seq_lens",)), ("obs.dcp_rows", ("rows.dcp_local_seq_lens",))):
            o = d[offs]
            for k in keys:
                cols[k] = d[k][o[a] : o[b]]
        write_dump(p, d.config, cols)
    return names


def child(bounded: str, *paths: str) -> dict:
    import torch  # noqa: F401  (start-up, not measured)

    from dcptool.check.replay import replay
    from dcptool.dump import open_dumps

    t = time.perf_counter()
    d = open_dumps(list(paths), bounded=bounded == "1")
    res = replay(d, "torch", bounded=d.bounded)
    sec = time.perf_counter() - t
    keys = [(f.rule, f.file.rsplit("/", 1)[-1][:3], f.step, f.rank) for f in res.findings]
    return {"seconds": sec, "bounded": d.bounded, "findings": len(res.findings),
            "check": hash(tuple(sorted((r, s, k) for r, _, s, k in keys)))}


def run(bounded: bool, paths: list[str]) -> dict:
    code = (f"import json, sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'benchmarks')!r}]; "
            "from bench_rollover import child; from bench_replay import peak_mb; r = child(*sys.argv[1:]); "
            "r['peak_mb'] = peak_mb(); print(json.dumps(r))")
    out = subprocess.run([sys.executable, "-c", code, "1" if bounded else "0", *paths], capture_output=True,
                         text=True, check=True, env={"PYTHONHASHSEED": "0", **dict(__import__("os").environ)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from bench_replay import make_dump

    ap = argparse.ArgumentParser()
    ap.add_argument("--obs", default="1e5")
    ap.add_argument("--files", type=int, default=8)
    args = ap.parse_args()
    n = int(float(args.obs))
    data = ROOT / "bench-data"
    data.mkdir(exist_ok=True)
    one = data / f"bench-{n}.safetensors"
    if not one.exists():
        make_dump(one, n)
    parts = split(one, data / f"rollover-{n}-{args.files}", args.files)
    mb = one.stat().st_size / 1e6
    print(f"{n:,} observations, {mb:,.0f} MB, {args.files} rollover files")
    print("| read | s | peak MB | s / baseline | peak / baseline | findings |")
    print("|---|---|---|---|---|---|")
    base = None
    seen = set()
    for name, bounded, paths in (("one file, in memory (baseline)", False, [str(one)]),
                                 ("one file, bounded", True, [str(one)]),
                                 (f"{args.files} files, merged in memory", False, parts),
                                 (f"{args.files} files, merged lazily (bounded)", True, parts)):
        r = run(bounded, paths)
        base = base or r
        seen.add((r["findings"], r["check"]))
        print(f"| {name} | {r['seconds']:.3f} | {r['peak_mb']:.0f} | {r['seconds'] / base['seconds']:.2f} | "
              f"{r['peak_mb'] / base['peak_mb']:.2f} | {r['findings']:,} |", flush=True)
    assert len(seen) == 1, f"the four reads disagree: {seen}"


if __name__ == "__main__":
    main()
