"""The command group's exits: exit codes that never lie, and every failure as one line on stderr."""

from __future__ import annotations

import os
import re
import sys

import typer
from typer.core import TyperGroup

from dcptool.errors import DcptoolError, UsageError  # stdlib only: --help stays light

# Every command runs inside Guarded.invoke (CliRunner too), so an unexpected exception is exit 2 with one
# line, never click's exit 1 ("findings" to a CI job); a usage error is one line too, never click's box.

INTERNAL = 2  # README: Exit codes
# per invocation: the exit code of what the command found (kept when the reader of stdout goes away), --debug,
# the files the command reads (named in an out-of-memory line)
_run: dict = {}
# click's exceptions (typer >= 0.22 vendors click, older typer re-exports it): found through typer's own
_CLICK_EXC = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
_PASS = (typer.Exit, typer.Abort, _CLICK_EXC)


def say(msg: str, command: str | None = None) -> None:
    """One line on stderr, `dcptool: MSG` or (a usage error) `dcptool COMMAND: MSG`; a path or a string from a file
    in it cannot reach the terminal as a command."""
    from dcptool.report.text import literal

    typer.echo(f"dcptool{' ' + command if command else ''}: {literal(msg)}", err=True)


def _is_usage(e: DcptoolError) -> bool:
    """An error about an option (`--split: ...`, `-o x: ...`): said with the command's name."""
    return isinstance(e, UsageError) or str(e).startswith("-")


def verdict(code: int) -> None:
    """Say the exit code before printing the report, so a broken pipe (`| head`) still ends with it."""
    _run["verdict"] = code


def debug(on: bool) -> None:
    _run["debug"] = on


def reading(paths) -> None:
    """The files the command reads: an out-of-memory line says how much they hold."""
    _run["inputs"] = [os.fspath(p) for p in paths]


def _debug() -> bool:
    return os.environ.get("DCPTOOL_DEBUG", "") not in ("", "0") or bool(_run.get("debug"))


def _report_to() -> str:
    """Where to report a bug: the package's Issues URL when its metadata names one."""
    try:
        from importlib.metadata import metadata

        for url in metadata("dcptool").get_all("Project-URL") or []:
            label, _, link = url.partition(",")
            if label.strip().lower() in ("issues", "bug tracker", "bugs", "tracker"):
                return link.strip()
    except Exception:
        pass
    return "the dcptool issue tracker"


def _internal(e: BaseException) -> None:
    _traceback(e)
    msg = " ".join(str(e).split()) or "(no message)"  # one line, whatever the exception says
    say(f"internal error: {type(e).__name__}: {msg} (please report this at {_report_to()}; "
        "rerun with --debug or DCPTOOL_DEBUG=1 for the traceback)")


def _traceback(e: BaseException) -> None:
    if _debug():
        import traceback

        traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)


# --------------------------------------------------------------------------------------------
# Out of memory: what was needed, and how to need less (README: Exit codes)

# What cuts the memory each command needs: the files it reads (each is read whole into memory, or merged lazily
# when together over half the available memory) or, for simulate, the workload it models.
_CUT = {
    "replay": "replay fewer files at once (a run's rollover files a few steps at a time, or fewer ranks' "
              "files), without --split or --html",
    "diff": "compare fewer files at once (the same steps' or ranks' files of each run)",
    "inspect": "inspect fewer files at once",
    "reduce": "reduce fewer files (those of the steps that show the problem)",
    "export-test": "export from fewer files (reduce the recording first)",
    "simulate": "fewer --steps, a smaller --max-num-reqs or --token-budget, or fewer ranks (--dcp, --pcp)",
}
# torch: "... you tried to allocate 123 bytes" (CPU), "Tried to allocate 2.00 GiB" (CUDA)
_ALLOCATE = re.compile(r"allocate (?:(\d+) bytes|([0-9.]+ ?[KMGTPE]i?B)\b)", re.I)


def out_of_memory(e: BaseException) -> bool:
    """An allocation that failed: Python's or numpy's MemoryError, or torch's (OutOfMemoryError, or its CPU
    allocator's RuntimeError)."""
    return isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


