"""Several files as one run (open_dumps): merged in memory, or (bounded memory) row columns left in the files."""

from __future__ import annotations

import os

import numpy as np

from dcptool.dump import files
from dcptool.dump.lazy import MappedFiles, MergedRows
from dcptool.dump.read import Dump, read_dump
from dcptool.dump.schema import (
    COLUMNS,
    DTYPES,
    RAGGED,
    DumpConfig,
    DumpError,
)


def unique_files(paths: list[str | os.PathLike]) -> list[str | os.PathLike]:
    """paths without a file named again (the same path, a symlink to it, a hard link, a directory's file
    listed beside the directory): each file is read once, at its first name, never double-counted.
    A path that cannot be stat'ed is kept, for the reader to report."""
    seen: set[tuple[int, int]] = set()
    out = []
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            out.append(p)
            continue
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            out.append(p)
    return out


def open_dumps(paths: list[str | os.PathLike], bounded: bool | None = None, stream: bool = False) -> Dump:
    """Read several files as one run: ordered by step, then file order, then order within a file.

    `stream`: one file read in memory is read as read_dump(stream=True) does (replay: the scan follows the
    read); the caller calls Dump.finish() before it reports. Several files are read at once as before.

    Files that together take more than half the memory available now (or `bounded=True`) are merged
    lazily: each is validated in bounded mode, its per-observation columns are merged in memory (tens of
    bytes an observation), and its row columns stay in the file, read on demand (MergedRows), so the
    set replays in bounded memory like one large file. Otherwise everything is merged in memory.
    """
    if not paths:
        raise DumpError("no dump files given")
    paths = unique_files(paths)
    lazy = bool(bounded) and len(paths) > 1
    if bounded is None and len(paths) > 1:
        avail = files.available_memory()
        total = 0
        for p in paths:
            try:
                total += os.stat(p).st_size
            except OSError:
                pass  # read_dump reports it
        lazy = avail is not None and total > avail // 2
    if len(paths) == 1:
        return read_dump(paths[0], bounded, stream=stream)
    dumps = [_obs_only(read_dump(p, True)) if lazy else read_dump(p, bounded) for p in paths]
    if len(dumps) == 1:
        return dumps[0]
    base = dumps[0].config
    for d in dumps[1:]:
        c = d.config
        for k in ("dcp_size", "cp_interleave", "pcp_size", "page_size", "kv_groups", "attn_tensors"):
            if getattr(c, k) != getattr(base, k):
                raise DumpError(f"{d.files[0]}: dcptool.config: {k} = {getattr(c, k)} but {dumps[0].files[0]} "
                                f"has {getattr(base, k)}; these files are not one run")
    site_index = {s: i for i, s in enumerate(base.sites)}  # a dict: site lists may be long (no quadratic merge)
    for d in dumps[1:]:
        for s in d.config.sites:
            site_index.setdefault(s, len(site_index))
    sites = list(site_index)
    cfg = DumpConfig(**{**base.__dict__, "sites": tuple(sites)})
    keys = [k for k in COLUMNS if all(k in d.columns for d in dumps)]
    # Stable sort by (step, file): observations of one step keep file order, then in-file order.
    step = np.concatenate([d["obs.step"] for d in dumps])
    fidx = np.concatenate([np.full(d.n, i, np.int32) for i, d in enumerate(dumps)])
    fobs = np.concatenate([np.arange(d.n, dtype=np.int64) for d in dumps])
    order = np.lexsort((fobs, fidx, step))
    starts = np.cumsum([0] + [d.n for d in dumps])
    inv = np.empty_like(order)
    inv[order] = np.arange(order.size)
    cols: dict[str, np.ndarray] = {}
    for key in keys:
        kind = COLUMNS[key][1]
        if kind == "n":
            parts = []
            for i, d in enumerate(dumps):
                v = d[key]
                if key == "obs.site":
                    remap = np.array([site_index[s] for s in d.config.sites], np.int32)
                    v = remap[v]
                elif key == "obs.parent":
                    v = np.where(v >= 0, v + starts[i], -1)
                parts.append(v)
            v = np.concatenate(parts)
            if key == "obs.parent":
                v = np.where(v >= 0, inv[np.maximum(v, 0)], -1)
            cols[key] = v[order]
    mapped = MappedFiles([d.files[0] for d in dumps], [d.idents[0] for d in dumps]) if lazy else None
    in_order = bool((order == np.arange(order.size)).all())
    for offs_key, row_keys in RAGGED.items():
        if offs_key not in keys:
            continue
        lens = np.concatenate([np.diff(d[offs_key]) for d in dumps])
        before = np.cumsum([0] + [int(d[offs_key][-1]) for d in dumps])  # rows of the files before each
        starts_rows = np.concatenate([d[offs_key][:-1] + before[i] for i, d in enumerate(dumps)])
        lens_o = lens[order]
        new_offs = np.zeros(order.size + 1, np.int64)
        np.cumsum(lens_o, out=new_offs[1:])
        cols[offs_key] = new_offs
        for rk in row_keys:
            if rk not in keys:
                continue
            if lazy:  # the rows stay in the files
                cols[rk] = MergedRows(mapped, [d.row_parts.get(rk) for d in dumps], DTYPES[COLUMNS[rk][0]],
                                      new_offs, starts_rows[order], before.astype(np.int64))
            elif in_order:  # rollover files with steps in order: the merge is the files end to end
                cols[rk] = np.concatenate([d[rk] for d in dumps])
            else:  # gather every row run in the new order with one vectorised index build
                src = np.repeat(starts_rows[order] - new_offs[:-1], lens_o) + np.arange(new_offs[-1])
                cols[rk] = np.concatenate([d[rk] for d in dumps])[src]
    return Dump(files=[f for d in dumps for f in d.files], config=cfg, columns=cols, file_index=fidx[order],
                file_obs=fobs[order], injected=[d.injected[0] for d in dumps], sizes=[d.sizes[0] for d in dumps],
                capped=[c for d in dumps for c in d.capped],
                bounded=lazy, idents=[d.idents[0] for d in dumps])


def _obs_only(d: Dump) -> Dump:
    """A validated bounded dump without its mapping: per-observation columns copied out, row columns
    replaced by where they lie in the file (row_parts: key -> (byte offset, count)); the mapping (and its
    descriptor) is closed once nothing views it, so thousands of files need no descriptor each."""
    parts: dict[str, tuple[int, int]] = {}
    cols: dict[str, np.ndarray] = {}
    for key, v in d.columns.items():
        if key.startswith("obs."):
            cols[key] = np.array(v)  # a copy: the mapping goes
        else:
            parts[key] = (d.maps[key][1], int(v.size)) if key in d.maps else (0, 0)
            cols[key] = np.zeros(0, v.dtype)  # present (for the merge's key list), never read
    return Dump(files=d.files, config=d.config, columns=cols, file_index=d.file_index, file_obs=d.file_obs,
                injected=d.injected, sizes=d.sizes, idents=d.idents, row_parts=parts, capped=d.capped)
