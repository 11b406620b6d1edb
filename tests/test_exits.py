"""exits.py: the one line each failure gets (usage errors, out of memory), unit by unit; tests/test_cli.py runs them
through the commands."""

import numpy as np
import pytest

from dcptool import exits


@pytest.fixture(autouse=True)
def _fresh_run():
    exits._run.clear()
    yield
    exits._run.clear()


def _numpy_memory_error() -> MemoryError:
    try:
        np.empty(1 << 60, np.uint8)  # a real numpy MemoryError (_ArrayMemoryError: it knows its size)
    except MemoryError as e:
        return e
    raise AssertionError("an exbibyte was allocated")


def test_memory_line_names_the_size_the_files_and_what_cuts_it(tmp_path):
    p = tmp_path / "run.safetensors"
    p.write_bytes(b"\0" * 3000)
    exits.reading([p, tmp_path / "gone.safetensors"])  # (a file that went away is not counted)
    line = exits.memory_line(_numpy_memory_error(), "replay")
    assert line.startswith("replay: out of memory: an allocation of 1.0 EiB failed; the 1 file read holds 2.9 KiB, "
                           "read whole into memory; to need less, replay fewer files at once"), line
    assert "without --split or --html" in line and line.endswith("or raise the memory limit (ulimit -v)")
    assert "\n" not in line


@pytest.mark.parametrize("error,size", [
    (MemoryError(), None),  # Python's own: no size
    (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 123456789 bytes. Error code 12 "
                  "(Cannot allocate memory)"), "117.7 MiB"),
    (type("OutOfMemoryError", (RuntimeError,), {})("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                                   "capacity of 139.81 GiB"), "2.00 GiB"),
])
def test_memory_line_reads_the_size_torch_and_python_give(error, size):
    assert exits.out_of_memory(error)
    line = exits.memory_line(error, "diff")
    want = f"an allocation of {size} failed" if size else "an allocation failed"
    assert line.startswith(f"diff: out of memory: {want}; to need less, compare fewer files at once"), line


@pytest.mark.parametrize("command,options", [("reduce", "reduce fewer files"), ("simulate", "fewer --steps"),
                                             ("export-test", "reduce the recording first"), ("inspect", "fewer files")])
def test_memory_line_says_what_cuts_each_command(command, options):
    assert options in exits.memory_line(MemoryError(), command)


def test_what_is_not_out_of_memory():
    assert not exits.out_of_memory(RuntimeError("something else"))
    assert not exits.out_of_memory(ValueError("can't allocate memory"))  # only torch's allocator's RuntimeError


def test_sizes_in_binary_units():
    assert [exits._size(n) for n in (0, 1023, 1024, 5 << 20, 3 << 30, 1 << 60)] == [
        "0 bytes", "1,023 bytes", "1.0 KiB", "5.0 MiB", "3.0 GiB", "1.0 EiB"]


def test_usage_line_is_one_line_naming_the_command_and_the_option():
    import typer
    from typer.main import get_command

    from dcptool.cli import app

    group = get_command(app)
    ctx = group.make_context("dcptool", ["replay", "x"])
    sub = group.get_command(ctx, "replay").make_context("replay", ["x"], parent=ctx)
    split = next(p for p in sub.command.params if p.name == "split")
    e = exits.usage_line(typer.BadParameter("must be >= 1, got 0", ctx=sub, param=split), ctx)
    assert e.exit_code == 2 and (e.command, e.message) == ("replay", "--split: must be >= 1, got 0")
    assert exits.usage_line(e, ctx) is e  # converted once
    dump = next(p for p in sub.command.params if p.name == "dumps")
    import importlib

    missing_cls = importlib.import_module(typer.BadParameter.__module__).MissingParameter  # (click's, or typer's copy)
    missing = exits.usage_line(missing_cls(ctx=sub, param=dump), ctx)
    assert (missing.command, missing.message) == ("replay", "DUMP: missing (see 'dcptool replay -h')")
    top = exits.usage_line(importlib.import_module(typer.BadParameter.__module__).UsageError("No such command 'x'.",
                                                                                              ctx=ctx), ctx)
    assert top.command is None and top.message.startswith("x: no such command (the commands: replay, diff")



# Triton's InterpreterError as the check sees it (its class name and module): importing triton here would decide
# the interpreter for every later test of this process (tests/test_cli.py raises the real one in a process of its own)
_InterpreterError = type("InterpreterError", (Exception,), {"__module__": "triton.runtime.errors"})


@pytest.mark.parametrize("e, want", [
    (_InterpreterError("TypeError('only 0-dimensional arrays can be converted to Python scalars')"), True),
    (RuntimeError("InterpreterError"), False),  # the name in a message is not the interpreter failing
    (type("InterpreterError", (Exception,), {})("x"), False),  # nor a class of that name outside triton
    (TypeError("only 0-dimensional arrays"), False),
])
def test_only_tritons_interpreter_error_is_said_as_the_interpreter_failing(e, want):
    assert exits.interpreter_failed(e) is want


def test_the_interpreter_line_names_the_versions_the_error_and_what_to_use():
    from importlib.metadata import version

    line = exits.interpreter_line(_InterpreterError("TypeError('only 0-dimensional\n arrays')"))
    assert line == (f"--backend triton: Triton's interpreter failed here (triton {version('triton')}, numpy "
                    f"{version('numpy')}): TypeError('only 0-dimensional arrays'); use --backend torch (the same "
                    "checks on the CPU)")


def test_installed_reads_the_metadata_or_says_not_installed():
    import numpy

    assert exits.installed("numpy") == numpy.__version__
    assert exits.installed("no-such-distribution-dcptool") == "not installed"
