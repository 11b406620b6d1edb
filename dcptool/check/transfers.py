"""The `transfer` rule: every recorded KV transfer plan checked slot by slot against where both sides keep the
request's KV (dcp.kv_transfer), vectorised over the transfers and their copies.

Each copy's blocks are looked up in its group's tables (a block id the table does not hold, a group the transfer
lacks, a run past its kernel block: `block-ids`), then expanded slot by slot (a chunk of transfers at a time, in
bounded memory) into the position each slot holds on the source worker and the one it lands at on the destination
rank: equal is a transfer; otherwise the slot came from past the sequence, from a worker that does not hold the
position, was sent to a rank that does not own it, or paired with the wrong block. What the destination rank must
hold (its positions below the sequence length, after its cached prefix, in the window) is counted in closed form
(dcp.kv_transfer.local_count), never enumerated: received twice, never received. A keyed store that does not hold
exactly the tokens its key claims holds a partial shard (`partial-store`). Mamba groups hold a state per block: their
copies must pair a block with the same block of the request.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dcptool.check.findings import FindingTable, Written
from dcptool.dcp.kv_transfer import KINDS, local_count, owner, positions_of, shard_of
from dcptool.dump import Dump
from dcptool.dump.transfer import COLUMNS_OF, GROUP_KINDS, MAMBA, OFFSETS, XCOPY, XDST, XFER, XGRP, XSRC

SLOTS_CHUNK = 1 << 22  # slots expanded at once (a transfer with more is expanded alone)
_BIG = np.int64(1) << 62  # an unknown sequence length
_SHIFT = np.int64(1) << 32  # (row, value + 1) packed into one int64 key
PARTIAL, WRONG_SOURCE, PAST, NOT_OWNER, BLOCK_IDS, TWICE, NEVER = range(len(KINDS))


class Plans(NamedTuple):
    """The dump's transfers as arrays: per transfer (its observation, the xfer columns, where its rows start),
    per group, and the table lookup keys."""

    obs: np.ndarray  # [T] merged observation index
    x: dict[str, np.ndarray]  # xfer.<name> -> [T]
    g: dict[str, np.ndarray]  # xgrp.<name> -> [G]
    gstart: np.ndarray  # [T] first group row
    ngroups: np.ndarray  # [T]
    cstart: np.ndarray  # [T] first copy row
    ncopies: np.ndarray  # [T]
    tables: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]  # side -> (sorted keys, block index, any-group keys)
    dst_blocks: np.ndarray  # [G] the destination table's named blocks per group (mamba coverage)


def _col(d: Dump, key: str) -> np.ndarray:
    v = d[key]
    return np.asarray(v[: len(v)] if not isinstance(v, np.ndarray) else v, np.int64)


def _per(d: Dump, level: str, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    offs = d[OFFSETS[level]]
    return offs[obs].astype(np.int64), (offs[obs + 1] - offs[obs]).astype(np.int64)


def plans(d: Dump) -> Plans:
    obs = np.flatnonzero(np.diff(d[OFFSETS[XFER]]) > 0)
    x = {c.name: _col(d, c.key) for c in COLUMNS_OF[XFER]}
    g = {c.name: _col(d, c.key) for c in COLUMNS_OF[XGRP]}
    gstart, ngroups = _per(d, XGRP, obs)
    cstart, ncopies = _per(d, XCOPY, obs)
    tables = {}
    dst_blocks = np.zeros(g["kind"].size, np.int64)
    for side, level in (("src", XSRC), ("dst", XDST)):
        start, count = _per(d, level, obs)
        t = np.repeat(np.arange(obs.size), count)
        grp, block = _col(d, f"{level}.group"), _col(d, f"{level}.block")
        row = gstart[t] + grp
        order = np.lexsort((np.arange(row.size), row))  # entries of one group in their order
        rank = np.empty(row.size, np.int64)
        first_of = np.searchsorted(row[order], row[order])
        rank[order] = np.arange(row.size) - first_of
        index = g[f"{side}_first"][row] + rank
        key = row * _SHIFT + block + 1
        ko = np.argsort(key, kind="stable")
        tables[side] = (key[ko], index[ko], np.sort(t * _SHIFT + block + 1))
        if side == "dst":
            np.add.at(dst_blocks, row[block >= 0], 1)
    return Plans(obs, x, g, gstart, ngroups, cstart, ncopies, tables, dst_blocks)


def _lookup(p: Plans, side: str, row: np.ndarray, t: np.ndarray, kid: np.ndarray):
    """(found, request block index, kernel block's index in its block, found in another group's table) of kernel
    block ids `kid` of group rows `row` on a side."""
    ratio = p.g[f"{side}_block"][row] // p.g[f"{side}_kernel"][row]
    logical, sub = kid // ratio, kid % ratio
    keys, index, anyg = p.tables[side]
    k = row * _SHIFT + logical + 1
    at = np.minimum(np.searchsorted(keys, k), max(keys.size - 1, 0))
    found = (keys.size > 0) & (keys[at] == k) if keys.size else np.zeros(k.size, bool)
    k2 = t * _SHIFT + logical + 1
    a2 = np.minimum(np.searchsorted(anyg, k2), max(anyg.size - 1, 0))
    other = (anyg[a2] == k2) & ~found if anyg.size else np.zeros(k.size, bool)
    return found, np.where(found, index[at] if index.size else 0, -1), sub, other


class Verdicts:
    """Per transfer: slots (or positions) of each kind, and per kind its first example (group row, destination
    position, the position received, the source worker; -1 where none)."""

    def __init__(self, n: int):
        self.count = np.zeros((n, len(KINDS)), np.int64)
        self.example = np.full((n, len(KINDS), 4), -1, np.int64)
        self.note = np.zeros((n, 2), np.int64)  # a block-ids example's cause (code, block id)
        self.need = np.zeros(n, np.int64)  # positions the destination must hold (positional groups, length known)

    def add(self, kind: int, t: np.ndarray, n: np.ndarray, ex: tuple[np.ndarray, ...] | None = None) -> None:
        """Count n (per entry) of kind at transfers t, entries in plan order (the first of each transfer is its
        example)."""
        np.add.at(self.count[:, kind], t, n)
        if ex is None or t.size == 0:
            return
        u, first = np.unique(t, return_index=True)
        fresh = self.example[u, kind, 0] < 0
        self.example[u[fresh], kind] = np.stack([e[first[fresh]] for e in ex], axis=1)


def _copies(d: Dump, p: Plans, lo: int, hi: int, v: Verdicts) -> None:
    """Judge the copies of transfers [lo, hi)."""
    a, b = int(p.cstart[lo]) if hi > lo else 0, int(p.cstart[hi - 1] + p.ncopies[hi - 1]) if hi > lo else 0
    c = {col.name: _col_slice(d, col.key, a, b) for col in COLUMNS_OF[XCOPY]}
    t = lo + np.repeat(np.arange(hi - lo), p.ncopies[lo:hi])
    grp = c["group"]
    known = grp < p.ngroups[t]
    if p.g["kind"].size == 0:  # (no transfer has a group: every copy names one it lacks)
        v.add(BLOCK_IDS, t, c["count"], (np.full(t.size, -1),) * 3 + (c["src_rank"],))
        v.note[np.unique(t)] = (1, -1)
        return
    row = np.where(known, p.gstart[t] + grp, 0)
    s_found, s_idx, s_sub, s_other = _lookup(p, "src", row, t, c["src_block_id"])
    d_found, d_idx, d_sub, d_other = _lookup(p, "dst", row, t, c["dst_block_id"])
    sk, dk = p.g["src_kernel"][row], p.g["dst_kernel"][row]
    over = (c["src_offset"] + c["count"] > sk) | (c["dst_offset"] + c["count"] > dk)
    x = p.x
    workers = x["src_pcp"][t] * x["src_dcp"][t]
    no_worker = c["src_rank"] >= workers
    cause = np.select([~known, ~s_found, ~d_found, over], [1, np.where(s_other, 2, 3), np.where(d_other, 4, 5), 6], 0)
    bad = cause > 0
    at = np.flatnonzero(bad)
    v.add(BLOCK_IDS, t[at], c["count"][at], (row[at], np.full(at.size, -1), np.full(at.size, -1), c["src_rank"][at]))
    first_bad = np.unique(t[at], return_index=True)
    fresh = v.note[first_bad[0], 0] == 0
    pick = at[first_bad[1][fresh]]
    v.note[first_bad[0][fresh]] = np.stack([cause[pick], np.select(
        [cause[pick] <= 3, cause[pick] <= 5], [c["src_block_id"][pick], c["dst_block_id"][pick]], -1)], axis=1)
    at = np.flatnonzero(~bad & no_worker)
    v.add(WRONG_SOURCE, t[at], c["count"][at], (row[at], np.full(at.size, -1), np.full(at.size, -1),
                                                c["src_rank"][at]))
    ok = ~bad & ~no_worker
    rows = np.arange(p.gstart[lo], p.gstart[hi - 1] + p.ngroups[hi - 1])  # the chunk's group rows
    m = ok & (p.g["kind"][row] == MAMBA)
    _mamba(p, v, rows, t[m], row[m], (s_idx[m], s_sub[m]), (d_idx[m], d_sub[m]), c["src_rank"][m])
    slots = ok & ~m
    _slots(p, v, rows, t[slots], row[slots], c, slots, (s_idx, s_sub), (d_idx, d_sub))


def _col_slice(d: Dump, key: str, a: int, b: int) -> np.ndarray:
    return np.asarray(d[key][a:b], np.int64)


def _transfer_of(p: Plans, rows: np.ndarray) -> np.ndarray:
    """The transfer each group row belongs to."""
    return np.searchsorted(p.gstart, rows, side="right") - 1


def _mamba(p: Plans, v: Verdicts, rows: np.ndarray, t, row, src, dst, worker) -> None:
    """Mamba copies: the same block of the request on both sides, each destination block once. `rows`: the group rows
    of the chunk."""
    right = (src[0] == dst[0]) & (src[1] == dst[1])
    at = np.flatnonzero(~right)
    v.add(BLOCK_IDS, t[at], np.ones(at.size, np.int64), (row[at], dst[0][at], src[0][at], worker[at]))
    u, n = np.unique(row[right] * _SHIFT + dst[0][right], return_counts=True)
    dup = n > 1
    v.add(TWICE, _transfer_of(p, u[dup] // _SHIFT), n[dup] - 1)
    rows = rows[p.g["kind"][rows] == MAMBA]
    missing = np.maximum(p.dst_blocks[rows] - np.bincount(u // _SHIFT, minlength=p.dst_blocks.size)[rows], 0)
    v.add(NEVER, _transfer_of(p, rows[missing > 0]), missing[missing > 0])


def _slots(p: Plans, v: Verdicts, rows: np.ndarray, t, row, c, sel, src, dst) -> None:
    """Positional copies, expanded slot by slot. `rows`: the group rows of the chunk."""
    x, g = p.x, p.g
    n = np.minimum(c["count"][sel], np.minimum(g["src_kernel"][row] - c["src_offset"][sel],
                                               g["dst_kernel"][row] - c["dst_offset"][sel]))
    k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    e = np.repeat(np.arange(n.size), n)
    st, sr = t[e], row[e]
    ls = (src[0][sel] * g["src_block"][row] + src[1][sel] * g["src_kernel"][row] + c["src_offset"][sel])[e] + k
    ld = (dst[0][sel] * g["dst_block"][row] + dst[1][sel] * g["dst_kernel"][row] + c["dst_offset"][sel])[e] + k
    worker = c["src_rank"][sel][e]
    sw = np.where(x["src_cp_shards"] > 0, x["src_pcp"] * x["src_dcp"], x["src_dcp"])[st]
    dw = np.where(x["dst_cp_shards"] > 0, x["dst_pcp"] * x["dst_dcp"], x["dst_dcp"])[st]
    s_shard = shard_of(worker, x["src_dcp"][st], x["src_cp_shards"][st] > 0)
    d_shard = shard_of(x["dst_rank"], x["dst_dcp"], x["dst_cp_shards"] > 0)
    ps = positions_of(ls, s_shard, sw, x["src_interleave"][st], g["src_sharded"][sr] > 0)
    pd = positions_of(ld, d_shard[st], dw, x["dst_interleave"][st], g["dst_sharded"][sr] > 0)
    L = np.where(x["seq_len"] >= 0, x["seq_len"], _BIG)
    lo, hi = needed(p, d_shard)
    relevant = (ld >= lo[sr]) & (ld < hi[sr])
    right = relevant & (ps == pd)
    wrong = relevant & ~right
    past = wrong & (ps >= L[st])
    wsrc = wrong & ~past & (g["src_sharded"][sr] > 0) & (owner(pd, sw, x["src_interleave"][st]) != s_shard)
    nown = wrong & ~past & ~wsrc & (g["dst_sharded"][sr] > 0) & (owner(ps, dw, x["dst_interleave"][st]) !=
                                                                    d_shard[st])
    misplaced = wrong & ~past & ~wsrc & ~nown
    for kind, m in ((PAST, past), (WRONG_SOURCE, wsrc), (NOT_OWNER, nown), (BLOCK_IDS, misplaced)):
        at = np.flatnonzero(m)
        v.add(kind, st[at], np.ones(at.size, np.int64), (sr[at], pd[at], ps[at], worker[at]))
    key = sr[right] * _SHIFT + ld[right]
    u, first, cnt = np.unique(key, return_index=True, return_counts=True)
    dup = np.flatnonzero(cnt > 1)
    at = np.flatnonzero(right)[first[dup]]
    v.add(TWICE, st[at], cnt[dup] - 1, (sr[at], pd[at], ps[at], worker[at]))
    _never(p, v, rows, u, lo, hi, d_shard)


def needed(p: Plans, d_shard: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per group row, the destination's local indices [lo, hi) it must hold (a sequence length unknown: every one
    from its table on)."""
    x, g = p.x, p.g
    t = np.repeat(np.arange(p.obs.size), p.ngroups)
    dw = np.where(x["dst_cp_shards"] > 0, x["dst_pcp"] * x["dst_dcp"], x["dst_dcp"])[t]
    il, sh, sharded = x["dst_interleave"][t], d_shard[t], g["dst_sharded"] > 0
    L = x["seq_len"][t]
    hi = np.where(L >= 0, local_count(L, sh, dw, il, sharded), _BIG)
    lo = g["dst_first"] * g["dst_block"]
    win = (g["window"] > 0) & (L >= 0)
    lo = np.where(win, np.maximum(lo, local_count(L - g["window"], sh, dw, il, sharded)), lo)
    return np.minimum(lo, hi), hi


