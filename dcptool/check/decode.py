"""The decode path's other inputs: the empty-shard mask (empty-mask) and the global companion (tot-lens)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dcptool.check.findings import FindingTable, Written
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


class _Batches:
    """The observations with a recorded Q = dcp_query_start_loc (`cand`; an empty Q is not recorded: vLLM's Q
    always holds Q[0]) and what empty-mask reads of them: Q's entries (segment `qseg`, entry `qj`, value `qv`,
    each batch's first at `first_entry`), num_decodes = len(Q) - 1, the batch's query_start_loc where it is
    recorded whole (`known`)."""

    def __init__(self, d: Dump):
        self.d = d
        dq_off = d["obs.dqsl"]
        qn = np.diff(dq_off)
        self.cand = cand = np.flatnonzero(qn > 0)
        self.dq_off, self.dq = dq_off, d["rows.dcp_query_start_loc"]
        self.nr = d["obs.num_reqs"][cand].astype(np.int64)
        self.nrp = d["obs.num_reqs_padded"][cand].astype(np.int64)
        self.rows = np.diff(d["obs.rows"])[cand]
        self.m = m = qn[cand]
        self.nd = m - 1
        self.qseg, self.qj, at = ragged(dq_off[cand], m)
        self.qv = self.dq[at].astype(np.int64)
        self.first_entry = np.cumsum(m) - m
        self.has_qsl = d.has("obs.qsl")
        self.qsl_rows = d["rows.query_start_loc"] if self.has_qsl else np.zeros(1, np.int32)
        self.qoff = d["obs.qsl"][cand] if self.has_qsl else np.zeros(cand.size, np.int64)
        self.known = (np.diff(d["obs.qsl"])[cand] == self.rows + 1) if self.has_qsl else np.zeros(cand.size, bool)

    def qsl_at(self, pos: np.ndarray, entry: np.ndarray, default: np.ndarray | int = 0) -> np.ndarray:
        """query_start_loc[entry] of cand[pos] where recorded, else default."""
        q = self.qsl_rows
        at = np.clip(self.qoff[pos] + entry, 0, max(q.size - 1, 0))
        return np.where(self.known[pos], q[at].astype(np.int64) if q.size else 0, default)


class _Problems:
    """Each candidate's first problem (position in cand -> text, detail): a later one does not replace it."""

    def __init__(self):
        self.first: dict[int, tuple[str, dict]] = {}

    def note(self, pos: np.ndarray, text_of, detail_of) -> None:
        for k in pos.tolist():
            if k not in self.first:
                self.first[k] = (text_of(k), detail_of(k))


def _check_q(b: _Batches, found: _Problems) -> None:
    """Q itself: it starts at 0 and never decreases."""
    q0 = b.qv[b.first_entry]
    found.note(np.flatnonzero(q0 != 0), lambda k: f"dcp_query_start_loc starts at {int(q0[k])}, not 0",
               lambda k: {"field": "dcp_query_start_loc", "row": 0, "recorded": int(q0[k]), "expected": 0})
    seg, j, qv = b.qseg, b.qj, b.qv
    dpos = np.flatnonzero((j[1:] > 0) & (qv[1:] < qv[:-1]))
    dec = np.zeros(b.cand.size, bool)
    dec[seg[1:][dpos]] = True
    first_dec = np.full(b.cand.size, -1, np.int64)
    first_dec[seg[1:][dpos][::-1]] = j[1:][dpos][::-1]
    found.note(np.flatnonzero(dec), lambda k: f"dcp_query_start_loc decreases at entry {int(first_dec[k])}",
               lambda k: {"field": "dcp_query_start_loc", "row": int(first_dec[k])})


class _Decodes(NamedTuple):
    """What query_start_loc says of each candidate: its decode rows (`want`, split_decodes_and_prefills), the rows
    the builder ran (`R`), the num_decodes its Q is held to (`nd_exp`: the recorded one where it fits either
    reading, else `want`), and the candidates whose Q fits neither (`bad`)."""

    want: np.ndarray
    R: np.ndarray
    nd_exp: np.ndarray
    bad: np.ndarray


