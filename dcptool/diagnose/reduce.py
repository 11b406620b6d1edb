"""`dcptool reduce`: shrink a recording to the fewest steps, observations and request rows that still show one
problem, by delta debugging (Zeller's ddmin), each candidate checked by an in-process replay.

A candidate keeps the problem when its replay still has a finding of the same rule, relation (stale) and site,
and no rule the original replay did not report (a cut that invents a new finding is not the same failure).
What a finding depends on survives by construction or by the check: every kept observation keeps its parent
(micro-batches and PCP-local batches are replayed against it; indices are renumbered), and a stale finding's
source observation or a rank-sum's other ranks are kept because dropping them loses the finding.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dcptool.check.findings import RELATIONS, Finding, FindingTable
from dcptool.dcp.rules import RULES
from dcptool.dump import COLUMNS, RAGGED, Dump, DumpConfig, match_file, obs_ref, parse_ref
from dcptool.errors import DcptoolError


class ReduceError(DcptoolError, ValueError):
    """Bad input for reduce (no such finding, a malformed --finding): exit 2."""


@dataclass(frozen=True)
class Target:
    """The problem a reduction must keep."""

    rule: str
    relation: str | None
    site: str
    finding: Finding  # the finding named on the command line (or the first of its rule)

    @property
    def label(self) -> str:
        return self.rule + (f"/{self.relation}" if self.relation else "")

    def holds(self, findings: FindingTable) -> bool:
        """A finding of the target's rule, site and relation (stale) is among `findings` (their columns read)."""
        rel = -1 if self.relation is None else RELATIONS.index(self.relation)
        return bool(((findings.rule == self.rule) & (findings.site == self.site) & (findings.relation == rel)).any())


def parse_finding(spec: str) -> tuple[str, str | None, tuple[str | None, int] | None]:
    """`RULE[/RELATION][@FILE:I]` (`@I` for one file) -> (rule, relation, (FILE or None, I) or None)."""
    head, at, ref = spec.partition("@")
    rule, _, relation = head.partition("/")
    if rule not in RULES:
        raise ReduceError(f"--finding: {spec!r}: unknown rule {rule!r} (one of {', '.join(RULES)})")
    obs = None
    if at:
        try:
            obs = parse_ref(ref)
        except ValueError:
            raise ReduceError(f"--finding: {spec!r}: expected RULE@FILE:I, an observation as the reports name it "
                              "(RULE@I for one file)") from None
    return rule, relation or None, obs


def find_target(path: str, findings: FindingTable, spec: str, d: Dump) -> Target:
    """The finding `spec` names in a replay of dump `d` (at observation FILE:I, when it names one), as a Target."""
    rule, relation, obs = parse_finding(spec)
    file = None
    if obs is not None:
        if obs[0] is None and len(d.files) > 1:
            raise ReduceError(f"--finding: {spec!r}: {len(d.files)} files are read; name the observation as "
                              f"FILE:I (e.g. {rule}@{obs_ref(d.files[0], obs[1])})")
        k = 0 if obs[0] is None else match_file(d.files, obs[0])
        if k is None:
            raise ReduceError(f"--finding: {spec!r}: {obs[0]} is not one of the dumps read")
        file = d.files[k]
    hits = [f for f in findings if f.rule == rule
            and (relation is None or (f.source is not None and f.source.relation == relation))
            and (obs is None or (f.obs == obs[1] and f.file == file))]
    if not hits:
        where = f" at {obs_ref(file, obs[1])}" if obs is not None else ""
        raise ReduceError(f"{path}: replay finds no {spec.partition('@')[0]} finding{where}")
    f = hits[0]
    return Target(rule=f.rule, relation=f.source.relation if f.source is not None else None, site=f.site, finding=f)


# --------------------------------------------------------------------------------------------
# Sub-dumps


def closure(d: Dump, keep: np.ndarray) -> np.ndarray:
    """keep plus every kept observation's parent, transitively (a micro-batch is checked against its parent)."""
    keep = keep.copy()
    if not d.has("obs.parent"):
        return keep
    parent = d["obs.parent"]
    while True:
        p = parent[keep]
        p = p[(p >= 0) & (p < d.n)]
        new = p[~keep[p]]
        if new.size == 0:
            return keep
        keep[new] = True


