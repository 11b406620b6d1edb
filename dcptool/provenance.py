"""Provenance: which observation (or rank, or interleave) a wrong DCP view really belongs to (DESIGN §3)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcptool.dump import Dump, take

INTERLEAVES = tuple(2**k for k in range(11))  # 1..1024, wrong-interleave candidates


def local_np(seq: np.ndarray, dcp_size: int, rank, cp_interleave: int) -> np.ndarray:
    """The formula in numpy (int64), for the rows provenance and row views look at."""
    L = np.asarray(seq, dtype=np.int64)
    il = np.asarray(cp_interleave, np.int64)  # an int, or an array broadcasting against seq
    span = dcp_size * il
    rounds = L // span
    return rounds * il + np.minimum(np.maximum(L - rounds * span - np.asarray(rank, np.int64) * il, 0), il)


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
    """The lowest rank other than `rank` whose local lengths are rec, without a loop over N ranks.

    For one row, local(L, r) is rounds*I + I for r < rem // I, rounds*I + rem % I at r = rem // I,
    and rounds*I from cdiv(rem, I) on: the ranks giving a value form one interval; intersect them.
    """
    L, v = seq.astype(np.int64), rec.astype(np.int64)
    rounds, rem = L // (N * il), L % (N * il)
    base = rounds * il
    lo = np.where(v == base + il, 0, np.where(v == base, -(-rem // il), rem // il))
    hi = np.where(v == base + il, rem // il, np.where(v == base, N, rem // il + 1))
    ok = (v == base + il) | (v == base) | ((v == base + rem % il) & (rem % il != 0))
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


@dataclass(frozen=True)
class Source:
    """Where a stale value came from: an observation whose expected rows the view holds."""

    index: int  # position in the merged dump
    obs: int  # index in its file
    file: str
    relation: str  # parent-rows | earlier-in-step | earlier-step
    step: int
    site: str
    ubatch: int

    def to_json(self) -> dict:
        return {"obs": self.obs, "relation": self.relation, "step": self.step, "site": self.site,
                "ubatch": self.ubatch, "file": self.file}


class Provenance:
    """Finds where a wrong view came from, in DESIGN §3's precedence; built lazily, so clean dumps
    pay nothing.

    Candidates in the same step are few and compared directly. Earlier steps are many, so they are
    looked up by a hash of each observation's first two expected rows (zero past num_reqs, so a
    zero-extended view keys alike), built with one O(n) gather the first time it is needed; a hit
    is confirmed by comparing all rows.
    """

    def __init__(self, d: Dump):
        self.d = d
        self._by_rank_step: tuple[np.ndarray, np.ndarray] | None = None
        self._sig: tuple[np.ndarray, np.ndarray] | None = None

    def _rank_step_index(self) -> tuple[np.ndarray, np.ndarray]:
        """Observations sorted by (rank, step, index): same-rank, same-step neighbours by bisection."""
        if self._by_rank_step is None:
            d = self.d
            order = np.lexsort((np.arange(d.n), d["obs.step"], d["obs.rank"]))
            key = d["obs.rank"][order].astype(np.int64) * (1 << 48) + d["obs.step"][order]
            self._by_rank_step = (order, key)
        return self._by_rank_step

    def _signatures(self) -> tuple[np.ndarray, np.ndarray]:
        """(sorted keys, observation per key): key = (rank, expected rows 0 and 1, 0 past num_reqs).

        Two gathered rows per observation (O(n), not O(rows)) narrow earlier-step candidates to
        the few whose leading rows agree; each is then compared whole.
        """
        if self._sig is None:
            d = self.d
            self._sig = self._key(d["obs.rank"], self._row(0), self._row(1))
        return self._sig

    def _row(self, j: int) -> np.ndarray:
        d, c = self.d, self.d.config
        nr = d["obs.num_reqs"]
        idx = np.flatnonzero(nr > j)
        out = np.zeros(d.n, np.int64)
        out[idx] = local_np(take(d, "rows.seq_lens", d["obs.rows"][idx] + j), c.dcp_size, d["obs.rank"][idx],
                            c.cp_interleave)
        return out

    @staticmethod
    def _key(rank, e0, e1):
        with np.errstate(over="ignore"):
            k = ((np.asarray(e0).astype(np.uint64) << np.uint64(32)) | np.asarray(e1).astype(np.uint64)
                 & np.uint64(0xFFFFFFFF)) ^ (np.asarray(rank).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
        if np.ndim(k) == 0:
            return k
        order = np.argsort(k, kind="stable")
        return k[order], order

    def _prefix_equal(self, s: int, rec: np.ndarray) -> bool:
        e = expected_of(self.d, s, rec.size)
        return bool(np.array_equal(np.pad(e, (0, rec.size - e.size)), rec))

    def explain(self, i: int, rec: np.ndarray) -> tuple[str, Source | None, dict]:
        """rec: the recorded real rows of observation i (which are wrong). Returns (rule, source, detail)."""
        d, c = self.d, self.d.config
        rank, step = int(d["obs.rank"][i]), int(d["obs.step"][i])
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
        # 2. an earlier observation of this rank in this step, most recent first (a prefix of its rows)
        order, key = self._rank_step_index()
        k = rank * (1 << 48) + step
        for s in order[np.searchsorted(key, k, "left") : np.searchsorted(key, k, "right")][::-1]:
            if s < i and d["obs.num_reqs"][s] >= 1 and self._prefix_equal(int(s), rec):
                return "stale", self._source(int(s), "earlier-in-step"), {}
        # 3-5. the global lengths, another rank, another interleave (all candidates in one shot)
        if np.array_equal(rec, seq):
            return "global", None, {}
        r = _other_rank(seq, rec, c.dcp_size, c.cp_interleave, rank)  # no [rows, dcp_size] array: N may be 2**31
        if r is not None:
            return "wrong-rank", None, {"rank": r}
        col = seq[:, None]
        extra = (c.page_size,) if c.page_size and c.page_size not in INTERLEAVES else ()
        ils = np.array([il for il in INTERLEAVES + extra if il != c.cp_interleave])
        hit = np.flatnonzero((local_np(col, c.dcp_size, rank, ils[None, :]) == rec[:, None]).all(axis=0))
        if hit.size:
            return "wrong-interleave", None, {"interleave": int(ils[hit[0]])}
        # 6. an earlier step of this rank, most recent first (e.g. a buffer baked into a graph)
        if _strip(rec).size:
            keys, obs = self._signatures()
            h = self._key(rank, rec[0], rec[1] if rec.size > 1 else 0)
            hits = np.sort(obs[np.searchsorted(keys, h, "left") : np.searchsorted(keys, h, "right")])[::-1]
            steps = d["obs.step"]
            want = _strip(rec)
            for s in hits:
                if s < i and steps[s] < step and np.array_equal(
                        _strip(expected_of(d, int(s), int(d["obs.num_reqs"][s]))), want):
                    return "stale", self._source(int(s), "earlier-step"), {}
        return "mismatch", None, {}

    def _source(self, s: int, relation: str) -> Source:
        d = self.d
        return Source(index=s, obs=int(d.file_obs[s]), file=d.file_of(s), relation=relation,
                      step=int(d["obs.step"][s]), site=d.site_name(s), ubatch=int(d["obs.ubatch"][s]))
