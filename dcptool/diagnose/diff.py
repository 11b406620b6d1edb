"""Diff: align two runs' observations by (step, site, rank, micro-batch, occurrence) and compare every column."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from dcptool.dump import Dump, obs_ref
from dcptool.dump.observation import HOST_ROWS
from dcptool.dump.transfer import OFFSETS, TABLE

# Per-pair fields in report order (docs/cli.md#diff names them); config differences come first, with no key.
CONFIG_FIELDS = ("dcp_size", "cp_interleave", "pcp_size", "page_size")
FIELDS = ("only-in-a", "only-in-b", "has_dcp", "num_reqs", "num_reqs_padded", "seq_lens", "dcp_local_seq_lens",
          "query_start_loc", "kv_pages", "dcp_query_start_loc", "dcp_tot_seq_lens", "positions", "slot_mapping",
          "slot_group", "ctx_chunks", "group_seq_lens", "verify_row_lens", "sparse_topk", *(f.name for f in HOST_ROWS),
          "parent", "req_start", "tok_start", "tok_stop", "num_tokens_padded", "graph", "buffer",
          *(c.key for c in TABLE))  # then a transfer plan's columns (dump.transfer), by their keys
_FIELD_ORDER = {f: i for i, f in enumerate(FIELDS)}
_SCALARS = ("req_start", "tok_start", "tok_stop", "num_tokens_padded", "graph")  # obs.<name>, compared as is
_TOPK = {"sparse_topk": ("obs.topk", "rows.sparse_topk")}
# Row fields: name -> (offsets column, rows column), compared row by row (dcp_local_seq_lens: where both have a view)
ROW_FIELDS = {"seq_lens": ("obs.rows", "rows.seq_lens"),
              "dcp_local_seq_lens": ("obs.dcp_rows", "rows.dcp_local_seq_lens"),
              "query_start_loc": ("obs.qsl", "rows.query_start_loc"), "kv_pages": ("obs.rows", "rows.kv_pages"),
              "dcp_query_start_loc": ("obs.dqsl", "rows.dcp_query_start_loc"),
              "dcp_tot_seq_lens": ("obs.tot", "rows.dcp_tot_seq_lens"),
              "positions": ("obs.slots", "rows.positions"), "slot_mapping": ("obs.slots", "rows.slot_mapping"),
              "slot_group": ("obs.slots", "rows.slot_group"), "ctx_chunks": ("obs.ctx", "rows.ctx_chunks"),
              "group_seq_lens": ("obs.gsl", "rows.group_seq_lens"),
              "verify_row_lens": ("obs.vrl", "rows.verify_row_lens"), **_TOPK,
              **{f.name: (f.offsets, f.column) for f in HOST_ROWS},  # what only some engines record
              **{c.key: (OFFSETS[c.level], c.key) for c in TABLE}}  # a transfer plan's columns, level by level
_OPTIONAL = {"query_start_loc": ("obs.qsl", "rows.query_start_loc"), "kv_pages": ("rows.kv_pages",),
             "dcp_query_start_loc": ("obs.dqsl", "rows.dcp_query_start_loc"),
             "dcp_tot_seq_lens": ("obs.tot", "rows.dcp_tot_seq_lens"),
             "slots": ("obs.slots", "rows.positions", "rows.slot_mapping", "rows.slot_group"),
             "ctx_chunks": ("obs.ctx", "rows.ctx_chunks"), "group_seq_lens": ("obs.gsl", "rows.group_seq_lens"),
             "verify_row_lens": ("obs.vrl", "rows.verify_row_lens"), **_TOPK,
             "parent": ("obs.parent",), "buffer": ("obs.buffer",), "transfers": tuple(OFFSETS.values()),
             **{f.name: (f.column,) if f.offsets == "obs.rows" else (f.offsets, f.column) for f in HOST_ROWS},
             **{s: (f"obs.{s}",) for s in _SCALARS}}
ROW_CHUNK = 1 << 22  # rows gathered per vectorised comparison pass: bounds memory on huge dumps


@dataclass(frozen=True)
class Key:
    """Where an observation sits in a run: the k-th (occurrence) with this step, site, rank and micro-batch."""

    step: int
    site: str
    rank: int
    ubatch: int
    occurrence: int

    def to_json(self) -> dict:
        return {"step": self.step, "site": self.site, "rank": self.rank, "ubatch": self.ubatch,
                "occurrence": self.occurrence}

    def __str__(self) -> str:
        ub = f" ubatch {self.ubatch}" if self.ubatch >= 0 else ""
        occ = f" #{self.occurrence}" if self.occurrence else ""
        return f"step {self.step} {self.site} rank {self.rank}{ub}{occ}"


@dataclass(frozen=True)
class Difference:
    """One field of one aligned observation (or of the config) that differs between A and B."""

    key: Key | None  # None for a config difference
    field: str
    a_obs: int | None  # index in its file
    b_obs: int | None
    a_file: str | None
    b_file: str | None
    row: int | None  # first differing row, for row fields
    a: int | None
    b: int | None
    count: int  # differing rows (row fields), else 1
    text: str  # what differs; the location and field are fields of their own (renderers compose them)

    @property
    def where(self) -> str:
        return "config" if self.key is None else str(self.key)

    @property
    def message(self) -> str:
        """The whole line, as JSON carries it: `WHERE: FIELD: TEXT`."""
        return f"{self.where}: {self.field}: {self.text}"

    @property
    def a_ref(self) -> str | None:
        """A's observation as `FILE:I` (what `dcptool replay A --obs` takes); None where A has none."""
        return None if self.a_obs is None or self.a_file is None else obs_ref(self.a_file, self.a_obs)

    @property
    def b_ref(self) -> str | None:
        return None if self.b_obs is None or self.b_file is None else obs_ref(self.b_file, self.b_obs)

    def to_json(self) -> dict:
        return {"type": "difference", "key": None if self.key is None else self.key.to_json(), "field": self.field,
                "a_obs": self.a_obs, "b_obs": self.b_obs, "a_file": self.a_file, "b_file": self.b_file,
                "a_ref": self.a_ref, "b_ref": self.b_ref, "row": self.row, "a": self.a, "b": self.b,
                "count": self.count, "message": self.message}


