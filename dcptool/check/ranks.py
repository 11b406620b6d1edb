"""Rules across the DCP ranks of one batch: their local lengths add up (rank-sum), they agree (rank-agree), they plan
the same chunked context (ctx-agree), sparse attention selects the same top-k sets (topk-agree)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dcptool.check.findings import FindingTable, Written
from dcptool.check.scan import rows_differ
from dcptool.dcp.chunks import gathers
from dcptool.dcp.segments import BULK_ROWS, group_ids, join, mix, obs_chunks, ragged, seg_sums
from dcptool.dump import Dump


def kth_per_rank(batch: np.ndarray, rank: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Set ids for members of cross-rank groups: in each batch the k-th member of every rank (in `idx` order,
    i.e. observation order) joins the k-th set."""
    order = np.lexsort((idx, rank, batch))
    new = np.ones(idx.size, bool)
    new[1:] = (batch[order][1:] != batch[order][:-1]) | (rank[order][1:] != rank[order][:-1])
    starts = np.flatnonzero(new)
    occ = np.empty(idx.size, np.int64)
    occ[order] = np.arange(idx.size) - np.repeat(starts, np.diff(np.append(starts, idx.size)))
    return group_ids([batch, occ])


def check_rank_sum(d: Dump, wrong: np.ndarray) -> FindingTable:
    """The same batch recorded with a view on all N ranks must add up to seq_len on each real row.

    The formula always adds up, so only batches with a wrong view on some rank can fail: groups
    are formed around the observations in `wrong` only. Members of a batch share (step, site,
    ubatch, num_reqs, real seq_lens); the k-th recording of each rank makes the k-th set, and the
    finding goes to the observation that completes it. Vectorised (sorts and joins on the key
    columns and a hash of the real seq_lens, confirmed exactly): no loop over members.
    """
    N = d.config.dcp_size
    found = Written(d)
    if N == 1 or wrong.size == 0:
        return found.table()
    for part, has in _step_blocks(d, np.unique(np.asarray(wrong, np.int64))):
        _rank_sum(d, part, has, found)
    return found.table()


