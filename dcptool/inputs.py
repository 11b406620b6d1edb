"""What every command shares on its command line: the dumps it reads (files, directories, quoted globs, comma-separated
lists, each the same way everywhere), the files it writes (one no-overwrite rule), and option values parsed and
refused in the project's words (`dcptool COMMAND: --option: what is wrong`)."""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from dcptool.errors import DcptoolError, UsageError

GLOB_CHARS = "*?["


class InputError(DcptoolError):
    """A dump argument that names nothing to read: one line naming it, exit 2."""


def _natural(p: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p)]


def _dir_dumps(path: str) -> list[str]:
    """A directory's *.safetensors (as the vLLM plugin and rollover write them), in natural order."""
    found = sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors")), key=_natural)
    if not found:
        raise InputError(f"{path}: directory holds no *.safetensors dump")
    return found


def _one(part: str) -> list[str]:
    if os.path.isdir(part):
        return _dir_dumps(part)
    if not os.path.lexists(part) and any(c in part for c in GLOB_CHARS):
        found = sorted((f for f in glob.glob(part) if not os.path.isdir(f)), key=_natural)
        if not found:
            raise InputError(f"{part}: no file matches")
        return found
    return [part]  # a file (the reader says what is wrong with one that is not)


def dump_paths(specs: Sequence[str | os.PathLike]) -> list[str]:
    """The dump files the arguments name, in order: a file as given; a directory as its *.safetensors; a glob (quoted,
    so that the shell left it: `'run/*.rank*.safetensors'`) as the files it matches; a comma-separated list of any
    of these (a path that exists is taken whole, commas and all). Directories and globs are expanded in natural order
    (rank2 before rank10)."""
    out: list[str] = []
    for spec in map(os.fspath, specs):
        parts = [spec] if os.path.lexists(spec) else [p for p in spec.split(",") if p]
        if not parts:
            raise InputError(f"{spec!r}: no dump named")
        for part in parts:
            out += _one(part)
    return out


# --------------------------------------------------------------------------------------------
# Output files: the no-overwrite rule, checked before the work


def output_target(option: str, path: Path, inputs: Sequence[str | os.PathLike], force: bool) -> None:
    """Refuse (UsageError, before any work) to write `path` where that would clobber a file without --force,
    overwrite one of the `inputs` (never, even with --force), replace anything but a regular file (a device, a
    FIFO, /proc/self/fd/N, a directory: dump.write_target) or write into a directory that does not exist."""
    from dcptool.dump import WriteError, exists_error, write_target

    try:
        write_target(path)
    except WriteError as e:
        raise UsageError(option, str(e)) from None
    if os.path.lexists(path):
        for p in inputs:
            try:
                same = os.path.samefile(path, p)
            except OSError:
                same = False
            if same:
                raise UsageError(option, f"{path}: is one of the dumps read; dcptool never modifies its input")
        if not force:
            raise UsageError(option, str(exists_error(path)))
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(option, f"{path}: directory {parent} does not exist")


# --------------------------------------------------------------------------------------------
# Option values (typer's `parser=`): the value is refused in dcptool's words, never in a library's


def _bad(what: str) -> Exception:
    """An option value refused: click's BadParameter (typer passes it through as is), which exits.usage_line turns
    into `dcptool COMMAND: --option: what`."""
    import typer

    return typer.BadParameter(what)


def integer(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """Parser of an integer option in [lo, hi]."""

    def parse(text: str) -> int:
        try:
            v = int(str(text).strip(), 10)
        except ValueError:
            raise _bad(f"expected an integer{_range(lo, hi)}, got {text!r}") from None
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise _bad(f"must be{_range(lo, hi)}, got {v}")
        return v

    return parse


def number(lo: float) -> Callable[[str], float]:
    """Parser of a number option >= lo."""

    def parse(text: str) -> float:
        try:
            v = float(str(text).strip())
        except ValueError:
            raise _bad(f"expected a number >= {lo:g}, got {text!r}") from None
        if not v >= lo or v != v or v == float("inf"):
            raise _bad(f"must be a number >= {lo:g}, got {text}")
        return v

    return parse


def _range(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f" from {lo} to {hi}"
    if lo is not None:
        return f" >= {lo}"
    return "" if hi is None else f" <= {hi}"
