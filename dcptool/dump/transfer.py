"""A KV transfer plan: what a connector moved for one request to one destination rank, as one record both sides read.

Under prefill/decode disaggregation a KV connector (NIXL, Mooncake, LMCache) copies a request's KV blocks from the
ranks of one instance to those of another, or into a keyed store. The plan it made is recorded as a *transfer*: one
record per request and destination rank, built once at the door (`transfer_record`, the Recorder's `transfer()`),
made of five row levels, each a ragged column set indexed per observation (a transfer is an observation at site
`transfer` with no rows of its own, so every observation rule holds for it trivially):

- `xfer` (one row): the request, its source engine, whether the destination is a keyed store, the sequence length,
  the destination rank, and both sides' layout (TP, PCP, DCP, interleave, and whether PCP ranks hold distinct shards);
- `xgrp` (one row per KV-cache group): its kind, whether each side shards it, both sides' block and kernel block
  sizes, its sliding window, and the request's block index each side's table starts at (a prefix-cache hit);
- `xsrc`, `xdst`: both sides' block tables (logical block ids, in the request's order, per group);
- `xcopy`: the copies: per group, the source worker, the source kernel block and offset, the destination kernel block
  and offset, and how many slots.

TABLE lists every column once; the dump's columns (dump.schema), the writer (`columns`), the reader's value checks
(`first_bad`) and docs/format.md follow it. This module imports nothing of dcptool but the observation table.
"""

from __future__ import annotations

import hashlib
from collections import namedtuple
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

XFER, XGRP, XSRC, XDST, XCOPY = "xfer", "xgrp", "xsrc", "xdst", "xcopy"
LEVELS = (XFER, XGRP, XSRC, XDST, XCOPY)
OFFSETS = {lv: f"obs.{lv}" for lv in LEVELS}  # each level's offsets column (n+1 values)
SITE = "transfer"  # the site a transfer observation is recorded at
# A group's kind (xgrp.kind indexes it): what its blocks hold. "mamba" holds one state per block, not per position:
# its copies are checked block by block.
GROUP_KINDS = ("attention", "mla", "swa", "mamba", "indexer")
MAMBA = GROUP_KINDS.index("mamba")
I32_MAX = 2**31 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1


class Column(NamedTuple):
    """One column of a transfer: its level, name, dtype and the values a file may hold."""

    level: str
    name: str
    dtype: str  # I64 or I32
    low: int
    high: int
    doc: str

    @property
    def key(self) -> str:
        return f"{self.level}.{self.name}"


def _side(side: str, doc: str) -> tuple[Column, ...]:
    return (Column(XFER, f"{side}_tp", "I32", 1, I32_MAX, f"{doc}'s tensor-parallel size"),
            Column(XFER, f"{side}_pcp", "I32", 1, I32_MAX, f"{doc}'s PCP size"),
            Column(XFER, f"{side}_dcp", "I32", 1, I32_MAX, f"{doc}'s DCP size"),
            Column(XFER, f"{side}_interleave", "I32", 1, I32_MAX, f"{doc}'s cp_kv_cache_interleave_size"),
            Column(XFER, f"{side}_cp_shards", "I32", 0, 1, f"1: {doc}'s PCP ranks hold distinct shards (the KV is "
                   "sharded over the CP world pcp*dcp, a worker's shard pcp_rank*dcp+dcp_rank); 0: over its DCP "
                   "ranks only, every PCP rank a replica"))


def _pair(level: str, name: str, low: int, doc: str) -> tuple[Column, ...]:
    return (Column(level, f"src_{name}", "I32", low, I32_MAX, f"the source's {doc}"),
            Column(level, f"dst_{name}", "I32", low, I32_MAX, f"the destination's {doc}"))


