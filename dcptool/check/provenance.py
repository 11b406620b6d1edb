"""Provenance: which observation (or rank, or interleave) a wrong DCP view really belongs to (docs/replay.md#the-rules:
"Where a wrong value came from")."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcptool.check.view_rows import parent_rows, recorded_rows, zero_ext_equal
from dcptool.dcp.reference import local_np, ranks_giving
from dcptool.dcp.segments import BULK_ROWS, KeyIndex, join, latest_before, member, mix, obs_chunks, ragged, seg_sums
from dcptool.dump import Dump, obs_ref

INTERLEAVES = tuple(2**k for k in range(11))  # 1..1024, wrong-interleave candidates
MISMATCH, GLOBAL, WRONG_RANK, WRONG_INTERLEAVE, STALE = range(5)  # explain_many's kinds (prepare: 0 = none of 3-5)
KINDS = ("mismatch", "global", "wrong-rank", "wrong-interleave", "stale")
_KIND = {k: i for i, k in enumerate(KINDS)}
_RELATION = {"parent-rows": 0, "earlier-in-step": 1, "earlier-step": 2}  # findings.RELATIONS' order


def expected_of(d: Dump, i: int, rows: int | None = None) -> np.ndarray:
    """Expected view of observation i: real rows by the formula, padded rows 0 (num_reqs_padded rows,
    or the first `rows` of them: num_reqs_padded is a recorded number, not memory to allocate)."""
    c = d.config
    nr, nrp = int(d["obs.num_reqs"][i]), int(d["obs.num_reqs_padded"][i])
    nrp = nrp if rows is None else min(nrp, rows)
    nr = min(nr, nrp)
    out = np.zeros(nrp, np.int64)
    out[:nr] = local_np(d.seq_lens_of(i)[:nr], c.dcp_size, int(d["obs.rank"][i]), c.cp_interleave)
    return out


def _other_rank(seq: np.ndarray, rec: np.ndarray, N: int, il: int, rank: int) -> int | None:
    """The lowest rank other than `rank` whose local lengths are rec, without a loop over N ranks:
    the ranks giving each row's value form one interval (reference.ranks_giving); intersect them."""
    lo, hi, ok = ranks_giving(seq.astype(np.int64), rec.astype(np.int64), N, il)
    if not ok.all():
        return None
    a, b = int(lo.max(initial=0)), int(hi.min(initial=N))
    for r in (a, a + 1):  # the lowest in [a, b) that is not this rank
        if r < b and r != rank:
            return r
    return None


def _strip(v: np.ndarray) -> np.ndarray:
    nz = np.flatnonzero(v)
    return v[: nz[-1] + 1] if nz.size else v[:0]


def _strip_lengths(d: Dump, obs: np.ndarray) -> np.ndarray:
    """Per observation of `obs` (each with num_reqs >= 1): its expected real rows' length without trailing zeros."""
    c, rank = d.config, d["obs.rank"][obs]
    return _stripped(d["obs.rows"][obs], d["obs.num_reqs"][obs].astype(np.int64),
                     lambda at, s: local_np(d.take("rows.seq_lens", at), c.dcp_size, rank[s], c.cp_interleave))


def _stripped(starts: np.ndarray, counts: np.ndarray, value) -> np.ndarray:
    """Per segment (rows [start, start + count), count >= 1): its length without trailing zeros; value(rows,
    segments) reads rows. One read each, plus the rows of the few whose last row is 0."""
    out = counts.copy()
    z = np.flatnonzero(value(starts + counts - 1, np.arange(counts.size)) == 0)
    if z.size:
        seg, j, at = ragged(starts[z], counts[z])
        out[z] = 0
        np.maximum.at(out, z[seg], np.where(value(at, z[seg]) != 0, j + 1, 0))
    return out


@dataclass(frozen=True)
class Source:
    """Where a stale value came from: an observation whose expected rows the view holds."""

    index: int  # position in the dump
    obs: int  # index in its file
    file: str
    relation: str  # parent-rows | earlier-in-step | earlier-step
    step: int
    site: str
    ubatch: int

    @property
    def ref(self) -> str:
        """`FILE:I`, as `replay --obs` takes it."""
        return obs_ref(self.file, self.obs)

    def to_json(self) -> dict:
        return {"obs": self.obs, "relation": self.relation, "step": self.step, "site": self.site,
                "ubatch": self.ubatch, "file": self.file, "ref": self.ref}


