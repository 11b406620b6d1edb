"""Provenance on the hostile case: thousands of wrong views of one rank in one step (no
quadratic path: docs/performance.md has what it cost when each finding was compared with every earlier one).

    python benchmarks/bench_provenance.py                   # 1,000 .. 16,000 wrong views
    python benchmarks/bench_provenance.py --sizes 4000 --backend torch

Three shapes of the same size: `one-step` (every view wrong, nothing to cite: the search finds
nothing, the worst case for a per-candidate loop), `one-bucket` (every observation's leading
expected rows alike, one per step: the earlier-step search's old hash bucket holds them all) and
`stale` (every view a copy of the observation before it in the step: every search hits). Prints,
measured in one run: load (read and touch every column), the bulk search alone (`prepare`),
replay, replay/load, and how replay grows from one size to the next (2.0x for 2x the views is
linear; the old search grew 4x).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make(path: Path, n: int, shape: str, rows: int = 4, seed: int = 0) -> None:
    from dcptool.check.provenance import local_np
    from dcptool.dump import DumpConfig, write_dump

    rng = np.random.default_rng(seed)
    seq = rng.integers(1, 1000, (n, rows)).astype(np.int32)
    step = np.zeros(n, np.int64)
    dcp = rng.integers(1000, 2000, (n, rows)).astype(np.int32)  # never a local length
    if shape == "one-bucket":
        seq[:, :2] = [500, 300]
        dcp[:, :2] = [250, 150]
        step = np.arange(n, dtype=np.int64)
    elif shape == "stale":
        dcp[1:] = local_np(seq[:-1], 2, 0, 1)  # the previous observation's rows
    offs = np.arange(n + 1, dtype=np.int64) * rows
    cols = {"obs.step": step, "obs.site": np.zeros(n, np.int32), "obs.rank": np.zeros(n, np.int32),
            "obs.ubatch": np.full(n, -1, np.int32), "obs.num_reqs": np.full(n, rows, np.int32),
            "obs.num_reqs_padded": np.full(n, rows, np.int32), "obs.rows": offs, "rows.seq_lens": seq.ravel(),
            "obs.has_dcp": np.ones(n, np.uint8), "obs.dcp_rows": offs.copy(), "rows.dcp_local_seq_lens": dcp.ravel()}
    write_dump(path, DumpConfig(dcp_size=2, sites=("attn_metadata",), note=f"bench {shape}"), cols)


def measure(path: Path, backend: str) -> dict:
    from dcptool.check.provenance import Provenance
    from dcptool.check.replay import replay
    from dcptool.check.scan import scan
    from dcptool.dump import open_dumps, read_dump

    t = time.perf_counter()
    d = read_dump(path)
    acc = sum(int(v.max()) for v in d.columns.values() if v.size)  # touch every byte: the floor
    load = time.perf_counter() - t
    d = open_dumps([str(path)])
    st = scan(d, backend)
    t = time.perf_counter()
    Provenance(d).prepare(st.obs[st.n_wrong > 0])
    prep = time.perf_counter() - t
    t = time.perf_counter()
    res = replay(open_dumps([str(path)]), backend)
    rep = time.perf_counter() - t
    return {"load": load, "prepare": prep, "replay": rep, "findings": len(res.findings), "check": acc,
            "rules": sorted({f.rule for f in res.findings})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,2000,4000,8000,16000")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--shapes", default="one-step,one-bucket,stale")
    a = ap.parse_args()
    import torch  # noqa: F401  (start-up, not measured)

    sizes = [int(float(s)) for s in a.sizes.split(",")]
    print(f"{'shape':<11} {'views':>7} {'load s':>8} {'prepare s':>10} {'replay s':>9} {'replay/load':>12} "
          f"{'growth':>7}  rules")
    with tempfile.TemporaryDirectory() as tmp:
        for shape in a.shapes.split(","):
            prev = None
            for n in sizes:
                p = Path(tmp) / f"{shape}-{n}.safetensors"
                make(p, n, shape)
                measure(p, a.backend)  # warm-up: imports, first-call costs
                r = measure(p, a.backend)
                assert r["findings"] == n, r
                growth = "" if prev is None else f"{r['replay'] / prev:.2f}x"
                print(f"{shape:<11} {n:>7,} {r['load']:>8.4f} {r['prepare']:>10.4f} {r['replay']:>9.3f} "
                      f"{r['replay'] / r['load']:>11.0f}x {growth:>7}  {','.join(r['rules'])}")
                prev = r["replay"]


if __name__ == "__main__":
    main()
