"""simulate: a seeded serving workload through a model of vLLM's runner (runner.py), recorded with or without
pre-fix faults; compare runs both pipelines side by side with what replay finds in each."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dcptool.dump import WriteError, write_target
from dcptool.engine.record import Recorder
from dcptool.model.runner import (  # noqa: F401 - SimConfig, SimError, FAULTS, FAULT_WHERE, applicability and capture_sizes are simulate's API
    FAULT_WHERE,
    FAULTS,
    KV_GROUPS,
    SITES,
    Runner,
    SimConfig,
    SimError,
    applicability,
    capture_sizes,
)


@dataclass
class FaultReport:
    """One injected fault: whether it applies, and the observations it touched (per file)."""

    name: str
    rule: str
    what: str
    applicable: bool
    why: str | None
    touched: dict[str, list[int]] = field(default_factory=dict)
    where: str = ""  # FAULT_WHERE: the vLLM releases that had it
    # Stale faults only: touched observations whose rows that exist are right (local lengths are
    # many-to-one, or the copied slice is empty) while the length is not; replay can only say `shape` there.
    shape_only: dict[str, list[int]] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.touched.values())

    def to_json(self) -> dict:
        return {"fault": self.name, "rule": self.rule, "where": self.where, "applicable": self.applicable,
                "why": self.why, "touched": self.count, "observations": self.touched,
                "shape_only": {k: v for k, v in self.shape_only.items() if v}}


@dataclass
class SimResult:
    config: SimConfig
    files: list[str]
    observations: int
    by_site: dict[str, int]
    faults: dict[str, FaultReport]
    seconds: float

    def injected(self, file: str) -> dict[str, list[int]]:
        """What `dcptool.injected` holds in `file`: applicable faults -> touched indices there."""
        return {f.name: f.touched.get(file, []) for f in self.faults.values() if f.applicable}

    def to_json(self) -> dict:
        c = self.config
        return {"type": "simulate", "command": c.command(), "pipeline": c.pipeline, "faults_injected": list(c.faults),
                "files": self.files, "observations": self.observations, "by_site": self.by_site,
                "faults": [f.to_json() for f in self.faults.values()], "seconds": round(self.seconds, 4)}



# --------------------------------------------------------------------------------------------
# The workload: Poisson arrivals, skewed lengths, chunked prefill under a token budget, spec decode


@dataclass
class Batch:
    """One scheduled step in batch order (decodes first, then prefills by query length)."""

    query_lens: np.ndarray
    num_computed: np.ndarray
    is_prefilling: np.ndarray
    slots: np.ndarray  # request slot of each row

    @property
    def num_reqs(self) -> int:
        return int(self.query_lens.size)

    @property
    def seq_lens(self) -> np.ndarray:
        return self.num_computed + self.query_lens


class Workload:
    """Requests arrive, prefill in chunks under the token budget, decode with K draft tokens each step
    (accepted drafts advance seq_lens by accepted + 1), and leave when their output is done."""

    def __init__(self, cfg: SimConfig, rng: np.random.Generator):
        self.cfg, self.rng = cfg, rng
        cap = cfg.max_num_reqs
        self.prompt = np.zeros(cap, np.int64)
        self.output = np.zeros(cap, np.int64)
        self.computed = np.zeros(cap, np.int64)
        self.generated = np.zeros(cap, np.int64)
        self.active = np.zeros(cap, bool)
        self.arrived = np.zeros(cap, np.int64)  # arrival order, for FCFS prefill
        self.waiting: list[tuple[int, int]] = []
        self.count = 0
        # Start in steady state: half the slots already decoding.
        for _ in range(cap // 2):
            p, o = self._lengths()
            s = self._admit(p, o)
            self.generated[s] = int(rng.integers(1, max(2, o)))
            self.computed[s] = p + self.generated[s] - 1

    def _lengths(self) -> tuple[int, int]:
        c, rng = self.cfg, self.rng
        p = int(np.clip(rng.lognormal(np.log(1024), 1.0), 8, min(16384, c.max_model_len // 2)))
        o = int(np.clip(rng.lognormal(np.log(256), 0.9), 4, min(4096, c.max_model_len - p - c.decode_query_len)))
        return p, max(o, 1)

    def _admit(self, prompt: int, output: int) -> int:
        s = int(np.flatnonzero(~self.active)[0])
        self.prompt[s], self.output[s], self.computed[s], self.generated[s] = prompt, output, 0, 0
        self.active[s] = True
        self.arrived[s] = self.count
        self.count += 1
        return s

    def schedule(self) -> Batch:
        c = self.cfg
        for _ in range(int(self.rng.poisson(c.arrival_rate))):
            self.waiting.append(self._lengths())
        budget = c.token_budget
        dec = np.flatnonzero(self.active & (self.computed >= self.prompt))
        dec = dec[: budget // c.decode_query_len]
        budget -= dec.size * c.decode_query_len
        pre = np.flatnonzero(self.active & (self.computed < self.prompt))
        pre = pre[np.argsort(self.arrived[pre], kind="stable")]
        chunks = []
        for s in pre:
            if budget == 0:
                break
            n = int(min(self.prompt[s] - self.computed[s], budget))
            chunks.append((int(s), n))
            budget -= n
        while budget > 0 and self.waiting and self.active.sum() < c.max_num_reqs:
            s = self._admit(*self.waiting.pop(0))
            n = int(min(self.prompt[s], budget))
            chunks.append((s, n))
            budget -= n
        slots = np.concatenate([dec, np.array([s for s, _ in chunks], np.int64)]).astype(np.int64)
        q = np.concatenate([np.full(dec.size, c.decode_query_len, np.int64),
                            np.array([n for _, n in chunks], np.int64)])
        # vLLM's sort_batch_req_ids: decodes with drafts first, then by query length.
        order = np.lexsort((q, q != c.decode_query_len, np.arange(q.size) >= dec.size))
        slots, q = slots[order], q[order]
        return Batch(query_lens=q, num_computed=self.computed[slots].copy(),
                     is_prefilling=self.computed[slots] < self.prompt[slots], slots=slots)

    def advance(self, b: Batch) -> np.ndarray:
        """Apply one step's results; returns num_computed after it, per row (what the drafter starts from)."""
        c = self.cfg
        s = b.slots
        dec = ~b.is_prefilling
        k = c.spec_tokens
        # accepted = leading run of accepted drafts (each with probability accept_rate)
        accepted = (self.rng.random((s.size, max(k, 1))) < c.accept_rate)[:, :k].cumprod(axis=1).sum(axis=1)
        step = np.where(dec, accepted + 1, b.query_lens)
        self.computed[s] += step
        done_prefill = b.is_prefilling & (self.computed[s] >= self.prompt[s])
        self.generated[s] += np.where(dec, accepted + 1, done_prefill.astype(np.int64))
        after = self.computed[s].copy()
        fin = (self.generated[s] >= self.output[s]) | (self.computed[s] + c.decode_query_len >= c.max_model_len)
        self.active[s[fin]] = False
        return after