@dataclass
class DiffResult:
    a_files: list[str]
    b_files: list[str]
    a_observations: int
    b_observations: int
    compared: int  # aligned pairs
    only_in_a: int
    only_in_b: int
    total: int  # every difference, shown or not
    by_field: dict[str, int]
    differences: list[Difference]  # in run order, at most max_differences
    first: Difference | None
    skipped: dict[str, str] = field(default_factory=dict)  # column -> why it was not compared
    seconds: float = 0.0

    @property
    def same(self) -> bool:
        return self.total == 0

    def summary_json(self) -> dict:
        return {"type": "summary", "a": self.a_files, "b": self.b_files, "a_observations": self.a_observations,
                "b_observations": self.b_observations, "compared": self.compared, "only_in_a": self.only_in_a,
                "only_in_b": self.only_in_b, "differences": self.total, "by_field": self.by_field,
                "first": None if self.first is None else self.first.to_json(), "skipped": self.skipped,
                "seconds": round(self.seconds, 4)}


# --------------------------------------------------------------------------------------------
# Keys and alignment


def _rank_within(groups: list[np.ndarray], n: int) -> np.ndarray:
    """For each observation, how many earlier observations (in dump order) share its group columns."""
    if n == 0:
        return np.zeros(0, np.int64)
    order = np.lexsort((np.arange(n),) + tuple(reversed(groups)))
    new = np.ones(n, bool)
    for g in groups:
        s = g[order]
        new[1:] &= s[1:] == s[:-1]
    new = ~new  # True where a group starts
    new[0] = True
    starts = np.flatnonzero(new)
    pos = np.arange(n) - np.repeat(starts, np.diff(np.append(starts, n)))
    out = np.empty(n, np.int64)
    out[order] = pos
    return out


@dataclass
class _Side:
    d: Dump
    site: np.ndarray  # site index into the shared name list
    occ: np.ndarray  # occurrence of (step, site, rank, ubatch)
    off: np.ndarray  # position within its step (for run order)


