"""Whether files read together are one run: the files of one run (one per rank, a rank's rolled files) name the same
engine and never record a rank's steps twice; two runs named together (a broken and a fixed recording) do both."""

from __future__ import annotations

import json

import numpy as np

from dcptool.dump.files import read_header
from dcptool.dump.read import Dump


def _engine(path: str) -> tuple[str | None, str | None]:
    """(engine, engine_version) a file's config names (validated when the file was read)."""
    meta = read_header(path)[0].get("__metadata__") or {}
    cfg = json.loads(meta.get("dcptool.config", "{}"))
    return cfg.get("engine"), cfg.get("engine_version")


def several_runs(d: Dump) -> str | None:
    """Why the files of `d` look like more than one run, or None when they may be one.

    Two signs: the files name different engines or engine versions; or a DCP rank's steps are recorded by more
    files at once than one run has processes for that rank (pcp_size when every such file holds that rank alone,
    else 1). A rank's rolled files share at most their boundary step, so steps are compared as open intervals
    (first step, last step) of each file."""
    if len(d.files) < 2:
        return None
    seen: dict[tuple, str] = {}
    for f in d.files:
        e = _engine(f)
        seen.setdefault(e, f)
        if len(seen) > 1:
            (ea, fa), (eb, fb) = list(seen.items())[:2]
            return (f"{fa} and {fb} look like two runs: one records {_name(ea)}, the other {_name(eb)}")
    return _overlap(d)


def _name(e: tuple[str | None, str | None]) -> str:
    engine, version = e
    return f"{engine or 'an unnamed engine'} ({version or 'no engine_version'})"


def _overlap(d: Dump) -> str | None:
    fidx = d.file_index.astype(np.int64)
    rank = d["obs.rank"].astype(np.int64)
    step = d["obs.step"].astype(np.int64)
    if fidx.size == 0:
        return None
    # per (rank, file): first and last step
    order = np.lexsort((fidx, rank))
    r, f, s = rank[order], fidx[order], step[order]
    start = np.flatnonzero(np.r_[True, (r[1:] != r[:-1]) | (f[1:] != f[:-1])])
    lo, hi = np.minimum.reduceat(s, start), np.maximum.reduceat(s, start)
    g_rank, g_file = r[start], f[start]
    ranks_in_file = np.bincount(np.unique(np.c_[fidx, rank], axis=0)[:, 0], minlength=len(d.files))
    for rk in np.unique(g_rank).tolist():
        at = np.flatnonzero(g_rank == rk)
        alone = bool((ranks_in_file[g_file[at]] == 1).all())
        allowed = d.config.pcp_size if alone else 1
        # open intervals (lo, hi): at a shared coordinate the ends come before the starts
        ev = np.r_[lo[at], hi[at]]
        kind = np.r_[np.ones(at.size, np.int64), -np.ones(at.size, np.int64)]
        e = np.lexsort((kind, ev))
        depth = np.cumsum(kind[e])
        k = int(np.argmax(depth))
        if depth[k] > allowed:
            where = ev[e][k]
            files = [d.files[int(g_file[j])] for j in at if lo[j] <= where < hi[j]][:2]
            return (f"{files[0]} and {files[1]} look like two runs: both record DCP rank {rk} at step {where}, "
                    f"which one run records in {'one file' if allowed == 1 else f'{allowed} files (pcp_size)'}")
    return None
