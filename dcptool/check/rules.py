"""DESIGN §3 in one file: the rule table, every check, and Finding (over 450 lines: issue 14 wants a rule's
detection, message and fault in one file, found from its name).

The table says per rule: severity, its one-letter timeline code, the columns it needs (without them the
check is skipped and the report says so), the check that detects it, and the simulated faults (runner.py /
simulate.py) that must produce it. Checks are vectorised over the dump with numpy (sorts, gathers,
segment reductions); Python runs only per problem found. The checks that find many (the row checks) hand
back a findings.FindingTable of columns whose messages are rendered only when read; the others return Issue
lists (findings_of turns them into a table). A finding's message says what is wrong; where (step, site,
rank, micro-batch) is a field that renderers compose (Finding.where, Finding.message).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from dcptool.check.findings import (
    ALIAS_GRAPH,
    ALIAS_UB,
    MISSING,
    PADDING,
    PAGES,
    SHAPE,
    STRAY,
    VALUE,
    Finding,  # noqa: F401 - rules.Finding, as before
    FindingTable,
)
from dcptool.check.provenance import KINDS, Provenance
from dcptool.check.scan import rows_differ
from dcptool.dcp.reference import local_np, local_of
from dcptool.dcp.segments import group_ids, join, mix, ragged, seg_sums
from dcptool.dcp.segments import obs_chunks as _obs_chunks
from dcptool.dcp.slicing import (
    first_disagreement,
    parse_engine_version,
    request_boundary_splits,
    sliced_last_cut,
    sliced_num_reqs,
    sliced_query_start_loc,
    splits_on_request_boundary,
    ubatch_bounds,
)
from dcptool.dump import Dump
from dcptool.dump.schema import GraphMode

if TYPE_CHECKING:
    from dcptool.check.scan import Stats


class Rule(NamedTuple):
    name: str
    severity: str  # error or warning
    code: str  # one character in the timeline, distinct even ignoring case (initials collide: stale/stray/shape,
    #            missing/mismatch, padding/pages); the legend under the timeline spells them out
    needs: tuple[str, ...]  # columns it needs beyond the required ones (DESIGN §2)
    check: str  # the function that detects it: of this module, or "module.function" of another dcptool module
    faults: tuple[str, ...]  # simulate's faults (DESIGN §4) that must produce it


# DESIGN §3, in table order: findings of one observation are reported in this order.
TABLE = (
    Rule("missing", "error", "M", (), "check_missing", ("dummy-none", "dflash-capture-none", "ubatch-none")),
    Rule("stale", "error", "S", (), "check_values", ("ubatch-parent-rows", "pcp-stale")),
    Rule("global", "error", "G", (), "check_values", ()),
    Rule("wrong-rank", "error", "R", (), "check_values", ()),
    Rule("wrong-interleave", "error", "I", (), "check_values", ()),
    Rule("mismatch", "error", "X", (), "check_values", ()),
    Rule("padding", "error", "P", (), "check_padding", ("sentinel",)),
    Rule("shape", "error", "L", (), "check_shape", ("pcp-unpadded",)),
    Rule("stray", "warning", "Y", (), "check_stray", ()),
    Rule("ubatch-slice", "error", "U", ("obs.parent", "obs.req_start", "obs.tok_start", "obs.tok_stop", "obs.qsl"),
         "check_ubatch_slice", ()),
    Rule("alias", "error", "A", ("obs.buffer",), "check_alias", ("capture-wrong-buffer", "graph-stale")),
    Rule("rank-sum", "error", "K", (), "check_rank_sum", ()),
    Rule("pages", "error", "B", ("rows.kv_pages",), "check_pages", ("flashinfer-global-pages",)),
    # issue 15 (coverage of the rest of what DCP attention consumes). After the view's own rules: a wrong
    # S is reported first as what it holds (stale/global/.../padding), empty-mask then says what the LSE
    # merge does with it; tot-lens is a per-observation companion check beside pages; rank-agree, a
    # group rule like rank-sum, comes last.
    Rule("empty-mask", "error", "E", ("obs.dqsl",), "check_empty_mask", ("dcp-qsl-local",)),
    Rule("tot-lens", "error", "T", ("obs.tot",), "check_tot_lens", ("tot-local",)),
    Rule("rank-agree", "error", "N", (), "check_rank_agree", ("rank-disagree",)),
)
# issue 15 item 3: which rank writes each KV slot
TABLE += (
    Rule("slots", "error", "W", ("obs.slots", "rows.positions", "rows.slot_mapping", "rows.slot_group"),
         "slots.check_slots", ("slot-wrong-group",)),
    Rule("slot-partition", "error", "O", ("obs.slots", "rows.positions", "rows.slot_mapping", "rows.slot_group"),
         "slots.check_slot_partition", ("slot-all-ranks",)),
)
RULE = {r.name: r for r in TABLE}
RULES = tuple(RULE)
SEVERITY = {r.name: r.severity for r in TABLE}
RULE_CODES = {r.name: r.code for r in TABLE}
RULE_OF_FAULT = {f: r.name for r in TABLE for f in r.faults}
RULE_ORDER = {r: i for i, r in enumerate(RULES)}
PARENT_ROWS_NEEDS = ("obs.parent", "obs.req_start")  # stale/parent-rows: the slice of the parent to compare


class Issue(NamedTuple):
    """What a vectorised check found at one observation; `fields` are Finding's keyword arguments."""

    index: int
    rule: str
    text: str
    fields: dict


# --------------------------------------------------------------------------------------------
# Findings: built as columns (findings.FindingTable), their messages rendered only when read


def check_values(d: Dump, prov: Provenance, st: Stats) -> FindingTable:
    """Wrong real rows (the scan's n_wrong): explained by provenance (stale, global, wrong-rank,
    wrong-interleave) or a mismatch, all at once; `prov` has been prepared for these observations."""
    k = st.n_wrong > 0
    i, first = st.obs[k].astype(np.int64), st.first_wrong[k].astype(np.int64)
    c = d.config
    rec = d.take("rows.dcp_local_seq_lens", d["obs.dcp_rows"][i] + first).astype(np.int64)
    exp = local_np(d.take("rows.seq_lens", d["obs.rows"][i] + first), c.dcp_size, d["obs.rank"][i], c.cp_interleave)
    kind, src, rel, aux = prov.explain_many(i)
    rule = np.array([RULES.index(k) for k in KINDS], np.int8)[kind]
    return FindingTable.build(d, i, rule, VALUE, row=first, recorded=rec, expected=exp, wrong_rows=st.n_wrong[k],
                              source=src, relation=rel, a0=aux)


def check_missing(d: Dump) -> FindingTable:
    return FindingTable.build(d, np.flatnonzero(~d["obs.has_dcp"].astype(bool)), "missing", MISSING)