def _side(d: Dump, sites: list[str]) -> _Side:
    index = {s: i for i, s in enumerate(sites)}  # not sites.index: quadratic in the number of sites
    remap = np.array([index[s] for s in d.config.sites], np.int32)
    site = remap[d["obs.site"]] if d.n else np.zeros(0, np.int32)
    step, rank, ub = d["obs.step"], d["obs.rank"], d["obs.ubatch"]
    return _Side(d, site, _rank_within([step, site, rank, ub], d.n), _rank_within([step], d.n))


def _align(a: _Side, b: _Side) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pairs (ia, ib) with equal keys, then the observations only in A and only in B (sorted by key)."""
    na, nb = a.d.n, b.d.n
    cols = [np.concatenate([x, y]).astype(np.int64) for x, y in
            ((a.d["obs.step"], b.d["obs.step"]), (a.site, b.site), (a.d["obs.rank"], b.d["obs.rank"]),
             (a.d["obs.ubatch"], b.d["obs.ubatch"]), (a.occ, b.occ))]
    side = np.concatenate([np.zeros(na, np.int8), np.ones(nb, np.int8)])
    idx = np.concatenate([np.arange(na), np.arange(nb)])
    order = np.lexsort((side,) + tuple(reversed(cols)))
    if order.size == 0:
        e = np.zeros(0, np.int64)
        return e, e, e, e
    eq = np.ones(order.size - 1, bool)
    for c in cols:
        s = c[order]
        eq &= s[1:] == s[:-1]
    # Keys are unique within a side (occurrence), so an equal neighbour is the other side: A sorts first.
    p = np.flatnonzero(eq)
    paired = np.zeros(order.size, bool)
    paired[p] = paired[p + 1] = True
    ia, ib = idx[order[p]], idx[order[p + 1]]
    single = order[~paired]
    return ia, ib, idx[single[side[single] == 0]], idx[single[side[single] == 1]]


# --------------------------------------------------------------------------------------------
# Vectorised comparisons


def _rows(offs: np.ndarray, i: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return offs[i], offs[i + 1] - offs[i]


def _compare_rows(oa: np.ndarray, va: np.ndarray, ia: np.ndarray, ob: np.ndarray, vb: np.ndarray,
                  ib: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per pair: differing rows (a length difference counts its extra rows) and the first one (-1: equal)."""
    sa, la = _rows(oa, ia)
    sb, lb = _rows(ob, ib)
    m = np.minimum(la, lb)
    count = np.abs(la - lb).astype(np.int64)
    first = np.where(la != lb, m, -1)
    csum = np.concatenate([[0], np.cumsum(m)])
    lo = 0
    while lo < m.size:
        # a run of pairs holding at most ROW_CHUNK rows (at least one pair)
        hi = max(lo + 1, int(np.searchsorted(csum, csum[lo] + ROW_CHUNK, side="right")) - 1)
        mm = m[lo:hi]
        tot = int(mm.sum())
        if tot:
            pair = np.repeat(np.arange(lo, hi), mm)
            within = np.arange(tot) - np.repeat(csum[lo:hi] - csum[lo], mm)
            bad = va[sa[pair] + within] != vb[sb[pair] + within]
            if bad.any():
                bp = pair[bad]
                count += np.bincount(bp, minlength=m.size)
                u, at = np.unique(bp, return_index=True)  # rows are in pair order: the first hit is the first row
                first[u] = within[bad][at]
        lo = hi
    return count, first


def _first_user(s: _Side, buf: np.ndarray) -> np.ndarray:
    """For each observation, the first one of its file whose DCP view used the same buffer (-3: unknown, 0).

    Addresses differ between runs, the use of persistent buffers does not: a buffer is named by
    the first observation that used it, and compared by that observation's alignment.
    """
    n = s.d.n
    fi = s.d.file_index.astype(np.int64)
    order = np.lexsort((s.d.order_of(np.arange(n)), buf, fi))  # (first in the run's order)
    start = np.ones(n, bool)
    if n > 1:
        start[1:] = (buf[order][1:] != buf[order][:-1]) | (fi[order][1:] != fi[order][:-1])
    first = np.empty(n, np.int64)
    first[order] = order[np.maximum.accumulate(np.where(start, np.arange(n), 0))]
    first[buf == 0] = -3
    return first


