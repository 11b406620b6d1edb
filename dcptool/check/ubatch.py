"""The ubatch-slice rule: a recorded micro-batch is its recorded parent sliced where the engine splits it."""

from __future__ import annotations

import numpy as np

from dcptool.check.findings import FindingTable, Written
from dcptool.dcp.rules import RULES
from dcptool.dcp.segments import ragged
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


class _Slices:
    """The recorded micro-batches to check (those with a recorded parent and bounds, both with query_start_loc),
    split into those whose requests run past their parent's (`over`) and the rest (`cand`, with their parent `p`,
    num_reqs_padded, req_start `r0` and token bounds `ts0`, `te0`)."""

    def __init__(self, d: Dump):
        par, ub = d["obs.parent"], d["obs.ubatch"]
        rs, ts, te = (d[k].astype(np.int64) for k in ("obs.req_start", "obs.tok_start", "obs.tok_stop"))
        self.qlen = qlen = np.diff(d["obs.qsl"])
        cand = np.flatnonzero((ub >= 0) & (par >= 0) & (rs >= 0) & (ts >= 0) & (te >= 0) & (qlen > 0))
        if cand.size:
            cand = cand[qlen[par[cand]] > 0]
        p = par[cand]
        nrp = d["obs.num_reqs_padded"][cand].astype(np.int64)
        r0 = rs[cand]
        over = (r0 + nrp > qlen[p] - 1) | (r0 + nrp > np.diff(d["obs.rows"])[p])
        self.over = cand[over]
        ok = ~over
        self.cand, self.p, self.nrp, self.r0 = cand[ok], p[ok], nrp[ok], r0[ok]
        self.ts0, self.te0 = ts[cand][ok], te[cand][ok]


def check_ubatch_slice(d: Dump, engine_version: str | None = None) -> FindingTable:
    """A recorded micro-batch must equal slicing its recorded parent at its recorded bounds (§1):
    qsl = clamp(parent qsl[rs:rs+nrp+1] - ts, 0, te - ts); seq_lens = parent rows [rs, rs+nrp),
    the last reduced by max(0, parent qsl[rs+nrp] - te); num_reqs = max(0, min(rs+nrp, parent) - rs).
    When the dump (or `engine_version`) names the engine version, the recorded bounds must also be
    where that version splits (_check_split_points); a dump that names none is sliced as recorded.
    One finding per micro-batch: its bounds first, then the first field that disagrees."""
    found = Written(d)
    s = _Slices(d)
    par = d["obs.parent"]
    for i in s.over:
        r = int(d["obs.req_start"][i])
        msg = f"requests [{r}, {r + int(d['obs.num_reqs_padded'][i])}) run past the parent's {int(s.qlen[par[i]]) - 1}"
        found.add(int(i), "ubatch-slice", msg, detail={"field": "req_stop"})
    if s.cand.size == 0:
        return found.table()
    bounds = _check_split_points(d, s.cand, engine_version) if parse_engine_version(engine_version) else {}
    for i, (field, _, rec, exp, k) in bounds.items():
        msg = (f"{field} is {rec}, but vLLM {engine_version} splits this batch (obs {d.ref(par[i])}) into {k} "
               f"micro-batches with {field} {exp}")
        found.add(i, "ubatch-slice", msg, recorded=rec, expected=exp, detail={
            "field": field, "parent_obs": int(d.file_obs[par[i]]), "ubatches": k, "engine_version": engine_version})
    bad_obs = _slice_disagreements(d, s)
    idx = {int(c): k for k, c in enumerate(s.cand)}
    for i in sorted(set(bad_obs) - set(bounds)):
        field, row, rec, exp = bad_obs[i]
        k = idx[i]
        msg = (f"{field} disagrees with slicing the parent (obs {d.ref(s.p[k])}) at requests "
               f"[{int(s.r0[k])}, {int(s.r0[k] + s.nrp[k])}) tokens [{int(s.ts0[k])}, {int(s.te0[k])}): "
               + (f"row {row} is {rec}, slicing gives {exp}" if row is not None else f"{rec}, slicing gives {exp}"))
        found.add(i, "ubatch-slice", msg, row=row, recorded=rec, expected=exp, wrong_rows=1,
                  detail={"field": field, "parent_obs": int(d.file_obs[s.p[k]])})
    return found.table()


