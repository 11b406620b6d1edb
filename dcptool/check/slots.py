"""Which rank writes each KV slot: the `slots` and `slot-partition` rules (issue 15 item 3), in one screened pass."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dcptool.check.findings import FindingTable, Issue, findings_of
from dcptool.check.ranks import kth_per_rank
from dcptool.check.scan import default_threads, in_order
from dcptool.check.slot_screen import merged, slot_screen
from dcptool.dcp.segments import group_ids, ragged
from dcptool.dcp.segments import obs_chunks as _obs_chunks
from dcptool.dump import Dump

#
# vLLM's rule (BlockTables.compute_slot_mappings, _compute_slot_mappings_kernel, 0.31-0.34; checked on
# CPU against vLLM's own kernel, tests/vllm/test_vllm_slots.py): in a DCP-sharded KV-cache group the token
# at position p is written by rank (p // I) % N only (vLLM tests it per virtual block of block_size * N
# tokens, which is the same since block_size % I == 0), at local block offset
# (p % (B*N)) // (I*N) * I + p % I of a block of B tokens; every other rank gets PAD_SLOT_ID (-1). A
# replicated group (dcp_sharded False: Mamba/GDN state, draft layers of a DCP-1 drafter; sliding window
# under DCP must be replicated, vLLM asserts) is written by every rank at offset p % B. Tokens past the
# real token count (qsl[num_reqs]) are -1 on every rank, and so is every token of a build whose slot
# mapping is all -1 (vLLM's get_dummy_slot_mappings: dummy runs and graph capture; a group whose spec
# does not use slot mappings), which these rules therefore do not ask to write.

_SLOT_KIND_TEXT = {
    "padded": "token {t} lies past the {real} real tokens (padding) but writes slot {s}; padded tokens write "
              "nothing (-1)",
    "value": "token {t} (position {p}) has slot {s}, neither a slot (>= 0) nor -1 (PAD_SLOT_ID)",
    "non-owner": "token {t} at position {p} writes slot {s} in DCP-sharded group {g}, but position {p} belongs "
                 "to rank {o} ((p // {I}) % {N}); other ranks must write -1",
    "owner-missing": "token {t} at position {p} belongs to this rank in DCP-sharded group {g} but writes nothing "
                     "(-1) while the build writes other tokens",
    "replicated-missing": "token {t} at position {p} writes nothing (-1) in replicated group {g}: every rank "
                          "writes every token of a replicated group (a slot mapping that localises a "
                          "replicated group, as in vLLM #57260)",
    "offset": "token {t} at position {p} writes slot {s}, at offset {off} of its {B}-token block; vLLM puts "
              "position {p} at local offset {want}",
    "duplicate": "token {t} at position {p} writes slot {s}, which token {t2} (position {p2}) of the same "
                 "build writes too",
}
_SLOT_KINDS = tuple(_SLOT_KIND_TEXT)


SLOT_CHUNK = 1 << 18  # slot entries per chunk (whole observations): the screen's temporaries stay in the L2 cache
# on several threads: longer numpy calls, less time holding the GIL between them (dense recording, 2 threads on
# 2 cores: 0.49 s in chunks of 256K entries, 0.33 s in chunks of 1M, against 0.55 s on one thread)
SLOT_CHUNK_THREADED = 1 << 20
_SLOT_CAP = 64  # positions kept per finding's detail


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
    obs_start = (np.cumsum(cnt) - cnt)[cnt > 0]
    chg = np.flatnonzero(grp[1:] != grp[:-1]) + 1  # (one pass; the decreasing ones are among these)
    dec = chg[grp[chg] < grp[chg - 1]]
    order = None
    if dec.size and (obs_start[np.minimum(np.searchsorted(obs_start, dec), obs_start.size - 1)] != dec).any():
        order = np.lexsort((grp, np.repeat(np.arange(cnt.size), cnt)))  # (stable: entry order within a group)
        grp = grp[order]
        chg = np.flatnonzero(grp[1:] != grp[:-1]) + 1
    return order, grp, merged(chg, obs_start)


def _group_name(d: Dump, g: int) -> str:
    kv = d.config.kv_groups
    return f"{g} ({kv[g].name})" if kv is not None and g < len(kv) else str(g)


def _want_offset(pos, bs, sharded, N: int, I_: int):
    """vLLM's local offset of each position in its block of `bs` tokens (module comment above); numpy
    arrays (int64) or Python ints."""
    vb = np.maximum(bs, 1)
    vo = pos % (vb * N)
    return np.where(sharded, vo // (I_ * N) * I_ + vo % I_, pos % vb)


def _spread(per_run, run_len: np.ndarray) -> np.ndarray:
    return np.repeat(per_run, run_len)


class _SlotMembers(NamedTuple):
    """slot-partition's members: one per (observation, DCP-sharded group) run, in (observation, group) order."""
    obs: np.ndarray
    grp: np.ndarray
    real: np.ndarray  # the observation's real token count (the run's length where not recorded)
    first: np.ndarray  # its first entry and span: the run's own where consecutive (the Recorder's layout), else
    span: np.ndarray  # its observation's entries
    length: np.ndarray
    quiet: np.ndarray  # the screen found it clean, in the Recorder's layout, its rank in range
    writes: np.ndarray