def _mask(n: int, i: np.ndarray) -> np.ndarray:
    m = np.zeros(n, bool)
    m[i] = True
    return m


def _as_pair(first: np.ndarray, paired: np.ndarray, n: int) -> np.ndarray:
    """First users as pair numbers, comparable across runs (-3: unknown buffer)."""
    pid = np.full(n, -2, np.int64)
    pid[paired] = np.arange(paired.size)
    return np.where(first >= 0, pid[np.maximum(first, 0)], first)


def _key_cols(s: _Side, i: np.ndarray) -> list[np.ndarray]:
    """Key columns of observations i (-1 -> a sentinel key that equals only itself).

    In int64: the int32 columns cannot hold the sentinel (numpy 2 raises OverflowError or wraps it
    to 0, a real rank / micro-batch), and no int32 value can equal it once widened."""
    ok = i >= 0
    j = np.where(ok, i, 0)
    cols = (s.d["obs.step"], s.site, s.d["obs.rank"], s.d["obs.ubatch"], s.occ)
    return [np.where(ok, c[j].astype(np.int64), np.int64(-(2**62))) for c in cols]


# --------------------------------------------------------------------------------------------
# The diff


@dataclass
class _Hits:
    """Differences found vectorised, before any is turned into a Difference."""

    names: list[str] = field(default_factory=list)
    pair: list[np.ndarray] = field(default_factory=list)  # index into the pair arrays (or singles)
    extra: list[dict] = field(default_factory=list)  # per field: arrays indexed like `pair`

    def add(self, name: str, sel: np.ndarray, **arrays) -> None:
        if sel.size:
            self.names.append(name)
            self.pair.append(sel)
            self.extra.append(arrays)


