"""Rules across observations: micro-batch slicing, shared buffers, all ranks adding up (DESIGN §3).

Each check is vectorised over the dump with numpy (sorts, gathers, segment reductions); Python
runs only per problem found. Each returns (observation, rule, message, fields) tuples that
replay turns into findings.
"""

from __future__ import annotations

import numpy as np

from dcptool.dump import Dump, every, take

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
    finding goes to the observation that completes it.
    """
    N = d.config.dcp_size
    if N == 1 or wrong.size == 0:
        return []
    has = d["obs.has_dcp"] == 1
    key_cols = [d["obs.num_reqs"].astype(np.int64), d["obs.ubatch"].astype(np.int64),
                d["obs.site"].astype(np.int64), d["obs.step"]]
    order, run = _segments(key_cols)
    pos = np.empty(d.n, np.int64)
    pos[order] = np.arange(d.n)
    ends = np.r_[np.flatnonzero(np.diff(run)) + 1, d.n]
    out: list[Issue] = []
    done: set[tuple] = set()
    for w in every(d, wrong.tolist()):
        start = int(run[pos[w]])
        stop = int(ends[np.searchsorted(ends, pos[w], side="right")])
        nr = int(d["obs.num_reqs"][w])
        seq = d.seq_lens_of(w)[:nr]
        members = [int(m) for m in order[start:stop] if has[m] and np.array_equal(d.seq_lens_of(m)[:nr], seq)]
        by_rank: dict[int, list[int]] = {}
        for m in sorted(members):
            by_rank.setdefault(int(d["obs.rank"][m]), []).append(m)
        if len(by_rank) < N:
            continue
        k = by_rank[int(d["obs.rank"][w])].index(w)
        if any(len(v) <= k for v in by_rank.values()):
            continue
        group = sorted(v[k] for v in by_rank.values())
        if tuple(group) in done:
            continue
        done.add(tuple(group))
        views = [d.dcp_of(m) for m in group]
        n = min(min(v.size for v in views), nr)
        total = np.sum([v[:n].astype(np.int64) for v in views], axis=0) if n else np.zeros(0, np.int64)
        bad = np.flatnonzero(total != seq[:n])
        if bad.size:
            i, j = group[-1], int(bad[0])
            msg = (f"{where(d, i)}: across the {N} ranks, local lengths of row {j} add up to {int(total[j])}, "
                   f"not its seq_len {int(seq[j])}")
            out.append((i, "rank-sum", msg, {"row": j, "recorded": int(total[j]), "expected": int(seq[j]),
                                             "wrong_rows": int(bad.size),
                                             "detail": {"obs": sorted(int(d.file_obs[m]) for m in group)}}))
    return out


def _ragged(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For segments (start, count): (segment id per element, index within segment, absolute index)."""
    seg = np.repeat(np.arange(counts.size), counts)
    j = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return seg, j, starts[seg] + j


def check_ubatch_slice(d: Dump) -> list[Issue]:
    """A recorded micro-batch must equal slicing its recorded parent at its recorded bounds (§1):
    qsl = clamp(parent qsl[rs:rs+nrp+1] - ts, 0, te - ts); seq_lens = parent rows [rs, rs+nrp),
    the last reduced by max(0, parent qsl[rs+nrp] - te); num_reqs = max(0, min(rs+nrp, parent) - rs)."""
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
    for i in sorted(bad_obs):
        field, row, rec, exp = bad_obs[i]
        k = idx[i]
        msg = (f"{where(d, i)}: {field} disagrees with slicing the parent (obs {int(d.file_obs[p[k]])}) at requests "
               f"[{int(r0[k])}, {int(r0[k] + nrp[k])}) tokens [{int(ts0[k])}, {int(te0[k])}): "
               + (f"row {row} is {rec}, slicing gives {exp}" if row is not None else f"{rec}, slicing gives {exp}"))
        out.append((i, "ubatch-slice", msg, {"row": row, "recorded": rec, "expected": exp, "wrong_rows": 1,
                                             "detail": {"field": field, "parent_obs": int(d.file_obs[p[k]])}}))
    return out