def _slot_pass(d: Dump, members: bool = True, threads: int | None = None) -> tuple[list[Issue], _SlotMembers | None]:
    """One pass over the slot entries in chunks of about SLOT_CHUNK entries (whole observations; memory
    bounded by the chunk, not the dump): check_slots' findings, and slot-partition's members (per run
    summaries) from the same reads. Each chunk is screened (slot_screen); only the observations with a
    suspect run get the exact work (_slot_findings); a chunk not in the Recorder's layout gets it whole.
    Chunks run on `threads` threads (default: the CPU scan's, scan.default_threads), in order when collected."""
    c = d.config
    N, I_ = c.dcp_size, c.cp_interleave
    offs = d["obs.slots"]
    out: list[Issue] = []
    parts = []
    if d.n == 0 or int(offs[-1]) == 0:
        return out, None
    real_tokens = _real_tokens(d)
    rank_all = d["obs.rank"]

    def chunk(lo: int, hi: int) -> tuple[list[Issue], tuple | None]:
        a, b = int(offs[lo]), int(offs[hi])
        if a == b:
            return [], None
        found: list[Issue] = []
        cnt = np.diff(offs[lo : hi + 1])
        grp0 = _slot_rows(d, "rows.slot_group", a, b)
        order, grp, start = _slot_runs(grp0, cnt)
        pos = _slot_rows(d, "rows.positions", a, b)
        slot = _slot_rows(d, "rows.slot_mapping", a, b)
        if d.bounded:
            d.release(lo, hi)
        run_len = np.diff(np.append(start, grp.size))
        cs = np.cumsum(cnt)
        run_obs = np.searchsorted(cs, start, "right")  # (into the chunk)
        r_sh, r_bs = _group_tables(d, grp[start])
        rt = real_tokens[lo + run_obs]
        r_real = np.where(rt >= 0, rt, run_len)
        r_rank = rank_all[lo + run_obs]
        if order is None:
            s = slot_screen(pos, slot, start, run_len, r_rank, r_sh, r_bs, np.minimum(r_real, run_len), N, I_)
            sus = np.unique(run_obs[s.suspect])
            quiet = s.clean & (r_rank >= 0) & (r_rank < N)
            first, span, writes = a + start, run_len, s.writes
        else:  # not the Recorder's layout: every observation gets the exact work, every set too
            sus = np.flatnonzero(cnt)
            quiet = writes = np.zeros(start.size, bool)
            first, span = offs[lo + run_obs], cnt[run_obs]
        if sus.size:
            if 2 * sus.size < cs.size:  # (else the whole chunk: clean observations give no finding there either)
                e = ragged(cs[sus] - cnt[sus], cnt[sus])[2]
                found += _slot_findings(d, lo + sus, cnt[sus], grp0[e], pos[e], slot[e], real_tokens)
            else:
                found += _slot_findings(d, lo + np.arange(cnt.size), cnt, grp0, pos, slot, real_tokens)
        part = None
        if members and N > 1:
            k = np.flatnonzero(r_sh)
            part = (lo + run_obs[k], grp[start[k]].astype(np.int64), r_real[k], first[k], span[k], run_len[k],
                    quiet[k], writes[k])
        return found, part

    workers = threads or default_threads(d.bounded)
    spans = _obs_chunks(np.diff(offs), SLOT_CHUNK if workers == 1 else SLOT_CHUNK_THREADED)
    for found, part in in_order(chunk, spans, workers):  # (chunks are independent)
        out += found
        if part is not None:
            parts.append(part)
    if not members or not parts:
        return out, None
    return out, _SlotMembers(*(np.concatenate(x) for x in zip(*parts)))


def check_slot_rules(d: Dump) -> FindingTable:
    """Both rules from one pass over the slot entries (what replay runs): slots and slot-partition."""
    found, members = _slot_pass(d, members=d.config.dcp_size > 1)
    return FindingTable.concat(d, [findings_of(d, found), findings_of(d, check_slot_partition(d, members))])


def check_slots(d: Dump) -> list[Issue]:
    """Per observation: each token's slot against vLLM's ownership rule (module comment above): padded
    tokens and non-owners of a DCP-sharded position write -1; the owner, and every rank in a replicated
    group, writes a slot (unless the build writes nothing at all); where the group's block size is known, a
    slot sits at vLLM's local block offset; no two tokens of one build write the same slot.

    One screened pass in chunks (_slot_pass); check_slot_rules shares it with slot-partition."""
    return _slot_pass(d, members=False)[0]


