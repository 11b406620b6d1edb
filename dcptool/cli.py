"""Command line: parse, call the library, render; exit 0 clean, 1 findings, 2 bad usage/input or internal error.
(Over 450 lines: six commands' options, each a page of help text; the exit-code guard is dcptool.exits.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from typer.core import TyperCommand

from dcptool import exits
from dcptool.choices import Backend, CudaGraph, Pipeline, SpecMethod, metavar, spoken, values
from dcptool.errors import DcptoolError  # stdlib only: --help stays light
from dcptool.exits import Guarded, say


class Trouble(DcptoolError):
    """Bad usage or bad input found by the command line itself: one line on stderr, exit code 2."""


app = typer.Typer(cls=Guarded, no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
                  rich_markup_mode=None,  # plain help pages, no box (usage errors: the guard's one line)
                  help="Replay and debug decode-context-parallel (DCP) metadata recorded from serving engines.")


def versions() -> list[str]:
    """What `dcptool --version` prints: dcptool's version, torch's and triton's (from their metadata: neither
    is imported) and the dump format versions this dcptool reads."""
    from importlib.metadata import PackageNotFoundError, version

    from dcptool import __version__
    from dcptool.dump.schema import FORMAT_VERSION

    def of(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    return [f"dcptool {__version__}", f"torch {of('torch')}", f"triton {of('triton')}",
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


def _obs_index(d, spec: str) -> int:
    """`--obs I` (index in the first file) or `--obs FILE:I`; returns the merged position."""

    file, _, num = spec.rpartition(":")
    try:
        k = int(num)
    except ValueError:
        raise Trouble(f"--obs {spec!r}: expected an observation index, or FILE:INDEX") from None
    if file:
        if file not in d.files:
            raise Trouble(f"--obs {spec!r}: {file} is not one of the dumps given")
        fi = d.files.index(file)
    else:
        fi = 0
    i = d.index_of(fi, k)
    if i is None:
        raise Trouble(f"--obs {spec!r}: {d.files[fi]} has no observation {k} "
                      f"(it has {int((d.file_index == fi).sum())})")
    from dcptool.check.replay import MAX_VIEW_CELLS, view_cells

    if view_cells(d, i) > MAX_VIEW_CELLS:
        raise Trouble(f"--obs {spec!r}: {d.files[fi]} observation {k} has {int(d['obs.num_reqs_padded'][i])} "
                      f"padded rows and dcp_size {d.config.dcp_size}: too large to show row by row "
                      f"({view_cells(d, i):,} cells > {MAX_VIEW_CELLS:,}); use replay --json")
    return i


def _check_html_target(path: Path, dumps: list[Path], force: bool) -> None:
    """Fail before the replay runs: never clobber without --force, never overwrite an input dump, never
    replace anything but a regular file (a device, a FIFO, /proc/self/fd/N, a directory: dump.write_target)."""
    from dcptool.dump import WriteError, write_target

    try:
        write_target(path)
    except WriteError as e:
        raise Trouble(f"--html {e}") from None
    if path.exists():
        if any(path.resolve() == p.resolve() for p in dumps if p.exists()):
            raise Trouble(f"--html {path}: is one of the dumps being replayed; dcptool never modifies its input")
        if not force:
            raise Trouble(f"--html {path}: exists (use --force to overwrite)")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise Trouble(f"--html {path}: directory {parent} does not exist")


def _write_html(path: Path, res, max_findings: int | None, force: bool) -> None:
    from dcptool.dump import DumpError, atomic_write
    from dcptool.report.html import render_html

    try:  # WriteError names the file and the problem (disk full, ...), and the old file is unchanged
        atomic_write(path, [render_html(res, max_findings).encode("utf-8")], force=force, inputs=res.files)
    except DumpError as e:
        raise Trouble(f"--html {e}") from None
    say(f"wrote {path}")


def _check_engine_version(v: str | None) -> None:
    from dcptool.dcp.slicing import parse_engine_version

    if v is not None and parse_engine_version(v) is None:
        raise Trouble(f"--engine-version {v!r}: expected a vLLM version such as 0.34.0")


@app.command()
def replay(
    dumps: Annotated[list[Path], typer.Argument(metavar="DUMP",
                                                help="Dump files (one run: per-rank files or chunks) or "
                                                             "directories of them.")],
    split: Annotated[int | None, typer.Option(
        "--split", min=1, help="Re-split every recorded full batch into K micro-batches and show what each must "
                               "carry.")] = None,
    backend: Annotated[str, typer.Option(metavar=metavar(Backend),
                                         help="auto (Triton on a GPU, torch on CPU), triton (the interpreter "
                                              "without a GPU) or torch.")] = "auto",
    obs: Annotated[str | None, typer.Option("--obs", help="Show one observation row by row: I or FILE:I.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="JSON Lines: findings, then a summary.")] = False,
    max_findings: Annotated[int | None, typer.Option(min=0, help="Show at most M findings (the summary counts "
                                                                 "all). Text default 100, JSON all.")] = None,
    strict: Annotated[bool, typer.Option(help="Exit 1 on warnings too (e.g. `stray`).")] = False,
    html: Annotated[Path | None, typer.Option("--html", help="Also write a self-contained HTML report (summary, "
                                                             "timeline, findings table, row views) to PATH.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Let --html overwrite an existing file.")] = False,
    engine_version: Annotated[str | None, typer.Option(
        "--engine-version", help="Split micro-batches by this vLLM version's rule (e.g. 0.34.0), not the one the "
                                 "dump names.")] = None,
) -> None:
    """Recompute every observation's DCP metadata and report what was missing, stale or wrong."""
    from dcptool.dump import open_dumps

    if backend not in values(Backend):
        raise Trouble(f"--backend {backend!r}: choose {spoken(Backend)}")
    _check_engine_version(engine_version)
    dumps = _dump_args(dumps)
    exits.reading(dumps)
    if html is not None:
        _check_html_target(html, dumps, force)
    d = open_dumps([str(p) for p in dumps], stream=True)  # (the scan follows the read; replay() ends it)
    try:
        i = _obs_index(d, obs) if obs is not None else None
    except DcptoolError:
        d.close()  # (no thread of the read outlives the command)
        raise
    from dcptool.check.replay import replay as run_replay
    from dcptool.report.html import VIEW_FINDINGS
    from dcptool.report.progress import Progress

    with Progress(d.n, "replay", not json_out and sys.stderr.isatty()) as bar:  # phases: replay.Phases
        res = run_replay(d, backend, split=split, obs=i, views=0 if html is None else VIEW_FINDINGS,
                         progress=bar, bounded=d.bounded, engine_version=engine_version)
        if html is not None:  # first: a reader of stdout that stops early (`| head`) must not cost the file
            from dcptool.report.html import html_units

            bar.plan(report=html_units(res, max_findings))
            bar.phase("report")
            _write_html(html, res, max_findings, force)
    if res.gpu_failed is not None:  # (auto's GPU failed before its scan reported anything: the CPU replayed)
        say(f"--backend auto: {res.gpu_failed}; replaying on the CPU instead")
    from dcptool.report import text as report

    code = 1 if res.errors or (strict and res.warnings) else 0
    exits.verdict(code)
    if json_out:
        for line in report.replay_json_lines(res, max_findings):
            sys.stdout.write(line + "\n")
    else:
        report.render_replay(res, _console(), max_findings)
    raise typer.Exit(code)