def interpreter_failed(e: BaseException) -> bool:
    """Triton's interpreter (`--backend triton` on the CPU, or TRITON_INTERPRET=1) failed inside a kernel: some
    triton and numpy pairs cannot run it (triton 3.6's interpreter under numpy 2.5 converts a loaded loop bound with
    int()), which no input of dcptool's causes and the torch backend does not meet."""
    return type(e).__name__ == "InterpreterError" and type(e).__module__.startswith("triton")


def installed(dist: str) -> str:
    """A distribution's version from its metadata (nothing imported), or "not installed"."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def interpreter_line(e: BaseException) -> str:
    msg = " ".join(str(e).split()) or "(no message)"
    return (f"--backend triton: Triton's interpreter failed here (triton {installed('triton')}, numpy "
            f"{installed('numpy')}): {msg}; use --backend torch (the same checks on the CPU)")


def _size(n: float) -> str:
    """Bytes in binary units, as numpy and torch name a failed allocation: `512 bytes`, `2.2 GiB`."""
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024:
            return f"{n:,.0f} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} EiB"


def memory_line(e: BaseException, command: str | None) -> str:
    """`COMMAND: out of memory: an allocation of SIZE failed; ...`: the size that could not be had (numpy and torch
    say it), how much the files read hold, and what cuts what the command needs."""
    total = getattr(e, "_total_size", None)  # numpy's _ArrayMemoryError
    m = _ALLOCATE.search(str(e))
    need = _size(total) if isinstance(total, int) else None if m is None else m[2] or _size(int(m[1]))
    sizes = []
    for p in _run.get("inputs", []):
        try:
            sizes.append(os.stat(p).st_size)
        except OSError:
            pass
    out = f"{command + ': ' if command else ''}out of memory: " + (
        f"an allocation of {need} failed" if need else "an allocation failed")
    if sizes:
        out += (f"; the {len(sizes)} file{'s' if len(sizes) != 1 else ''} read hold{'s' if len(sizes) == 1 else ''} "
                f"{_size(sum(sizes))}, read whole into memory")
    return out + f"; to need less, {_CUT.get(command or '', 'give it fewer files at once')}; or raise the memory " \
                 "limit (ulimit -v)"


# --------------------------------------------------------------------------------------------
# Usage errors: click prints usage, a hint and the error on three lines (or a box); dcptool prints one


class _UsageLine(_CLICK_EXC):
    """A usage error as one line on stderr, exit 2: `dcptool COMMAND: --option: what is wrong`. click's own exception
    type (click prints it and exits), never raised to a caller: not one of dcptool's errors."""

    exit_code = 2

    def __init__(self, message: str, command: str | None):
        super().__init__(message)
        self.command = command

    def show(self, file=None) -> None:
        say(self.message, self.command)


def _kind(e) -> set[str]:
    return {c.__name__ for c in type(e).__mro__}


def _param_name(param) -> str:
    """An option as it is typed (its longest name: `--max-findings`), an argument as its help names it (`DUMP`)."""
    if getattr(param, "param_type_name", "") == "argument":
        return getattr(param, "metavar", None) or (param.name or "argument").upper()
    opts = list(getattr(param, "opts", None) or [])
    return max(opts, key=len) if opts else (param.name or "?")


def _words(e, group, command: str | None) -> str:
    """click's usage error in dcptool's words: `--option: what is wrong` (the parsers of dcptool.inputs say what)."""
    kind = _kind(e)
    param = getattr(e, "param", None)
    see = f" (see 'dcptool{' ' + command if command else ''} -h')"
    if "MissingParameter" in kind and param is not None:
        if getattr(param, "param_type_name", "") == "argument":
            return f"{_param_name(param)}: missing{see}"
        return f"{_param_name(param)}: required{see}"
    if "BadParameter" in kind and param is not None:
        return f"{_param_name(param)}: {e.message}"
    if "NoSuchOption" in kind:
        maybe = sorted(getattr(e, "possibilities", None) or [])
        return f"{e.option_name}: no such option" + (f"; did you mean {' or '.join(maybe)}?" if maybe else "") + see
    msg = " ".join(e.format_message().split()).rstrip(".")
    if "BadOptionUsage" in kind and getattr(e, "option_name", None):
        what = ("needs a value" if "requires an argument" in msg else "takes no value" if "not take a value" in msg
                else msg[:1].lower() + msg[1:])
        return f"{e.option_name}: {what}"
    m = re.match(r"No such command '(.*)'", msg)
    if m:
        names = ", ".join(group.command.list_commands(group)) if group is not None else ""
        return f"{m[1]}: no such command" + (f" (the commands: {names})" if names else "")
    m = re.match(r"Got unexpected extra arguments?(?:\(s\))? \((.*)\)", msg)
    if m:
        return f"{m[1]}: unexpected extra argument{see}"
    return msg[:1].lower() + msg[1:] + see


