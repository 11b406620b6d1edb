"""The slot checks as they were before issue 16 (whole-column, one pass over every entry): the reference the
chunked dcptool.rules.check_slots / check_slot_partition are compared against (tests/test_rules.py) and timed
against (benchmarks/bench_coverage.py --slots). Not part of the package."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dcptool.dump import Dump
from dcptool.rules import _SLOT_KIND_TEXT, _SLOT_KINDS, Issue, _few, _group_name, _kth_per_rank


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



def old_check_slots(d: Dump) -> list[Issue]:
    """Per observation: each token's slot against vLLM's ownership rule (module comment above): padded
    tokens and non-owners of a DCP-sharded position write -1; the owner, and every rank in a replicated
    group, writes a slot (unless the build writes nothing at all); where the group's block size is known, a
    slot sits at vLLM's local block offset; no two tokens of one build write the same slot."""
    c = d.config
    N, I_ = c.dcp_size, c.cp_interleave
    s = _slot_entries(d)
    if s.obs.size == 0:
        return []
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
        return []
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
    return out


def old_check_slot_partition(d: Dump) -> list[Issue]:
    """Across the N ranks of one (step, site, micro-batch, KV-cache group) recorded on every rank (the k-th
    recording of each rank makes the k-th set), each real token of a DCP-sharded group must be written by
    exactly one rank. A position written by several ranks is reported at the ranks that do not own it, one
    written by none at its owner (so the finding sits where the write went wrong). Sets whose ranks write
    nothing at all (dummy runs, capture) are not asked to."""
    from dcptool.segments import group_ids as _group_ids

    c = d.config
    N = c.dcp_size
    s = _slot_entries(d)
    if N == 1 or s.obs.size == 0:
        return []
    # one member per (observation, sharded group) run: its first entry
    first = np.full(s.run_writes.size, s.obs.size, np.int64)
    np.minimum.at(first, s.run, np.arange(s.obs.size))
    m_obs, m_grp = s.obs[first], s.grp[first]
    m_real = s.n_real[first]
    keep = s.sharded[first]
    m = np.flatnonzero(keep)
    if m.size == 0:
        return []
    o = m_obs[m]
    key = [d["obs.step"][o], d["obs.site"][o].astype(np.int64), d["obs.ubatch"][o].astype(np.int64), m_grp[m],
           m_real[m], d["obs.num_reqs"][o].astype(np.int64)]
    sets = _kth_per_rank(_group_ids(key), d["obs.rank"][o].astype(np.int64), o)
    size = np.bincount(sets)
    set_of_run = np.full(s.run_writes.size, -1, np.int64)
    set_of_run[m[size[sets] == N]] = sets[size[sets] == N]
    # entries of full sets, real tokens: count the ranks writing each token
    es = set_of_run[s.run]
    sel = np.flatnonzero((es >= 0) & s.real)
    if sel.size == 0:
        return []
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
        return []
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
        return []
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
    return out

