"""Root causes: replay's findings grouped into problems, and problems matched against known vLLM bugs.

A problem is one mechanism: the same rule (and relation, for `stale`), the same code path (site, where the
rule is about a path) and the same pattern of rows (every real row, the row straddling a micro-batch split,
padded rows, a view cut to num_reqs ...). Side findings a fault causes on the observations it touched (a
stale global-length view is also the wrong `shape`; wrong rows make the ranks' sum wrong) join the problem
of that observation (or, for `rank-sum`, of its batch). Grouping is one lexsort over the findings' columns
(_Keys, read from the FindingTable's arrays): no Finding object but each problem's first.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources

import numpy as np

from dcptool.check.findings import PAGES, SHAPE, Finding, FindingTable
from dcptool.check.findings import RELATIONS as FINDING_RELATIONS
from dcptool.dcp.rules import RULES
from dcptool.dcp.segments import distinct
from dcptool.dump import Dump

RELATIONS = ("", *FINDING_RELATIONS)

# Row patterns: what part of a view the finding concerns (problems split on them: different mechanisms).
VIEW, REAL_ROWS, STRADDLE, PADDED, CUT, LENGTH, PLAN = range(7)
PATTERNS = ("the whole view", "real rows", "the row straddling the micro-batch split", "padded rows",
            "view cut to num_reqs", "view length", "a KV transfer plan")

# Rules whose mechanism is a code path, so the site is part of the problem (None at a dummy run and None in a
# micro-batch are two bugs). The others come from one place whatever path built the batch: page counts from
# the attention backend's plan, padded rows from the buffer's fill, rank and interleave from configuration.
SITE_BOUND = frozenset({"missing", "stale", "global", "mismatch", "shape", "ubatch-slice", "alias"})
# Main rules: a wrong or absent view. Side rules: consequences that join the main problem of the same
# observation (shape of another length, e.g. a global-length view) or the same batch (rank-sum).
MAIN = frozenset({"missing", "stale", "global", "wrong-rank", "wrong-interleave", "mismatch"})
# the same by rule code (position in rules.RULES): grouping reads the findings' codes, never an array of names
IS_SITE_BOUND = np.array([r in SITE_BOUND for r in RULES], bool)
IS_MAIN = np.array([r in MAIN for r in RULES], bool)


@dataclass(frozen=True)
class _Keys:
    """The fields grouping reads, one array per field, one entry per finding (in finding order)."""

    rule: np.ndarray  # int16: position in rules.RULES
    relation: np.ndarray  # int8: position in RELATIONS (0: none)
    site: np.ndarray  # int32: index into sites
    step: np.ndarray  # int64
    rank: np.ndarray  # int32
    ubatch: np.ndarray  # int32
    index: np.ndarray  # int64: observation (merged position)
    row: np.ndarray  # int64: first wrong row, -1 when none
    wrong_rows: np.ndarray  # int64
    length: np.ndarray  # int64: a shape finding's view length, -1 otherwise
    claimed_global: np.ndarray  # bool: a pages finding that claimed the global count
    sites: tuple[str, ...]

    @property
    def n(self) -> int:
        return int(self.rule.size)


def _keys(t: FindingTable) -> _Keys:
    """The grouping keys of a FindingTable's findings (its relations are RELATIONS[1:], -1 for none)."""
    kind, rule = t.kind, t.rule_code.astype(np.int16)
    return _Keys(rule=rule, relation=(t.relation + 1).astype(np.int8), site=t.site_code.astype(np.int32),
                         step=t.step, rank=t.rank.astype(np.int32), ubatch=t.ubatch.astype(np.int32), index=t.index,
                         row=np.where(t.has_row, t.row, -1), wrong_rows=t.wrong_rows,
                         length=np.where(kind == SHAPE, t.a0, -1),
                         claimed_global=(kind == PAGES) & (t.recorded == t.a0), sites=tuple(t.d.config.sites))


