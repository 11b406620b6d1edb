"""The decode path's other inputs (issue 15): the empty-shard mask (empty-mask) and the global companion (tot-lens)."""

from __future__ import annotations

import numpy as np

from dcptool.check.findings import Issue
from dcptool.check.ranks import rank_sets
from dcptool.dcp.reference import local_of
from dcptool.dcp.segments import group_ids, ragged
from dcptool.dcp.segments import obs_chunks as _obs_chunks
from dcptool.dump import Dump

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
    sets = rank_sets(d, cand)
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
