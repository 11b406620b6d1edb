"""docs/format.md as code: the format's columns and limits, DumpConfig, the DumpError family, obs.graph's one
encoding (GraphMode), and every check of a hostile file (header, entries, config, columns). dump.py reads,
merges and writes through these."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import numpy as np

from dcptool.dump import transfer
from dcptool.dump.observation import ROW_TABLE, dump_columns
from dcptool.errors import DcptoolError

FORMAT_VERSION = "1"
# safetensors' own reader refuses headers past 100 MB; a dcptool header is a few kB plus the
# `dcptool.injected` index lists, so this bound is generous and keeps hostile files cheap.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# JSON values (outside strings) one header, config or injected index may hold. A dcptool header
# has a few hundred; an injected index list holds one per touched observation. The bound keeps a
# hostile 100 MB header of `[],[],...` from growing into gigabytes of Python objects.
MAX_JSON_VALUES = 2_000_000
INT32_MAX = 2**31 - 1
MAX_DCP_SIZE = 4096  # docs/limits.md

DTYPES = {"I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "U8": np.dtype("u1"), "I8": np.dtype("i1")}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# Every safetensors dtype with its size in bits (sub-byte types pack several values in a byte).
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "U16": 16, "I16": 16, "F16": 16, "BF16": 16, "U32": 32, "I32": 32,
               "F32": 32, "U64": 64, "I64": 64, "F64": 64, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F4": 4,
               "F6_E2M3": 6, "F6_E3M2": 6, "C64": 64}

# key -> (dtype, length kind): "n" per observation, "n+1" offsets, or the offsets key that sizes it; derived from the
# observation's fields (dump.observation.FIELDS_TABLE): a new field's columns come along.
REQUIRED, OPTIONAL = dump_columns()
OPTIONAL.update(transfer.dump_columns())  # a KV transfer plan's columns (dump.transfer.TABLE)
COLUMNS = {**REQUIRED, **OPTIONAL}
WIDE = tuple(f for f in ROW_TABLE if f.width > 1)  # the row fields of tuples (per KV-cache group ...)
# offsets column -> the row columns it sizes, in table order (derived: a new ragged column comes along)
RAGGED: dict[str, tuple[str, ...]] = {}
for _key, (_, _kind) in COLUMNS.items():
    if _kind not in ("n", "n+1"):
        RAGGED[_kind] = (*RAGGED.get(_kind, ()), _key)
# Optional columns come in groups: an offsets column of their own and the row columns it sizes go together.
COLUMN_GROUPS: list[tuple[str, ...]] = [(offs, *keys) for offs, keys in RAGGED.items() if offs in OPTIONAL]
SLOT_COLUMNS = next(g for g in COLUMN_GROUPS if g[0] == "obs.slots")
COLUMN_GROUPS.append(tuple(transfer.dump_columns()))  # a transfer's five levels go together


class DumpError(DcptoolError, ValueError):
    """A dump that cannot be used; the message names the file, the key and what is wrong."""


class WriteError(DumpError, OSError):
    """A dump that could not be written (disk full, no permission, ...); the old file is unchanged."""


class OutputExistsError(WriteError, FileExistsError):
    """The output exists and overwriting it was not asked for (--force)."""


@dataclass(frozen=True)
class DumpConfig:
    """`dcptool.config`: the DCP layout every observation of a dump shares."""

    dcp_size: int
    cp_interleave: int = 1
    sites: tuple[str, ...] = ()
    pcp_size: int = 1
    page_size: int | None = None
    engine: str | None = None
    engine_version: str | None = None
    note: str | None = None
    kv_groups: tuple[KVGroup, ...] | None = None  # rows.slot_group indexes it; None: every group DCP-sharded
    attn_tensors: tuple[str, ...] | None = None  # the names of the metadata tensors rows.attn_addrs lists, in order

    def to_json(self) -> dict:
        d = {"dcp_size": self.dcp_size, "cp_interleave": self.cp_interleave, "sites": list(self.sites)}
        if self.pcp_size != 1:
            d["pcp_size"] = self.pcp_size
        for k in ("page_size", "engine", "engine_version", "note"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        if self.kv_groups is not None:
            d["kv_groups"] = [g.to_json() for g in self.kv_groups]
        if self.attn_tensors is not None:
            d["attn_tensors"] = list(self.attn_tensors)
        return d

    def tensor_name(self, k: int) -> str:
        """The name of the k-th metadata tensor of rows.attn_addrs (its position where attn_tensors does not say)."""
        t = self.attn_tensors
        return t[k] if t is not None and 0 <= k < len(t) else f"metadata tensor {k}"

    def group_dcp(self, count: int) -> np.ndarray:
        """[count] bool: whether each KV-cache group is DCP-sharded (without kv_groups: all are, as vLLM
        0.29-0.30 shard every group and later releases every attention group)."""
        out = np.ones(max(count, 0), bool)
        if self.kv_groups is not None:
            k = min(count, len(self.kv_groups))
            out[:k] = [g.dcp for g in self.kv_groups[:k]]
        return out

    def group_cp(self, count: int) -> np.ndarray:
        """[count] int64: the DCP size each KV-cache group's positions are sharded over (1: replicated)."""
        return np.where(self.group_dcp(count), self.dcp_size, 1).astype(np.int64)

    def group_block_size(self, count: int) -> np.ndarray:
        """[count] int64: each KV-cache group's block size, 0 where unknown."""
        out = np.zeros(max(count, 0), np.int64)
        if self.kv_groups is not None:
            k = min(count, len(self.kv_groups))
            out[:k] = [g.block_size or 0 for g in self.kv_groups[:k]]
        return out


