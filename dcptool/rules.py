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

import sys
import threading
import weakref
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from dcptool.dump import Dump
from dcptool.findings import (
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
from dcptool.provenance import KINDS, Provenance
from dcptool.reference import local_np, local_of
from dcptool.scan import rows_differ
from dcptool.schema import GraphMode
from dcptool.segments import group_ids, join, mix, ragged, seg_sums
from dcptool.segments import obs_chunks as _obs_chunks
from dcptool.slicing import (
    first_disagreement,
    parse_engine_version,
    request_boundary_splits,
    sliced_last_cut,
    sliced_num_reqs,
    sliced_query_start_loc,
    splits_on_request_boundary,
    ubatch_bounds,
)

if TYPE_CHECKING:
    from dcptool.scan import Stats


class Rule(NamedTuple):
    name: str
    severity: str  # error or warning
    code: str  # one character in the timeline, distinct even ignoring case (initials collide: stale/stray/shape,
    #            missing/mismatch, padding/pages); the legend under the timeline spells them out
    needs: tuple[str, ...]  # columns it needs beyond the required ones (DESIGN §2)
    check: str  # the function of this module that detects it
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
         "check_slots", ("slot-wrong-group",)),
    Rule("slot-partition", "error", "O", ("obs.slots", "rows.positions", "rows.slot_mapping", "rows.slot_group"),
         "check_slot_partition", ("slot-all-ranks",)),
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
    seq = d.take("rows.seq_lens", at).astype(np.int64)
    h = [seg_sums(mix(seq, j, salt), nr[m]) for salt in (0, 1)]
    batch = group_ids([k[m] for k in key] + [x.view(np.int64) for x in h])
    # the hash groups equal seq_lens; confirm each member against its batch's first member exactly
    first = np.full(int(batch.max(initial=-1)) + 1, np.iinfo(np.int64).max)
    np.minimum.at(first, batch, np.arange(m.size))
    ref = first[batch][seg]
    same = np.ones(m.size, bool)
    np.logical_and.at(same, seg, seq == seq[(np.cumsum(nr[m]) - nr[m])[ref] + j])
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
    sg, jj, at = ragged(d["obs.dcp_rows"][mm], n[g])
    total = np.zeros(int(n.sum()), np.int64)
    base = np.repeat(np.cumsum(n) - n, n)  # each set's first row in total
    row_of = (np.cumsum(n) - n)[g[sg]] + jj
    np.add.at(total, row_of, d.take("rows.dcp_local_seq_lens", at).astype(np.int64))
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
    fits_real = ((nd == a2) | (nd == b2)) & (~full | ~graph)  # (a FULL graph runs the padded batch)
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
# --------------------------------------------------------------------------------------------
# issue 15 item 3: which rank writes each KV slot (slots, slot-partition)
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

_SLOT_NEEDS = ("obs.slots", "rows.positions", "rows.slot_mapping", "rows.slot_group")
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
    return order, grp, _merged(chg, obs_start)