def _natural(p: str) -> list:
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p)]


def _dir_dumps(path: str) -> list[str]:
    """A directory's *.safetensors (as the vLLM plugin and rollover write them), in natural order."""
    import glob
    import os

    found = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")), key=_natural)
    if not found:
        raise Trouble(f"{path}: directory holds no *.safetensors dump")
    return found


def _dump_args(paths: list[Path]) -> list[Path]:
    """DUMP arguments of replay/inspect: files as given, a directory as its *.safetensors (natural order)."""
    return [q for p in paths for q in ([Path(f) for f in _dir_dumps(str(p))] if p.is_dir() else [p])]


def _dump_side(spec: str) -> list[str]:
    """A side of `diff`: a file, a directory (its *.safetensors), a glob, or a comma-separated list of these."""
    import glob
    import os

    out: list[str] = []
    for part in (p for p in spec.split(",") if p):
        if os.path.isdir(part):
            out += _dir_dumps(part)
        elif not os.path.exists(part) and any(c in part for c in "*?["):
            found = sorted(glob.glob(part), key=_natural)
            if not found:
                raise Trouble(f"{part}: no file matches")
            out += found
        else:
            out.append(part)
    if not out:
        raise Trouble(f"{spec!r}: no dump given")
    return out


@app.command()
def diff(
    a: Annotated[str, typer.Argument(metavar="A", help="The first run: a dump, a directory of dumps (per-rank "
                                                        "files), a glob or a comma-separated list.")],
    b: Annotated[str, typer.Argument(metavar="B", help="The second run, given the same way.")],
    json_out: Annotated[bool, typer.Option("--json", help="JSON Lines: differences, then a summary.")] = False,
    max_findings: Annotated[int | None, typer.Option(min=0, help="Show at most M differences (the summary counts "
                                                                 "all). Text default 100, JSON all.")] = None,
) -> None:
    """Align two runs by (step, site, rank, micro-batch, occurrence) and report every recorded difference."""
    from dcptool.diagnose.diff import diff as run_diff
    from dcptool.dump import open_dumps

    first = _dump_side(a)
    exits.reading(first)
    da = open_dumps(first)
    second = _dump_side(b)
    exits.reading(first + second)
    db = open_dumps(second)
    from dcptool.report import text as report

    limit = max_findings if (max_findings is not None or json_out) else report.TEXT_MAX_FINDINGS
    res = run_diff(da, db, limit)
    exits.verdict(0 if res.same else 1)
    if json_out:
        for line in report.diff_json_lines(res):
            sys.stdout.write(line + "\n")
    else:
        report.render_diff(res, _console())
    raise typer.Exit(0 if res.same else 1)


