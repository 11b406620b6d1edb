"""Rules across observations: micro-batch slicing, shared buffers, all ranks adding up (DESIGN §3).

Each check is vectorised over the dump with numpy (sorts, gathers, segment reductions); Python
runs only per problem found. Each returns (observation, rule, message, fields) tuples that
replay turns into findings.
"""

from __future__ import annotations

import numpy as np

from dcptool.dump import Dump, take

Issue = tuple[int, str, str, dict]


def where(d: Dump, i: int) -> str:
    ub = int(d["obs.ubatch"][i])
    return f"step {int(d['obs.step'][i])} {d.site_name(i)} rank {int(d['obs.rank'][i])}" + (
        f" ubatch {ub}" if ub >= 0 else "")


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
            msg = (f"{where(d, i)}: micro-batch {int(ub[i])} reads the same DCP buffer as micro-batch {int(ub[j])} "
                   f"(obs {int(d.file_obs[j])}); each micro-batch needs its own buffer")
            out.append((i, "alias", msg, {"detail": {"buffer": int(buf[i]), "other_obs": int(d.file_obs[j])}}))
    if "obs.graph" in d.columns:
        g = d["obs.graph"]
        sel = np.flatnonzero(((g == 2) | (g == 3)) & (buf != 0))
        if sel.size:
            nrp = d["obs.num_reqs_padded"].astype(np.int64)
            # Every buffer captured for a key counts: a drafter (DFlash) captures graphs of the same sizes on
            # its own buffers, and several PCP ranks of one DCP rank may share a file; only a replay whose
            # buffer no earlier capture of its key used reads stale values.
            _, key = np.unique(np.stack([fidx[sel], rank[sel], nrp[sel], ub[sel]]), axis=1, return_inverse=True)
            _, pair = np.unique(np.stack([key.ravel(), buf[sel]]), axis=1, return_inverse=True)
            key, pair = key.ravel(), pair.ravel()
            cap = g[sel] == 2
            big = np.iinfo(np.int64).max
            first_cap = np.full(int(pair.max()) + 1, big)
            np.minimum.at(first_cap, pair[cap], sel[cap])
            order, run = _segments([key])
            s = sel[order]
            pos = np.arange(s.size)
            last = np.maximum.accumulate(np.where(g[s] == 2, pos, run - 1))  # latest capture in the run so far
            bad = np.flatnonzero((g[s] == 3) & (last >= run) & (first_cap[pair[order]] > s))
            for k in bad:
                i, j = int(s[k]), int(s[last[k]])
                msg = (f"{where(d, i)}: full-graph replay reads DCP buffer {int(buf[i]):#x} but the graph was "
                       f"captured on {int(buf[j]):#x} (obs {int(d.file_obs[j])}); the replay sees stale values")
                out.append((i, "alias", msg, {"detail": {"buffer": int(buf[i]), "captured": int(buf[j]),
                                                         "capture_obs": int(d.file_obs[j])}}))
    return out


def check_rank_sum(d: Dump, wrong: np.ndarray) -> list[Issue]:
    """The same batch recorded with a view on all N ranks must add up to seq_len on each real row.

    The formula always adds up, so only batches with a wrong view on some rank can fail: groups
    are formed around the observations in `wrong` only. Members of a batch share (step, site,
    ubatch, num_reqs, real seq_lens); the k-th recording of each rank makes the k-th set, and the
    finding goes to the observation that completes it. Vectorised (sorts and joins on the key
    columns and a hash of the real seq_lens, confirmed exactly): no loop over members.
    """
    from dcptool.provenance import _group_ids, _join, _mix, _ragged, _seg_sums

    N = d.config.dcp_size
    if N == 1 or wrong.size == 0:
        return []
    wrong = np.unique(np.asarray(wrong, np.int64))
    nr = d["obs.num_reqs"].astype(np.int64)
    key = [d["obs.step"], d["obs.site"].astype(np.int64), d["obs.ubatch"].astype(np.int64), nr]
    has = np.flatnonzero(d["obs.has_dcp"] == 1)
    ci, qi = _join([k[has] for k in key], [k[wrong] for k in key])
    m = has[np.isin(ci, qi)]  # recorded with a view, in a (step, site, ubatch, num_reqs) of a wrong one
    seg, j, at = _ragged(d["obs.rows"][m], nr[m])
    seq = take(d, "rows.seq_lens", at).astype(np.int64)
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
    sg, jj, at = _ragged(d["obs.dcp_rows"][mm], n[g])
    total = np.zeros(int(n.sum()), np.int64)
    base = np.repeat(np.cumsum(n) - n, n)  # each set's first row in total
    row_of = (np.cumsum(n) - n)[g[sg]] + jj
    np.add.at(total, row_of, take(d, "rows.dcp_local_seq_lens", at).astype(np.int64))
    lead = mm[bounds]
    setrow = np.repeat(np.arange(bounds.size), n)
    want = take(d, "rows.seq_lens", d["obs.rows"][lead][setrow] + (np.arange(total.size) - base)).astype(np.int64)
    bad = total != want
    out: list[Issue] = []
    first_row = np.cumsum(n) - n
    for t in np.unique(setrow[bad]):
        rows = np.flatnonzero(bad[first_row[t] : first_row[t] + n[t]])
        group = mm[bounds[t] : bounds[t] + counts[t]]
        i, jr = int(group[-1]), int(rows[0])
        k = int(first_row[t]) + jr
        msg = (f"{where(d, i)}: across the {N} ranks, local lengths of row {jr} add up to {int(total[k])}, "
               f"not its seq_len {int(want[k])}")
        out.append((i, "rank-sum", msg, {"row": jr, "recorded": int(total[k]), "expected": int(want[k]),
                                         "wrong_rows": int(rows.size),
                                         "detail": {"obs": sorted(int(d.file_obs[x]) for x in group)}}))
    return out


