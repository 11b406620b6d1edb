"""Several files as one run (open_dumps): the files end to end, read into memory, or (bounded memory) their row
columns left in the files, as files.memory_plan decides."""

from __future__ import annotations

import os
import re

import numpy as np

from dcptool.dump import files, lazy
from dcptool.dump.lazy import ConcatRows, MappedFiles
from dcptool.dump.read import Dump, Head, file_head, read_dump
from dcptool.dump.schema import (
    COLUMNS,
    DTYPES,
    RAGGED,
    DumpConfig,
    DumpError,
    check_row_values,
    fail,
    validate_columns,
)
from dcptool.dump.stream import Reader, Source, Streamed


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
    """Read several files as one run: end to end in the order given, each in its own order (Dump); reports show
    the run's order (by step, then file order, then order within a file: Dump.order_of).

    `stream`: the row columns are read on a thread of their own (replay: the scan follows the read); the caller
    calls Dump.finish() before it reports. Without it they are read before this returns.

    Files that together take more than half the memory available now (or `bounded=True`: files.memory_plan) are read
    in bounded memory: each is validated in bounded mode, its per-observation columns are copied out (tens of bytes
    an observation), and its row columns stay in the file, read on demand (ConcatRows), so the set replays in
    bounded memory like one large file. Otherwise each file's rows are read straight into its part of one array
    per column: no copy after the read. `Dump.memory` says which.
    """
    if not paths:
        raise DumpError("no dump files given")
    paths = unique_files(paths)
    how = files.memory_plan(paths, bounded)
    if len(paths) == 1:
        d = read_dump(paths[0], how.bounded, stream=stream)
    else:
        d = _mapped(paths) if how.bounded else _read(paths, stream)
    d.memory = how
    return d


# NAME.00000.safetensors, NAME.00001.safetensors ...: the files a Recorder rolls one recording into (engine writer)
ROLLED = re.compile(r"^(?P<name>.+)\.\d{5,}(?P<suffix>\.[^./]*)?$")


def recording_ids(paths: list[str]) -> list[int]:
    """Per file, the recording it belongs to: the numbered files a Recorder rolled one recording into (the same
    NAME and suffix in one directory) share one; any other file is a recording of its own."""
    ids: dict[tuple, int] = {}
    out = []
    for p in paths:
        m = ROLLED.match(os.path.abspath(p))
        key = ("rolled", m["name"], m["suffix"]) if m else ("file", os.path.abspath(p))
        out.append(ids.setdefault(key, len(ids)))
    return out


def _one_run(paths: list[str], configs: list[DumpConfig]) -> tuple[DumpConfig, list[np.ndarray]]:
    """The set's config (the first file's, with every file's sites by name) and each file's site remap; DumpError
    when the files do not share what one run shares."""
    base = configs[0]
    for p, c in zip(paths[1:], configs[1:]):
        for k in ("dcp_size", "cp_interleave", "pcp_size", "page_size", "kv_groups", "attn_tensors"):
            if getattr(c, k) != getattr(base, k):
                raise DumpError(f"{p}: dcptool.config: {k} = {getattr(c, k)} but {paths[0]} "
                                f"has {getattr(base, k)}; these files are not one run")
    site_index = {s: i for i, s in enumerate(base.sites)}  # a dict: site lists may be long (no quadratic merge)
    for c in configs[1:]:
        for s in c.sites:
            site_index.setdefault(s, len(site_index))
    remap = [np.array([site_index[s] for s in c.sites], np.int32) for c in configs]
    return DumpConfig(**{**base.__dict__, "sites": tuple(site_index)}), remap


