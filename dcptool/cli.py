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
    return int(hit[0])


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
) -> None:
    """Recompute every observation's DCP metadata and report what was missing, stale or wrong."""
    from dcptool.dump import open_dumps

    if backend not in ("auto", "triton", "torch"):
        raise _fail(f"--backend {backend!r}: choose auto, triton or torch")
    try:
        d = open_dumps([str(p) for p in dumps])
        i = _obs_index(d, obs) if obs is not None else None
        from dcptool.kernel import BackendError
        from dcptool.replay import replay as run_replay

        try:
            res = run_replay(d, backend, split=split, obs=i)
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
    raise typer.Exit(1 if res.errors or (strict and res.warnings) else 0)


def _dump_side(spec: str) -> list[str]:
    """A side of `diff`: a file, a directory (its *.safetensors), a glob, or a comma-separated list of these."""
    import glob
    import os
    import re

    def natural(p: str) -> list:
        return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p)]

    out: list[str] = []
    for part in (p for p in spec.split(",") if p):
        if os.path.isdir(part):
            found = sorted(glob.glob(os.path.join(glob.escape(part), "*.safetensors")), key=natural)
            if not found:
                raise Trouble(f"{part}: directory holds no *.safetensors dump")
            out += found
        elif not os.path.exists(part) and any(c in part for c in "*?["):
            found = sorted(glob.glob(part), key=natural)
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
    from dcptool.diff import diff as run_diff
    from dcptool.dump import open_dumps

    try:
        da = open_dumps(_dump_side(a))
        db = open_dumps(_dump_side(b))
    except (DumpError, Trouble) as e:
        raise _fail(str(e)) from None
    from dcptool import report

    limit = max_findings if (max_findings is not None or json_out) else report.TEXT_MAX_FINDINGS
    res = run_diff(da, db, limit)
    if json_out:
        for line in report.diff_json_lines(res):
            sys.stdout.write(line + "\n")
    else:
        report.render_diff(res, _console())
    raise typer.Exit(0 if res.same else 1)


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
    app()
