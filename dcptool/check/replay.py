"""Replay: the pipeline (scan -> rules, or skipped -> provenance -> findings), --split, --obs row views and the grid."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from dcptool.check.alias import check_alias
from dcptool.check.decode import check_empty_mask, check_tot_lens
from dcptool.check.findings import Collector, Finding, FindingTable, findings_of
from dcptool.check.provenance import Provenance, Source, expected_of
from dcptool.check.ranks import check_rank_agree, check_rank_sum, rank_pairs
from dcptool.check.rules import PARENT_ROWS_NEEDS, RULE, RULES, SEVERITY
from dcptool.check.slots import check_slot_rules
from dcptool.check.ubatch import check_ubatch_slice, merge_split_findings
from dcptool.check.values import check_missing, check_padding, check_pages, check_shape, check_stray, check_values
from dcptool.choices import Backend, values
from dcptool.dcp.reference import local_np
from dcptool.dcp.slicing import Ubatch, engine_split
from dcptool.dump import Dump, DumpError, obs_ref

__all__ = ["RULES", "SEVERITY", "Finding", "LimitError", "ReplayResult", "Source", "expected_of", "local_np", "replay",
           "resolve_backend", "rows_view", "splits"]


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
        return {"type": "split", "parent_obs": self.parent_obs, "file": self.file,
                "parent_ref": obs_ref(self.file, self.parent_obs), "ubatch": self.ubatch,
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
        return {"type": "rows", "obs": self.obs, "file": self.file, "ref": obs_ref(self.file, self.obs),
                "step": self.step, "site": self.site, "rank": self.rank, "ubatch": self.ubatch,
                "num_reqs": self.num_reqs, "num_reqs_padded": self.num_reqs_padded, "seq_lens": self.seq_lens,
                "expected": self.expected,
                "recorded": self.recorded, "expected_all_ranks": self.expected_all_ranks, "verdict": self.verdict}


@dataclass(frozen=True)
class ObsGrid:
    """Where the observations are, for the timeline: one entry per distinct (site, rank, step, ubatch)."""

    site: np.ndarray  # int32, index into config.sites
    rank: np.ndarray  # int32
    step: np.ndarray  # int64
    ubatch: np.ndarray  # int32, -1 for a full batch
    count: np.ndarray  # int64, observations with that key


@dataclass
class ReplayResult:
    files: list[str]
    config: object
    observations: int
    findings: FindingTable  # a Sequence of Finding, built as columns (findings.py)
    backend: str
    device: str
    seconds: float
    skipped: dict[str, str] = field(default_factory=dict)  # check -> why it did not run
    splits: list[Split] = field(default_factory=list)
    rows_view: RowsView | None = None
    grid: ObsGrid | None = None
    views: dict[int, RowsView] = field(default_factory=dict)  # merged index -> row view (for --html)
    problems: list = field(default_factory=list)  # problems.Problem: the findings grouped by root cause
    capped: int | None = None  # the size cap (bytes) the recording stopped at (dcptool.capped); None: it did not

    @property
    def errors(self) -> int:
        if isinstance(self.findings, FindingTable):
            return self.findings.count_errors()[0]
        return sum(f.severity == "error" for f in self.findings)

    @property
    def warnings(self) -> int:
        if isinstance(self.findings, FindingTable):
            return self.findings.count_errors()[1]
        return sum(f.severity == "warning" for f in self.findings)

    def by_rule(self) -> dict[str, int]:
        if isinstance(self.findings, FindingTable):
            return self.findings.by_rule()
        out: dict[str, int] = {}
        for f in self.findings:
            out[f.rule] = out.get(f.rule, 0) + 1
        return {r: out[r] for r in RULES if r in out}

    def by_site(self) -> dict[str, dict[str, int]]:
        if isinstance(self.findings, FindingTable):
            return self.findings.by_site()
        out: dict[str, dict[str, int]] = defaultdict(dict)
        for f in self.findings:
            out[f.site][f.rule] = out[f.site].get(f.rule, 0) + 1
        return dict(out)

    def summary_json(self) -> dict:
        return {"type": "summary", "files": self.files, "observations": self.observations,
                "findings": len(self.findings), "errors": self.errors, "warnings": self.warnings,
                "by_rule": self.by_rule(), "by_site": self.by_site(),
                "first": self.findings[0].to_json() if self.findings else None, "skipped": self.skipped,
                "backend": self.backend, "device": self.device, "seconds": round(self.seconds, 4),
                **({} if self.capped is None else {"capped": self.capped})}


def replay(d: Dump, backend: str = "auto", *, split: int | None = None, obs: int | None = None,
           views: int = 0, bounded: bool = False, progress=None, engine_version: str | None = None) -> ReplayResult:
    """Check every observation of a dump; findings in observation order, then DESIGN §3 table order.

    `views` > 0 adds row views of the first `views` observations with findings and of the sources
    of their stale findings (the HTML report's row views).
    The row checks are one chunked scan (scan.py); everything else is per finding, or vectorised
    over observations (structure.py). `bounded` drops each chunk's pages after use (huge dumps);
    `progress(k)` is called as k more observations are scanned. Micro-batches are split by the rule of
    `engine_version` (default: the one the dump names; slicing.engine_split).
    """
    t0 = time.perf_counter()
    c = d.config
    version = engine_version if engine_version is not None else c.engine_version
    if split is not None:
        check_split(d, split)  # before the scan: an absurd K is bad usage, not an hour of work
    backend, device = resolve_backend(backend, d.n)
    N = c.dcp_size
    found = Collector(d)  # each check's findings as columns (findings.py); messages are rendered when read
    skipped: dict[str, str] = {}
    bar = Phases(progress)
    w_checks = W_CHECKS + W_SLICES * d.has(*RULE["ubatch-slice"].needs) + W_ALIAS * d.has(*RULE["alias"].needs)
    bar.plan(scan=d.n, checks=round(w_checks * d.n), provenance=0, findings=0)
    # The checks that do not read the scan's answer run on other threads while it runs (numpy releases the
    # GIL in its long calls): on a many-core host the checks phase shrinks to its longest check. A bounded
    # dump stays on one thread (each read drops the pages it touched; reads of several threads at once
    # would hold more). Collected in the same order either way, so the findings are identical.
    later = _later(d, bounded)
    try:
        parts, grid = _checks(d, backend, N, version, bounded, progress, bar, skipped, later)
        for part in parts:
            found += part.result() if hasattr(part, "result") else part
    except Exception:
        if isinstance(later, _Threads):  # no check may still read the dump's memory while the error ends the process
            later.settle()
        d.finish()  # a streamed dump's DumpError first: what a check raised on rows not yet validated is not the cause
        raise
    d.finish()  # (a streamed dump: the file validated whole before anything is reported)
    res = ReplayResult(files=d.files, config=c, observations=d.n, findings=found.table(), backend=backend,
                       device=device, seconds=0.0, skipped=skipped, grid=grid,
                       capped=next((x for x in d.capped if x is not None), None))
    if split is not None:
        res.splits = splits(d, split, version)
        res.findings = merge_split_findings(d, res.findings, res.splits)
    if obs is not None:
        res.rows_view = rows_view(d, obs, [res.findings[int(k)] for k in np.flatnonzero(res.findings.index == obs)])
    if views > 0:
        res.views = finding_views(d, res.findings, views)
    from dcptool.check.problems import problems

    res.problems = problems(d, res.findings, version)
    bar.done("findings")
    res.seconds = time.perf_counter() - t0
    return res


class _Later:
    """A check run when its result is asked for (the one-thread replay: the order of today)."""

    def __init__(self, f, *a):
        self.f, self.a, self.done = f, a, False

    def result(self):
        if not self.done:  # (once: a result handed out twice is computed once)
            self.value, self.done = self.f(*self.a), True
        return self.value


CHECK_THREADS = 4  # checks running at once beside the scan (at most the cores there are)


class _Background:
    """A check on a thread of its own (daemon: an interrupted replay exits at once, not when its checks end),
    at most `slots` running at a time; result() waits and re-raises what the check raised."""

    def __init__(self, slots: threading.Semaphore, f, *a):
        self.value, self.error = None, None
        self.t = threading.Thread(target=self._run, args=(slots, f, a), daemon=True, name="dcptool-check")
        self.t.start()

    def _run(self, slots, f, a) -> None:
        with slots:
            try:
                self.value = f(*a)
            except BaseException as e:  # handed to the caller by result()
                self.error = e

    def result(self):
        self.t.join()
        if self.error is not None:
            raise self.error
        return self.value


class _Prev:
    """The scan's view of rank_pairs' future: its `prev` column."""

    def __init__(self, f):
        self.f = f

    def result(self) -> np.ndarray:
        return self.f.result().prev


class _Threads:
    """later() on background threads: each check a _Background, at most n running at once. settle() waits for
    every one started: when the replay fails (a file rewritten while it is read, a check tripping over rows not
    yet validated), the error must not end the process while checks still run on the dump's buffers (daemon
    threads that the interpreter's exit stops in the middle of numpy or torch code can abort it)."""

    def __init__(self, n: int):
        self.slots, self.started = threading.Semaphore(n), []

    def __call__(self, f, *a) -> _Background:
        self.started.append(_Background(self.slots, f, *a))
        return self.started[-1]

    def settle(self) -> None:
        for b in self.started:
            b.t.join()


def _later(d: Dump, bounded: bool):
    """How the checks run: on background threads, or one after the other when asked for (a bounded dump, one
    core, nothing to check)."""
    import os

    n = min(CHECK_THREADS, (os.cpu_count() or 1))
    if bounded or d.bounded or n < 2 or d.n == 0:
        return _Later
    return _Threads(n)


def _checks(d: Dump, backend: str, N: int, version, bounded: bool, progress, bar, skipped: dict,
            later) -> tuple[list, ObsGrid]:
    """Every check's findings (a table, or what later() returned), in the order they are collected, and the
    timeline grid (later(f, *args): run f on another thread, or when asked for)."""
    from dcptool.check.scan import scan

    out: list = []
    # first: rank-agree's row comparison rides on the scan's read of the rows; they are computed while the scan
    # sets up, and its first chunk waits for them
    pairs = later(rank_pairs, d) if N > 1 else None
    independent: dict[str, object] = {}  # submitted before the scan
    if N > 1:
        independent["missing"] = later(check_missing, d)
        independent["shape"] = later(check_shape, d)
    else:
        independent["stray"] = later(check_stray, d)
    if d.has(*RULE["ubatch-slice"].needs):
        independent["ubatch-slice"] = later(lambda: findings_of(d, check_ubatch_slice(d, version)))
    if d.has(*RULE["alias"].needs):
        independent["alias"] = later(lambda: findings_of(d, check_alias(d)))
    grid = later(obs_grid, d)
    for rule, check in (("empty-mask", check_empty_mask), ("tot-lens", check_tot_lens)):
        if N > 1 and d.has(*RULE[rule].needs):
            independent[rule] = later(lambda check=check: findings_of(d, check(d)))
    if d.has(*RULE["slots"].needs):
        independent["slots"] = later(lambda: [findings_of(d, x) for x in check_slot_rules(d)])  # (one pass, both)
    prov = Provenance(d)
    lead = None
    if N > 1 and backend == "triton" and later is not _Later:  # the host waits while the device scans: provenance's
        lead = later(prov.lead)  # per-observation keys now (not on one thread: a clean dump would pay for them)
    bar.phase("scan")
    st = scan(d, backend, bounded=bounded, progress=progress, pairs=None if pairs is None else _Prev(pairs))
    n_wrong = int((st.n_wrong > 0).sum())
    bar.plan(provenance=round(W_PROVENANCE * d.n + W_WRONG * n_wrong) if n_wrong else 0,
             findings=round(W_FINDING * st.obs.size))
    if N > 1:
        # the checks that need the scan but not each other: beside provenance
        wrong = st.obs[st.n_wrong > 0]
        rank_sum = later(lambda: findings_of(d, check_rank_sum(d, wrong)))
        agree = later(lambda: findings_of(d, check_rank_agree(d, pairs.result(), st.differ)))
        bar.phase("provenance")
        out.append(independent["missing"])
        if lead is not None:
            lead.result()  # (kept in prov)
        if wrong.size:  # every wrong view's sources are searched at once (a clean dump pays nothing)
            prov.prepare(wrong)
        out.append(check_values(d, prov, st))
        bar.phase("checks")
        out.append(check_padding(d, st))
        out.append(independent["shape"])
        out.append(rank_sum)
    else:
        bar.phase("checks")
        out.append(independent["stray"])
        skipped["rank-sum"] = "dcp_size is 1"
    if "ubatch-slice" in independent:
        out.append(independent["ubatch-slice"])
    else:
        skipped["ubatch-slice"] = "needs obs.parent, obs.req_start, obs.tok_start, obs.tok_stop and query_start_loc"
    if not d.has(*PARENT_ROWS_NEEDS):
        skipped["stale/parent-rows"] = "needs obs.parent and obs.req_start"
    if "alias" in independent:
        out.append(independent["alias"])
        if "obs.graph" not in d.columns:
            skipped["alias/graph"] = "needs obs.graph for capture/replay pairs"
    else:
        skipped["alias"] = "needs obs.buffer"
    grid = grid.result()
    bar.phase("findings")
    if d.has(*RULE["pages"].needs):
        out.append(check_pages(d, st))
    else:
        skipped["pages"] = "needs rows.kv_pages and page_size"
    # issue 15: the empty-shard mask, the global companion, rank agreement
    for rule in ("empty-mask", "tot-lens"):
        if N == 1:
            skipped[rule] = "dcp_size is 1"
        elif rule in independent:
            out.append(independent[rule])
        else:
            skipped[rule] = f"needs {' and '.join(RULE[rule].needs)} (not recorded in this dump)"
    if N > 1:
        out.append(agree)
    else:
        skipped["rank-agree"] = "dcp_size is 1"
    # issue 15 item 3: which rank writes each KV slot
    if "slots" in independent:
        both = independent["slots"]
        out += [_Later(lambda: both.result()[0]), _Later(lambda: both.result()[1])]
    else:
        skipped["slots"] = "needs the slot columns (obs.slots, rows.positions, rows.slot_mapping, rows.slot_group)"
    return out, grid


# The progress bar's phase weights (progress.PHASES), in observation-scan equivalents: what one more
# observation, wrong view or finding costs in that phase against the scan of one observation, measured with
# `benchmarks/bench_replay.py --phases` on the 1%-findings dumps and the dense legacy recording (CPU, numpy
# scan; docs/performance.md "The progress bar"). Estimates: the bar moves in proportion to the work left.
W_CHECKS = 0.2  # per observation: missing, padding, shape, rank-sum, the timeline grid
W_SLICES = 1.2  # per observation, more when the dump has micro-batch slices (ubatch-slice)
W_ALIAS = 0.5  # per observation, more when it records buffers (alias)
W_PROVENANCE = 0.1  # per observation when some view is wrong: the joins' one-column pre-filters
W_WRONG = 8.0  # per wrong view: the bulk provenance search and its confirmation
W_FINDING = 0.2  # per observation with a finding from the scan: building the columns
W_REPORT = 30.0  # per finding the HTML page lays out (cli.py)


class Phases:
    """Phase calls on a progress bar that has them (progress.Progress); nothing on a plain `progress(k)`
    callable or None, so library callers keep passing either."""

    def __init__(self, progress):
        self.p = progress if hasattr(progress, "phase") else None

    def plan(self, **units: int) -> None:
        if self.p is not None:
            self.p.plan(**units)

    def phase(self, name: str) -> None:
        if self.p is not None:
            self.p.phase(name)

    def done(self, name: str) -> None:
        """Phase `name` is over (the next one, if planned, has not started)."""
        if self.p is not None:
            self.p.phase(name)
            self.p(self.p.total)


def resolve_backend(name: str, observations: int | None = None) -> tuple[str, str]:
    """auto = Triton on CUDA, torch on CPU; triton without a GPU runs the interpreter. With `observations`
    given, auto keeps a dump smaller than scan.GPU_MIN_OBS on the CPU (where the GPU's start-up and transfers
    cost more than it saves), without asking for a GPU. The GPU is asked of the CUDA driver (dcp.cuda,
    ~0.1 s), not torch (1.5-1.8 s to import): neither backend's replay imports torch outside the interpreter."""
    from dcptool.check.scan import GPU_MIN_OBS
    from dcptool.dcp import cuda

    if name not in values(Backend):
        raise ValueError(f"unknown backend {name!r} (auto, triton or torch)")
    if name == "torch" or (name == "auto" and observations is not None and observations < GPU_MIN_OBS):
        return "torch", "cpu"
    gpu = cuda.available()
    if name == "auto":
        name = "triton" if gpu else "torch"
    if name == "torch":
        return "torch", "cpu"
    return "triton", "cuda" if gpu else "cpu (Triton interpreter)"


MAX_SPLIT = 64  # --split K: micro-batches per batch at most (vLLM's DBO runs 2); docs/limits.md


class LimitError(DumpError):
    """A value past one of dcptool's documented limits (docs/limits.md): bad usage or input, exit 2."""


def _splittable(d: Dump) -> np.ndarray:
    """Recorded full batches `--split` re-splits (a batch whose query_start_loc does not cover
    num_reqs_padded rows cannot be)."""
    if not d.has("obs.qsl"):
        return np.zeros(0, np.int64)
    padded = d["obs.num_reqs_padded"].astype(np.int64)
    return np.flatnonzero((d["obs.ubatch"] == -1) & (d["obs.num_reqs"] >= 1) & (np.diff(d["obs.qsl"]) > padded))


def check_split(d: Dump, k: int) -> None:
    """Refuse an absurd `--split K` before any work: K micro-batches per batch cost K objects each,
    so K is capped (MAX_SPLIT) and may not exceed the tokens of the largest batch there is to split
    (past that every micro-batch but one would be empty)."""
    if k < 1:
        raise LimitError(f"--split: must be >= 1, got {k}")
    if k > MAX_SPLIT:
        raise LimitError(f"--split: {k}: at most {MAX_SPLIT} micro-batches per batch (docs/limits.md)")
    idx = _splittable(d)
    if idx.size:
        tok = d.take("rows.query_start_loc", d["obs.qsl"][idx] + d["obs.num_reqs"][idx]).astype(np.int64)
        if d.has("obs.num_tokens_padded"):
            ntp = d["obs.num_tokens_padded"][idx].astype(np.int64)
            tok = np.where(ntp >= 0, ntp, tok)
        most = int(tok.max())
        if k > max(most, 2):  # (K = 2, vLLM's DBO, is always allowed: an odd dump of empty batches still replays)
            raise LimitError(f"--split: {k}: more micro-batches than tokens; the largest batch to split has {most}")


def splits(d: Dump, k: int, engine_version: str | None = None) -> list[Split]:
    """`--split K`: re-split every recorded full batch (with query_start_loc) into K micro-batches, by the
    rule of `engine_version` (default: the dump's)."""
    check_split(d, k)
    c = d.config
    version = engine_version if engine_version is not None else c.engine_version
    out = []
    ntp = d["obs.num_tokens_padded"] if d.has("obs.num_tokens_padded") else None
    for i in _splittable(d):
        nr, nrp = int(d["obs.num_reqs"][i]), int(d["obs.num_reqs_padded"][i])
        for u, ub in enumerate(engine_split(d.qsl_of(i), d.seq_lens_of(i), nr, nrp,
                                            None if ntp is None else int(ntp[i]), k, version)):
            dcp = np.zeros(ub.num_reqs_padded, np.int64)
            dcp[: ub.num_reqs] = local_np(ub.seq_lens[: ub.num_reqs], c.dcp_size, int(d["obs.rank"][i]),
                                          c.cp_interleave)
            out.append(Split(parent=int(i), parent_obs=int(d.file_obs[i]), file=d.file_of(i), ubatch=u, ub=ub,
                             dcp_local_seq_lens=dcp))
    return out


MAX_VIEW_CELLS = 1 << 22  # a row view lays out rows + real rows x ranks cells; past this it is not built
VIEW_BUDGET = 1 << 21  # cells of all the row views the HTML report carries together (docs/limits.md)


def view_cells(d: Dump, i: int) -> int:
    """The size of observation i's row view; num_reqs_padded and dcp_size are recorded numbers, not
    data, so a hostile dump could ask for billions of rows: callers check this first."""
    rows = max(int(d["obs.num_reqs_padded"][i]), int(d["obs.dcp_rows"][i + 1] - d["obs.dcp_rows"][i]))
    return rows + int(d["obs.num_reqs"][i]) * d.config.dcp_size


def rows_view(d: Dump, i: int, findings: list[Finding]) -> RowsView:
    """`--obs I`: seq_len, expected on every rank, recorded and a verdict for each row (see view_cells)."""
    c = d.config
    nr, nrp = int(d["obs.num_reqs"][i]), int(d["obs.num_reqs_padded"][i])
    seq = d.seq_lens_of(i)
    exp = expected_of(d, i)
    view = d.dcp_of(i)
    # (no real rows: no per-rank table; an arange of a 2^31-1 dcp_size would be 16 GB for nothing)
    allr = local_np(seq[:nr].reshape(-1, 1), c.dcp_size, np.arange(c.dcp_size if nr else 1).reshape(1, -1),
                    c.cp_interleave)
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


def obs_grid(d: Dump) -> ObsGrid:
    """Count observations per distinct (site, rank, step, ubatch): one sort, no loop per observation."""
    site, rank, step, ub = d["obs.site"], d["obs.rank"], d["obs.step"], d["obs.ubatch"]
    order = np.lexsort((ub, step, rank, site))
    s, r, t, u = site[order], rank[order], step[order], ub[order]
    new = np.ones(order.size, bool)
    new[1:] = (s[1:] != s[:-1]) | (r[1:] != r[:-1]) | (t[1:] != t[:-1]) | (u[1:] != u[:-1])
    first = np.flatnonzero(new)
    count = np.diff(np.append(first, order.size).astype(np.int64))
    return ObsGrid(site=s[first].astype(np.int32), rank=r[first].astype(np.int32), step=t[first].astype(np.int64),
                   ubatch=u[first].astype(np.int32), count=count.astype(np.int64))


def finding_views(d: Dump, findings: FindingTable, limit: int) -> dict[int, RowsView]:
    """Row views of the first `limit` observations with findings, plus the sources of their stale findings,
    within VIEW_BUDGET cells in all (a view's size is set by recorded numbers: see view_cells)."""
    index = findings.index
    uniq, first = np.unique(index, return_index=True)
    want = uniq[np.argsort(first, kind="stable")][:limit]  # observations with findings, in report order
    at = np.flatnonzero(np.isin(index, want))  # their findings, in report order
    src = findings.source[at]
    sources = src[src >= 0]
    out: dict[int, RowsView] = {}
    budget = VIEW_BUDGET
    mine = {int(i): [] for i in want}
    for k in at.tolist():
        mine[int(index[k])].append(k)
    for i in dict.fromkeys(want.tolist() + sources.tolist()):  # observations with findings first, then sources
        cells = view_cells(d, i)
        if cells <= min(budget, MAX_VIEW_CELLS):
            budget -= cells
            ks = mine.get(i, np.flatnonzero(index == i).tolist())
            out[i] = rows_view(d, i, [findings[k] for k in ks])
    return dict(sorted(out.items()))