def subset(d: Dump, keep: np.ndarray, name: str = "reduced") -> Dump:
    """The observations where keep is True, as one in-memory dump: rows gathered, parents renumbered (a
    parent not kept becomes -1), vectorised over observations."""
    idx = np.flatnonzero(keep)
    idx = idx[np.argsort(d.order_of(idx), kind="stable")]  # (in the run's order: by step where files were read)
    new_of = np.full(d.n, -1, np.int64)
    new_of[idx] = np.arange(idx.size)
    cols: dict[str, np.ndarray] = {}
    for key, v in d.columns.items():
        if COLUMNS.get(key, ("", ""))[1] == "n":
            cols[key] = v[idx]
    if "obs.parent" in cols:
        p = cols["obs.parent"]
        ok = (p >= 0) & (p < d.n)
        ok[ok] = keep[p[ok]]
        cols["obs.parent"] = np.where(ok, new_of[np.clip(p, 0, max(d.n - 1, 0))], -1).astype(np.int64)
    for offs, row_keys in RAGGED.items():
        if offs not in d.columns:
            continue
        o = d[offs]
        lens = (o[1:] - o[:-1])[idx]
        new_offs = np.zeros(idx.size + 1, np.int64)
        np.cumsum(lens, out=new_offs[1:])
        src = np.repeat(o[:-1][idx] - new_offs[:-1], lens) + np.arange(new_offs[-1])
        cols[offs] = new_offs
        for rk in row_keys:
            if rk in d.columns:
                cols[rk] = d[rk][src]
    injected = []
    if len(d.files) == 1 and d.injected and d.injected[0]:
        injected = [{k: new_of[np.asarray(v, np.int64)[keep[np.asarray(v, np.int64)]]].tolist()
                     for k, v in d.injected[0].items()}]
    return Dump(files=[name], config=d.config, columns=cols, file_index=np.zeros(idx.size, np.int32),
                file_obs=np.arange(idx.size, dtype=np.int64), injected=injected or [None], sizes=[0])


# How a dropped request row changes each ragged column (by its offsets key): "row" columns lose the row's
# entry (seq_lens, kv_pages, the DCP view, the global companion); "starts" columns (query_start_loc and the
# empty-shard mask's prefix of it) lose its boundary, later starts shifting down by its query length;
# "tokens" columns (slot entries per token) are cleared for the observation (0 entries: not recorded).
_DROP_KIND = {"obs.rows": "row", "obs.dcp_rows": "row", "obs.tot": "row", "obs.qsl": "starts",
              "obs.dqsl": "starts", "obs.slots": "tokens"}


def _drop_from(kind: str, v: np.ndarray, js: list[int]) -> np.ndarray:
    """One observation's entries of a ragged column without the request rows js (see _DROP_KIND)."""
    if not js or v.size == 0:
        return v
    if kind == "tokens":
        return v[:0]
    if kind == "row":
        keep = np.ones(v.size, bool)
        keep[[j for j in js if j < v.size]] = False
        return v[keep]
    if v.size < 2:
        return v
    q = v.astype(np.int64)
    qlen = np.diff(q)
    keep = np.ones(qlen.size, bool)
    keep[[j for j in js if j < qlen.size]] = False
    return np.concatenate([q[:1], q[0] + np.cumsum(qlen[keep])]).astype(v.dtype)


def drop_rows(d: Dump, drop: set[tuple[int, int]], name: str = "reduced") -> Dump:
    """d without the request rows `drop` ((observation, row) pairs): every ragged column changes as
    _DROP_KIND says, and the counts go together. A loop over the observations: this runs on an already
    reduced dump of a handful of them."""
    by_obs: dict[int, list[int]] = {}
    for i, j in drop:
        by_obs.setdefault(i, []).append(j)
    cols = {k: v.copy() for k, v in d.columns.items() if COLUMNS.get(k, ("", ""))[1] == "n"}
    groups = {o: [k for k in ks if k in d.columns] for o, ks in RAGGED.items() if o in d.columns}
    unknown = set(groups) - set(_DROP_KIND)
    if unknown:  # a column added to the format without saying how a dropped row changes it
        raise ValueError(f"reduce cannot drop rows of {sorted(unknown)}")
    parts: dict[str, list[np.ndarray]] = {k: [] for ks in groups.values() for k in ks}
    lens: dict[str, list[int]] = {o: [] for o in groups}
    for i in range(d.n):
        r0, r1 = int(d["obs.rows"][i]), int(d["obs.rows"][i + 1])
        js = sorted({j for j in by_obs.get(i, ()) if 0 <= j < r1 - r0})
        for o, ks in groups.items():
            a, b = int(d[o][i]), int(d[o][i + 1])
            got = [_drop_from(_DROP_KIND[o], d[k][a:b], js) for k in ks]
            for k, v in zip(ks, got):
                parts[k].append(v)
            lens[o].append(got[0].size if got else b - a)
        if js and "obs.qsl" in d.columns and "obs.num_tokens_padded" in cols and cols["obs.num_tokens_padded"][i] >= 0:
            q = d["rows.query_start_loc"][int(d["obs.qsl"][i]):int(d["obs.qsl"][i + 1])].astype(np.int64)
            qlen = np.diff(q)
            cols["obs.num_tokens_padded"][i] -= int(qlen[[j for j in js if j < qlen.size]].sum())
        if js:
            nr = int(cols["obs.num_reqs"][i])
            cols["obs.num_reqs"][i] = nr - sum(j < nr for j in js)
            cols["obs.num_reqs_padded"][i] -= len(js)
    for k, ls in lens.items():
        o = np.zeros(d.n + 1, np.int64)
        np.cumsum(ls, out=o[1:])
        cols[k] = o
    for k, ps in parts.items():
        cols[k] = np.concatenate(ps).astype(d[k].dtype) if ps else d[k][:0]
    return Dump(files=[name], config=d.config, columns=cols, file_index=np.zeros(d.n, np.int32),
                file_obs=np.arange(d.n, dtype=np.int64), injected=d.injected, sizes=[0])