def diff(a: Dump, b: Dump, max_differences: int | None = None) -> DiffResult:
    """Compare two runs observation by observation; differences come back in run order."""
    t0 = time.perf_counter()
    in_a = set(a.config.sites)
    sites = list(a.config.sites) + [s for s in b.config.sites if s not in in_a]
    sa, sb = _side(a, sites), _side(b, sites)
    ia, ib, only_a, only_b = _align(sa, sb)
    skipped: dict[str, str] = {}
    cfg_diffs = [Difference(key=None, field=f"config.{k}", a_obs=None, b_obs=None, a_file=None, b_file=None, row=None,
                            a=getattr(a.config, k), b=getattr(b.config, k), count=1,
                            text=f"{getattr(a.config, k)} in A, {getattr(b.config, k)} in B")
                 for k in CONFIG_FIELDS if getattr(a.config, k) != getattr(b.config, k)]

    hits = _Hits()
    # Scalars every dump has.
    has_a, has_b = a["obs.has_dcp"][ia], b["obs.has_dcp"][ib]
    hits.add("has_dcp", np.flatnonzero(has_a != has_b))
    for name in ("num_reqs", "num_reqs_padded"):
        hits.add(name, np.flatnonzero(a[f"obs.{name}"][ia] != b[f"obs.{name}"][ib]))
    # Rows.
    for name, (offs, vals) in ROW_FIELDS.items():
        if not (a.has(offs, vals) and b.has(offs, vals)):
            continue
        p = np.flatnonzero((has_a == 1) & (has_b == 1)) if name == "dcp_local_seq_lens" else np.arange(ia.size)
        count, first = _compare_rows(a[offs], a[vals], ia[p], b[offs], b[vals], ib[p])
        bad = np.flatnonzero(count > 0)
        hits.add(name, p[bad], count=count[bad], row=first[bad])
    # Optional per-observation columns.
    for name in ("parent",) + _SCALARS:
        key = f"obs.{name}"
        if not (a.has(key) and b.has(key)):
            continue
        va, vb = a[key][ia], b[key][ib]
        if name == "parent":  # compare what the parent is, not where it sits in its file
            ka, kb = _key_cols(sa, va), _key_cols(sb, vb)
            bad = np.zeros(ia.size, bool)
            for x, y in zip(ka, kb):
                bad |= x != y
            hits.add(name, np.flatnonzero(bad))
        else:
            hits.add(name, np.flatnonzero(va != vb))
    if a.has("obs.buffer") and b.has("obs.buffer"):
        # Only pairs with a view on both sides count, as users and as first users: a view that is
        # missing or only in one run is reported already (has_dcp, only-in-a/b) and must not echo here.
        both = (has_a == 1) & (has_b == 1)
        pa, pb = (_first_user(s, np.where(_mask(x.n, i[both]), x["obs.buffer"], 0))
                  for s, x, i in ((sa, a, ia), (sb, b, ib)))
        xa, xb = _as_pair(pa, ia, a.n)[ia], _as_pair(pb, ib, b.n)[ib]
        bad = np.flatnonzero(both & (xa != xb))
        hits.add("buffer", bad, a_first=pa[ia][bad], b_first=pb[ib][bad])
    for name, keys in _OPTIONAL.items():
        ina, inb = a.has(*keys), b.has(*keys)
        if ina != inb:
            skipped[name] = f"only {'A' if ina else 'B'} records {', '.join(keys)}"

    by_field: dict[str, int] = {}
    if only_a.size:
        by_field["only-in-a"] = int(only_a.size)
    if only_b.size:
        by_field["only-in-b"] = int(only_b.size)
    for name, sel in zip(hits.names, hits.pair):
        by_field[name] = by_field.get(name, 0) + int(sel.size)
    by_field = {**{f"config.{k}": 1 for k in CONFIG_FIELDS if getattr(a.config, k) != getattr(b.config, k)},
                **{f: by_field[f] for f in FIELDS if f in by_field}}
    total = len(cfg_diffs) + int(only_a.size + only_b.size) + sum(int(s.size) for s in hits.pair)

    # Run order: step, then position within the step (the earlier side of a pair), then field.
    kinds = [(0, only_a, sa.d["obs.step"][only_a], sa.off[only_a], _FIELD_ORDER["only-in-a"]),
             (1, only_b, sb.d["obs.step"][only_b], sb.off[only_b], _FIELD_ORDER["only-in-b"])]
    for h, (name, sel) in enumerate(zip(hits.names, hits.pair)):
        kinds.append((2 + h, sel, a["obs.step"][ia[sel]], np.minimum(sa.off[ia[sel]], sb.off[ib[sel]]),
                      _FIELD_ORDER[name]))
    src = np.concatenate([np.full(k[1].size, k[0], np.int64) for k in kinds])
    pos = np.concatenate([np.arange(k[1].size) for k in kinds])
    step = np.concatenate([k[2] for k in kinds])
    off = np.concatenate([k[3] for k in kinds])
    ford = np.concatenate([np.full(k[1].size, k[4], np.int64) for k in kinds])
    order = np.lexsort((ford, off, step))
    limit = None if max_differences is None else max(0, max_differences - len(cfg_diffs))
    # the first difference is always materialised (the summary names it), even with --max-findings 0
    take = order if limit is None else order[: max(limit, 1)]
    ctx = _Ctx(sa, sb, ia, ib, only_a, only_b, hits)
    out = [ctx.make(int(src[t]), int(pos[t])) for t in take]
    first = cfg_diffs[0] if cfg_diffs else (out[0] if out else None)
    shown = (cfg_diffs + out) if max_differences is None else (cfg_diffs + out)[:max_differences]
    return DiffResult(a_files=a.files, b_files=b.files, a_observations=a.n, b_observations=b.n, compared=int(ia.size),
                      only_in_a=int(only_a.size), only_in_b=int(only_b.size), total=total, by_field=by_field,
                      differences=shown, first=first, skipped=skipped, seconds=time.perf_counter() - t0)


