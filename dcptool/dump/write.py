"""Writing a dump: row-form observations to columns, encoding, atomic writes and the output-path checks."""

from __future__ import annotations

import json
import os
import stat
import struct
import tempfile
from pathlib import Path

import numpy as np

from dcptool.dump.observation import (
    FIELDS,
    GROUPS,
    ROW_TABLE,
    ROWS,
    SCALAR_FIELDS,
    TOKENS,
    Field,
    Observation,
    numpy_dtype,
)
from dcptool.dump.schema import (
    COLUMNS,
    DTYPE_NAMES,
    DTYPES,
    FORMAT_VERSION,
    INT32_MAX,
    DumpConfig,
    DumpError,
    OutputExistsError,
    WriteError,
    clean,
    fail,
    parse_config,
    validate_columns,
)


def columns(config: DumpConfig, sites: list[str], vals: dict, rows: dict) -> tuple[DumpConfig, dict[str, np.ndarray]]:
    """Row-form observations -> dump columns (docs/format.md): the one place both writers (pack, Recorder) go through.

    sites: one site name per observation (added to the config's list in order of first use);
    vals: FIELDS -> one value per observation (None where unknown); rows: ROW_FIELDS -> one 1-D
    array per observation (None: a `None` DCP view, or an unknown query_start_loc / kv_pages).
    The columns follow the observation's fields (dump.observation.FIELDS_TABLE): optional ones are written when
    any observation knows them; the others get the field's "unknown" value (-1; 0 for obs.buffer and obs.graph),
    so checks needing them skip those observations.
    """
    n = len(sites)
    names = list(config.sites)
    for site in dict.fromkeys(sites):
        if site not in names:
            names.append(site)
    cfg = DumpConfig(**{**config.__dict__, "sites": tuple(names)})
    index = {site: i for i, site in enumerate(names)}
    cols = {"obs.site": np.array([index[x] for x in sites], "<i4")}
    for f in SCALAR_FIELDS:
        if f.always or any(v is not None for v in vals[f.name]):
            cols[f.column] = _scalar_column(f, vals[f.name])
    first: dict[str, tuple[str, list | None]] = {}  # offsets column -> (its first field, its arrays if written)
    for f in ROW_TABLE:
        arrs = rows.get(f.section)  # (absent from a caller that predates the field: not written)
        if arrs is None:
            continue
        if f.offsets not in first:  # the first field of its offsets column: written when any observation has it
            known = f.always or any(a is not None for a in arrs)
            first[f.offsets] = (f.name, arrs if known else None)
            if not known:
                continue
            cols[f.offsets] = _offsets(arrs, n)
        owner, owned = first[f.offsets]
        if owned is None:
            continue  # (the field its offsets go with is not recorded: neither is it)
        if owner != f.name and f.shape == ROWS:  # one value per row of the field it shares offsets with: None -1
            if not any(a is not None for a in arrs):
                continue
            arrs = [np.full(q.size, -1, np.int32) if a is None else a for a, q in zip(arrs, owned)]
        if f.present is not None:
            cols[f.present] = np.array([a is not None for a in arrs], "u1")
        got = [a for a in arrs if a is not None]
        cols[f.column] = _cat(got, f.column) if got else np.zeros(0, "<i4")
    return cfg, cols


def _scalar_column(f: Field, values) -> np.ndarray:
    """A scalar field's column: its values in the column's dtype, None as the field's "unknown"."""
    dtype = numpy_dtype(f)
    v = [f.unknown if x is None else x for x in values]
    try:
        return np.array(v, dtype=dtype)
    except OverflowError:  # a Python int the column cannot hold
        bad = next(x for x in v if not np.iinfo(dtype).min <= int(x) <= np.iinfo(dtype).max)
        raise DumpError(f"{f.name}: value {bad} does not fit {np.dtype(dtype).name}") from None


def _offsets(arrs, n: int) -> np.ndarray:
    out = np.zeros(n + 1, np.int64)
    np.cumsum(np.fromiter((0 if a is None else a.size for a in arrs), np.int64, n), out=out[1:])
    return out