TABLE: tuple[Column, ...] = (
    Column(XFER, "request", "I64", I64_MIN, I64_MAX, "the request's id (a string id: its 64-bit hash)"),
    Column(XFER, "source", "I64", I64_MIN, I64_MAX, "the source engine's id (a string id: its 64-bit hash)"),
    Column(XFER, "store", "I32", 0, 1, "1: the destination is a keyed store claiming the request's tokens"),
    Column(XFER, "seq_len", "I32", -1, I32_MAX, "the tokens the source computed (-1: unknown)"),
    Column(XFER, "dst_rank", "I32", 0, I32_MAX, "the destination worker's CP coordinates, pcp_rank*dcp+dcp_rank"),
    *_side("src", "the source"),
    *_side("dst", "the destination"),
    Column(XGRP, "kind", "I32", 0, len(GROUP_KINDS) - 1, "the group's kind: " + ", ".join(GROUP_KINDS)),
    *_pair(XGRP, "sharded", 0, "sharding of the group (1: sharded over its CP ranks, 0: on every rank)"),
    *_pair(XGRP, "block", 1, "block size (the KV-cache manager's, in tokens)"),
    *_pair(XGRP, "kernel", 1, "kernel block size (what copies address; divides the block size)"),
    Column(XGRP, "window", "I32", 0, I32_MAX, "the sliding window in tokens (0: full attention)"),
    *_pair(XGRP, "first", 0, "block index of its table's first entry (blocks before it are cached)"),
    Column(XSRC, "group", "I32", 0, I32_MAX, "the entry's group (an index into the transfer's groups)"),
    Column(XSRC, "block", "I32", -1, I32_MAX, "the source's logical block id (-1: none)"),
    Column(XDST, "group", "I32", 0, I32_MAX, "the entry's group"),
    Column(XDST, "block", "I32", -1, I32_MAX, "the destination's logical block id (-1: none)"),
    Column(XCOPY, "group", "I32", 0, I32_MAX, "the copy's group (an index into the transfer's groups)"),
    Column(XCOPY, "src_rank", "I32", 0, I32_MAX, "the source worker's CP coordinates, pcp_rank*dcp+dcp_rank"),
    Column(XCOPY, "src_block_id", "I32", 0, I32_MAX, "the source's kernel block id"),
    Column(XCOPY, "src_offset", "I32", 0, I32_MAX, "the first source slot in that kernel block"),
    Column(XCOPY, "dst_block_id", "I32", 0, I32_MAX, "the destination's kernel block id"),
    Column(XCOPY, "dst_offset", "I32", 0, I32_MAX, "the first destination slot in that kernel block"),
    Column(XCOPY, "count", "I32", 1, I32_MAX, "slots copied"),
)
COLUMNS_OF = {lv: tuple(c for c in TABLE if c.level == lv) for lv in LEVELS}
KEYS = {c.key: c for c in TABLE}
SIDE_FIELDS = ("tp", "pcp", "dcp", "interleave", "cp_shards")


def dump_columns() -> dict[str, tuple[str, str]]:
    """The transfer's optional dump columns: key -> (dtype, length kind), as observation.dump_columns gives them."""
    out: dict[str, tuple[str, str]] = {}
    for lv in LEVELS:
        out[OFFSETS[lv]] = ("I64", "n+1")
        out.update({c.key: (c.dtype, OFFSETS[lv]) for c in COLUMNS_OF[lv]})
    return out


# --------------------------------------------------------------------------------------------------
# The door: a connector's plan in its own terms -> the record's rows


class Side(NamedTuple):
    """One side's layout: the KV of position p lives on shard (p // interleave) % world, world = pcp * dcp when
    cp_shards (PCP ranks hold distinct shards: V1's BlockTable, vllm-ascend), else dcp (every PCP rank a replica of
    its DCP shard: vLLM's model runner V2)."""

    tp: int = 1
    pcp: int = 1
    dcp: int = 1
    interleave: int = 1
    cp_shards: bool = False

    @classmethod
    def of(cls, x: Any) -> Side:
        return _built(cls, x, "layout")


class GroupPlan(NamedTuple):
    """One KV-cache group of a transfer: its kind (GROUP_KINDS), both sides' block tables (logical block ids of the
    request, in order, starting at block index src_first / dst_first), block sizes and kernel block sizes (None: the
    block size), whether each side shards it (default: every kind but mamba), and its sliding window (0: none)."""

    kind: str
    src_blocks: Any
    dst_blocks: Any
    src_block_size: int
    dst_block_size: int
    src_kernel_block_size: int | None = None
    dst_kernel_block_size: int | None = None
    src_sharded: bool | None = None
    dst_sharded: bool | None = None
    window: int = 0
    src_first: int = 0
    dst_first: int = 0

    @classmethod
    def of(cls, x: Any) -> GroupPlan:
        return _built(cls, x, "group")


def _built(cls, x: Any, what: str):
    """A NamedTuple of class cls from itself, a dict of its fields or a sequence of them; ValueError for a key it
    does not have."""
    if isinstance(x, cls):
        return x
    if isinstance(x, Mapping):
        extra = set(x) - set(cls._fields)
        if extra:
            raise ValueError(f"unknown {what} key {sorted(extra)[0]!r}")
        return cls(**x)
    return cls(*x)