@dataclass
class _Ctx:
    """Turns one vectorised hit into a Difference (Python only for what is reported)."""

    a: _Side
    b: _Side
    ia: np.ndarray
    ib: np.ndarray
    only_a: np.ndarray
    only_b: np.ndarray
    hits: _Hits

    def key(self, s: _Side, i: int) -> Key:
        d = s.d
        return Key(step=int(d["obs.step"][i]), site=d.site_name(i), rank=int(d["obs.rank"][i]),
                   ubatch=int(d["obs.ubatch"][i]), occurrence=int(s.occ[i]))

    def make(self, src: int, pos: int) -> Difference:
        if src < 2:
            s, i = (self.a, int(self.only_a[pos])) if src == 0 else (self.b, int(self.only_b[pos]))
            side, other = ("A", "B") if src == 0 else ("B", "A")
            k = self.key(s, i)
            obs, f = int(s.d.file_obs[i]), s.d.file_of(i)
            view = "None" if not s.d["obs.has_dcp"][i] else f"{int(np.diff(s.d['obs.dcp_rows'])[i])} DCP rows"
            msg = (f"obs {s.d.ref(i)} of {side} (num_reqs {int(s.d['obs.num_reqs'][i])}, "
                   f"{view}); {other} has no such observation")
            return Difference(key=k, field="only-in-a" if src == 0 else "only-in-b",
                              a_obs=obs if src == 0 else None, b_obs=obs if src == 1 else None,
                              a_file=f if src == 0 else None, b_file=f if src == 1 else None, row=None, a=None, b=None,
                              count=1, text=msg)
        h = src - 2
        name, p = self.hits.names[h], int(self.hits.pair[h][pos])
        ex = {k: v[pos] for k, v in self.hits.extra[h].items()}
        i, j = int(self.ia[p]), int(self.ib[p])
        da, db = self.a.d, self.b.d
        k = self.key(self.a, i)
        base = dict(key=k, field=name, a_obs=int(da.file_obs[i]), b_obs=int(db.file_obs[j]), a_file=da.file_of(i),
                    b_file=db.file_of(j))
        if name in ROW_FIELDS:
            ra, rb = _row_values(da, name, i), _row_values(db, name, j)
            row, count = int(ex["row"]), int(ex["count"])
            va = int(ra[row]) if row < ra.size else None
            vb = int(rb[row]) if row < rb.size else None
            size = f" ({ra.size} rows in A, {rb.size} in B)" if ra.size != rb.size else ""
            msg = (f"{count} row(s) differ{size}, first row {row}: "
                   f"{'absent' if va is None else va} in A, {'absent' if vb is None else vb} in B")
            return Difference(**base, row=row, a=va, b=vb, count=count, text=msg)
        if name == "has_dcp":
            va, vb = int(da["obs.has_dcp"][i]), int(db["obs.has_dcp"][j])
            msg = (f"the DCP view is {'a tensor' if va else 'None'} in A, "
                   f"{'a tensor' if vb else 'None'} in B")
            return Difference(**base, row=None, a=va, b=vb, count=1, text=msg)
        if name == "parent":
            pa, pb = int(da["obs.parent"][i]), int(db["obs.parent"][j])
            wa = "none" if pa < 0 else f"obs {da.ref(pa)} ({self.key(self.a, pa)})"
            wb = "none" if pb < 0 else f"obs {db.ref(pb)} ({self.key(self.b, pb)})"
            return Difference(**base, row=None, a=None if pa < 0 else int(da.file_obs[pa]),
                              b=None if pb < 0 else int(db.file_obs[pb]), count=1,
                              text=f"derived from {wa} in A, from {wb} in B")
        if name == "buffer":
            fa, fb = int(ex["a_first"]), int(ex["b_first"])

            def first(d, side, f, me):
                if f < 0:
                    return "is unknown"
                if f == me:
                    return "is first used here"
                return f"was first used by obs {d.ref(f)} ({self.key(side, f)})"

            return Difference(**base, row=None, a=int(da.file_obs[fa]) if fa >= 0 else None,
                              b=int(db.file_obs[fb]) if fb >= 0 else None, count=1,
                              text=f"the DCP view's buffer {first(da, self.a, fa, i)} in A, "
                                      f"{first(db, self.b, fb, j)} in B")
        va, vb = int(da[f"obs.{name}"][i]), int(db[f"obs.{name}"][j])
        return Difference(**base, row=None, a=va, b=vb, count=1, text=f"{va} in A, {vb} in B")


def _row_values(d: Dump, name: str, i: int) -> np.ndarray:
    """Observation i's rows of a row field (a view without DCP rows: none)."""
    offs, vals = ROW_FIELDS[name]
    o = d[offs]
    return d[vals][o[i] : o[i + 1]] if name != "dcp_local_seq_lens" or d["obs.has_dcp"][i] else np.zeros(0, np.int32)
