"""dcp/backend.py: where Triton kernels run: the interpreter switch, the device, load() (the one place triton is
first imported) and its BackendError when triton was imported without the interpreter and there is no GPU.
What imports triton or sets TRITON_INTERPRET runs in a fresh process: this one's triton is decided once."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from dcptool.dcp import backend
from dcptool.errors import DcptoolError


def _fresh(script: str, **env) -> list[str]:
    """`script` in a fresh Python, no GPU, no TRITON_INTERPRET (unless `env` sets it): the lines it printed."""
    e = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    e.update({"PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}, **env)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=e, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.splitlines()


@pytest.mark.parametrize("value,want", [("1", True), ("0", False), ("true", False), ("", False), (None, False)])
def test_interpreted_is_TRITON_INTERPRET_set_to_1(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    assert backend.interpreted() is want


@pytest.mark.parametrize("gpu", [False, True])
def test_device_is_the_gpu_when_there_is_one_else_the_cpu(monkeypatch, gpu):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    assert backend.device() == torch.device("cuda" if gpu else "cpu")


def test_load_without_a_gpu_switches_the_interpreter_on_before_triton_is_imported():
    out = _fresh("""
import os, sys
from dcptool.dcp import backend
print("triton" in sys.modules, backend.interpreted(), backend.device())
k = backend.load("dcptool.dcp.kernel_tl")
print("triton" in sys.modules, os.environ.get("TRITON_INTERPRET"), backend.interpreted(), k.__name__)
print(backend.load("dcptool.dcp.kernel_tl") is k, hasattr(k, "dcp_local_seq_lens_kernel"))
""")
    assert out == ["False False cpu", "True 1 True dcptool.dcp.kernel_tl", "True True"]


def test_load_with_the_interpreter_already_on_takes_triton_imported_first():
    out = _fresh("""
import triton
from dcptool.dcp import backend
print(backend.load("dcptool.dcp.kernel_tl").__name__)
""", TRITON_INTERPRET="1")
    assert out == ["dcptool.dcp.kernel_tl"]


def test_load_with_a_gpu_leaves_the_interpreter_off():
    """With a GPU (pretended: the module loaded is a stdlib one, nothing is launched) the interpreter stays off."""
    out = _fresh("""
import os, sys, torch
torch.cuda.is_available = lambda: True
from dcptool.dcp import backend
m = backend.load("json")
print(m.__name__, "triton" in sys.modules, os.environ.get("TRITON_INTERPRET"), backend.interpreted())
""")
    assert out == ["json True None False"]


def test_triton_imported_without_the_interpreter_and_no_gpu_is_a_backend_error():
    """A process that imported triton itself (the interpreter off) before the first load: the kernels cannot run on
    the CPU any more; load says so in one line and what to do instead."""
    out = _fresh("""
import os, sys, triton
from dcptool.dcp import backend
try:
    backend.load("dcptool.dcp.kernel_tl")
except backend.BackendError as e:
    print(str(e))
    print(type(e).__mro__[1:3], os.environ.get("TRITON_INTERPRET"), "dcptool.dcp.kernel_tl" in sys.modules)
""")
    assert out == ["triton was imported without TRITON_INTERPRET=1 and there is no GPU; set TRITON_INTERPRET=1 before "
                   "starting, or use --backend torch",
                   "(<class 'dcptool.errors.DcptoolError'>, <class 'RuntimeError'>) None False"]
    assert issubclass(backend.BackendError, DcptoolError) and issubclass(backend.BackendError, RuntimeError)