def _never(p: Plans, v: Verdicts, rows: np.ndarray, got: np.ndarray, lo, hi, d_shard) -> None:
    """Positions the destination must hold that no right slot filled, per group row in `rows` (got: the sorted keys
    of the local indices received right); the first one as the example."""
    known = p.x["seq_len"][_transfer_of(p, rows)] >= 0
    rows = rows[known & (p.g["kind"][rows] != MAMBA)]
    grow = got // _SHIFT
    n = np.bincount(grow, minlength=p.g["kind"].size)[rows]
    np.add.at(v.need, _transfer_of(p, rows), hi[rows] - lo[rows])
    missing = np.maximum(hi[rows] - lo[rows] - n, 0)
    rows, missing = rows[missing > 0], missing[missing > 0]
    if rows.size == 0:
        return
    # the first local index missing: lo when the first received is later (or none is), else the end of the first run
    # received (keys of two rows differ by far more than 1: a run never spans rows)
    first = lo[rows]
    if got.size:
        at = np.minimum(np.searchsorted(got, rows * _SHIFT), got.size - 1)
        has = (grow[at] == rows) & (got[at] % _SHIFT == lo[rows])
        ends = np.append(np.flatnonzero(np.diff(got) != 1), got.size - 1)
        run_end = ends[np.searchsorted(ends, at)]
        first = np.where(has, got[run_end] % _SHIFT + 1, first)
    t = _transfer_of(p, rows)
    x = p.x
    dw = np.where(x["dst_cp_shards"] > 0, x["dst_pcp"] * x["dst_dcp"], x["dst_dcp"])[t]
    pos = positions_of(first, d_shard[t], dw, x["dst_interleave"][t], p.g["dst_sharded"][rows] > 0)
    v.add(NEVER, t, missing, (rows, pos, np.full(rows.size, -1), np.full(rows.size, -1)))