def _per_obs(cols: list[dict[str, np.ndarray]], keys: list[str], remap: list[np.ndarray],
             rows_before: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The files' per-observation columns end to end: sites by the set's list, parents where their file lies,
    offsets where their file's rows lie (rows_before[offsets key][f]: rows of the files before f)."""
    starts = np.cumsum([0] + [c["obs.step"].size for c in cols])
    out: dict[str, np.ndarray] = {}
    for key in keys:
        kind = COLUMNS[key][1]
        if kind == "n":
            parts = [c[key] for c in cols]
            if key == "obs.site":
                parts = [r[v] for r, v in zip(remap, parts)]
            elif key == "obs.parent":
                parts = [np.where(v >= 0, v + starts[f], -1) for f, v in enumerate(parts)]
            out[key] = np.concatenate(parts)
        elif kind == "n+1":
            b = rows_before[key]
            out[key] = np.concatenate([c[key][:-1] + b[f] for f, c in enumerate(cols)] + [b[-1:]])
    return out


def _dump(parts: list[Dump], cfg: DumpConfig, cols: dict, **kw) -> Dump:
    """The set's Dump: `cols` its columns end to end, `parts` each file's (files, injected, sizes, capped, idents)."""
    n = [int(p.file_obs.size) for p in parts]
    fidx = np.repeat(np.arange(len(n), dtype=np.int32), n)
    step = cols["obs.step"]
    return Dump(files=[p.files[0] for p in parts], config=cfg, columns=cols, file_index=fidx,
                file_obs=np.arange(fidx.size, dtype=np.int64) - np.repeat(np.cumsum([0] + n[:-1]), n),
                injected=[p.injected[0] for p in parts], sizes=[p.sizes[0] for p in parts],
                capped=[p.capped[0] for p in parts], idents=[p.idents[0] for p in parts],
                in_order=bool(step.size < 2 or (step[1:] >= step[:-1]).all()),
                recordings=recording_ids([p.files[0] for p in parts]), **kw)


def _read(paths: list[str], stream: bool) -> Dump:
    """The files read into memory, end to end: the per-observation columns now (each file validated but for its
    row values), each row column into one array, file f's part read straight from file f (on a thread of its
    own: the Reader, which validates each file's row values once its rows are in)."""
    heads, obs, kept = [], [], []  # kept: the files held open for the reader (the first few; the rest reopened)
    cap = lazy.max_open_files()
    try:
        for p in paths:
            p = str(p)
            try:
                f = files.open_file(p)
            except OSError as e:
                raise fail(p, None, f"cannot read: {e.strerror or e}") from None
            kept.append(f)
            h = file_head(p, f)
            heads.append(h)
            obs.append(_obs_columns(h, f))
            if len(kept) > cap:
                kept.pop().close()
                kept.append(None)
        return _read_rows(heads, obs, kept, stream)
    except BaseException:
        for f in kept:
            if f is not None:
                f.close()
        raise


def _read_rows(heads: list[Head], obs: list[dict[str, np.ndarray]], kept: list, stream: bool) -> Dump:
    """_read's row columns, each into one array (the Reader closes the files in `kept`)."""
    cfg, remap = _one_run([h.p for h in heads], [h.config for h in heads])
    keys = [k for k in COLUMNS if all(k in h.entries for h in heads)]
    row_keys = [k for k in keys if COLUMNS[k][1] not in ("n", "n+1")]
    count = {k: [int(h.entries[k][1][0]) for h in heads] for k in row_keys}
    big = {k: np.empty(sum(count[k]), DTYPES[COLUMNS[k][0]]) for k in row_keys}
    before = {k: np.cumsum([0] + count[k]).astype(np.int64) for k in row_keys}
    sources = []
    for f, h in enumerate(heads):
        mine = {k: big[k][before[k][f] : before[k][f + 1]] for k in row_keys}
        cols = {**obs[f], **mine}
        for k in h.rows():  # (a row column not every file has is not read: its shape is validated all the same)
            if k not in mine:
                cols[k] = np.broadcast_to(np.zeros(1, DTYPES[COLUMNS[k][0]]), (int(h.entries[k][1][0]),))
        validate_columns(h.p, h.config, cols, h.injected, row_values=False)
        rows = {k: (h.data_start + h.entries[k][2], count[k][f], v.view(np.uint8)) for k, v in mine.items()}
        mine = {**obs[f], **mine}
        sources.append(Source(h.p, rows, h.before, lambda p=h.p, c=h.config, m=mine: check_row_values(p, c, m),
                              kept[f]))
    cols = {**_per_obs(obs, keys, remap, _rows_before(keys, before)), **big}
    parts = [Dump(files=[h.p], config=h.config, columns={}, file_index=np.zeros(0, np.int32),
                  file_obs=np.arange(o["obs.step"].size, dtype=np.int64), injected=[h.injected], sizes=[h.size],
                  capped=[h.capped], idents=[h.ident]) for h, o in zip(heads, obs)]
    if not any(v.size for v in big.values()):  # (no row to read: the files' row values are checked now)
        for f in kept:
            if f is not None:
                f.close()
        for s in sources:
            s.validate()
        return _dump(parts, cfg, cols)
    reader = Reader(sources)
    d = _dump(parts, cfg, Streamed(cols, reader), reader=reader)
    if not stream:
        d.finish()
    return d


def _rows_before(keys: list[str], before: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per offsets column (of `keys`): the rows of the files before each file, and of all (before[row key])."""
    return {offs: before[ks[0]] for offs, ks in RAGGED.items() if offs in keys and ks[0] in before}


def _obs_columns(h: Head, f) -> dict[str, np.ndarray]:
    """The file's per-observation columns, read (one buffer for them all)."""
    keys = h.per_obs()
    spans = [(h.entries[k][2], h.entries[k][3]) for k in keys]
    buf = np.empty(sum(b - a for a, b in spans), np.uint8)
    out, at = {}, 0
    try:
        for k, (a, b) in zip(keys, spans):
            files.pread(h.p, f, buf, h.data_start + a, b - a, h.data_start + a - at, h.size)
            dt = DTYPES[h.entries[k][0]]
            out[k] = buf[at : at + b - a].view(dt)
            at += b - a
    except OSError as e:
        raise fail(h.p, None, f"cannot read: {e.strerror or e}") from None
    return out


def _mapped(paths: list[str]) -> Dump:
    """The files in bounded memory: each validated in bounded mode and its per-observation columns copied out; the
    row columns stay in the files, read on demand end to end (ConcatRows)."""
    dumps = [read_dump(p, True) for p in paths]
    cfg, remap = _one_run([d.files[0] for d in dumps], [d.config for d in dumps])
    keys = [k for k in COLUMNS if all(k in d.columns for d in dumps)]
    row_keys = [k for k in keys if COLUMNS[k][1] not in ("n", "n+1")]
    before = {k: np.cumsum([0] + [int(d[k].size) for d in dumps]).astype(np.int64) for k in row_keys}
    where = [{k: (d.maps[k][1], int(d[k].size)) if k in d.maps else (0, 0) for k in row_keys} for d in dumps]
    obs = [{k: np.array(v) for k, v in d.columns.items() if COLUMNS[k][1] in ("n", "n+1")} for d in dumps]
    mapped = MappedFiles([d.files[0] for d in dumps], [d.idents[0] for d in dumps])
    parts = [Dump(files=d.files, config=d.config, columns={}, file_index=d.file_index, file_obs=d.file_obs,
                  injected=d.injected, sizes=d.sizes, capped=d.capped, idents=d.idents) for d in dumps]
    del dumps  # (each mapping, and its descriptor, closes once nothing views it)
    cols = {**_per_obs(obs, keys, remap, _rows_before(keys, before)),
            **{k: ConcatRows(mapped, [w[k] for w in where], DTYPES[COLUMNS[k][0]], before[k]) for k in row_keys}}
    return _dump(parts, cfg, cols, bounded=True)