def row_units(d: Dump) -> list[tuple[int, int]]:
    """The request rows reduce may drop: every row of every observation except micro-batches, whose rows are
    their parent's rows [req_start, ...) and go with them, and the rows of another derived batch (a PCP-local
    batch) that its parent also has, which go with the parent's row of the same index (drop_requests)."""
    rows = d["obs.rows"]
    n_rows = (rows[1:] - rows[:-1]).tolist()
    kids = _ubatch_children(d)
    tied = _row_tied_children(d)
    return [(i, j) for i in range(d.n) if i not in kids
            for j in range(n_rows[i]) if i not in tied or j >= n_rows[tied[i]]]


def _row_tied_children(d: Dump) -> dict[int, int]:
    """Derived batches that are not micro-batches (a PCP-local batch) -> parent: their row j is taken to be the
    parent's row j (decodes come first and are replicated whole); where it is not, the check refuses the cut."""
    if not d.has("obs.parent"):
        return {}
    kid = np.flatnonzero((d["obs.parent"] >= 0) & (d["obs.ubatch"] < 0))
    return dict(zip(kid.tolist(), d["obs.parent"][kid].tolist()))


def _ubatch_children(d: Dump) -> dict[int, int]:
    """micro-batch observation -> its parent, where the slice is recorded (req_start) and the parent kept."""
    if not d.has("obs.parent", "obs.req_start"):
        return {}
    kid = np.flatnonzero((d["obs.ubatch"] >= 0) & (d["obs.parent"] >= 0) & (d["obs.req_start"] >= 0))
    return dict(zip(kid.tolist(), d["obs.parent"][kid].tolist()))


def drop_requests(d: Dump, drop: set[tuple[int, int]], name: str = "reduced") -> Dump:
    """drop_rows, where dropping a parent's row also drops that request's row in each of its micro-batches and
    shifts their slices (req_start, and tok_start/tok_stop by the dropped tokens before them)."""
    full = set(drop)
    edits: dict[str, dict[int, int]] = {"obs.req_start": {}, "obs.tok_start": {}, "obs.tok_stop": {}}
    by_parent: dict[int, np.ndarray] = {}
    for i, j in drop:
        by_parent.setdefault(i, []).append(j)
    for c, p in _ubatch_children(d).items():
        if p not in by_parent:
            continue
        ks = np.asarray(sorted(by_parent[p]), np.int64)
        s = int(d["obs.req_start"][c])
        n_c = int(d["obs.rows"][c + 1] - d["obs.rows"][c])
        full |= {(c, int(k - s)) for k in ks if 0 <= k - s < n_c}
        edits["obs.req_start"][c] = s - int((ks < s).sum())
        q = d.qsl_of(p)
        if q is not None and q.size >= 2 and d.has("obs.tok_start", "obs.tok_stop"):
            q = q.astype(np.int64)
            ks = ks[ks < q.size - 1]
            lo, ql = q[ks], q[ks + 1] - q[ks]
            for key in ("obs.tok_start", "obs.tok_stop"):
                t = int(d[key][c])
                if t >= 0:  # the tokens of dropped requests that lay before t
                    edits[key][c] = t - int(np.clip(t - lo, 0, ql).sum())
    for c, p in _row_tied_children(d).items():
        n_c = int(d["obs.rows"][c + 1] - d["obs.rows"][c])
        full |= {(c, j) for j in by_parent.get(p, ()) if j < n_c}
    out = drop_rows(d, full, name)
    for key, vals in edits.items():
        for i, v in vals.items():
            out.columns[key][i] = v
    return out