# Row hashing for provenance joins. A view's hash is the sum over its rows j of mix(value, j), with mix(0, j) = 0:
# zeros add nothing, so a view and its zero-extension hash alike (replay compares views with zeros past num_reqs),
# and a prefix hash is a cumulative sum. One 64-bit hash: every hit is confirmed exactly and a hit that fails falls
# back to the exact search, so a collision costs time, never a wrong answer (rank-sum, without a fallback, keeps two).
SALTS = (0,)
LEAD_BLOCK = 1 << 16  # observations per block of lead() on a dump still being read


def _i64(hs: list[np.ndarray]) -> list[np.ndarray]:
    return [h.view(np.int64) for h in hs]


class _Keys:
    """One prepare call's search keys: the whole columns read once, the wrong views' first recorded rows, and per
    search the candidates that share a key with some wrong view, indexed once (segments.KeyIndex) when a block
    first needs them, so a block's lookup costs its own views and candidates, not a pass over every observation."""

    def __init__(self, search: _Search, wrong: np.ndarray, m: np.ndarray):
        d = search.d
        self.d, self.wrong, self.m = d, wrong, m  # wrong views (sorted), their recorded real rows (> 0)
        self.rank, self.step = d["obs.rank"].astype(np.int64), d["obs.step"]
        self.real = d["obs.num_reqs"] >= 1  # (only these are sources)
        self.e0, self.e1 = search.lead()
        self.q_rank, self.q_step = self.rank[wrong], self.step[wrong]
        at = d["obs.dcp_rows"][wrong]
        self.r0 = d.take("rows.dcp_local_seq_lens", at).astype(np.int64)
        self.r1 = np.where(m > 1, d.take("rows.dcp_local_seq_lens", at + (m > 1)).astype(np.int64), 0)
        self.ls = _stripped(at, m, lambda rows, _: d.take("rows.dcp_local_seq_lens", rows))  # len(strip(rec))
        self._index: dict[str, KeyIndex] = {}

    def in_step(self, pos: np.ndarray) -> np.ndarray:
        """The observations (ascending, num_reqs >= 1) whose (rank, step, first expected row) is the (rank, step,
        first recorded row) of one of the wrong views at positions pos."""
        return self._lookup("in-step", [self.rank, self.step, self.e0], [self.q_rank, self.q_step, self.r0], pos)

    def earlier(self, pos: np.ndarray) -> np.ndarray:
        """The same for the key (rank, expected rows 0 and 1, length of the expected real rows without trailing
        zeros) and (rank, recorded rows 0 and 1 (0 past the view), length of the recorded ones without them)."""
        return self._lookup("earlier", [self.rank, self.e0, self.e1], [self.q_rank, self.r0, self.r1], pos,
                            (lambda rows: _strip_lengths(self.d, rows), self.ls))

    def _lookup(self, name: str, cols: list[np.ndarray], q_key: list[np.ndarray], pos: np.ndarray,
                more: tuple | None = None) -> np.ndarray:
        """`more`: one more key column, (its values at given candidates, the queries' values), for the candidates
        the columns leave (it is computed, not a column)."""
        if pos.size == 0:
            return np.zeros(0, np.int64)
        if name not in self._index:
            rows = np.flatnonzero(member(cols, q_key) & self.real)  # (one pass over the columns: no sort of all)
            c_key = [col[rows] for col in cols]
            if more is not None:
                c_key, q_key = [*c_key, more[0](rows)], [*q_key, more[1]]
            self._index[name] = KeyIndex(c_key, q_key, rows)
        return self._index[name].rows_of(pos)