def _decodes(b: _Batches) -> _Decodes:
    """The builder's num_reqs is num_reqs_padded under a FULL graph (build_attn_metadata); otherwise num_reqs,
    or the padded count where a path pads requests outside a FULL graph (a drafter's padded batch): a Q that fits
    either is accepted there. The expected one is the padded count for a FULL graph (and when obs.graph is
    absent), else num_reqs."""
    d, known, nd, cand = b.d, b.known, b.nd, b.cand
    graph = d.has("obs.graph")
    full = (d["obs.graph"][cand] >= 2) if graph else np.ones(cand.size, bool)
    R_pad = np.where(known, np.minimum(b.nrp, b.rows), 0)
    R_real = np.where(known, np.minimum(b.nr, b.rows), 0)
    a, a_b = decode_counts(d, cand, R_pad) if b.has_qsl else (nd, nd)
    padded = np.flatnonzero(R_real != R_pad)  # (request padding is rare: count those again only)
    a2, b2 = a.copy(), a_b.copy()
    if padded.size and b.has_qsl:
        a2[padded], b2[padded] = decode_counts(d, cand[padded], R_real[padded])
    fits_pad = (nd == a) | (nd == a_b)
    fits_real = ((nd == a2) | (nd == b2)) & (~full | (not graph))  # (a FULL graph runs the padded batch)
    R = np.where(fits_pad | ~fits_real & full, R_pad, R_real)
    want = np.where(full, a, a2)
    nd_exp = np.where(known & (fits_pad | fits_real), nd, want)
    return _Decodes(want, R, np.where(known, nd_exp, nd), known & ~fits_pad & ~fits_real)


def _check_against_qsl(b: _Batches, dec: _Decodes, found: _Problems) -> None:
    """Q against query_start_loc: num_decodes, then Q as its prefix."""
    m, nd, a = b.m, b.nd, dec.want
    found.note(np.flatnonzero(dec.bad),
               lambda k: (f"dcp_query_start_loc holds {int(m[k])} entries (num_decodes {int(nd[k])}), but this batch "
                          f"has {int(a[k])} decode rows (split_decodes_and_prefills, threshold 1; padded rows count): "
                          f"it must be query_start_loc[:{int(a[k]) + 1}]"),
               lambda k: {"field": "num_decodes", "recorded": int(nd[k]), "expected": int(a[k])})
    cmpn = np.where(b.known, np.minimum(m, dec.R + 1), 0)
    seg2, j2, _ = ragged(np.zeros(b.cand.size, np.int64), cmpn)
    badq = np.flatnonzero(b.qv[b.first_entry[seg2] + j2] != b.qsl_at(seg2, j2))
    qpre = np.zeros(b.cand.size, bool)
    qpre[seg2[badq]] = True
    fq = np.full(b.cand.size, -1, np.int64)
    fq[seg2[badq][::-1]] = j2[badq][::-1]
    dq, dq_off, qsl, qoff, cand = b.dq, b.dq_off, b.qsl_rows, b.qoff, b.cand
    found.note(np.flatnonzero(qpre),
               lambda k: (f"dcp_query_start_loc[{int(fq[k])}] is {int(dq[dq_off[cand[k]] + fq[k]])}, but "
                          f"query_start_loc[{int(fq[k])}] is {int(qsl[qoff[k] + fq[k]])}: Q must be "
                          "the batch's query_start_loc prefix, the same on every rank (empty shards keep their query "
                          "tokens and are masked through LSE = -inf)"),
               lambda k: {"field": "dcp_query_start_loc", "row": int(fq[k]),
                          "recorded": int(dq[dq_off[cand[k]] + fq[k]]), "expected": int(qsl[qoff[k] + fq[k]])})


def _check_view_length(b: _Batches, found: _Problems) -> np.ndarray:
    """S, the view's first num_decodes rows, must exist: the candidates whose view has them (`ok`)."""
    d, cand, m, nd = b.d, b.cand, b.m, b.nd
    has = d["obs.has_dcp"][cand] == 1
    dlen = np.diff(d["obs.dcp_rows"])[cand]
    short = has & (dlen < nd)
    found.note(np.flatnonzero(short),
               lambda k: (f"dcp_query_start_loc has {int(m[k])} entries but the DCP view only {int(dlen[k])} rows: "
                          "mask_dcp_empty_shards_ raises 'query_start_loc must contain one boundary per sequence'"),
               lambda k: {"field": "seq_lens", "recorded": int(dlen[k]), "expected": int(nd[k])})
    return has & ~short