def row_patterns(d: Dump, fa: _Keys) -> np.ndarray:
    """Each finding's row pattern (VIEW, REAL_ROWS, STRADDLE, PADDED, CUT, LENGTH), vectorised."""
    code = RULES.index
    nr = d["obs.num_reqs"][fa.index].astype(np.int64)
    nrp = d["obs.num_reqs_padded"][fa.index].astype(np.int64)
    out = np.full(fa.n, VIEW, np.int8)
    rows = fa.row >= 0
    out[rows] = REAL_ROWS
    # a micro-batch whose one wrong row is its last real row: the request cut by the split (its tokens after
    # the split belong to the next micro-batch, so its length here is shorter than the parent's)
    out[rows & (fa.ubatch >= 0) & (fa.wrong_rows == 1) & (fa.row == nr - 1) & IS_MAIN[fa.rule]] = STRADDLE
    out[fa.rule == code("padding")] = PADDED
    out[fa.rule == code("transfer")] = PLAN
    shape = fa.rule == code("shape")
    out[shape] = np.where((fa.length[shape] == nr[shape]) & (nr[shape] < nrp[shape]), CUT, LENGTH)
    return out


@dataclass(frozen=True)
class KnownBug:
    id: str
    title: str
    rule: str
    relation: str | None
    sites: tuple[str, ...]
    pr: int | None
    fixed_in: str | None
    since: str | None  # first affected release
    before: str | None  # first release without it
    main: str | None  # lived only on vLLM main (no release)
    project: str = "vLLM"  # whose bug (vllm-ascend's: matched only where the recorded engine names it)

    @property
    def name(self) -> str:
        return (f"{self.project} PR #{self.pr}" if self.pr is not None
                else f"the known {self.project} bug '{self.title}'")


def known_bugs() -> tuple[KnownBug, ...]:
    """The package's known-bug signatures (dcptool/check/known_bugs.json)."""
    raw = json.loads(resources.files("dcptool.check").joinpath("known_bugs.json").read_text("utf-8"))
    out = []
    for b in raw["bugs"]:
        a = b.get("affected", {})
        out.append(KnownBug(id=b["id"], title=b["title"], rule=b["rule"], relation=b.get("relation"),
                            sites=tuple(b.get("sites") or ()), pr=b.get("pr"), fixed_in=b.get("fixed_in"),
                            since=a.get("from"), before=a.get("before"), main=a.get("main"),
                            project=b.get("project", "vLLM")))
    return tuple(out)


_VERSION = re.compile(r"(?<![\d.])(\d+)\.(\d+)(?:\.(\d+))?((?:\.?(?:dev|rc|a|b)\d*)|\+[\w.]+)?")


def parse_version(text: str | None) -> tuple[tuple[int, int, int], bool] | None:
    """((major, minor, patch), development build?) of the first version in a recorded engine_version, or None.
    "0.30.0.dev12+g1a2b" and "0.30.0rc1" are development builds: on main before 0.30.0, fix or no fix."""
    m = _VERSION.search(text or "")
    if m is None:
        return None
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)), bool(m.group(4))


def _v(s: str) -> tuple[int, int, int]:
    parsed = parse_version(s)
    assert parsed is not None, s
    return parsed[0]


@dataclass(frozen=True)
class BugMatch:
    """A known bug whose signature a problem has, and what the recorded engine version says about it."""

    bug: KnownBug
    verdict: str  # match | dev (a development build that may have it) | no-version | fixed | not-affected
    recorded: str | None

    @property
    def named(self) -> bool:
        """Is the bug named to the user? Only where the recorded version has it (or may, on main)."""
        return self.verdict in ("match", "dev")

    @property
    def text(self) -> str:
        b = self.bug
        fixed = f" (fixed in {b.fixed_in})" if b.fixed_in else " (on vLLM main only, never released)"
        if self.verdict == "match":
            return f"matches {b.name}{fixed}; you recorded {self.recorded}"
        if self.verdict == "dev":
            return f"may match {b.name}{fixed}; you recorded the development build {self.recorded}"
        if self.verdict == "no-version":
            return "no engine version recorded: not checked against known vLLM bugs"
        return f"no known vLLM bug of {self.recorded} has this signature"

    def to_json(self) -> dict:
        b = self.bug
        return {"id": b.id, "pr": b.pr, "fixed_in": b.fixed_in, "title": b.title, "verdict": self.verdict,
                "recorded": self.recorded, "named": self.named, "text": self.text}


