"""KV transfer plans for the tests: seeded random layouts with awkward sizes, their reference plans, the perturbations
each kind of the `transfer` rule must catch, and a per-slot Python account of the rule (no numpy, a dict per
position) that the vectorised check is compared with. Not part of the package."""

from __future__ import annotations

from collections import Counter

import numpy as np

from dcptool.dcp.kv_transfer import KINDS, plan_transfer
from dcptool.dump.transfer import GROUP_KINDS, GroupPlan, Side

SEQ_LENS = (0, 1, 3, 7, 127, 128, 129, 1031)  # awkward: empty, shorter than any CP world, around a block, long
BLOCKS = (16, 64)


def random_side(rng: np.random.Generator, block: int) -> Side:
    dcp = int(rng.integers(1, 9))
    pcp = int(rng.integers(1, 3))
    interleave = int(rng.choice([1, block, max(1, block // 4)]))
    return Side(tp=dcp * int(rng.integers(1, 3)), pcp=pcp, dcp=dcp, interleave=interleave,
                cp_shards=bool(rng.integers(2)) and pcp > 1)


def world(s: Side, sharded: bool = True) -> int:
    return (s.pcp * s.dcp if s.cp_shards else s.dcp) if sharded else 1


def random_groups(rng: np.random.Generator, L: int, src: Side, dst: Side, *, prefix: bool = True,
                  base: int = 0) -> list[GroupPlan]:
    """An MLA group (sharded), sometimes a sliding-window one, a replicated indexer sharded on one side only, and a
    mamba group; block tables of distinct ids (each group its own range from `base`), long enough for L on both
    sides, the destination's from a random prefix hit on."""
    kinds = ["mla"] + [k for k in ("swa", "indexer", "mamba") if rng.random() < 0.5]
    out = []
    for g, kind in enumerate(kinds):
        # (vLLM: the block size is a multiple of the interleave, so a shard's blocks hold B * W tokens of the request)
        B = int(rng.choice([b for b in (16, 64, 128) if b % src.interleave == 0 and b % dst.interleave == 0]))
        ks = B // int(rng.choice([1, 2, 4]))
        kd = B // int(rng.choice([1, 2, 4]))
        ss = ds = kind != "mamba"
        if kind == "indexer":
            ss, ds = bool(rng.integers(2)), bool(rng.integers(2))
        window = int(rng.integers(1, 200)) if kind == "swa" else 0
        ns = -(-L // (B * world(src, ss))) if kind != "mamba" else 1
        nd = -(-L // (B * world(dst, ds))) if kind != "mamba" else 1
        first = int(rng.integers(0, nd + 1)) if prefix and kind != "mamba" else 0
        pool = base + 10_000 * g
        src_ids = pool + rng.permutation(4 * ns + 8)[:ns]
        dst_ids = pool + 5_000 + rng.permutation(4 * nd + 8)[: nd - first]
        out.append(GroupPlan(kind, src_ids, dst_ids, B, B, ks, kd, ss, ds, window, 0, first))
    return out


def random_transfer(rng: np.random.Generator, *, store: bool = False) -> dict:
    """Recorder.transfer's keywords (but step and rank) for a random right plan."""
    block = int(rng.choice(BLOCKS))
    src, dst = random_side(rng, block), random_side(rng, block)
    L = int(rng.choice(SEQ_LENS))
    groups = random_groups(rng, L, src, dst)
    dst_rank = int(rng.integers(0, dst.pcp * dst.dcp))
    copies = plan_transfer(L, dst_rank, src, dst, groups)
    return dict(request=int(rng.integers(1 << 40)), src=src, dst=dst, groups=groups, seq_len=L, dst_rank=dst_rank,
                copies=copies, store=store)


# ---- the perturbations: how a connector goes wrong, and the kind each must produce


def positional(t: dict) -> np.ndarray:
    """Rows of the copies of positional (not mamba) groups."""
    kinds = np.array([GROUP_KINDS.index(g.kind) for g in t["groups"]])
    c = t["copies"]
    return np.flatnonzero(kinds[c[:, 0]] != GROUP_KINDS.index("mamba")) if c.size else np.zeros(0, np.int64)


def drop_copy(t: dict, rng) -> dict | None:
    rows = positional(t)
    if rows.size == 0:
        return None
    return {**t, "copies": np.delete(t["copies"], int(rng.choice(rows)), axis=0)}


def twice(t: dict, rng) -> dict | None:
    rows = positional(t)
    if rows.size == 0:
        return None
    r = int(rng.choice(rows))
    return {**t, "copies": np.concatenate([t["copies"], t["copies"][r : r + 1]])}


def scaled_ids(t: dict, rng) -> dict | None:
    """vllm-ascend #13965: another group's kernel scale (8) applied to the source block ids."""
    if not t["copies"].size:
        return None
    c = t["copies"].copy()
    c[:, 2] *= 8
    return {**t, "copies": c}


def wrong_worker(t: dict, rng) -> dict | None:
    """A copy of a sharded source group read from another worker, whose shard holds other positions."""
    src = t["src"]
    workers = src.pcp * src.dcp
    rows = [r for r in positional(t) if t["groups"][t["copies"][r, 0]].src_sharded and world(src) > 1]
    if not rows:
        return None
    c = t["copies"].copy()
    r = int(rng.choice(rows))
    shard = c[r, 1] if src.cp_shards else c[r, 1] % src.dcp
    other = [w for w in range(workers) if (w if src.cp_shards else w % src.dcp) != shard]
    c[r, 1] = int(rng.choice(other))
    return {**t, "copies": c}


PERTURB = {"never": drop_copy, "twice": twice, "block-ids": scaled_ids, "wrong-source": wrong_worker}


# ---- the rule, slot by slot in Python (no numpy): the account the vectorised check must agree with


def _pos(local: int, shard: int, W: int, I: int, sharded: bool) -> int:
    return ((local // I) * W + shard) * I + local % I if sharded else local


def _owner(p: int, W: int, I: int) -> int:
    return (p // I) % W


def _local_count(n: int, shard: int, W: int, I: int, sharded: bool) -> int:
    return sum(1 for p in range(max(n, 0)) if not sharded or _owner(p, W, I) == shard)


def account(t: dict) -> Counter:
    """The kinds of one transfer (record keywords), counted as the rule counts them, one slot at a time."""
    src, dst, L, groups = t["src"], t["dst"], t["seq_len"], t["groups"]
    Ws, Wd = world(src), world(dst)
    d_shard = t["dst_rank"] if dst.cp_shards else t["dst_rank"] % dst.dcp
    out: Counter = Counter()
    got: dict[tuple[int, int], int] = {}
    for g, s_rank, s_id, s_off, d_id, d_off, count in (tuple(int(x) for x in row) for row in t["copies"]):
        if g >= len(groups):
            out["block-ids"] += count
            continue
        grp = groups[g]
        s_tab, d_tab = [int(x) for x in grp.src_blocks], [int(x) for x in grp.dst_blocks]
        rs, rd = grp.src_block_size // grp.src_kernel_block_size, grp.dst_block_size // grp.dst_kernel_block_size
        if (s_id // rs not in s_tab or d_id // rd not in d_tab or s_off + count > grp.src_kernel_block_size
                or d_off + count > grp.dst_kernel_block_size):
            out["block-ids"] += count
            continue
        if s_rank >= src.pcp * src.dcp:
            out["wrong-source"] += count
            continue
        si = grp.src_first + s_tab.index(s_id // rs)
        di = grp.dst_first + d_tab.index(d_id // rd)
        if grp.kind == "mamba":
            if (si, s_id % rs) != (di, d_id % rd):
                out["block-ids"] += 1
            else:
                got[(g, di)] = got.get((g, di), 0) + 1
            continue
        s_shard = s_rank if src.cp_shards else s_rank % src.dcp
        lo = grp.dst_first * grp.dst_block_size
        if grp.window and L >= 0:
            lo = max(lo, _local_count(L - grp.window, d_shard, Wd, dst.interleave, grp.dst_sharded))
        hi = _local_count(L, d_shard, Wd, dst.interleave, grp.dst_sharded) if L >= 0 else 1 << 62
        for k in range(count):
            ls = si * grp.src_block_size + (s_id % rs) * grp.src_kernel_block_size + s_off + k
            ld = di * grp.dst_block_size + (d_id % rd) * grp.dst_kernel_block_size + d_off + k
            if not lo <= ld < hi:
                continue
            ps = _pos(ls, s_shard, Ws, src.interleave, grp.src_sharded)
            pd = _pos(ld, d_shard, Wd, dst.interleave, grp.dst_sharded)
            if ps == pd:
                got[(g, ld)] = got.get((g, ld), 0) + 1
            elif L >= 0 and ps >= L:
                out["past-sequence"] += 1
            elif grp.src_sharded and _owner(pd, Ws, src.interleave) != s_shard:
                out["wrong-source"] += 1
            elif grp.dst_sharded and _owner(ps, Wd, dst.interleave) != d_shard:
                out["not-owner"] += 1
            else:
                out["block-ids"] += 1
    for n in got.values():
        if n > 1:
            out["twice"] += n - 1
    for g, grp in enumerate(groups):
        if grp.kind == "mamba":
            need = sum(1 for b in grp.dst_blocks if b >= 0)
        elif L < 0:
            continue
        else:
            lo = grp.dst_first * grp.dst_block_size
            if grp.window:
                lo = max(lo, _local_count(L - grp.window, d_shard, Wd, dst.interleave, grp.dst_sharded))
            need = max(_local_count(L, d_shard, Wd, dst.interleave, grp.dst_sharded) - lo, 0)
        have = sum(1 for (h, _) in got if h == g)
        if need > have:
            out["never"] += need - have
    if t.get("store") and sum(out[k] for k in ("wrong-source", "past-sequence", "not-owner", "never")):
        out["partial-store"] = sum(out[k] for k in ("wrong-source", "past-sequence", "not-owner", "never"))
    assert set(out) <= set(KINDS)
    return +out