def check_empty_mask(d: Dump) -> FindingTable:
    """The empty-shard mask's inputs (vLLM 0.30+ FlashInfer decode): Q = dcp_query_start_loc must be
    query_start_loc[:num_decodes+1] (Q[0] = 0, non-decreasing, the same on every rank) with num_decodes from
    split_decodes_and_prefills at threshold 1; S = the DCP view's first num_decodes rows must give
    len(Q) == len(S) + 1; and the LSE rows mask_dcp_empty_shards_ masks with the recorded (Q, S) must be those it
    masks with the expected ones (local lengths of the batch, 0 on padded rows). Checks that need
    query_start_loc run where it is recorded. One finding per observation: its first problem, plus the real rows
    masked on every rank of its batch (a NaN after the LSE merge) when there are any. Vectorised: ragged
    gathers, one sorted search for every row's sequence; Python per finding only."""
    found = Written(d)
    b = _Batches(d)
    if d.config.dcp_size == 1 or b.cand.size == 0:
        return found.table()
    problems = _Problems()
    _check_q(b, problems)
    dec = _decodes(b)
    _check_against_qsl(b, dec, problems)
    ok = _check_view_length(b, problems)
    masks = _Masks(b, dec, ok, problems)
    masks.note_wrong(problems)
    masks.note_all_masked(problems)
    for k in sorted(problems.first):
        text, det = problems.first[k]
        found.add(int(b.cand[k]), "empty-mask", text, row=det.pop("row", None), recorded=det.pop("recorded", None),
                  expected=det.pop("expected", None), wrong_rows=det.pop("wrong_rows", 1), detail=det)
    return found.table()


