"""DESIGN §3 in one file: the rule table, every check, and Finding (over 450 lines: issue 14 wants a rule's
detection, message and fault in one file, found from its name).

The table says per rule: severity, its one-letter timeline code, the columns it needs (without them the
check is skipped and the report says so), the check that detects it, and the simulated faults (runner.py /
simulate.py) that must produce it. Checks are vectorised over the dump with numpy (sorts, gathers,
segment reductions); Python runs only per problem found. A finding's message says what is wrong; where
(step, site, rank, micro-batch) is a field that renderers compose (Finding.where, Finding.message).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from dcptool.dump import Dump
from dcptool.provenance import Provenance, Source, expected_of
from dcptool.reference import local_of
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
# Findings


@dataclass(frozen=True)
class Finding:
    rule: str
    index: int  # position in the merged dump (observation order)
    obs: int  # index in its file
    file: str
    step: int
    site: str
    rank: int
    ubatch: int
    row: int | None
    recorded: int | None
    expected: int | None
    wrong_rows: int
    text: str  # what is wrong; `message` prefixes where
    source: Source | None = None
    detail: dict = dataclasses.field(default_factory=dict)

    @property
    def severity(self) -> str:
        return SEVERITY[self.rule]

    @property
    def where(self) -> str:
        return f"step {self.step} {self.site} rank {self.rank}" + (f" ubatch {self.ubatch}" if self.ubatch >= 0 else "")

    @property
    def message(self) -> str:
        """The one-line message: where, then what (the JSON "message")."""
        return f"{self.where}: {self.text}"

    def to_json(self) -> dict:
        return {"type": "finding", "rule": self.rule, "severity": self.severity, "obs": self.obs,
                "file": self.file, "step": self.step, "site": self.site, "rank": self.rank,
                "ubatch": self.ubatch, "row": self.row, "recorded": self.recorded, "expected": self.expected,
                "wrong_rows": self.wrong_rows, "source": None if self.source is None else self.source.to_json(),
                "detail": self.detail, "message": self.message}


def _mk(d: Dump, i: int, rule: str, text: str, *, row=None, recorded=None, expected=None, wrong_rows=0,
        source=None, detail=None) -> Finding:
    return Finding(rule=rule, index=int(i), obs=int(d.file_obs[i]), file=d.file_of(i), step=int(d["obs.step"][i]),
                   site=d.site_name(i), rank=int(d["obs.rank"][i]), ubatch=int(d["obs.ubatch"][i]),
                   row=None if row is None else int(row), recorded=None if recorded is None else int(recorded),
                   expected=None if expected is None else int(expected), wrong_rows=int(wrong_rows),
                   text=text, source=source, detail=detail or {})


_EXPLAIN = {
    "parent-rows": "copied from the parent batch (obs {obs}, {site}); recompute from the micro-batch's own seq_lens",
    "earlier-in-step": "derived from an earlier batch of this step (obs {obs}, {site}), e.g. the global batch "
                       "before the PCP partition; compute it from the final batch",
    "earlier-step": "left over from step {step} (obs {obs}, {site}); the buffer was not refreshed "
                    "(e.g. baked into a CUDA graph)",
}


def _value_finding(d: Dump, prov: Provenance, i: int, n_wrong: int, first: int) -> Finding:
    c = d.config
    nr = int(d["obs.num_reqs"][i])
    view = d.dcp_of(i)
    rec = np.asarray(view[: min(view.size, nr)], np.int64)
    exp = expected_of(d, i, nr)
    rule, src, detail = prov.explain(i, rec)
    kw = dict(row=first, recorded=rec[first], expected=exp[first], wrong_rows=n_wrong, source=src, detail=detail)
    rows = f"row {first} is {rec[first]}, expected {exp[first]} ({n_wrong} wrong row{'s' if n_wrong > 1 else ''})"
    if rule == "stale":
        why = _EXPLAIN[src.relation].format(obs=src.obs, site=src.site, step=src.step)
        msg = f"stale DCP view, {why}; {rows}"
    elif rule == "global":
        msg = f"DCP view holds the global seq_lens, not this rank's local lengths; {rows}"
    elif rule == "wrong-rank":
        msg = f"DCP view holds rank {detail['rank']}'s local lengths; pass this rank's dcp_rank; {rows}"
    elif rule == "wrong-interleave":
        msg = (f"DCP view was computed with interleave {detail['interleave']}, the dump's is "
               f"{c.cp_interleave} (check cp_kv_cache_interleave_size); {rows}")
    else:
        msg = rows
    return _mk(d, i, rule, msg, **kw)


def _page_finding(d: Dump, i: int, n_bad: int, j: int) -> Finding:
    c = d.config
    page = c.page_size
    seq = int(d.seq_lens_of(i)[j])
    local = local_of(seq, int(d["obs.rank"][i]), c.dcp_size, c.cp_interleave)  # Python ints: no numpy call
    claimed, ok, glob = int(d.kv_pages_of(i)[j]), -(-local // page), -(-seq // page)
    why = " = the global count: page counts were computed from the global length" if claimed == glob else ""
    msg = (f"attention plan claims {claimed} pages for row {j}{why}; this rank owns {ok} "
           f"(cdiv(local {local}, {page}))")
    return _mk(d, i, "pages", msg, row=j, recorded=claimed, expected=ok, wrong_rows=n_bad,
               detail={"claimed": claimed, "allowed": ok, "global": glob})


def check_values(d: Dump, prov: Provenance, st: Stats) -> list[tuple[int, Finding]]:
    """Wrong real rows (the scan's n_wrong): explained by provenance (stale, global, wrong-rank,
    wrong-interleave) or a mismatch; `prov` has been prepared for these observations."""
    return [(i, _value_finding(d, prov, i, n, j))
            for i, n, j in d.every(zip(st.obs.tolist(), st.n_wrong.tolist(), st.first_wrong.tolist())) if n]


def check_missing(d: Dump) -> list[tuple[int, Finding]]:
    found = []
    for i in np.flatnonzero(~d["obs.has_dcp"].astype(bool)):
        msg = (f"dcp_local_seq_lens is None with dcp_size {d.config.dcp_size}; attention metadata would fail "
               "with 'NoneType' object is not subscriptable")
        found.append((int(i), _mk(d, i, "missing", msg)))
    return found


def check_padding(d: Dump, st: Stats) -> list[tuple[int, Finding]]:
    found = []
    for i, n, j in d.every(zip(st.obs.tolist(), st.n_pad.tolist(), st.first_pad.tolist())):
        if n:
            rec = int(d.dcp_of(i)[j])
            msg = (f"padded row {j} holds {rec}, must be 0 "
                   f"({n} bad padded row(s); rows >= num_reqs {int(d['obs.num_reqs'][i])})")
            found.append((i, _mk(d, i, "padding", msg, row=j, recorded=rec, expected=0, wrong_rows=n)))
    return found


def check_shape(d: Dump) -> list[tuple[int, Finding]]:
    found = []
    has = d["obs.has_dcp"].astype(bool)
    nrp = d["obs.num_reqs_padded"]
    dlen = np.diff(d["obs.dcp_rows"])
    for i in np.flatnonzero(has & (dlen != nrp)):
        msg = f"DCP view has {int(dlen[i])} rows, must have num_reqs_padded = {int(nrp[i])}"
        found.append((int(i), _mk(d, i, "shape", msg, detail={"length": int(dlen[i]),
                                                              "expected_length": int(nrp[i])})))
    return found


def check_stray(d: Dump) -> list[tuple[int, Finding]]:
    found = []
    for i in np.flatnonzero(d["obs.has_dcp"].astype(bool)):
        msg = "a DCP view is present with dcp_size 1; the engine should pass None"
        found.append((int(i), _mk(d, i, "stray", msg)))
    return found


def check_pages(d: Dump, st: Stats) -> list[tuple[int, Finding]]:
    return [(i, _page_finding(d, i, n, j))
            for i, n, j in d.every(zip(st.obs.tolist(), st.n_pages.tolist(), st.first_pages.tolist())) if n]


def findings_of(d: Dump, issues: list[Issue]) -> list[tuple[int, Finding]]:
    return [(i, _mk(d, i, rule, text, **kw)) for i, rule, text, kw in issues]


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


def check_alias(d: Dump) -> list[Issue]:
    """Micro-batches of one step sharing a DCP buffer; full-graph replays reading another buffer
    than their capture (same file, rank, num_reqs_padded and micro-batch)."""
    out: list[Issue] = []
    buf, ub, has = d["obs.buffer"], d["obs.ubatch"].astype(np.int64), d["obs.has_dcp"]
    fidx, rank, step = d.file_index.astype(np.int64), d["obs.rank"].astype(np.int64), d["obs.step"]
    sel = np.flatnonzero((ub >= 0) & (has == 1) & (buf != 0))
    if sel.size:
        order, run = _segments([buf[sel], rank[sel], step[sel], fidx[sel]])
        s = sel[order]
        # same step, rank and buffer as an earlier member of its run, but another micro-batch
        first = s[run]
        for k in np.flatnonzero(ub[s] != ub[first]):
            i, j = int(s[k]), int(first[k])
            msg = (f"micro-batch {int(ub[i])} reads the same DCP buffer as micro-batch {int(ub[j])} "
                   f"(obs {int(d.file_obs[j])}); each micro-batch needs its own buffer")
            out.append(Issue(i, "alias", msg, {"detail": {"buffer": int(buf[i]), "other_obs": int(d.file_obs[j])}}))
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
            for k in bad:
                i, j = int(s[k]), int(s[last[k]])
                msg = (f"full-graph replay reads DCP buffer {int(buf[i]):#x} but the graph was "
                       f"captured on {int(buf[j]):#x} (obs {int(d.file_obs[j])}); the replay sees stale values")
                out.append(Issue(i, "alias", msg, {"detail": {"buffer": int(buf[i]), "captured": int(buf[j]),
                                                         "capture_obs": int(d.file_obs[j])}}))
    return out


def _kth_per_rank(batch: np.ndarray, rank: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Set ids for members of cross-rank groups: in each batch the k-th member of every rank (in `idx` order,
    i.e. observation order) joins the k-th set."""
    from dcptool.provenance import _group_ids

    order = np.lexsort((idx, rank, batch))
    new = np.ones(idx.size, bool)
    new[1:] = (batch[order][1:] != batch[order][:-1]) | (rank[order][1:] != rank[order][:-1])
    starts = np.flatnonzero(new)
    occ = np.empty(idx.size, np.int64)
    occ[order] = np.arange(idx.size) - np.repeat(starts, np.diff(np.append(starts, idx.size)))
    return _group_ids([batch, occ])


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


