"""Findings: one type, FindingTable, a table of columns (one numpy array per field) whose messages are rendered
only for what is read.

A dense recording has a finding on most of its observations (138,839 in 99,008 of `simulate --dcp 8 --pipeline
legacy`): a Python object and a message for each would cost more than the scan. The vectorised checks hand their
findings over as arrays (FindingTable.build), the checks that find few write each one's text themselves
(Written), and a Finding, the view of one row with its message, is made only when a finding is read one at a
time: the text report's first 100, the HTML table, a test. Vectorised readers (counts, the timeline, problems)
read the arrays; the JSON Lines writer streams from the columns.
"""

from __future__ import annotations

import dataclasses
import json
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii
from typing import TYPE_CHECKING

import numpy as np

from dcptool.check.provenance import Source
from dcptool.dcp.kv_transfer import KINDS as TRANSFER_KINDS
from dcptool.dcp.rules import RULES, SEVERITY
from dcptool.dump.ref import obs_ref, obs_refs

if TYPE_CHECKING:
    from dcptool.dump import Dump

# Source.relation (stale), then the kinds of a transfer finding (dcp.kv_transfer.KINDS), by code
RELATIONS = ("parent-rows", "earlier-in-step", "earlier-step", *TRANSFER_KINDS)



@dataclass(frozen=True)
class Finding:
    rule: str
    index: int  # position in the dump (Dump: several files end to end)
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
    text: str  # what is wrong; `message` prefixes where
    source: Source | None = None
    detail: dict = dataclasses.field(default_factory=dict)

    @property
    def severity(self) -> str:
        return SEVERITY[self.rule]

    @property
    def where(self) -> str:
        return f"step {self.step} {self.site} rank {self.rank}" + (f" ubatch {self.ubatch}" if self.ubatch >= 0 else "")

    @property
    def message(self) -> str:
        """The one-line message: where, then what (the JSON "message")."""
        return f"{self.where}: {self.text}"

    @property
    def ref(self) -> str:
        """`FILE:I`, as `replay --obs` takes it (dump.obs_ref)."""
        return obs_ref(self.file, self.obs)

    def to_json(self) -> dict:
        return {"type": "finding", "rule": self.rule, "severity": self.severity, "obs": self.obs,
                "file": self.file, "ref": self.ref, "step": self.step, "site": self.site, "rank": self.rank,
                "ubatch": self.ubatch, "row": self.row, "recorded": self.recorded, "expected": self.expected,
                "wrong_rows": self.wrong_rows, "source": None if self.source is None else self.source.to_json(),
                "detail": self.detail, "message": self.message}


# How a finding's text and detail are made from its columns. STORED: the check wrote them (Written); the others
# are rendered when read (render_texts) from the columns and the dump.
STORED, VALUE, MISSING, PADDING, SHAPE, STRAY, PAGES, ALIAS_UB, ALIAS_GRAPH = range(9)

# stale: why, by relation ({0} the source's reference, {1} its site, {2} its step: positional, so that map() formats
# a column of them)
_EXPLAIN = {
    "parent-rows": "copied from the parent batch (obs {0}, {1}); recompute from the micro-batch's own seq_lens",
    "earlier-in-step": "derived from an earlier batch of this step (obs {0}, {1}), e.g. the global batch "
                       "before the PCP partition; compute it from the final batch",
    "earlier-step": "left over from step {2} (obs {0}, {1}); the buffer was not refreshed "
                    "(e.g. baked into a CUDA graph)",
}

# the integer columns besides index, rule and kind; `a0`/`a1` hold per-kind numbers for the text and detail
# (wrong-rank: rank; wrong-interleave: interleave; shape: length, expected length; pages: global count,
# local length; padding: num_reqs; alias: the other observation, its index)
_INT = ("row", "recorded", "expected", "wrong_rows", "source", "relation", "a0", "a1")
_MASK = ("has_row", "has_recorded", "has_expected")

