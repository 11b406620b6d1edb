"""Which rank writes each KV slot: the `slots` and `slot-partition` rules, from one screened pass over the slot
entries (slot_pass.py says vLLM's rule)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dcptool.check import slot_pass
from dcptool.check.findings import FindingTable, Written
from dcptool.check.ranks import kth_per_rank
from dcptool.check.slot_pass import SlotMembers, group_name
from dcptool.dcp.segments import group_ids, obs_chunks, ragged
from dcptool.dump import Dump

SLOT_CAP = 64  # positions kept per finding's detail


def check_slot_rules(d: Dump) -> FindingTable:
    """Both rules from one pass over the slot entries (what replay runs): slots and slot-partition."""
    found, members = slot_pass.slot_pass(d, members=d.config.dcp_size > 1)
    return FindingTable.concat(d, [found, check_slot_partition(d, members)])


def check_slots(d: Dump) -> FindingTable:
    """Per observation: each token's slot against vLLM's ownership rule (slot_pass.py): padded tokens and
    non-owners of a DCP-sharded position write -1; the owner, and every rank in a replicated group, writes a slot
    (unless the build writes nothing at all); where the group's block size is known, a slot sits at vLLM's local
    block offset; no two tokens of one build write the same slot.

    One screened pass in chunks (slot_pass.slot_pass); check_slot_rules shares it with slot-partition."""
    return slot_pass.slot_pass(d, members=False)[0]


def check_slot_partition(d: Dump, members: SlotMembers | None = None) -> FindingTable:
    """Across the N ranks of one (step, site, micro-batch, KV-cache group) recorded on every rank (the k-th
    recording of each rank makes the k-th set), each real token of a DCP-sharded group must be written by
    exactly one rank. A position written by several ranks is reported at the ranks that do not own it, one
    written by none at its owner (so the finding sits where the write went wrong). Sets whose ranks write
    nothing at all (dummy runs, capture) are not asked to.

    Bounded memory: the (observation, group) runs are summarised in chunks first (`members`: the summaries
    of a pass over the entries made already, by check_slot_rules; else slot_pass), the sets formed from
    them; a set whose members the screen found clean has no finding (below), the others' entries are
    gathered about SLOT_CHUNK entries' worth of whole sets at a time (a set's members can lie far apart in
    the file); per token a bincount, no sort. A finding keeps its first SLOT_CAP positions of each kind and
    the counts."""
    found = Written(d)
    offs = d["obs.slots"]
    if d.config.dcp_size == 1 or d.n == 0 or int(offs[-1]) == 0:
        return found.table()
    m = members if members is not None else slot_pass.slot_pass(d)[1]
    if m is None or m.obs.size == 0:
        return found.table()
    s = _Sets(d, m)
    if s.n == 0:
        return found.table()
    blamed = []
    for slo, shi in obs_chunks(m.span[s.mr].reshape(s.n, -1).sum(axis=1), slot_pass.SLOT_CHUNK):
        got = _blamed(d, s, slo, shi)
        if got is not None:
            blamed.append(got)
    if blamed:
        _add_partition_findings(d, found, s, blamed)
    return found.table()


class _Sets:
    """The full rank sets (N members: the k-th run of each rank for one (step, site, micro-batch, group, real
    token count, num_reqs)) that can have a finding, by set then observation: `mr` (positions in the members, N in
    a row per set), `mset` (their set ids), `tokens` (real tokens per set). A set whose members the screen found
    clean (each writes exactly the real positions it owns, or nothing), of one real token count and all writing
    or none, has each token written by exactly its owner or by none of them: it is left out, its entries unread."""

    def __init__(self, d: Dump, m: SlotMembers):
        self.m, self.N = m, d.config.dcp_size
        N = self.N
        key = [d["obs.step"][m.obs], d["obs.site"][m.obs].astype(np.int64), d["obs.ubatch"][m.obs].astype(np.int64),
               m.grp, m.real, d["obs.num_reqs"][m.obs].astype(np.int64)]
        self.rank = d["obs.rank"].astype(np.int64)
        sets = kth_per_rank(group_ids(key), self.rank[m.obs], m.obs)
        mr = np.flatnonzero(np.bincount(sets)[sets] == N)
        mr = mr[np.lexsort((m.obs[mr], sets[mr]))].reshape(-1, N)
        nr = np.minimum(m.real, m.length)[mr]
        wr = m.writes[mr]
        quiet = m.quiet[mr].all(axis=1) & (nr.min(axis=1) == nr.max(axis=1)) & (wr.all(axis=1) | ~wr.any(axis=1))
        self.mr = mr[~quiet].ravel()
        self.mset = sets[self.mr]
        self.n = self.mr.size // N
        self.tokens = np.minimum(m.real, m.length)[self.mr].reshape(self.n, N).max(axis=1) if self.n else self.mr


class _Blamed(NamedTuple):
    """The blamed entries of a batch of sets (their first SLOT_CAP of each (observation, kind)), sorted by
    observation, kind (0: written by several ranks, 1: by none), entry; `keys` (2 * observation + kind) and
    `counts` count every blamed entry."""
    at: np.ndarray
    obs: np.ndarray
    kind: np.ndarray
    pos: np.ndarray
    slot: np.ndarray
    tok: np.ndarray
    grp: np.ndarray
    set: np.ndarray
    keys: np.ndarray
    counts: np.ndarray


def _set_entries(d: Dump, m: SlotMembers, mm: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The real tokens' entries of members mm: (member segment, token, entry)."""
    if (m.span[mm] != m.length[mm]).any():  # a run interleaved with other groups (not the Recorder's layout)
        seg, _, at = ragged(m.first[mm], m.span[mm])
        k = d.take("rows.slot_group", at) == m.grp[mm][seg]
        seg, at = seg[k], at[k]
        tok = np.arange(at.size) - np.searchsorted(seg, np.arange(mm.size))[seg]
        k = np.flatnonzero(tok < m.real[mm][seg])  # real tokens only
        return seg[k], tok[k], at[k]
    return ragged(m.first[mm], np.minimum(m.real[mm], m.length[mm]))  # (the run's first real entries)


