"""simulate: a seeded serving workload through a model of vLLM's runner (runner.py), recorded with or without
pre-fix faults; compare runs both pipelines side by side with what replay finds in each.

The configuration and the fault table are in config.py, the workload in workload.py, the recording sink in sink.py,
the streaming of a long run to its files in spool.py."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dcptool.dump import atomic_write, exists_error, write_target
from dcptool.model.config import (  # noqa: F401 - SimConfig, SimError, FAULTS, FAULT_WHERE, applicability are simulate's API
    FAULT_WHERE,
    FAULTS,
    PAIR_SITES,
    TRANSFER_FAULTS,
    SimConfig,
    SimError,
    applicability,
)
from dcptool.model.graphs import capture_sizes  # noqa: F401 - simulate's API
from dcptool.model.pair import Pair
from dcptool.model.runner import Runner
from dcptool.model.sink import Sink, output_paths  # noqa: F401 - output_paths is simulate's API
from dcptool.model.spool import Parts
from dcptool.model.workload import Workload


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


NOTICE_BYTES = 2 << 30  # a run expected to write more than this says so (stderr) before it does


def progress_units(cfg: SimConfig) -> int:
    """The units simulate(progress=) counts: one a step, then the writing of the files (an eighth of the steps)."""
    return cfg.steps + _write_units(cfg)


def _write_units(cfg: SimConfig) -> int:
    return max(1, cfg.steps // 8)


def simulate(cfg: SimConfig, out: str | Path, *, per_rank: bool = False, force: bool = False,
             progress: Callable[[int], None] | None = None, notice: Callable[[str], None] | None = None) -> SimResult:
    """Run the workload through the runner model and write the dump(s) atomically, streamed (spool.py: memory holds a
    part of the run, not all of it). `progress(k)`: k more of progress_units(cfg) done; `notice(line)`: the expected
    size, once, before a run writes more than NOTICE_BYTES. Refuses (OutputExistsError) an existing output without
    `force`, before any work."""
    cfg.validate()
    t0 = time.perf_counter()
    out = Path(out)
    paths = output_paths(cfg, out, per_rank)
    for p in paths:  # before hours of work: only regular files are replaced (no /dev/null, FIFO...)
        write_target(p)
    clash = [p for p in paths if os.path.lexists(p)]
    if clash and not force:
        raise exists_error(clash[0])
    parts = Parts(paths)
    sink = None
    written: list[Path] = []
    try:
        sink = Sink(cfg, parts.next(), per_rank)
        return _run(cfg, sink, parts, paths, Run(force, progress, notice, written, t0))
    except BaseException:
        # Interrupted (Ctrl-C) or failed: a dump whose note says `--steps 5000` must not hold 2,407 of them.
        # Nothing reaches the final paths but whole dumps (atomic writes), and those this run already wrote
        # (--per-rank) go too, so no partial set is left.
        for f in written:
            f.unlink(missing_ok=True)
        for rec in [] if sink is None else sink.recorders:
            rec.discard()
        raise
    finally:
        parts.close()


@dataclass
class Run:
    """What a run reports to and writes with, passed down whole."""

    force: bool
    progress: Callable[[int], None] | None
    notice: Callable[[str], None] | None
    written: list[Path]  # the dumps written so far (removed again if the run fails)
    t0: float
    noticed: bool = False
    last: tuple[int, int] | None = None  # (step, bytes) when the last part was written


def _run(cfg: SimConfig, sink: Sink, parts: Parts, paths: list[Path], run: Run) -> SimResult:
    rng = np.random.default_rng(cfg.seed)
    runner = Runner(cfg, sink)
    work = Workload(cfg, rng)
    pair = None if cfg.kv_connector == "none" else Pair(cfg, runner.F & frozenset(TRANSFER_FAULTS), sink)
    runner.startup()
    dummies = 0
    touched: list[dict[str, list[np.ndarray]]] = [{} for _ in paths]  # per file: fault -> indices, a part at a time
    for step in range(1, cfg.steps + 1):
        if run.progress:
            run.progress(1)
        if cfg.dummy_every and step % cfg.dummy_every == 0:
            runner.dummy_run(step, dummies, rng)
            dummies += 1
        arrived = work.count
        b = work.schedule()
        if pair is not None:
            pair.step(step, work, arrived, None)
        if b.num_reqs > 0:
            active = work.active.copy() if pair is not None else None
            desc = runner.real_step(step, b)
            after = work.advance(b)
            if pair is not None:
                pair.step(step, work, None, active)
            if cfg.spec_tokens > 1:
                runner.drafts(step, desc, after)
        if step < cfg.steps and max(len(r) for r in sink.recorders) >= parts.part_obs:  # a step boundary
            _part(sink, parts, touched, parts.next())
            _expect(cfg, parts, step, paths, run)
    _part(sink, parts, touched, None)
    why = applicability(cfg)
    files = [str(p) for p in paths]
    reports = {f: FaultReport(f, FAULTS[f][0], FAULTS[f][1], why[f] is None, why[f], where=FAULT_WHERE[f])
               for f in cfg.faults}
    for i, got in enumerate(touched):
        for f, rep in reports.items():
            shape = np.concatenate(got.get(f + ":shape", [np.zeros(0, np.int64)]))
            rep.touched[files[i]] = np.sort(np.concatenate([*got.get(f, []), shape])).tolist()
            rep.shape_only[files[i]] = np.sort(shape).tolist()
    units, left = _write_units(cfg), [0]
    total = max(1, parts.bytes)

    def done(nbytes: int) -> None:  # the write's share of progress_units, as its bytes are copied
        left[0] += nbytes * units
        if run.progress and left[0] >= total:
            run.progress(left[0] // total)
            left[0] %= total

    for i, (path, col) in enumerate(zip(paths, parts.columns)):
        injected = {f: rep.touched[files[i]] for f, rep in reports.items() if rep.applicable}
        atomic_write(path, col.chunks(injected, path, done), force=run.force)
        run.written.append(path)
    by_site = {s: sink.by_site[s] for s in PAIR_SITES if s in sink.by_site}
    return SimResult(cfg, files, sum(by_site.values()), by_site, reports, time.perf_counter() - run.t0)


def _part(sink: Sink, parts: Parts, touched: list[dict[str, list[np.ndarray]]], after: list[Path] | None) -> None:
    """The part recorded so far handed over to be written and appended to the dumps' columns (spool.Parts); recording
    goes on at `after`'s paths, or (None: the last part) waits until it is appended."""
    before = parts.hand_over(sink.recorders)
    for i, got in enumerate(sink.touched):  # part indices -> indices in the whole file
        for f, idx in got.items():
            touched[i].setdefault(f, []).append(np.asarray(idx, np.int64) + before[i])
    if after is not None:
        sink.reopen(after)
    else:
        parts.wait()


def _expect(cfg: SimConfig, parts: Parts, step: int, paths: list[Path], run: Run) -> None:
    """Say, once, what the run will write when that is more than NOTICE_BYTES (and how much room there is): what it
    wrote, and the steps left at the bytes a step took in the last part (the first holds the start-up's captures,
    which do not recur; the batches grow as requests arrive, so the latest rate is the closest)."""
    last, run.last = run.last, (step, parts.bytes)
    if run.notice is None or run.noticed or last is None:
        return
    expect = parts.bytes + (parts.bytes - last[1]) / (step - last[0]) * (cfg.steps - step)
    if expect < NOTICE_BYTES:
        return
    run.noticed = True
    where = paths[0].parent if str(paths[0].parent) else Path(".")
    free = shutil.disk_usage(where).free
    room = f"; {where} has {_size(free)} free" + (": not enough" if free < 2 * expect else "")
    run.notice(f"{cfg.steps:,} steps will write about {_size(expect)} to {', '.join(map(str, paths))} (twice that "
               f"while it is written){room}")


def _size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


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
    for s in sorted(names, key=PAIR_SITES.index):
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