def judge(d: Dump) -> tuple[Plans, Verdicts]:
    """Every transfer's verdict, a chunk of transfers at a time (at most SLOTS_CHUNK slots each, but one)."""
    p = plans(d)
    v = Verdicts(p.obs.size)
    slots = np.zeros(p.obs.size, np.int64)
    counts = _col(d, "xcopy.count")
    owner_t = np.repeat(np.arange(p.obs.size), p.ncopies)
    np.add.at(slots, owner_t, counts)
    ends = np.cumsum(slots)
    lo = 0
    while lo < p.obs.size:
        hi = max(lo + 1, int(np.searchsorted(ends, (ends[lo - 1] if lo else 0) + SLOTS_CHUNK, side="right")))
        _copies(d, p, lo, hi, v)
        lo = hi
    _partial(p, v)
    return p, v


def _partial(p: Plans, v: Verdicts) -> None:
    """A keyed store holding other positions than its key's, or some of them only: a partial shard stored as the
    whole request."""
    store = p.x["store"] > 0
    lost = v.count[:, [WRONG_SOURCE, PAST, NOT_OWNER, NEVER]].sum(axis=1)
    at = np.flatnonzero(store & (lost > 0))
    v.count[at, PARTIAL] = lost[at]


def check_transfer(d: Dump) -> FindingTable:
    """One `transfer` finding per transfer whose plan is wrong, named by its first kind (KINDS' order), its counts
    in the detail."""
    p, v = judge(d)
    found = Written(d)
    for t in np.flatnonzero(v.count.sum(axis=1)).tolist():
        kind = int(np.flatnonzero(v.count[t])[0])
        text, detail = describe(p, v, t, kind)
        ex = v.example[t, kind if kind != PARTIAL else _partial_example(v, t)]
        grp = int(ex[0] - p.gstart[t]) if ex[0] >= 0 else None
        found.add(int(p.obs[t]), "transfer", text, row=grp, recorded=None if ex[2] < 0 else int(ex[2]),
                  expected=None if ex[1] < 0 else int(ex[1]), wrong_rows=int(v.count[t].sum() - v.count[t, PARTIAL]),
                  detail=detail, relation=KINDS[kind])
    return found.table()


