"""The replay benchmarks' recordings in the vLLM plugin's layout: the same observations as one file, or one file per
DCP rank (`rank<r>.NNNNN.safetensors`, rolled over into several), made piece by piece so a 10^7-observation set is
written without holding it in memory.

Each step is one batch on `ranks` DCP ranks (interleave 16), 64-512 requests (rows), a few padded; the seq_lens are a
hash of (step, row), so every rank of a step records the same ones (rank-agree has nothing to say). A fraction
`wrong` of the observations is planted wrong, a quarter each: a `None` view, a wrong real row, a -1 in padding, a
view two rows short (1.0: every observation). The planted observations are drawn over the whole run, so every
layout of one (n, ranks, wrong, seed) holds the same observations with the same faults.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

I = 16  # noqa: E741  (cp_interleave, as bench_replay's dumps)
PIECE_OBS = 200_000  # observations generated at a time while a file is built


@dataclass
class Run:
    """What each observation is (global index = step * ranks + rank): the per-observation columns and the faults."""

    n: int
    ranks: int
    seed: int
    lens: np.ndarray  # rows (num_reqs_padded)
    nreq: np.ndarray
    kind: np.ndarray  # planted fault: -1 none, 0 None, 1 a wrong real row, 2 -1 in padding, 3 short
    at: np.ndarray  # the row a kind-1 fault changes

    @classmethod
    def make(cls, n: int, ranks: int, wrong: float, seed: int = 0) -> Run:
        rng = np.random.default_rng(seed)
        steps = -(-n // ranks)
        lens = rng.choice([64, 128, 192, 256, 320, 384, 448, 512], size=steps).astype(np.int64)
        lens += rng.integers(-8, 9, steps)
        pad = rng.integers(0, 8, steps)
        lens, pad = np.repeat(lens, ranks)[:n], np.repeat(pad, ranks)[:n]
        nreq = np.maximum(lens - pad, 0)
        kind = np.full(n, -1, np.int8)
        planted = rng.choice(n, size=min(n, max(4, round(n * wrong))), replace=False)
        kind[planted] = planted % 4
        at = (rng.random(n) * np.maximum(nreq, 1)).astype(np.int64)
        return cls(n, ranks, seed, lens, nreq, kind, at)

    def config(self):
        from dcptool.dump import DumpConfig

        return DumpConfig(dcp_size=self.ranks, cp_interleave=I, sites=("attn_metadata",), note="bench")

    def columns(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """The dump columns of observations idx (global indices, in the order the file holds them)."""
        from dcptool.dcp.reference import local_np

        lens, nreq, kind = self.lens[idx], self.nreq[idx], self.kind[idx]
        rank = (idx % self.ranks).astype(np.int32)
        rows = np.zeros(idx.size + 1, np.int64)
        np.cumsum(lens, out=rows[1:])
        dlen = np.where(kind == 0, 0, np.where(kind == 3, np.maximum(lens - 2, 0), lens))
        drows = np.zeros(idx.size + 1, np.int64)
        np.cumsum(dlen, out=drows[1:])
        seq = np.empty(int(rows[-1]), np.int32)
        dcp = np.empty(int(drows[-1]), np.int32)
        for lo in range(0, idx.size, PIECE_OBS):
            hi = min(idx.size, lo + PIECE_OBS)
            o = np.repeat(np.arange(lo, hi), lens[lo:hi])
            j = np.arange(rows[lo], rows[hi]) - rows[o]
            step = idx[o] // self.ranks
            h = (step * 2654435761 + j * 40503 + self.seed) % ((1 << 17) - 1)
            s = np.where(j < nreq[o], h + 1, 0).astype(np.int32)
            seq[rows[lo] : rows[hi]] = s
            v = np.where(j < nreq[o], local_np(s, self.ranks, rank[o], I), 0).astype(np.int32)
            v[(kind[o] == 1) & (j == self.at[idx][o]) & (j < nreq[o])] += 1
            v[(kind[o] == 2) & (j == lens[o] - 1) & (j >= nreq[o])] = -1
            dcp[drows[lo] : drows[hi]] = v[j < dlen[o]]
        return {"obs.step": (idx // self.ranks).astype(np.int64), "obs.site": np.zeros(idx.size, np.int32),
                "obs.rank": rank, "obs.ubatch": np.full(idx.size, -1, np.int32),
                "obs.num_reqs": nreq.astype(np.int32), "obs.num_reqs_padded": lens.astype(np.int32), "obs.rows": rows,
                "obs.has_dcp": (kind != 0).astype(np.uint8), "obs.dcp_rows": drows, "rows.seq_lens": seq,
                "rows.dcp_local_seq_lens": dcp}

    def write(self, path: Path, idx: np.ndarray) -> None:
        from dcptool.dump import write_dump

        write_dump(path, self.config(), self.columns(idx))


def one_file(data: Path, n: int, ranks: int = 4, wrong: float = 0.01, seed: int = 0) -> list[str]:
    """The run as one file (every rank's observations in step order), made once under `data`."""
    make(data, [(n, ranks, wrong, "one")], jobs=1, seed=seed)
    return [t[0] for t in _tasks(data, n, ranks, wrong, "one", seed)]


def per_rank(data: Path, n: int, ranks: int = 4, roll: int = 1, wrong: float = 0.01, seed: int = 0) -> list[str]:
    """The run as the plugin writes it: rank<r>.NNNNN.safetensors, each rank's observations rolled into `roll` files
    (in a directory of their own, made once under `data`); the files in the order a directory lists them."""
    make(data, [(n, ranks, wrong, f"rank{roll}")], jobs=1, seed=seed)
    return sorted(t[0] for t in _tasks(data, n, ranks, wrong, f"rank{roll}", seed))


def _layout_dir(data: Path, n: int, ranks: int, wrong: float, seed: int) -> Path:
    return data / f"layout-{n}-r{ranks}-w{wrong:g}-s{seed}"


@lru_cache(maxsize=2)
def _run(n: int, ranks: int, wrong: float, seed: int) -> Run:
    return Run.make(n, ranks, wrong, seed)


def _write_one(task: tuple) -> None:
    """One file of a layout (a worker's task): (path, n, ranks, wrong, seed, observations as (rank, roll, k))."""
    path, n, ranks, wrong, seed, part = task
    run = _run(n, ranks, wrong, seed)
    if part is None:
        idx = np.arange(n, dtype=np.int64)
    else:
        r, roll, k = part
        mine = np.arange(r, n, ranks, dtype=np.int64)
        cuts = np.linspace(0, mine.size, roll + 1).astype(np.int64)
        idx = mine[cuts[k] : cuts[k + 1]]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    run.write(Path(path), idx)


def _tasks(data: Path, n: int, ranks: int, wrong: float, name: str, seed: int) -> list[tuple]:
    out = _layout_dir(data, n, ranks, wrong, seed)
    if name == "one":
        return [(str(out / "one.safetensors"), n, ranks, wrong, seed, None)]
    roll = int(name.removeprefix("rank"))
    return [(str(out / f"per-rank-{roll}" / f"rank{r}.{k:05d}.safetensors"), n, ranks, wrong, seed, (r, roll, k))
            for r in range(ranks) for k in range(roll)]


def make(data: Path, layouts: list[tuple[int, int, float, str]], jobs: int, seed: int = 0) -> None:
    """Every file of the layouts (n, ranks, wrong, name: `one` or `rankR`) not made yet, `jobs` files at a time
    (a process each: a 10^7-observation set is a few minutes of one core); what one_file and per_rank read."""
    from concurrent.futures import ProcessPoolExecutor

    todo = [t for spec in layouts for t in _tasks(data, *spec, seed) if not os.path.exists(t[0])]
    todo.sort(key=lambda t: -(t[1] if t[5] is None else t[1] // (t[2] * t[5][1])))  # the largest files first
    if jobs <= 1 or len(todo) <= 1:
        for t in todo:
            _write_one(t)
        return
    with ProcessPoolExecutor(min(jobs, len(todo))) as pool:
        list(pool.map(_write_one, todo))


def size_of(paths: list[str]) -> int:
    return sum(os.stat(p).st_size for p in paths)