# The record's fields (Recorder.transfer's keywords), in order, with their defaults (REQUIRED: none).
REQUIRED = object()
ARGUMENTS: tuple[tuple[str, Any], ...] = (
    ("step", REQUIRED), ("rank", REQUIRED), ("request", REQUIRED), ("src", REQUIRED), ("dst", REQUIRED),
    ("groups", REQUIRED), ("seq_len", -1), ("dst_rank", None), ("reads", None), ("copies", None), ("source", 0),
    ("store", False), ("site", SITE))
TransferRecord = namedtuple("TransferRecord", [a for a, _ in ARGUMENTS],
                            defaults=[d for _, d in ARGUMENTS if d is not REQUIRED], module=__name__)
TransferRecord.__doc__ = "One transfer as Recorder.transfer() takes it (dump.transfer.ARGUMENTS, in order)."


def ident(x: Any, name: str) -> int:
    """A request or engine id as int64: an integer as given, a string as the first 8 bytes of its blake2b hash."""
    if isinstance(x, str):
        return int.from_bytes(hashlib.blake2b(x.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little",
                              signed=True)
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise ValueError(f"{name} must be an integer or a string, got {type(x).__name__}")
    if not I64_MIN <= int(x) <= I64_MAX:
        raise ValueError(f"{name} {x} does not fit int64")
    return int(x)


def _ints(x: Any, name: str) -> np.ndarray:
    """A 1-D int64 array of integer values (tensors on any device, numpy arrays, lists)."""
    if hasattr(x, "detach"):
        x = x.detach().to("cpu").numpy()
    a = np.asarray(x if x is not None else [])
    if a.size == 0:
        return np.zeros(0, np.int64)
    if a.dtype.kind not in "iu":
        raise ValueError(f"{name}: integer values expected, got dtype {a.dtype}")
    return a.reshape(-1).astype(np.int64)


def _per_group(x: Any, groups: int, name: str) -> list[np.ndarray]:
    """Block ids per group: a list (one per group) or {group index: ids}."""
    if isinstance(x, Mapping):
        out = [np.zeros(0, np.int64)] * groups
        for g, ids in x.items():
            if not 0 <= int(g) < groups:
                raise ValueError(f"{name}: group {g} out of range")
            out[int(g)] = _ints(ids, name)
        return out
    got = list(x)
    if len(got) != groups:
        raise ValueError(f"{name}: {len(got)} groups, the transfer has {groups}")
    return [_ints(ids, name) for ids in got]


def _reads(reads: Any, kernels: np.ndarray) -> np.ndarray:
    """Whole-kernel-block reads (src_rank, src kernel ids per group, dst kernel ids per group), as NIXL's ReadSpec
    pairs them, as copies [k, 8] (group, src_rank, src id, src offset, dst id, dst offset, count)."""
    parts = []
    groups = kernels.shape[0]
    for src_rank, src_ids, dst_ids in reads:
        s, d = _per_group(src_ids, groups, "reads"), _per_group(dst_ids, groups, "reads")
        for g in range(groups):
            if s[g].size != d[g].size:
                raise ValueError(f"reads: group {g} pairs {s[g].size} source blocks with {d[g].size}")
            if s[g].size and kernels[g, 0] != kernels[g, 1]:
                raise ValueError(f"reads: group {g}'s kernel blocks differ in size ({kernels[g, 0]} and "
                                 f"{kernels[g, 1]} tokens): pass copies= with slot offsets")
            k = s[g].size
            parts.append(np.stack([np.full(k, g), np.full(k, int(src_rank)), s[g], np.zeros(k, np.int64), d[g],
                                   np.zeros(k, np.int64), np.full(k, kernels[g, 1])], axis=1))
    return np.concatenate(parts) if parts else np.zeros((0, 7), np.int64)


def _group_rows(groups: list[GroupPlan]) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    rows, src, dst = [], [], []
    for g, p in enumerate(groups):
        if p.kind not in GROUP_KINDS:
            raise ValueError(f"group {g}: kind {p.kind!r} is not one of {', '.join(GROUP_KINDS)}")
        k = GROUP_KINDS.index(p.kind)
        shard = k != MAMBA
        sk = p.src_block_size if p.src_kernel_block_size is None else p.src_kernel_block_size
        dk = p.dst_block_size if p.dst_kernel_block_size is None else p.dst_kernel_block_size
        rows.append([k, shard if p.src_sharded is None else bool(p.src_sharded),
                     shard if p.dst_sharded is None else bool(p.dst_sharded), p.src_block_size, p.dst_block_size,
                     sk, dk, p.window, p.src_first, p.dst_first])
        src.append(_ints(p.src_blocks, f"group {g} src_blocks"))
        dst.append(_ints(p.dst_blocks, f"group {g} dst_blocks"))
    return np.array(rows, np.int64).reshape(-1, 10), src, dst


def _table(ids: list[np.ndarray]) -> np.ndarray:
    if not ids:
        return np.zeros((0, 2), np.int64)
    return np.stack([np.repeat(np.arange(len(ids)), [a.size for a in ids]), np.concatenate(ids)], axis=1)


# Each level's columns' bounds in TABLE's order: levels_of checks a record's [rows, columns] at once.
_LOW = {lv: np.array([c.low for c in COLUMNS_OF[lv]], np.int64) for lv in LEVELS}
_HIGH = {lv: np.array([c.high for c in COLUMNS_OF[lv]], np.int64) for lv in LEVELS}
_AT = {c.key: (c.level, k) for lv in LEVELS for k, c in enumerate(COLUMNS_OF[lv])}


class _LevelColumns:
    """A record's rows per level read as first_bad's columns (key -> a column of its level), cut as asked."""

    def __init__(self, levels: dict[str, np.ndarray]):
        self._levels = levels

    def __getitem__(self, key: str) -> np.ndarray:
        lv, k = _AT[key]
        return self._levels[lv][:, k]


def levels_of(t: TransferRecord) -> dict[str, np.ndarray]:
    """The record's rows per level ([rows, columns] int64, TABLE's order), checked as a reader checks a file
    (first_bad); ValueError for what a dump cannot hold."""
    src, dst = Side.of(t.src), Side.of(t.dst)
    groups = [GroupPlan.of(g) for g in t.groups]
    grp, src_ids, dst_ids = _group_rows(groups)
    if (t.reads is None) == (t.copies is None):
        raise ValueError("give the plan as reads= (whole kernel blocks) or copies= (slot runs), one of them")
    if t.copies is not None:
        copies = np.asarray(t.copies.detach().to("cpu").numpy() if hasattr(t.copies, "detach") else t.copies)
        if copies.size and copies.dtype.kind not in "iu":
            raise ValueError(f"copies: integer values expected, got dtype {copies.dtype}")
        copies = copies.astype(np.int64).reshape(-1, 7)
    else:
        copies = _reads(t.reads, grp[:, 5:7])
    store = bool(t.store)
    dst_rank = (0 if store else int(t.rank)) if t.dst_rank is None else int(t.dst_rank)
    xfer = [ident(t.request, "request"), ident(t.source, "source"), int(store), int(t.seq_len), dst_rank,
            *(int(getattr(src, f)) for f in SIDE_FIELDS), *(int(getattr(dst, f)) for f in SIDE_FIELDS)]
    out = {XFER: np.array([xfer], np.int64), XGRP: grp, XSRC: _table(src_ids), XDST: _table(dst_ids),
           XCOPY: copies}
    cols = _LevelColumns(out)
    offsets = {OFFSETS[lv]: np.array([0, out[lv].shape[0]]) for lv in LEVELS}
    ranged = all(not m.size or not ((m < _LOW[lv]) | (m > _HIGH[lv])).any() for lv, m in out.items())
    bad = _inconsistent(cols, offsets) if ranged else first_bad(cols, offsets)
    if bad is not None:
        raise ValueError(f"{bad[0]}: {bad[1]}")
    return out


# --------------------------------------------------------------------------------------------------
# Writing and reading: the columns, and the values a file may hold


def columns(n: int, transfers: Mapping[int, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The transfer columns of n observations, `transfers` mapping an observation's index to its rows (levels_of);
    {} when there is none."""
    if not transfers:
        return {}
    at = sorted(transfers)
    out: dict[str, np.ndarray] = {}
    for lv in LEVELS:
        counts = np.zeros(n, np.int64)
        counts[at] = [transfers[i][lv].shape[0] for i in at]
        offs = np.zeros(n + 1, np.int64)
        np.cumsum(counts, out=offs[1:])
        out[OFFSETS[lv]] = offs
        rows = np.concatenate([transfers[i][lv] for i in at]) if at else np.zeros((0, len(COLUMNS_OF[lv])))
        for k, c in enumerate(COLUMNS_OF[lv]):
            out[c.key] = rows[:, k].astype("<i8" if c.dtype == "I64" else "<i4")
    return out


# Slots the copies of one file may stand for, per byte of its copy columns: the check expands each copy slot by slot
# (docs/limits.md). A realistic copy, a whole kernel block of 16-128 slots, takes 32 bytes; mamba copies (one state
# per block) are not expanded and not counted.
SLOTS_PER_BYTE = 256


def first_bad(c: Mapping[str, np.ndarray], offsets: Mapping[str, np.ndarray]) -> tuple[str, str] | None:
    """The first value a file may not hold in the transfer columns `c` (with their offsets columns), as (key, what);
    None when all are valid. Offsets are checked by the schema; here: each column's range, one transfer at most per
    observation, rows of the lower levels only on observations with a transfer, kernel blocks dividing blocks, table
    entries naming a group the transfer has, and the copies' slots within SLOTS_PER_BYTE."""
    for col in TABLE:
        v = c[col.key]
        if v.size and (v.min() < col.low or v.max() > col.high):
            i = int(np.argmax((v < col.low) | (v > col.high)))
            return col.key, f"value {v[i]} at row {i} outside [{col.low}, {col.high}]"
    return _inconsistent(c, offsets)


def _inconsistent(c: Mapping[str, np.ndarray], offsets: Mapping[str, np.ndarray]) -> tuple[str, str] | None:
    """first_bad's checks past the columns' ranges (every value in range)."""
    per = {lv: offsets[OFFSETS[lv]][1:] - offsets[OFFSETS[lv]][:-1] for lv in LEVELS}  # (np.diff's Python costs more)
    if per[XFER].size and per[XFER].max() > 1:
        return OFFSETS[XFER], f"observation {int(np.argmax(per[XFER] > 1))} holds more than one transfer"
    for lv in LEVELS[1:]:
        stray = (per[lv] > 0) & (per[XFER] == 0)
        if stray.any():
            return OFFSETS[lv], f"rows at observation {int(np.argmax(stray))}, which holds no transfer"
    workers = c["xfer.dst_pcp"].astype(np.int64) * c["xfer.dst_dcp"]
    if (c["xfer.dst_rank"] >= workers).any():
        i = int(np.argmax(c["xfer.dst_rank"] >= workers))
        return "xfer.dst_rank", f"rank {c['xfer.dst_rank'][i]} at row {i} is outside its layout ({workers[i]} workers)"
    for side in ("src", "dst"):
        b, k = c[f"xgrp.{side}_block"], c[f"xgrp.{side}_kernel"]
        if (b % k).any():
            i = int(np.argmax(b % k != 0))
            return f"xgrp.{side}_kernel", f"kernel block size {k[i]} does not divide the block size {b[i]} at row {i}"
    groups = per[XGRP][per[XFER] > 0]  # groups per transfer
    for lv in (XSRC, XDST):
        owner = np.repeat(np.arange(groups.size), per[lv][per[XFER] > 0])
        g = c[f"{lv}.group"]
        if g.size and (g >= groups[owner]).any():
            i = int(np.argmax(g >= groups[owner]))
            return f"{lv}.group", f"group {g[i]} at row {i}: its transfer has {groups[owner][i]} groups"
    nbytes = sum(c[col.key].nbytes for col in COLUMNS_OF[XCOPY])
    has = per[XFER] > 0
    owner = np.repeat(np.arange(groups.size), per[XCOPY][has])  # each copy's transfer
    row = np.repeat(offsets[OFFSETS[XGRP]][:-1][has], per[XCOPY][has]) + c["xcopy.group"]
    known = c["xcopy.group"] < groups[owner]  # (a copy naming a group its transfer lacks is a finding)
    mamba = np.zeros(owner.size, bool)
    mamba[known] = c["xgrp.kind"][row[known]] == MAMBA
    slots = int(c["xcopy.count"][~mamba].astype(np.int64).sum())
    if slots > SLOTS_PER_BYTE * nbytes + (1 << 16):
        return "xcopy.count", (f"the copies stand for {slots} slots, past dcptool's limit of {SLOTS_PER_BYTE} per "
                               "byte of copies (docs/limits.md)")
    return None


def transfer_door(method: str, doc: str) -> Any:
    """A method `transfer(self, *, <one keyword per field of ARGUMENTS>)` returning `self.<method>(record)`, the
    record built from its keywords (as observation.keyword_door builds observe()): a field added to ARGUMENTS is a
    keyword at once."""
    ns: dict[str, Any] = {"_new": tuple.__new__, "_Record": TransferRecord}
    params = []
    for name, default in ARGUMENTS:
        if default is REQUIRED:
            params.append(name)
        else:
            ns[f"_default_{name}"] = default
            params.append(f"{name}=_default_{name}")
    values = ", ".join(name for name, _ in ARGUMENTS)
    exec(f"def transfer(self, *, {', '.join(params)}):\n    return self.{method}(_new(_Record, ({values},)))\n", ns)
    fn = ns["transfer"]
    fn.__doc__ = doc
    return fn