def match_known(rule: str, relation: str | None, sites: tuple[str, ...], engine_version: str | None,
                bugs: tuple[KnownBug, ...] | None = None) -> BugMatch | None:
    """The known bug with this signature (rule, relation, a site it lives at) and the version's verdict; of
    several with the signature (bugs of different releases one rule catches), the first the version has, else the
    first; None when no signature fits."""
    found = [_verdict(b, engine_version) for b in (known_bugs() if bugs is None else bugs)
             if b.rule == rule and (b.relation or None) == (relation or None)
             and not (b.sites and not set(sites) & set(b.sites))
             and (b.project == "vLLM" or b.project.lower() in (engine_version or "").lower())]
    # (another project's bug is matched only where the recorded engine names it: its releases are not vLLM's)
    return next((m for m in found if m.named), found[0] if found else None)


def _verdict(b: KnownBug, engine_version: str | None) -> BugMatch:
    v = parse_version(engine_version)
    if v is None:
        return BugMatch(b, "no-version", None)
    (ver, dev), rec = v, engine_version.strip()
    if b.main is not None:  # main only: no release had it; a development build may
        return BugMatch(b, "dev" if dev else "not-affected", rec)
    if dev and b.before is not None and ver == _v(b.before):
        return BugMatch(b, "dev", rec)  # a build on main before the fixing release
    inside = (b.since is None or ver >= _v(b.since)) and (b.before is None or ver < _v(b.before))
    return BugMatch(b, "match" if inside else ("fixed" if b.before and ver >= _v(b.before) else "not-affected"), rec)


# --------------------------------------------------------------------------------------------
# Problems

