"""gpu/cubin.py: Triton kernels compiled for the GPU (here: for Hopper, sm_90, on a machine without one) and
kept in dcptool's own cache (written by the dump's one atomic write), read back by a fresh process without
importing triton. Compiles run in fresh processes: this one's triton may be the interpreter's."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from dcptool.dcp.fused import TL
from dcptool.gpu import cubin
from dcptool.gpu.cuda import CudaError
from dcptool.gpu.scan_cuda import SIGNATURES

CONST = {"DCP_SIZE": 4, "INTERLEAVE": 1, "PAGE": 16, "HAS_PAGES": True, "BLOCK": 256}

COMPILE = """
import json, sys, time
from dcptool.dcp.fused import TL
from dcptool.gpu import cubin
from dcptool.gpu.scan_cuda import SIGNATURES
name, const, warps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
k = cubin.kernel(TL, name, SIGNATURES[name], const, warps, 90)
print(json.dumps({"name": k.name, "elf": k.cubin[:4] == b"\\x7fELF", "threads": k.threads, "shared": k.shared,
                  "scratch": k.scratch, "triton": "triton" in sys.modules}))
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
    assert first["triton"]  # compiled: triton was imported
    entries = list((tmp_path / "cache" / "kernels").glob("*.json"))
    assert len(entries) == 1 and not list((tmp_path / "cache" / "kernels").glob(".*"))  # (no temporary left)
    assert oct(entries[0].stat().st_mode & 0o777) == oct(0o644)
    again = _compile(tmp_path, name, warps=warps)
    assert not again.pop("triton")  # read back: triton not even imported
    assert again == {k: v for k, v in first.items() if k != "triton"}


def test_a_damaged_cache_entry_is_compiled_again(tmp_path):
    first = _compile(tmp_path, "differ_rows_kernel", {"BLOCK": 256})
    (entry,) = (tmp_path / "cache" / "kernels").glob("*.json")
    entry.write_text('{"name": "differ_rows_kernel", "cubin": "not base64!"')
    again = _compile(tmp_path, "differ_rows_kernel", {"BLOCK": 256})
    assert again["triton"] and again["elf"] and again == {**first, "triton": True}
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


def test_an_entry_is_written_by_the_dumps_atomic_write(tmp_path, monkeypatch):
    """One atomic write in dcptool (dump.atomic_write): the cache's entries go through it; one it cannot write
    (here: the write fails) is left out, the kernel returned all the same."""
    from dcptool.dump import WriteError

    monkeypatch.setenv("DCPTOOL_CACHE_DIR", str(tmp_path))
    k = cubin.Kernel("k", b"\x7fELF...", 64, 0, 0)
    calls = []
    monkeypatch.setattr(cubin, "atomic_write", lambda path, chunks, **kw: calls.append((path, b"".join(chunks))))
    cubin._write(cubin.cache_dir() / "x.json", k)
    ((path, data),) = calls
    assert path == tmp_path / "kernels" / "x.json" and json.loads(data)["name"] == "k"

    def full(path, chunks, **kw):
        raise WriteError(f"{path}: cannot write: No space left on device")

    monkeypatch.setattr(cubin, "atomic_write", full)
    cubin._write(cubin.cache_dir() / "y.json", k)  # (no error: the kernel is compiled again next time)
    monkeypatch.undo()
    monkeypatch.setenv("DCPTOOL_CACHE_DIR", str(tmp_path))
    cubin._write(cubin.cache_dir() / "z.json", k)
    assert cubin._read(cubin.cache_dir() / "z.json") == k and cubin._read(cubin.cache_dir() / "y.json") is None


def test_compiling_under_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(CudaError, match="TRITON_INTERPRET=1"):
        cubin._compile(TL, "differ_rows_kernel", SIGNATURES["differ_rows_kernel"], {"BLOCK": 256}, 2, 90)