def _merged(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The sorted union of two int arrays as int64 (np.union1d's hashing costs more on these small arrays)."""
    c = np.concatenate((a, b)).astype(np.int64)
    c.sort()
    return c[np.r_[True, c[1:] != c[:-1]]] if c.size else c


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


def _pow2(x) -> bool:
    return bool(np.all((x > 0) & (x & (x - 1) == 0)))


def _log2(x: int) -> int:
    return int(x).bit_length() - 1


_BYTE_SUM = np.uint64(0x0101010101010101)  # (x * this) >> 56: the sum of x's 8 bytes where each is 0 or 1


def _true_before(w: np.ndarray, start: np.ndarray) -> np.ndarray:
    """For each k (start sorted, start[0] == 0, each < w.size // 8 * 8): how many of w[:start[k]] are True. `w`
    is a bool array of whole 8-byte words (its padding False). Summed 8 entries per word (little-endian):
    np.add.reduceat with a cast pays about a microsecond per run, np.flatnonzero a pass of its own."""
    if sys.byteorder != "little":
        return np.searchsorted(np.flatnonzero(w), start)
    words = w.view(np.uint64)
    per = ((words * _BYTE_SUM) >> np.uint64(56)).view(np.int64)
    q = start >> 3
    new = np.ones(q.size, bool)
    np.not_equal(q[1:], q[:-1], out=new[1:])
    qu = q[new]
    cum = np.cumsum(np.add.reduceat(per, qu)) - np.add.reduceat(per, qu)  # per[qu[0]:qu[i]] (qu[0] == 0)
    part = words[q] & ((np.uint64(1) << (start & 7).astype(np.uint64) * np.uint64(8)) - np.uint64(1))
    return cum[np.cumsum(new) - 1] + ((part * _BYTE_SUM) >> np.uint64(56)).view(np.int64)


class _SlotScreen(NamedTuple):
    """Per run of a chunk, from the screen (one pass of cheap whole-chunk operations)."""
    clean: np.ndarray  # exact: no value below -1, no padded write, and its real tokens' writes are exactly the
    #                    positions it owns (every one in a replicated group) or none at all: slot-partition's fact
    suspect: np.ndarray  # may have a slots finding (not clean, or a written slot off its offset or written twice)
    writes: np.ndarray  # some real token writes a slot


def _slot_screen(pos: np.ndarray, slot: np.ndarray, start: np.ndarray, run_len: np.ndarray, r_rank: np.ndarray,
                 r_sh: np.ndarray, r_bs: np.ndarray, nr: np.ndarray, N: int, I_: int) -> _SlotScreen:
    """Which runs of a chunk (Recorder's layout: each run's entries consecutive) can have a finding. Most
    entries of a correct build are fine, so the exact kind/offset/duplicate work (_slot_findings) is left to
    the observations this flags; the screen only has to never miss one. A few whole-chunk passes on int32/bool
    (shifts and masks where N, I and B are powers of two: numpy's % costs several times a mask); the per-run
    facts are counts of the passes' True entries before each run's start, real/padding boundary and end
    (_true_before), not per-entry spreads of them."""
    n = slot.size
    wpad = np.empty((n // 8 + 1) * 8, bool)  # (whole words, one past the end, for _true_before)
    wpad[n:] = False
    w = wpad[:n]
    np.greater_equal(slot, 0, out=w)
    pts = np.append(np.stack([start, start + nr], 1).ravel(), n)  # sorted: start <= real end <= next start
    cw = _true_before(wpad, pts)
    w_real, w_pad = cw[1::2] - cw[:-1:2], cw[2::2] - cw[1::2]
    writes = w_real > 0
    # a run that writes must write every real token it owns (all of them in a replicated group) and nothing else;
    # one that does not must write nothing at all (padding included)
    clean = w_pad == 0
    known = (r_bs > 0) & (~r_sh | (r_bs % I_ == 0)) & writes  # offsets: where vLLM's precondition holds
    sh = r_sh & writes
    # where N, I and the block sizes are powers of two with B N <= 2**16, ownership and offsets depend on the
    # low 16 bits of position and slot only: work on those (uint16, a quarter of the memory traffic)
    lo16 = (sys.byteorder == "little" and _pow2(N) and _pow2(I_) and _pow2(r_bs[known])
            and int(r_bs[known].max(initial=1)) * N * I_ <= 1 << 16)
    if lo16:
        pos, slot = np.ascontiguousarray(pos), np.ascontiguousarray(slot)  # (views of int32 as uint16 pairs)
    p = pos.view(np.uint16)[::2].copy() if lo16 else pos.astype(np.int64)
    if sh.any():
        own = np.bitwise_and(p >> _log2(I_) if I_ > 1 else p, N - 1) if lo16 else p // I_ % N
        xpad = np.empty_like(wpad)
        xpad[n:] = False
        x = xpad[:n]
        np.equal(own, np.repeat(r_rank.astype(own.dtype), run_len), out=x)
        np.not_equal(x, w, out=x)  # owned but not written, or written but not owned
        cx = _true_before(xpad, pts)
        clean &= ~writes | np.where(r_sh, cx[1::2] == cx[:-1:2], w_real == nr)
    else:
        clean &= ~writes | (w_real == nr)
    if n and int(np.minimum.reduce(slot)) < -1:
        clean &= ~np.logical_or.reduceat(slot < -1, start)
    suspect = ~clean | (r_rank < 0) | (r_rank >= N)  # (a rank out of range: compared on its low bits below)
    # vLLM's offset of position p in a block of B is congruent mod B to f(p) = p in a replicated group and to
    # (p // (I N)) * I + p % I in a sharded one, so a slot at the right offset has (slot - f(p)) % B == 0
    # (uint16 arithmetic wraps modulo 2**16, which keeps residues modulo a power of two <= 2**16)
    if known.any():
        if not r_sh.any():
            f = p.copy()
        else:
            if not lo16:
                f = p // (I_ * N) * I_ + p % I_
            elif I_ == 1:
                f = p >> _log2(N)
            else:
                f = ((p >> _log2(I_ * N)) << _log2(I_)) | (p & (I_ - 1))
            if not r_sh.all():
                np.copyto(f, p, where=np.repeat(~r_sh, run_len))
        np.subtract(slot.view(np.uint16)[::2] if lo16 else slot, f, out=f)
        b = r_bs[known]
        if not lo16:
            f %= np.repeat(np.where(known, r_bs, 1), run_len)
        elif known.all() and b.min() == b.max():
            f &= int(b[0]) - 1
        else:
            f &= np.repeat(np.where(known, r_bs - 1, 0).astype(np.uint16), run_len)
        off = f != 0
        off &= w
        suspect |= np.logical_or.reduceat(off, start)
    # duplicates (in the runs not suspect already): the written slots of a run split into strictly increasing
    # segments (one per request in a typical build); segments whose value ranges do not overlap share no slot
    if suspect.all():
        return _SlotScreen(clean, suspect, writes)
    if suspect.any():
        np.logical_and(w, np.repeat(~suspect, run_len), out=w)
        cw = _true_before(wpad, pts)
    sc = slot[w]
    if sc.size > 1:
        cut = np.flatnonzero(sc[1:] <= sc[:-1]) + 1
        if cut.size:
            rs = cw[:-1:2]  # each run's first written entry in sc
            seg = _merged(rs[rs < sc.size], cut)  # (the runs' starts and the cuts)
            suspect[_overlapping(sc, seg, np.searchsorted(rs, seg, "right") - 1)] = True
    return _SlotScreen(clean, suspect, writes)


def _overlapping(sc: np.ndarray, seg: np.ndarray, s_run: np.ndarray) -> np.ndarray:
    """Written slots `sc` (0 <= slot < 2**31) in strictly increasing segments starting at `seg`, of runs `s_run`:
    the runs two of whose segments' value ranges overlap (the others cannot write a slot twice)."""
    s_lo, s_hi = sc[seg], sc[np.append(seg[1:], sc.size) - 1]
    o = np.lexsort((s_lo, s_run))
    s_run, s_lo = s_run[o], s_lo[o]
    top = np.maximum.accumulate(s_run.astype(np.int64) << 32 | s_hi[o])  # highest slot so far in the run
    return s_run[1:][(s_run[1:] == s_run[:-1]) & (s_lo[1:] <= (top[:-1] & 0xFFFFFFFF))]


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


def _slot_pass(d: Dump, members: bool = True) -> tuple[list[Issue], _SlotMembers | None]:
    """One pass over the slot entries in chunks of about SLOT_CHUNK entries (whole observations; memory
    bounded by the chunk, not the dump): check_slots' findings, and slot-partition's members (per run
    summaries) from the same reads. Each chunk is screened (_slot_screen); only the observations with a
    suspect run get the exact work (_slot_findings); a chunk not in the Recorder's layout gets it whole."""
    c = d.config
    N, I_ = c.dcp_size, c.cp_interleave
    offs = d["obs.slots"]
    out: list[Issue] = []
    parts = []
    if d.n == 0 or int(offs[-1]) == 0:
        return out, None
    real_tokens = _real_tokens(d)
    rank_all = d["obs.rank"]
    for lo, hi in _obs_chunks(np.diff(offs), SLOT_CHUNK):
        a, b = int(offs[lo]), int(offs[hi])
        if a == b:
            continue
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
            s = _slot_screen(pos, slot, start, run_len, r_rank, r_sh, r_bs, np.minimum(r_real, run_len), N, I_)
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
                out += _slot_findings(d, lo + sus, cnt[sus], grp0[e], pos[e], slot[e], real_tokens)
            else:
                out += _slot_findings(d, lo + np.arange(cnt.size), cnt, grp0, pos, slot, real_tokens)
        if members and N > 1:
            k = np.flatnonzero(r_sh)
            parts.append((lo + run_obs[k], grp[start[k]].astype(np.int64), r_real[k], first[k], span[k],
                          run_len[k], quiet[k], writes[k]))
    if not members or not parts:
        return out, None
    return out, _SlotMembers(*(np.concatenate(x) for x in zip(*parts)))


# One pass serves both slot rules: whichever of check_slots / check_slot_partition comes first on a dump computes
# check_slots' findings and slot-partition's members; the other takes them (replay runs the two on two threads
# at once: it waits for the first). A part asked for a second time, or columns changed since, computes afresh.
_SLOT_KEYS = ("obs.slots", "rows.positions", "rows.slot_mapping", "rows.slot_group", "obs.rank", "obs.qsl",
              "obs.num_reqs", "rows.query_start_loc")


class _SlotShared:
    def __init__(self, d: Dump) -> None:
        self.ref = weakref.ref(d)
        self.lock = threading.Lock()
        self.key: tuple | None = None
        self.result: tuple[list[Issue], _SlotMembers | None] = ([], None)
        self.taken: set[int] = set()


_SHARED: dict[int, _SlotShared] = {}
_SHARED_LOCK = threading.Lock()


def _shared_pass(d: Dump, part: int):
    """Part 0 (check_slots' findings) or 1 (slot-partition's members) of the dump's one pass."""
    with _SHARED_LOCK:
        s = _SHARED.get(id(d))
        if s is None or s.ref() is not d:
            s = _SHARED[id(d)] = _SlotShared(d)
            weakref.finalize(d, _SHARED.pop, id(d), None)
    with s.lock:
        key = (SLOT_CHUNK, id(d.config), d.n) + tuple(id(d.columns.get(k)) for k in _SLOT_KEYS)
        if s.key != key or part in s.taken:
            s.result, s.key, s.taken = _slot_pass(d), key, set()
        s.taken.add(part)
        out = s.result[part]
        if len(s.taken) == 2:  # both given out: nothing left to keep
            s.result, s.key = ([], None), None
        return out


def check_slots(d: Dump) -> list[Issue]:
    """Per observation: each token's slot against vLLM's ownership rule (module comment above): padded
    tokens and non-owners of a DCP-sharded position write -1; the owner, and every rank in a replicated
    group, writes a slot (unless the build writes nothing at all); where the group's block size is known, a
    slot sits at vLLM's local block offset; no two tokens of one build write the same slot.

    One screened pass in chunks (_slot_pass), shared with check_slot_partition on the same dump."""
    if d.config.dcp_size == 1:  # (no slot-partition to share the pass with)
        return _slot_pass(d, members=False)[0]
    return _shared_pass(d, 0)


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


def check_slot_partition(d: Dump) -> list[Issue]:
    """Across the N ranks of one (step, site, micro-batch, KV-cache group) recorded on every rank (the k-th
    recording of each rank makes the k-th set), each real token of a DCP-sharded group must be written by
    exactly one rank. A position written by several ranks is reported at the ranks that do not own it, one
    written by none at its owner (so the finding sits where the write went wrong). Sets whose ranks write
    nothing at all (dummy runs, capture) are not asked to.

    Bounded memory: the (observation, group) runs are summarised in chunks first (by the pass check_slots
    shares, _slot_pass), the sets formed from the summaries; a set whose members the screen found clean has
    no finding (below), the others' entries are gathered about SLOT_CHUNK entries' worth of whole sets at a
    time (a set's members can lie far apart in the file); per token a bincount, no sort. A finding keeps its
    first _SLOT_CAP positions of each kind and the counts."""
    c = d.config
    N, I_ = c.dcp_size, c.cp_interleave
    offs = d["obs.slots"]
    if N == 1 or d.n == 0 or int(offs[-1]) == 0:
        return []
    m = _shared_pass(d, 1)
    if m is None or m.obs.size == 0:
        return []
    m_obs, m_grp, m_real, m_first, m_span, m_len = m.obs, m.grp, m.real, m.first, m.span, m.length
    key = [d["obs.step"][m_obs], d["obs.site"][m_obs].astype(np.int64), d["obs.ubatch"][m_obs].astype(np.int64),
           m_grp, m_real, d["obs.num_reqs"][m_obs].astype(np.int64)]
    rank = d["obs.rank"].astype(np.int64)
    sets = _kth_per_rank(group_ids(key), rank[m_obs], m_obs)
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