# --------------------------------------------------------------------------------------------
# Recording sinks: one Recorder for all ranks, or one per rank (--per-rank)


class _Sink:
    def __init__(self, cfg: SimConfig, out: Path, per_rank: bool, force: bool = False):
        P, N = cfg.pcp, cfg.dcp
        version = cfg.engine_version or f"vLLM model runner V2 model ({cfg.pipeline} pipeline)"
        kw = dict(dcp_size=N, cp_interleave=cfg.interleave, sites=SITES, pcp_size=P, page_size=cfg.page_size,
                  engine="dcptool simulate", engine_version=version, note=cfg.command(),
                  # (slot mappings are recorded without PCP only: runner.Runner._slots)
                  kv_groups=[{"name": n, "dcp": dcp, "block_size": cfg.page_size} for n, dcp in KV_GROUPS]
                  if P == 1 else None)
        if per_rank:
            names = [f".pcp{p}.rank{r}" if P > 1 else f".rank{r}" for p in range(P) for r in range(N)]
            self.paths = [out.with_name(f"{out.stem}{n}{out.suffix or '.safetensors'}") for n in names]
            self.file_of = list(range(P * N))
        else:
            self.paths = [out]
            self.file_of = [0] * (P * N)
        for p in self.paths:  # before hours of work: only regular files are replaced (no /dev/null, FIFO...)
            write_target(p)
        if not force:  # (the Recorder refuses too; this says it in the CLI's words)
            clash = [str(p) for p in self.paths if os.path.lexists(p)]
            if clash:
                raise FileExistsError(f"{clash[0]}: exists (use --force to overwrite)")
        self.recorders = [Recorder(p, force=force, **kw) for p in self.paths]
        self.shared = not per_rank
        self.touched: list[dict[str, list[int]]] = [{} for _ in self.recorders]
        self.by_site: dict[str, int] = {}

    def mark(self, proc: int, idx: int, fault: str) -> None:
        """fault, or "fault:shape" where a stale fault left the rows that exist right but the length wrong."""
        self.touched[self.file_of[proc]].setdefault(fault, []).append(idx)


