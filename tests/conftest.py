"""Shared test helpers: hand-built observations and dumps, and the CLI (in-process, or as a real subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

from dcptool.dump import DumpConfig, Observation, write_observations
from dcptool.reference import local_np

ROOT = Path(__file__).resolve().parents[1]


def expected_view(seq, num_reqs: int, num_reqs_padded: int, dcp: int, rank: int, il: int = 1) -> np.ndarray:
    out = np.zeros(num_reqs_padded, np.int32)
    out[:num_reqs] = local_np(np.asarray(seq[:num_reqs]), dcp, rank, il)
    return out


def obs(step=0, site="attn_metadata", rank=0, seq=(17, 25, 0, 0), num_reqs=2, num_reqs_padded=4, dcp=2, il=1,
        view="auto", **kw) -> Observation:
    """A correct observation unless `view` says otherwise ("auto" = the right view, None = missing)."""
    seq = np.asarray(seq, np.int32)
    if isinstance(view, str) and view == "auto":
        view = expected_view(seq, num_reqs, num_reqs_padded, dcp, rank, il)
    return Observation(step=step, site=site, rank=rank, num_reqs=num_reqs, num_reqs_padded=num_reqs_padded,
                       seq_lens=seq, dcp_local_seq_lens=None if view is None else np.asarray(view, np.int32), **kw)


def write(path, observations, dcp=2, il=1, **cfg) -> str:
    write_observations(path, observations, DumpConfig(dcp_size=dcp, cp_interleave=il, **cfg))
    return str(path)


class Ran(NamedTuple):
    """What a finished `dcptool` run left: the fields of subprocess.CompletedProcess the tests read."""

    returncode: int
    stdout: str
    stderr: str
    args: tuple = ()


def _runner():
    from typer.testing import CliRunner

    try:  # click < 8.2 (older typer re-exports it) mixes stderr into stdout unless told not to
        return CliRunner(mix_stderr=False)
    except TypeError:  # click >= 8.2 and typer's own runner keep them apart and have no such argument
        return CliRunner()


_CLICK: dict = {}


def _command(app):
    """The click command of dcptool's app, built once (typer rebuilds it on every `app()` call)."""
    if not _CLICK:
        import typer

        _CLICK["cmd"] = typer.main.get_command(app)
    return _CLICK["cmd"]


def _show_warning(message, category, filename, lineno, file=None, line=None):
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def cli(*args, env=None, cwd=None) -> Ran:
    """`dcptool ARGS` in this process, through typer's CliRunner and dcptool.cli.main() as `python -m dcptool`
    runs it (its stdout set-up, then the guarded command group); `env` and `cwd` apply for the run only.
    Warnings reach stderr as they would in a process of its own (default filters), not pytest's record.
    An exception escaping main() is what a process would show: a traceback on stderr and exit 1."""
    import dcptool.cli as dcli

    argv = [os.fsdecode(a) if isinstance(a, bytes) else str(a) for a in args]
    overrides = {"COLUMNS": "200", **(env or {})}
    here, hook, app = os.getcwd(), sys.excepthook, dcli.app
    code = 0
    # dcptool.cli.main() calls `app()`, which rebuilds the command and reads sys.argv: run the built one instead
    dcli.app = lambda: _command(app).main(args=argv, prog_name="dcptool")
    try:
        if cwd is not None:
            os.chdir(cwd)
        with _runner().isolation(env=overrides) as streams, warnings.catch_warnings():
            warnings.resetwarnings()
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.simplefilter("ignore", category)  # Python's default filters, as in a fresh process
            warnings.showwarning = _show_warning
            try:
                dcli.main()
            except SystemExit as e:
                code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
                if not isinstance(e.code, (int, type(None))):
                    sys.stderr.write(f"{e.code}\n")
            except Exception as e:
                code = 1
                traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
            out, err = streams[0].getvalue(), streams[1].getvalue()
    finally:
        dcli.app, sys.excepthook = app, hook
        os.chdir(here)
    # bytes a non-UTF-8 file name put on stdout (main() writes them back, surrogate-escaped) survive the round trip
    return Ran(code, out.decode("utf-8", "surrogateescape"), err.decode("utf-8", "surrogateescape"), tuple(argv))


def cli_subprocess(*args, env=None, cwd=None) -> subprocess.CompletedProcess:
    """Run `python -m dcptool ARGS` as a real process, as a user would; returns the finished process.
    For the few smoke tests that need a process: imports, signals, pipes, file descriptors, argv bytes."""
    e = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", **(env or {})}
    return subprocess.run([sys.executable, "-m", "dcptool", *map(str, args)], capture_output=True, text=True,
                          env=e, cwd=cwd, timeout=300)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# Fuzz cases run this session, by kind; printed as `fuzz: N cases` in the terminal summary (CI log).
FUZZ_CASES: dict[str, int] = {}


def count_fuzz(kind: str, n: int = 1) -> None:
    FUZZ_CASES[kind] = FUZZ_CASES.get(kind, 0) + n


def pytest_terminal_summary(terminalreporter) -> None:
    if FUZZ_CASES:
        detail = ", ".join(f"{k} {v}" for k, v in sorted(FUZZ_CASES.items()))
        terminalreporter.write_line(f"fuzz: {sum(FUZZ_CASES.values())} cases ({detail})")