# --------------------------------------------------------------------------------------------
# Delta debugging


def ddmin(units: list, test: Callable[[list], bool], deadline: float) -> list:
    """Zeller's ddmin: a 1-minimal sublist of units for which test holds (test(units) must hold). Stops at the
    deadline with the smallest list found so far."""
    n = 2
    while len(units) >= 2:
        if time.monotonic() > deadline:
            break
        size = -(-len(units) // n)
        chunks = [units[k:k + size] for k in range(0, len(units), size)]
        for c in chunks:  # a subset alone
            if test(c):
                units, n = c, 2
                break
        else:
            for k in range(len(chunks)):  # a complement
                comp = [u for m, c in enumerate(chunks) if m != k for u in c]
                if len(chunks) > 2 and test(comp):
                    units, n = comp, max(n - 1, 2)
                    break
            else:
                if n >= len(units):
                    break
                n = min(len(units), 2 * n)
    return units


@dataclass
class Reduction:
    target: Target
    dump: Dump  # the reduced recording (in memory)
    before: dict[str, int]  # observations, steps, rows
    after: dict[str, int]
    candidates: int  # replays run
    seconds: float
    stopped: bool  # the time budget ran out before ddmin finished
    findings: FindingTable  # the reduced recording's replay

    def to_json(self) -> dict:
        return {"type": "reduce", "rule": self.target.rule, "relation": self.target.relation,
                "site": self.target.site, "before": self.before, "after": self.after, "candidates": self.candidates,
                "seconds": round(self.seconds, 3), "stopped_at_budget": self.stopped,
                "findings": len(self.findings)}


def sizes(d: Dump) -> dict[str, int]:
    return {"observations": d.n, "steps": int(np.unique(d["obs.step"]).size), "rows": int(d["obs.rows"][-1])}


def reduce_dump(d: Dump, target: Target, rules: set[str], *, max_seconds: float = 60.0, backend: str = "torch",
                progress: Callable[[int], None] | None = None, name: str = "reduced") -> Reduction:
    """Shrink d while target holds: ddmin over steps, then observations, then request rows."""
    from dcptool.check.replay import replay

    t0 = time.monotonic()
    deadline = t0 + max_seconds
    count = [0]
    shown = [0]

    def check(sub: Dump) -> bool:
        if sub.n == 0:
            return False
        count[0] += 1
        if progress is not None:  # the bar counts seconds of the budget
            spent = int(time.monotonic() - t0)
            if spent > shown[0]:
                progress(spent - shown[0])
                shown[0] = spent
        found = replay(sub, backend).findings
        return target.holds(found) and set(found.rule.tolist()) <= rules

    steps = d["obs.step"]
    units = np.unique(steps).tolist()
    first = target.finding.step
    cur = d

    def by_steps(keep_steps: list) -> Dump:
        return subset(d, closure(d, np.isin(steps, np.asarray(keep_steps, np.int64))), name)

    if check(by_steps([first])):  # the usual answer, tried first: one step
        units = [first]
    else:
        units = ddmin(units, lambda u: check(by_steps(u)), deadline)
    cur = by_steps(units)
    obs_units = list(range(cur.n))

    def by_obs(keep_obs: list, base: Dump) -> Dump:
        m = np.zeros(base.n, bool)
        m[keep_obs] = True
        return subset(base, closure(base, m), name)

    base = cur
    obs_units = ddmin(obs_units, lambda u: check(by_obs(u, base)), deadline)
    cur = by_obs(obs_units, base)
    rows = row_units(cur)
    base = cur
    # rows to drop: the complement of the ones ddmin keeps
    kept_rows = ddmin(rows, lambda u: check(drop_requests(base, set(rows) - set(u), name)), deadline)
    cur = drop_requests(base, set(rows) - set(kept_rows), name)
    stopped = time.monotonic() > deadline
    found = replay(cur, backend).findings
    return Reduction(target=target, dump=cur, before=sizes(d), after=sizes(cur), candidates=count[0],
                     seconds=time.monotonic() - t0, stopped=stopped, findings=found)


def reduced_config(d: Dump, source: str, target: Target) -> DumpConfig:
    """The reduced dump's config: the original's, with a note saying where it came from."""
    note = f"reduced by dcptool reduce from {source} to keep {target.label} at {target.site}"
    if d.config.note:
        note = f"{d.config.note}; {note}"
    return DumpConfig(**{**d.config.__dict__, "note": note})
