"""gpu/cubin.py: Triton kernels compiled for the GPU (here: for Hopper, sm_90, on a machine without one) and
kept in dcptool's own cache (written by the dump's one atomic write), read back by a fresh process without
importing triton; each cubin declares the parameters the launch packs; a compile that fails is one line. Compiles
run in fresh processes: this one's triton may be the interpreter's."""

import base64
import json
import os
import struct
import subprocess
import sys

import pytest
from conftest import ROOT

from dcptool.dcp.fused import TL
from dcptool.gpu import cubin
from dcptool.gpu.cuda import CudaError
from dcptool.gpu.scan_cuda import SIGNATURES, size_of

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


def _declared_parameters(elf: bytes, name: str) -> list[int]:
    """The byte size of each parameter of kernel `name`, by ordinal, as its cubin declares them to the driver (the
    table cuKernelGetParamInfo reads): the EIATTR_KPARAM_INFO attributes of ELF section `.nv.info.<name>`. An
    attribute is a format byte, an attribute byte and a 16-bit field; a sized one (format 4) has that many bytes
    after it, for KPARAM_INFO (0x17): index u32, ordinal u16, offset u16, flags u32 (the size in bits 18-31)."""
    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    entsize, count, names = struct.unpack_from("<HHH", elf, 0x3A)
    sections = [struct.unpack_from("<I4xQQQQ", elf, shoff + i * entsize) for i in range(count)]
    table = sections[names][3]
    title = f".nv.info.{name}\0".encode()
    ((at, size),) = [(off, n) for name_at, _, _, off, n in sections if elf[table + name_at:].startswith(title)]
    sizes, end = {}, at + size
    while at < end:
        fmt, attr, n = struct.unpack_from("<BBH", elf, at)
        if fmt == 4 and attr == 0x17:
            _, ordinal, _, flags = struct.unpack_from("<IHHI", elf, at + 4)
            sizes[ordinal] = flags >> 18
        at += 4 + (n if fmt == 4 else 0)
    assert sorted(sizes) == list(range(len(sizes)))
    return [sizes[i] for i in range(len(sizes))]


@pytest.mark.parametrize("name,const", [("flag_rows_kernel", CONST), ("check_rows_kernel", CONST),
                                        ("differ_rows_kernel", {"BLOCK": 256})])
def test_each_cubin_declares_the_parameters_its_launch_packs(tmp_path, name, const):
    """The cubin dcptool caches declares, in order, the sizes the launch packs (8 for a pointer or an i64, 4 for
    an i32), then Triton's 8-byte scratch pointers: what the driver reads back on a GPU (Fn refuses any other
    layout), here from the ELF itself."""
    _compile(tmp_path, name, const)
    (entry,) = (tmp_path / "cache" / "kernels").glob("*.json")
    declared = _declared_parameters(base64.b64decode(json.loads(entry.read_text())["cubin"]), name)
    sig = [size_of(t) for t in SIGNATURES[name].values()]
    assert declared[: len(sig)] == sig and declared[len(sig):] == [8] * (len(declared) - len(sig))
    assert 4 in sig or name != "check_rows_kernel"  # (n_ids: the one 4-byte parameter, packed as int32)


BROKEN = """
import json, sys
import triton
from dcptool.dcp.fused import TL
from dcptool.gpu import cubin
from dcptool.gpu.cuda import CudaError
from dcptool.gpu.scan_cuda import SIGNATURES

def broken(*a, **k):
    raise RuntimeError("PTXAS error: Internal Triton PTX codegen error\\n`ptxas` stderr:\\nptxas fatal: sm_999")

triton.compile = broken
try:
    cubin.kernel(TL, "differ_rows_kernel", SIGNATURES["differ_rows_kernel"], {"BLOCK": 256}, 2, 999)
except CudaError as e:
    print(json.dumps([e.what, str(e)]))
"""


def test_a_compile_that_fails_is_one_line(tmp_path):
    """A GPU this Triton cannot compile for (or its ptxas failing): one CudaError line, so `auto` can replay on the
    CPU and `triton` exits 2, never a traceback. (A fresh process: this one's triton may be the interpreter's.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="", DCPTOOL_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", BROKEN], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    what, line = json.loads(r.stdout.splitlines()[-1])
    assert what == ("compiling kernel differ_rows_kernel for sm_999 failed: RuntimeError: PTXAS error: Internal Triton "
                    "PTX codegen error `ptxas` stderr: ptxas fatal: sm_999")
    assert line == f"{what}; use --backend torch to replay on the CPU"
    assert not list((tmp_path / "cache").rglob("*.json"))  # (nothing cached)


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
    with pytest.raises(CudaError, match="^TRITON_INTERPRET=1 is set: .*; unset it$"):
        cubin._compile(TL, "differ_rows_kernel", SIGNATURES["differ_rows_kernel"], {"BLOCK": 256}, 2, 90)