def merge_split_findings(d: Dump, findings: list[Finding], splits: list) -> list[Finding]:
    """Recorded micro-batches of a re-split batch (`--split`: replay.Split) must match the split
    (else `ubatch-slice`)."""
    if not d.has("obs.parent") or not splits:
        return findings
    by_parent = {(s.parent, s.ubatch): s for s in splits}
    have = {(f.index, f.rule) for f in findings}
    extra = []
    k = max(x.ubatch for x in splits) + 1
    par, ub = d["obs.parent"], d["obs.ubatch"]
    for i in np.flatnonzero((ub >= 0) & (par >= 0)):
        s = by_parent.get((int(par[i]), int(ub[i])))
        if s is None or (int(i), "ubatch-slice") in have:
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
            detail = {"field": f, "parent_obs": s.parent_obs, "split": True}
            extra.append(_mk(d, i, "ubatch-slice", msg, detail=detail))
    if not extra:
        return findings
    return sorted(findings + extra, key=lambda f: (f.index, RULE_ORDER[f.rule]))


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
    pos = d["rows.positions"].astype(np.int64)
    slot = d["rows.slot_mapping"].astype(np.int64)
    grp = d["rows.slot_group"].astype(np.int64)
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


def _group_name(d: Dump, g: int) -> str:
    kv = d.config.kv_groups
    return f"{g} ({kv[g].name})" if kv is not None and g < len(kv) else str(g)


def check_slots(d: Dump) -> list[Issue]:
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


def check_slot_partition(d: Dump) -> list[Issue]:
    """Across the N ranks of one (step, site, micro-batch, KV-cache group) recorded on every rank (the k-th
    recording of each rank makes the k-th set), each real token of a DCP-sharded group must be written by
    exactly one rank. A position written by several ranks is reported at the ranks that do not own it, one
    written by none at its owner (so the finding sits where the write went wrong). Sets whose ranks write
    nothing at all (dummy runs, capture) are not asked to."""
    from dcptool.provenance import _group_ids

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


def _few(a: np.ndarray, k: int = 6) -> str:
    v = [int(x) for x in a[:k]]
    return ", ".join(map(str, v)) + (f", ... ({a.size} in all)" if a.size > k else "")