def _ragged(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For segments (start, count): (segment id per element, index within segment, absolute index)."""
    seg = np.repeat(np.arange(counts.size), counts)
    j = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return seg, j, starts[seg] + j


def _ragged_searchsorted(d: Dump, parents: np.ndarray, x: np.ndarray, side: str) -> np.ndarray:
    """searchsorted(cu, x[k], side) where cu = parents[k]'s real query_start_loc[:num_reqs+1], for all k
    at once: the unique parents' cu arrays laid end to end, each lifted above the one before."""
    up, inv = np.unique(parents, return_inverse=True)
    inv = inv.ravel()
    n = d["obs.num_reqs"][up].astype(np.int64) + 1
    seg, j, idx = _ragged(d["obs.qsl"][up].astype(np.int64), n)
    lift = np.int64(1) << 34  # recorded values are int32: every segment gets its own range
    keys = d["rows.query_start_loc"][idx].astype(np.int64) + seg * lift
    start = np.cumsum(n) - n
    return np.searchsorted(keys, x + inv * lift, side=side) - start[inv]


def _split_bounds(d: Dump, p: np.ndarray, u: np.ndarray, k: np.ndarray, ntp: np.ndarray, s: np.ndarray):
    """(req_start, req_stop, tok_start, tok_stop) of micro-batch u of k with split point s (slicing.ubatch_slices,
    vectorised): tokens [s*u, s*(u+1)), the last micro-batch to the real end, padded to ntp / num_reqs_padded."""
    nr = d["obs.num_reqs"][p].astype(np.int64)
    nrp = d["obs.num_reqs_padded"][p].astype(np.int64)
    last = u == k - 1
    ts = s * u
    end = np.where(last, d["rows.query_start_loc"][d["obs.qsl"][p] + nr].astype(np.int64), s * (u + 1))
    rs = np.clip(_ragged_searchsorted(d, p, ts, "right") - 1, 0, np.maximum(nr - 1, 0))
    re_ = np.maximum(np.minimum(_ragged_searchsorted(d, p, end, "left"), nrp), rs)
    return rs, np.where(last, nrp, re_), ts, np.where(last, ntp, end)


def _check_split_points(d: Dump, cand: np.ndarray, engine_version: str) -> dict[int, tuple]:
    """Recorded micro-batch bounds against the engine version's split rule (slicing.ubatch_slices): the
    token midpoint, or from vLLM 0.34 on a request boundary for a batch of equal query lengths. vLLM
    0.34 uses the request boundary only when its DP ranks agree the batch is a uniform decode, which
    a dump does not record, so there either split is right. K is the number of micro-batches recorded
    for the parent; parents whose last recorded micro-batch does not end at num_tokens_padded (not all
    recorded) are not checked."""
    from dcptool.slicing import splits_on_request_boundary

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
    mid = np.stack(_split_bounds(d, p, u, k, ntp, ntp // k))
    good = (got == mid).all(axis=0)
    if splits_on_request_boundary(engine_version):
        # equal query lengths q > 1 (vLLM's uniform_token_count): split at (ntp // (q*K)) * q when > 0
        seg, j, idx = _ragged(qo[p].astype(np.int64), nr + 1)
        qv = d["rows.query_start_loc"][idx].astype(np.int64)
        dq = np.diff(qv)
        inner = j[1:] > 0  # differences inside one parent's cu
        lo = np.full(c.size, np.iinfo(np.int64).max)
        hi = np.full(c.size, np.iinfo(np.int64).min)
        np.minimum.at(lo, seg[1:][inner], dq[inner])
        np.maximum.at(hi, seg[1:][inner], dq[inner])
        q = np.where(lo == hi, hi, 0)
        per = np.where(q > 1, ntp // np.maximum(q * k, 1), 0)
        uni = per > 0
        if uni.any():
            bnd = np.stack(_split_bounds(d, p[uni], u[uni], k[uni], ntp[uni], per[uni] * q[uni]))
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
    from dcptool.slicing import parse_engine_version

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
        msg = (f"{where(d, int(i))}: requests [{int(rs[i])}, {int(rs[i]) + int(d['obs.num_reqs_padded'][i])}) run "
               f"past the parent's {int(qlen[par[i]]) - 1}")
        out.append((int(i), "ubatch-slice", msg, {"detail": {"field": "req_stop"}}))
    ok = ~over
    cand, p, nrp, r0, ts0, te0 = cand[ok], p[ok], nrp[ok], r0[ok], ts0[ok], te0[ok]
    q = d["rows.query_start_loc"]
    nr_par = d["obs.num_reqs"][p].astype(np.int64)
    want_nr = np.maximum(0, np.minimum(r0 + nrp, nr_par) - r0)
    bad_obs: dict[int, tuple] = {}
    bounds = _check_split_points(d, cand, engine_version) if parse_engine_version(engine_version) else {}
    for i, (field, _, rec, exp, k) in bounds.items():
        msg = (f"{where(d, i)}: {field} is {rec}, but vLLM {engine_version} splits this batch (obs "
               f"{int(d.file_obs[par[i]])}) into {k} micro-batches with {field} {exp}")
        out.append((i, "ubatch-slice", msg, {"recorded": rec, "expected": exp, "wrong_rows": 0,
                                             "detail": {"field": field, "parent_obs": int(d.file_obs[par[i]]),
                                                        "ubatches": k, "engine_version": engine_version}}))
    for k in np.flatnonzero(want_nr != d["obs.num_reqs"][cand]):
        bad_obs[int(cand[k])] = ("num_reqs", None, int(d["obs.num_reqs"][cand[k]]), int(want_nr[k]))
    # query_start_loc: nrp + 1 values each (only where the recorded length matches)
    qn = np.where(qlen[cand] == nrp + 1, nrp + 1, 0)
    seg, j, _ = _ragged(np.zeros(cand.size, np.int64), qn)
    got = q[qo[cand][seg] + j].astype(np.int64)
    want = np.clip(q[qo[p][seg] + r0[seg] + j].astype(np.int64) - ts0[seg], 0, (te0 - ts0)[seg])
    for k in np.flatnonzero(got != want):
        bad_obs.setdefault(int(cand[seg[k]]), ("query_start_loc", int(j[k]), int(got[k]), int(want[k])))
    for k in np.flatnonzero(qlen[cand] != nrp + 1):
        bad_obs.setdefault(int(cand[k]), ("query_start_loc", None, int(qlen[cand[k]]), int(nrp[k]) + 1))
    # seq_lens: nrp rows each, the last reduced by the tokens of that request after te. The reader
    # accepts a micro-batch with fewer seq_lens rows than num_reqs_padded (only num_reqs are required):
    # compare the rows it has, and report the short ones below rather than read past them.
    have = np.diff(rows)[cand]
    seg, j, _ = _ragged(np.zeros(cand.size, np.int64), np.minimum(nrp, have))
    got = take(d, "rows.seq_lens", rows[cand][seg] + j).astype(np.int64)
    want = take(d, "rows.seq_lens", rows[p][seg] + r0[seg] + j).astype(np.int64)
    cut = np.maximum(0, q[qo[p] + r0 + nrp].astype(np.int64) - te0)
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
        msg = (f"{where(d, i)}: {field} disagrees with slicing the parent (obs {int(d.file_obs[p[k]])}) at requests "
               f"[{int(r0[k])}, {int(r0[k] + nrp[k])}) tokens [{int(ts0[k])}, {int(te0[k])}): "
               + (f"row {row} is {rec}, slicing gives {exp}" if row is not None else f"{rec}, slicing gives {exp}"))
        out.append((i, "ubatch-slice", msg, {"row": row, "recorded": rec, "expected": exp, "wrong_rows": 1,
                                             "detail": {"field": field, "parent_obs": int(d.file_obs[p[k]])}}))
    return out
