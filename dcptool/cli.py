"""Command line: parse, call the library, render; exit 0 clean, 1 findings, 2 bad usage/input or internal error.
(Over 450 lines: six commands' options, each a page of help text; the exit-code guard is dcptool.exits, what the
commands share on their command lines dcptool.inputs.)"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from typer.core import TyperCommand

from dcptool import exits
from dcptool.choices import Backend, CudaGraph, KVConnector, KVShards, Pipeline, SpecMethod, metavar, spoken, values
from dcptool.errors import DcptoolError, UsageError  # stdlib only: --help stays light
from dcptool.exits import Guarded, say
from dcptool.inputs import InputError, dump_paths, integer, number, output_target

app = typer.Typer(cls=Guarded, no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
                  rich_markup_mode=None,  # plain help pages, no box (usage errors: the guard's one line)
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="Replay and debug decode-context-parallel (DCP) metadata recorded from serving engines.")


def versions() -> list[str]:
    """What `dcptool --version` prints: dcptool's version, torch's and triton's (from their metadata: neither
    is imported) and the dump format versions this dcptool reads."""
    from dcptool import __version__
    from dcptool.dump.schema import FORMAT_VERSION

    return [f"dcptool {__version__}", f"torch {exits.installed('torch')}", f"triton {exits.installed('triton')}",
            f"reads dump format {FORMAT_VERSION}"]


def _version(show: bool) -> None:
    if show:
        try:
            sys.stdout.write("".join(f"{line}\n" for line in versions()))
            sys.stdout.flush()
        except BrokenPipeError:  # `| head -1` has what it wanted: still exit 0
            exits.drop_stdout()
        raise typer.Exit(0)


@app.callback()
def _options(
    debug: Annotated[bool, typer.Option("--debug", help="Show the traceback of an internal error (or set "
                                                        "DCPTOOL_DEBUG=1).")] = False,
    version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_version, expose_value=False,
                                          help="Show the versions of dcptool, torch and triton and the dump "
                                               "format it reads, and exit.")] = False,
) -> None:
    exits.debug(debug)


def _console() -> Console:
    from dcptool.report.text import ReportConsole

    return ReportConsole()


# --------------------------------------------------------------------------------------------
# What the commands share: the dumps they read, the files they write, the options they take alike

DUMPS_HELP = ("Dump files, directories of them, or quoted globs ('run/*.safetensors'), of one run (per-rank files, "
              "rolled files); a comma-separated list works too.")
MERGE_HELP = ("Read the files as one run even where they look like several (different engine versions, or a rank's "
              "steps recorded twice); without it such files are refused.")
FORCE_HELP = "Overwrite an existing output file."
MAX_FINDINGS = typer.Option("--max-findings", parser=integer(0), metavar="M",
                            help="Show at most M findings (the summary counts all). Text default 100, JSON all.")


def _inputs(specs: list[str], also: list[str] | None = None) -> list[str]:
    """The dump files the arguments name (dcptool.inputs.dump_paths); the out-of-memory line names them."""
    files = dump_paths(specs)
    exits.reading([*(also or []), *files])
    return files


BOUNDED_ENV = "DCPTOOL_BOUNDED"  # 1: read in bounded memory, 0: into memory, unset: as the memory available says


def _bounded() -> bool | None:
    """DCPTOOL_BOUNDED as open_dumps' `bounded` (for tests and benchmarks: the path without the memory it needs)."""
    v = os.environ.get(BOUNDED_ENV, "")
    if v not in ("", "0", "1"):
        raise InputError(f"{BOUNDED_ENV}={v!r}: expected 1 (bounded memory), 0 (in memory) or unset (as the memory "
                         "available says)")
    return None if v == "" else v == "1"


def _open(files: list[str], merge: bool, stream: bool = False):
    """The files read as one run (dump.open_dumps), refused when they look like several runs unless --merge."""
    from dcptool.dump import open_dumps
    from dcptool.dump.runs import several_runs

    d = open_dumps(files, bounded=_bounded(), stream=stream)
    try:
        why = None if merge else several_runs(d)
    except BaseException:
        d.close()  # (no thread of a streamed read outlives the command)
        raise
    if why is not None:
        d.close()
        raise InputError(f"{why}; read one run at a time (`dcptool diff A B` compares two), or pass --merge to read "
                         "them as one")
    return d