class _Masks:
    """The LSE rows mask_dcp_empty_shards_ masks with the recorded (Q, S) and with the expected ones, built for the
    candidates that can differ and their batch's ranks: per candidate the rows where they differ (`wrong`), per rank
    set the real rows no rank keeps (`all_masked`)."""

    def __init__(self, b: _Batches, dec: _Decodes, ok: np.ndarray, found: _Problems):
        self.b, self.dec = b, dec
        d, cand, m = b.d, b.cand, b.m
        ntp = d["obs.num_tokens_padded"][cand].astype(np.int64) if d.has("obs.num_tokens_padded") else np.full(
            cand.size, -1, np.int64)
        self.qlast_rec = b.qv[b.first_entry + m - 1]
        self.qexp_last = b.qsl_at(np.arange(cand.size), np.minimum(dec.nd_exp, dec.R), self.qlast_rec)
        all_dec = b.known & (dec.nd_exp == dec.R)
        T = np.where(all_dec & (ntp >= 0), np.maximum(ntp, self.qexp_last), self.qexp_last)
        # rows past both Q[-1]s are masked in both masks: build rows up to there, and CUDA-graph padding rows
        # (masked in both) only as far as a finding's detail shows them; bounds what a hostile Q[-1] can ask for
        reach = np.maximum(self.qexp_last, np.minimum(self.qlast_rec, self.qexp_last + MASK_PAST_Q))
        self.U = np.clip(np.minimum(T, reach + _SHOWN), 0, None) * ok
        self.sets = rank_sets(d, cand)
        self.wrong: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.all_masked: dict[int, list[int]] = {}
        build = self._suspects(ok, found)
        self._build(np.flatnonzero(build & ok & (self.U > 0)))

    def _suspects(self, ok: np.ndarray, found: _Problems) -> np.ndarray:
        """Where Q is right, row t < Q[-1] belongs to the request j with Q[j] <= t < Q[j+1]: the masks differ
        exactly where a request with query tokens is empty in one S and not in the other. That test runs per
        request on every candidate; LSE rows are built only for those with a problem and their batch's ranks."""
        b, d, cand = self.b, self.b.d, self.b.cand
        qok = ok.copy()
        qok[list(found.first)] = False
        pq = np.flatnonzero(qok)
        sq, jq, atq = ragged(d["obs.dcp_rows"][cand[pq]], b.nd[pq])
        s_rec = d.take("rows.dcp_local_seq_lens", atq).astype(np.int64)
        seq_r = d.take("rows.seq_lens", d["obs.rows"][cand[pq]][sq] + jq).astype(np.int64)
        c = d.config
        s_exp = np.where(jq < b.nr[pq][sq], local_of(seq_r, d["obs.rank"][cand[pq]][sq].astype(np.int64), c.dcp_size,
                                                     c.cp_interleave), 0)
        tok = b.qv[b.first_entry[pq][sq] + jq + 1] > b.qv[b.first_entry[pq][sq] + jq]
        flagged = np.zeros(cand.size, bool)
        flagged[pq[np.unique(sq[tok & ((s_rec == 0) != (s_exp == 0))])]] = True
        return flagged | (ok & ~qok) | np.isin(self.sets, self.sets[flagged])

    def _build(self, pos_all: np.ndarray) -> None:
        """Both masks of candidates pos_all, MASK_ROWS_CHUNK LSE rows at a time; the unmasked count per (set,
        real row) gathered for all_masked."""
        unmasked = []
        for lo, hi in _obs_chunks(self.U[pos_all], MASK_ROWS_CHUNK):
            sub = pos_all[lo:hi]
            if sub.size:
                unmasked.append(self._chunk(sub))
        if unmasked:
            self._all_masked(np.concatenate(unmasked, axis=1))

    def _chunk(self, sub: np.ndarray) -> np.ndarray:
        b, dec, U = self.b, self.dec, self.U
        d, i = b.d, b.cand[sub]
        c = d.config
        # recorded
        ndr = b.nd[sub]
        sq, jq, _ = ragged(np.zeros(sub.size, np.int64), np.maximum(b.m[sub] - 1, 0))
        qrv = b.qv[b.first_entry[sub][sq] + 1 + jq]
        ss, _, ats = ragged(d["obs.dcp_rows"][i], ndr)
        srv = d.take("rows.dcp_local_seq_lens", ats).astype(np.int64)
        sr, tr, mr = _masks(sq, qrv, ss, srv, ndr, U[sub], self.qlast_rec[sub])
        # expected
        nde = dec.nd_exp[sub]
        qe_n = np.where(b.known[sub], nde, np.maximum(b.m[sub] - 1, 0))
        sq2, jq2, _ = ragged(np.zeros(sub.size, np.int64), qe_n)
        qev = b.qsl_at(sub[sq2], 1 + jq2, b.qv[np.minimum(b.first_entry[sub][sq2] + 1 + jq2, b.qv.size - 1)])
        ss2, js2, ats2 = ragged(d["obs.rows"][i], nde)
        sev = local_of(d.take("rows.seq_lens", ats2).astype(np.int64), d["obs.rank"][i][ss2].astype(np.int64),
                       c.dcp_size, c.cp_interleave)
        sev = np.where(js2 < b.nr[sub][ss2], sev, 0)
        _, _, me = _masks(sq2, qev, ss2, sev, nde, U[sub], self.qexp_last[sub])
        for k in np.unique(sr[np.flatnonzero(mr != me)]).tolist():
            sel = sr == k
            self.wrong[int(sub[k])] = (np.flatnonzero(mr[sel]), np.flatnonzero(me[sel]))
        # real rows (tokens of real requests) masked on this rank: count unmasked per (set, row)
        real = tr < b.qsl_at(sub, np.minimum(b.nr[sub], dec.R[sub]), self.qexp_last[sub])[sr]
        return np.stack([self.sets[sub][sr][real], tr[real], (~mr[real]).astype(np.int64)])

    def _all_masked(self, unmasked: np.ndarray) -> None:
        """The real rows of a set of N ranks that no member keeps."""
        if unmasked.shape[1] == 0:
            return
        sets, N = self.sets, self.b.d.config.dcp_size
        size = np.bincount(sets, minlength=int(sets.max()) + 1)
        g = group_ids([unmasked[0], unmasked[1]])
        un = np.zeros(int(g.max()) + 1, np.int64)
        np.add.at(un, g, unmasked[2])
        members = np.zeros(int(g.max()) + 1, np.int64)
        np.add.at(members, g, 1)
        bad = (un[g] == 0) & (members[g] >= N) & (size[unmasked[0]] >= N)
        for sset, t in sorted(set(zip(unmasked[0][bad].tolist(), unmasked[1][bad].tolist()))):
            self.all_masked.setdefault(sset, []).append(t)

    def note_wrong(self, found: _Problems) -> None:
        """A candidate whose masks differ: its problem unless it has one, and both masks in its detail."""
        for k, (mrec, mexp) in self.wrong.items():
            if k not in found.first:
                diff = np.setxor1d(mrec, mexp)
                t = int(diff[0])
                rec = set(mrec.tolist())
                found.first[k] = (
                    f"mask_dcp_empty_shards_ masks {_rows_text(mrec)} with the recorded local lengths, but the "
                    f"batch's local lengths mask {_rows_text(mexp)} (row {t} {'masked' if t in rec else 'kept'} "
                    "wrongly): the DCP view's decode rows give the wrong empty shards, so the LSE merge weighs the "
                    "wrong ranks",
                    {"field": "mask", "row": t, "recorded": int(t in rec), "expected": int(t in set(mexp.tolist())),
                     "wrong_rows": int(diff.size)})
            found.first[k][1]["masked"] = mrec[:_SHOWN].tolist()
            found.first[k][1]["expected_masked"] = mexp[:_SHOWN].tolist()

    def note_all_masked(self, found: _Problems) -> None:
        """The real rows no rank keeps: said at the set's candidates with a problem (else its first member)."""
        for sset, ts in self.all_masked.items():
            members = np.flatnonzero(self.sets == sset)
            withf = [int(k) for k in members if int(k) in found.first] or [int(members[0])]
            for k in withf:
                if k not in found.first:
                    found.first[k] = (f"{_rows_text(np.array(ts))} of real requests are masked", {"field": "mask"})
                found.first[k][1]["all_ranks_masked"] = ts[:_SHOWN]
                found.first[k] = (found.first[k][0] + f"; {_rows_text(np.array(ts))} masked on every rank (the "
                                  "merged output there is NaN)", found.first[k][1])