def _blamed(d: Dump, s: _Sets, slo: int, shi: int) -> _Blamed | None:
    """Sets [slo, shi): per token how many ranks write it and whether every rank has it at one position; a token
    of a set that writes, not written by exactly one rank, is blamed at the ranks that do not own it (several
    writers; every writer where none owns it) or at its owner (no writer)."""
    m, N, I_ = s.m, s.N, d.config.cp_interleave
    mm = s.mr[slo * N : shi * N]
    seg, tok, at = _set_entries(d, m, mm)
    pos = d.take("rows.positions", at).astype(np.int32, copy=False)
    slot = d.take("rows.slot_mapping", at).astype(np.int32, copy=False)
    if d.bounded:
        d.release(0, d.n)
    if at.size == 0:
        return None
    ls = seg // N
    ntok = s.tokens[slo:shi]
    tid = (np.cumsum(ntok) - ntok)[ls] + tok
    nt = int(ntok.sum())
    wr = slot >= 0
    writers = np.bincount(tid[wr], minlength=nt)
    ref = np.zeros(nt, np.int32)
    ref[tid] = pos
    moved = np.bincount(tid[pos != ref[tid]], minlength=nt) > 0
    set_writes = np.bincount(ls[wr], minlength=shi - slo) > 0
    b = np.flatnonzero(((writers != 1) & ~moved & np.repeat(set_writes, ntok))[tid])
    if b.size == 0:
        return None
    own = s.rank[m.obs[mm][seg[b]]] == (pos[b] // I_) % N
    w, bt, nw = wr[b], tid[b], writers[tid[b]]
    owner_writes = np.zeros(nt, bool)
    owner_writes[bt[w & own]] = True
    e = b[((nw >= 2) & w & (~own | ~owner_writes[bt])) | ((nw == 0) & own)]
    e, extra = _first_of_each(seg, slot, e, mm.size)
    return _capped(at[e], m.obs[mm][seg[e]], (slot[e] < 0).astype(np.int8), pos[e], slot[e], tok[e].astype(np.int32),
                   m.grp[mm][seg[e]].astype(np.int32), s.mset[slo * N + seg[e]], extra=extra)


def _first_of_each(seg: np.ndarray, slot: np.ndarray, e: np.ndarray, members: int) -> tuple[np.ndarray, np.ndarray |
                                                                                             None]:
    """Where many are blamed: each member's first SLOT_CAP entries of each kind, and per entry kept how many
    dropped ones it stands for (None: none dropped)."""
    if e.size <= 2 * SLOT_CAP * members:
        return e, None
    mk = seg[e] * 2 + (slot[e] < 0)
    o = np.argsort(mk, kind="stable")  # (mostly in order already: e is by member, then entry)
    e, mk = e[o], mk[o]
    head = np.flatnonzero(np.r_[True, mk[1:] != mk[:-1]])
    n = np.diff(np.append(head, mk.size))
    kept = np.arange(mk.size) - np.repeat(head, n) < SLOT_CAP
    extra = np.zeros(e.size, np.int64)  # the members' dropped entries, counted at the first one kept
    extra[head] = n - np.minimum(n, SLOT_CAP)
    return e[kept], extra[kept]


def _capped(at, eo, kind, pos, slot, tok, grp, sset, extra=None) -> _Blamed:
    """Blamed entries -> their first SLOT_CAP of each (observation, kind) in entry order, sorted by observation,
    kind, entry, with keys 2 * observation + kind and each key's count (`extra`: per entry, more entries it
    stands for)."""
    order = np.lexsort((at, kind, eo))
    at, eo, kind = at[order], eo[order], kind[order]
    key = 2 * eo + kind
    head = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    n = np.diff(np.append(head, key.size))
    keep = np.arange(key.size) - np.repeat(head, n) < SLOT_CAP
    if extra is not None and key.size:
        n = n + np.add.reduceat(extra[order], head)
    cols = [x[order][keep] for x in (pos, slot, tok, grp, sset)]
    return _Blamed(at[keep], eo[keep], kind[keep], *cols, key[head], n)


def _add_partition_findings(d: Dump, found: Written, s: _Sets, blamed: list[_Blamed]) -> None:
    """One finding per observation with blamed entries: its positions of each kind (the first SLOT_CAP) and how
    many in all, at its first blamed entry."""
    N, I_ = s.N, d.config.cp_interleave
    parts = [np.concatenate(x) for x in zip(*blamed)]
    f = _capped(*parts[:8])
    ck, inv = np.unique(parts[8], return_inverse=True)
    total = np.bincount(inv.ravel(), weights=parts[9]).astype(np.int64)  # per (observation, kind)
    eo, kind, pos = f.obs, f.kind, f.pos
    heads = np.flatnonzero(np.r_[True, eo[1:] != eo[:-1]])
    ends = np.append(heads[1:], eo.size)
    n_sev = np.bincount(np.repeat(np.arange(heads.size), ends - heads), weights=kind == 0,
                        minlength=heads.size).astype(np.int64)  # kept positions of each kind, per finding
    o = eo[heads]
    tot_sev = np.where(n_sev > 0, total[np.minimum(np.searchsorted(ck, 2 * o), ck.size - 1)], 0)
    tot_zero = np.where(ends - heads > n_sev, total[np.minimum(np.searchsorted(ck, 2 * o + 1), ck.size - 1)], 0)
    # the observation's first blamed entry: the first of either kind (each kind's entries are in entry order)
    z0 = np.minimum(heads + n_sev, eo.size - 1)
    k = np.where((n_sev == 0) | ((ends - heads > n_sev) & (f.at[z0] < f.at[heads])), z0, heads)
    lo_m, hi_m = np.searchsorted(s.mset, f.set[k], "left"), np.searchsorted(s.mset, f.set[k], "right")
    members = d.file_obs[s.m.obs[s.mr]].tolist()
    for i, a, z, ns, ts, tz, kk, g, ml, mh in zip(o.tolist(), heads.tolist(), ends.tolist(), n_sev.tolist(),
                                                  tot_sev.tolist(), tot_zero.tolist(), k.tolist(), f.grp[k].tolist(),
                                                  lo_m.tolist(), hi_m.tolist()):
        sev, zero = pos[a : a + ns].tolist(), pos[a + ns : z].tolist()
        text = []
        if sev:
            text.append(f"position{'s' if ts > 1 else ''} {few(sev, n=ts)} written by several ranks, this "
                        f"one not the owner (rank {(sev[0] // I_) % N} owns position {sev[0]})")
        if zero:
            text.append(f"position{'s' if tz > 1 else ''} {few(zero, n=tz)} of this rank written by no rank")
        msg = (f"across the {N} ranks, DCP-sharded group {group_name(d, g)}: " + "; ".join(text)
               + "; each position must be written by exactly one rank, its owner")
        found.add(i, "slot-partition", msg, row=int(f.tok[kk]), recorded=int(f.slot[kk]), wrong_rows=ts + tz,
                  detail={"group": g, "written_by_several": sev, "unwritten": zero, "obs": members[ml:mh]})


def few(a: np.ndarray | list[int], k: int = 6, n: int | None = None) -> str:
    """The first k values of a, and how many there are in all (n: of which `a` is the start)."""
    n = len(a) if n is None else n
    v = [int(x) for x in a[:k]]
    return ", ".join(map(str, v)) + (f", ... ({n} in all)" if n > k else "")