def _obs_index(d, spec: str) -> int:
    """`--obs FILE:I` (as every report names an observation; `I` alone for one file): its position in the dump."""
    from dcptool.dump import match_file, obs_ref, parse_ref

    try:
        file, k = parse_ref(spec)
    except ValueError:
        raise UsageError("--obs", f"{spec!r}: expected FILE:I, an observation as the reports name it (I alone for "
                                  "one file)") from None
    if file is None and len(d.files) > 1:
        raise UsageError("--obs", f"{spec}: {len(d.files)} files are read; name the file, e.g. "
                                  f"{obs_ref(d.files[0], k)}")
    fi = 0 if file is None else match_file(d.files, file)
    if fi is None:
        raise UsageError("--obs", f"{spec}: {file} is not one of the dumps read")
    i = d.index_of(fi, k)
    if i is None:
        n = int((d.file_index == fi).sum())
        raise UsageError("--obs", f"{spec}: {d.files[fi]} has no observation {k} "
                                  f"({f'it has {n}: 0..{n - 1}' if n else 'it has none'})")
    from dcptool.check.replay import MAX_VIEW_CELLS, view_cells

    if view_cells(d, i) > MAX_VIEW_CELLS:
        raise UsageError("--obs", f"{spec}: {int(d['obs.num_reqs_padded'][i])} padded rows and dcp_size "
                                  f"{d.config.dcp_size}: too large to show row by row ({view_cells(d, i):,} cells > "
                                  f"{MAX_VIEW_CELLS:,}); use replay --json")
    return i


def _write_html(path: Path, html: str, force: bool, inputs) -> None:
    from dcptool.dump import DumpError, atomic_write

    try:  # WriteError names the file and the problem (disk full, ...), and the old file is unchanged
        atomic_write(path, [html.encode("utf-8")], force=force, inputs=inputs)
    except DumpError as e:
        raise UsageError("--html", str(e)) from None
    say(f"wrote {path}")


def _engine_version(command: str, v: str | None) -> None:
    """--engine-version: refused unless it names a version; a release dcptool has no model of is said on stderr."""
    from dcptool.dcp.slicing import parse_engine_version, unmodelled

    if not v:
        return
    if parse_engine_version(v) is None:
        raise UsageError("--engine-version", f"{v!r}: expected a vLLM version such as 0.34.0")
    why = unmodelled(v)
    if why is not None:
        say(f"warning: --engine-version {v}: {why}", command)


def _backend(name: str) -> None:
    """--backend: one of the choices; triton without a GPU (its interpreter, ~100x slower than torch) only when
    TRITON_INTERPRET=1 asks for the interpreter."""
    if name not in values(Backend):
        raise UsageError("--backend", f"{name!r}: choose {spoken(Backend)}")
    if name == "triton" and os.environ.get("TRITON_INTERPRET", "") in ("", "0"):
        from dcptool.gpu import cuda

        if not cuda.available():
            raise UsageError("--backend", "triton: no GPU here, and Triton's interpreter on the CPU is about 100x "
                                          "slower than torch; use --backend torch (or auto, which picks it), or set "
                                          "TRITON_INTERPRET=1 to run the interpreter anyway")


def _render(whole, screen, full: bool, res, max_findings: int | None) -> None:
    """Render the whole report, or on a terminal without --full one screen of it."""
    console = _console()
    (whole if full or not console.is_terminal else screen)(res, console, max_findings)


FULL_HELP = ("The whole report on a terminal too: every finding (up to --max-findings), the by-site table, the "
             "problems and the timeline uncut. Without it a terminal gets one screen, the summary and the first "
             "problem last; a pipe or a file always gets the whole report.")