def simulate(cfg: SimConfig, out: str | Path, *, per_rank: bool = False, force: bool = False,
             progress=None) -> SimResult:
    """Run the workload through the runner model and write the dump(s) atomically; `progress(k)` is
    told as k more steps are done."""
    cfg.validate()
    t0 = time.perf_counter()
    out = Path(out)
    sink = _Sink(cfg, out, per_rank, force)
    try:
        return _run(cfg, sink, t0, progress)
    except BaseException as e:
        # Interrupted (Ctrl-C) or failed: a dump whose note says `--steps 5000` must not hold 2,407 of them.
        # Nothing reaches the final paths (the Recorders write nothing at exit either); files this run
        # already completed (--per-rank) go too, so no partial set is left.
        for rec in sink.recorders:
            for f in rec.files:
                Path(f).unlink(missing_ok=True)
            rec.discard()
        if isinstance(e, WriteError):  # one line: the file and the problem, not the Recorder's retry advice
            failed = next((r for r in sink.recorders if r.last_error), None)
            raise WriteError(failed.last_error if failed is not None else str(e)) from None
        raise


def _run(cfg: SimConfig, sink: _Sink, t0: float, progress) -> SimResult:
    rng = np.random.default_rng(cfg.seed)
    runner = Runner(cfg, sink)
    work = Workload(cfg, rng)
    runner.startup()
    dummies = 0
    for step in range(1, cfg.steps + 1):
        if progress:
            progress(1)
        if cfg.dummy_every and step % cfg.dummy_every == 0:
            runner.dummy_run(step, dummies, rng)
            dummies += 1
        b = work.schedule()
        if b.num_reqs == 0:
            continue
        desc = runner.real_step(step, b)
        after = work.advance(b)
        if cfg.spec_tokens > 1:
            runner.drafts(step, desc, after)
    why = applicability(cfg)
    files = [str(p) for p in sink.paths]
    reports = {f: FaultReport(f, FAULTS[f][0], FAULTS[f][1], why[f] is None, why[f], where=FAULT_WHERE[f])
               for f in cfg.faults}
    for i, rec in enumerate(sink.recorders):
        got = sink.touched[i]
        for f, rep in reports.items():
            shape = sorted(got.get(f + ":shape", []))
            rep.touched[files[i]] = sorted(got.get(f, []) + shape)
            rep.shape_only[files[i]] = shape
        rec.injected = {f: rep.touched[files[i]] for f, rep in reports.items() if rep.applicable}
    for rec in sink.recorders:
        rec.close()
    by_site = {s: sink.by_site[s] for s in SITES if s in sink.by_site}
    return SimResult(cfg, files, sum(by_site.values()), by_site, reports, time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------
# Without -o: both pipelines side by side, with what replay finds in each


@dataclass
class SiteRow:
    site: str
    observations: int
    fixed: dict[str, int]  # rule -> findings at this site, fixed pipeline
    other: dict[str, int]  # same, legacy pipeline (or the injected faults)


@dataclass
class FaultRow:
    """An injected fault: where it touched, and what replay reported at those observations."""

    name: str
    rule: str
    applicable: bool
    why: str | None
    touched: int
    found: int  # touched observations where replay reported the fault's rule (`shape` where shape-only)
    sites: dict[str, int]  # site -> touched observations
    side: dict[str, int]  # rule -> touched observations where replay also reported it and no fault explains it
    shape_only: int = 0  # stale faults: touched observations whose rows are right, so `shape` is the finding
    where: str = ""  # FAULT_WHERE: the vLLM releases that had it

    def to_json(self) -> dict:
        return {"type": "fault", "fault": self.name, "rule": self.rule, "where": self.where,
                "applicable": self.applicable,
                "why": self.why, "touched": self.touched, "found": self.found, "shape_only": self.shape_only,
                "sites": self.sites, "side_findings": self.side}


@dataclass
class Comparison:
    config: SimConfig  # the other (legacy / injected) configuration
    label: str
    sites: list[SiteRow]
    faults: list[FaultRow]
    fixed: object  # ReplayResult of the fixed pipeline
    other: object  # ReplayResult of the other one
    seconds: float

    def summary_json(self) -> dict:
        return {"type": "summary", "command": self.config.command(), "label": self.label,
                "observations": self.fixed.observations, "fixed": {"findings": len(self.fixed.findings),
                                                                    "by_rule": self.fixed.by_rule()},
                "other": {"findings": len(self.other.findings), "by_rule": self.other.by_rule()},
                "backend": self.other.backend, "device": self.other.device, "seconds": round(self.seconds, 4)}


def compare(cfg: SimConfig, backend: str = "auto", progress=None) -> Comparison:
    """Simulate the fixed pipeline and `cfg`'s faults (all of them for legacy) on the same workload,
    replay both, and line up per site what each path recorded and what replay found."""
    import tempfile

    from dcptool.check.replay import replay
    from dcptool.dump import open_dumps

    cfg.validate()
    t0 = time.perf_counter()
    if not cfg.faults:
        cfg = SimConfig(**{**cfg.__dict__, "pipeline": "legacy"})
    fixed_cfg = SimConfig(**{**cfg.__dict__, "pipeline": "fixed", "inject": ()})
    with tempfile.TemporaryDirectory(prefix="dcptool-simulate-") as tmp:
        runs = []
        for name, c in (("fixed", fixed_cfg), ("other", cfg)):
            res = simulate(c, Path(tmp) / f"{name}.safetensors", progress=progress)
            d = open_dumps(res.files)
            runs.append((res, d, replay(d, backend)))
    (fres, fd, frep), (ores, od, orep) = runs
    sites = []
    names = [fd.config.sites[i] for i in np.unique(fd["obs.site"])]
    for s in sorted(names, key=SITES.index):
        sites.append(SiteRow(s, fres.by_site.get(s, 0), frep.by_site().get(s, {}), orep.by_site().get(s, {})))
    at: dict[int, set[str]] = {}
    for f in orep.findings:
        at.setdefault(f.index, set()).add(f.rule)
    # the rules the faults touching an observation explain there; anything else there is a side finding
    explained: dict[int, set[str]] = {}
    for rep in ores.faults.values():
        shape_only = {i for v in rep.shape_only.values() for i in v}
        for v in rep.touched.values():
            for i in v:
                explained.setdefault(i, set()).add("shape" if i in shape_only else rep.rule)
    site_of = od["obs.site"]
    rows = []
    for name, rep in ores.faults.items():
        idx = [i for v in rep.touched.values() for i in v]
        shape_only = {i for v in rep.shape_only.values() for i in v}
        side: dict[str, int] = {}
        per_site: dict[str, int] = {}
        found = 0
        for i in idx:
            for r in at.get(i, set()) - explained[i] - {"rank-sum"}:  # rank-sum belongs to a group of ranks
                side[r] = side.get(r, 0) + 1
            found += ("shape" if i in shape_only else rep.rule) in at.get(i, ())
            s = od.config.sites[int(site_of[i])]
            per_site[s] = per_site.get(s, 0) + 1
        rows.append(FaultRow(name, rep.rule, rep.applicable, rep.why, len(idx), found, per_site, side,
                             len(shape_only), FAULT_WHERE[name]))
    label = "legacy" if cfg.pipeline == "legacy" else "inject " + ",".join(cfg.faults)
    return Comparison(cfg, label, sites, rows, frep, orep, time.perf_counter() - t0)