def check_padding(d: Dump, st: Stats) -> FindingTable:
    k = st.n_pad > 0
    i, j = st.obs[k].astype(np.int64), st.first_pad[k].astype(np.int64)
    rec = d.take("rows.dcp_local_seq_lens", d["obs.dcp_rows"][i] + j)
    return FindingTable.build(d, i, "padding", PADDING, row=j, recorded=rec, expected=0, wrong_rows=st.n_pad[k],
                              a0=d["obs.num_reqs"][i])


def check_shape(d: Dump) -> FindingTable:
    has = d["obs.has_dcp"].astype(bool)
    nrp = d["obs.num_reqs_padded"]
    dlen = np.diff(d["obs.dcp_rows"])
    i = np.flatnonzero(has & (dlen != nrp))
    return FindingTable.build(d, i, "shape", SHAPE, a0=dlen[i], a1=nrp[i])


def check_stray(d: Dump) -> FindingTable:
    return FindingTable.build(d, np.flatnonzero(d["obs.has_dcp"].astype(bool)), "stray", STRAY)


def check_pages(d: Dump, st: Stats) -> FindingTable:
    c = d.config
    k = st.n_pages > 0
    i, j = st.obs[k].astype(np.int64), st.first_pages[k].astype(np.int64)
    page = c.page_size
    seq = d.take("rows.seq_lens", d["obs.rows"][i] + j).astype(np.int64)
    local = local_np(seq, c.dcp_size, d["obs.rank"][i], c.cp_interleave)
    claimed = d.take("rows.kv_pages", d["obs.rows"][i] + j).astype(np.int64)
    return FindingTable.build(d, i, "pages", PAGES, row=j, recorded=claimed, expected=-(-local // page),
                              wrong_rows=st.n_pages[k], a0=-(-seq // page), a1=local)


def findings_of(d: Dump, issues: list[Issue] | FindingTable) -> FindingTable:
    """A check's Issues as findings (their texts and details kept as written); a check that finds many may
    build its FindingTable itself (check_alias), which passes through."""
    return issues if isinstance(issues, FindingTable) else FindingTable.from_issues(d, issues)


# --------------------------------------------------------------------------------------------
# Rules across observations: shared buffers, all ranks adding up, micro-batch slicing

CAPTURE, REPLAY = GraphMode.FULL_CAPTURE, GraphMode.FULL_REPLAY




def _segments(keys: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Stable sort by keys (last key most significant; ties keep their order); returns (order, start of
    each element's run of equal keys)."""
    order = np.lexsort(keys)
    if order.size == 0:
        return order, order
    change = np.zeros(order.size, bool)
    change[0] = True
    for k in keys:
        ks = k[order]
        change[1:] |= ks[1:] != ks[:-1]
    run = np.maximum.accumulate(np.where(change, np.arange(order.size), 0))
    return order, run


def check_alias(d: Dump) -> FindingTable:
    """Micro-batches of one step sharing a DCP buffer; full-graph replays reading another buffer
    than their capture (same file, rank, num_reqs_padded and micro-batch). A dense recording has one on a
    quarter of its observations: built as columns, messages rendered when read (findings.ALIAS_*)."""
    out: list[FindingTable] = []
    buf, ub, has = d["obs.buffer"], d["obs.ubatch"].astype(np.int64), d["obs.has_dcp"]
    fidx, rank, step = d.file_index.astype(np.int64), d["obs.rank"].astype(np.int64), d["obs.step"]
    sel = np.flatnonzero((ub >= 0) & (has == 1) & (buf != 0))
    if sel.size:
        order, run = _segments([buf[sel], rank[sel], step[sel], fidx[sel]])
        s = sel[order]
        # same step, rank and buffer as an earlier member of its run, but another micro-batch
        first = s[run]
        k = np.flatnonzero(ub[s] != ub[first])
        out.append(FindingTable.build(d, s[k], "alias", ALIAS_UB, a0=first[k]))
    if "obs.graph" in d.columns:
        g = d["obs.graph"]
        sel = np.flatnonzero(((g == CAPTURE) | (g == REPLAY)) & (buf != 0))
        if sel.size:
            nrp = d["obs.num_reqs_padded"].astype(np.int64)
            # Every buffer captured for a key counts: a drafter (DFlash) captures graphs of the same sizes on
            # its own buffers, and several PCP ranks of one DCP rank may share a file; only a replay whose
            # buffer no earlier capture of its key used reads stale values.
            _, key = np.unique(np.stack([fidx[sel], rank[sel], nrp[sel], ub[sel]]), axis=1, return_inverse=True)
            _, pair = np.unique(np.stack([key.ravel(), buf[sel]]), axis=1, return_inverse=True)
            key, pair = key.ravel(), pair.ravel()
            cap = g[sel] == CAPTURE
            big = np.iinfo(np.int64).max
            first_cap = np.full(int(pair.max()) + 1, big)
            np.minimum.at(first_cap, pair[cap], sel[cap])
            order, run = _segments([key])
            s = sel[order]
            pos = np.arange(s.size)
            last = np.maximum.accumulate(np.where(g[s] == CAPTURE, pos, run - 1))  # latest capture in the run so far
            bad = np.flatnonzero((g[s] == REPLAY) & (last >= run) & (first_cap[pair[order]] > s))
            out.append(FindingTable.build(d, s[bad], "alias", ALIAS_GRAPH, a0=s[last[bad]]))
    return FindingTable.concat(d, out)


def _kth_per_rank(batch: np.ndarray, rank: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Set ids for members of cross-rank groups: in each batch the k-th member of every rank (in `idx` order,
    i.e. observation order) joins the k-th set."""
    order = np.lexsort((idx, rank, batch))
    new = np.ones(idx.size, bool)
    new[1:] = (batch[order][1:] != batch[order][:-1]) | (rank[order][1:] != rank[order][:-1])
    starts = np.flatnonzero(new)
    occ = np.empty(idx.size, np.int64)
    occ[order] = np.arange(idx.size) - np.repeat(starts, np.diff(np.append(starts, idx.size)))
    return group_ids([batch, occ])


def check_rank_sum(d: Dump, wrong: np.ndarray) -> list[Issue]:
    """The same batch recorded with a view on all N ranks must add up to seq_len on each real row.

    The formula always adds up, so only batches with a wrong view on some rank can fail: groups
    are formed around the observations in `wrong` only. Members of a batch share (step, site,
    ubatch, num_reqs, real seq_lens); the k-th recording of each rank makes the k-th set, and the
    finding goes to the observation that completes it. Vectorised (sorts and joins on the key
    columns and a hash of the real seq_lens, confirmed exactly): no loop over members.
    """
    N = d.config.dcp_size
    if N == 1 or wrong.size == 0:
        return []
    wrong = np.unique(np.asarray(wrong, np.int64))
    nr = d["obs.num_reqs"].astype(np.int64)
    key = [d["obs.step"], d["obs.site"].astype(np.int64), d["obs.ubatch"].astype(np.int64), nr]
    has = np.flatnonzero(d["obs.has_dcp"] == 1)
    has = has[np.isin(key[0][has], key[0][wrong])]  # (the step alone first: a sort of one column, not of four)
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
    sets = _kth_per_rank(batch, d["obs.rank"][m].astype(np.int64), m)  # the k-th recording of each rank of a batch
    size = np.bincount(sets, minlength=int(sets.max(initial=-1)) + 1)
    hit = np.zeros(size.size, bool)
    hit[sets[np.isin(m, wrong)]] = True
    full = np.flatnonzero(hit & (size >= N))  # ranks are < N (the reader checks), so size N is every rank
    if full.size == 0:
        return []
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
    out: list[Issue] = []
    first_row = np.cumsum(n) - n
    for t in np.unique(setrow[bad]):
        rows = np.flatnonzero(bad[first_row[t] : first_row[t] + n[t]])
        group = mm[bounds[t] : bounds[t] + counts[t]]
        i, jr = int(group[-1]), int(rows[0])
        k = int(first_row[t]) + jr
        msg = (f"across the {N} ranks, local lengths of row {jr} add up to {int(total[k])}, "
               f"not its seq_len {int(want[k])}")
        out.append(Issue(i, "rank-sum", msg, {"row": jr, "recorded": int(total[k]), "expected": int(want[k]),
                                         "wrong_rows": int(rows.size),
                                         "detail": {"obs": sorted(int(d.file_obs[x]) for x in group)}}))
    return out


def _check_split_points(d: Dump, cand: np.ndarray, engine_version: str) -> dict[int, tuple]:
    """Recorded micro-batch bounds against the engine version's split rule (slicing.ubatch_slices): the
    token midpoint, or from vLLM 0.34 on a request boundary for a batch of equal query lengths. vLLM
    0.34 uses the request boundary only when its DP ranks agree the batch is a uniform decode, which
    a dump does not record, so there either split is right. K is the number of micro-batches recorded
    for the parent; parents whose last recorded micro-batch does not end at num_tokens_padded (not all
    recorded) are not checked."""
    par, ub = d["obs.parent"], d["obs.ubatch"].astype(np.int64)
    p = par[cand]
    qo = d["obs.qsl"]
    nr = d["obs.num_reqs"][p].astype(np.int64)
    real = d["rows.query_start_loc"][qo[p] + nr].astype(np.int64)
    ntp = real
    if d.has("obs.num_tokens_padded"):
        rec = d["obs.num_tokens_padded"][p].astype(np.int64)
        ntp = np.where(rec >= 0, rec, real)  # as slicing.split_batch
    kmax = np.full(d.n, -1, np.int64)
    np.maximum.at(kmax, p, ub[cand])
    k = kmax[p] + 1
    te = d["obs.tok_stop"][cand].astype(np.int64)
    ends = np.zeros(d.n, bool)
    ends[p[(ub[cand] == k - 1) & (te == ntp)]] = True
    ok = ends[p] & (nr >= 1) & (ntp >= k)
    c, p, u, k, ntp, nr = cand[ok], p[ok], ub[cand][ok], k[ok], ntp[ok], nr[ok]
    got = np.stack([d[f"obs.{f}"][c].astype(np.int64) for f in ("req_start", "tok_start", "tok_stop")]
                   + [d["obs.req_start"][c].astype(np.int64) + d["obs.num_reqs_padded"][c].astype(np.int64)])
    got = got[[0, 3, 1, 2]]  # req_start, req_stop, tok_start, tok_stop
    mid = np.stack(ubatch_bounds(d, p, u, k, ntp, ntp // k))
    good = (got == mid).all(axis=0)
    if splits_on_request_boundary(engine_version):
        # equal query lengths q > 1 (vLLM's uniform_token_count): split at (ntp // (q*K)) * q when > 0
        seg, j, idx = ragged(qo[p].astype(np.int64), nr + 1)
        qv = d["rows.query_start_loc"][idx].astype(np.int64)
        dq = np.diff(qv)
        inner = j[1:] > 0  # differences inside one parent's cu
        lo = np.full(c.size, np.iinfo(np.int64).max)
        hi = np.full(c.size, np.iinfo(np.int64).min)
        np.minimum.at(lo, seg[1:][inner], dq[inner])
        np.maximum.at(hi, seg[1:][inner], dq[inner])
        q = np.where(lo == hi, hi, 0)
        split = request_boundary_splits(ntp, k, q)
        uni = split > 0
        if uni.any():
            bnd = np.stack(ubatch_bounds(d, p[uni], u[uni], k[uni], ntp[uni], split[uni]))
            good[uni] |= (got[:, uni] == bnd).all(axis=0)
    out: dict[int, tuple] = {}
    names = ("req_start", "req_stop", "tok_start", "tok_stop")
    for i in np.flatnonzero(~good):
        f = int(np.flatnonzero(got[:, i] != mid[:, i])[0])
        out[int(c[i])] = (names[f], None, int(got[f, i]), int(mid[f, i]), int(k[i]))
    return out


def check_ubatch_slice(d: Dump, engine_version: str | None = None) -> list[Issue]:
    """A recorded micro-batch must equal slicing its recorded parent at its recorded bounds (§1):
    qsl = clamp(parent qsl[rs:rs+nrp+1] - ts, 0, te - ts); seq_lens = parent rows [rs, rs+nrp),
    the last reduced by max(0, parent qsl[rs+nrp] - te); num_reqs = max(0, min(rs+nrp, parent) - rs).
    When the dump (or `engine_version`) names the engine version, the recorded bounds must also be
    where that version splits (_check_split_points); a dump that names none is sliced as recorded."""
    par, ub = d["obs.parent"], d["obs.ubatch"]
    rs, ts, te = (d[k].astype(np.int64) for k in ("obs.req_start", "obs.tok_start", "obs.tok_stop"))
    qo, rows = d["obs.qsl"], d["obs.rows"]
    qlen = np.diff(qo)
    cand = np.flatnonzero((ub >= 0) & (par >= 0) & (rs >= 0) & (ts >= 0) & (te >= 0) & (qlen > 0))
    if cand.size:
        cand = cand[qlen[par[cand]] > 0]
    if cand.size == 0:
        return []
    p = par[cand]
    nrp = d["obs.num_reqs_padded"][cand].astype(np.int64)
    r0, ts0, te0 = rs[cand], ts[cand], te[cand]
    out: list[Issue] = []
    over = (r0 + nrp > qlen[p] - 1) | (r0 + nrp > np.diff(rows)[p])
    for i in cand[over]:
        msg = (f"requests [{int(rs[i])}, {int(rs[i]) + int(d['obs.num_reqs_padded'][i])}) run "
               f"past the parent's {int(qlen[par[i]]) - 1}")
        out.append(Issue(int(i), "ubatch-slice", msg, {"detail": {"field": "req_stop"}}))
    ok = ~over
    cand, p, nrp, r0, ts0, te0 = cand[ok], p[ok], nrp[ok], r0[ok], ts0[ok], te0[ok]
    q = d["rows.query_start_loc"]
    nr_par = d["obs.num_reqs"][p].astype(np.int64)
    want_nr = sliced_num_reqs(r0, nrp, nr_par)
    bad_obs: dict[int, tuple] = {}
    bounds = _check_split_points(d, cand, engine_version) if parse_engine_version(engine_version) else {}
    for i, (field, _, rec, exp, k) in bounds.items():
        msg = (f"{field} is {rec}, but vLLM {engine_version} splits this batch (obs "
               f"{int(d.file_obs[par[i]])}) into {k} micro-batches with {field} {exp}")
        out.append(Issue(i, "ubatch-slice", msg, {"recorded": rec, "expected": exp, "wrong_rows": 0,
                                             "detail": {"field": field, "parent_obs": int(d.file_obs[par[i]]),
                                                        "ubatches": k, "engine_version": engine_version}}))
    for k in np.flatnonzero(want_nr != d["obs.num_reqs"][cand]):
        bad_obs[int(cand[k])] = ("num_reqs", None, int(d["obs.num_reqs"][cand[k]]), int(want_nr[k]))
    # query_start_loc: nrp + 1 values each (only where the recorded length matches)
    qn = np.where(qlen[cand] == nrp + 1, nrp + 1, 0)
    seg, j, _ = ragged(np.zeros(cand.size, np.int64), qn)
    got = q[qo[cand][seg] + j].astype(np.int64)
    want = sliced_query_start_loc(q[qo[p][seg] + r0[seg] + j].astype(np.int64), ts0[seg], te0[seg])
    for k in np.flatnonzero(got != want):
        bad_obs.setdefault(int(cand[seg[k]]), ("query_start_loc", int(j[k]), int(got[k]), int(want[k])))
    for k in np.flatnonzero(qlen[cand] != nrp + 1):
        bad_obs.setdefault(int(cand[k]), ("query_start_loc", None, int(qlen[cand[k]]), int(nrp[k]) + 1))
    # seq_lens: nrp rows each, the last reduced by the tokens of that request after te. The reader
    # accepts a micro-batch with fewer seq_lens rows than num_reqs_padded (only num_reqs are required):
    # compare the rows it has, and report the short ones below rather than read past them.
    have = np.diff(rows)[cand]
    seg, j, _ = ragged(np.zeros(cand.size, np.int64), np.minimum(nrp, have))
    got = d.take("rows.seq_lens", rows[cand][seg] + j).astype(np.int64)
    want = d.take("rows.seq_lens", rows[p][seg] + r0[seg] + j).astype(np.int64)
    cut = sliced_last_cut(q[qo[p] + r0 + nrp].astype(np.int64), te0)
    last = j == nrp[seg] - 1
    want[last] -= cut[seg[last]]
    for k in np.flatnonzero(got != want):
        bad_obs.setdefault(int(cand[seg[k]]), ("seq_lens", int(j[k]), int(got[k]), int(want[k])))
    for k in np.flatnonzero(have < nrp):
        bad_obs.setdefault(int(cand[k]), ("seq_lens", None, int(have[k]), int(nrp[k])))
    idx = {int(c): k for k, c in enumerate(cand)}
    for i in sorted(set(bad_obs) - set(bounds)):  # one finding per observation: the split is the first wrong
        field, row, rec, exp = bad_obs[i]
        k = idx[i]
        msg = (f"{field} disagrees with slicing the parent (obs {int(d.file_obs[p[k]])}) at requests "
               f"[{int(r0[k])}, {int(r0[k] + nrp[k])}) tokens [{int(ts0[k])}, {int(te0[k])}): "
               + (f"row {row} is {rec}, slicing gives {exp}" if row is not None else f"{rec}, slicing gives {exp}"))
        out.append(Issue(i, "ubatch-slice", msg, {"row": row, "recorded": rec, "expected": exp, "wrong_rows": 1,
                                             "detail": {"field": field, "parent_obs": int(d.file_obs[p[k]])}}))
    return out


def merge_split_findings(d: Dump, findings: FindingTable, splits: list) -> FindingTable:
    """Recorded micro-batches of a re-split batch (`--split`: replay.Split) must match the split
    (else `ubatch-slice`)."""
    if not d.has("obs.parent") or not splits:
        return findings
    by_parent = {(s.parent, s.ubatch): s for s in splits}
    have = set(findings.index[findings.rule_code == RULES.index("ubatch-slice")].tolist())
    extra: list[Issue] = []
    k = max(x.ubatch for x in splits) + 1
    par, ub = d["obs.parent"], d["obs.ubatch"]
    for i in np.flatnonzero((ub >= 0) & (par >= 0)):
        s = by_parent.get((int(par[i]), int(ub[i])))
        if s is None or int(i) in have:
            continue
        got = {"num_reqs_padded": int(d["obs.num_reqs_padded"][i]), "num_reqs": int(d["obs.num_reqs"][i])}
        for key, attr in (("obs.req_start", "req_start"), ("obs.tok_start", "tok_start"), ("obs.tok_stop", "tok_stop")):
            if d.has(key) and d[key][i] >= 0:
                got[attr] = int(d[key][i])
        bad = first_disagreement(got, d.seq_lens_of(i)[: int(d["obs.num_reqs_padded"][i])], s.ub)
        if bad:
            f, rec, want = bad
            msg = (f"recorded micro-batch disagrees with --split {k} of its parent "
                   f"(obs {s.parent_obs}): {f} is {rec}, the split gives {want}")
            extra.append(Issue(int(i), "ubatch-slice", msg, {"detail": {"field": f, "parent_obs": s.parent_obs,
                                                                        "split": True}}))
    if not extra:
        return findings
    return FindingTable.concat(d, [findings, findings_of(d, extra)])



# --------------------------------------------------------------------------------------------
# Issue 15: the empty-shard mask, the global companion, rank agreement

MASK_ROWS_CHUNK = 1 << 22  # LSE rows whose masks are built at once (bounded memory on huge or hostile dumps)
_SHOWN = 16  # masked rows listed in a finding's detail
MASK_PAST_Q = 1 << 16  # LSE rows compared past the expected Q[-1] when the recorded Q runs further


def lse_mask(q: np.ndarray, s: np.ndarray, rows: int) -> np.ndarray:
    """vLLM's `mask_dcp_empty_shards_` for one batch, in numpy: which of `rows` LSE rows get -inf.

    Row t belongs to sequence searchsorted(q[1:], t, right) (clamped to the last one) and is masked when
    t >= q[-1] (CUDA-graph padding) or that sequence's local length is 0 (an empty shard); with no
    sequences every row is masked. Requires len(q) == len(s) + 1 (vLLM raises otherwise). The one-batch
    spec the vectorised check_empty_mask is tested against."""
    q, s = np.asarray(q, np.int64), np.asarray(s, np.int64)
    if q.size != s.size + 1:
        raise ValueError("query_start_loc must contain one boundary per sequence")
    t = np.arange(rows, dtype=np.int64)
    if s.size == 0:
        return np.ones(rows, bool)
    seq = np.minimum(np.searchsorted(q[1:], t, side="right"), s.size - 1)
    return (t >= q[-1]) | (s[seq] == 0)


def _ql_rows(d: Dump, idx: np.ndarray, R: np.ndarray):
    """query lengths of the first R rows of each observation in idx: (segment, row, query length)."""
    seg, j, at = ragged(d["obs.qsl"][idx], R)
    q = d["rows.query_start_loc"]
    return seg, j, q[at + 1].astype(np.int64) - q[at].astype(np.int64)


def decode_counts(d: Dump, idx: np.ndarray, R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """num_decodes as vLLM's split_decodes_and_prefills gives it with decode_threshold 1 (the FlashInfer
    builder's threshold under DCP) over the first R rows, for both values of its `require_uniform`.

    Rows are decodes up to the first query longer than 1; request-padding rows (0 query tokens) count as
    decodes. With require_uniform, a batch whose first row has 0 query tokens (a micro-batch lying in
    token padding) ends its decodes at the first row with any query token instead. Returns (a, b)."""
    seg, j, ql = _ql_rows(d, idx, R)
    a = _first_in_segment(seg, j, ql > 1, R)
    first0 = np.zeros(idx.size, bool)
    first0[seg[(j == 0) & (ql == 0)]] = True
    anylong = a < R
    b2 = _first_in_segment(seg, j, first0[seg] & anylong[seg] & (ql >= 1), R)
    return a, np.where(first0 & anylong, b2, a)


def _first_in_segment(seg: np.ndarray, j: np.ndarray, cond: np.ndarray, default: np.ndarray) -> np.ndarray:
    """Per segment (seg sorted): the index j of its first element where cond holds, else default."""
    out = np.asarray(default, np.int64).copy()
    k = np.flatnonzero(cond)
    if k.size:
        first = np.ones(k.size, bool)
        first[1:] = seg[k][1:] != seg[k][:-1]
        out[seg[k][first]] = j[k][first]
    return out


def _rank_sets(d: Dump, idx: np.ndarray) -> np.ndarray:
    """For observations idx: the id of its set over ranks, the k-th recording of each rank in one
    (step, site, micro-batch) making set k (how every rank records the same sequence of builds)."""
    step, site = d["obs.step"][idx], d["obs.site"][idx].astype(np.int64)
    ub, rank = d["obs.ubatch"][idx].astype(np.int64), d["obs.rank"][idx].astype(np.int64)
    return _kth_per_rank(group_ids([step, site, ub]), rank, idx)


def _count_le(seg_q: np.ndarray, v_q: np.ndarray, seg_t: np.ndarray, v_t: np.ndarray) -> np.ndarray:
    """For each (segment, t): how many values of its segment's q are <= t (searchsorted right on a sorted q;
    defined for an unsorted one too). All segments at once: keys are segment * 2**33 + value + 2**31."""
    off = np.int64(1) << np.int64(31)
    kq = np.sort((seg_q.astype(np.int64) << np.int64(33)) + v_q.astype(np.int64) + off)
    kt = (seg_t.astype(np.int64) << np.int64(33)) + v_t.astype(np.int64) + off
    return np.searchsorted(kq, kt, "right") - np.searchsorted(kq, seg_t.astype(np.int64) << np.int64(33), "left")


def _masks(qs: np.ndarray, qv: np.ndarray, ss: np.ndarray, sv: np.ndarray, nseq: np.ndarray, rows: np.ndarray,
           base: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """lse_mask over many batches at once. q entries (segment qs, value qv, q[1:] only), s rows
    (segment ss, value sv, nseq per segment; ss sorted), `rows` LSE rows per segment, q[-1] per segment in
    `base`. Returns (segment, row t, masked) for every row."""
    seg, t, _ = ragged(np.zeros(rows.size, np.int64), rows)
    cnt = np.minimum(_count_le(qs, qv, seg, t), np.maximum(nseq[seg] - 1, 0))
    start = np.cumsum(nseq) - nseq
    sval = np.zeros(seg.size, np.int64)
    has = nseq[seg] > 0
    sval[has] = sv[start[seg[has]] + cnt[has]]
    masked = (t >= base[seg]) | ~has | (sval == 0)
    return seg, t, masked


def check_empty_mask(d: Dump) -> list[Issue]:
    """The empty-shard mask's inputs (vLLM 0.30+ FlashInfer decode; issue 15): Q = dcp_query_start_loc
    must be query_start_loc[:num_decodes+1] (Q[0] = 0, non-decreasing, the same on every rank) with
    num_decodes from split_decodes_and_prefills at threshold 1; S = the DCP view's first num_decodes rows
    must give len(Q) == len(S) + 1; and the LSE rows mask_dcp_empty_shards_ masks with the recorded (Q, S)
    must be those it masks with the expected ones (local lengths of the batch, 0 on padded rows). Checks
    that need query_start_loc run where it is recorded. One finding per observation: its first problem,
    plus the real rows masked on every rank of its batch (a NaN after the LSE merge) when there are any.
    Vectorised: ragged gathers, one sorted search for every row's sequence; Python per finding only."""
    c = d.config
    N = c.dcp_size
    dq_off = d["obs.dqsl"]
    qn = np.diff(dq_off)
    cand = np.flatnonzero(qn > 0)  # an empty Q: not recorded (vLLM's Q always holds Q[0])
    if N == 1 or cand.size == 0:
        return []
    dq = d["rows.dcp_query_start_loc"]
    nr = d["obs.num_reqs"][cand].astype(np.int64)
    nrp = d["obs.num_reqs_padded"][cand].astype(np.int64)
    rows = np.diff(d["obs.rows"])[cand]
    m = qn[cand]
    nd = m - 1
    problems: dict[int, tuple[str, dict]] = {}  # position in cand -> first problem

    def note(pos: np.ndarray, text_of, detail_of) -> None:
        for k in pos.tolist():
            if k not in problems:
                problems[k] = (text_of(k), detail_of(k))

    # Q itself: starts at 0, never decreases
    seg, j, at = ragged(dq_off[cand], m)
    qv = dq[at].astype(np.int64)
    first_entry = np.cumsum(m) - m
    q0 = qv[first_entry]
    note(np.flatnonzero(q0 != 0), lambda k: f"dcp_query_start_loc starts at {int(q0[k])}, not 0",
         lambda k: {"field": "dcp_query_start_loc", "row": 0, "recorded": int(q0[k]), "expected": 0})
    dec = np.zeros(cand.size, bool)
    inner = j[1:] > 0
    dpos = np.flatnonzero(inner & (qv[1:] < qv[:-1]))
    dec[seg[1:][dpos]] = True
    first_dec = np.full(cand.size, -1, np.int64)
    first_dec[seg[1:][dpos][::-1]] = j[1:][dpos][::-1]
    note(np.flatnonzero(dec), lambda k: f"dcp_query_start_loc decreases at entry {int(first_dec[k])}",
         lambda k: {"field": "dcp_query_start_loc", "row": int(first_dec[k])})
    # against query_start_loc: num_decodes, then the prefix
    known = np.zeros(cand.size, bool)
    qsl_rows = d["rows.query_start_loc"] if d.has("obs.qsl") else np.zeros(1, np.int32)
    qoff = d["obs.qsl"][cand] if d.has("obs.qsl") else np.zeros(cand.size, np.int64)
    if d.has("obs.qsl"):
        known = np.diff(d["obs.qsl"])[cand] == rows + 1

    def qsl_at(pos: np.ndarray, entry: np.ndarray, default: np.ndarray | int = 0) -> np.ndarray:
        """query_start_loc[entry] of cand[pos] where recorded, else default."""
        at = np.clip(qoff[pos] + entry, 0, max(qsl_rows.size - 1, 0))
        return np.where(known[pos], qsl_rows[at].astype(np.int64) if qsl_rows.size else 0, default)

    # The builder's num_reqs: num_reqs_padded under a FULL graph (build_attn_metadata); otherwise num_reqs,
    # or the padded count where a path pads requests outside a FULL graph (a drafter's padded batch): a Q
    # that fits either is accepted there. The expected one is the padded count for a FULL graph (and when
    # obs.graph is absent), else num_reqs.
    graph = d.has("obs.graph")
    full = (d["obs.graph"][cand] >= 2) if graph else np.ones(cand.size, bool)
    R_pad = np.where(known, np.minimum(nrp, rows), 0)
    R_real = np.where(known, np.minimum(nr, rows), 0)
    a, b = decode_counts(d, cand, R_pad) if d.has("obs.qsl") else (nd, nd)
    padded = np.flatnonzero(R_real != R_pad)  # (request padding is rare: count those again only)
    a2, b2 = a.copy(), b.copy()
    if padded.size and d.has("obs.qsl"):
        a2[padded], b2[padded] = decode_counts(d, cand[padded], R_real[padded])
    a_want = np.where(full, a, a2)
    fits_pad = (nd == a) | (nd == b)
    fits_real = ((nd == a2) | (nd == b2)) & (~full | (not graph))  # (a FULL graph runs the padded batch)
    R = np.where(fits_pad | ~fits_real & full, R_pad, R_real)
    nd_exp = np.where(known & (fits_pad | fits_real), nd, a_want)
    nd_exp = np.where(known, nd_exp, nd)
    bad_nd = known & ~fits_pad & ~fits_real
    a = a_want
    note(np.flatnonzero(bad_nd),
         lambda k: (f"dcp_query_start_loc holds {int(m[k])} entries (num_decodes {int(nd[k])}), but this batch has "
                    f"{int(a[k])} decode rows (split_decodes_and_prefills, threshold 1; padded rows count): it must be "
                    f"query_start_loc[:{int(a[k]) + 1}]"),
         lambda k: {"field": "num_decodes", "recorded": int(nd[k]), "expected": int(a[k])})
    cmpn = np.where(known, np.minimum(m, R + 1), 0)
    seg2, j2, _ = ragged(np.zeros(cand.size, np.int64), cmpn)
    rec = qv[first_entry[seg2] + j2]
    want = qsl_at(seg2, j2)
    badq = np.flatnonzero(rec != want)
    qpre = np.zeros(cand.size, bool)
    qpre[seg2[badq]] = True
    fq = np.full(cand.size, -1, np.int64)
    fq[seg2[badq][::-1]] = j2[badq][::-1]
    note(np.flatnonzero(qpre),
         lambda k: (f"dcp_query_start_loc[{int(fq[k])}] is {int(dq[dq_off[cand[k]] + fq[k]])}, but "
                    f"query_start_loc[{int(fq[k])}] is {int(qsl_rows[qoff[k] + fq[k]])}: Q must be "
                    "the batch's query_start_loc prefix, the same on every rank (empty shards keep their query "
                    "tokens and are masked through LSE = -inf)"),
         lambda k: {"field": "dcp_query_start_loc", "row": int(fq[k]), "recorded": int(dq[dq_off[cand[k]] + fq[k]]),
                    "expected": int(qsl_rows[qoff[k] + fq[k]])})
    # S: the view's first num_decodes rows
    has = d["obs.has_dcp"][cand] == 1
    dlen = np.diff(d["obs.dcp_rows"])[cand]
    short = has & (dlen < nd)
    note(np.flatnonzero(short),
         lambda k: (f"dcp_query_start_loc has {int(m[k])} entries but the DCP view only {int(dlen[k])} rows: "
                    "mask_dcp_empty_shards_ raises 'query_start_loc must contain one boundary per sequence'"),
         lambda k: {"field": "seq_lens", "recorded": int(dlen[k]), "expected": int(nd[k])})
    # the masks: recorded (Q, S) against expected (query_start_loc prefix, local lengths), over the LSE rows
    ok = has & ~short
    ntp = d["obs.num_tokens_padded"][cand].astype(np.int64) if d.has("obs.num_tokens_padded") else np.full(
        cand.size, -1, np.int64)
    qlast_rec = qv[first_entry + m - 1]
    allpos = np.arange(cand.size)
    qexp_last = qsl_at(allpos, np.minimum(nd_exp, R), qlast_rec)
    all_dec = known & (nd_exp == R)
    T = np.where(all_dec & (ntp >= 0), np.maximum(ntp, qexp_last), qexp_last)
    # rows past both Q[-1]s are masked in both masks: build rows up to there, and CUDA-graph padding rows
    # (masked in both) only as far as a finding's detail shows them; bounds what a hostile Q[-1] can ask for
    reach = np.maximum(qexp_last, np.minimum(qlast_rec, qexp_last + MASK_PAST_Q))
    U = np.clip(np.minimum(T, reach + _SHOWN), 0, None) * ok
    wrong_rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    all_masked: dict[int, list[int]] = {}
    sets = _rank_sets(d, cand)
    # Where Q is right, row t < Q[-1] belongs to the request j with Q[j] <= t < Q[j+1]: the masks differ exactly
    # where a request with query tokens is empty in one S and not in the other. That test runs per request
    # on every observation; LSE rows are built only for observations with a problem and their batch's ranks.
    qok = ok.copy()
    qok[list(problems)] = False
    pq = np.flatnonzero(qok)
    sq, jq, atq = ragged(d["obs.dcp_rows"][cand[pq]], nd[pq])
    s_rec = d.take("rows.dcp_local_seq_lens", atq).astype(np.int64)
    seq_r = d.take("rows.seq_lens", d["obs.rows"][cand[pq]][sq] + jq).astype(np.int64)
    s_exp = np.where(jq < nr[pq][sq], local_of(seq_r, d["obs.rank"][cand[pq]][sq].astype(np.int64), N,
                                               c.cp_interleave), 0)
    tok = qv[first_entry[pq][sq] + jq + 1] > qv[first_entry[pq][sq] + jq]
    flagged = np.zeros(cand.size, bool)
    flagged[pq[np.unique(sq[tok & ((s_rec == 0) != (s_exp == 0))])]] = True
    build = flagged | (ok & ~qok)
    build |= np.isin(sets, sets[flagged])
    pos_all = np.flatnonzero(build & ok & (U > 0))
    unmasked_any = None
    for lo_hi in _obs_chunks(U[pos_all], MASK_ROWS_CHUNK):
        sub = pos_all[lo_hi[0] : lo_hi[1]]
        if sub.size == 0:
            continue
        i = cand[sub]
        # recorded
        ndr = nd[sub]
        sq, jq, _ = ragged(np.zeros(sub.size, np.int64), np.maximum(m[sub] - 1, 0))
        qrv = qv[first_entry[sub][sq] + 1 + jq]
        ss, js, ats = ragged(d["obs.dcp_rows"][i], ndr)
        srv = d.take("rows.dcp_local_seq_lens", ats).astype(np.int64)
        sr, tr, mr = _masks(sq, qrv, ss, srv, ndr, U[sub], qlast_rec[sub])
        # expected
        nde = nd_exp[sub]
        kn = known[sub]
        qe_n = np.where(kn, nde, np.maximum(m[sub] - 1, 0))
        sq2, jq2, _ = ragged(np.zeros(sub.size, np.int64), qe_n)
        qev = qsl_at(sub[sq2], 1 + jq2, qv[np.minimum(first_entry[sub][sq2] + 1 + jq2, qv.size - 1)])
        ss2, js2, ats2 = ragged(d["obs.rows"][i], nde)
        seqv = d.take("rows.seq_lens", ats2).astype(np.int64)
        sev = local_of(seqv, d["obs.rank"][i][ss2].astype(np.int64), N, c.cp_interleave)
        sev = np.where(js2 < nr[sub][ss2], sev, 0)
        _, _, me = _masks(sq2, qev, ss2, sev, nde, U[sub], qexp_last[sub])
        diff = np.flatnonzero(mr != me)
        for k in np.unique(sr[diff]).tolist():
            pk = int(sub[k])
            sel = sr == k
            wrong_rows[pk] = (np.flatnonzero(mr[sel]), np.flatnonzero(me[sel]))
        # real rows (tokens of real requests) masked on this rank: count unmasked per (set, row)
        real = tr < qsl_at(sub, np.minimum(nr[sub], R[sub]), qexp_last[sub])[sr]
        part = np.stack([sets[sub][sr][real], tr[real], (~mr[real]).astype(np.int64)])
        unmasked_any = part if unmasked_any is None else np.concatenate([unmasked_any, part], axis=1)
    if unmasked_any is not None and unmasked_any.shape[1]:
        size = np.bincount(sets, minlength=int(sets.max()) + 1)
        g = group_ids([unmasked_any[0], unmasked_any[1]])
        un = np.zeros(int(g.max()) + 1, np.int64)
        np.add.at(un, g, unmasked_any[2])
        members = np.zeros(int(g.max()) + 1, np.int64)
        np.add.at(members, g, 1)
        bad = (un[g] == 0) & (members[g] >= N) & (size[unmasked_any[0]] >= N)
        for sset, t in sorted(set(zip(unmasked_any[0][bad].tolist(), unmasked_any[1][bad].tolist()))):
            all_masked.setdefault(sset, []).append(t)
    for k, (mrec, mexp) in wrong_rows.items():
        if k not in problems:
            diff = np.setxor1d(mrec, mexp)
            t = int(diff[0])
            problems[k] = (
                f"mask_dcp_empty_shards_ masks {_rows_text(mrec)} with the recorded local lengths, but the "
                f"batch's local lengths mask {_rows_text(mexp)} (row {t} "
                f"{'masked' if t in set(mrec.tolist()) else 'kept'} wrongly): the DCP view's decode rows give the "
                "wrong empty shards, so the LSE merge weighs the wrong ranks",
                {"field": "mask", "row": t, "recorded": int(t in set(mrec.tolist())),
                 "expected": int(t in set(mexp.tolist())), "wrong_rows": int(diff.size)})
        problems[k][1]["masked"] = mrec[:_SHOWN].tolist()
        problems[k][1]["expected_masked"] = mexp[:_SHOWN].tolist()
    out: list[Issue] = []
    # the real rows no rank keeps: said at the set's observations with a finding (else its first member)
    for sset, ts in all_masked.items():
        members = np.flatnonzero(sets == sset)
        withf = [int(k) for k in members if int(k) in problems] or [int(members[0])]
        for k in withf:
            if k not in problems:
                problems[k] = (f"{_rows_text(np.array(ts))} of real requests are masked", {"field": "mask"})
            problems[k][1]["all_ranks_masked"] = ts[:_SHOWN]
            problems[k] = (problems[k][0] + f"; {_rows_text(np.array(ts))} masked on every rank (the "
                           "merged output there is NaN)", problems[k][1])
    for k in sorted(problems):
        text, det = problems[k]
        kw = {"row": det.pop("row", None), "recorded": det.pop("recorded", None),
              "expected": det.pop("expected", None), "wrong_rows": det.pop("wrong_rows", 1), "detail": det}
        out.append(Issue(int(cand[k]), "empty-mask", text, kw))
    return out


def _rows_text(r: np.ndarray) -> str:
    r = np.asarray(r).tolist()
    if not r:
        return "no LSE row"
    return "LSE rows [" + ", ".join(map(str, r[:_SHOWN])) + (f", ... ({len(r)} rows)]" if len(r) > _SHOWN else "]")


def check_tot_lens(d: Dump) -> list[Issue]:
    """The global companion (e.g. FlashAttention/FlashMLA's total seq lens, MLA's dcp_tot_seq_lens =
    seq_lens[:num_decodes]) must equal the batch's global seq_lens on every real row it holds."""
    if d.config.dcp_size == 1:
        return []
    off = d["obs.tot"]
    tn = np.diff(off)
    nr = d["obs.num_reqs"].astype(np.int64)
    k = np.minimum(tn, nr)
    cand = np.flatnonzero(k > 0)
    if cand.size == 0:
        return []
    seg, j, at = ragged(off[cand], k[cand])
    got = d["rows.dcp_tot_seq_lens"][at].astype(np.int64)
    want = d.take("rows.seq_lens", d["obs.rows"][cand][seg] + j).astype(np.int64)
    bad = got != want
    nbad = np.bincount(seg[bad], minlength=cand.size)
    first = np.full(cand.size, -1, np.int64)
    first[seg[bad][::-1]] = j[bad][::-1]
    # (only for observations with a wrong row: does the companion hold this rank's local lengths?)
    hit = nbad[seg] > 0
    loc = local_of(want[hit], d["obs.rank"][cand][seg[hit]].astype(np.int64), d.config.dcp_size,
                   d.config.cp_interleave)
    all_local = np.bincount(seg[hit][got[hit] != loc], minlength=cand.size) == 0
    out: list[Issue] = []
    for p in np.flatnonzero(nbad).tolist():
        i, r = int(cand[p]), int(first[p])
        rec, exp = int(d["rows.dcp_tot_seq_lens"][off[i] + r]), int(d.seq_lens_of(i)[r])
        why = " = this rank's local lengths: the companion must be global" if all_local[p] else ""
        msg = (f"global companion (dcp_tot_seq_lens) row {r} is {rec}, the global seq_len is {exp}{why} "
               f"({int(nbad[p])} wrong row{'s' if nbad[p] > 1 else ''})")
        out.append(Issue(i, "tot-lens", msg, {"row": r, "recorded": rec, "expected": exp,
                                              "wrong_rows": int(nbad[p]), "detail": {"local": bool(all_local[p])}}))
    return out


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
    sets = _rank_sets(d, idx) if d.n else idx
    prev = np.full(d.n, -1, np.int64)
    order = np.lexsort((idx, sets))
    same = sets[order][1:] == sets[order][:-1]
    prev[order[1:][same]] = order[:-1][same]
    return RankSets(sets, prev)


def check_rank_agree(d: Dump, pairs: RankSets | None = None, seq_differ: np.ndarray | None = None) -> list[Issue]:
    """What every DCP rank of one batch must share: num_reqs, num_reqs_padded, seq_lens, query_start_loc,
    num_tokens_padded and the graph mode (the last three where recorded). Sets are the k-th recording of
    each rank in one (step, site, micro-batch); the majority's values are the reference (a tie: the lowest
    rank's). One finding per set, at the first observation of a differing rank, naming every differing
    rank and its first differing field.

    Vectorised in two passes: every observation is compared exactly with the member before it in its set
    (rank_pairs; a clean dump ends here); only the members of sets that differ are hashed and grouped to
    find the majority. Python runs per finding only. `pairs` and `seq_differ` (the observations whose
    seq_lens rows differ from their pair's) come from the scan, which compares the rows as it reads them
    (replay); without them the rows are read here."""
    if d.config.dcp_size == 1 or d.n == 0:
        return []
    idx = np.arange(d.n, dtype=np.int64)
    sets, pairs = pairs if pairs is not None else rank_pairs(d)
    size = np.bincount(sets)
    has = pairs >= 0
    other = np.where(has, pairs, idx)
    scalars = {"num_reqs": "obs.num_reqs", "num_reqs_padded": "obs.num_reqs_padded",
               "num_tokens_padded": "obs.num_tokens_padded", "graph": "obs.graph"}
    ragged_cols = {"seq_lens": ("obs.rows", "rows.seq_lens"), "query_start_loc": ("obs.qsl", "rows.query_start_loc")}
    names = [f for f in _AGREE if (f in scalars and d.has(scalars[f])) or (f in ragged_cols and
                                                                          d.has(ragged_cols[f][0]))]
    differ = np.zeros(d.n, bool)
    for f in names:
        if f in scalars:
            differ |= d[scalars[f]] != d[scalars[f]][other]
        elif f == "seq_lens" and seq_differ is not None:
            differ[seq_differ] = True
        else:
            p = np.flatnonzero(has)
            differ[p[rows_differ(d, *ragged_cols[f], p, other[p])]] = True
    bad = np.unique(sets[differ & (size[sets] >= 2)])
    if bad.size == 0:
        return []
    m = np.flatnonzero(np.isin(sets, bad))  # members of the sets that disagree
    cols: dict[str, list[np.ndarray]] = {}
    for f in names:
        if f in scalars:
            cols[f] = [d[scalars[f]][m].astype(np.int64)]
        else:
            offs_key, rows_key = ragged_cols[f]
            cols[f] = [np.diff(d[offs_key])[m], _row_hashes(d, offs_key, rows_key, m)]
    sm = sets[m]
    tup = group_ids([sm] + [c for f in names for c in cols[f]])  # one id per (set, values)
    count = np.bincount(tup)
    rank = d["obs.rank"][m].astype(np.int64)
    # the reference of each set: most members, then the lowest rank, then the earliest
    order = np.lexsort((m, rank, -count[tup], sm))
    first = np.ones(m.size, bool)
    first[1:] = sm[order][1:] != sm[order][:-1]
    ref = np.empty(int(sm.max()) + 1, np.int64)
    ref[sm[order][first]] = order[first]  # a position in m
    odd_all = tup != tup[ref[sm]]
    # each member's first field that differs from its set's reference (names order), all at once
    refk = ref[sm]
    diff = np.stack([np.any([c != c[refk] for c in cols[f]], axis=0) for f in names])  # [fields, members]
    first_f = np.argmax(diff, axis=0)
    # members grouped by set once (a stable sort: positions in m stay in order), sliced per finding
    by_set = np.argsort(sm, kind="stable")
    sm_sorted = sm[by_set]
    out: list[Issue] = []
    for sset in np.unique(sm[odd_all]).tolist():
        members = by_set[np.searchsorted(sm_sorted, sset, "left"):np.searchsorted(sm_sorted, sset, "right")]
        r0 = int(ref[sset])
        odd = [int(k) for k in members[odd_all[members]]]
        parts, fields = [], {}
        for k in odd:
            f = names[int(first_f[k])]
            fields[int(rank[k])] = f
            parts.append(f"rank {int(rank[k])} {f} {_agree_value(d, int(m[k]), f)}")
        k = odd[0]
        f = fields[int(rank[k])]
        i0 = int(m[r0])
        msg = (f"ranks disagree on what every rank of this batch must share: {'; '.join(parts)}; rank "
               f"{int(rank[r0])} (obs {int(d.file_obs[i0])}) and the majority have {f} {_agree_value(d, i0, f)} "
               f"(ranks {', '.join(str(int(rank[x])) for x in odd)} differ)")
        out.append(Issue(int(m[k]), "rank-agree", msg, {"detail": {
            "field": f, "ranks": [int(rank[x]) for x in odd], "fields": {str(r): v for r, v in fields.items()},
            "obs": [int(d.file_obs[m[x]]) for x in members], "reference_obs": int(d.file_obs[i0])}}))
    return out


def _row_hashes(d: Dump, offs_key: str, rows_key: str, idx: np.ndarray, step: int = 1 << 16) -> np.ndarray:
    """A 64-bit hash of the rows of each observation in idx (value and position; a 0 hashes like any
    value), in chunks of about `step` rows so a huge dump is hashed in bounded memory."""
    offs = d[offs_key]
    lens = np.diff(offs)[idx]
    out = np.zeros(idx.size, np.int64)
    for lo, hi in _obs_chunks(lens, step):
        cnt = lens[lo:hi]
        _, j, at = ragged(offs[idx[lo:hi]], cnt)
        v = d.take(rows_key, at).astype(np.int64) + 1  # (mix hashes 0 as 0: shift so a 0 row counts)
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
    key = {"num_reqs": "obs.num_reqs", "num_reqs_padded": "obs.num_reqs_padded",
           "num_tokens_padded": "obs.num_tokens_padded", "graph": "obs.graph"}[field]
    return str(int(d[key][i]))
