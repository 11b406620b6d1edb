"""Replay: the pipeline (scan -> rules, or skipped -> provenance -> findings), --split, --obs row views and the grid."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from dcptool.check.findings import Finding, FindingTable
from dcptool.check.later import Later, Threads, runner, value
from dcptool.check.plan import Plan, plan, run_check
from dcptool.check.provenance import Provenance, Source, expected_of
from dcptool.check.ranks import rank_pairs
from dcptool.check.ubatch import merge_split_findings
from dcptool.choices import Backend, values
from dcptool.dcp.reference import local_np
from dcptool.dcp.rules import DIFFER, PAIRS, PROVENANCE, RULE, RULES, SCAN, SEVERITY, VERSION, WRONG
from dcptool.dcp.slicing import Ubatch, engine_split
from dcptool.dump import Dump, DumpError, MemoryPlan, obs_ref
from dcptool.gpu.cuda import CudaError, CudaStartError

__all__ = ["RULES", "SEVERITY", "Finding", "LimitError", "ReplayResult", "Source", "expected_of", "local_np", "replay",
           "resolve_backend", "rows_view", "splits"]


@dataclass(frozen=True)
class Split:
    """`--split K`: what one micro-batch of a recorded full batch must carry."""

    parent: int  # its index in the dump
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
    views: dict[int, RowsView] = field(default_factory=dict)  # index -> row view, in the run's order (for --html)
    problems: list = field(default_factory=list)  # problems.Problem: the findings grouped by root cause
    capped: int | None = None  # the size cap (bytes) the recording stopped at (dcptool.capped); None: it did not
    gpu_failed: str | None = None  # what failed on the GPU that `auto` replayed on the CPU instead; None: nothing
    bounded: MemoryPlan | None = None  # the dump read in bounded memory, and why (dump.open_dumps); None: in memory

    @property
    def errors(self) -> int:
        return self.findings.count_errors()[0]

    @property
    def warnings(self) -> int:
        return self.findings.count_errors()[1]

    def by_rule(self) -> dict[str, int]:
        return self.findings.by_rule()

    def by_site(self) -> dict[str, dict[str, int]]:
        return self.findings.by_site()

    def summary_json(self) -> dict:
        return {"type": "summary", "files": self.files, "observations": self.observations,
                "findings": len(self.findings), "errors": self.errors, "warnings": self.warnings,
                "by_rule": self.by_rule(), "by_site": self.by_site(),
                "first": self.findings[0].to_json() if self.findings else None, "skipped": self.skipped,
                "backend": self.backend, "device": self.device, "seconds": round(self.seconds, 4),
                **({} if self.capped is None else {"capped": self.capped}),
                **({} if self.gpu_failed is None else {"gpu_failed": self.gpu_failed}),
                **({} if self.bounded is None else {"memory": {
                    "read": "bounded", "dump_bytes": self.bounded.dump_bytes, "available_bytes": self.bounded.available,
                    "forced": self.bounded.forced}})}


def replay(d: Dump, backend: str = "auto", *, split: int | None = None, obs: int | None = None,
           views: int = 0, bounded: bool = False, progress=None, engine_version: str | None = None) -> ReplayResult:
    """Check every observation of a dump; findings in the run's order (Dump.order_of), then the rule table's order.

    The checks are those of the rule table (dcp.rules) that apply to the dump (check.plan). `views` > 0 adds
    row views of the first `views` observations with findings and of the sources of their stale findings (the
    HTML report's row views). The row checks are one chunked scan (scan.py); everything else is per finding, or
    vectorised over observations. `bounded` drops each chunk's pages after use (huge dumps); `progress(k)` is
    called as k more observations are scanned. Micro-batches are split by the rule of `engine_version`
    (default: the one the dump names; slicing.engine_split). With `auto`, a GPU that fails before its scan
    reported anything (gpu.cuda.CudaStartError) leaves the scan to the CPU: `gpu_failed` says what failed.
    """
    t0 = time.perf_counter()
    c = d.config
    version = engine_version if engine_version is not None else c.engine_version
    if split is not None:
        check_split(d, split)  # before the scan: an absurd K is bad usage, not an hour of work
    where = _where(backend, d.n)
    p = plan(d)
    bar = Phases(progress)
    w_checks = W_CHECKS + W_SLICES * p.runs("ubatch-slice") + W_ALIAS * p.runs("alias")
    bar.plan(scan=d.n, checks=round(w_checks * d.n), provenance=0, findings=0)
    later = runner(bounded or d.bounded or d.n == 0)
    try:
        parts, grid = _checks(d, p, where, version, bounded, progress, bar, later)
    except Exception:
        if isinstance(later, Threads):  # no check may still read the dump's memory while the error ends the process
            later.settle()
        d.finish()  # a streamed dump's DumpError first: what a check raised on rows not yet validated is not the cause
        raise
    d.finish()  # (a streamed dump: the file validated whole before anything is reported)
    res = ReplayResult(files=d.files, config=c, observations=d.n, findings=FindingTable.concat(d, parts),
                       backend=where.backend, device=where.device, seconds=0.0, skipped=p.skipped, grid=grid,
                       capped=next((x for x in d.capped if x is not None), None), gpu_failed=where.gpu_failed,
                       bounded=(d.memory or MemoryPlan(True, sum(d.sizes), None)) if d.bounded else None)
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


@dataclass
class Where:
    """Where the scan runs: resolve_backend's backend and device, and why `--backend auto` replays on the CPU
    after all (`gpu_failed`: what failed on the GPU; None: nothing did)."""

    backend: str
    device: str
    auto: bool
    gpu_failed: str | None = None

    def instead(self, e: CudaError) -> None:
        """The GPU failed before the scan reported anything: `auto` takes the CPU, a GPU asked for by name fails."""
        if not self.auto:
            raise e
        self.backend, self.device, self.gpu_failed = "torch", "cpu", e.what


def _where(name: str, observations: int) -> Where:
    try:
        return Where(*resolve_backend(name, observations), auto=name == "auto")
    except CudaError as e:  # (a GPU there that cannot be used: a broken install, a driver that fails to start)
        where = Where("torch", "cpu", auto=name == "auto")
        where.instead(e)
        return where


class _Prev:
    """The scan's view of rank_pairs' future: its `prev` column."""

    def __init__(self, f):
        self.f = f

    def result(self) -> np.ndarray:
        return self.f.result().prev


def _checks(d: Dump, p: Plan, where: Where, version, bounded: bool, progress, bar, later) -> tuple[list, ObsGrid]:
    """The findings of every check of plan `p` (in table order) and the timeline grid. The checks that need only
    the dump start first and run beside the scan (later(f, *args): f on another thread, or when asked for); those
    that need its answer start when it ends; the values check (with provenance) runs on this thread meanwhile."""
    from dcptool.check.scan import scan

    found: dict[str, object] = {}
    # rank-agree's row comparison rides on the scan's read of the rows: the pairs are computed while the scan sets
    # up, and its first chunk waits for them
    pairs = later(rank_pairs, d) if p.runs("rank-agree") else None
    for check, rules in p.run.items():
        if set(rules[0].inputs) <= {VERSION}:
            found[check] = later(run_check, d, rules[0], {VERSION: version})
    grid = later(obs_grid, d)
    prov = Provenance(d)
    by_value = RULE["mismatch"].check if p.runs("mismatch") else None  # the values check, explained by provenance
    lead = None
    if by_value and where.backend == "triton" and later is not Later:  # the host waits while the device scans:
        lead = later(prov.lead)  # provenance's per-observation keys now (not on one thread: a clean dump would pay)
    bar.phase("scan")
    scan_pairs = None if pairs is None else _Prev(pairs)
    try:
        st = scan(d, where.backend, bounded=bounded, progress=progress, pairs=scan_pairs)
    except CudaStartError as e:
        where.instead(e)
        st = scan(d, where.backend, bounded=bounded, progress=progress, pairs=scan_pairs)
    wrong = st.obs[st.n_wrong > 0]
    bar.plan(provenance=round(W_PROVENANCE * d.n + W_WRONG * wrong.size) if wrong.size else 0,
             findings=round(W_FINDING * st.obs.size))
    inputs = {VERSION: version, SCAN: st, WRONG: wrong, PAIRS: pairs, DIFFER: st.differ, PROVENANCE: prov}
    for check, rules in p.run.items():  # the checks that need the scan but not provenance: beside provenance
        if check not in found and check != by_value:
            found[check] = later(run_check, d, rules[0], inputs)
    if by_value:
        bar.phase("provenance")
        if lead is not None:
            lead.result()  # (kept in prov)
        if wrong.size:  # every wrong view's sources are searched at once (a clean dump pays nothing)
            prov.prepare(wrong)
        found[by_value] = run_check(d, p.first(by_value), inputs)
    bar.phase("checks")
    parts = [value(found[check]) for check in p.run]
    grid = grid.result()
    bar.phase("findings")
    return parts, grid


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
    cost more than it saves), without asking for a GPU. The GPU is asked of the CUDA driver (gpu.cuda.available:
    its bindings, no context started), not torch (seconds to import): neither backend's replay imports torch
    outside the interpreter."""
    from dcptool.check.scan import GPU_MIN_OBS
    from dcptool.gpu import cuda

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
    idx = _splittable(d)
    for i in idx[np.argsort(d.order_of(idx), kind="stable")]:  # (in the run's order)
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
    keys = np.array(list(out), np.int64)
    return {int(i): out[int(i)] for i in keys[np.argsort(d.order_of(keys), kind="stable")]}