class _RuleHelp(TyperCommand):
    """replay: its help ends with the rule table (dcptool.dcp.rules: name, severity, what it catches), read when
    the help is shown."""

    def format_epilog(self, ctx, formatter) -> None:
        from dcptool.dcp import rules

        with formatter.section("Rules (docs/replay.md#the-rules)"):
            formatter.write_dl([(r.name, f"{r.severity}: {r.what}") for r in rules.TABLE])
        super().format_epilog(ctx, formatter)


@app.command(cls=_RuleHelp, short_help="Check every observation's DCP metadata; report what is wrong.")
def replay(
    dumps: Annotated[list[str], typer.Argument(metavar="DUMP", help=DUMPS_HELP)],
    full: Annotated[bool, typer.Option("--full", help=FULL_HELP)] = False,
    split: Annotated[int | None, typer.Option(
        "--split", parser=integer(1), metavar="K", help="Re-split every recorded full batch into K micro-batches and "
                                                        "show what each must carry.")] = None,
    backend: Annotated[str, typer.Option("--backend", metavar=metavar(Backend),
                                         help="auto (Triton on a GPU, torch on CPU), triton (a GPU) or torch.")]
    = "auto",
    obs: Annotated[str | None, typer.Option("--obs", metavar="FILE:I", help="Show one observation row by row: "
                                            "FILE:I as the reports name it (I alone for one file).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="JSON Lines: findings, then a summary.")] = False,
    max_findings: Annotated[int | None, MAX_FINDINGS] = None,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 1 on warnings too (e.g. `stray`).")] = False,
    html: Annotated[Path | None, typer.Option("--html", metavar="PATH", help="Also write a self-contained HTML "
                                              "report (summary, timeline, findings table, row views) to PATH.")]
    = None,
    force: Annotated[bool, typer.Option("--force", help="Let --html overwrite an existing file.")] = False,
    engine_version: Annotated[str | None, typer.Option(
        "--engine-version", help="Split micro-batches by this vLLM version's rule (e.g. 0.34.0), not the one the "
                                 "dump names.")] = None,
    merge: Annotated[bool, typer.Option("--merge", help=MERGE_HELP)] = False,
) -> None:
    """Recompute every observation's DCP metadata and report what was missing, stale or wrong."""
    _backend(backend)
    _engine_version("replay", engine_version)
    files = _inputs(dumps)
    if html is not None:
        output_target("--html", html, files, force)
    d = _open(files, merge, stream=True)  # (the scan follows the read; replay() ends it)
    if d.bounded:  # (said before the work: a replay in bounded memory takes longer)
        say(d.memory.reason(), "replay")
    try:
        i = _obs_index(d, obs) if obs is not None else None
    except DcptoolError:
        d.close()
        raise
    from dcptool.check.replay import replay as run_replay
    from dcptool.report.html import VIEW_FINDINGS
    from dcptool.report.progress import Progress

    with Progress(d.n, "replay", not json_out and sys.stderr.isatty()) as bar:  # phases: replay.Phases
        res = run_replay(d, backend, split=split, obs=i, views=0 if html is None else VIEW_FINDINGS,
                         progress=bar, bounded=d.bounded, engine_version=engine_version)
        if html is not None:  # first: a reader of stdout that stops early (`| head`) must not cost the file
            from dcptool.report.html import html_units, render_html

            bar.plan(report=html_units(res, max_findings))
            bar.phase("report")
            _write_html(html, render_html(res, max_findings), force, res.files)
    if res.gpu_failed is not None:  # (auto's GPU failed before its scan reported anything: the CPU replayed)
        say(f"warning: --backend auto: {res.gpu_failed}; replaying on the CPU instead", "replay")
    from dcptool.report import text as report

    code = 1 if res.errors or (strict and res.warnings) else 0
    exits.verdict(code)
    if json_out:
        for chunk in report.replay_json_text(res, max_findings):
            sys.stdout.write(chunk)
    else:
        from dcptool.report import screen

        _render(report.render_replay, screen.render_replay, full, res, max_findings)
    raise typer.Exit(code)


@app.command(short_help="Compare two runs, observation by observation.")
def diff(
    a: Annotated[str, typer.Argument(metavar="A", help="The first run: dump files, a directory, a quoted glob, or a "
                                                        "comma-separated list of these.")],
    b: Annotated[str, typer.Argument(metavar="B", help="The second run, given the same way.")],
    full: Annotated[bool, typer.Option("--full", help="The whole report on a terminal too: every difference (up to "
                                                      "--max-findings). A pipe or a file always gets it.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="JSON Lines: differences, then a summary.")] = False,
    max_findings: Annotated[int | None, typer.Option(
        "--max-findings", parser=integer(0), metavar="M", help="Show at most M differences (the summary counts "
                                                               "all). Text default 100, JSON all.")] = None,
    html: Annotated[Path | None, typer.Option("--html", metavar="PATH", help="Also write a self-contained HTML "
                                              "report (summary, differences table) to PATH.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Let --html overwrite an existing file.")] = False,
    merge: Annotated[bool, typer.Option("--merge", help=MERGE_HELP)] = False,
) -> None:
    """Align two runs by (step, site, rank, micro-batch, occurrence) and report every recorded difference."""
    from dcptool.diagnose.diff import diff as run_diff

    first = _inputs([a])
    second = _inputs([b], also=first)
    if html is not None:
        output_target("--html", html, first + second, force)
    da = _open(first, merge)
    db = _open(second, merge)
    from dcptool.report.differences import diff_json_lines, render_diff
    from dcptool.report.html import HTML_MAX_FINDINGS
    from dcptool.report.text import TEXT_MAX_FINDINGS

    # the differences kept: as many as the longest of the reports asked for shows (None: all)
    shown = [max_findings if max_findings is not None else None if json_out else TEXT_MAX_FINDINGS]
    if html is not None:
        shown.append(max_findings if max_findings is not None else HTML_MAX_FINDINGS)
    res = run_diff(da, db, None if None in shown else max(shown))
    if html is not None:
        from dcptool.report.html import render_diff_html

        _write_html(html, render_diff_html(res, max_findings), force, first + second)
    exits.verdict(0 if res.same else 1)
    if json_out:
        for line in diff_json_lines(res, max_findings):
            sys.stdout.write(line + "\n")
    else:
        from dcptool.report import screen

        _render(render_diff, screen.render_diff, full, res, max_findings)
    raise typer.Exit(0 if res.same else 1)


@app.command(short_help="Summarise a dump: config, steps, sites, ranks, sizes.")
def inspect(
    dump: Annotated[list[str], typer.Argument(metavar="DUMP", help=DUMPS_HELP)],
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False,
    merge: Annotated[bool, typer.Option("--merge", help=MERGE_HELP)] = False,
) -> None:
    """Summarise a dump: config, steps, sites, ranks, micro-batches, sizes, optional columns."""
    from dcptool.dump import describe
    from dcptool.report import text as report

    d = _open(_inputs(dump), merge, stream=True)  # replay's read: the same validation, the same errors
    d.finish()
    info = describe(d)
    if json_out:
        sys.stdout.write(report.inspect_json(info) + "\n")
    else:
        report.render_inspect(info, _console())


INJECT_HELP = "Faults to inject on the fixed pipeline, comma-separated, with the vLLM releases that had each: "


class _FaultHelp(TyperCommand):
    """simulate: its --inject help lists every fault of the fault table (dcptool.model.config), read only when the
    help is shown (the table imports numpy: `dcptool --help` stays light)."""

    def format_help(self, ctx, formatter) -> None:
        from dcptool.model.config import FAULT_WHERE, FAULTS

        inject = next(p for p in self.params if p.name == "inject")
        inject.help = INJECT_HELP + ", ".join(f"{f} [{FAULT_WHERE[f]}]" for f in FAULTS) + "."
        super().format_help(ctx, formatter)


def _int(flag: str, lo: int, help: str):
    return typer.Option(flag, parser=integer(lo), metavar="N", help=help)


@app.command(cls=_FaultHelp, short_help="Model vLLM's runner: what each fault looks like, or test dumps.")
def simulate(
    dcp: Annotated[int, _int("--dcp", 1, "DCP world size N (ranks recorded).")] = 2,
    interleave: Annotated[int, _int("--interleave", 1, "cp_kv_cache_interleave_size I.")] = 1,
    pcp: Annotated[int, _int("--pcp", 1, "PCP world size P (P x N recording processes).")] = 1,
    steps: Annotated[int, _int("--steps", 0, "Engine steps after start-up.")] = 32,
    spec_tokens: Annotated[int, _int("--spec-tokens", 0, "Draft tokens K per decode (0: no speculative "
                                                         "decoding).")] = 2,
    spec_method: Annotated[str, typer.Option("--spec-method", metavar=metavar(SpecMethod),
                                             help="mtp or dflash (DFlash captures its own graphs).")] = "mtp",
    ubatches: Annotated[int, _int("--ubatches", 1, "Micro-batches (DBO) when a batch passes vLLM's "
                                                   "thresholds.")] = 2,
    cudagraph: Annotated[str, typer.Option("--cudagraph", metavar=metavar(CudaGraph),
                                           help="none, piecewise, or full (FULL_AND_PIECEWISE).")] = "full",
    dummy_every: Annotated[int, _int("--dummy-every", 0, "A dummy run every D steps (0: only the profile "
                                                         "run).")] = 16,
    page_size: Annotated[int, _int("--page-size", 1, "KV page (block) size for attention page counts.")] = 16,
    pipeline: Annotated[str, typer.Option("--pipeline", metavar=metavar(Pipeline),
                                          help="fixed (vLLM after the fix) or legacy (every pre-fix fault).")]
    = "fixed",
    inject: Annotated[str | None, typer.Option("--inject", help=INJECT_HELP)] = None,  # + the table (_FaultHelp)
    features: Annotated[str | None, typer.Option("--features", metavar="FEATURE,...", help="What to model beyond "
                                                 "the default engine, comma-separated: chunked-context (MLA's "
                                                 "chunked prefill context), swa (a sliding-window KV-cache group), "
                                                 "sparse (sparse MLA's top-k). A fault that needs one models it.")]
    = None,
    seed: Annotated[int, _int("--seed", 0, "Workload seed (same seed, same dump, byte for byte).")] = 0,
    engine_version: Annotated[str, typer.Option("--engine-version", help="vLLM release to model (e.g. 0.34.0): "
                                                "its micro-batch split rule, recorded as engine_version.")] = "",
    max_num_reqs: Annotated[int, _int("--max-num-reqs", 1, "max_num_seqs: requests per step.")] = 64,
    token_budget: Annotated[int, _int("--token-budget", 1, "max_num_batched_tokens: tokens per step.")] = 2048,
    kv_connector: Annotated[str, typer.Option("--kv-connector", metavar=metavar(KVConnector),
                                              help="Record KV transfers: nixl or mooncake pull each arriving "
                                                   "request from a prefill instance, lmcache stores each finished "
                                                   "one (docs/simulate.md).")] = "none",
    prefill_dcp: Annotated[int, _int("--prefill-dcp", 0, "The prefill instance's DCP size (0: --dcp).")] = 0,
    prefill_pcp: Annotated[int, _int("--prefill-pcp", 1, "The prefill instance's PCP size.")] = 1,
    prefill_tp: Annotated[int, _int("--prefill-tp", 0, "The prefill instance's TP size (0: its DCP size).")] = 0,
    prefill_interleave: Annotated[int, _int("--prefill-interleave", 0, "The prefill instance's interleave (0: "
                                                                      "--interleave).")] = 0,
    prefill_block_size: Annotated[int, _int("--prefill-block-size", 0, "The prefill instance's block size (0: "
                                                                      "--page-size).")] = 0,
    prefill_kv_shards: Annotated[str, typer.Option("--prefill-kv-shards", metavar=metavar(KVShards),
                                                   help="dcp: its PCP ranks keep replicas of its DCP shards; cp: "
                                                        "they hold distinct shards (CP world pcp x dcp).")] = "dcp",
    output: Annotated[Path | None, typer.Option("-o", "--output", metavar="PATH", help="Write the dump here "
                                                "instead of printing the side-by-side table.")] = None,
    per_rank: Annotated[bool, typer.Option("--per-rank", help="With -o: one file per rank (OUT.rankR / "
                                                              "OUT.pcpP.rankR).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite existing output files.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="JSON: the table as JSON Lines, or with -o one "
                                                          "object describing what was written.")] = False,
) -> None:
    """Simulate a serving workload through a model of vLLM's runner; show or write its DCP metadata."""
    from dcptool.model.simulate import SimConfig, compare, output_paths, progress_units
    from dcptool.model.simulate import simulate as run_sim
    from dcptool.report import text as report
    from dcptool.report.progress import Progress

    faults = tuple(f.strip() for f in inject.split(",") if f.strip()) if inject else ()
    models = tuple(f.strip() for f in features.split(",") if f.strip()) if features else ()
    cfg = SimConfig(dcp=dcp, interleave=interleave, pcp=pcp, steps=steps, spec_tokens=spec_tokens,
                    spec_method=spec_method, ubatches=ubatches, cudagraph=cudagraph, dummy_every=dummy_every,
                    page_size=page_size, pipeline=pipeline, inject=faults, seed=seed, max_num_reqs=max_num_reqs,
                    token_budget=token_budget, engine_version=engine_version, features=models,
                    kv_connector=kv_connector, prefill_dcp=prefill_dcp, prefill_pcp=prefill_pcp,
                    prefill_tp=prefill_tp, prefill_interleave=prefill_interleave,
                    prefill_block_size=prefill_block_size, prefill_kv_shards=prefill_kv_shards)
    cfg.validate()
    _engine_version("simulate", engine_version)
    if per_rank and output is None:
        raise UsageError("--per-rank", "needs -o (it is a way of writing the dump)")
    if output is not None:
        for p in output_paths(cfg, output, per_rank):
            output_target("-o", p, (), force)
    bar = Progress(progress_units(cfg) * (1 if output else 2), "simulate", not json_out and sys.stderr.isatty(),
                   unit="steps")
    try:
        with bar:
            if output is None:
                cmp = compare(cfg, progress=bar)
            else:
                res = run_sim(cfg, output, per_rank=per_rank, force=force, progress=bar, notice=say)
    except FileExistsError as e:
        raise UsageError("-o", str(e)) from None
    except DcptoolError:
        raise
    except OSError as e:
        raise InputError(f"{output}: cannot write: {e.strerror or e}") from None
    if output is None:
        if json_out:
            for line in report.simulate_json_lines(cmp):
                sys.stdout.write(line + "\n")
        else:
            report.render_simulate(cmp, _console())
        return
    say(report.simulated_line(res))
    if json_out:
        sys.stdout.write(json.dumps(res.to_json()) + "\n")
    else:
        report.render_simulated(res, _console())


# --------------------------------------------------------------------------------------------
# Diagnosis: a minimal reproducer, and a regression test made from it


def _replayed_into(dump: list[str], output: Path, force: bool, merge: bool):
    """reduce's and export-test's start: -o checked before any work, the dumps read and replayed (torch): (the
    files, the dump, the replay)."""
    from dcptool.check.replay import replay as run_replay

    files = _inputs(dump)
    output_target("-o", output, files, force)
    d = _open(files, merge)
    return files, d, run_replay(d, "torch")


@contextmanager
def _output_error():
    """What writing -o met (it appeared since, the disk is full): `dcptool COMMAND: -o: what`."""
    from dcptool.dump import DumpError

    try:
        yield
    except DumpError as e:
        raise UsageError("-o", str(e)) from None


@app.command(short_help="Shrink a recording to the few observations of one problem.")
def reduce(
    dump: Annotated[list[str], typer.Argument(metavar="DUMP", help=DUMPS_HELP)],
    finding: Annotated[str, typer.Option("--finding", help="The problem to keep: RULE, RULE/RELATION (stale) or "
                                                           "RULE@FILE:I (that observation's finding, FILE:I as the "
                                                           "reports name it; RULE@I for one file).")],
    output: Annotated[Path, typer.Option("-o", "--output", metavar="PATH", help="Where to write the reduced "
                                                                                "recording.")],
    max_seconds: Annotated[float, typer.Option("--max-seconds", parser=number(0.1), metavar="S",
                                               help="Stop shrinking after this long and write the smallest so "
                                                    "far.")] = 60.0,
    force: Annotated[bool, typer.Option("--force", help=FORCE_HELP)] = False,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object describing the reduction.")] = False,
    merge: Annotated[bool, typer.Option("--merge", help=MERGE_HELP)] = False,
) -> None:
    """Shrink a recording to the fewest steps, observations and rows that still show one problem."""
    from dcptool.diagnose.reduce import find_target, reduce_dump, reduced_config
    from dcptool.dump import write_dump
    from dcptool.report import text as report
    from dcptool.report.progress import Progress

    files, d, res = _replayed_into(dump, output, force, merge)
    target = find_target(str(files[0]), res.findings, finding, d)
    with Progress(max(1, int(max_seconds)), "reduce", not json_out and sys.stderr.isatty(), unit="s") as bar:
        red = reduce_dump(d, target, {f.rule for f in res.findings}, max_seconds=max_seconds, progress=bar,
                          name=str(output))
    cols = red.dump.columns
    injected = red.dump.injected[0] if red.dump.injected else None
    with _output_error():
        write_dump(output, reduced_config(d, ", ".join(d.files), target), cols, injected, force=force,
                   inputs=d.files)
    say(f"wrote {output}")
    if json_out:
        sys.stdout.write(json.dumps({**red.to_json(), "output": str(output)}) + "\n")
    else:
        from dcptool.report import screen

        console = _console()
        (screen.render_reduction if console.is_terminal else report.render_reduction)(red, str(output), console)


@app.command("export-test", short_help="Write a pytest file from a recording's wrong observations.")
def export_test(
    dump: Annotated[list[str], typer.Argument(metavar="DUMP", help="A (reduced) recording with findings: " +
                                              DUMPS_HELP[0].lower() + DUMPS_HELP[1:])],
    output: Annotated[Path, typer.Option("-o", "--output", metavar="PATH", help="The pytest file to write.")],
    max_cases: Annotated[int, typer.Option("--max-cases", parser=integer(1), metavar="N",
                                           help="Embed at most this many observations with findings.")] = 8,
    force: Annotated[bool, typer.Option("--force", help=FORCE_HELP)] = False,
    merge: Annotated[bool, typer.Option("--merge", help=MERGE_HELP)] = False,
) -> None:
    """Write a pytest regression test embedding the recording's wrong observations as literal arrays."""
    from dcptool.diagnose.export import ExportError
    from dcptool.diagnose.export import export_test as build
    from dcptool.dump import atomic_write

    files, d, res = _replayed_into(dump, output, force, merge)
    try:
        text, cases = build(d, res.findings, max_cases=max_cases)
    except ExportError as e:
        raise InputError(f"{files[0]}: {e}") from None
    with _output_error():
        atomic_write(output, [text.encode("utf-8")], force=force, inputs=d.files)
    say(f"wrote {output}: {cases} case{'s' if cases != 1 else ''} (run it with pytest)")


def main() -> None:
    # File names need not be UTF-8; Python hands them over surrogate-escaped and, outside the C
    # locale, stdout is strict, so printing one in a report would crash: write its bytes back.
    if getattr(sys.stdout, "errors", None) == "strict" and hasattr(sys.stdout, "reconfigure"):
        utf8 = (sys.stdout.encoding or "").lower().replace("-", "") == "utf8"
        sys.stdout.reconfigure(errors="surrogateescape" if utf8 else "backslashreplace")
    from dcptool.memory import keep_freed_memory

    keep_freed_memory()  # the process is ours: freed temporaries are reused, not faulted in afresh
    app()