def slot_entries(positions, slot_mapping, groups: int | None = None) -> tuple:
    """(positions, slot_mapping, slot_group) per entry of the slot columns: one entry per token and KV-cache
    group, groups ascending; or (None, None, None) when neither is given. `slot_mapping`: 1-D (group 0),
    [groups, tokens], or {group index: 1-D}; host arrays (numpy or lists). ValueError for what cannot be
    stored: one without the other, a length that is not one per position, a group outside [0, groups)."""
    if positions is None and slot_mapping is None:
        return (None, None, None)
    if positions is None or slot_mapping is None:
        raise ValueError("positions and slot_mapping go together")
    pos = np.asarray(positions).reshape(-1)
    if isinstance(slot_mapping, dict):
        maps = slot_mapping
    else:
        m = np.asarray(slot_mapping)
        maps = {0: m} if m.ndim == 1 else dict(enumerate(m))  # [groups, tokens]
    keys = sorted(int(g) for g in maps)
    hi = INT32_MAX if groups is None else groups - 1
    if keys and not (0 <= keys[0] and keys[-1] <= hi):
        raise ValueError(f"KV-cache group {keys[0] if keys[0] < 0 else keys[-1]} out of range")
    slots = [np.asarray(maps[g]).reshape(-1) for g in keys]
    if any(x.size != pos.size for x in slots):
        raise ValueError(f"a slot mapping does not have one value per position ({pos.size})")
    return (np.tile(pos, len(keys)), np.concatenate(slots) if slots else pos[:0],
            np.repeat(np.array(keys, np.int64), pos.size))


def pack(observations: list[Observation], config: DumpConfig) -> tuple[DumpConfig, dict[str, np.ndarray]]:
    """Observations (the row form: Observation, or anything with its attributes) -> columns (see columns())."""
    def arr(x):
        return None if x is None else np.asarray(x).reshape(-1)

    vals = {f: [getattr(o, f) for o in observations] for f in FIELDS}
    rows = {f.section: [arr(getattr(o, f.name)) for o in observations] for f in ROW_TABLE
            if f.shape not in (TOKENS, GROUPS)}
    # the slot entries: one per token and KV-cache group (slot_entries), from positions and slot_mapping
    slots = [f.section for f in ROW_TABLE if f.shape in (TOKENS, GROUPS)]
    entries = zip(*[slot_entries(o.positions, o.slot_mapping) for o in observations]) if observations else ((),) * 3
    rows.update(zip(slots, entries))
    return columns(config, [o.site for o in observations], vals, rows)


def encode(config: DumpConfig, columns: dict[str, np.ndarray], injected: dict | None = None,
           extra_metadata: dict[str, str] | None = None) -> tuple[bytes, list[tuple[str, np.ndarray]]]:
    """The safetensors header and the tensors to follow it, in a fixed (sorted) order."""
    tensors = []
    for key in sorted(columns):
        want = COLUMNS[key][0] if key in COLUMNS else None
        arr = np.ascontiguousarray(columns[key])
        if want is not None:
            arr = arr.astype(DTYPES[want], copy=False)
        tensors.append((key, arr))
    return encode_header({k: (a.dtype, int(a.shape[0])) for k, a in tensors}, config, injected, extra_metadata), tensors