class KVGroup(NamedTuple):
    """One KV-cache group of dcptool.config's `kv_groups`: its name, whether DCP shards its token
    positions across ranks (vLLM's KVCacheSpec.dcp_sharded), and its block size when known; a sliding-window
    group's window, and the DCP size its positions are sharded over (1: replicated on every rank), when known."""

    name: str
    dcp: bool
    block_size: int | None = None
    sliding_window: int | None = None
    cp_size: int | None = None

    def to_json(self) -> dict:
        d = {"name": self.name, "dcp": self.dcp}
        for k in ("block_size", "sliding_window", "cp_size"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d

    @classmethod
    def of(cls, g) -> KVGroup:
        """A KVGroup from one (a dict {"name", "dcp", "block_size"?, "sliding_window"?, "cp_size"?} or a tuple);
        ValueError if malformed."""
        if isinstance(g, KVGroup):
            return g
        if isinstance(g, dict):
            extra = set(g) - set(cls._fields)
            if extra:
                raise ValueError(f"unknown key {sorted(extra)[0]!r}")
            name, dcp, bs, win, cp = (g.get(k) for k in cls._fields)
        else:
            name, dcp, bs, win, cp = (tuple(g) + (None,) * 5)[:5]
        if not (isinstance(name, str) and text_ok(name)):
            raise ValueError(f"name must be a string, got {name!r}")
        if type(dcp) is not bool:
            raise ValueError(f"dcp must be true or false, got {dcp!r}")
        for k, v in (("block_size", bs), ("sliding_window", win), ("cp_size", cp)):
            if v is not None and not (type(v) is int and 1 <= v <= INT32_MAX):
                raise ValueError(f"{k} must be an integer >= 1, got {v!r}")
        if cp is not None and not dcp and cp != 1:
            raise ValueError(f"cp_size {cp} for a group DCP does not shard (dcp false: 1)")
        return cls(name, dcp, bs, win, cp)


class GraphMode(IntEnum):
    """obs.graph: how the observed forward ran (docs/format.md)."""

    EAGER = 0
    PIECEWISE = 1
    FULL_CAPTURE = 2  # a full CUDA graph being captured: the buffer address it bakes in
    FULL_REPLAY = 3  # a full CUDA graph replayed: must read the buffer its capture baked in

    @property
    def full(self) -> bool:
        return self >= GraphMode.FULL_CAPTURE

    def recorded(self, capturing: bool) -> GraphMode:
        """A dispatched mode as obs.graph records it: a full graph is a capture while capturing, else a replay."""
        if self.full:
            return GraphMode.FULL_CAPTURE if capturing else GraphMode.FULL_REPLAY
        return self

    @classmethod
    def parse(cls, name: str) -> GraphMode:
        """Recorder.observe(graph=...) names; KeyError for any other (the observation is dropped)."""
        return _NAMES[name]

    @classmethod
    def of_vllm(cls, name: str | None) -> GraphMode:
        """vLLM's runtime CUDAGraphMode name as obs.graph (a capture is marked by the caller); others eager."""
        return _VLLM.get(name, GraphMode.EAGER)


def addr_words(addresses) -> np.ndarray:
    """Addresses (data_ptr()s, ints) as the int32 words rows.attn_addrs / rows.graph_addrs hold them: each one's
    two little-endian words, low then high (an int64 array viewed as int32)."""
    return np.asarray(addresses, dtype="<i8").reshape(-1).view("<i4")


def word_addrs(words) -> np.ndarray:
    """addr_words' inverse: the int64 addresses of int32 words (an odd count: the last word is dropped)."""
    w = np.ascontiguousarray(words, dtype="<i4").reshape(-1)
    return w[: w.size // 2 * 2].view("<i8")


_NAMES = {"eager": GraphMode.EAGER, "piecewise": GraphMode.PIECEWISE, "capture": GraphMode.FULL_CAPTURE,
          "full-capture": GraphMode.FULL_CAPTURE, "replay": GraphMode.FULL_REPLAY, "full-replay": GraphMode.FULL_REPLAY}
_VLLM = {"NONE": GraphMode.EAGER, "PIECEWISE": GraphMode.PIECEWISE, "FULL": GraphMode.FULL_REPLAY}


# --------------------------------------------------------------------------------------------
# Checks of a hostile file


def clean(s: object, limit: int = 200) -> str:
    """Text from a file or a path, safe for a one-line message: escaped and clipped."""
    s = str(s)
    if not s.isprintable():
        s = s.encode("unicode_escape", "backslashreplace").decode("ascii")
    return s if len(s) <= limit else s[: limit - 3] + "..."


def fail(path: str, key: str | None, what: str) -> DumpError:
    # Everything here may come from a hostile file (keys, values) or an odd file name: one line, short.
    p, what = clean(path, 400), clean(what, 400)
    return DumpError(f"{p}: {clean(key)}: {what}" if key else f"{p}: {what}")


def _json_values(raw: bytes) -> int:
    """How many JSON values json.loads would build from raw, counted without building them.

    Structural characters outside strings (`,` `[` `{`) bound the values; strings are found by
    their quotes once escaped backslashes and quotes are dropped. Counted in chunks with numpy,
    so a 100 MB header costs a fraction of a second and a few MB.
    """
    a = np.frombuffer(raw.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    count, inside = 0, 0
    for k in range(0, a.size, 1 << 22):
        c = a[k : k + (1 << 22)]
        quotes = c == 34
        # parity of the quotes up to here: 1 inside a string (uint8 wraps, parity survives)
        par = (np.cumsum(quotes, dtype=np.uint8) + inside) & 1
        count += int(np.count_nonzero(((c == 44) | (c == 91) | (c == 123)) & (par == 0)))
        inside = int(par[-1])
    return count + 1


def loads(p: str, key: str | None, raw: bytes | str, invalid: str):
    """json.loads of text from a file, bounded in the values it may build; DumpError(invalid) if not JSON."""
    b = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    n = _json_values(b)
    if n > MAX_JSON_VALUES:
        raise fail(p, key, f"too many JSON values ({n} > {MAX_JSON_VALUES}): not a dcptool header")
    try:
        return json.loads(b.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):  # ValueError: bad JSON, or a 5000-digit number
        raise fail(p, key, invalid) from None


def text_ok(s: str) -> bool:
    """Valid Unicode (no lone surrogates from a JSON escape), so it can be printed anywhere."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_MAGIC = ((b"\x1f\x8b", "gzip-compressed: gunzip it first"), (b"\x28\xb5\x2f\xfd", "zstd-compressed: unzstd it first"),
          (b"\xfd7zXZ", "xz-compressed: unxz it first"), (b"BZh", "bzip2-compressed: bunzip2 it first"),
          (b"PK\x03\x04", "a zip archive: unzip it first"), (b"\x89PNG", "a PNG image"),
          (b"\x80", "a Python pickle, e.g. from torch.save; dcptool never unpickles"))


def sniff(start: bytes) -> str:
    """What a file that is not safetensors seems to be, from its first bytes."""
    for magic, what in _MAGIC:
        if start.startswith(magic):
            return what
    try:
        text = start.decode("utf-8")
    except UnicodeDecodeError:
        text = ""
    if text and all(c.isprintable() or c in "\t\r\n" for c in text):
        return f"it is text: {clean(text.splitlines()[0] if text.strip() else text, 40)!r}"
    return "no safetensors header: an 8-byte length, then a JSON object"


def check_entries(p: str, header: dict, data_start: int, size: int) -> dict[str, tuple[str, list, int, int]]:
    """Each tensor entry well-formed, in bounds, sized by its dtype and shape, not overlapping."""
    data_len = size - data_start
    entries = {}
    for key, e in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(e, dict) or not isinstance(e.get("dtype"), str) or not isinstance(
                e.get("shape"), list) or not isinstance(e.get("data_offsets"), list):
            raise fail(p, key, "malformed tensor entry (needs dtype, shape and data_offsets)")
        dt, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if dt not in DTYPE_BITS:
            raise fail(p, key, f"unknown dtype {dt!r}")
        if not all(type(s) is int and s >= 0 for s in shape):
            raise fail(p, key, f"bad shape {shape!r}")
        if len(offs) != 2 or not all(type(o) is int for o in offs) or not 0 <= offs[0] <= offs[1]:
            raise fail(p, key, f"bad data_offsets {offs!r}")
        if offs[1] > data_len:
            raise fail(p, key, f"truncated: data runs to byte {offs[1]} but the file holds {data_len} "
                                "bytes of data")
        # Declared element count, compared with the bytes the offsets span; stop multiplying once it
        # cannot fit (a shape of a million 2**62 dims would otherwise cost minutes of bignum work).
        bits = 0 if 0 in shape else DTYPE_BITS[dt]
        for s in shape:
            bits *= s
            if bits > 8 * data_len:
                break
        if bits != 8 * (offs[1] - offs[0]):
            need = "more than the file holds" if bits > 8 * data_len else f"{bits / 8:g} bytes"
            raise fail(p, key, f"data_offsets span {offs[1] - offs[0]} bytes, but {dt} of shape "
                                f"{clean(shape, 60)} needs {need}")
        entries[key] = (dt, shape, offs[0], offs[1])
    spans = sorted((v[2], v[3], k) for k, v in entries.items() if v[3] > v[2])
    for (_a0, a1, ka), (b0, _b1, kb) in zip(spans, spans[1:]):
        if b0 < a1:
            raise fail(p, kb, f"data overlaps {clean(ka)}")
    end = max((v[3] for v in entries.values()), default=0)
    if end != data_len:
        raise fail(p, None, f"file size mismatch: tensors end at byte {end} of the data but the file "
                             f"holds {data_len} (trailing bytes or a broken copy)")
    return entries


def parse_capped(p: str, meta: dict) -> int | None:
    """`dcptool.capped` (written by a Recorder that stopped at its size cap, in its last file): the cap in bytes;
    None when absent."""
    raw = meta.get("dcptool.capped")
    if raw is None:
        return None
    c = loads(p, "dcptool.capped", raw, "not valid JSON")
    v = c.get("max_bytes") if isinstance(c, dict) else None
    if type(v) is not int or v < 1:
        raise fail(p, "dcptool.capped", "must be a JSON object {\"max_bytes\": an integer >= 1}")
    return v


def check_packed(p: str, entries: dict[str, tuple[str, list, int, int]]) -> None:
    """safetensors packs tensors back to back from byte 0 of the data: bytes no tensor holds are a broken file
    (checked after what names a key: a tensor dropped from the header is `missing`, not a gap)."""
    spans = sorted((v[2], v[3], k) for k, v in entries.items() if v[3] > v[2])
    for (_a0, a1, ka), (b0, _b1, kb) in zip([(0, 0, None)] + spans, spans):
        if b0 > a1:
            n = f"{b0 - a1} byte{'s' if b0 - a1 != 1 else ''}"
            raise fail(p, kb, f"data starts at byte {b0}, but {clean(ka)} ends at byte {a1}: no tensor holds the "
                               f"{n} between them" if ka is not None else f"data starts at byte {b0}, not 0: no tensor "
                               f"holds the {n} before it")


def parse_config(p: str, meta: dict) -> tuple[DumpConfig, dict | None]:
    fmt = meta.get("dcptool.format")
    if fmt is None:
        raise fail(p, "__metadata__", "not a dcptool dump (no dcptool.format entry)")
    if fmt != FORMAT_VERSION:
        raise fail(p, "dcptool.format", f"unknown format version {fmt!r} (this dcptool reads "
                                         f"{FORMAT_VERSION!r}; upgrade dcptool)")
    raw = meta.get("dcptool.config")
    if raw is None:
        raise fail(p, "dcptool.config", "missing")
    c = loads(p, "dcptool.config", raw, "not valid JSON")
    if not isinstance(c, dict):
        raise fail(p, "dcptool.config", "must be a JSON object")

    def int_field(name: str, default: int | None, minimum: int = 1, nullable: bool = False) -> int | None:
        if name not in c:
            return default
        v = c[name]
        if v is None and nullable:  # page_size may be written as null: no pages
            return None
        if type(v) is not int:
            raise fail(p, "dcptool.config", f"{name} must be an integer, got {v!r}")
        if v < minimum:
            raise fail(p, "dcptool.config", f"{name} must be >= {minimum}, got {v}")
        if v > INT32_MAX:
            raise fail(p, "dcptool.config", f"{name} = {v} overflows int32")
        return v

    if "dcp_size" not in c:
        raise fail(p, "dcptool.config", "dcp_size missing")
    dcp = int_field("dcp_size", None)
    il = int_field("cp_interleave", 1)
    pcp = int_field("pcp_size", 1)
    page = int_field("page_size", None, nullable=True)
    if dcp * il > INT32_MAX:
        raise fail(p, "dcptool.config", f"dcp_size * cp_interleave = {dcp * il} overflows int32 arithmetic")
    if dcp > MAX_DCP_SIZE:  # a recorded number that sizes per-rank work; no engine runs DCP this wide
        raise fail(p, "dcptool.config", f"dcp_size = {dcp} is past dcptool's limit of {MAX_DCP_SIZE} (docs/limits.md)")
    sites = c.get("sites")
    # (may be empty in a dump without observations: validate_columns checks that)
    if not isinstance(sites, list) or not all(isinstance(s, str) and text_ok(s) for s in sites):
        raise fail(p, "dcptool.config", "sites must be a list of (valid Unicode) strings")
    if len(set(sites)) != len(sites):
        raise fail(p, "dcptool.config", "sites lists a name twice")
    strs = {}
    for k in ("engine", "engine_version", "note"):
        v = c.get(k)
        if v is not None and not (isinstance(v, str) and text_ok(v)):
            raise fail(p, "dcptool.config", f"{k} must be a (valid Unicode) string")
        strs[k] = v
    injected = None
    if "dcptool.injected" in meta:
        injected = loads(p, "dcptool.injected", meta["dcptool.injected"], "not valid JSON")
        if not isinstance(injected, dict) or not all(
                text_ok(k) and isinstance(v, list) and all(type(i) is int for i in v) for k, v in injected.items()):
            raise fail(p, "dcptool.injected", "must map fault names to lists of observation indices")
    groups = None
    if c.get("kv_groups") is not None:
        raw_groups = c["kv_groups"]
        if not isinstance(raw_groups, list):
            raise fail(p, "dcptool.config", "kv_groups must be a list of {\"name\", \"dcp\"} objects")
        out = []
        for k, g in enumerate(raw_groups):
            if not isinstance(g, dict):
                raise fail(p, "dcptool.config", f"kv_groups[{k}] must be an object {{\"name\", \"dcp\"}}")
            try:
                out.append(KVGroup.of(g))
            except ValueError as e:
                raise fail(p, "dcptool.config", f"kv_groups[{k}]: {e}") from None
            if out[-1].dcp and out[-1].cp_size not in (None, dcp):
                raise fail(p, "dcptool.config", f"kv_groups[{k}]: cp_size {out[-1].cp_size} of a DCP-sharded "
                                                f"group is not dcp_size {dcp}")
        groups = tuple(out)
    tensors = c.get("attn_tensors")
    if tensors is not None:
        if not isinstance(tensors, list) or not all(isinstance(t, str) and text_ok(t) for t in tensors):
            raise fail(p, "dcptool.config", "attn_tensors must be a list of (valid Unicode) strings")
        tensors = tuple(tensors)
    cfg = DumpConfig(dcp_size=dcp, cp_interleave=il, sites=tuple(sites), pcp_size=pcp, page_size=page,
                     kv_groups=groups, attn_tensors=tensors, **strs)
    return cfg, injected


def _check_offsets(p: str, key: str, offs: np.ndarray, total: int) -> None:
    if offs[0] != 0:
        raise fail(p, key, f"offsets must start at 0, got {offs[0]}")
    d = np.diff(offs)
    if d.size and d.min() < 0:
        i = int(np.argmax(d < 0))
        raise fail(p, key, f"offsets not monotone at observation {i} ({offs[i]} > {offs[i + 1]})")
    if offs[-1] != total:
        raise fail(p, key, f"offsets end at {offs[-1]} but the rows hold {total} values")


def _first_bad(p: str, key: str, bad: np.ndarray, values: np.ndarray, what: str) -> None:
    if bad.any():
        i = int(np.argmax(bad))
        raise fail(p, key, f"{what} at observation {i} (value {values[i]})")


def validate_columns(p: str, cfg: DumpConfig, c: dict[str, np.ndarray], injected: dict | None = None,
                     release=None, row_values: bool = True) -> None:
    """Every structural and value rule of docs/format.md on in-memory columns (used on read and on write).
    `release(key, lo, hi)`, when given, is told after each chunk of a row column has been checked.
    row_values=False: all but the rules on the values of row columns (check_row_values), which a streamed read
    applies once the rows are in (read_dump(stream=True))."""
    for key in REQUIRED:
        if key not in c:
            raise fail(p, key, "missing")
    n = c["obs.step"].shape[0]
    if n and not cfg.sites:
        raise fail(p, "dcptool.config", "sites must be a non-empty list of strings")
    for key, (_, kind) in COLUMNS.items():
        if key not in c:
            continue
        if c[key].ndim != 1:
            raise fail(p, key, f"must be 1-D, got shape {list(c[key].shape)}")
        if kind == "n" and c[key].shape[0] != n:
            raise fail(p, key, f"has {c[key].shape[0]} values but obs.step has {n} observations")
        if kind == "n+1" and c[key].shape[0] != n + 1:
            raise fail(p, key, f"has {c[key].shape[0]} offsets, expected n+1 = {n + 1}")
    for group in COLUMN_GROUPS:  # (read_dump checks this on the file's entries first; here for writers)
        present = [k for k in group if k in c]
        if present and len(present) != len(group):
            raise fail(p, (set(group) - set(present)).pop(), f"missing (it goes with {present[0]})")
    for key, (_, kind) in COLUMNS.items():
        if key in c and kind.startswith("obs."):
            if kind not in c:
                raise fail(p, key, f"present without its offsets {kind}")
            if key == "rows.kv_pages":
                if c[key].shape[0] != c["rows.seq_lens"].shape[0]:
                    raise fail(p, key, f"has {c[key].shape[0]} rows but rows.seq_lens has "
                                        f"{c['rows.seq_lens'].shape[0]}")
                continue
            _check_offsets(p, kind, c[kind], c[key].shape[0])
    site, rank, ub = c["obs.site"], c["obs.rank"], c["obs.ubatch"]
    nr, nrp, has = c["obs.num_reqs"], c["obs.num_reqs_padded"], c["obs.has_dcp"]
    _first_bad(p, "obs.site", (site < 0) | (site >= len(cfg.sites)), site,
               f"site index out of range (config lists {len(cfg.sites)} sites)")
    _first_bad(p, "obs.rank", (rank < 0) | (rank >= cfg.dcp_size), rank,
               f"rank out of range for dcp_size {cfg.dcp_size}")
    _first_bad(p, "obs.ubatch", ub < -1, ub, "micro-batch index below -1")
    _first_bad(p, "obs.num_reqs", nr < 0, nr, "negative length")
    _first_bad(p, "obs.num_reqs_padded", nrp < 0, nrp, "negative length")
    _first_bad(p, "obs.num_reqs_padded", nr > nrp, nr, "num_reqs > num_reqs_padded")
    _first_bad(p, "obs.has_dcp", has > 1, has, "must be 0 or 1")
    rows = np.diff(c["obs.rows"])
    _first_bad(p, "obs.rows", rows < nr, rows, "fewer seq_lens rows than num_reqs")
    dcp_rows = np.diff(c["obs.dcp_rows"])
    _first_bad(p, "obs.dcp_rows", (has == 0) & (dcp_rows != 0), dcp_rows, "rows recorded for a None DCP view")
    if "obs.parent" in c:
        par = c["obs.parent"]
        _first_bad(p, "obs.parent", (par < -1) | (par >= n) | (par == np.arange(n)), par,
                   "parent index out of range")
    for key in ("obs.req_start", "obs.tok_start", "obs.tok_stop", "obs.num_tokens_padded"):
        if key in c:
            _first_bad(p, key, c[key] < -1, c[key], "negative (use -1 for unknown)")
    if "obs.qsl" in c:
        q = np.diff(c["obs.qsl"])
        _first_bad(p, "obs.qsl", (q != rows + 1) & (q != 0), q,
                   "query_start_loc must hold seq_lens rows + 1 values (or 0 when unknown)")
    if "obs.graph" in c:
        g = c["obs.graph"]
        _first_bad(p, "obs.graph", (g < 0) | (g > 3), g, "must be 0..3 (eager, piecewise, capture, replay)")
    if "obs.slots" in c:
        for key in SLOT_COLUMNS[1:]:
            if key not in c:
                raise fail(p, key, "missing (it goes with obs.slots)")
    if "rows.kv_pages" in c and cfg.page_size is None:
        raise fail(p, "rows.kv_pages", "present but dcptool.config has no page_size")
    if injected:
        for fault, idx in injected.items():
            if any(not 0 <= i < n for i in idx):
                raise fail(p, "dcptool.injected", f"{fault}: observation index out of range")
    if row_values:
        check_row_values(p, cfg, c, release)


def check_row_values(p: str, cfg: DumpConfig, c: dict[str, np.ndarray], release=None) -> None:
    """docs/format.md's rules on the values of row columns (after validate_columns(row_values=False) on the same
    columns): no negative seq_len, global length, chunked-context value, group length or sparse top-k value, slot
    positions and KV-cache groups in range."""
    sl = c["rows.seq_lens"]
    step = 1 << 22
    for lo in range(0, sl.size, step):  # in chunks, so a bounded read never holds all rows at once
        part = sl[lo : lo + step]
        if part.min() < 0:
            i = lo + int(np.argmax(part < 0))
            raise fail(p, "rows.seq_lens", f"negative length {sl[i]} at row {i}")
        if release is not None:
            release("rows.seq_lens", lo, lo + part.size)
    if "rows.dcp_tot_seq_lens" in c:  # global lengths: a negative one is no length (as rows.seq_lens)
        t = c["rows.dcp_tot_seq_lens"]
        if t.size and t.min() < 0:
            i = int(np.argmax(t < 0))
            raise fail(p, "rows.dcp_tot_seq_lens", f"negative length {t[i]} at row {i}")
    for key in ("rows.ctx_chunks", "rows.group_seq_lens", "rows.sparse_topk"):
        # chunk sizes, offsets, lengths, fingerprints, counts, state bits: none is negative
        t = c.get(key)
        if t is not None and t.size and t.min() < 0:
            i = int(np.argmax(t < 0))
            raise fail(p, key, f"negative value {t[i]} at row {i}")
    for f in WIDE:  # (rows of tuples: whole tuples per observation)
        if f.offsets in c and (bad := np.flatnonzero(np.diff(c[f.offsets]) % f.width)).size:
            raise fail(p, f.offsets, f"observation {bad[0]} holds {np.diff(c[f.offsets])[bad[0]]} values of "
                       f"{f.column}, not whole tuples of {f.width}")
        if f.nonneg and f.column in c and c[f.column].size and c[f.column].min() < 0:
            i = int(np.argmax(c[f.column] < 0))
            raise fail(p, f.column, f"negative value {c[f.column][i]} at row {i}")
    if "obs.slots" in c:
        _check_slots(p, cfg, c)
    if transfer.OFFSETS[transfer.XFER] in c:
        bad = transfer.first_bad(c, c)
        if bad is not None:
            raise fail(p, *bad)


def _check_slots(p: str, cfg: DumpConfig, c: dict[str, np.ndarray]) -> None:
    """Slot columns: positions are token positions (>= 0); each entry's KV-cache group is one the
    config lists (any index >= 0 without kv_groups). Slot values are findings, not file errors."""
    pos, grp = c["rows.positions"], c["rows.slot_group"]
    if pos.size and pos.min() < 0:
        i = int(np.argmax(pos < 0))
        raise fail(p, "rows.positions", f"negative position {pos[i]} at entry {i}")
    if grp.size:
        hi = INT32_MAX if cfg.kv_groups is None else len(cfg.kv_groups) - 1
        bad = (grp < 0) | (grp > hi)
        if bad.any():
            i = int(np.argmax(bad))
            what = "negative" if grp[i] < 0 else f"out of range (config lists {len(cfg.kv_groups)} kv_groups)"
            raise fail(p, "rows.slot_group", f"KV-cache group {grp[i]} at entry {i} is {what}")