_WHY = {
    ("missing", "dummy"): "dummy/profile runs build attention metadata with dcp_local_seq_lens None (the dummy "
                          "batch leaves it unset and nothing computes it before attention)",
    ("missing", "capture"): "CUDA-graph capture builds attention metadata with dcp_local_seq_lens None",
    ("missing", "dflash_capture"): "DFlash CUDA-graph capture builds attention metadata without "
                                   "dcp_local_seq_lens",
    ("missing", "ubatch"): "micro-batches are built without dcp_local_seq_lens (the per-micro-batch metadata "
                           "drops the field)",
    ("missing", None): "attention metadata at {site} is built with dcp_local_seq_lens None",
    ("stale/parent-rows", None): "micro-batches copy the parent's DCP rows instead of recomputing them from "
                                 "their own seq_lens, so the request straddling the split keeps its full length",
    ("stale/earlier-in-step", None): "the DCP view is derived from an earlier batch of the same step (e.g. the "
                                     "global batch before the PCP partition), not from the final batch",
    ("stale/earlier-step", None): "the DCP view holds an earlier step's lengths: its buffer was not refreshed "
                                  "(e.g. baked into a CUDA graph)",
    ("global", None): "the DCP view holds the global seq_lens: the localisation to this rank was skipped",
    ("wrong-rank", None): "the DCP view was computed for another DCP rank (a wrong dcp_rank argument)",
    ("wrong-interleave", None): "the DCP view was computed with another interleave than the dump's "
                                "cp_kv_cache_interleave_size",
    ("mismatch", None): "the DCP view's real rows are wrong and match no known provenance",
    ("padding", None): "padded rows [num_reqs, num_reqs_padded) are not zero (a sentinel or an old value is left "
                       "in the buffer)",
    ("shape/cut", None): "the DCP view is sliced to num_reqs instead of num_reqs_padded: padded rows are missing",
    ("shape", None): "the DCP view's length is not num_reqs_padded",
    ("stray", None): "dcp_size is 1 but a DCP view is passed (the engine should pass None)",
    ("ubatch-slice", None): "micro-batch seq_lens/query_start_loc disagree with slicing the parent batch",
    ("alias", None): "a full-graph replay reads another buffer than its capture, or micro-batches share one "
                     "DCP buffer",
    ("rank-sum", None): "the ranks' local lengths of one batch do not add up to its seq_lens",
    ("pages/global", None): "the attention plan claims cdiv(global length, page) pages per request instead of "
                            "cdiv(local length, page): each rank reads pages it does not own",
    ("pages", None): "the attention plan claims page counts that disagree with the rank's local lengths",
    ("empty-mask", None): "the empty-shard mask's inputs (dcp_query_start_loc, the local lengths) differ from "
                          "query_start_loc[:num_decodes+1] and the batch's local lengths, so other LSE rows are "
                          "masked than the empty shards",
    ("tot-lens", None): "the global companion of the local lengths (dcp_tot_seq_lens) is not the batch's global "
                        "seq_lens",
    ("rank-agree", None): "the DCP ranks of one batch disagree on what every rank must share (request counts, "
                          "seq_lens, query_start_loc, padding or graph mode)",
    ("slots", None): "a KV slot is written by another rank than the position's owner, or a replicated group is "
                     "not written by every rank",
    ("slot-partition", None): "across the ranks a DCP-sharded position is written by several ranks or by none",
    ("ctx-chunks", None): "the chunked prefill context is planned off the DCP virtual block or not from the "
                          "requests' computed context, so ranks gather misplaced or wrong context rows",
    ("ctx-agree", None): "the ranks of one DCP group plan different chunked prefill context, so they call different "
                         "DCP KV gathers (a rank waits in a collective its peers never join)",
    ("group-lens", None): "a KV-cache group's attention reads lengths of another sharding than its own (a replicated "
                          "sliding-window group with DCP-local lengths), or a verify token's rank-local causal bound "
                          "is taken after the shard mapping",
    ("topk-agree", None): "the ranks of one DCP group select different sparse top-k sets for a query token (a tie at "
                          "the k-th score broken another way), so their shares do not partition one set",
    ("topk-empty", None): "a rank that owns none of a query token's top-k entries gives a partial result other than "
                          "output 0 and LSE -inf (a NaN the merge's 0 weight does not cancel: 0 x NaN)",
    ("graph-addr", None): "a full CUDA graph replays the addresses its capture baked in, but the build hands "
                          "attention a metadata tensor allocated anew (another address): the graph reads a stale "
                          "buffer",
    ("capacity", None): "a per-request metadata buffer sized below the largest padded batch (max_num_seqs under a "
                        "larger CUDA-graph capture size): views cut short, writes past its end",
    ("host-copy", None): "the metadata builder reads a host copy of seq_lens (seq_lens_cpu) that is not the "
                         "device's (async scheduling left it behind), or a build writes the shared copy in place",
    ("plan-pages", None): "FlashInfer's native plans count a prefill row's pages or a row's last page from the "
                          "global length, not the rank's local context",
    ("kernel-block", None): "the slot mapping deals positions to the DCP ranks by the attention kernel's block where "
                            "the KV-cache manager's differs and the interleave does not divide it: KV written on "
                            "ranks that do not own it, past the kernel block",
    ("transfer/partial-store", None): "a connector stores one rank's shard of the KV under a key that claims the "
                                      "whole request (e.g. only rank 0 writes, as if it held the full MLA KV)",
    ("transfer/wrong-source", None): "the connector reads positions from a source worker whose shard does not hold "
                                     "them (it matched the shards by the wrong stride, or assumed one source rank)",
    ("transfer/past-sequence", None): "the connector fills destination positions from source slots past the "
                                      "sequence length (allocation padding read as KV)",
    ("transfer/not-owner", None): "the connector sends positions to a destination rank that does not own them "
                                  "(the two sides' sharding was not mapped onto each other)",
    ("transfer/block-ids", None): "the connector's block ids do not name the request's blocks of that group "
                                  "(scaled by another group's block ratio, taken from another group, or paired "
                                  "wrongly)",
    ("transfer/twice", None): "the connector moves some positions more than once",
    ("transfer/never", None): "positions the destination rank must hold are never transferred",
    ("transfer", None): "a KV transfer plan does not move what the destination rank must hold",
}


def explain(rule: str, relation: str | None, pattern: int, sites: tuple[str, ...], all_global: bool = False) -> str:
    """The one-sentence mechanism of a problem."""
    key = rule
    if rule in ("stale", "transfer") and relation:
        key = f"{rule}/{relation}"
    elif rule == "shape" and pattern == CUT:
        key = "shape/cut"
    elif rule == "pages" and all_global:
        key = "pages/global"
    site = sites[0] if len(sites) == 1 else None
    text = _WHY.get((key, site)) or _WHY.get((key, None)) or f"{rule} findings"
    return text.format(site=site or ", ".join(sites))


@dataclass(frozen=True)
class Steps:
    first: int
    last: int
    count: int  # distinct steps
    period: int | None  # constant gap between distinct steps (1: contiguous), None when irregular or one step

    @property
    def text(self) -> str:
        if self.count == 1:
            return f"step {self.first}"
        if self.period == 1:
            return f"steps {self.first}-{self.last}"
        if self.period is not None:
            return f"every {self.period} steps from {self.first} to {self.last}" if self.count > 2 else \
                f"steps {self.first} and {self.last}"
        return f"{self.count} steps in {self.first}-{self.last}"

    def to_json(self) -> dict:
        return {"first": self.first, "last": self.last, "count": self.count, "period": self.period}


