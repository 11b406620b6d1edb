"""errors.py: DcptoolError, the one root of every error the CLI reports in one line; stdlib only."""

import importlib
import inspect
import pkgutil
import subprocess
import sys

from conftest import ROOT

import dcptool
from dcptool.errors import DcptoolError


def test_one_exception_root():
    from dcptool.check.replay import LimitError
    from dcptool.dcp.backend import BackendError
    from dcptool.dump import DumpError, OutputExistsError, WriteError
    from dcptool.dump.schema import DcptoolError
    from dcptool.errors import UsageError
    from dcptool.inputs import InputError
    from dcptool.model.config import SimError

    for cls in (DumpError, WriteError, OutputExistsError, LimitError, SimError, BackendError, UsageError,
                InputError):
        assert issubclass(cls, DcptoolError), cls
    # the old bases stay, for callers that catch them
    assert issubclass(DumpError, ValueError) and issubclass(SimError, ValueError)
    assert issubclass(BackendError, RuntimeError) and issubclass(WriteError, OSError)


def test_every_public_error_class_of_dcptool_derives_from_the_root():
    """Every public exception class a module of dcptool defines (walked, not listed: a new one is caught too)."""
    found = {}
    for m in pkgutil.walk_packages(dcptool.__path__, "dcptool."):
        if m.name.endswith(("_tl", "__main__")):  # kernels: through dcp.backend.load only; __main__ runs the CLI
            continue
        mod = importlib.import_module(m.name)
        for name, obj in vars(mod).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == m.name:
                if not name.startswith("_"):  # (a private exception: control flow inside its module)
                    found[f"{m.name}.{name}"] = obj
    assert {"dcptool.dump.schema.DumpError", "dcptool.dcp.backend.BackendError", "dcptool.model.config.SimError",
            "dcptool.diagnose.export.ExportError", "dcptool.diagnose.reduce.ReduceError",
            "dcptool.check.replay.LimitError", "dcptool.errors.UsageError",
            "dcptool.inputs.InputError"} <= set(found), sorted(found)
    assert [k for k, cls in found.items() if cls is not DcptoolError and not issubclass(cls, DcptoolError)] == []


def test_the_package_names_the_root_lazily():
    assert dcptool.DcptoolError is DcptoolError and "DcptoolError" in dcptool.__all__


def test_errors_imports_the_standard_library_only():
    """cli.py imports it for `dcptool --help`: a fresh process importing it loads nothing outside the stdlib."""
    script = ("import sys; import dcptool.errors; "
              "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numpy', 'torch', 'triton', 'typer', "
              "'rich', 'safetensors') or (m.startswith('dcptool.') and m != 'dcptool.errors')))")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and r.stdout == "[]\n", (r.stdout, r.stderr[-2000:])