def _slot_findings(d: Dump, oid: np.ndarray, cnt: np.ndarray, grp: np.ndarray, pos: np.ndarray,
                   slot: np.ndarray, real_tokens: np.ndarray) -> list[Issue]:
    """check_slots' exact work on observations `oid` (their entries, `cnt` each, concatenated in order).
    Per-run facts (rank, group, real token count) are spread over the run's entries with np.repeat; the
    sharded offset only on the owners' written entries, the duplicate sort only on runs whose written slots
    do not strictly increase, the kind only on an observation's first wrong entry."""
    c = d.config
    N, I_ = c.dcp_size, c.cp_interleave
    order, grp, start = _slot_runs(grp, cnt)
    if order is not None:
        pos, slot = pos[order], slot[order]
    n = slot.size
    run_len = np.diff(np.append(start, n))
    run_obs = np.searchsorted(np.cumsum(cnt), start, "right")
    r_grp = grp[start]
    r_sh, r_bs = _group_tables(d, r_grp)
    rt = real_tokens[oid[run_obs]]
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
        mine = own == _spread(d["obs.rank"][oid[run_obs]].astype(np.int32), run_len)
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
        return []
    # per observation (its entries are [cs - cnt, cs)): the first wrong entry and how many
    cs = np.cumsum(cnt)
    f0, f1 = np.searchsorted(idx, cs - cnt), np.searchsorted(idx, cs)
    eo = np.flatnonzero(f1 > f0)
    count = (f1 - f0)[eo]
    ks = idx[f0[eo]]
    if order is not None:
        ks = inv[ks]
    rk = runid[ks]
    out = []
    for o, k, r, n_bad in zip(oid[eo].tolist(), ks.tolist(), rk.tolist(), count.tolist()):
        j = None if partner is None else int(partner[k])
        two = None if j is None or j < 0 else (j - int(start[r]), int(pos[j]))
        out.append(_slot_issue(d, o, n_bad, k - int(start[r]), int(r_grp[r]), int(r_real[r]), int(pos[k]),
                               int(slot[k]), bool(real[k]), bool(r_sh[r]), int(r_bs[r]),
                               True if mine is None else bool(mine[k]), bool(r_writes[r]), two))
    return out


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


def check_slot_partition(d: Dump, members: _SlotMembers | None = None) -> list[Issue]:
    """Across the N ranks of one (step, site, micro-batch, KV-cache group) recorded on every rank (the k-th
    recording of each rank makes the k-th set), each real token of a DCP-sharded group must be written by
    exactly one rank. A position written by several ranks is reported at the ranks that do not own it, one
    written by none at its owner (so the finding sits where the write went wrong). Sets whose ranks write
    nothing at all (dummy runs, capture) are not asked to.

    Bounded memory: the (observation, group) runs are summarised in chunks first (`members`: the summaries
    of a pass over the entries made already, by check_slot_rules; else _slot_pass), the sets formed from
    them; a set whose members the screen found clean has no finding (below), the others' entries are
    gathered about SLOT_CHUNK entries' worth of whole sets at a time (a set's members can lie far apart in
    the file); per token a bincount, no sort. A finding keeps its first _SLOT_CAP positions of each kind and
    the counts."""
    c = d.config
    N, I_ = c.dcp_size, c.cp_interleave
    offs = d["obs.slots"]
    if N == 1 or d.n == 0 or int(offs[-1]) == 0:
        return []
    m = members if members is not None else _slot_pass(d)[1]
    if m is None or m.obs.size == 0:
        return []
    m_obs, m_grp, m_real, m_first, m_span, m_len = m.obs, m.grp, m.real, m.first, m.span, m.length
    key = [d["obs.step"][m_obs], d["obs.site"][m_obs].astype(np.int64), d["obs.ubatch"][m_obs].astype(np.int64),
           m_grp, m_real, d["obs.num_reqs"][m_obs].astype(np.int64)]
    rank = d["obs.rank"].astype(np.int64)
    sets = kth_per_rank(group_ids(key), rank[m_obs], m_obs)
    full = np.bincount(sets)[sets] == N
    # the members of full sets, by set then observation: N in a row each
    mr = np.flatnonzero(full)
    mr = mr[np.lexsort((m_obs[mr], sets[mr]))].reshape(-1, N)
    # a set whose members the screen found clean (each writes exactly the real positions it owns, or nothing),
    # of one real token count and all writing or none, has each token written by exactly its owner or by
    # none of them: no finding. Only the others' entries are read again.
    nr = np.minimum(m_real, m_len)[mr]
    wr = m.writes[mr]
    quiet = m.quiet[mr].all(axis=1) & (nr.min(axis=1) == nr.max(axis=1)) & (wr.all(axis=1) | ~wr.any(axis=1))
    mr = mr[~quiet].ravel()
    mset = sets[mr]
    nset = mr.size // N
    if nset == 0:
        return []
    tokens = np.minimum(m_real, m_len)[mr].reshape(nset, N).max(axis=1)  # real tokens per set (token ids)
    found = []
    for slo, shi in _obs_chunks(m_span[mr].reshape(nset, N).sum(axis=1), SLOT_CHUNK):
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
        return []
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
    return out


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


def _few(a: np.ndarray | list[int], k: int = 6, n: int | None = None) -> str:
    """The first k values of a, and how many there are in all (n: of which `a` is the start)."""
    n = len(a) if n is None else n
    v = [int(x) for x in a[:k]]
    return ", ".join(map(str, v)) + (f", ... ({n} in all)" if n > k else "")