@app.command()
def inspect(
    dump: Annotated[list[Path], typer.Argument(metavar="DUMP", help="Dump file(s) or directories to summarise.")],
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False,
) -> None:
    """Summarise a dump: config, steps, sites, ranks, micro-batches, sizes, optional columns."""
    from dcptool.dump import describe, open_dumps
    from dcptool.report import text as report

    files = _dump_args(dump)
    exits.reading(files)
    d = open_dumps([str(p) for p in files], stream=True)  # replay's read: the same validation, the same errors
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


@app.command(cls=_FaultHelp)
def simulate(
    dcp: Annotated[int, typer.Option("--dcp", help="DCP world size N (ranks recorded).")] = 2,
    interleave: Annotated[int, typer.Option(help="cp_kv_cache_interleave_size I.")] = 1,
    pcp: Annotated[int, typer.Option("--pcp", help="PCP world size P (P x N recording processes).")] = 1,
    steps: Annotated[int, typer.Option(help="Engine steps after start-up.")] = 32,
    spec_tokens: Annotated[int, typer.Option(help="Draft tokens K per decode (0: no speculative decoding).")] = 2,
    spec_method: Annotated[str, typer.Option(metavar=metavar(SpecMethod),
                                             help="mtp or dflash (DFlash captures its own graphs).")] = "mtp",
    ubatches: Annotated[int, typer.Option(help="Micro-batches (DBO) when a batch passes vLLM's thresholds.")] = 2,
    cudagraph: Annotated[str, typer.Option(metavar=metavar(CudaGraph),
                                           help="none, piecewise, or full (FULL_AND_PIECEWISE).")] = "full",
    dummy_every: Annotated[int, typer.Option(help="A dummy run every D steps (0: only the profile run).")] = 16,
    page_size: Annotated[int, typer.Option(help="KV page (block) size for attention page counts.")] = 16,
    pipeline: Annotated[str, typer.Option(metavar=metavar(Pipeline),
                                          help="fixed (vLLM after the fix) or legacy (every pre-fix fault).")]
    = "fixed",
    inject: Annotated[str | None, typer.Option(help=INJECT_HELP)] = None,  # + the fault table (_FaultHelp)
    seed: Annotated[int, typer.Option(help="Workload seed (same seed, same dump, byte for byte).")] = 0,
    engine_version: Annotated[str, typer.Option("--engine-version", help="vLLM release to model (e.g. 0.34.0): "
                                                "its micro-batch split rule, recorded as engine_version.")] = "",
    max_num_reqs: Annotated[int, typer.Option(help="max_num_seqs: requests per step.")] = 64,
    token_budget: Annotated[int, typer.Option(help="max_num_batched_tokens: tokens per step.")] = 2048,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Write the dump here instead of "
                                                                       "printing the side-by-side table.")] = None,
    per_rank: Annotated[bool, typer.Option(help="With -o: one file per rank (OUT.rankR / OUT.pcpP.rankR).")]
    = False,
    force: Annotated[bool, typer.Option(help="Overwrite existing output files.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="JSON: the table as JSON Lines, or with -o one "
                                                          "object describing what was written.")] = False,
) -> None:
    """Simulate a serving workload through a model of vLLM's runner; show or write its DCP metadata."""
    from dcptool.model.simulate import SimConfig, SimError, compare
    from dcptool.model.simulate import simulate as run_sim
    from dcptool.report import text as report
    from dcptool.report.progress import Progress

    faults = tuple(f.strip() for f in inject.split(",") if f.strip()) if inject else ()
    cfg = SimConfig(dcp=dcp, interleave=interleave, pcp=pcp, steps=steps, spec_tokens=spec_tokens,
                    spec_method=spec_method, ubatches=ubatches, cudagraph=cudagraph, dummy_every=dummy_every,
                    page_size=page_size, pipeline=pipeline, inject=faults, seed=seed, max_num_reqs=max_num_reqs,
                    token_budget=token_budget, engine_version=engine_version)
    try:
        cfg.validate()
        if per_rank and output is None:
            raise SimError("--per-rank needs -o")
        bar = Progress(cfg.steps * (1 if output else 2), "simulate", not json_out and sys.stderr.isatty(),
                       unit="steps")
        with bar:
            if output is None:
                cmp = compare(cfg, progress=bar)
            else:
                if output.parent and not output.parent.is_dir():
                    raise SimError(f"{output}: directory {output.parent} does not exist")
                res = run_sim(cfg, output, per_rank=per_rank, force=force, progress=bar)
    except DcptoolError:
        raise
    except FileExistsError as e:
        raise Trouble(str(e)) from None
    except OSError as e:
        raise Trouble(f"{output}: cannot write: {e.strerror or e}") from None
    if output is None:
        if json_out:
            for line in report.simulate_json_lines(cmp):
                sys.stdout.write(line + "\n")
        else:
            report.render_simulate(cmp, _console())
    elif json_out:
        sys.stdout.write(json.dumps(res.to_json()) + "\n")
    else:
        report.render_simulated(res, _console())


