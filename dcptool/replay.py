"""Replay: recompute what every observation's DCP view must hold and turn differences into findings."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from dcptool.dump import Dump
from dcptool.slicing import Ubatch, split_batch

# DESIGN §3, in table order: findings of one observation are reported in this order.
RULES = ("missing", "stale", "global", "wrong-rank", "wrong-interleave", "mismatch", "padding", "shape",
         "stray", "ubatch-slice", "alias", "rank-sum", "pages")
SEVERITY = {r: ("warning" if r == "stray" else "error") for r in RULES}
_RULE_ORDER = {r: i for i, r in enumerate(RULES)}
INTERLEAVES = tuple(2**k for k in range(11))  # 1..1024, wrong-interleave candidates


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
    message: str
    source: Source | None = None
    detail: dict = field(default_factory=dict)

    @property
    def severity(self) -> str:
        return SEVERITY[self.rule]

    def to_json(self) -> dict:
        return {"type": "finding", "rule": self.rule, "severity": self.severity, "obs": self.obs,
                "file": self.file, "step": self.step, "site": self.site, "rank": self.rank,
                "ubatch": self.ubatch, "row": self.row, "recorded": self.recorded, "expected": self.expected,
                "wrong_rows": self.wrong_rows, "source": None if self.source is None else self.source.to_json(),
                "detail": self.detail, "message": self.message}


@dataclass(frozen=True)
class Split:
    """`--split K`: what one micro-batch of a recorded full batch must carry."""

    parent: int  # merged index
    parent_obs: int
    file: str
    ubatch: int
    ub: Ubatch
    dcp_local_seq_lens: np.ndarray  # for the parent's rank, padded rows included

    def to_json(self) -> dict:
        s = self.ub.slice
        return {"type": "split", "parent_obs": self.parent_obs, "file": self.file, "ubatch": self.ubatch,
                "req_start": s.req_start, "req_stop": s.req_stop, "tok_start": s.tok_start,
                "tok_stop": s.tok_stop, "num_reqs": self.ub.num_reqs, "num_reqs_padded": self.ub.num_reqs_padded,
                "query_start_loc": self.ub.query_start_loc.tolist(), "seq_lens": self.ub.seq_lens.tolist(),
                "dcp_local_seq_lens": self.dcp_local_seq_lens.tolist()}


@dataclass(frozen=True)
class RowsView:
    """`--obs I`: one observation row by row."""

    index: int
    obs: int
    file: str
    step: int
    site: str
    rank: int
    ubatch: int
    num_reqs: int
    num_reqs_padded: int
    seq_lens: list[int]
    expected: list[int]  # this rank, num_reqs_padded rows
    recorded: list[int] | None
    expected_all_ranks: list[list[int]]  # [row][rank], real rows
    verdict: list[str]
    findings: list[Finding]

    def to_json(self) -> dict:
        return {"type": "rows", "obs": self.obs, "file": self.file, "step": self.step, "site": self.site,
                "rank": self.rank, "ubatch": self.ubatch, "num_reqs": self.num_reqs,
                "num_reqs_padded": self.num_reqs_padded, "seq_lens": self.seq_lens, "expected": self.expected,
                "recorded": self.recorded, "expected_all_ranks": self.expected_all_ranks, "verdict": self.verdict}


@dataclass
class ReplayResult:
    files: list[str]
    config: object
    observations: int
    findings: list[Finding]
    backend: str
    device: str
    seconds: float
    skipped: dict[str, str] = field(default_factory=dict)  # check -> why it did not run
    splits: list[Split] = field(default_factory=list)
    rows_view: RowsView | None = None

    @property
    def errors(self) -> int:
        return sum(f.severity == "error" for f in self.findings)

    @property
    def warnings(self) -> int:
        return sum(f.severity == "warning" for f in self.findings)

    def by_rule(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.findings:
            out[f.rule] = out.get(f.rule, 0) + 1
        return {r: out[r] for r in RULES if r in out}

    def by_site(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = defaultdict(dict)
        for f in self.findings:
            out[f.site][f.rule] = out[f.site].get(f.rule, 0) + 1
        return dict(out)

    def summary_json(self) -> dict:
        return {"type": "summary", "files": self.files, "observations": self.observations,
                "findings": len(self.findings), "errors": self.errors, "warnings": self.warnings,
                "by_rule": self.by_rule(), "by_site": self.by_site(),
                "first": self.findings[0].to_json() if self.findings else None, "skipped": self.skipped,
                "backend": self.backend, "device": self.device, "seconds": round(self.seconds, 4)}


# --------------------------------------------------------------------------------------------
# Expected values


def local_np(seq: np.ndarray, dcp_size: int, rank, cp_interleave: int) -> np.ndarray:
    """The formula in numpy (int64), for the handful of rows provenance and row views look at."""
    L = np.asarray(seq, dtype=np.int64)
    span = dcp_size * cp_interleave
    rounds = L // span
    return rounds * cp_interleave + np.clip(L - rounds * span - np.asarray(rank, np.int64) * cp_interleave,
                                            0, cp_interleave)


def expected_of(d: Dump, i: int) -> np.ndarray:
    """Expected view of observation i: real rows by the formula, padded rows 0 (num_reqs_padded rows)."""
    c = d.config
    nr, nrp = int(d["obs.num_reqs"][i]), int(d["obs.num_reqs_padded"][i])
    out = np.zeros(nrp, np.int64)
    out[:nr] = local_np(d.seq_lens_of(i)[:nr], c.dcp_size, int(d["obs.rank"][i]), c.cp_interleave)
    return out


def _check_values(d: Dump, sel: np.ndarray, backend: str):
    """Run the fused check over the observations in `sel` (one launch); returns [4, len(sel)]."""
    import torch

    c = d.config
    rows, dcp_rows = d["obs.rows"], d["obs.dcp_rows"]
    if sel.size == d.n:
        args_rows = (torch.from_numpy(d["rows.seq_lens"]), torch.from_numpy(rows),
                     torch.from_numpy(d["rows.dcp_local_seq_lens"]), torch.from_numpy(dcp_rows))
        per = [torch.from_numpy(d[k]) for k in ("obs.num_reqs", "obs.num_reqs_padded", "obs.rank")]
    else:
        # Only observations with a view: rebuild the dcp offsets over the selection, seq rows unchanged.
        dl = dcp_rows[1:][sel] - dcp_rows[:-1][sel]
        new = np.zeros(sel.size + 1, np.int64)
        np.cumsum(dl, out=new[1:])
        src = np.repeat(dcp_rows[:-1][sel] - new[:-1], dl) + np.arange(new[-1])
        seq_start = np.empty(sel.size + 1, np.int64)
        seq_start[:-1] = rows[:-1][sel]
        seq_start[-1] = 0
        args_rows = (torch.from_numpy(d["rows.seq_lens"]), torch.from_numpy(seq_start),
                     torch.from_numpy(np.ascontiguousarray(d["rows.dcp_local_seq_lens"][src])), torch.from_numpy(new))
        per = [torch.from_numpy(np.ascontiguousarray(d[k][sel]))
               for k in ("obs.num_reqs", "obs.num_reqs_padded", "obs.rank")]
    if backend == "torch":
        from dcptool.reference import check_rows
    else:
        from dcptool.kernel import check_rows
        from dcptool.kernel import device as kdev

        dev = kdev()
        args_rows = tuple(t.to(dev) for t in args_rows)
        per = [t.to(dev) for t in per]
    stats = check_rows(*args_rows, *per, c.dcp_size, c.cp_interleave)
    return stats.cpu().numpy()


# --------------------------------------------------------------------------------------------
# Provenance (only for observations with wrong real rows)


class _Provenance:
    """Finds where a wrong view came from, in DESIGN §3's precedence.

    Sources are looked up by an additive hash of expected rows (Σ row_j * W_j, uint64): zero rows
    add nothing, so a prefix and a zero-extended view hash alike, and prefix hashes of every
    observation come from one cumulative sum. The hashes are built lazily on the first wrong
    observation, so clean dumps pay nothing. A hash hit is confirmed by exact comparison.
    """

    def __init__(self, d: Dump):
        self.d = d
        self._prefix = None
        self._tables: dict[int, dict] = {}
        self.rng_w = np.random.default_rng(0x5EED).integers(1, 2**63, size=1 << 16, dtype=np.uint64) | 1

    def _weights(self, k: int) -> np.ndarray:
        if k > self.rng_w.size:
            extra = np.random.default_rng(k).integers(1, 2**63, size=k - self.rng_w.size, dtype=np.uint64) | 1
            self.rng_w = np.concatenate([self.rng_w, extra])
        return self.rng_w[:k]

    def _build_prefix(self) -> None:
        d, c = self.d, self.d.config
        rows = d["obs.rows"]
        lens = np.diff(rows)
        obs = np.repeat(np.arange(d.n), lens)
        j = np.arange(rows[-1]) - rows[:-1][obs]
        exp = local_np(d["rows.seq_lens"], c.dcp_size, d["obs.rank"][obs], c.cp_interleave)
        exp[j >= d["obs.num_reqs"][obs]] = 0
        w = self._weights(int(lens.max()) if lens.size else 0)
        h = np.zeros(rows[-1] + 1, np.uint64)
        with np.errstate(over="ignore"):
            np.cumsum(exp.astype(np.uint64) * w[j], out=h[1:])
        self._prefix = h

    def _table(self, k: int) -> dict:
        """(rank, hash of the first k expected rows, zero-extended) -> observation indices, ascending."""
        if k not in self._tables:
            if self._prefix is None:
                self._build_prefix()
            d = self.d
            rows = d["obs.rows"]
            end = rows[:-1] + np.minimum(np.diff(rows), k)
            with np.errstate(over="ignore"):
                h = self._prefix[end] - self._prefix[rows[:-1]]
            t: dict = defaultdict(list)
            ok = d["obs.num_reqs"] >= 1
            for i in np.flatnonzero(ok):  # once per distinct k of a wrong view, not per observation
                t[(int(d["obs.rank"][i]), int(h[i]))].append(int(i))
            self._tables[k] = t
        return self._tables[k]

    def _hash(self, rec: np.ndarray) -> int:
        with np.errstate(over="ignore"):
            return int(np.sum(rec.astype(np.int64).astype(np.uint64) * self._weights(rec.size), dtype=np.uint64))

    def _equal(self, src: int, rec: np.ndarray) -> bool:
        e = expected_of(self.d, src)[: rec.size]
        return e.size >= 0 and np.array_equal(np.pad(e, (0, rec.size - e.size)), rec)

    def explain(self, i: int, rec: np.ndarray) -> tuple[str, Source | None, dict]:
        """rec: the recorded real rows. Returns (rule, source, detail)."""
        d, c = self.d, self.d.config
        rank, step = int(d["obs.rank"][i]), int(d["obs.step"][i])
        seq = d.seq_lens_of(i)[: rec.size].astype(np.int64)
        # 1. the parent's rows for this slice: what they must be, or what the parent recorded (a copy of a
        # parent that was itself wrong is still a copy; the parent has its own finding)
        if d.has("obs.parent", "obs.req_start"):
            p, rs = int(d["obs.parent"][i]), int(d["obs.req_start"][i])
            if p >= 0 and rs >= 0:
                pe = expected_of(d, p)[rs : rs + rec.size]
                pv = d.dcp_of(p)
                if np.array_equal(np.pad(pe, (0, rec.size - pe.size)), rec) or (
                        pv is not None and np.array_equal(pv[rs : rs + rec.size], rec)):
                    return "stale", self._source(p, "parent-rows"), {}
        if rec.size == 0:
            return "mismatch", None, {}
        cands = self._table(rec.size).get((rank, self._hash(rec)), [])
        steps = d["obs.step"]
        # 2. an earlier observation of this rank in this step, most recent first
        for s in reversed(cands):
            if s < i and steps[s] == step and self._equal(s, rec):
                return "stale", self._source(s, "earlier-in-step"), {}
        # 3-5. the global lengths, another rank, another interleave
        if np.array_equal(rec, seq):
            return "global", None, {}
        for r in range(c.dcp_size):
            if r != rank and np.array_equal(rec, local_np(seq, c.dcp_size, r, c.cp_interleave)):
                return "wrong-rank", None, {"rank": r}
        extra = (c.page_size,) if c.page_size and c.page_size not in INTERLEAVES else ()
        for il in INTERLEAVES + extra:
            if il != c.cp_interleave and np.array_equal(rec, local_np(seq, c.dcp_size, rank, il)):
                return "wrong-interleave", None, {"interleave": il}
        # 6. an earlier step of this rank, most recent first (e.g. a buffer baked into a graph)
        for s in reversed(cands):
            if s < i and steps[s] < step and self._equal(s, rec):
                return "stale", self._source(s, "earlier-step"), {}
        return "mismatch", None, {}

    def _source(self, s: int, relation: str) -> Source:
        d = self.d
        return Source(index=s, obs=int(d.file_obs[s]), file=d.file_of(s), relation=relation,
                      step=int(d["obs.step"][s]), site=d.site_name(s), ubatch=int(d["obs.ubatch"][s]))


# --------------------------------------------------------------------------------------------
# Findings


def _mk(d: Dump, i: int, rule: str, message: str, *, row=None, recorded=None, expected=None, wrong_rows=0,
        source=None, detail=None) -> Finding:
    return Finding(rule=rule, index=int(i), obs=int(d.file_obs[i]), file=d.file_of(i), step=int(d["obs.step"][i]),
                   site=d.site_name(i), rank=int(d["obs.rank"][i]), ubatch=int(d["obs.ubatch"][i]),
                   row=None if row is None else int(row), recorded=None if recorded is None else int(recorded),
                   expected=None if expected is None else int(expected), wrong_rows=int(wrong_rows),
                   message=message, source=source, detail=detail or {})


def _where(d: Dump, i: int) -> str:
    ub = int(d["obs.ubatch"][i])
    return f"step {int(d['obs.step'][i])} {d.site_name(i)} rank {int(d['obs.rank'][i])}" + (
        f" ubatch {ub}" if ub >= 0 else "")


_EXPLAIN = {
    "parent-rows": "copied from the parent batch (obs {obs}, {site}); recompute from the micro-batch's own seq_lens",
    "earlier-in-step": "derived from an earlier batch of this step (obs {obs}, {site}), e.g. the global batch "
                       "before the PCP partition; compute it from the final batch",
    "earlier-step": "left over from step {step} (obs {obs}, {site}); the buffer was not refreshed "
                    "(e.g. baked into a CUDA graph)",
}


def _value_findings(d: Dump, prov: _Provenance, i: int, n_wrong: int, first: int) -> Finding:
    c = d.config
    nr = int(d["obs.num_reqs"][i])
    view = d.dcp_of(i)
    rec = np.asarray(view[: min(view.size, nr)], np.int64)
    exp = expected_of(d, i)
    rule, src, detail = prov.explain(i, rec)
    kw = dict(row=first, recorded=rec[first], expected=exp[first], wrong_rows=n_wrong, source=src, detail=detail)
    w = _where(d, i)
    if rule == "stale":
        msg = f"{w}: DCP view is stale, " + _EXPLAIN[src.relation].format(obs=src.obs, site=src.site, step=src.step)
    elif rule == "global":
        msg = f"{w}: DCP view holds the global seq_lens, not this rank's local lengths"
    elif rule == "wrong-rank":
        msg = f"{w}: DCP view holds rank {detail['rank']}'s local lengths; pass this rank's dcp_rank"
    elif rule == "wrong-interleave":
        msg = (f"{w}: DCP view was computed with interleave {detail['interleave']}, the dump's is "
               f"{c.cp_interleave}; check cp_kv_cache_interleave_size")
    else:
        msg = f"{w}: {n_wrong} real row(s) wrong, first row {first}: {rec[first]} recorded, {exp[first]} expected"
    return _mk(d, i, rule, msg, **kw)


def _check_pages(d: Dump) -> list[tuple[int, Finding]]:
    """`pages`: kv_pages must be cdiv(local, page_size) on every real row (checked vectorised)."""
    c = d.config
    page = c.page_size
    rows, nr = d["obs.rows"], d["obs.num_reqs"]
    kv = d["rows.kv_pages"]
    obs = np.repeat(np.arange(d.n), np.diff(rows))
    j = np.arange(rows[-1]) - rows[:-1][obs]
    seq = d["rows.seq_lens"].astype(np.int64)
    allowed = -(-local_np(seq, c.dcp_size, d["obs.rank"][obs], c.cp_interleave) // page)
    bad = (j < nr[obs]) & (kv >= 0) & (kv != allowed)
    out = []
    if not bad.any():
        return out
    bad_obs = obs[bad]
    counts = np.bincount(bad_obs, minlength=d.n)
    first_rows = np.flatnonzero(bad)
    firsts = first_rows[np.r_[True, bad_obs[1:] != bad_obs[:-1]]]
    for r in firsts:
        i = int(obs[r])
        claimed, ok, glob = int(kv[r]), int(allowed[r]), int(-(-seq[r] // page))
        why = (" = the global count: page counts were computed from the global length"
               if claimed == glob else "")
        msg = (f"{_where(d, i)}: attention plan claims {claimed} pages for row {int(j[r])}{why}; this rank "
               f"owns {ok} (cdiv(local {int(local_np(seq[r], c.dcp_size, d['obs.rank'][i], c.cp_interleave))},"
               f" {page}))")
        out.append((i, _mk(d, i, "pages", msg, row=j[r], recorded=claimed, expected=ok, wrong_rows=counts[i],
                           detail={"claimed": claimed, "allowed": ok, "global": glob})))
    return out


def _check_alias(d: Dump) -> list[tuple[int, Finding]]:
    out = []
    buf, ub, has = d["obs.buffer"], d["obs.ubatch"], d["obs.has_dcp"]
    step, rank = d["obs.step"], d["obs.rank"]
    fidx = d.file_index
    seen: dict[tuple, tuple[int, int]] = {}
    # Two micro-batches of one step (same rank, same recording process) sharing a DCP buffer.
    for i in np.flatnonzero((ub >= 0) & (has == 1) & (buf != 0)):
        key = (int(fidx[i]), int(step[i]), int(rank[i]), int(buf[i]))
        if key in seen and seen[key][1] != int(ub[i]):
            j = seen[key][0]
            msg = (f"{_where(d, i)}: micro-batch {int(ub[i])} reads the same DCP buffer as micro-batch "
                   f"{seen[key][1]} (obs {int(d.file_obs[j])}); each micro-batch needs its own buffer")
            out.append((int(i), _mk(d, i, "alias", msg, detail={"buffer": int(buf[i]), "other_obs": int(d.file_obs[j])})))
        else:
            seen.setdefault(key, (int(i), int(ub[i])))
    if "obs.graph" in d.columns:
        g, nrp = d["obs.graph"], d["obs.num_reqs_padded"]
        # Every buffer captured for a key counts: a drafter (DFlash) captures graphs of the same sizes on its
        # own buffers, and several PCP ranks of one DCP rank may share a file; only a buffer no capture used
        # is an alias.
        capture: dict[tuple, dict[int, int]] = {}
        for i in np.flatnonzero(((g == 2) | (g == 3)) & (buf != 0)):
            key = (int(fidx[i]), int(rank[i]), int(nrp[i]), int(ub[i]))
            if g[i] == 2:
                capture.setdefault(key, {})[int(buf[i])] = int(i)
            elif key in capture and int(buf[i]) not in capture[key]:
                j = max(capture[key].values())
                msg = (f"{_where(d, i)}: full-graph replay reads DCP buffer {int(buf[i]):#x} but the graph was "
                       f"captured on {int(buf[j]):#x} (obs {int(d.file_obs[j])}); the replay sees stale values")
                out.append((int(i), _mk(d, i, "alias", msg, detail={"buffer": int(buf[i]), "captured": int(buf[j]),
                                                                    "capture_obs": int(d.file_obs[j])})))
    return out


def _check_rank_sum(d: Dump) -> list[tuple[int, Finding]]:
    """The same batch recorded with a view on all N ranks must add up to seq_len on each real row."""
    c = d.config
    N = c.dcp_size
    if N == 1:
        return []
    out = []
    groups: dict[tuple, dict[int, int]] = {}
    occurrence: dict[tuple, int] = defaultdict(int)
    has, rank = d["obs.has_dcp"], d["obs.rank"]
    for i in np.flatnonzero(has == 1):
        nr = int(d["obs.num_reqs"][i])
        seq = d.seq_lens_of(i)[:nr]
        base = (int(d["obs.step"][i]), int(d["obs.site"][i]), int(d["obs.ubatch"][i]), nr, seq.tobytes())
        r = int(rank[i])
        occ = occurrence[(base, r)]
        occurrence[(base, r)] += 1
        members = groups.setdefault((base, occ), {})
        members[r] = int(i)
        if len(members) < N:
            continue
        views = [d.dcp_of(m) for m in members.values()]
        k = min(min(v.size for v in views), nr)
        total = np.sum([v[:k].astype(np.int64) for v in views], axis=0) if k else np.zeros(0, np.int64)
        bad = np.flatnonzero(total != seq[:k])
        if bad.size:
            j = int(bad[0])
            msg = (f"{_where(d, i)}: across the {N} ranks, local lengths of row {j} add up to {int(total[j])}, "
                   f"not its seq_len {int(seq[j])}")
            out.append((int(i), _mk(d, i, "rank-sum", msg, row=j, recorded=total[j], expected=seq[j],
                                    wrong_rows=bad.size, detail={"obs": sorted(int(d.file_obs[m])
                                                                              for m in members.values())})))
    return out


def _check_ubatch_slice(d: Dump) -> list[tuple[int, Finding]]:
    """A recorded micro-batch must equal slicing its recorded parent at the recorded bounds (§1)."""
    from dcptool.slicing import UbatchSlice, slice_ubatch

    out = []
    par, ub = d["obs.parent"], d["obs.ubatch"]
    rs, ts, te = d["obs.req_start"], d["obs.tok_start"], d["obs.tok_stop"]
    for i in np.flatnonzero((ub >= 0) & (par >= 0) & (rs >= 0) & (ts >= 0) & (te >= 0)):
        p = int(par[i])
        pq, q = d.qsl_of(p), d.qsl_of(i)
        if pq is None or pq.size == 0 or q is None or q.size == 0:
            continue
        nrp = int(d["obs.num_reqs_padded"][i])
        sl = UbatchSlice(int(rs[i]), int(rs[i]) + nrp, int(ts[i]), int(te[i]))
        if sl.req_stop > pq.size - 1:
            msg = f"{_where(d, i)}: requests [{sl.req_start}, {sl.req_stop}) run past the parent's {pq.size - 1}"
            out.append((int(i), _mk(d, i, "ubatch-slice", msg, detail={"field": "req_stop"})))
            continue
        want = slice_ubatch(pq, d.seq_lens_of(p), int(d["obs.num_reqs"][p]), sl)
        seq = d.seq_lens_of(i)[:nrp]
        for name, got, exp in (("num_reqs", np.array([d["obs.num_reqs"][i]]), np.array([want.num_reqs])),
                               ("query_start_loc", q, want.query_start_loc), ("seq_lens", seq, want.seq_lens)):
            if got.size != exp.size or not np.array_equal(got, exp):
                k = next((j for j in range(min(got.size, exp.size)) if got[j] != exp[j]), min(got.size, exp.size))
                rec = int(got[k]) if k < got.size else None
                e = int(exp[k]) if k < exp.size else None
                msg = (f"{_where(d, i)}: {name} disagrees with slicing the parent (obs {int(d.file_obs[p])}) at "
                       f"requests [{sl.req_start}, {sl.req_stop}) tokens [{sl.tok_start}, {sl.tok_stop}): row {k} "
                       f"is {rec}, slicing gives {e}")
                out.append((int(i), _mk(d, i, "ubatch-slice", msg, row=k if name != "num_reqs" else None,
                                        recorded=rec, expected=e,
                                        wrong_rows=int(np.sum(got[: exp.size] != exp[: got.size])) or 1,
                                        detail={"field": name, "parent_obs": int(d.file_obs[p])})))
                break
    return out


def replay(d: Dump, backend: str = "auto", *, split: int | None = None, obs: int | None = None) -> ReplayResult:
    """Check every observation of a dump; findings in observation order, then DESIGN §3 table order."""
    t0 = time.perf_counter()
    c = d.config
    backend, device = resolve_backend(backend)
    N = c.dcp_size
    has = d["obs.has_dcp"].astype(bool)
    nrp = d["obs.num_reqs_padded"]
    dlen = np.diff(d["obs.dcp_rows"])
    found: list[tuple[int, Finding]] = []
    skipped: dict[str, str] = {}
    if N > 1:
        for i in np.flatnonzero(~has):
            msg = (f"{_where(d, i)}: dcp_local_seq_lens is None with dcp_size {N}; attention would fail "
                   "('NoneType' object is not subscriptable)")
            found.append((int(i), _mk(d, i, "missing", msg)))
        sel = np.flatnonzero(has)
        if sel.size:
            stats = _check_values(d, sel, backend)
            prov = _Provenance(d)
            for k in np.flatnonzero(stats[0] > 0):
                i = int(sel[k])
                found.append((i, _value_findings(d, prov, i, int(stats[0][k]), int(stats[1][k]))))
            for k in np.flatnonzero(stats[2] > 0):
                i, j = int(sel[k]), int(stats[3][k])
                rec = int(d.dcp_of(i)[j])
                msg = (f"{_where(d, i)}: padded row {j} holds {rec}, must be 0 "
                       f"({int(stats[2][k])} bad padded row(s); rows >= num_reqs {int(d['obs.num_reqs'][i])})")
                found.append((i, _mk(d, i, "padding", msg, row=j, recorded=rec, expected=0,
                                     wrong_rows=int(stats[2][k]))))
        for i in np.flatnonzero(has & (dlen != nrp)):
            msg = (f"{_where(d, i)}: DCP view has {int(dlen[i])} rows, must have num_reqs_padded = {int(nrp[i])}")
            found.append((int(i), _mk(d, i, "shape", msg, detail={"length": int(dlen[i]),
                                                                  "expected_length": int(nrp[i])})))
        found += _check_rank_sum(d)
    else:
        for i in np.flatnonzero(has):
            msg = f"{_where(d, i)}: a DCP view is present with dcp_size 1; the engine should pass None"
            found.append((int(i), _mk(d, i, "stray", msg)))
        skipped["rank-sum"] = "dcp_size is 1"
    if d.has("obs.parent", "obs.req_start", "obs.tok_start", "obs.tok_stop", "obs.qsl"):
        found += _check_ubatch_slice(d)
    else:
        skipped["ubatch-slice"] = "needs obs.parent, obs.req_start, obs.tok_start, obs.tok_stop and query_start_loc"
    if not d.has("obs.parent", "obs.req_start"):
        skipped["stale/parent-rows"] = "needs obs.parent and obs.req_start"
    if d.has("obs.buffer"):
        found += _check_alias(d)
        if "obs.graph" not in d.columns:
            skipped["alias/graph"] = "needs obs.graph for capture/replay pairs"
    else:
        skipped["alias"] = "needs obs.buffer"
    if d.has("rows.kv_pages"):
        found += _check_pages(d)
    else:
        skipped["pages"] = "needs rows.kv_pages and page_size"
    found.sort(key=lambda t: (t[0], _RULE_ORDER[t[1].rule]))
    res = ReplayResult(files=d.files, config=c, observations=d.n, findings=[f for _, f in found], backend=backend,
                       device=device, seconds=0.0, skipped=skipped)
    if split is not None:
        res.splits = splits(d, split)
        res.findings = _merge_split_findings(d, res)
    if obs is not None:
        res.rows_view = rows_view(d, obs, [f for f in res.findings if f.index == obs])
    res.seconds = time.perf_counter() - t0
    return res


def resolve_backend(name: str) -> tuple[str, str]:
    """auto = Triton on CUDA, torch on CPU; triton without a GPU runs the interpreter."""
    import torch

    if name not in ("auto", "triton", "torch"):
        raise ValueError(f"unknown backend {name!r} (auto, triton or torch)")
    cuda = torch.cuda.is_available()
    if name == "auto":
        name = "triton" if cuda else "torch"
    if name == "torch":
        return "torch", "cpu"
    return "triton", "cuda" if cuda else "cpu (Triton interpreter)"


def splits(d: Dump, k: int) -> list[Split]:
    """`--split K`: re-split every recorded full batch (with query_start_loc) into K micro-batches."""
    if k < 1:
        raise ValueError(f"--split must be >= 1, got {k}")
    if not d.has("obs.qsl"):
        return []
    c = d.config
    out = []
    ntp = d["obs.num_tokens_padded"] if d.has("obs.num_tokens_padded") else None
    for i in np.flatnonzero((d["obs.ubatch"] == -1) & (d["obs.num_reqs"] >= 1) & (np.diff(d["obs.qsl"]) > 0)):
        nr, nrp = int(d["obs.num_reqs"][i]), int(d["obs.num_reqs_padded"][i])
        for u, ub in enumerate(split_batch(d.qsl_of(i), d.seq_lens_of(i), nr, nrp,
                                           None if ntp is None else int(ntp[i]), k)):
            dcp = np.zeros(ub.num_reqs_padded, np.int64)
            dcp[: ub.num_reqs] = local_np(ub.seq_lens[: ub.num_reqs], c.dcp_size, int(d["obs.rank"][i]),
                                          c.cp_interleave)
            out.append(Split(parent=int(i), parent_obs=int(d.file_obs[i]), file=d.file_of(i), ubatch=u, ub=ub,
                             dcp_local_seq_lens=dcp))
    return out


def _merge_split_findings(d: Dump, res: ReplayResult) -> list[Finding]:
    """Recorded micro-batches of a re-split batch must match the split (else `ubatch-slice`)."""
    if not d.has("obs.parent") or not res.splits:
        return res.findings
    by_parent: dict[tuple[int, int], Split] = {(s.parent, s.ubatch): s for s in res.splits}
    have = {(f.index, f.rule) for f in res.findings}
    extra = []
    par, ub = d["obs.parent"], d["obs.ubatch"]
    for i in np.flatnonzero((ub >= 0) & (par >= 0)):
        s = by_parent.get((int(par[i]), int(ub[i])))
        if s is None or (int(i), "ubatch-slice") in have:
            continue
        got = {"num_reqs_padded": int(d["obs.num_reqs_padded"][i]), "num_reqs": int(d["obs.num_reqs"][i])}
        want = {"num_reqs_padded": s.ub.num_reqs_padded, "num_reqs": s.ub.num_reqs}
        for key, attr in (("obs.req_start", "req_start"), ("obs.tok_start", "tok_start"), ("obs.tok_stop", "tok_stop")):
            if d.has(key) and d[key][i] >= 0:
                got[attr], want[attr] = int(d[key][i]), getattr(s.ub.slice, attr)
        seq = d.seq_lens_of(i)[: int(d["obs.num_reqs_padded"][i])]
        bad = [k for k in got if got[k] != want[k]]
        if not bad and not np.array_equal(seq, s.ub.seq_lens):
            bad = ["seq_lens"]
            got["seq_lens"], want["seq_lens"] = seq.tolist(), s.ub.seq_lens.tolist()
        if bad:
            f = bad[0]
            msg = (f"{_where(d, i)}: recorded micro-batch disagrees with --split {max(x.ubatch for x in res.splits) + 1} "
                   f"of its parent (obs {s.parent_obs}): {f} is {got[f]}, the split gives {want[f]}")
            extra.append(_mk(d, i, "ubatch-slice", msg, detail={"field": f, "parent_obs": s.parent_obs, "split": True}))
    if not extra:
        return res.findings
    return sorted(res.findings + extra, key=lambda f: (f.index, _RULE_ORDER[f.rule]))


def rows_view(d: Dump, i: int, findings: list[Finding]) -> RowsView:
    """`--obs I`: seq_len, expected on every rank, recorded and a verdict for each row."""
    c = d.config
    nr, nrp = int(d["obs.num_reqs"][i]), int(d["obs.num_reqs_padded"][i])
    seq = d.seq_lens_of(i)
    exp = expected_of(d, i)
    view = d.dcp_of(i)
    allr = local_np(seq[:nr].reshape(-1, 1), c.dcp_size, np.arange(c.dcp_size).reshape(1, -1), c.cp_interleave)
    verdict = []
    n = max(nrp, 0 if view is None else view.size)
    for j in range(n):
        if view is None:
            verdict.append("missing" if c.dcp_size > 1 else "ok")
        elif j >= view.size:
            verdict.append("absent (view too short)")
        elif j >= nrp:
            verdict.append("extra (view too long)")
        elif view[j] == exp[j]:
            verdict.append("ok" if j < nr else "ok (padding)")
        else:
            verdict.append("WRONG" if j < nr else "WRONG (padding must be 0)")
    return RowsView(index=i, obs=int(d.file_obs[i]), file=d.file_of(i), step=int(d["obs.step"][i]),
                    site=d.site_name(i), rank=int(d["obs.rank"][i]), ubatch=int(d["obs.ubatch"][i]), num_reqs=nr,
                    num_reqs_padded=nrp, seq_lens=seq.tolist(), expected=exp.tolist(),
                    recorded=None if view is None else view.tolist(), expected_all_ranks=allr.tolist(),
                    verdict=verdict, findings=findings)
