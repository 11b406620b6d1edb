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
from dcptool.reference import local_np
from dcptool.schema import GraphMode
from dcptool.segments import ragged
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


def check_rank_sum(d: Dump, wrong: np.ndarray) -> list[Issue]:
    """The same batch recorded with a view on all N ranks must add up to seq_len on each real row.

    The formula always adds up, so only batches with a wrong view on some rank can fail: groups
    are formed around the observations in `wrong` only. Members of a batch share (step, site,
    ubatch, num_reqs, real seq_lens); the k-th recording of each rank makes the k-th set, and the
    finding goes to the observation that completes it. Vectorised (sorts and joins on the key
    columns and a hash of the real seq_lens, confirmed exactly): no loop over members.
    """
    from dcptool.provenance import _group_ids, _join, _mix, _seg_sums

    N = d.config.dcp_size
    if N == 1 or wrong.size == 0:
        return []
    wrong = np.unique(np.asarray(wrong, np.int64))
    nr = d["obs.num_reqs"].astype(np.int64)
    key = [d["obs.step"], d["obs.site"].astype(np.int64), d["obs.ubatch"].astype(np.int64), nr]
    has = np.flatnonzero(d["obs.has_dcp"] == 1)
    has = has[np.isin(key[0][has], key[0][wrong])]  # (the step alone first: a sort of one column, not of four)
    ci, qi = _join([k[has] for k in key], [k[wrong] for k in key])
    m = has[np.isin(ci, qi)]  # recorded with a view, in a (step, site, ubatch, num_reqs) of a wrong one
    seg, j, at = ragged(d["obs.rows"][m], nr[m])
    seq = d.take("rows.seq_lens", at).astype(np.int64)
    h = [_seg_sums(_mix(seq, j, salt), nr[m]) for salt in (0, 1)]
    batch = _group_ids([k[m] for k in key] + [x.view(np.int64) for x in h])
    # the hash groups equal seq_lens; confirm each member against its batch's first member exactly
    first = np.full(int(batch.max(initial=-1)) + 1, np.iinfo(np.int64).max)
    np.minimum.at(first, batch, np.arange(m.size))
    ref = first[batch][seg]
    same = np.ones(m.size, bool)
    np.logical_and.at(same, seg, seq == seq[(np.cumsum(nr[m]) - nr[m])[ref] + j])
    m, batch = m[same], batch[same]
    rank = d["obs.rank"][m].astype(np.int64)
    order = np.lexsort((m, rank, batch))
    pos = np.ones(m.size, bool)
    pos[1:] = (batch[order][1:] != batch[order][:-1]) | (rank[order][1:] != rank[order][:-1])
    starts = np.flatnonzero(pos)
    occ = np.empty(m.size, np.int64)
    occ[order] = np.arange(m.size) - np.repeat(starts, np.diff(np.append(starts, m.size)))
    sets = _group_ids([batch, occ])  # the k-th recording of each rank of a batch
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
