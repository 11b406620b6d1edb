"""The slot rules' one pass over the slot entries: each chunk screened (slot_screen), the exact `slots` work on the
observations the screen flags, and slot-partition's per-run summaries (SlotMembers) from the same reads.

vLLM's rule (BlockTables.compute_slot_mappings, _compute_slot_mappings_kernel, 0.31-0.34; checked on CPU against
vLLM's own kernel, tests/vllm/test_vllm_slots.py): in a DCP-sharded KV-cache group the token at position p is
written by rank (p // I) % N only (vLLM tests it per virtual block of block_size * N tokens, which is the same since
block_size % I == 0), at local block offset (p % (B*N)) // (I*N) * I + p % I of a block of B tokens; every other rank
gets PAD_SLOT_ID (-1). A replicated group (dcp_sharded False: Mamba/GDN state, draft layers of a DCP-1 drafter;
sliding window under DCP must be replicated, vLLM asserts) is written by every rank at offset p % B. Tokens past the
real token count (qsl[num_reqs]) are -1 on every rank, and so is every token of a build whose slot mapping is all -1
(vLLM's get_dummy_slot_mappings: dummy runs and graph capture; a group whose spec does not use slot mappings), which
these rules therefore do not ask to write.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dcptool.check.findings import FindingTable, Written
from dcptool.check.scan import default_threads, in_order
from dcptool.check.slot_screen import merged, slot_screen
from dcptool.dcp.segments import obs_chunks, ragged
from dcptool.dump import Dump

SLOT_KIND_TEXT = {
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
SLOT_KINDS = tuple(SLOT_KIND_TEXT)

SLOT_CHUNK = 1 << 18  # slot entries per chunk (whole observations): the screen's temporaries stay in the L2 cache
# on several threads: longer numpy calls, less time holding the GIL between them (docs/performance.md)
SLOT_CHUNK_THREADED = 1 << 20


def real_tokens(d: Dump) -> np.ndarray:
    """Per observation: its real token count qsl[num_reqs] where query_start_loc was recorded, else -1 (then
    every token of a group counts as real)."""
    out = np.full(d.n, -1, np.int64)
    if d.has("obs.qsl"):
        q = d["obs.qsl"]
        k = np.flatnonzero(np.diff(q) > 0)
        out[k] = d.take("rows.query_start_loc", q[k] + d["obs.num_reqs"][k].astype(np.int64))
    return out


def group_tables(d: Dump, grp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per entry of `grp` (KV-cache groups): DCP-sharded, block size (0: unknown). Without kv_groups every
    group is sharded of unknown block size (schema lets a group index be any int32 then: no table by index)."""
    kv = d.config.kv_groups
    if kv is None:
        return np.ones(grp.size, bool), np.zeros(grp.size, np.int64)
    return d.config.group_dcp(len(kv))[grp], d.config.group_block_size(len(kv))[grp]


def group_name(d: Dump, g: int) -> str:
    kv = d.config.kv_groups
    return f"{g} ({kv[g].name})" if kv is not None and g < len(kv) else str(g)