class _Search:
    """The bulk search behind Provenance: docs/replay.md's explanations 1-6 for every wrong view at once (`prepare`).
    The two searches over other observations (earlier in the step, earlier steps) narrow candidates by a join on
    their leading expected rows, then match them by a join on row hashes (see segments.mix) and `latest_before` picks
    the most recent; a hit is confirmed exactly. Nothing is quadratic in observations per step or rank. The answers
    wait in `_bulk` (and per observation in the dicts) for Provenance's explain paths."""

    def __init__(self, d: Dump):
        self.d = d
        self._in_step: dict[int, int] = {}
        self._earlier: dict[int, int] = {}
        self._prepared: set[int] = set()
        self._rows01: tuple[np.ndarray, np.ndarray] | None = None
        self._value: dict[int, tuple[str, dict] | None] = {}  # rules 3-5 per prepared observation (None: none)
        self._bulk: list[tuple[np.ndarray, ...]] = []  # per prepare call: (obs, in_step, value kind, aux, earlier)
        self._hashed = self._no_hashes()  # _prefix_sums' observations (sorted), first rows, sums

    @staticmethod
    def _no_hashes() -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), [np.zeros(1, np.uint64) for _ in SALTS]

    # ----- bulk search

    def lead(self) -> tuple[np.ndarray, np.ndarray]:
        """Expected rows 0 and 1 of every observation (0 past num_reqs): O(n) gathers, not O(rows). Computed once;
        replay asks for it early on the GPU path, while the host waits for the device's scan. On a dump still
        being read (read_dump(stream=True)) it follows the read in blocks of LEAD_BLOCK observations, so it is
        ready when the scan is, not after the whole column."""
        if self._rows01 is None:
            d = self.d
            out = (np.zeros(d.n, np.int64), np.zeros(d.n, np.int64))
            step = LEAD_BLOCK if d.reader is not None else max(d.n, 1)
            for lo in range(0, d.n, step):
                hi = min(d.n, lo + step)
                for j in (0, 1):
                    self._row(j, lo, hi, out[j])
            self._rows01 = out
        return self._rows01

    def _row(self, j: int, lo: int, hi: int, out: np.ndarray) -> None:
        """Expected row j of observations [lo, hi) into out (0 past num_reqs)."""
        d, c = self.d, self.d.config
        idx = lo + np.flatnonzero(d["obs.num_reqs"][lo:hi] > j)
        out[idx] = local_np(d.take("rows.seq_lens", d["obs.rows"][idx] + j), c.dcp_size, d["obs.rank"][idx],
                            c.cp_interleave)

    def _prefix_sums(self, obs: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """Hashes of the expected real rows of observations `obs`, as prefix sums: (first row of each
        observation, [cs]) where cs[first + k] - cs[first] hashes its first k rows. The observations hashed
        since the last _prepare block began are kept: both searches of a block mostly narrow to the same ones."""
        obs = np.asarray(obs, np.int64)
        ids, first, cs = self._hashed
        new = np.setdiff1d(obs, ids)
        if new.size:
            d, c = self.d, self.d.config
            nr = d["obs.num_reqs"][new].astype(np.int64)
            seg, j, at = ragged(d["obs.rows"][new], nr)
            e = local_np(d.take("rows.seq_lens", at), c.dcp_size, d["obs.rank"][new][seg], c.cp_interleave)
            base = cs[0].size - 1  # the new rows continue the sums (only differences within one observation count)
            with np.errstate(over="ignore"):
                cs = [np.concatenate([old, old[-1] + np.cumsum(mix(e, j, salt), dtype=np.uint64)])
                      for old, salt in zip(cs, SALTS)]
            ids, first = np.concatenate([ids, new]), np.concatenate([first, base + np.cumsum(nr) - nr])
            order = np.argsort(ids, kind="stable")
            ids, first = ids[order], first[order]
            self._hashed = ids, first, cs
        return first[np.searchsorted(ids, obs)], cs

    def prepare(self, wrong: np.ndarray) -> None:
        """Rules 2-6 for all wrong observations at once (each call costs O(n log n): pass them all together), in
        blocks of BULK_ROWS recorded rows."""
        d = self.d
        wrong = np.array([w for w in np.unique(np.asarray(wrong, np.int64)).tolist() if w not in self._prepared],
                         np.int64)
        if wrong.size == 0:
            return
        self._prepared.update(wrong.tolist())
        nr, view = d["obs.num_reqs"].astype(np.int64), d["obs.dcp_rows"]
        wrong = wrong[d["obs.has_dcp"][wrong] == 1]
        m = np.minimum(np.diff(view)[wrong], nr[wrong])  # recorded real rows
        wrong, m = wrong[m > 0], m[m > 0]
        if wrong.size == 0:
            return
        keys = _Keys(self, wrong, m)
        for a, b in obs_chunks(m, BULK_ROWS):  # (a block reads at most its BULK_ROWS rows at once)
            self._prepare(keys, a, b)
        self._hashed = self._no_hashes()

    def _prepare(self, keys: _Keys, a: int, b: int) -> None:
        """prepare() for the wrong views at positions [a, b) of `keys` (m recorded real rows each, > 0). A view's
        rows are read only where a rule tests them: its first rows for the value rules (a wrong view fails at one
        of its first rows), all of them to hash it only where a search has a candidate for its key."""
        d = self.d
        self._hashed = self._no_hashes()
        wrong, m, rank, step = keys.wrong[a:b], keys.m[a:b], keys.rank, keys.step
        r0, r1, e0, e1 = keys.r0[a:b], keys.r1[a:b], keys.e0, keys.e1
        n = wrong.size
        in_step, earlier = np.full(n, -1, np.int64), np.full(n, -1, np.int64)
        vkind, vaux = np.zeros(n, np.int8), np.zeros(n, np.int64)

        def hashes(cands, q, mq):  # the row hashes of the views q whose key has a candidate (0 for the others)
            k = np.flatnonzero(np.isin(cands[2], cands[1]))
            out = [np.zeros(q.size, np.uint64) for _ in SALTS]
            if k.size:
                _, j, rec = recorded_rows(d, q[k], mq[k], mq[k])
                for h, salt in zip(out, SALTS):
                    h[k] = seg_sums(mix(rec, j, salt), mq[k])
            return out

        # docs/replay.md's precedence, each search only for the views no earlier rule explains: most wrong views of
        # a pre-fix recording are stale copies of their parent or of an earlier batch of the step
        todo = ~self._parent_hits(wrong, m)  # 1. (exact, no search)
        q, mq = wrong[todo], m[todo]  # 2. earlier in the step
        c = keys.in_step(a + np.flatnonzero(todo))
        cands = self._narrow(c, [rank[c], step[c], e0[c]], [rank[q], step[q], r0[todo]], [(c, q)])
        in_step[todo] = self._search_in_step(q, mq, hashes(cands, q, mq), cands)
        hit = np.flatnonzero(in_step >= 0)
        todo[hit[zero_ext_equal(self.d, wrong[hit], m[hit], in_step[hit], m[hit])]] = False
        vkind[todo], vaux[todo] = self._by_values(wrong[todo], m[todo])  # 3-5. the values
        todo &= (vkind == 0) & (keys.ls[a:b] > 0)  # 6. needs strip(rec) non-empty
        if todo.any():
            q, mq, pos = wrong[todo], m[todo], a + np.flatnonzero(todo)
            c = keys.earlier(pos)
            key = self._narrow(c, [rank[c], e0[c], e1[c], _strip_lengths(d, c)],
                               [rank[q], r0[todo], r1[todo], keys.ls[pos]],
                               [(d.order_of(c), d.order_of(q)), (step[c], step[q])])
            earlier[todo] = self._search_earlier_steps(q, hashes(key, q, mq), key)
        # the answers as arrays too, for explain_many (wrong is sorted)
        self._bulk.append((wrong, in_step, vkind, vaux, earlier))

    def _parent_hits(self, q: np.ndarray, m: np.ndarray) -> np.ndarray:
        """Rule 1 for views q (m recorded real rows each), exactly."""
        d = self.d
        out = np.zeros(q.size, bool)
        if d.has("obs.parent", "obs.req_start"):
            p, rs = d["obs.parent"][q].astype(np.int64), d["obs.req_start"][q].astype(np.int64)
            k = np.flatnonzero((p >= 0) & (rs >= 0))
            out[k] = parent_rows(self.d, q[k], m[k], p[k], rs[k])
        return out

    @staticmethod
    def _narrow(cand: np.ndarray, c_key: list[np.ndarray], q_key: list[np.ndarray],
                before: list[tuple[np.ndarray, np.ndarray]]):
        """The candidates whose key (columns c_key, at cand) some query has, and the query ids of that key:
        (candidates, their key ids, the queries' key ids). `before`: pairs (the candidates' values, at cand; the
        queries'): a candidate stays only where its value is below the largest query value of its key in each (the
        searches cite only earlier observations: the others could never be cited, and are not hashed)."""
        ci, qi = join(c_key, q_key)
        keep = np.isin(ci, qi)
        for col, qv in before:
            last = np.full(int(max(ci.max(initial=-1), qi.max(initial=-1))) + 1, np.iinfo(np.int64).min)
            np.maximum.at(last, qi, np.asarray(qv, np.int64))
            keep &= np.asarray(col, np.int64) < last[ci]
        return cand[keep], ci[keep], qi

    def _search_in_step(self, q, m, qh, cands) -> np.ndarray:
        """Rule 2: the latest s < i, same rank and step, num_reqs >= 1, whose expected rows zero-extended
        start with the recorded rows: (a) num_reqs_s >= m and its first m rows hash alike, or
        (b) num_reqs_s < m and all its rows hash like the recorded ones (the rest are zeros).
        `cands`: _narrow on (rank, step, first expected row)."""
        cand, ci, qi = cands
        if cand.size == 0:
            return np.full(q.size, -1, np.int64)
        first, cs = self._prefix_sums(cand)
        nrc = self.d["obs.num_reqs"][cand].astype(np.int64)
        with np.errstate(over="ignore"):
            full = [c[first + nrc] - c[first] for c in cs]
        # (a) each candidate's prefix hash at every length a query of its group has (and it reaches):
        # the queried lengths of a group, sorted, and a vectorised binary search per candidate
        o = np.lexsort((m, qi))
        gq, mq = qi[o], m[o]
        uniq = np.ones(gq.size, bool)
        uniq[1:] = (gq[1:] != gq[:-1]) | (mq[1:] != mq[:-1])
        gq, mq = gq[uniq], mq[uniq]
        g0 = np.searchsorted(gq, ci, "left")
        lo, hi = g0.copy(), np.searchsorted(gq, ci, "right")
        while True:
            act = lo < hi
            if not act.any():
                break
            mid = (lo + hi) // 2
            le = mq[np.minimum(mid, mq.size - 1)] <= nrc
            lo, hi = np.where(act & le, mid + 1, lo), np.where(act & ~le, mid, hi)
        sidx, _, pos = ragged(g0, lo - g0)
        k = mq[pos]
        with np.errstate(over="ignore"):
            at = [c[first[sidx] + k] - c[first[sidx]] for c in cs]
        ca, qa = join([ci[sidx], k, *_i64(at)], [qi, m, *_i64(qh)])
        keep = np.isin(ca, qa)
        best = latest_before(ca[keep], cand[sidx][keep], np.zeros(int(keep.sum()), np.int64), qa, q,
                             np.ones(q.size, np.int64))
        # (b) whole rows of shorter candidates: value num_reqs_s must be < m
        cb, qb = join([ci, *_i64(full)], [qi, *_i64(qh)])
        keep = np.isin(cb, qb)
        best = np.maximum(best, latest_before(cb[keep], cand[keep], nrc[keep], qb, q, m))
        self._in_step.update(zip(q.tolist(), best.tolist()))
        return best

    def _by_values(self, q, m) -> tuple[np.ndarray, np.ndarray]:
        """Rules 3-5 for all wrong views at once (row-wise, then one reduction per observation): the
        global lengths; another rank (the interval argument of _other_rank); another interleave."""
        d, c = self.d, self.d.config
        N, il = c.dcp_size, c.cp_interleave
        rank = d["obs.rank"][q].astype(np.int64)
        seq0, rec0 = d["obs.rows"][q].astype(np.int64), d["obs.dcp_rows"][q].astype(np.int64)

        def L(v, r):  # the global lengths under rows r of views v (read for the rows tested only)
            return d.take("rows.seq_lens", seq0[v] + r).astype(np.int64)

        def R(v, r):  # the recorded rows r of views v
            return d.take("rows.dcp_local_seq_lens", rec0[v] + r).astype(np.int64)

        def every_row(test, views: np.ndarray) -> np.ndarray:
            """Views (a mask) that pass test(views v and rows r of each element, views k, each view's first element)
            on every prefix of their rows, tried on growing prefixes (1 row, then the next 4, 16, ...), each on the
            views still passing: a wrong view fails at one of its first rows, and the rest of its rows are not
            read (a first-row test alone let a third of them through). The test must fail a view for good once it
            fails."""
            views = views.copy()
            k = np.flatnonzero(views & (m > 0))
            lo, width = 0, 1
            while k.size:
                hi = np.minimum(m[k], lo + width)
                n = hi - lo
                seg, j, _ = ragged(np.zeros(k.size, np.int64), n)
                ok = test(k[seg], lo + j, k, np.cumsum(n) - n)
                views[k[~ok]] = False
                k = k[ok & (hi < m[k])]
                lo, width = lo + width, width * 4
            return views

        def rows(f):  # every row of the block passes f
            return lambda v, r, k, first: np.logical_and.reduceat(f(v, r), first)

        a, b = np.zeros(q.size, np.int64), np.full(q.size, N, np.int64)

        def other_rank(v, r, k, first):
            """The ranks giving every row so far are [a, b) (reference.ranks_giving's intervals, intersected);
            the view passes while that holds a rank other than its own (the interval only shrinks)."""
            lo, hi, ok = ranks_giving(L(v, r), R(v, r), N, il)
            a[k] = np.maximum(a[k], np.maximum.reduceat(lo, first))
            b[k] = np.minimum(b[k], np.minimum.reduceat(hi, first))
            return np.logical_and.reduceat(ok, first) & (a[k] < b[k]) & ((a[k] != rank[k]) | (a[k] + 1 < b[k]))

        alive = np.ones(q.size, bool)
        glob = every_row(rows(lambda v, r: R(v, r) == L(v, r)), alive)
        other = np.where(every_row(other_rank, alive), np.where(a != rank, a, a + 1), -1)
        extra = (c.page_size,) if c.page_size and c.page_size not in INTERLEAVES else ()
        ils = [x for x in INTERLEAVES + extra if x != il]
        inter = np.full(q.size, -1, np.int64)
        todo = ~glob & (other < 0)  # (global and wrong-rank come first)
        for x in ils:  # the first interleave that fits wins
            hit = every_row(rows(lambda v, r, x=x: local_np(L(v, r), N, rank[v], x) == R(v, r)), todo)
            inter[hit] = x
            todo &= ~hit
        kind = np.where(glob, GLOBAL, np.where(other >= 0, WRONG_RANK, np.where(inter >= 0, WRONG_INTERLEAVE, 0)))
        aux = np.where(glob, 0, np.where(other >= 0, other, np.where(inter >= 0, inter, 0)))
        for i, g, r, x in zip(q.tolist(), glob.tolist(), other.tolist(), inter.tolist()):
            self._value[i] = (("global", {}) if g else ("wrong-rank", {"rank": r}) if r >= 0 else
                              ("wrong-interleave", {"interleave": x}) if x >= 0 else None)
        return kind.astype(np.int8), aux.astype(np.int64)

    def _search_earlier_steps(self, q, qh, cands) -> np.ndarray:
        """Rule 6: the latest s before i (in the run's order: Dump.order_of) of the same rank in an earlier step
        whose expected rows equal the recorded ones up to trailing zeros. `cands`: _narrow on (rank, expected rows
        0 and 1)."""
        cand, ci, qi = cands
        if q.size == 0 or cand.size == 0:
            return np.full(q.size, -1, np.int64)
        d = self.d
        step = d["obs.step"]
        first, cs = self._prefix_sums(cand)
        with np.errstate(over="ignore"):
            full = [c[first + d["obs.num_reqs"][cand].astype(np.int64)] - c[first] for c in cs]
        ci, qi = join([ci, *_i64(full)], [qi, *_i64(qh)])
        keep = np.isin(ci, qi)
        best = latest_before(ci[keep], d.order_of(cand[keep]), step[cand][keep], qi, d.order_of(q), step[q],
                             c_id=cand[keep])
        self._earlier.update(zip(q.tolist(), best.tolist()))
        return best


class Provenance(_Search):
    """Finds where a wrong view came from, in docs/replay.md's precedence; built lazily, so clean dumps pay nothing.
    `prepare` (the bulk search) with every wrong observation first; `explain_many` then reads its answers for
    many views at once, `explain` for one (searching for that one alone if it was not prepared)."""

    # ----- every wrong view at once

    def explain_many(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """`explain` for many observations at once (their wrong views: the recorded real rows), prepared or not:
        (kind: MISMATCH, GLOBAL, WRONG_RANK, WRONG_INTERLEAVE or STALE; source index, -1 none; relation, an
        index into RELATIONS, -1 none; aux: the rank of wrong-rank, the interleave of wrong-interleave).
        Every hit is confirmed row by row in one pass; a view whose hash hit fails to confirm (never seen)
        takes `explain`'s exact path alone."""
        d = self.d
        obs = np.asarray(obs, np.int64)
        n = obs.size
        kind = np.zeros(n, np.int8)
        src, rel, aux = np.full(n, -1, np.int64), np.full(n, -1, np.int64), np.zeros(n, np.int64)
        if n == 0:
            return kind, src, rel, aux
        self.prepare(obs)
        nr = d["obs.num_reqs"].astype(np.int64)
        has = d["obs.has_dcp"][obs] == 1
        m = np.where(has, np.minimum(np.diff(d["obs.dcp_rows"])[obs], nr[obs]), 0)
        todo = np.ones(n, bool)
        k = np.flatnonzero(self._parent_hits(obs, m))  # 1. the parent's rows for this slice
        if k.size:
            kind[k], src[k], rel[k], todo[k] = STALE, d["obs.parent"][obs[k]], 0, False
        todo &= ~((m == 0) | ~has)  # no recorded real rows: a mismatch
        q_all, in_step, vkind, vaux, earlier = self._bulk_answers()
        pos = np.minimum(np.searchsorted(q_all, obs), max(q_all.size - 1, 0))
        known = (q_all[pos] == obs) if q_all.size else np.zeros(n, bool)
        alone = np.flatnonzero(todo & ~known)  # not prepared in bulk (cannot happen after prepare): one at a time
        todo[alone] = False
        # 2. earlier in the step: confirm the prefix of the expected rows
        k = np.flatnonzero(todo)
        s = in_step[pos[k]] if k.size else np.zeros(0, np.int64)
        cand = s >= 0
        ok = zero_ext_equal(self.d, obs[k[cand]], m[k[cand]], s[cand], m[k[cand]])
        alone = np.concatenate([alone, k[cand][~ok]])
        todo[k[cand][~ok]] = False
        k = k[cand][ok]
        kind[k], src[k], rel[k], todo[k] = STALE, in_step[pos[k]], 1, False
        # 3-5. global, another rank, another interleave (decided in prepare)
        k = np.flatnonzero(todo)
        v = vkind[pos[k]] if k.size else np.zeros(0, np.int8)
        k, v = k[v > 0], v[v > 0]
        kind[k], aux[k], todo[k] = v, vaux[pos[k]], False
        # 6. an earlier step: the whole expected rows, up to trailing zeros
        k = np.flatnonzero(todo)
        s = earlier[pos[k]] if k.size else np.zeros(0, np.int64)
        step = d["obs.step"]
        cand = (s >= 0) & (d.order_of(np.maximum(s, 0)) < d.order_of(obs[k])) & (step[np.maximum(s, 0)] < step[obs[k]])
        stale = s >= 0
        ok = zero_ext_equal(self.d, obs[k[cand]], m[k[cand]], s[cand], np.maximum(nr[s[cand]], m[k[cand]]))
        good = np.zeros(k.size, bool)
        good[np.flatnonzero(cand)[ok]] = True
        alone = np.concatenate([alone, k[stale & ~good]])  # a hit that did not confirm: the exact scan
        k = k[good]
        kind[k], src[k], rel[k] = STALE, earlier[pos[k]], 2
        for t in np.unique(alone).tolist():
            i = int(obs[t])
            view = d.dcp_of(i)
            rule, source, detail = self.explain(i, np.asarray(view[: int(m[t])], np.int64))
            kind[t] = _KIND[rule]
            if source is not None:
                src[t], rel[t] = source.index, _RELATION[source.relation]
            aux[t] = detail.get("rank", detail.get("interleave", 0))
        return kind, src, rel, aux

    def _bulk_answers(self) -> tuple[np.ndarray, ...]:
        if not self._bulk:
            z = np.zeros(0, np.int64)
            return z, z, np.zeros(0, np.int8), z, z
        if len(self._bulk) > 1:
            cols = [np.concatenate(c) for c in zip(*self._bulk)]
            order = np.argsort(cols[0], kind="stable")
            self._bulk = [tuple(c[order] for c in cols)]
        return self._bulk[0]

    # ----- exact checks

    def _prefix_equal(self, s: int, rec: np.ndarray) -> bool:
        e = expected_of(self.d, s, rec.size)
        return bool(np.array_equal(np.pad(e, (0, rec.size - e.size)), rec))

    def _strip_equal(self, s: int, want: np.ndarray) -> bool:
        return bool(np.array_equal(_strip(expected_of(self.d, s, int(self.d["obs.num_reqs"][s]))), want))

    def _scan_in_step(self, i: int, rec: np.ndarray) -> int:
        """The exact search for one finding (only after a hash hit failed to confirm)."""
        d = self.d
        same = np.flatnonzero((d["obs.rank"] == d["obs.rank"][i]) & (d["obs.step"] == d["obs.step"][i]))
        for s in same[same < i][::-1]:
            if d["obs.num_reqs"][s] >= 1 and self._prefix_equal(int(s), rec):
                return int(s)
        return -1

    def _scan_earlier_steps(self, i: int, want: np.ndarray) -> int:
        d = self.d
        same = np.flatnonzero((d["obs.rank"] == d["obs.rank"][i]) & (d["obs.step"] < d["obs.step"][i]))
        at = d.order_of(same)
        keep = at < d.order_of(i)
        for s in same[keep][np.argsort(at[keep], kind="stable")][::-1]:  # the latest first, in the run's order
            if self._strip_equal(int(s), want):
                return int(s)
        return -1

    def explain(self, i: int, rec: np.ndarray) -> tuple[str, Source | None, dict]:
        """rec: the recorded real rows of observation i (which are wrong). Returns (rule, source, detail).

        Call `prepare` with every wrong observation first to search them all at once; otherwise
        the search runs for this one."""
        d, c = self.d, self.d.config
        rank = int(d["obs.rank"][i])
        seq = d.seq_lens_of(i)[: rec.size].astype(np.int64)
        # 1. the parent's rows for this slice: what they must be, or what the parent recorded (a copy of a
        # parent that was itself wrong is still a copy; the parent has its own finding)
        if d.has("obs.parent", "obs.req_start"):
            p, rs = int(d["obs.parent"][i]), int(d["obs.req_start"][i])
            if p >= 0 and rs >= 0:
                pe = expected_of(d, p, rs + rec.size)[rs:]
                pv = d.dcp_of(p)
                if np.array_equal(np.pad(pe, (0, rec.size - pe.size)), rec) or (
                        pv is not None and np.array_equal(pv[rs : rs + rec.size], rec)):
                    return "stale", self._source(p, "parent-rows"), {}
        if rec.size == 0:
            return "mismatch", None, {}
        if i not in self._prepared:
            self.prepare(np.array([i]))
        # 2. an earlier observation of this rank in this step, most recent first (a prefix of its rows)
        s = self._in_step.get(i, -1)
        if s >= 0 and not self._prefix_equal(s, rec):
            s = self._scan_in_step(i, rec)
        if s >= 0:
            return "stale", self._source(s, "earlier-in-step"), {}
        # 3-5. the global lengths, another rank, another interleave (prepared in bulk, or one at a time)
        if i in self._value:
            v = self._value[i]
            if v is not None:
                return v[0], None, v[1]
        elif np.array_equal(rec, seq):
            return "global", None, {}
        else:
            r = _other_rank(seq, rec, c.dcp_size, c.cp_interleave, rank)  # no [rows, N] array: N may be 4,096
            if r is not None:
                return "wrong-rank", None, {"rank": r}
            extra = (c.page_size,) if c.page_size and c.page_size not in INTERLEAVES else ()
            ils = np.array([il for il in INTERLEAVES + extra if il != c.cp_interleave])
            hit = np.flatnonzero((local_np(seq[:, None], c.dcp_size, rank, ils[None, :]) == rec[:, None]).all(axis=0))
            if hit.size:
                return "wrong-interleave", None, {"interleave": int(ils[hit[0]])}
        # 6. an earlier step of this rank, most recent first (e.g. a buffer baked into a graph)
        want = _strip(rec)
        if want.size:
            s = self._earlier.get(i, -1)
            if s >= 0 and not (d.order_of(s) < d.order_of(i) and d["obs.step"][s] < d["obs.step"][i]
                               and self._strip_equal(s, want)):
                s = self._scan_earlier_steps(i, want)
            if s >= 0:
                return "stale", self._source(s, "earlier-step"), {}
        return "mismatch", None, {}

    def _source(self, s: int, relation: str) -> Source:
        d = self.d
        return Source(index=s, obs=int(d.file_obs[s]), file=d.file_of(s), relation=relation,
                      step=int(d["obs.step"][s]), site=d.site_name(s), ubatch=int(d["obs.ubatch"][s]))