def _rows_text(r: np.ndarray) -> str:
    r = np.asarray(r).tolist()
    if not r:
        return "no LSE row"
    return "LSE rows [" + ", ".join(map(str, r[:_SHOWN])) + (f", ... ({len(r)} rows)]" if len(r) > _SHOWN else "]")


def check_tot_lens(d: Dump) -> FindingTable:
    """The global companion (e.g. FlashAttention/FlashMLA's total seq lens, MLA's dcp_tot_seq_lens =
    seq_lens[:num_decodes]) must equal the batch's global seq_lens on every real row it holds."""
    found = Written(d)
    if d.config.dcp_size == 1:
        return found.table()
    off = d["obs.tot"]
    tn = np.diff(off)
    nr = d["obs.num_reqs"].astype(np.int64)
    k = np.minimum(tn, nr)
    cand = np.flatnonzero(k > 0)
    if cand.size == 0:
        return found.table()
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
    for p in np.flatnonzero(nbad).tolist():
        i, r = int(cand[p]), int(first[p])
        rec, exp = int(d["rows.dcp_tot_seq_lens"][off[i] + r]), int(d.seq_lens_of(i)[r])
        why = " = this rank's local lengths: the companion must be global" if all_local[p] else ""
        msg = (f"global companion (dcp_tot_seq_lens) row {r} is {rec}, the global seq_len is {exp}{why} "
               f"({int(nbad[p])} wrong row{'s' if nbad[p] > 1 else ''})")
        found.add(i, "tot-lens", msg, row=r, recorded=rec, expected=exp, wrong_rows=int(nbad[p]),
                  detail={"local": bool(all_local[p])})
    return found.table()