def _partial_example(v: Verdicts, t: int) -> int:
    return next(k for k in (NEVER, WRONG_SOURCE, NOT_OWNER, PAST) if v.example[t, k, 0] >= 0 or k == PAST)


_CAUSE = {1: "names a KV-cache group the transfer does not have", 2: "reads source block {id}, which is in another "
          "group's table", 3: "reads source block {id}, which no table of the request holds (scaled, or stale)",
          4: "writes destination block {id}, which is in another group's table", 5: "writes destination block {id}, "
          "which no table of the request holds (scaled, or stale)", 6: "runs past its kernel block"}


def describe(p: Plans, v: Verdicts, t: int, kind: int) -> tuple[str, dict]:
    """A transfer finding's text and detail."""
    x = p.x
    counts = {KINDS[k]: int(n) for k, n in enumerate(v.count[t]) if n}
    ex = v.example[t, kind if kind != PARTIAL else _partial_example(v, t)]
    row, pd, ps, worker = (int(e) for e in ex)
    g = row - int(p.gstart[t]) if row >= 0 else -1
    gname = f"group {g} ({GROUP_KINDS[int(p.g['kind'][row])]})" if row >= 0 else "a group"
    L = int(x["seq_len"][t])
    head = f"request {int(x['request'][t])}, {gname}: "
    if kind == BLOCK_IDS:
        cause, bid = (int(c) for c in v.note[t])
        what = (_CAUSE[cause].format(id=bid) if cause else f"pairs blocks that carry other positions: position {pd} "
                f"receives the KV of position {ps}")
        text = f"a copy {what}"
    elif kind == PARTIAL:
        need = int(v.need[t])
        text = (f"a store whose key claims {need} positions of tokens [0, {L}) holds {need - counts.get('never', 0)} "
                "of them: a partial shard stored as the whole request")
    elif kind == WRONG_SOURCE:
        text = (f"position {pd} read from source worker {worker}, whose shard does not hold it" if pd >= 0 else
                f"reads from source worker {worker}, which the source layout does not have")
    elif kind == PAST:
        text = f"position {pd} filled from source position {ps}, past the sequence ({L} tokens)"
    elif kind == NOT_OWNER:
        text = f"the KV of position {ps} sent to destination rank {int(x['dst_rank'][t])}, which does not own it"
    elif kind == TWICE:
        text = f"position {pd} received more than once"
    else:
        text = f"position {pd} never transferred to destination rank {int(x['dst_rank'][t])}"
    more = ", ".join(f"{k} {n}" for k, n in counts.items())
    detail = {"kind": KINDS[kind], "kinds": counts, "request": int(x["request"][t]), "group": g if g >= 0 else None,
              "position": pd if pd >= 0 else None, "received": ps if ps >= 0 else None,
              "source_worker": worker if worker >= 0 else None, "seq_len": L if L >= 0 else None}
    return f"{head}{text} ({more})", detail