def _step_blocks(d: Dump, wrong: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """`wrong`, and the observations with a view in its steps, in blocks of whole steps of about BULK_ROWS rows
    each (rank-sum holds tens of bytes a row of the batches it adds up; a recording wrong everywhere has every
    batch to add up)."""
    step = d["obs.step"]
    steps, at = np.unique(step[wrong], return_inverse=True)
    has = np.flatnonzero(d["obs.has_dcp"] == 1)
    has = has[np.isin(step[has], steps)]
    hat = np.searchsorted(steps, step[has])
    rows = np.bincount(hat, weights=d["obs.num_reqs"][has], minlength=steps.size).astype(np.int64)
    edges = [a for a, _ in obs_chunks(rows, BULK_ROWS)][1:]  # (the first step of each block after the first)
    parts = []
    for x, k in ((wrong, at), (has, hat)):
        o = np.argsort(k, kind="stable")
        parts.append([np.sort(p) for p in np.split(x[o], np.searchsorted(k[o], edges))])
    return list(zip(*parts))


def _rank_sum(d: Dump, wrong: np.ndarray, has: np.ndarray, found: Written) -> None:
    """check_rank_sum for `wrong` (unique; `has`: the observations with a view in its steps), its findings added to
    `found`."""
    N = d.config.dcp_size
    nr = d["obs.num_reqs"].astype(np.int64)
    key = [d["obs.step"], d["obs.site"].astype(np.int64), d["obs.ubatch"].astype(np.int64), nr]
    ci, qi = join([k[has] for k in key], [k[wrong] for k in key])
    m = has[np.isin(ci, qi)]  # recorded with a view, in a (step, site, ubatch, num_reqs) of a wrong one
    seg, j, at = ragged(d["obs.rows"][m], nr[m])
    seq = d.take("rows.seq_lens", at)  # (its dtype: mix widens a block at a time)
    cols = [k[m] for k in key]
    row0 = np.cumsum(nr[m]) - nr[m]

    def batches(hashes: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        # the hashes group equal seq_lens; each member is confirmed against its batch's first member exactly
        batch = group_ids(cols + [x.view(np.int64) for x in hashes])
        first = np.full(int(batch.max(initial=-1)) + 1, np.iinfo(np.int64).max)
        np.minimum.at(first, batch, np.arange(m.size))
        ref = first[batch][seg]
        return batch, np.bincount(seg, weights=seq != seq[row0[ref] + j], minlength=m.size) == 0

    h = [seg_sums(mix(seq, j, 0), nr[m])]
    batch, same = batches(h)
    if not same.all():  # two seq_lens under one hash (never seen): both hashes, as the batches always were
        batch, same = batches(h + [seg_sums(mix(seq, j, 1), nr[m])])
    m, batch = m[same], batch[same]
    sets = kth_per_rank(batch, d["obs.rank"][m].astype(np.int64), m)  # the k-th recording of each rank of a batch
    size = np.bincount(sets, minlength=int(sets.max(initial=-1)) + 1)
    hit = np.zeros(size.size, bool)
    hit[sets[np.isin(m, wrong)]] = True
    full = np.flatnonzero(hit & (size >= N))  # ranks are < N (the reader checks), so size N is every rank
    if full.size == 0:
        return
    sel = np.isin(sets, full)
    mm, ss = m[sel], sets[sel]
    order = np.lexsort((mm, ss))
    mm, ss = mm[order], ss[order]
    bounds = np.flatnonzero(np.r_[True, ss[1:] != ss[:-1]])
    counts = np.diff(np.append(bounds, mm.size))
    dl = np.diff(d["obs.dcp_rows"])[mm]
    nrs = nr[mm]
    n = np.minimum(np.minimum.reduceat(dl, bounds), nrs[bounds])  # rows every view of the set holds
    g = np.repeat(np.arange(bounds.size), counts)
    sg, _, at = ragged(d["obs.dcp_rows"][mm], n[g])
    total = np.zeros(int(n.sum()), np.int64)
    base = np.repeat(np.cumsum(n) - n, n)  # each set's first row in total
    row_of = at + ((np.cumsum(n) - n)[g] - d["obs.dcp_rows"][mm])[sg]  # (one gather per row, not two)
    # (bincount's float64 sums are exact here: int32 values, fewer than 2**21 ranks)
    total += np.bincount(row_of, weights=d.take("rows.dcp_local_seq_lens", at), minlength=total.size).astype(np.int64)
    lead = mm[bounds]
    setrow = np.repeat(np.arange(bounds.size), n)
    want = d.take("rows.seq_lens", d["obs.rows"][lead][setrow] + (np.arange(total.size) - base)).astype(np.int64)
    bad = total != want
    first_row = np.cumsum(n) - n
    for t in np.unique(setrow[bad]):
        rows = np.flatnonzero(bad[first_row[t] : first_row[t] + n[t]])
        group = mm[bounds[t] : bounds[t] + counts[t]]
        i, jr = int(group[-1]), int(rows[0])
        k = int(first_row[t]) + jr
        msg = (f"across the {N} ranks, local lengths of row {jr} add up to {int(total[k])}, "
               f"not its seq_len {int(want[k])}")
        found.add(i, "rank-sum", msg, row=jr, recorded=int(total[k]), expected=int(want[k]), wrong_rows=int(rows.size),
                  detail={"obs": sorted(int(d.file_obs[x]) for x in group)})


def rank_sets(d: Dump, idx: np.ndarray) -> np.ndarray:
    """For observations idx: the id of its set over ranks, the k-th recording of each rank in one
    (step, site, micro-batch) making set k (how every rank records the same sequence of builds)."""
    step, site = d["obs.step"][idx], d["obs.site"][idx].astype(np.int64)
    ub, rank = d["obs.ubatch"][idx].astype(np.int64), d["obs.rank"][idx].astype(np.int64)
    return kth_per_rank(group_ids([step, site, ub]), rank, idx)


_AGREE = ("num_reqs", "num_reqs_padded", "seq_lens", "query_start_loc", "num_tokens_padded", "graph")


class RankSets(NamedTuple):
    """check_rank_agree's sets: the k-th recording of each rank in one (step, site, micro-batch) is set k."""

    sets: np.ndarray  # [n] int64 set id of each observation
    prev: np.ndarray  # [n] int64 the observation before it in its set (observation order), -1 for a set's first


def rank_pairs(d: Dump) -> RankSets:
    """The rank sets and, per observation, the member before it. A set agrees iff every member equals the one
    before it, so rank-agree compares these pairs; the scan compares their seq_lens rows while it reads them
    (scan(pairs=prev))."""
    idx = np.arange(d.n, dtype=np.int64)
    sets = rank_sets(d, idx) if d.n else idx
    prev = np.full(d.n, -1, np.int64)
    order = np.lexsort((idx, sets))
    same = sets[order][1:] == sets[order][:-1]
    prev[order[1:][same]] = order[:-1][same]
    return RankSets(sets, prev)


_SCALARS = {"num_reqs": "obs.num_reqs", "num_reqs_padded": "obs.num_reqs_padded",
            "num_tokens_padded": "obs.num_tokens_padded", "graph": "obs.graph"}
_RAGGED = {"seq_lens": ("obs.rows", "rows.seq_lens"), "query_start_loc": ("obs.qsl", "rows.query_start_loc")}


def check_rank_agree(d: Dump, pairs: RankSets | None = None,
                     seq_differ: np.ndarray | None = None) -> FindingTable:
    """What every DCP rank of one batch must share: num_reqs, num_reqs_padded, seq_lens, query_start_loc,
    num_tokens_padded and the graph mode (the last three where recorded). Sets are the k-th recording of
    each rank in one (step, site, micro-batch); the values most of its ranks share are the reference (a tie,
    the ranks split evenly: the lowest rank's). One finding per set, at the first observation of a differing
    rank, naming every differing rank and its first differing field; its message says which of a majority, a
    largest group short of one, or an even split the reference stands for.

    Vectorised in two passes: every observation is compared exactly with the member before it in its set
    (rank_pairs; a clean dump ends here); only the members of sets that differ are hashed and grouped to
    find the majority. Python runs per finding only. `pairs` and `seq_differ` (the observations whose
    seq_lens rows differ from their pair's) come from the scan, which compares the rows as it reads them
    (replay); without them the rows are read here."""
    found = Written(d)
    if d.config.dcp_size == 1 or d.n == 0:
        return found.table()
    sets, prev = pairs if pairs is not None else rank_pairs(d)
    names = [f for f in _AGREE if (f in _SCALARS and d.has(_SCALARS[f])) or (f in _RAGGED and d.has(_RAGGED[f][0]))]
    bad = _disagreeing_sets(d, sets, prev, names, seq_differ)
    if bad.size == 0:
        return found.table()
    m = np.flatnonzero(np.isin(sets, bad))  # members of the sets that disagree
    v = _Votes(d, m, sets[m], names)
    for sset in np.unique(v.sm[v.odd]).tolist():
        members = v.by_set[np.searchsorted(v.sm_sorted, sset, "left"):np.searchsorted(v.sm_sorted, sset, "right")]
        _add_disagreement(found, d, v, members, int(v.ref[sset]))
    return found.table()


def _disagreeing_sets(d: Dump, sets: np.ndarray, prev: np.ndarray, names: list[str],
                      seq_differ: np.ndarray | None) -> np.ndarray:
    """The sets (of two members or more) in which some member differs from the one before it in a field of
    `names` (seq_differ: the scan's answer for seq_lens, else the rows are compared here)."""
    idx = np.arange(d.n, dtype=np.int64)
    has = prev >= 0
    other = np.where(has, prev, idx)
    differ = np.zeros(d.n, bool)
    for f in names:
        if f in _SCALARS:
            differ |= d[_SCALARS[f]] != d[_SCALARS[f]][other]
        elif f == "seq_lens" and seq_differ is not None:
            differ[seq_differ] = True
        else:
            p = np.flatnonzero(has)
            differ[p[rows_differ(d, *_RAGGED[f], p, other[p])]] = True
    size = np.bincount(sets)
    return np.unique(sets[differ & (size[sets] >= 2)])


class _Votes:
    """The members `m` of disagreeing sets grouped by their values: each set's reference (most members, then the
    lowest rank, then the earliest), which members differ from it and each one's first differing field."""

    def __init__(self, d: Dump, m: np.ndarray, sm: np.ndarray, names: list[str]):
        cols: dict[str, list[np.ndarray]] = {}
        for f in names:
            if f in _SCALARS:
                cols[f] = [d[_SCALARS[f]][m].astype(np.int64)]
            else:
                offs_key, rows_key = _RAGGED[f]
                cols[f] = [np.diff(d[offs_key])[m], _row_hashes(d, offs_key, rows_key, m)]
        self.m, self.sm, self.names = m, sm, names
        self.tup = group_ids([sm] + [c for f in names for c in cols[f]])  # one id per (set, values)
        self.count = np.bincount(self.tup)
        self.rank = d["obs.rank"][m].astype(np.int64)
        self.ref = _set_refs(sm, self.tup, self.count, self.rank, m)  # a position in m
        self.odd = self.tup != self.tup[self.ref[sm]]
        refk = self.ref[sm]  # each member's first field that differs from its set's reference (names order)
        diff = np.stack([np.any([c != c[refk] for c in cols[f]], axis=0) for f in names])  # [fields, members]
        self.first_f = np.argmax(diff, axis=0)
        self.by_set = np.argsort(sm, kind="stable")  # members grouped by set (positions in m stay in order)
        self.sm_sorted = sm[self.by_set]


def _set_refs(sets: np.ndarray, tup: np.ndarray, count: np.ndarray, rank: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Each set's reference member (a position in the members' arrays, indexed by set): the one whose values most
    members share, then the lowest rank, then the earliest observation (`ids`). rank-agree, ctx-agree and
    topk-agree name their references by this one rule."""
    order = np.lexsort((ids, rank, -count[tup], sets))
    lead = np.ones(sets.size, bool)
    lead[1:] = sets[order][1:] != sets[order][:-1]
    ref = np.empty(int(sets.max()) + 1, np.int64)
    ref[sets[order][lead]] = order[lead]
    return ref


def _add_disagreement(found: Written, d: Dump, v: _Votes, members: np.ndarray, r0: int) -> None:
    """The finding of one set (its members, positions in v.m; r0 its reference's), at its first differing member."""
    m, rank = v.m, v.rank
    odd = [int(k) for k in members[v.odd[members]]]
    parts, fields = [], {}
    for k in odd:
        f = v.names[int(v.first_f[k])]
        fields[int(rank[k])] = f
        parts.append(f"rank {int(rank[k])} {f} {_agree_value(d, int(m[k]), f)}")
    k = odd[0]
    f = fields[int(rank[k])]
    i0 = int(m[r0])
    ref_text = f"rank {int(rank[r0])} (obs {d.ref(i0)})"
    msg = (f"ranks disagree on what every rank of this batch must share: {'; '.join(parts)}; "
           f"{_reference_text(ref_text, v.count[v.tup[members]], int(v.count[v.tup[r0]]))} {f} "
           f"{_agree_value(d, i0, f)} (ranks {', '.join(str(int(rank[x])) for x in odd)} differ)")
    found.add(int(m[k]), "rank-agree", msg, detail={
        "field": f, "ranks": [int(rank[x]) for x in odd], "fields": {str(r): name for r, name in fields.items()},
        "obs": [int(d.file_obs[m[x]]) for x in members], "reference_obs": int(d.file_obs[i0])})


def _reference_text(ref: str, sizes: np.ndarray, top: int) -> str:
    """How a set's reference (`ref`: its rank and observation) is named: with the majority where its values are
    more than half the set's; the largest group where they are fewer; an even split where another group is
    as large (then it is the reference only as the lowest rank). `sizes`: per member, how many members share
    its values; `top`: the reference's count."""
    if np.count_nonzero(sizes == top) > top:  # (another group of `top` members besides the reference's)
        return f"the ranks split evenly, so the lowest rank's values are the reference: {ref} has"
    if 2 * top > sizes.size:
        return f"{ref} and the majority have"
    return f"{ref} and the largest group ({top} of {sizes.size} ranks) have"


def _row_hashes(d: Dump, offs_key: str, rows_key: str, idx: np.ndarray, step: int = 1 << 16,
                stride: int = 1) -> np.ndarray:
    """A 64-bit hash of the rows of each observation in idx (value and position; a 0 hashes like any
    value), every `stride`-th row from its first, in chunks of about `step` rows so a huge dump is hashed in
    bounded memory."""
    offs = d[offs_key]
    lens = np.diff(offs)[idx] // stride
    out = np.zeros(idx.size, np.int64)
    for lo, hi in obs_chunks(lens, step):
        cnt = lens[lo:hi]
        _, j, at = ragged(offs[idx[lo:hi]], cnt)
        v = d.take(rows_key, at + (stride - 1) * j).astype(np.int64) + 1  # (mix hashes 0 as 0: shift so 0 counts)
        out[lo:hi] = seg_sums(mix(v, j, 0), cnt).view(np.int64)
        if d.bounded:
            d.release(0, d.n)
    return out


def _agree_value(d: Dump, i: int, field: str) -> str:
    if field == "seq_lens":
        return str(d.seq_lens_of(i)[:8].tolist()) + ("..." if d.seq_lens_of(i).size > 8 else "")
    if field == "query_start_loc":
        q = d.qsl_of(i)
        return str(q[:9].tolist()) + ("..." if q.size > 9 else "")
    return str(int(d[_SCALARS[field]][i]))


class Split(NamedTuple):
    """One set whose members recorded different values of a field (_split_sets): its members (observations, in
    observation order), the reference among them, the ones that differ from it, and the reference text."""

    members: np.ndarray
    ref: int
    odd: list[int]
    ref_text: str


def _split_sets(d: Dump, sets: np.ndarray, idx: np.ndarray, keys: list[np.ndarray]) -> list[Split]:
    """The sets (ids `sets[idx]`) whose members `idx` disagree on `keys` (one value per member each: a length, a
    hash). Each set's reference: the values most members share, then the lowest rank's, then the earliest member's
    (as rank-agree's); only the members of disagreeing sets are grouped further. Python runs per split set."""
    if idx.size < 2:
        return []
    s = sets[idx]
    tup = group_ids([s, *keys])
    first = np.full(int(s.max()) + 1, -1, np.int64)
    first[s[::-1]] = tup[::-1]
    bad = np.unique(s[tup != first[s]])
    if bad.size == 0:
        return []
    m = np.isin(s, bad)
    idx, s, tup = idx[m], s[m], tup[m]
    count = np.bincount(tup)
    rank = d["obs.rank"][idx].astype(np.int64)
    ref = _set_refs(s, tup, count, rank, idx)
    out = []
    by_set = np.argsort(s, kind="stable")
    bounds = np.flatnonzero(np.r_[True, s[by_set][1:] != s[by_set][:-1], True])
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        pos = by_set[a:b]
        r0 = int(ref[s[pos[0]]])
        odd = [int(idx[k]) for k in pos if tup[k] != tup[r0]]
        text = _reference_text(f"rank {int(rank[r0])} (obs {d.ref(int(idx[r0]))})", count[tup[pos]],
                               int(count[tup[r0]]))
        out.append(Split(idx[pos], int(idx[r0]), odd, text))
    return out


def check_ctx_agree(d: Dump, pairs: RankSets | None = None) -> FindingTable:
    """The ranks of one batch (rank-agree's sets) must plan the same chunked prefill context: each chunk is one DCP
    KV gather every rank of the DCP group calls, so ranks with other chunks (or none: chunked_context None) call
    other collectives than their peers (a timeout, then a CUDA error). Compared: the whole recorded schedule (the
    members that recorded one); one finding per set, at its first member that differs from the reference, naming
    every differing rank and the gathers it calls."""
    found = Written(d)
    N = d.config.dcp_size
    if N == 1 or d.n == 0:
        return found.table()
    sets = (pairs if pairs is not None else rank_pairs(d)).sets
    off = d["obs.ctx"]
    lens = np.diff(off)
    idx = np.flatnonzero(lens > 0)
    for sp in _split_sets(d, sets, idx, [lens[idx], _row_hashes(d, "obs.ctx", "rows.ctx_chunks", idx)]):
        plan = {int(i): gathers(d["rows.ctx_chunks"][off[i]:off[i + 1]], N, d.config.cp_interleave)
                for i in (*sp.odd, sp.ref)}
        rank = d["obs.rank"]
        parts = [f"rank {int(rank[i])} {_gather_text(plan[i])}" for i in sp.odd]
        i0 = sp.odd[0]
        msg = (f"ranks disagree on the chunked-context schedule, so they call different DCP KV gathers (each rank "
               f"waits in a collective the others never join): {'; '.join(parts)}; {sp.ref_text} a schedule that "
               f"{_gather_text(plan[sp.ref])} (ranks {', '.join(str(int(rank[i])) for i in sp.odd)} differ)")
        found.add(i0, "ctx-agree", msg, detail={
            "ranks": [int(rank[i]) for i in sp.odd], "gathers": {str(int(rank[i])): plan[i] for i in sp.odd},
            "reference_gathers": plan[sp.ref], "obs": [int(d.file_obs[x]) for x in sp.members],
            "reference_obs": int(d.file_obs[sp.ref])})
    return found.table()


def _gather_text(g: list[int]) -> str:
    if not g:
        return "calls no DCP KV gather (no chunked context)"
    rows = ", ".join(map(str, g[:6])) + (", ..." if len(g) > 6 else "")
    return f"calls {len(g)} DCP KV gather{'s' if len(g) > 1 else ''} of [{rows}] local rows"


def check_topk_agree(d: Dump, pairs: RankSets | None = None) -> FindingTable:
    """The ranks of one batch (rank-agree's sets) must select the same top-k set for every query token of a sparse
    MLA layer: each attends to the entries of that set it owns, so the partition between ranks is exact only when
    the sets are equal (a tie at the k-th score broken another way on one rank gives it another set: some entries
    attended twice, others never). Compared: the recorded tokens' set fingerprints (rows.sparse_topk); one finding
    per set, at its first member that differs from the reference, naming every differing rank and its first
    differing token."""
    found = Written(d)
    if d.config.dcp_size == 1 or d.n == 0:
        return found.table()
    sets = (pairs if pairs is not None else rank_pairs(d)).sets
    off = d["obs.topk"]
    lens = np.diff(off)
    idx = np.flatnonzero(lens >= 3)
    rank = d["obs.rank"]
    # compared: the fingerprints, every third value (the owned counts and states after them differ between ranks)
    fps = _row_hashes(d, "obs.topk", "rows.sparse_topk", idx, stride=3)
    for sp in _split_sets(d, sets, idx, [lens[idx], fps]):
        ref = d["rows.sparse_topk"][off[sp.ref]:off[sp.ref + 1]][::3]
        parts, first = [], {}
        for i in sp.odd:
            fp = d["rows.sparse_topk"][off[i]:off[i + 1]][::3]
            n = min(fp.size, ref.size)
            diff = np.flatnonzero(fp[:n] != ref[:n])
            t = int(diff[0]) if diff.size else n
            first[i] = t
            parts.append(f"rank {int(rank[i])} from query token {t} ({int(diff.size) + abs(fp.size - ref.size)} of "
                         f"{max(fp.size, ref.size)} tokens differ)")
        i0 = sp.odd[0]
        msg = (f"ranks disagree on sparse attention's top-k sets, so their shares of each set do not partition it "
               f"(entries attended on two ranks or on none: a tie at the k-th score broken differently per rank): "
               f"{'; '.join(parts)}; {sp.ref_text} the other sets (ranks "
               f"{', '.join(str(int(rank[i])) for i in sp.odd)} differ)")
        found.add(i0, "topk-agree", msg, detail={
            "ranks": [int(rank[i]) for i in sp.odd], "tokens": {str(int(rank[i])): first[i] for i in sp.odd},
            "obs": [int(d.file_obs[x]) for x in sp.members], "reference_obs": int(d.file_obs[sp.ref])})
    return found.table()