# --------------------------------------------------------------------------------------------
# Diagnosis: a minimal reproducer, and a regression test made from it


@app.command()
def reduce(
    dump: Annotated[list[Path], typer.Argument(metavar="DUMP", help="The recording (files of one run, or a "
                                                                    "directory of them).")],
    finding: Annotated[str, typer.Option("--finding", help="The problem to keep: RULE, RULE/RELATION (stale) or "
                                                           "RULE@OBS (that observation's finding, in the first "
                                                           "file).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the reduced recording.")],
    max_seconds: Annotated[float, typer.Option("--max-seconds", min=0.1, help="Stop shrinking after this long "
                                                                              "and write the smallest so far.")]
    = 60.0,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing output file.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object describing the reduction.")] = False,
) -> None:
    """Shrink a recording to the fewest steps, observations and rows that still show one problem."""
    from dcptool.check.replay import replay as run_replay
    from dcptool.diagnose.reduce import find_target, reduce_dump, reduced_config
    from dcptool.dump import DumpError, open_dumps, write_dump, write_target
    from dcptool.report import text as report
    from dcptool.report.progress import Progress

    files = _dump_args(dump)
    exits.reading(files)
    try:
        write_target(output)
    except DumpError as e:
        raise Trouble(f"-o {e}") from None
    if output.exists():
        if any(p.exists() and output.resolve() == p.resolve() for p in files):
            raise Trouble(f"-o {output}: is one of the dumps being reduced; dcptool never modifies its input")
        if not force:
            raise Trouble(f"-o {output}: exists (use --force to overwrite)")
    d = open_dumps([str(p) for p in files])
    res = run_replay(d, "torch")
    target = find_target(str(files[0]), res.findings, finding, d)
    with Progress(max(1, int(max_seconds)), "reduce", not json_out and sys.stderr.isatty(), unit="s") as bar:
        red = reduce_dump(d, target, {f.rule for f in res.findings}, max_seconds=max_seconds, progress=bar,
                          name=str(output))
    cols = red.dump.columns
    injected = red.dump.injected[0] if red.dump.injected else None
    try:
        write_dump(output, reduced_config(d, ", ".join(d.files), target), cols, injected, force=force,
                   inputs=d.files)
    except DumpError as e:
        raise Trouble(str(e)) from None
    if json_out:
        sys.stdout.write(json.dumps({**red.to_json(), "output": str(output)}) + "\n")
    else:
        report.render_reduction(red, str(output), _console())


@app.command("export-test")
def export_test(
    dump: Annotated[list[Path], typer.Argument(metavar="DUMP", help="A (reduced) recording with findings.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="The pytest file to write.")],
    max_cases: Annotated[int, typer.Option("--max-cases", min=1, help="Embed at most this many observations "
                                                                       "with findings.")] = 8,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing output file.")] = False,
) -> None:
    """Write a pytest regression test embedding the recording's wrong observations as literal arrays."""
    from dcptool.check.replay import replay as run_replay
    from dcptool.diagnose.export import ExportError
    from dcptool.diagnose.export import export_test as build
    from dcptool.dump import DumpError, atomic_write, open_dumps

    files = _dump_args(dump)
    exits.reading(files)
    d = open_dumps([str(p) for p in files])
    res = run_replay(d, "torch")
    try:
        text, cases = build(d, res.findings, max_cases=max_cases)
    except ExportError as e:
        raise Trouble(f"{files[0]}: {e}") from None
    try:
        atomic_write(output, [text.encode("utf-8")], force=force, inputs=d.files)
    except DumpError as e:
        raise Trouble(f"-o {e}") from None
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