def encode_header(shapes: dict[str, tuple[np.dtype, int]], config: DumpConfig, injected: dict | None = None,
           extra_metadata: dict[str, str] | None = None) -> bytes:
    """The safetensors header of a dump whose columns have these (dtype, length), laid out in sorted key order
    (what encode writes; a writer that streams its columns writes it first)."""
    meta = {"dcptool.format": FORMAT_VERSION, "dcptool.config": json.dumps(config.to_json(), sort_keys=True)}
    if injected is not None:
        meta["dcptool.injected"] = json.dumps({k: sorted(v) for k, v in sorted(injected.items())})
    meta.update(extra_metadata or {})
    head: dict = {"__metadata__": meta}
    off = 0
    for key in sorted(shapes):
        dtype, n = np.dtype(shapes[key][0]), shapes[key][1]
        nbytes = n * dtype.itemsize
        head[key] = {"dtype": DTYPE_NAMES[dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype],
                     "shape": [n], "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes with spaces
    return struct.pack("<Q", len(raw)) + raw


def exists_error(p: str | os.PathLike) -> OutputExistsError:
    """The one error for an output that exists when no --force (force=True) allows replacing it."""
    return OutputExistsError(f"{clean(p)}: exists (use --force to overwrite)")


def _link_no_clobber(tmp: str, p: Path) -> None:
    """Move tmp to p unless p exists, atomically where the filesystem has hard links."""
    try:
        os.link(tmp, p)  # fails if p exists, even if another writer created it a moment ago
    except FileExistsError:
        raise exists_error(p) from None
    except OSError:  # no hard links here (some FUSE / SMB mounts): check, then rename
        if os.path.lexists(p):
            raise exists_error(p) from None
        os.replace(tmp, p)
        return
    os.unlink(tmp)


CAT_PIECE = 1 << 17  # values a Recorder's packing concatenates per numpy call (~0.5 ms: the GIL is free between)
_KINDS = ((stat.S_ISDIR, "directory"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
          (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "special file")


def write_target(path: str | os.PathLike) -> Path:
    """The path a write to `path` may replace: `path` itself when it is absent, a regular file, or a symbolic
    link to a regular file (the link is replaced by the new file; the file it points to is never written:
    a link into another directory, or to a file someone else owns, must not make dcptool write there).
    Anything else is a WriteError: a directory, a device (`/dev/null`), a FIFO, a socket, a link to one
    of them (`/proc/self/fd/1`) or a dangling link. A rename would swap such a node for a regular file."""
    p = Path(path)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return p
    except OSError as e:
        raise WriteError(f"{clean(p)}: cannot write: {e.strerror or e}") from None
    if stat.S_ISREG(st.st_mode):
        return p
    if not stat.S_ISLNK(st.st_mode):
        raise WriteError(f"{clean(p)}: is a {_kind(st.st_mode)}, not a regular file; dcptool only replaces "
                         "regular files")
    try:
        target = os.stat(p)
    except OSError:
        raise WriteError(f"{clean(p)}: is a symbolic link to nothing; dcptool only writes regular files") from None
    if not stat.S_ISREG(target.st_mode):
        raise WriteError(f"{clean(p)}: is a symbolic link to a {_kind(target.st_mode)}, not a regular file; "
                         "dcptool only replaces regular files")
    real = Path(os.path.realpath(p))
    try:  # a /proc/self/fd link to a deleted or unnamed file resolves to no path that is that file
        same = os.path.samefile(real, p)
    except OSError:
        same = False
    if not same:
        raise WriteError(f"{clean(p)}: is a symbolic link whose target cannot be replaced by name")
    return p


def atomic_write(path: str | os.PathLike, chunks, *, force: bool = True, inputs=()) -> None:
    """Write chunks (bytes-like) to a temporary file beside `path`, fsync, then rename it into place.

    A crash, a kill or a full disk leaves the old file (or none), never a torn one; on an error the
    temporary is removed and WriteError names the file. force=False refuses an existing `path`
    (OutputExistsError); `path` is never one of `inputs`, even with force. Only a regular file (or
    an absent path) is ever replaced; a symbolic link to a regular file is replaced itself, its target
    never written (write_target).
    """
    p = Path(path)
    shown = p
    for q in inputs:
        try:
            same = os.path.samefile(p, q)
        except OSError:  # either does not exist: not the same file
            same = False
        if same:
            raise WriteError(f"{clean(p)}: is also an input; write the output to another file")
    p = write_target(p)
    existed = os.path.lexists(p)
    if existed and not force:
        raise exists_error(shown)
    d = p.parent
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=d)
        with os.fdopen(fd, "wb") as f:
            # mkstemp makes 0600 files; a dump is for sharing: keep the old file's mode, else rw-r--r--
            os.fchmod(f.fileno(), (os.stat(p).st_mode & 0o777) if existed and p.is_file() else 0o644)
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        if force:
            os.replace(tmp, p)
        else:
            _link_no_clobber(tmp, p)
        tmp = None
    except OutputExistsError:
        raise
    except OSError as e:
        keep = " (the previous file is unchanged)" if existed else ""
        raise WriteError(f"{clean(shown)}: cannot write: {e.strerror or e}{keep}") from None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    try:
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass  # some filesystems refuse directory fsync; the rename itself is still atomic


def check_config(path: str | os.PathLike, config: DumpConfig, injected: dict | None = None) -> None:
    """Raise the DumpError a reader would raise for this config (so nothing unreadable is written)."""
    meta = {"dcptool.format": FORMAT_VERSION, "dcptool.config": json.dumps(config.to_json())}
    if injected is not None:
        meta["dcptool.injected"] = json.dumps(injected)
    parse_config(os.fspath(path), meta)


def _cat(got: list[np.ndarray], key: str) -> np.ndarray:
    """The arrays end to end in "<i4" (checked: _narrow), a piece of CAT_PIECE values at a time when they are many: no
    single numpy call holds the GIL for long (a Recorder packs its rolled files on a thread beside the engine)."""
    want = np.dtype("<i4")
    total = sum(a.size for a in got)
    if total <= CAT_PIECE:
        return _narrow(np.concatenate(got), want, key)
    dtype = np.result_type(*{a.dtype for a in got})  # (what one concatenation would give)
    out = np.empty(total, want)
    at, group, size = 0, [], 0
    for k, a in enumerate(got):
        group.append(a)
        size += a.size
        if size >= CAT_PIECE or k == len(got) - 1:
            out[at:at + size] = _narrow(np.concatenate(group).astype(dtype, copy=False), want, key)
            at, group, size = at + size, [], 0
    return out


def _narrow(a: np.ndarray, want: np.dtype, key: str) -> np.ndarray:
    """a in dtype `want`; a value it cannot hold is a DumpError (astype would wrap or truncate it silently)."""
    if a.size and a.dtype != want:
        if a.dtype.kind == "f" and not np.array_equal(a, np.trunc(a)):  # NaN, inf and 1.5 are not lengths
            bad = a[~(a == np.trunc(a))][0]
            raise DumpError(f"{key}: value {bad} is not an integer")
        if a.dtype.kind not in "iubf":
            raise DumpError(f"{key}: integer values expected, got dtype {a.dtype}")
        info = np.iinfo(want)
        lo, hi = a.min(), a.max()
        if lo < info.min or hi > info.max:
            raise DumpError(f"{key}: value {int(lo) if lo < info.min else int(hi)} does not fit {DTYPE_NAMES[want]}")
    return a.astype(want, copy=False)


def _column(p: str, key: str, v) -> np.ndarray:
    """A column in its format dtype (checked: see _narrow)."""
    a = np.asarray(v)
    if key not in COLUMNS:
        return a
    try:
        return _narrow(a, DTYPES[COLUMNS[key][0]], key)
    except DumpError as e:
        raise fail(p, None, str(e)) from None


def write_dump(path: str | os.PathLike, config: DumpConfig, columns: dict[str, np.ndarray],
               injected: dict | None = None, *, force: bool = True, inputs=(),
               extra_metadata: dict[str, str] | None = None) -> None:
    """Validate config and columns (so every dump we write reads back) and write them atomically
    (extra_metadata: more `__metadata__` keys, e.g. `dcptool.capped`)."""
    p = os.fspath(path)
    check_config(p, config, injected)
    cols = {k: _column(p, k, v) for k, v in columns.items()}
    validate_columns(p, config, cols, injected)
    header, tensors = encode(config, cols, injected, extra_metadata)
    atomic_write(path, [header] + [memoryview(a).cast("B") for _, a in tensors if a.nbytes], force=force,
                 inputs=inputs)


def write_observations(path: str | os.PathLike, observations: list[Observation], config: DumpConfig,
                       injected: dict | None = None, *, force: bool = True, inputs=()) -> DumpConfig:
    try:
        cfg, cols = pack(observations, config)
    except DumpError as e:
        raise fail(os.fspath(path), None, str(e)) from None
    write_dump(path, cfg, cols, injected, force=force, inputs=inputs)
    return cfg