def usage_line(e, group) -> BaseException:
    """click's usage error (a bad option value, a missing argument, an unknown option or command) as a _UsageLine;
    `dcptool` alone (click >= 8.2's NoArgsIsHelpError: the help page) and a _UsageLine stay as they are. `group`:
    the group's context, for an error that names none (an option's missing value)."""
    if isinstance(e, _UsageLine) or type(e).__name__ == "NoArgsIsHelpError":
        return e
    ctx = getattr(e, "ctx", None)
    if ctx is not None and ctx.parent is not None:
        command = ctx.info_name
    elif ctx is None and group.invoked_subcommand:  # (the command's context was never made)
        command = group.invoked_subcommand
    else:  # the group's own: an unknown command, or an option of its own
        command = None
    return _UsageLine(_words(e, group, command), command)


# --------------------------------------------------------------------------------------------
# stdout


def drop_stdout() -> None:
    """Point stdout at /dev/null (Python docs, "Note on SIGPIPE"): the flush at exit then cannot fail
    and print "Exception ignored" about a reader that went away or a full device."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a real file (CliRunner): nothing will flush it at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


class _Watched:
    """sys.stdout while a command runs: remembers that writing to it failed, to tell a full device (exit 2,
    "cannot write to standard output") from a bug (internal error)."""

    def __init__(self, f):
        self._f, self.failed = f, False

    def write(self, s):
        try:
            return self._f.write(s)
        except OSError:
            self.failed = True
            raise

    def flush(self):
        try:
            return self._f.flush()
        except OSError:
            self.failed = True
            raise

    def __getattr__(self, name):
        return getattr(self._f, name)


class Guarded(TyperGroup):
    """The dcptool command group: runs each command under one guard for exit codes and stdout."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:  # the group's own options (`dcptool --bogus`)
            return super().make_context(info_name, args, parent, **extra)
        except _CLICK_EXC as e:
            if getattr(e, "ctx", None) is None:
                raise
            raise usage_line(e, e.ctx) from None

    def invoke(self, ctx):
        _run.clear()
        code = 0
        out = sys.stdout = _Watched(sys.stdout)
        try:
            try:
                super().invoke(ctx)
            except typer.Exit as e:
                code = e.exit_code
            sys.stdout.flush()  # a buffered write to a full device or a closed pipe fails here, not at exit
        except _CLICK_EXC as e:  # a command's usage error (its options, its arguments) or an unknown command
            raise usage_line(e, ctx) from None
        except _PASS:
            raise
        except DcptoolError as e:  # bad input or usage, from the library or the command line: the one place
            say(str(e), ctx.invoked_subcommand if _is_usage(e) else None)
            code = 2
        except KeyboardInterrupt:
            say("interrupted")
            code = 130
        except BrokenPipeError:  # `| head`: the reader has what it wanted; keep the verdict of what was found
            drop_stdout()
            code = _run.get("verdict", code)
        except Exception as e:
            if isinstance(e, OSError) and out.failed:
                drop_stdout()
                say(f"cannot write to standard output: {e.strerror or e}")
            elif out_of_memory(e):  # bad input in a way: more than this process may hold
                _traceback(e)
                say(memory_line(e, ctx.invoked_subcommand))
            elif interpreter_failed(e):
                _traceback(e)
                say(interpreter_line(e), ctx.invoked_subcommand)
            else:
                _internal(e)
            code = INTERNAL
        finally:
            if sys.stdout is out:
                sys.stdout = out._f
        raise typer.Exit(code)

    def main(self, *args, **kwargs):
        try:
            return super().main(*args, **kwargs)
        except (*_PASS, SystemExit):
            raise
        except Exception as e:  # outside a command (parsing, a parameter's conversion): still one line, exit 2
            _internal(e)
            if kwargs.get("standalone_mode", True):
                sys.exit(INTERNAL)
            return INTERNAL
