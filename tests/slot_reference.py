"""The slot checks as they were before: old_* the whole-column implementation (before chunks),
chunked_* the chunked one of main d07e667 (before the one-pass screen). The references dcptool.check.slots.check_slots /
check_slot_partition are compared against (tests/check/test_slots.py) and timed against (benchmarks/bench_coverage.py
--slots). Not part of the package."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dcptool.check.findings import FindingTable, Written
from dcptool.check.ranks import kth_per_rank
from dcptool.check.slot_pass import SLOT_KIND_TEXT as _SLOT_KIND_TEXT
from dcptool.check.slot_pass import SLOT_KINDS as _SLOT_KINDS
from dcptool.check.slot_pass import group_name as _group_name
from dcptool.check.slots import few as _few
from dcptool.dcp.segments import group_ids, obs_chunks, ragged
from dcptool.dump import Dump


class Issue(NamedTuple):
    """One finding as the references write it; _table makes their lists FindingTables, as the checks return."""

    index: int
    rule: str
    text: str
    fields: dict


def _table(d: Dump, issues: list[Issue]) -> FindingTable:
    w = Written(d)
    for i in issues:
        f = i.fields
        w.add(i.index, i.rule, i.text, row=f.get("row"), recorded=f.get("recorded"), expected=f.get("expected"),
              wrong_rows=f.get("wrong_rows", 0), detail=f.get("detail"))
    return w.table()


class _SlotEntries(NamedTuple):
    obs: np.ndarray  # per entry: observation
    pos: np.ndarray
    slot: np.ndarray
    grp: np.ndarray
    tok: np.ndarray  # index of the token within its (observation, group)
    real: np.ndarray  # bool: a real token (t < the observation's real token count)
    sharded: np.ndarray  # bool: its group is DCP-sharded
    owner: np.ndarray  # the rank that owns its position
    run: np.ndarray  # id of its (observation, group)
    run_writes: np.ndarray  # per run: some real token writes a slot
    n_real: np.ndarray  # per entry: the observation's real token count (its group's token count if unknown)


def _slot_entries(d: Dump) -> _SlotEntries:
    c = d.config
    N, I_ = c.dcp_size, c.cp_interleave
    offs = d["obs.slots"]
    cnt = np.diff(offs)
    obs = np.repeat(np.arange(d.n, dtype=np.int64), cnt)
    # whole columns (np.asarray: a lazily merged set of files builds them; not bounded, docs/limits.md)
    pos = np.asarray(d["rows.positions"]).astype(np.int64)
    slot = np.asarray(d["rows.slot_mapping"]).astype(np.int64)
    grp = np.asarray(d["rows.slot_group"]).astype(np.int64)
    # by observation, then group, then entry order (= token order); the Recorder writes each observation's
    # groups as ascending blocks, so the sort is only needed for a dump written otherwise
    blocks = obs.size < 2 or not ((grp[1:] < grp[:-1]) & (obs[1:] == obs[:-1])).any()
    order = None if blocks else np.lexsort((np.arange(obs.size), grp, obs))
    so, sg = (obs, grp) if blocks else (obs[order], grp[order])
    new = np.ones(obs.size, bool)
    if obs.size:
        new[1:] = (so[1:] != so[:-1]) | (sg[1:] != sg[:-1])
    run_sorted = np.cumsum(new) - 1
    start = np.flatnonzero(new)
    tok_sorted = np.arange(obs.size) - start[run_sorted]
    if blocks:
        run, tok = run_sorted, tok_sorted
    else:
        run = np.empty(obs.size, np.int64)
        run[order] = run_sorted
        tok = np.empty(obs.size, np.int64)
        tok[order] = tok_sorted
    run_len = np.diff(np.append(start, obs.size))
    # the real token count: qsl[num_reqs] where query_start_loc was recorded, else every token of the group
    n_real = run_len[run]
    if d.has("obs.qsl"):
        q = d["obs.qsl"]
        known = np.diff(q) > 0
        nr = d["obs.num_reqs"].astype(np.int64)
        real_tokens = np.full(d.n, -1, np.int64)
        k = np.flatnonzero(known)
        real_tokens[k] = d["rows.query_start_loc"][q[k] + nr[k]]
        rt = real_tokens[obs]
        n_real = np.where(rt >= 0, rt, n_real)
    real = tok < n_real
    sharded = c.group_dcp(int(grp.max(initial=-1)) + 1)[grp]
    owner = (pos // I_) % N
    run_writes = np.zeros(start.size, bool)
    run_writes[run[real & (slot >= 0)]] = True
    return _SlotEntries(obs, pos, slot, grp, tok, real, sharded, owner, run, run_writes, n_real)



def old_check_slots(d: Dump) -> FindingTable:
    """Per observation: each token's slot against vLLM's ownership rule (module comment above): padded
    tokens and non-owners of a DCP-sharded position write -1; the owner, and every rank in a replicated
    group, writes a slot (unless the build writes nothing at all); where the group's block size is known, a
    slot sits at vLLM's local block offset; no two tokens of one build write the same slot."""
    c = d.config
    N, I_ = c.dcp_size, c.cp_interleave
    s = _slot_entries(d)
    if s.obs.size == 0:
        return _table(d, [])
    rank = d["obs.rank"].astype(np.int64)[s.obs]
    writes = s.run_writes[s.run]
    w = s.slot >= 0
    bs = c.group_block_size(int(s.grp.max()) + 1)[s.grp]
    vb = np.maximum(bs, 1)
    vo = s.pos % (vb * N)
    want_off = np.where(s.sharded, vo // (I_ * N) * I_ + vo % I_, s.pos % vb)
    # offsets are vLLM's only where its own precondition holds (block_size a multiple of the interleave)
    off_known = (bs > 0) & (~s.sharded | (bs % I_ == 0))
    dup = np.zeros(s.obs.size, bool)
    partner = np.full(s.obs.size, -1, np.int64)
    cand = np.flatnonzero(s.real & w)
    if cand.size:
        # one int64 key per written entry: its (observation, group) run, then its slot (0 <= slot < 2**31)
        o2 = cand[np.argsort(s.run[cand] << 31 | s.slot[cand], kind="stable")]
        same = (s.run[o2][1:] == s.run[o2][:-1]) & (s.slot[o2][1:] == s.slot[o2][:-1])
        dup[o2[1:][same]] = True
        partner[o2[1:][same]] = o2[:-1][same]
    kinds = [
        ~s.real & (s.slot != -1),
        s.slot < -1,
        s.real & s.sharded & w & (rank != s.owner),
        s.real & s.sharded & (s.slot == -1) & (rank == s.owner) & writes,
        s.real & ~s.sharded & (s.slot == -1) & writes,
        s.real & w & off_known & (s.slot % vb != want_off) & (~s.sharded | (rank == s.owner)),
        dup,
    ]
    kind = np.select(kinds, np.arange(len(kinds)), -1)
    bad = np.flatnonzero(kind >= 0)
    if bad.size == 0:
        return _table(d, [])
    obs_bad, first, count = np.unique(s.obs[bad], return_index=True, return_counts=True)
    out: list[Issue] = []
    for o, k, n in zip(obs_bad.tolist(), bad[first].tolist(), count.tolist()):
        name = _SLOT_KINDS[int(kind[k])]
        g, p, sl, t = int(s.grp[k]), int(s.pos[k]), int(s.slot[k]), int(s.tok[k])
        B = int(bs[k])
        kw = dict(t=t, p=p, s=sl, g=_group_name(d, g), o=int(s.owner[k]), I=I_, N=N, real=int(s.n_real[k]),
                  B=B, off=sl % max(B, 1), want=int(want_off[k]), t2=None, p2=None)
        if name == "duplicate":
            j = int(partner[k])
            kw.update(t2=int(s.tok[j]), p2=int(s.pos[j]))
        text = _SLOT_KIND_TEXT[name].format(**kw) + (f" ({n} wrong entries)" if n > 1 else "")
        detail = {"kind": name, "group": g, "position": p, "token": t, "slot": sl}
        if name in ("non-owner", "owner-missing"):
            detail["owner"] = int(s.owner[k])
        expected = -1 if name in ("padded", "non-owner") else None
        out.append(Issue(o, "slots", text, {"row": t, "recorded": sl, "expected": expected, "wrong_rows": n,
                                            "detail": detail}))
    return _table(d, out)


def old_check_slot_partition(d: Dump) -> FindingTable:
    """Across the N ranks of one (step, site, micro-batch, KV-cache group) recorded on every rank (the k-th
    recording of each rank makes the k-th set), each real token of a DCP-sharded group must be written by
    exactly one rank. A position written by several ranks is reported at the ranks that do not own it, one
    written by none at its owner (so the finding sits where the write went wrong). Sets whose ranks write
    nothing at all (dummy runs, capture) are not asked to."""
    from dcptool.dcp.segments import group_ids as _group_ids

    c = d.config
    N = c.dcp_size
    s = _slot_entries(d)
    if N == 1 or s.obs.size == 0:
        return _table(d, [])
    # one member per (observation, sharded group) run: its first entry
    first = np.full(s.run_writes.size, s.obs.size, np.int64)
    np.minimum.at(first, s.run, np.arange(s.obs.size))
    m_obs, m_grp = s.obs[first], s.grp[first]
    m_real = s.n_real[first]
    keep = s.sharded[first]
    m = np.flatnonzero(keep)
    if m.size == 0:
        return _table(d, [])
    o = m_obs[m]
    key = [d["obs.step"][o], d["obs.site"][o].astype(np.int64), d["obs.ubatch"][o].astype(np.int64), m_grp[m],
           m_real[m], d["obs.num_reqs"][o].astype(np.int64)]
    sets = kth_per_rank(_group_ids(key), d["obs.rank"][o].astype(np.int64), o)
    size = np.bincount(sets)
    set_of_run = np.full(s.run_writes.size, -1, np.int64)
    set_of_run[m[size[sets] == N]] = sets[size[sets] == N]
    # entries of full sets, real tokens: count the ranks writing each token
    es = set_of_run[s.run]
    sel = np.flatnonzero((es >= 0) & s.real)
    if sel.size == 0:
        return _table(d, [])
    tid = _group_ids([es[sel], s.tok[sel]])
    wr = (s.slot[sel] >= 0).astype(np.int64)
    writers = np.bincount(tid, weights=wr).astype(np.int64)
    nt = writers.size
    pmin = np.full(nt, np.iinfo(np.int64).max)
    pmax = np.full(nt, -1, np.int64)
    np.minimum.at(pmin, tid, s.pos[sel])
    np.maximum.at(pmax, tid, s.pos[sel])
    set_writes = np.zeros(int(es.max()) + 1, bool)
    set_writes[es[sel][wr > 0]] = True
    tset = np.zeros(nt, np.int64)
    tset[tid] = es[sel]
    bad_tok = (writers != 1) & (pmin == pmax) & set_writes[tset]
    if not bad_tok.any():
        return _table(d, [])
    erank = d["obs.rank"].astype(np.int64)[s.obs[sel]]
    bt = bad_tok[tid]
    many = bt & (writers[tid] >= 2) & (wr > 0) & (erank != s.owner[sel])
    # a position several ranks write but none of them owns it: every writer is at fault
    owner_writes = np.zeros(nt, bool)
    owner_writes[tid[(wr > 0) & (erank == s.owner[sel])]] = True
    many |= bt & (writers[tid] >= 2) & (wr > 0) & ~owner_writes[tid]
    none = bt & (writers[tid] == 0) & (erank == s.owner[sel])
    blame = many | none
    ent = sel[blame]
    if ent.size == 0:
        return _table(d, [])
    out: list[Issue] = []
    eo = s.obs[ent]
    order = np.argsort(eo, kind="stable")
    ent, eo = ent[order], eo[order]
    bounds = np.flatnonzero(np.r_[True, eo[1:] != eo[:-1]])
    ends = np.append(bounds[1:], ent.size)
    # each set's member observations, in order (one sort, sliced per finding)
    mr = np.flatnonzero(set_of_run >= 0)
    mr = mr[np.lexsort((m_obs[mr], set_of_run[mr]))]
    mset = set_of_run[mr]
    for a, b in zip(bounds.tolist(), ends.tolist()):
        mine = ent[a:b]
        i = int(eo[a])
        g = int(s.grp[mine[0]])
        st = int(set_of_run[s.run[mine[0]]])
        members = m_obs[mr[np.searchsorted(mset, st, "left"):np.searchsorted(mset, st, "right")]]
        sev = mine[(s.slot[mine] >= 0)]
        zero = mine[s.slot[mine] < 0]
        parts = []
        if sev.size:
            pl = s.pos[sev]
            parts.append(f"position{'s' if pl.size > 1 else ''} {_few(pl)} written by several ranks, this one "
                         f"not the owner (rank {int(s.owner[sev[0]])} owns position {int(pl[0])})")
        if zero.size:
            parts.append(f"position{'s' if zero.size > 1 else ''} {_few(s.pos[zero])} of this rank written by no "
                         "rank")
        text = (f"across the {N} ranks, DCP-sharded group {_group_name(d, g)}: " + "; ".join(parts)
                + "; each position must be written by exactly one rank, its owner")
        k = int(mine[0])
        detail = {"group": g, "written_by_several": [int(x) for x in s.pos[sev][:64]],
                  "unwritten": [int(x) for x in s.pos[zero][:64]],
                  "obs": [int(d.file_obs[x]) for x in members]}
        out.append(Issue(i, "slot-partition", text, {"row": int(s.tok[k]), "recorded": int(s.slot[k]),
                                                      "expected": None, "wrong_rows": int(mine.size),
                                                      "detail": detail}))
    return _table(d, out)


# --------------------------------------------------------------------------------------------
# main d07e667's chunked implementation, verbatim but for the names

SLOT_CHUNK = 1 << 22
_SLOT_CAP = 64


def _real_tokens(d: Dump) -> np.ndarray:
    """Per observation: its real token count qsl[num_reqs] where query_start_loc was recorded, else -1 (then
    every token of a group counts as real)."""
    out = np.full(d.n, -1, np.int64)
    if d.has("obs.qsl"):
        q = d["obs.qsl"]
        k = np.flatnonzero(np.diff(q) > 0)
        out[k] = d.take("rows.query_start_loc", q[k] + d["obs.num_reqs"][k].astype(np.int64))
    return out


def _group_tables(d: Dump, grp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per entry of `grp` (KV-cache groups): DCP-sharded, block size (0: unknown). Without kv_groups every
    group is sharded of unknown block size (schema lets a group index be any int32 then: no table by index)."""
    kv = d.config.kv_groups
    if kv is None:
        return np.ones(grp.size, bool), np.zeros(grp.size, np.int64)
    return d.config.group_dcp(len(kv))[grp], d.config.group_block_size(len(kv))[grp]


def _slot_rows(d: Dump, key: str, a: int, b: int) -> np.ndarray:
    """Entries [a, b) of a slot row column as int32; in a bounded dump a copy, so that dropping the
    chunk's pages really frees them."""
    v = d[key][a:b]
    return np.array(v, np.int32) if d.bounded else np.asarray(v).astype(np.int32, copy=False)


def _slot_runs(grp: np.ndarray, cnt: np.ndarray) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """The (observation, group) runs of consecutive observations' entries (`cnt` each): by observation, then
    group, then entry order (= token order). The Recorder writes each observation's groups as ascending
    blocks; entries written otherwise are put in that order first -> (that order or None, the groups in it,
    each run's first entry in it)."""
    n = grp.size
    obs_start = (np.cumsum(cnt) - cnt)[cnt > 0]
    dec = np.flatnonzero(grp[1:] < grp[:-1]) + 1
    order = None
    if dec.size and not np.isin(dec, obs_start).all():
        order = np.lexsort((grp, np.repeat(np.arange(cnt.size), cnt)))  # (stable: entry order within a group)
        grp = grp[order]
    new = np.empty(n, bool)
    if n:
        new[0] = True
        np.not_equal(grp[1:], grp[:-1], out=new[1:])
        new[obs_start] = True
    return order, grp, np.flatnonzero(new)


def _want_offset(pos, bs, sharded, N: int, I_: int):
    """vLLM's local offset of each position in its block of `bs` tokens (module comment above); numpy
    arrays (int64) or Python ints."""
    vb = np.maximum(bs, 1)
    vo = pos % (vb * N)
    return np.where(sharded, vo // (I_ * N) * I_ + vo % I_, pos % vb)


def _spread(per_run, run_len: np.ndarray) -> np.ndarray:
    return np.repeat(per_run, run_len)


def chunked_check_slots(d: Dump) -> FindingTable:
    """Per observation: each token's slot against vLLM's ownership rule (module comment above): padded
    tokens and non-owners of a DCP-sharded position write -1; the owner, and every rank in a replicated
    group, writes a slot (unless the build writes nothing at all); where the group's block size is known, a
    slot sits at vLLM's local block offset; no two tokens of one build write the same slot.

    In chunks of about SLOT_CHUNK entries (whole observations): memory bounded by the chunk, not the dump.
    Per-run facts (rank, group, real token count) are spread over the run's entries with np.repeat; the
    sharded offset only on the owners' written entries, the duplicate sort only on runs whose written slots
    do not strictly increase, the kind only on an observation's first wrong entry."""
    c = d.config
    N, I_ = c.dcp_size, c.cp_interleave
    offs = d["obs.slots"]
    if d.n == 0 or int(offs[-1]) == 0:
        return _table(d, [])
    real_tokens = _real_tokens(d)
    rank_all = d["obs.rank"].astype(np.int64)
    out: list[Issue] = []
    for lo, hi in obs_chunks(np.diff(offs), SLOT_CHUNK):
        a, b = int(offs[lo]), int(offs[hi])
        if a == b:
            continue
        cnt = np.diff(offs[lo : hi + 1])
        order, grp, start = _slot_runs(_slot_rows(d, "rows.slot_group", a, b), cnt)
        pos = _slot_rows(d, "rows.positions", a, b)
        slot = _slot_rows(d, "rows.slot_mapping", a, b)
        if d.bounded:
            d.release(lo, hi)
        if order is not None:
            pos, slot = pos[order], slot[order]
        n = slot.size
        run_len = np.diff(np.append(start, n))
        run_obs = np.searchsorted(np.cumsum(cnt), start, "right")  # (into the chunk)
        r_grp = grp[start]
        r_sh, r_bs = _group_tables(d, r_grp)
        rt = real_tokens[lo + run_obs]
        r_real = np.where(rt >= 0, rt, run_len)
        nr = np.minimum(r_real, run_len)
        real = np.repeat(np.tile(np.array([True, False]), start.size), np.stack([nr, run_len - nr], 1).ravel())
        w = slot >= 0
        nil = slot == -1
        rw = real & w
        r_writes = np.logical_or.reduceat(rw, start)
        mine = None  # this rank writes the position: every rank in a replicated group, the owner in a sharded one
        if r_sh.any():
            own = pos // I_ if I_ > 1 else pos
            own = own & (N - 1) if N & (N - 1) == 0 else own % N
            mine = own == _spread(rank_all[lo + run_obs].astype(np.int32), run_len)
            if not r_sh.all():
                mine |= _spread(~r_sh, run_len)
        if mine is None:
            bad = (~real & ~nil) | (slot < -1) | (real & nil & _spread(r_writes, run_len))
        else:
            bad = (~real & ~nil) | (slot < -1) | (real & ((w & ~mine) | (nil & mine & _spread(r_writes, run_len))))
        # offsets are vLLM's only where its own precondition holds (block_size a multiple of the interleave)
        known = (r_bs > 0) & (~r_sh | (r_bs % I_ == 0))
        rep = known & ~r_sh  # replicated: offset p % B, i.e. (slot - p) % B == 0
        if rep.any():
            B = np.unique(r_bs[rep])
            Be = int(B[0]) if B.size == 1 else _spread(np.where(rep, r_bs, 1).astype(np.int32), run_len)
            m = (slot - pos) % Be != 0
            m &= rw
            m &= _spread(rep, run_len)
            bad |= m
        runid = _spread(np.arange(start.size, dtype=np.int32), run_len)
        shk = known & r_sh
        if shk.any():
            oc = np.flatnonzero(rw & mine & _spread(shk, run_len))
            rr = runid[oc]
            p = pos[oc].astype(np.int64)
            bad[oc[slot[oc] % r_bs[rr] != _want_offset(p, r_bs[rr], True, N, I_)]] = True
        # duplicates: in entry order a run whose written slots strictly increase has none; sort the others' by
        # one int64 key, their run then their slot (0 <= slot < 2**31), ties in entry order
        partner = None
        cand = np.flatnonzero(rw)
        sc = slot[cand]
        flag = np.flatnonzero(sc[1:] <= sc[:-1])  # (and at most run boundaries)
        if flag.size:
            r1, r2 = runid[cand[flag]], runid[cand[flag + 1]]
            mark = np.zeros(start.size, bool)
            mark[r1[r1 == r2]] = True
            runs = np.flatnonzero(mark)
            if runs.size:
                seg, _, e = ragged(start[runs], run_len[runs])
                keep = rw[e]
                e = e[keep]
                key = runs[seg[keep]].astype(np.int64) << 31 | slot[e].astype(np.int64)
                o2 = np.argsort(key, kind="stable")
                same = key[o2][1:] == key[o2][:-1]
                dups = e[o2[1:][same]]
                bad[dups] = True
                partner = np.full(n, -1, np.int64)
                partner[dups] = e[o2[:-1][same]]
        if order is not None:  # the first wrong entry of each observation in entry order
            inv = np.empty(n, np.int64)
            inv[order] = np.arange(n)
            bad = bad[inv]
        idx = np.flatnonzero(bad)
        if idx.size == 0:
            continue
        # per observation (its entries are [cs - cnt, cs)): the first wrong entry and how many
        cs = np.cumsum(cnt)
        f0, f1 = np.searchsorted(idx, cs - cnt), np.searchsorted(idx, cs)
        eo = np.flatnonzero(f1 > f0)
        count = (f1 - f0)[eo]
        ks = idx[f0[eo]]
        if order is not None:
            ks = inv[ks]
        rk = runid[ks]
        for o, k, r, n_bad in zip(eo.tolist(), ks.tolist(), rk.tolist(), count.tolist()):
            j = None if partner is None else int(partner[k])
            two = None if j is None or j < 0 else (j - int(start[r]), int(pos[j]))
            out.append(_slot_issue(d, lo + o, n_bad, k - int(start[r]), int(r_grp[r]), int(r_real[r]), int(pos[k]),
                                   int(slot[k]), bool(real[k]), bool(r_sh[r]), int(r_bs[r]),
                                   True if mine is None else bool(mine[k]), bool(r_writes[r]), two))
    return _table(d, out)


def _slot_issue(d: Dump, i: int, n: int, t: int, g: int, n_real: int, p: int, sl: int, real: bool, sharded: bool,
                B: int, mine: bool, writes: bool, two: tuple[int, int] | None) -> Issue:
    """The finding of observation i, whose first wrong entry is token t of group g (n wrong entries in all)."""
    c = d.config
    N, I_ = c.dcp_size, c.cp_interleave
    vb = max(B, 1)
    vo = p % (vb * N)
    want = vo // (I_ * N) * I_ + vo % I_ if sharded else p % vb
    if not real and sl != -1:
        name = "padded"
    elif sl < -1:
        name = "value"
    elif sl >= 0 and not mine:
        name = "non-owner"
    elif sl == -1 and mine and writes:
        name = "owner-missing" if sharded else "replicated-missing"
    elif sl >= 0 and B > 0 and (not sharded or B % I_ == 0) and sl % vb != want:
        name = "offset"
    else:
        name = "duplicate"
    owner = (p // I_) % N
    kw = dict(t=t, p=p, s=sl, g=_group_name(d, g), o=owner, I=I_, N=N, real=n_real, B=B, off=sl % vb,
              want=want, t2=None, p2=None)
    if name == "duplicate":
        kw.update(t2=two[0], p2=two[1])
    text = _SLOT_KIND_TEXT[name].format(**kw) + (f" ({n} wrong entries)" if n > 1 else "")
    detail = {"kind": name, "group": g, "position": p, "token": t, "slot": sl}
    if name in ("non-owner", "owner-missing"):
        detail["owner"] = owner
    expected = -1 if name in ("padded", "non-owner") else None
    return Issue(i, "slots", text, {"row": t, "recorded": sl, "expected": expected, "wrong_rows": n, "detail": detail})


def chunked_check_slot_partition(d: Dump) -> FindingTable:
    """Across the N ranks of one (step, site, micro-batch, KV-cache group) recorded on every rank (the k-th
    recording of each rank makes the k-th set), each real token of a DCP-sharded group must be written by
    exactly one rank. A position written by several ranks is reported at the ranks that do not own it, one
    written by none at its owner (so the finding sits where the write went wrong). Sets whose ranks write
    nothing at all (dummy runs, capture) are not asked to.

    Bounded memory: the (observation, group) runs are summarised in chunks first, the sets formed from the
    summaries, then the entries of about SLOT_CHUNK entries' worth of whole sets gathered at a time (a set's
    members can lie far apart in the file); per token a bincount, no sort. A finding keeps its first
    _SLOT_CAP positions of each kind and the counts."""
    c = d.config
    N, I_ = c.dcp_size, c.cp_interleave
    offs = d["obs.slots"]
    if N == 1 or d.n == 0 or int(offs[-1]) == 0:
        return _table(d, [])
    real_tokens = _real_tokens(d)
    # one member per (observation, DCP-sharded group) run, in (observation, group) order: its first entry and
    # length where its entries are consecutive (the Recorder's layout), else its observation's entries
    parts = []
    for lo, hi in obs_chunks(np.diff(offs), SLOT_CHUNK):
        a, b = int(offs[lo]), int(offs[hi])
        cnt = np.diff(offs[lo : hi + 1])
        order, grp, start = _slot_runs(_slot_rows(d, "rows.slot_group", a, b), cnt)
        if d.bounded:
            d.release(lo, hi)
        run_len = np.diff(np.append(start, grp.size))
        run_obs = np.searchsorted(np.cumsum(cnt), start, "right")
        keep = _group_tables(d, grp[start])[0]
        run_obs, start, run_len = run_obs[keep], start[keep], run_len[keep]
        rt = real_tokens[lo + run_obs]
        if order is None:
            first, span = a + start, run_len
        else:
            first, span = offs[lo + run_obs], cnt[run_obs]
        parts.append((lo + run_obs, grp[start].astype(np.int64), np.where(rt >= 0, rt, run_len), first, span,
                      run_len))
    if not parts:
        return _table(d, [])
    m_obs, m_grp, m_real, m_first, m_span, m_len = (np.concatenate(x) for x in zip(*parts))
    if m_obs.size == 0:
        return _table(d, [])
    key = [d["obs.step"][m_obs], d["obs.site"][m_obs].astype(np.int64), d["obs.ubatch"][m_obs].astype(np.int64),
           m_grp, m_real, d["obs.num_reqs"][m_obs].astype(np.int64)]
    rank = d["obs.rank"].astype(np.int64)
    sets = kth_per_rank(group_ids(key), rank[m_obs], m_obs)
    full = np.bincount(sets)[sets] == N
    # the members of full sets, by set then observation: N in a row each
    mr = np.flatnonzero(full)
    mr = mr[np.lexsort((m_obs[mr], sets[mr]))]
    mset = sets[mr]
    nset = mr.size // N
    if nset == 0:
        return _table(d, [])
    tokens = np.minimum(m_real, m_len)[mr].reshape(nset, N).max(axis=1)  # real tokens per set (token ids)
    found = []
    for slo, shi in obs_chunks(m_span[mr].reshape(nset, N).sum(axis=1), SLOT_CHUNK):
        mm = mr[slo * N : shi * N]
        if (m_span[mm] != m_len[mm]).any():  # a run interleaved with other groups (not the Recorder's layout)
            seg, _, at = ragged(m_first[mm], m_span[mm])
            k = d.take("rows.slot_group", at) == m_grp[mm][seg]
            seg, at = seg[k], at[k]
            tok = np.arange(at.size) - np.searchsorted(seg, np.arange(mm.size))[seg]
            k = np.flatnonzero(tok < m_real[mm][seg])  # real tokens only
            seg, at, tok = seg[k], at[k], tok[k]
        else:  # the run's first min(real, length) entries are its real tokens
            seg, tok, at = ragged(m_first[mm], np.minimum(m_real[mm], m_len[mm]))
        pos = d.take("rows.positions", at).astype(np.int32, copy=False)
        slot = d.take("rows.slot_mapping", at).astype(np.int32, copy=False)
        if d.bounded:
            d.release(0, d.n)
        if at.size == 0:
            continue
        # per token of the batch's sets: how many ranks write it, whether every rank has it at one position
        ls = seg // N
        ntok = tokens[slo:shi]
        base = np.cumsum(ntok) - ntok
        tid = base[ls] + tok
        nt = int(ntok.sum())
        wr = slot >= 0
        writers = np.bincount(tid[wr], minlength=nt)
        ref = np.zeros(nt, np.int32)
        ref[tid] = pos
        moved = np.bincount(tid[pos != ref[tid]], minlength=nt) > 0
        set_writes = np.bincount(ls[wr], minlength=shi - slo) > 0
        bad_tok = (writers != 1) & ~moved & np.repeat(set_writes, ntok)
        b = np.flatnonzero(bad_tok[tid])
        if b.size == 0:
            continue
        bo = m_obs[mm][seg[b]]
        er = rank[bo]
        own = er == (pos[b] // I_) % N
        w, bt, nw = wr[b], tid[b], writers[tid[b]]
        owner_writes = np.zeros(nt, bool)
        owner_writes[bt[w & own]] = True
        # several writers: those that do not own the position (every writer where none owns it); none: the owner
        blame = ((nw >= 2) & w & (~own | ~owner_writes[bt])) | ((nw == 0) & own)
        e = b[blame]
        if e.size > 2 * _SLOT_CAP * mm.size:  # keep each member's first _SLOT_CAP of each kind (and the counts)
            mk = seg[e] * 2 + (slot[e] < 0)
            o = np.argsort(mk, kind="stable")  # (mostly in order already: e is by member, then entry)
            e, mk = e[o], mk[o]
            head = np.flatnonzero(np.r_[True, mk[1:] != mk[:-1]])
            n = np.diff(np.append(head, mk.size))
            kept = np.arange(mk.size) - np.repeat(head, n) < _SLOT_CAP
            extra = np.zeros(e.size, np.int64)  # the members' dropped entries, counted at the first one kept
            extra[head] = n - np.minimum(n, _SLOT_CAP)
            e, extra = e[kept], extra[kept]
        else:
            extra = None
        found.append(_cap_per_obs(at[e], m_obs[mm][seg[e]], (slot[e] < 0).astype(np.int8), pos[e], slot[e],
                                  tok[e].astype(np.int32), m_grp[mm][seg[e]].astype(np.int32),
                                  mset[slo * N + seg[e]], extra=extra))
    if not found:
        return _table(d, [])
    f = _cap_per_obs(*[np.concatenate(x) for x in zip(*[r[0] for r in found])])
    cnt_keys = np.concatenate([r[1] for r in found])
    cnt = np.concatenate([r[2] for r in found])
    ck, inv = np.unique(cnt_keys, return_inverse=True)
    total = np.bincount(inv.ravel(), weights=cnt).astype(np.int64)  # per (observation, kind)
    at, eo, kind, pos, slot, tok, grp, st = f[0]
    heads = np.flatnonzero(np.r_[True, eo[1:] != eo[:-1]])
    ends = np.append(heads[1:], eo.size)
    n_sev = np.bincount(np.repeat(np.arange(heads.size), ends - heads), weights=kind == 0,
                        minlength=heads.size).astype(np.int64)  # kept positions of each kind, per finding
    o = eo[heads]
    tot_sev = np.where(n_sev > 0, total[np.minimum(np.searchsorted(ck, 2 * o), ck.size - 1)], 0)
    tot_zero = np.where(ends - heads > n_sev, total[np.minimum(np.searchsorted(ck, 2 * o + 1), ck.size - 1)], 0)
    # the observation's first wrong entry: the first of either kind (each kind's entries are in entry order)
    z0 = np.minimum(heads + n_sev, eo.size - 1)
    k = np.where((n_sev == 0) | ((ends - heads > n_sev) & (at[z0] < at[heads])), z0, heads)
    lo_m = np.searchsorted(mset, st[k], "left")
    hi_m = np.searchsorted(mset, st[k], "right")
    members = d.file_obs[m_obs[mr]].tolist()
    out: list[Issue] = []
    for i, a, z, ns, ts, tz, kk, g, ml, mh in zip(o.tolist(), heads.tolist(), ends.tolist(), n_sev.tolist(),
                                                  tot_sev.tolist(), tot_zero.tolist(), k.tolist(), grp[k].tolist(),
                                                  lo_m.tolist(), hi_m.tolist()):
        sev, zero = pos[a : a + ns].tolist(), pos[a + ns : z].tolist()
        text = []
        if sev:
            text.append(f"position{'s' if ts > 1 else ''} {_few(sev, n=ts)} written by several ranks, this "
                        f"one not the owner (rank {(sev[0] // I_) % N} owns position {sev[0]})")
        if zero:
            text.append(f"position{'s' if tz > 1 else ''} {_few(zero, n=tz)} of this rank written by no rank")
        msg = (f"across the {N} ranks, DCP-sharded group {_group_name(d, g)}: " + "; ".join(text)
               + "; each position must be written by exactly one rank, its owner")
        detail = {"group": g, "written_by_several": sev, "unwritten": zero, "obs": members[ml:mh]}
        out.append(Issue(i, "slot-partition", msg, {"row": int(tok[kk]), "recorded": int(slot[kk]),
                                                     "expected": None, "wrong_rows": ts + tz, "detail": detail}))
    return _table(d, out)


def _cap_per_obs(at, eo, kind, *cols, extra=None):
    """Blamed entries -> (their first _SLOT_CAP of each (observation, kind) in entry order, sorted by
    observation, kind, entry), keys 2 * observation + kind, and each key's count (`extra`: per entry, more
    entries it stands for)."""
    order = np.lexsort((at, kind, eo))
    at, eo, kind = at[order], eo[order], kind[order]
    cols = [x[order] for x in cols]
    key = 2 * eo + kind
    head = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    n = np.diff(np.append(head, key.size))
    keep = np.arange(key.size) - np.repeat(head, n) < _SLOT_CAP
    if extra is not None and key.size:
        n = n + np.add.reduceat(extra[order], head)
    return ([at[keep], eo[keep], kind[keep]] + [x[keep] for x in cols]), key[head], n