def want_offset(pos, bs, sharded, N: int, I_: int):
    """vLLM's local offset of each position in its block of `bs` tokens (module docstring); numpy arrays (int64)
    or Python ints."""
    vb = np.maximum(bs, 1)
    vo = pos % (vb * N)
    return np.where(sharded, vo // (I_ * N) * I_ + vo % I_, pos % vb)


def _slot_rows(d: Dump, key: str, a: int, b: int) -> np.ndarray:
    """Entries [a, b) of a slot row column as int32; in a bounded dump a copy, so that dropping the
    chunk's pages really frees them."""
    v = d[key][a:b]
    return np.array(v, np.int32) if d.bounded else np.asarray(v).astype(np.int32, copy=False)


def slot_runs(grp: np.ndarray, cnt: np.ndarray) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
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


class SlotMembers(NamedTuple):
    """slot-partition's members: one per (observation, DCP-sharded group) run, in (observation, group) order."""
    obs: np.ndarray
    grp: np.ndarray
    real: np.ndarray  # the observation's real token count (the run's length where not recorded)
    first: np.ndarray  # its first entry and span: the run's own where consecutive (the Recorder's layout), else
    span: np.ndarray  # its observation's entries
    length: np.ndarray
    quiet: np.ndarray  # the screen found it clean, in the Recorder's layout, its rank in range
    writes: np.ndarray


class _Entries(NamedTuple):
    """A chunk's slot entries [a, b) of observations [lo, hi), `cnt` each, in file order."""
    lo: int
    a: int
    cnt: np.ndarray
    grp: np.ndarray
    pos: np.ndarray
    slot: np.ndarray


def slot_pass(d: Dump, members: bool = True, threads: int | None = None) -> tuple[FindingTable, SlotMembers | None]:
    """One pass over the slot entries in chunks of about SLOT_CHUNK entries (whole observations; memory
    bounded by the chunk, not the dump): check_slots' findings, and slot-partition's members (per run
    summaries) from the same reads. Each chunk is screened (slot_screen); only the observations with a
    suspect run get the exact work (slot_findings); a chunk not in the Recorder's layout gets it whole.
    Chunks run on `threads` threads (default: the CPU scan's, scan.default_threads), in order when collected."""
    offs = d["obs.slots"]
    if d.n == 0 or int(offs[-1]) == 0:
        return Written(d).table(), None
    rt = real_tokens(d)
    want_members = members and d.config.dcp_size > 1

    def chunk(lo: int, hi: int) -> tuple[FindingTable | None, tuple | None]:
        a, b = int(offs[lo]), int(offs[hi])
        if a == b:
            return None, None
        e = _Entries(lo, a, np.diff(offs[lo : hi + 1]), _slot_rows(d, "rows.slot_group", a, b),
                     _slot_rows(d, "rows.positions", a, b), _slot_rows(d, "rows.slot_mapping", a, b))
        if d.bounded:
            d.release(lo, hi)
        return _screened(d, e, rt, want_members)

    workers = threads or default_threads(d.bounded)
    spans = obs_chunks(np.diff(offs), SLOT_CHUNK if workers == 1 else SLOT_CHUNK_THREADED)
    found, parts = [], []
    for f, part in in_order(chunk, spans, workers):  # (chunks are independent)
        if f is not None:
            found.append(f)
        if part is not None:
            parts.append(part)
    table = FindingTable.concat(d, found)
    if not want_members or not parts:
        return table, None
    return table, SlotMembers(*(np.concatenate(x) for x in zip(*parts)))


def _screened(d: Dump, e: _Entries, rt: np.ndarray, members: bool) -> tuple[FindingTable, tuple | None]:
    """One chunk: the screen, the exact work on the observations it flags, the members of its sharded runs."""
    c = d.config
    N, I_ = c.dcp_size, c.cp_interleave
    cnt, lo = e.cnt, e.lo
    order, grp, start = slot_runs(e.grp, cnt)
    run_len = np.diff(np.append(start, grp.size))
    cs = np.cumsum(cnt)
    run_obs = np.searchsorted(cs, start, "right")  # (into the chunk)
    r_sh, r_bs = group_tables(d, grp[start])
    r_real = np.where(rt[lo + run_obs] >= 0, rt[lo + run_obs], run_len)
    r_rank = d["obs.rank"][lo + run_obs]
    if order is None:
        s = slot_screen(e.pos, e.slot, start, run_len, r_rank, r_sh, r_bs, np.minimum(r_real, run_len), N, I_)
        sus = np.unique(run_obs[s.suspect])
        quiet = s.clean & (r_rank >= 0) & (r_rank < N)
        first, span, writes = e.a + start, run_len, s.writes
    else:  # not the Recorder's layout: every observation gets the exact work, every set too
        sus = np.flatnonzero(cnt)
        quiet = writes = np.zeros(start.size, bool)
        first, span = d["obs.slots"][lo + run_obs], cnt[run_obs]
    found = Written(d)
    if sus.size:
        if 2 * sus.size < cs.size:  # (else the whole chunk: clean observations give no finding there either)
            at = ragged(cs[sus] - cnt[sus], cnt[sus])[2]
            slot_findings(d, found, lo + sus, cnt[sus], e.grp[at], e.pos[at], e.slot[at], rt)
        else:
            slot_findings(d, found, lo + np.arange(cnt.size), cnt, e.grp, e.pos, e.slot, rt)
    part = None
    if members:
        k = np.flatnonzero(r_sh)
        part = (lo + run_obs[k], grp[start[k]].astype(np.int64), r_real[k], first[k], span[k], run_len[k], quiet[k],
                writes[k])
    return found.table(), part


class _Runs:
    """Observations `oid`'s entries (`cnt` each, concatenated in order) as (observation, group) runs: per-run facts
    (group, DCP-sharded, block size, real token count, writes at all) and per entry whether it is a real token,
    writes, and is this rank's to write (`mine`: every rank in a replicated group, the owner in a sharded one;
    None: no sharded run)."""

    def __init__(self, d: Dump, oid: np.ndarray, cnt: np.ndarray, grp: np.ndarray, pos: np.ndarray,
                 slot: np.ndarray, rt: np.ndarray):
        c = d.config
        N, I_ = c.dcp_size, c.cp_interleave
        self.order, grp, self.start = slot_runs(grp, cnt)
        if self.order is not None:
            pos, slot = pos[self.order], slot[self.order]
        self.pos, self.slot = pos, slot
        start = self.start
        self.run_len = run_len = np.diff(np.append(start, slot.size))
        run_obs = np.searchsorted(np.cumsum(cnt), start, "right")
        self.r_grp = grp[start]
        self.r_sh, self.r_bs = group_tables(d, self.r_grp)
        r = rt[oid[run_obs]]
        self.r_real = np.where(r >= 0, r, run_len)
        nr = np.minimum(self.r_real, run_len)
        self.real = np.repeat(np.tile(np.array([True, False]), start.size), np.stack([nr, run_len - nr], 1).ravel())
        self.rw = self.real & (slot >= 0)
        self.r_writes = np.logical_or.reduceat(self.rw, start)
        self.runid = np.repeat(np.arange(start.size, dtype=np.int32), run_len)
        self.mine = None
        if self.r_sh.any():
            own = pos // I_ if I_ > 1 else pos
            own = own & (N - 1) if N & (N - 1) == 0 else own % N
            self.mine = own == np.repeat(d["obs.rank"][oid[run_obs]].astype(np.int32), run_len)
            if not self.r_sh.all():
                self.mine |= np.repeat(~self.r_sh, run_len)

    def spread(self, per_run: np.ndarray) -> np.ndarray:
        return np.repeat(per_run, self.run_len)


def _wrong_owner(u: _Runs) -> np.ndarray:
    """Entries a rank must not write or must write: padded tokens writing, values below -1, a non-owner writing, an
    owner writing nothing while its build writes other tokens."""
    slot, real = u.slot, u.real
    nil = slot == -1
    writes = u.spread(u.r_writes)
    if u.mine is None:
        return (~real & ~nil) | (slot < -1) | (real & nil & writes)
    return (~real & ~nil) | (slot < -1) | (real & (((slot >= 0) & ~u.mine) | (nil & u.mine & writes)))


def _wrong_offset(u: _Runs, N: int, I_: int) -> np.ndarray:
    """Written real entries at another block offset than vLLM's, where the group's block size is known and vLLM's
    precondition holds (block_size a multiple of the interleave)."""
    bad = np.zeros(u.slot.size, bool)
    known = (u.r_bs > 0) & (~u.r_sh | (u.r_bs % I_ == 0))
    rep = known & ~u.r_sh  # replicated: offset p % B, i.e. (slot - p) % B == 0
    if rep.any():
        B = np.unique(u.r_bs[rep])
        Be = int(B[0]) if B.size == 1 else u.spread(np.where(rep, u.r_bs, 1).astype(np.int32))
        m = (u.slot - u.pos) % Be != 0
        m &= u.rw
        m &= u.spread(rep)
        bad |= m
    shk = known & u.r_sh
    if shk.any():
        oc = np.flatnonzero(u.rw & u.mine & u.spread(shk))
        rr = u.runid[oc]
        p = u.pos[oc].astype(np.int64)
        bad[oc[u.slot[oc] % u.r_bs[rr] != want_offset(p, u.r_bs[rr], True, N, I_)]] = True
    return bad


def _duplicates(u: _Runs) -> tuple[np.ndarray, np.ndarray | None]:
    """Written real entries whose slot an earlier entry of the same run writes, and for each the entry that writes
    it first (-1 elsewhere; None: no duplicate). In entry order a run whose written slots strictly increase has
    none; the others' are sorted by one int64 key, their run then their slot (0 <= slot < 2**31), ties in entry
    order."""
    bad = np.zeros(u.slot.size, bool)
    cand = np.flatnonzero(u.rw)
    sc = u.slot[cand]
    flag = np.flatnonzero(sc[1:] <= sc[:-1])  # (and at most run boundaries)
    if flag.size == 0:
        return bad, None
    r1, r2 = u.runid[cand[flag]], u.runid[cand[flag + 1]]
    mark = np.zeros(u.start.size, bool)
    mark[r1[r1 == r2]] = True
    runs = np.flatnonzero(mark)
    if runs.size == 0:
        return bad, None
    seg, _, e = ragged(u.start[runs], u.run_len[runs])
    e = e[u.rw[e]]
    key = u.runid[e].astype(np.int64) << 31 | u.slot[e].astype(np.int64)
    o2 = np.argsort(key, kind="stable")
    same = key[o2][1:] == key[o2][:-1]
    dups = e[o2[1:][same]]
    bad[dups] = True
    partner = np.full(u.slot.size, -1, np.int64)
    partner[dups] = e[o2[:-1][same]]
    return bad, partner


def slot_findings(d: Dump, found: Written, oid: np.ndarray, cnt: np.ndarray, grp: np.ndarray, pos: np.ndarray,
                  slot: np.ndarray, rt: np.ndarray) -> None:
    """check_slots' exact work on observations `oid` (their entries, `cnt` each, concatenated in order; rt: the
    real token counts, real_tokens): one finding per observation with a wrong entry, at its first. Per-run facts
    are spread over the run's entries with np.repeat; the sharded offset only on the owners' written entries,
    the duplicate sort only on runs whose written slots do not strictly increase, the kind only on an
    observation's first wrong entry."""
    c = d.config
    u = _Runs(d, oid, cnt, grp, pos, slot, rt)
    dup, partner = _duplicates(u)
    bad = _wrong_owner(u) | _wrong_offset(u, c.dcp_size, c.cp_interleave) | dup
    if u.order is not None:  # the first wrong entry of each observation in entry order
        inv = np.empty(bad.size, np.int64)
        inv[u.order] = np.arange(bad.size)
        bad = bad[inv]
    idx = np.flatnonzero(bad)
    if idx.size == 0:
        return
    # per observation (its entries are [cs - cnt, cs)): the first wrong entry and how many
    cs = np.cumsum(cnt)
    f0, f1 = np.searchsorted(idx, cs - cnt), np.searchsorted(idx, cs)
    eo = np.flatnonzero(f1 > f0)
    ks = idx[f0[eo]]
    if u.order is not None:
        ks = inv[ks]
    for o, k, n_bad in zip(oid[eo].tolist(), ks.tolist(), (f1 - f0)[eo].tolist()):
        r = int(u.runid[k])
        j = -1 if partner is None else int(partner[k])
        first = int(u.start[r])
        _add_slot_finding(d, found, _Wrong(
            obs=o, count=n_bad, token=k - first, group=int(u.r_grp[r]), real_tokens=int(u.r_real[r]),
            position=int(u.pos[k]), slot=int(u.slot[k]), real=bool(u.real[k]), sharded=bool(u.r_sh[r]),
            block=int(u.r_bs[r]), mine=True if u.mine is None else bool(u.mine[k]), writes=bool(u.r_writes[r]),
            other=None if j < 0 else (j - first, int(u.pos[j]))))


class _Wrong(NamedTuple):
    """An observation's first wrong slot entry and what names its kind."""
    obs: int
    count: int  # the observation's wrong entries
    token: int  # the entry's token in its group
    group: int
    real_tokens: int
    position: int
    slot: int
    real: bool  # a real token (not padding)
    sharded: bool  # its group is DCP-sharded
    block: int  # its group's block size (0: unknown)
    mine: bool  # this rank's to write
    writes: bool  # its build writes some real token of the group
    other: tuple[int, int] | None  # (token, position) of the entry that writes the same slot first


def _kind(w: _Wrong, want: int, I_: int) -> str:
    sl, vb = w.slot, max(w.block, 1)
    if not w.real and sl != -1:
        return "padded"
    if sl < -1:
        return "value"
    if sl >= 0 and not w.mine:
        return "non-owner"
    if sl == -1 and w.mine and w.writes:
        return "owner-missing" if w.sharded else "replicated-missing"
    if sl >= 0 and w.block > 0 and (not w.sharded or w.block % I_ == 0) and sl % vb != want:
        return "offset"
    return "duplicate"


def _add_slot_finding(d: Dump, found: Written, w: _Wrong) -> None:
    c = d.config
    N, I_ = c.dcp_size, c.cp_interleave
    p, sl, vb = w.position, w.slot, max(w.block, 1)
    want = int(want_offset(p, w.block, w.sharded, N, I_))
    name = _kind(w, want, I_)
    owner = (p // I_) % N
    t2, p2 = w.other if name == "duplicate" else (None, None)
    text = SLOT_KIND_TEXT[name].format(t=w.token, p=p, s=sl, g=group_name(d, w.group), o=owner, I=I_, N=N,
                                       real=w.real_tokens, B=w.block, off=sl % vb, want=want, t2=t2, p2=p2)
    detail = {"kind": name, "group": w.group, "position": p, "token": w.token, "slot": sl}
    if name in ("non-owner", "owner-missing"):
        detail["owner"] = owner
    found.add(w.obs, "slots", text + (f" ({w.count} wrong entries)" if w.count > 1 else ""), row=w.token,
              recorded=sl, expected=-1 if name in ("padded", "non-owner") else None, wrong_rows=w.count, detail=detail)