# A finding's JSON line (Finding.to_json as json.dumps writes it) and its source's, as %-formats of their fields: the
# rule's "rule" and "severity", "obs", the file's "file" and "ref" up to the index, the index, ... the message's where
# (step, site, rank, micro-batch) and text as they go inside its JSON string
_LINE = ('{"type": "finding", %s, "obs": %d, %s%d", "step": %d, "site": %s, "rank": %d, "ubatch": %d, "row": %s, '
         '"recorded": %s, "expected": %s, "wrong_rows": %d, "source": %s, "detail": %s, '
         '"message": "step %d %s rank %d%s: %s"}')
_SOURCE = '{"obs": %d, "relation": "%s", "step": %d, "site": %s, "ubatch": %d, "file": %s, "ref": %s:%d"}'


def _where_ubatch(ub: np.ndarray) -> list[str]:
    """The micro-batch part of Finding.where for each ubatch: " ubatch U", "" for the full batch (-1)."""
    out = np.full(ub.size, "", object)
    at = np.flatnonzero(ub >= 0)
    out[at] = list(map(" ubatch %d".__mod__, ub[at].tolist()))
    return out.tolist()


def _escaped(texts: list[str], kind: np.ndarray, code: np.ndarray) -> list[str]:
    """Texts as they go inside a JSON string: escaped (the json module's encoder, without the quotes) where a text
    holds strings from the dump (a check's own text, stale's and alias's references and sites); the others are
    dcptool's words and numbers, which JSON writes as they are."""
    out = np.array(texts, object) if texts else np.zeros(0, object)
    at = np.flatnonzero((kind == STORED) | (kind == ALIAS_UB) | (kind == ALIAS_GRAPH)
                        | ((kind == VALUE) & (code == RULES.index("stale"))))
    if at.size:
        out[at] = list(map(_INSIDE, map(encode_basestring_ascii, out[at].tolist())))
    return out.tolist()


_INSIDE = operator.itemgetter(slice(1, -1))  # a JSON string without its quotes


def _or_null(v: np.ndarray, has: np.ndarray) -> list:
    """A column's JSON values: each number, "null" where `has` is False (the field is None)."""
    out = v.astype(object)
    out[~has] = "null"
    return out.tolist()