def _steps(steps: np.ndarray) -> Steps:
    u = distinct(steps)
    gaps = np.unique(np.diff(u))
    return Steps(int(u[0]), int(u[-1]), int(u.size), int(gaps[0]) if gaps.size == 1 else None)


def _ranks_text(ranks: tuple[int, ...]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ",".join(map(str, ranks))


@dataclass(frozen=True)
class Problem:
    number: int  # 1-based, in order of first occurrence
    rule: str
    relation: str | None
    pattern: str
    sites: tuple[str, ...]
    count: int  # findings of its own rule
    side: dict[str, int]  # side findings attached: rule -> count
    findings: np.ndarray  # int64 positions in the finding stream (replay's order), own and side, ascending
    observations: int  # distinct observations
    steps: Steps
    ranks: tuple[int, ...]
    first: Finding
    explanation: str
    known: BugMatch | None = None

    @property
    def label(self) -> str:
        return self.rule + (f"/{self.relation}" if self.relation else "")

    @property
    def line(self) -> str:
        """The report's one line for this problem."""
        side = "".join(f", +{n} {r} side finding{'s' if n > 1 else ''}" for r, n in self.side.items())
        f = self.first
        head = (f"problem {self.number}: {self.label} at {', '.join(self.sites)} ({self.pattern}): "
                f"{self.count} finding{'s' if self.count > 1 else ''}{side}, {self.steps.text}, "
                f"{_ranks_text(self.ranks)}, first at {f.ref} ({f.where}): {self.explanation}")
        return head + (f"; {self.known.text}" if self.known is not None and self.known.verdict != "not-affected"
                       else "")

    def to_json(self) -> dict:
        f = self.first
        return {"type": "problem", "problem": self.number, "rule": self.rule, "relation": self.relation,
                "pattern": self.pattern, "sites": list(self.sites), "count": self.count, "side": self.side,
                "observations": self.observations, "steps": self.steps.to_json(), "ranks": list(self.ranks),
                "first": {"obs": f.obs, "file": f.file, "ref": f.ref, "step": f.step, "site": f.site, "rank": f.rank,
                          "ubatch": f.ubatch, "finding": int(self.findings[0])},
                "explanation": self.explanation,
                "known_bug": None if self.known is None or not self.known.named else self.known.to_json(),
                "engine_version_note": None if self.known is None or self.known.named else self.known.text,
                "findings": self.findings.tolist()}


def _runs(keys: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Sort by keys (last key primary, as lexsort) and label each run of equal keys: (order, group of sorted)."""
    order = np.lexsort(keys)
    new = np.zeros(order.size, bool)
    if order.size:
        new[0] = True
        for k in keys:
            ks = k[order]
            new[1:] |= ks[1:] != ks[:-1]
    return order, np.cumsum(new) - 1


def problems(d: Dump, findings: FindingTable, engine_version: str | None = None) -> list[Problem]:
    """Findings -> problems, deterministic: keyed by (rule, relation, site where SITE_BOUND, row pattern);
    side findings (shape of another length, rank-sum) join the main problem at their observation (rank-sum:
    at their batch). Problems are numbered in order of first occurrence; `engine_version` (default: the dump's)
    is what known bugs are checked against."""
    version = d.config.engine_version if engine_version is None else engine_version
    n = len(findings)
    if n == 0:
        return []
    fa = _keys(findings)
    pattern = row_patterns(d, fa)
    gid = _key_groups(fa, pattern)
    owner = _side_owners(fa, pattern, gid)
    final = np.where(owner >= 0, owner, gid)
    # number problems by first occurrence (the first finding of each final group)
    firsts = np.full(int(final.max()) + 1, n, np.int64)
    np.minimum.at(firsts, final, np.arange(n, dtype=np.int64))
    live = np.flatnonzero(firsts < n)
    live = live[np.argsort(firsts[live], kind="stable")]
    by = np.argsort(final, kind="stable")  # positions of each group, ascending
    bounds = np.searchsorted(final[by], live)
    ends = np.searchsorted(final[by], live, side="right")
    return [_problem(num, fa, pattern, by[a:b], gid[by[a:b]] == g, findings, version)
            for num, (g, a, b) in enumerate(zip(live.tolist(), bounds.tolist(), ends.tolist()), 1)]


def _key_groups(fa: _Keys, pattern: np.ndarray) -> np.ndarray:
    """Each finding's group of its own key (rule, relation, site where SITE_BOUND, row pattern). The straddling
    row is how a copied parent row usually shows, not another mechanism: one key with real rows."""
    site_key = np.where(IS_SITE_BOUND[fa.rule], fa.site, -1).astype(np.int64)
    key_pattern = np.where(pattern == STRADDLE, REAL_ROWS, pattern).astype(np.int64)
    order, g_sorted = _runs([key_pattern, site_key, fa.relation.astype(np.int64), fa.rule.astype(np.int64)])
    gid = np.empty(fa.n, np.int64)
    gid[order] = g_sorted
    return gid


def _side_owners(fa: _Keys, pattern: np.ndarray, gid: np.ndarray) -> np.ndarray:
    """The main group a side finding joins (-1: none): a main finding's at the same observation (shape of another
    length, rank-sum), else for rank-sum, which is reported where the set of ranks completes, a main finding's of
    the same batch (step, site, ubatch)."""
    main = IS_MAIN[fa.rule]
    side_sum = fa.rule == RULES.index("rank-sum")
    owner = np.full(fa.n, -1, np.int64)
    if not main.any():
        return owner
    mi = np.flatnonzero(main)
    mo = np.argsort(fa.index[mi], kind="stable")
    keys, grp = fa.index[mi][mo], gid[mi][mo]
    s = np.flatnonzero(((fa.rule == RULES.index("shape")) & (pattern == LENGTH)) | side_sum)
    k = np.searchsorted(keys, fa.index[s])
    hit = (k < keys.size) & (keys[np.minimum(k, keys.size - 1)] == fa.index[s])
    owner[s[hit]] = grp[k[hit]]
    r = np.flatnonzero(side_sum & (owner < 0))
    if r.size:  # (one int key per batch by ranking the triples)
        both = np.concatenate([mi, r])
        b_order, b_sorted = _runs([fa.ubatch[both].astype(np.int64), fa.site[both].astype(np.int64), fa.step[both]])
        batch = np.empty(both.size, np.int64)
        batch[b_order] = b_sorted
        mb, rb = batch[: mi.size], batch[mi.size:]
        bo = np.argsort(mb, kind="stable")
        k = np.searchsorted(mb[bo], rb)
        hit = (k < mb.size) & (mb[bo][np.minimum(k, mb.size - 1)] == rb)
        owner[r[hit]] = gid[mi][bo][k[hit]]
    return owner


def _problem(num: int, fa: _Keys, pattern: np.ndarray, members: np.ndarray, is_own: np.ndarray,
             findings: FindingTable, version: str | None) -> Problem:
    """Problem `num`: its findings (`members`, ascending positions), of them its own key's (where `is_own`) and the
    side findings that joined it."""
    own, side_idx = members[is_own], members[~is_own]
    rep = own[0] if own.size else members[0]
    r_name = RULES[int(fa.rule[rep])]
    rel = RELATIONS[int(fa.relation[rep])] or None
    s_names = tuple(fa.sites[i] for i in distinct(fa.site[own]).tolist())
    side = {}
    if side_idx.size:
        cnt = np.bincount(fa.rule[side_idx], minlength=len(RULES))
        side = {RULES[x]: int(cnt[x]) for x in np.flatnonzero(cnt).tolist()}
    pat = int(pattern[rep])
    straddle = int((pattern[own] == STRADDLE).sum())
    if pat in (REAL_ROWS, STRADDLE):
        pat = STRADDLE if straddle == own.size else REAL_ROWS
    pat_text = PATTERNS[pat] if pat != REAL_ROWS or not straddle else \
        f"real rows; in {straddle} only the row straddling the micro-batch split"
    return Problem(number=num, rule=r_name, relation=rel, pattern=pat_text, sites=s_names, count=int(own.size),
                   side=side, findings=members.astype(np.int64), observations=int(distinct(fa.index[members]).size),
                   steps=_steps(fa.step[own]), ranks=tuple(distinct(fa.rank[own]).tolist()), first=findings[int(rep)],
                   explanation=explain(r_name, rel, pat, s_names, bool(fa.claimed_global[own].all())),
                   known=match_known(r_name, rel, s_names, version))
