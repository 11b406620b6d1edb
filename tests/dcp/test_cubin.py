"""dcp/cubin.py: Triton kernels compiled for the GPU (here: for Hopper, sm_90, on a machine without one) and
kept in dcptool's own cache, read back by a fresh process without importing triton. Compiles run in fresh
processes: this one's triton may be the interpreter's."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from dcptool.check.scan_cuda import SIGNATURES, TL
from dcptool.dcp import cubin
from dcptool.dcp.cuda import CudaError

CONST = {"DCP_SIZE": 4, "INTERLEAVE": 1, "PAGE": 16, "HAS_PAGES": True, "BLOCK": 256}

COMPILE = """
import json, sys, time
from dcptool.check.scan_cuda import SIGNATURES, TL
from dcptool.dcp import cubin
name, const, warps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
k = cubin.kernel(TL, name, SIGNATURES[name], const, warps, 90)
print(json.dumps({"name": k.name, "elf": k.cubin[:4] == b"\\x7fELF", "params": k.params, "threads": k.threads,
                  "shared": k.shared, "scratch": k.scratch, "triton": "triton" in sys.modules}))
"""


def _compile(tmp_path, name, const=CONST, warps=2):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", DCPTOOL_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", COMPILE, name, json.dumps(const), str(warps)], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


@pytest.mark.parametrize("name,warps", [("flag_rows_kernel", 2), ("check_rows_kernel", 4)])
def test_a_kernel_compiles_for_hopper_then_comes_from_the_cache_without_triton(tmp_path, name, warps):
    first = _compile(tmp_path, name, warps=warps)
    assert first["name"] == name and first["elf"] and first["threads"] == 32 * warps and first["scratch"] == 0
    sig = list(SIGNATURES[name].values())
    # one parameter per runtime argument (pointers and i64 8 bytes, i32 4), then Triton's scratch pointers
    assert first["params"][: len(sig)] == [4 if t == "i32" else 8 for t in sig]
    assert all(p == 8 for p in first["params"][len(sig):])
    assert first["triton"]  # compiled: triton was imported
    entries = list((tmp_path / "cache" / "kernels").glob("*.json"))
    assert len(entries) == 1 and not list((tmp_path / "cache" / "kernels").glob(".tmp-*"))
    again = _compile(tmp_path, name, warps=warps)
    assert not again.pop("triton")  # read back: triton not even imported
    assert again == {k: v for k, v in first.items() if k != "triton"}


def test_a_damaged_cache_entry_is_compiled_again(tmp_path):
    first = _compile(tmp_path, "differ_rows_kernel", {"BLOCK": 256})
    (entry,) = (tmp_path / "cache" / "kernels").glob("*.json")
    entry.write_text('{"name": "differ_rows_kernel", "cubin": "not base64!"')
    again = _compile(tmp_path, "differ_rows_kernel", {"BLOCK": 256})
    assert again["triton"] and again["elf"] and again["params"] == first["params"]
    assert json.loads(entry.read_text())["name"] == "differ_rows_kernel"  # rewritten whole


def test_an_unwritable_cache_only_costs_the_compile(tmp_path):
    (tmp_path / "cache").write_text("a file where the cache directory would be")
    got = _compile(tmp_path, "differ_rows_kernel", {"BLOCK": 256})
    assert got["elf"] and got["triton"]


def test_the_key_changes_with_everything_the_cubin_depends_on(monkeypatch):
    sig = SIGNATURES["flag_rows_kernel"]
    base = cubin.key(TL, "flag_rows_kernel", sig, CONST, 2, 90)
    assert base == cubin.key(TL, "flag_rows_kernel", dict(sig), dict(CONST), 2, 90)
    others = [cubin.key(TL, "check_rows_kernel", sig, CONST, 2, 90),
              cubin.key(TL, "flag_rows_kernel", sig, {**CONST, "DCP_SIZE": 8}, 2, 90),
              cubin.key(TL, "flag_rows_kernel", sig, {**CONST, "HAS_PAGES": False}, 2, 90),
              cubin.key(TL, "flag_rows_kernel", {**sig, "kv_ptr": "*i64"}, CONST, 2, 90),
              cubin.key(TL, "flag_rows_kernel", sig, CONST, 4, 90),
              cubin.key(TL, "flag_rows_kernel", sig, CONST, 2, 100)]
    monkeypatch.setattr(cubin, "_sources", lambda: "a kernel module edited")
    others.append(cubin.key(TL, "flag_rows_kernel", sig, CONST, 2, 90))
    assert len({base, *others}) == 1 + len(others)


def test_the_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DCPTOOL_CACHE_DIR", str(tmp_path / "a"))
    assert cubin.cache_dir() == tmp_path / "a" / "kernels"
    monkeypatch.delenv("DCPTOOL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cubin.cache_dir() == tmp_path / "x" / "dcptool" / "kernels"


PTX = """
.visible .entry k(
\t.param .u64 .ptr .global .align 1 k_param_0,
\t.param .u32 k_param_1,
\t.param .u64 .ptr .global .align 1 k_param_2
)
.reqntid 64
{
\tld.param.u32 %r1, [k_param_1];
}
"""


def test_parameters_are_read_from_the_entry_point():
    assert cubin.params_of(PTX, "k") == (8, 4, 8)
    with pytest.raises(CudaError, match="no entry point"):
        cubin.params_of(PTX, "other")


def test_compiling_under_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(CudaError, match="TRITON_INTERPRET=1"):
        cubin._compile(TL, "differ_rows_kernel", SIGNATURES["differ_rows_kernel"], {"BLOCK": 256}, 2, 90)