class FindingTable(Sequence):
    """Findings in the run's order of their observations (Dump.order_of), then the rule table's order, as columns.

    A Sequence of Finding: `t[k]`, iteration and slices (`t[:100]`, a table again) work as on a list, and a
    table equals a list of the same findings; a Finding and its message are made only when one is read (and
    `t[k]` keeps it, so the same object comes back). Arrays for vectorised readers: `index`, `rule_code` (into
    rules.RULES), `rule` (names), `obs`, `file_index`, `step`, `site_code` (into config.sites), `site`, `rank`,
    `ubatch`, `row`, `recorded`, `expected` (with `has_row`, `has_recorded`, `has_expected`: False where the
    field is None), `wrong_rows`, `source` (its index, -1 none), `relation` (into RELATIONS, -1 none),
    `severity_code` (1 error, 0 warning).
    """

    def __init__(self, d: Dump | None, cols: dict[str, np.ndarray], stored: dict[int, tuple[str, dict]],
                 sel: np.ndarray | None = None):
        self.d = d
        self._cols = cols  # all of the same length; `sel` picks (and orders) the rows this table shows
        self._stored = stored  # row -> (text, detail) for STORED rows
        self._sel = sel
        self._cache: dict[int, Finding] = {}

    # ----- building

    @classmethod
    def empty(cls, d: Dump | None = None) -> FindingTable:
        return cls.build(d, np.zeros(0, np.int64), "missing", MISSING)

    @classmethod
    def build(cls, d: Dump | None, index: np.ndarray, rule: str | np.ndarray, kind: int,
              stored: dict[int, tuple[str, dict]] | None = None, **cols) -> FindingTable:
        """Findings of one check: `index` the observations; `rule` a name or codes; `kind` how their texts are
        made (STORED: `stored` maps each row to its text and detail); other columns by name (missing integer
        columns are 0, -1 for source and relation; a mask column is True where its field was given)."""
        index = np.asarray(index, np.int64)
        n = index.size
        code = (np.full(n, RULES.index(rule), np.int8) if isinstance(rule, str) else np.asarray(rule, np.int8))
        out = {"index": index, "rule_code": code, "kind": np.full(n, kind, np.int8)}
        for k in _INT:
            v = cols.get(k)
            out[k] = (np.full(n, -1 if k in ("source", "relation") else 0, np.int64) if v is None
                      else np.broadcast_to(np.asarray(v, np.int64), (n,)).copy())
        for k, field in zip(_MASK, ("row", "recorded", "expected")):
            v = cols.get(k)
            out[k] = np.full(n, field in cols, bool) if v is None else np.asarray(v, bool)
        return cls(d, out, stored or {})

    @classmethod
    def concat(cls, d: Dump | None, parts: list[FindingTable]) -> FindingTable:
        """One table of several, sorted by (observation in the run's order: Dump.order_of, the rule table's order),
        stably (ties keep part order)."""
        if not parts:
            return cls.empty(d)
        parts = [p._compact() for p in parts]
        cols = {k: np.concatenate([p._cols[k] for p in parts]) for k in parts[0]._cols}
        stored, base = {}, 0
        for p in parts:
            stored.update({base + k: v for k, v in p._stored.items()})
            base += len(p)
        at = cols["index"] if d is None else d.order_of(cols["index"])
        return cls(d, cols, stored, np.lexsort((cols["rule_code"], at)))

    def _compact(self) -> FindingTable:
        """The same findings with `sel` applied to the columns (for concatenation)."""
        if self._sel is None:
            return self
        pos = {int(r): k for k, r in enumerate(self._sel.tolist()) if int(r) in self._stored} if self._stored else {}
        return FindingTable(self.d, {k: v[self._sel] for k, v in self._cols.items()},
                            {k: self._stored[r] for r, k in pos.items()})

    # ----- arrays

    @property
    def index(self) -> np.ndarray:  # (the array of observations: it replaces Sequence.index(value), unused here)
        return self._col("index")

    def _col(self, k: str) -> np.ndarray:
        v = self._cols[k]
        return v if self._sel is None else v[self._sel]

    def _rows(self) -> np.ndarray:
        return np.arange(self._cols["index"].size) if self._sel is None else self._sel

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in ("index", "rule_code", "kind", *_INT, *_MASK):
            return self._col(name)
        d = self.d
        if name in ("obs", "file_index", "step", "rank", "ubatch", "site_code"):
            idx = self._col("index")
            if name == "obs":
                return d.file_obs[idx].astype(np.int64)
            if name == "file_index":
                return d.file_index[idx].astype(np.int64)
            key = {"site_code": "obs.site"}.get(name, f"obs.{name}")
            return d[key][idx].astype(np.int64)
        if name == "rule":
            return np.asarray(RULES, dtype=object)[self.rule_code]
        if name == "site":
            return np.asarray(d.config.sites, dtype=object)[self.site_code]
        if name == "severity_code":
            return np.array([SEVERITY[r] == "error" for r in RULES], np.int8)[self.rule_code]
        raise AttributeError(name)

    # ----- the Sequence

    def __len__(self) -> int:
        return int(self._cols["index"].size if self._sel is None else self._sel.size)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return FindingTable(self.d, self._cols, self._stored, self._rows()[k])
        if isinstance(k, (list, np.ndarray)):
            return FindingTable(self.d, self._cols, self._stored, self._rows()[np.asarray(k, np.int64)])
        n = len(self)
        k = int(k)
        if k < 0:
            k += n
        if not 0 <= k < n:
            raise IndexError("finding index out of range")
        f = self._cache.get(k)
        if f is None:
            f = self._cache[k] = self._make(int(self._rows()[k]))
        return f

    def made(self) -> dict[int, Finding]:
        """position -> Finding, for the findings already read by position (t[k])."""
        return dict(self._cache)

    def __iter__(self) -> Iterator[Finding]:
        for k in range(len(self)):
            f = self._cache.get(k)
            yield f if f is not None else self._make(int(self._rows()[k]))

    def __eq__(self, other) -> bool:
        if isinstance(other, (FindingTable, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # a mutable-looking sequence, like the list it replaces

    def __repr__(self) -> str:
        return f"FindingTable({len(self)} findings)"

    # ----- one finding

    def _make(self, r: int) -> Finding:
        """Finding of column row r, its text and detail rendered now."""
        c, d = self._cols, self.d
        i = int(c["index"][r])
        rule = RULES[int(c["rule_code"][r])]
        opt = [int(c[f][r]) if c[m][r] else None for f, m in zip(("row", "recorded", "expected"), _MASK)]
        s = int(c["source"][r])
        source = None
        if s >= 0:
            source = Source(index=s, obs=int(d.file_obs[s]), file=d.file_of(s),
                            relation=RELATIONS[int(c["relation"][r])], step=int(d["obs.step"][s]),
                            site=d.site_name(s), ubatch=int(d["obs.ubatch"][s]))
        text, detail = self._text_detail(r)
        return Finding(rule=rule, index=i, obs=int(d.file_obs[i]), file=d.file_of(i), step=int(d["obs.step"][i]),
                       site=d.site_name(i), rank=int(d["obs.rank"][i]), ubatch=int(d["obs.ubatch"][i]),
                       row=opt[0], recorded=opt[1], expected=opt[2], wrong_rows=int(c["wrong_rows"][r]), text=text,
                       source=source, detail=detail)

    def _text_detail(self, r: int) -> tuple[str, dict]:
        if int(self._cols["kind"][r]) == STORED:
            return self._stored[r]
        texts, details = render_texts(self, np.array([r]))
        return texts[0], json.loads(details[0])

    # ----- JSON Lines, streamed from the columns

    def json_lines(self, block: int = 16384) -> Iterator[str]:
        """Each finding as its JSON line (as json.dumps(Finding.to_json()) writes it), from the columns: json_blocks."""
        for lines in self.json_blocks(block):
            yield from lines

    def json_blocks(self, block: int = 16384) -> Iterator[list[str]]:
        """The JSON lines of a block of findings at a time (a list each): the texts of a block rendered together
        (render_texts), the columns read as lists, and each line one %-format of them (_LINE) applied by map's C
        loop, no bytecode per finding. Names, files and texts from the dump are JSON strings made by the json
        module's own C encoder; the texts dcptool writes from numbers alone go in as they are (nothing to escape)."""
        d = self.d
        c = self._cols
        enc = encode_basestring_ascii  # json.dumps(str) without the encoder object per call
        head = [f'"rule": {enc(r)}, "severity": {enc(SEVERITY[r])}' for r in RULES]
        # "file" and "ref" (enc(obs_ref(file, obs))): enc escapes each character alone, so the reference's JSON is
        # the file's without its closing quote, then ":I" and the quote (neither needs escaping)
        files = [f'"file": {enc(f)}, "ref": {enc(f)[:-1]}:' for f in d.files]
        sites_j = [enc(s) for s in d.config.sites]
        sites_in = [s[1:-1] for s in sites_j]  # (inside the message's JSON string)
        every = self._rows()
        for lo in range(0, every.size, block):
            rows = every[lo : lo + block]
            idx = c["index"][rows]
            fobs, fidx = d.file_obs[idx].tolist(), d.file_index[idx].tolist()
            step, site = d["obs.step"][idx].tolist(), d["obs.site"][idx].tolist()
            rank, ub = d["obs.rank"][idx], d["obs.ubatch"][idx]
            code = c["rule_code"][rows]
            texts, details = render_texts(self, rows)
            where_ub = _where_ubatch(ub)
            rank, ub = rank.tolist(), ub.tolist()
            yield list(map(_LINE.__mod__, zip(
                map(head.__getitem__, code.tolist()), fobs, map(files.__getitem__, fidx), fobs, step,
                map(sites_j.__getitem__, site), rank, ub,
                *(_or_null(c[f][rows], c[m][rows]) for f, m in zip(("row", "recorded", "expected"), _MASK)),
                c["wrong_rows"][rows].tolist(), self._source_json(rows), details, step,
                map(sites_in.__getitem__, site), rank, where_ub, _escaped(texts, c["kind"][rows], code))))

    def _source_json(self, rows: np.ndarray) -> list[str]:
        """The JSON of the sources of column rows `rows` ("null" where none), in the order of `rows`."""
        d = self.d
        src = self._cols["source"][rows]
        out = np.full(rows.size, "null", object)
        at = np.flatnonzero(src >= 0)
        if at.size:
            s = src[at]
            enc = encode_basestring_ascii
            files_j = [enc(f) for f in d.files]
            fidx = d.file_index[s].tolist()
            obs = d.file_obs[s].tolist()
            out[at] = list(map(_SOURCE.__mod__, zip(
                obs, map(RELATIONS.__getitem__, self._cols["relation"][rows][at].tolist()), d["obs.step"][s].tolist(),
                map([enc(x) for x in d.config.sites].__getitem__, d["obs.site"][s].tolist()),
                d["obs.ubatch"][s].tolist(), map(files_j.__getitem__, fidx), map([f[:-1] for f in files_j].__getitem__,
                                                                                 fidx), obs)))
        return out.tolist()

    # ----- counts

    def by_rule(self) -> dict[str, int]:
        n = np.bincount(self.rule_code.astype(np.int64), minlength=len(RULES))
        return {r: int(n[k]) for k, r in enumerate(RULES) if n[k]}

    def by_site(self) -> dict[str, dict[str, int]]:
        """Counts by site then rule, each in order of first appearance (as a loop over the findings built it)."""
        if len(self) == 0:
            return {}
        site, code = self.site_code, self.rule_code.astype(np.int64)
        pair = site * len(RULES) + code
        uniq, first, count = np.unique(pair, return_index=True, return_counts=True)
        s_uniq, s_first = np.unique(site, return_index=True)
        s_rank = dict(zip(s_uniq.tolist(), s_first.tolist()))
        order = sorted(range(uniq.size), key=lambda k: (s_rank[int(uniq[k]) // len(RULES)], int(first[k])))
        out: dict[str, dict[str, int]] = {}
        names = self.d.config.sites
        for k in order:
            s, r = divmod(int(uniq[k]), len(RULES))
            out.setdefault(names[s], {})[RULES[r]] = int(count[k])
        return out

    def count_errors(self) -> tuple[int, int]:
        e = int(self.severity_code.sum())
        return e, len(self) - e

    def cells(self) -> np.ndarray:
        """[k, 5] int64: (site index, rank, step, ubatch, rule index) per finding (the timeline's input)."""
        return np.stack([self.site_code, self.rank, self.step, self.ubatch, self.rule_code.astype(np.int64)],
                        axis=1).reshape(len(self), 5)


class Written:
    """The findings of a check that writes each one's text and detail itself (the checks that find few, Python per
    finding): add() them in any order, then table(). A field left None is absent (None in the JSON)."""

    def __init__(self, d: Dump):
        self.d = d
        self.index: list[int] = []
        self.rule: list[int] = []
        self.ints: dict[str, list[int]] = {k: [] for k in ("row", "recorded", "expected", "wrong_rows")}
        self.texts: list[tuple[str, dict]] = []
        self.relation: list[int] = []

    def add(self, index: int, rule: str, text: str, *, row: int | None = None, recorded: int | None = None,
            expected: int | None = None, wrong_rows: int = 0, detail: dict | None = None,
            relation: str | None = None) -> None:
        """One finding; `relation` (one of RELATIONS) says which mechanism it is where a rule has several."""
        self.index.append(int(index))
        self.rule.append(RULES.index(rule))
        self.relation.append(-1 if relation is None else RELATIONS.index(relation))
        for k, v in (("row", row), ("recorded", recorded), ("expected", expected), ("wrong_rows", wrong_rows)):
            self.ints[k].append(v)
        self.texts.append((text, detail or {}))

    def table(self) -> FindingTable:
        cols = {k: np.array([0 if x is None else int(x) for x in v], np.int64) for k, v in self.ints.items()}
        masks = {m: np.array([x is not None for x in self.ints[f]], bool) for f, m in zip(("row", "recorded",
                                                                                           "expected"), _MASK)}
        return FindingTable.build(self.d, np.array(self.index, np.int64), np.array(self.rule, np.int8), STORED,
                                  dict(enumerate(self.texts)), **cols, **masks,
                                  relation=np.array(self.relation, np.int64))


def render_texts(t: FindingTable, rows: np.ndarray) -> tuple[list[str], list[str]]:
    """The texts and the JSON of the details of many column rows at once (the JSON Lines writer, one finding read
    alone): by kind (and rule), one %-format (or str.format) of the columns applied by map's C loop, no bytecode
    per finding but for the checks' own written texts (STORED)."""
    c, d = t._cols, t.d
    cfg = d.config
    n = rows.size
    texts = np.full(n, "", object)
    details = np.full(n, "{}", object)
    kind = c["kind"][rows]
    for kd in np.unique(kind).tolist():
        at = np.flatnonzero(kind == kd)
        r = rows[at]
        if kd == STORED:  # (the checks that find few)
            written = [t._stored[x] for x in r.tolist()]
            texts[at] = [x for x, _ in written]
            details[at] = [json.dumps(x) for _, x in written]
            continue
        row, rec, exp, wr, a0, a1 = (c[x][r] for x in ("row", "recorded", "expected", "wrong_rows", "a0", "a1"))
        if kd == MISSING:
            texts[at] = (f"dcp_local_seq_lens is None with dcp_size {cfg.dcp_size}; attention metadata would fail "
                         "with 'NoneType' object is not subscriptable")
        elif kd in (ALIAS_UB, ALIAS_GRAPH):
            texts[at], details[at] = _alias_texts(d, c["index"][r], a0, kd)
        elif kd == STRAY:
            texts[at] = "a DCP view is present with dcp_size 1; the engine should pass None"
        elif kd == SHAPE:
            _fill(texts, at, "DCP view has %d rows, must have num_reqs_padded = %d", a0, a1)
            _fill(details, at, '{"length": %d, "expected_length": %d}', a0, a1)
        elif kd == PADDING:
            _fill(texts, at, "padded row %d holds %d, must be 0 (%d bad padded row(s); rows >= num_reqs %d)", row,
                  rec, wr, a0)
        elif kd == PAGES:
            why = np.where(rec == a0, " = the global count: page counts were computed from the global length", "")
            _fill(texts, at, "attention plan claims %d pages for row %d%s; this rank owns %d (cdiv(local %d, %s))",
                  rec, row, why, exp, a1, np.full(at.size, cfg.page_size, object))
            _fill(details, at, '{"claimed": %d, "allowed": %d, "global": %d}', rec, exp, a0)
        else:  # VALUE
            _value_texts(d, c, r, at, texts, details)
    return texts.tolist(), details.tolist()


def _fill(out: np.ndarray, at: np.ndarray, fmt: str, *cols: np.ndarray) -> None:
    """out[at] = fmt % (cols[0][m], cols[1][m], ...) for each m, by map's C loop."""
    out[at] = list(map(fmt.__mod__, zip(*(x.tolist() for x in cols))))


def _value_texts(d, c: dict[str, np.ndarray], r: np.ndarray, at: np.ndarray, texts: np.ndarray,
                 details: np.ndarray) -> None:
    """The VALUE findings' texts (column rows `r`, at positions `at`): the wrong row, after what each rule says."""
    cfg = d.config
    row, rec, exp, wr = (c[x][r] for x in ("row", "recorded", "expected", "wrong_rows"))
    rws = np.empty(at.size, object)
    rws[:] = list(map("row %d is %d, expected %d (%d wrong row%s)".__mod__, zip(
        row.tolist(), rec.tolist(), exp.tolist(), wr.tolist(), np.where(wr > 1, "s", "").tolist())))
    code, a0 = c["rule_code"][r], c["a0"][r]
    for k in np.unique(code).tolist():
        m = np.flatnonzero(code == k)
        rule = RULES[k]
        if rule == "stale":
            src, rel = c["source"][r][m], c["relation"][r][m]
            s = np.where(src >= 0, src, 0)  # (a stale finding has a source; none would read the first observation)
            has = src >= 0
            s_obs, s_file = np.where(has, d.file_obs[s], 0), np.where(has, d.file_index[s], 0)
            s_step, s_site = np.where(has, d["obs.step"][s], 0), np.where(has, d["obs.site"][s], 0)
            refs = np.array(obs_refs(d.files, s_file.tolist(), s_obs.tolist()), object)
            for x in np.unique(rel).tolist():
                e = np.flatnonzero(rel == x)
                texts[at[m[e]]] = list(map(("stale DCP view, " + _EXPLAIN[RELATIONS[x]] + "; {3}").format, refs[e],
                                           map(cfg.sites.__getitem__, s_site[e].tolist()), s_step[e].tolist(),
                                           rws[m[e]]))
        elif rule == "global":
            _fill(texts, at[m], "DCP view holds the global seq_lens, not this rank's local lengths; %s", rws[m])
        elif rule == "wrong-rank":
            _fill(texts, at[m], "DCP view holds rank %d's local lengths; pass this rank's dcp_rank; %s", a0[m], rws[m])
            _fill(details, at[m], '{"rank": %d}', a0[m])
        elif rule == "wrong-interleave":
            _fill(texts, at[m], "DCP view was computed with interleave %d, the dump's is %s (check "
                                "cp_kv_cache_interleave_size); %s", a0[m], np.full(m.size, cfg.cp_interleave, object),
                  rws[m])
            _fill(details, at[m], '{"interleave": %d}', a0[m])
        else:
            texts[at[m]] = rws[m]


def _alias_texts(d, i: np.ndarray, j: np.ndarray, kind: int) -> tuple[list[str], list[str]]:
    """alias: observations i and the other observation j (the micro-batch sharing the buffer, or the capture):
    (texts, details as JSON)."""
    buf = d["obs.buffer"]
    bi, bj, oj = buf[i].tolist(), buf[j].tolist(), d.file_obs[j].tolist()
    rj = obs_refs(d.files, d.file_index[j].tolist(), oj)  # the other one's reference
    rj_j = list(map(encode_basestring_ascii, rj))
    if kind == ALIAS_UB:
        ui, uj = d["obs.ubatch"][i].tolist(), d["obs.ubatch"][j].tolist()
        return (list(map("micro-batch %d reads the same DCP buffer as micro-batch %d (obs %s); each micro-batch needs "
                         "its own buffer".__mod__, zip(ui, uj, rj))),
                list(map('{"buffer": %d, "other_obs": %d, "other_ref": %s}'.__mod__, zip(bi, oj, rj_j))))
    return (list(map("full-graph replay reads DCP buffer %#x but the graph was captured on %#x (obs %s); the replay "
                     "sees stale values".__mod__, zip(bi, bj, rj))),
            list(map('{"buffer": %d, "captured": %d, "capture_obs": %d, "capture_ref": %s}'.__mod__,
                     zip(bi, bj, oj, rj_j))))
