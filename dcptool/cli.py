"""Command line: parse, call the library, render, exit 0 clean / 1 findings / 2 bad usage or input."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from dcptool.dump import DumpError

app = typer.Typer(no_args_is_help=True, pretty_exceptions_show_locals=False, add_completion=False,
                  rich_markup_mode=None,  # plain usage errors: one "Error:" line, no box
                  help="Replay and debug decode-context-parallel (DCP) metadata recorded from serving engines.")


class Trouble(Exception):
    """Bad usage or bad input: one line on stderr, exit code 2."""


def _fail(msg: str) -> typer.Exit:
    typer.echo(f"dcptool: {msg}", err=True)
    return typer.Exit(2)


def _console() -> Console:
    return Console(highlight=False, soft_wrap=False)


def _obs_index(d, spec: str) -> int:
    """`--obs I` (index in the first file) or `--obs FILE:I`; returns the merged position."""
    import numpy as np

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
    hit = np.flatnonzero((d.file_index == fi) & (d.file_obs == k))
    if hit.size == 0:
        raise Trouble(f"--obs {spec!r}: {d.files[fi]} has no observation {k} "
                      f"(it has {int((d.file_index == fi).sum())})")
    i = int(hit[0])
    from dcptool.replay import MAX_VIEW_CELLS, view_cells

    if view_cells(d, i) > MAX_VIEW_CELLS:
        raise Trouble(f"--obs {spec!r}: {d.files[fi]} observation {k} has {int(d['obs.num_reqs_padded'][i])} "
                      f"padded rows and dcp_size {d.config.dcp_size}: too large to show row by row "
                      f"({view_cells(d, i):,} cells > {MAX_VIEW_CELLS:,}); use replay --json")
    return i


def _check_html_target(path: Path, dumps: list[Path], force: bool) -> None:
    """Fail before the replay runs: never clobber without --force, never overwrite an input dump."""
    if path.is_dir():
        raise Trouble(f"--html {path}: is a directory")
    if path.exists():
        if any(path.resolve() == p.resolve() for p in dumps if p.exists()):
            raise Trouble(f"--html {path}: is one of the dumps being replayed; dcptool never modifies its input")
        if not force:
            raise Trouble(f"--html {path}: exists (use --force to overwrite)")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise Trouble(f"--html {path}: directory {parent} does not exist")


def _write_html(path: Path, res, max_findings: int | None, force: bool) -> None:
    from dcptool.dump import atomic_write
    from dcptool.htmlreport import render_html

    try:  # WriteError names the file and the problem (disk full, ...), and the old file is unchanged
        atomic_write(path, [render_html(res, max_findings).encode("utf-8")], force=force, inputs=res.files)
    except DumpError as e:
        raise _fail(f"--html {e}") from None
    typer.echo(f"dcptool: wrote {path}", err=True)


@app.command()
def replay(
    dumps: Annotated[list[Path], typer.Argument(metavar="DUMP",
                                                help="Dump files (one run: per-rank files or chunks).")],
    split: Annotated[int | None, typer.Option(
        "--split", min=1, help="Re-split every recorded full batch into K micro-batches and show what each must "
                               "carry.")] = None,
    backend: Annotated[str, typer.Option(help="auto (Triton on a GPU, torch on CPU), triton (the interpreter "
                                              "without a GPU) or torch.")] = "auto",
    obs: Annotated[str | None, typer.Option("--obs", help="Show one observation row by row: I or FILE:I.")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="JSON Lines: findings, then a summary.")] = False,
    max_findings: Annotated[int | None, typer.Option(min=0, help="Show at most M findings (the summary counts "
                                                                 "all). Text default 100, JSON all.")] = None,
    strict: Annotated[bool, typer.Option(help="Exit 1 on warnings too (e.g. `stray`).")] = False,
    html: Annotated[Path | None, typer.Option("--html", help="Also write a self-contained HTML report (summary, "
                                                             "timeline, findings table, row views) to PATH.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Let --html overwrite an existing file.")] = False,
) -> None:
    """Recompute every observation's DCP metadata and report what was missing, stale or wrong."""
    from dcptool.dump import open_dumps

    if backend not in ("auto", "triton", "torch"):
        raise _fail(f"--backend {backend!r}: choose auto, triton or torch")
    try:
        if html is not None:
            _check_html_target(html, dumps, force)
        d = open_dumps([str(p) for p in dumps])
        i = _obs_index(d, obs) if obs is not None else None
        from dcptool.htmlreport import VIEW_FINDINGS
        from dcptool.kernel import BackendError
        from dcptool.replay import replay as run_replay

        try:
            res = run_replay(d, backend, split=split, obs=i, views=0 if html is None else VIEW_FINDINGS)
        except BackendError as e:
            raise Trouble(str(e)) from None
    except (DumpError, Trouble) as e:
        raise _fail(str(e)) from None
    from dcptool import report

    if json_out:
        for line in report.replay_json_lines(res, max_findings):
            sys.stdout.write(line + "\n")
    else:
        report.render_replay(res, _console(), max_findings)
    if html is not None:
        _write_html(html, res, max_findings, force)
    raise typer.Exit(1 if res.errors or (strict and res.warnings) else 0)


@app.command()
def inspect(
    dump: Annotated[list[Path], typer.Argument(metavar="DUMP", help="Dump file(s) to summarise.")],
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object.")] = False,
) -> None:
    """Summarise a dump: config, steps, sites, ranks, micro-batches, sizes, optional columns."""
    from dcptool import report
    from dcptool.dump import describe, open_dumps

    try:
        info = describe(open_dumps([str(p) for p in dump]))
    except DumpError as e:
        raise _fail(str(e)) from None
    if json_out:
        sys.stdout.write(report.inspect_json(info) + "\n")
    else:
        report.render_inspect(info, _console())


def main() -> None:
    # File names need not be UTF-8; Python hands them over surrogate-escaped and, outside the C
    # locale, stdout is strict, so printing one in a report would crash: write its bytes back.
    if getattr(sys.stdout, "errors", None) == "strict" and hasattr(sys.stdout, "reconfigure"):
        utf8 = (sys.stdout.encoding or "").lower().replace("-", "") == "utf8"
        sys.stdout.reconfigure(errors="surrogateescape" if utf8 else "backslashreplace")
    app()