def _slice_disagreements(d: Dump, s: _Slices) -> dict[int, tuple]:
    """Per micro-batch of s.cand whose fields disagree with slicing its parent: its first disagreement (field,
    row or None, recorded, sliced) in the order num_reqs, query_start_loc, seq_lens."""
    cand, p, nrp, r0 = s.cand, s.p, s.nrp, s.r0
    qo, rows, q = d["obs.qsl"], d["obs.rows"], d["rows.query_start_loc"]
    out: dict[int, tuple] = {}
    want_nr = sliced_num_reqs(r0, nrp, d["obs.num_reqs"][p].astype(np.int64))
    for k in np.flatnonzero(want_nr != d["obs.num_reqs"][cand]):
        out[int(cand[k])] = ("num_reqs", None, int(d["obs.num_reqs"][cand[k]]), int(want_nr[k]))
    # query_start_loc: nrp + 1 values each (only where the recorded length matches)
    qlen = s.qlen[cand]
    seg, j, _ = ragged(np.zeros(cand.size, np.int64), np.where(qlen == nrp + 1, nrp + 1, 0))
    got = q[qo[cand][seg] + j].astype(np.int64)
    want = sliced_query_start_loc(q[qo[p][seg] + r0[seg] + j].astype(np.int64), s.ts0[seg], s.te0[seg])
    for k in np.flatnonzero(got != want):
        out.setdefault(int(cand[seg[k]]), ("query_start_loc", int(j[k]), int(got[k]), int(want[k])))
    for k in np.flatnonzero(qlen != nrp + 1):
        out.setdefault(int(cand[k]), ("query_start_loc", None, int(qlen[k]), int(nrp[k]) + 1))
    # seq_lens: nrp rows each, the last reduced by the tokens of that request after te. The reader
    # accepts a micro-batch with fewer seq_lens rows than num_reqs_padded (only num_reqs are required):
    # compare the rows it has, and report the short ones below rather than read past them.
    have = np.diff(rows)[cand]
    seg, j, _ = ragged(np.zeros(cand.size, np.int64), np.minimum(nrp, have))
    got = d.take("rows.seq_lens", rows[cand][seg] + j).astype(np.int64)
    want = d.take("rows.seq_lens", rows[p][seg] + r0[seg] + j).astype(np.int64)
    cut = sliced_last_cut(q[qo[p] + r0 + nrp].astype(np.int64), s.te0)
    last = j == nrp[seg] - 1
    want[last] -= cut[seg[last]]
    for k in np.flatnonzero(got != want):
        out.setdefault(int(cand[seg[k]]), ("seq_lens", int(j[k]), int(got[k]), int(want[k])))
    for k in np.flatnonzero(have < nrp):
        out.setdefault(int(cand[k]), ("seq_lens", None, int(have[k]), int(nrp[k])))
    return out


def merge_split_findings(d: Dump, findings: FindingTable, splits: list) -> FindingTable:
    """Recorded micro-batches of a re-split batch (`--split`: replay.Split) must match the split
    (else `ubatch-slice`)."""
    if not d.has("obs.parent") or not splits:
        return findings
    by_parent = {(s.parent, s.ubatch): s for s in splits}
    have = set(findings.index[findings.rule_code == RULES.index("ubatch-slice")].tolist())
    extra = Written(d)
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
                   f"(obs {d.ref(s.parent)}): {f} is {rec}, the split gives {want}")
            extra.add(int(i), "ubatch-slice", msg, detail={"field": f, "parent_obs": s.parent_obs, "split": True})
    if not extra.index:
        return findings
    return FindingTable.concat(d, [findings, extra.table()])
