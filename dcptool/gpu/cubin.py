"""Triton kernels compiled to cubins for gpu.cuda's launches, kept in dcptool's own cache between processes.

A fresh process that finds its kernel here loads it without importing triton or computing Triton's own cache key
(which hashes Triton's compiler). The key is what the cubin depends on: every `*_tl.py` kernel module of dcptool
byte for byte, Triton's version, the kernel, its signature and constants, its warps and the GPU's compute
capability. A missing, unreadable or corrupt entry is compiled again and written atomically (dump.atomic_write);
an unwritable cache directory only costs the compile. The parameters' sizes are the driver's to read from the
loaded cubin (gpu.cuda.Gpu.parameter_sizes), not the cache's.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib
import json
import os
import warnings
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from dcptool.dcp.backend import interpreted
from dcptool.dump import atomic_write
from dcptool.gpu.cuda import CudaError

CACHE_FORMAT = 2  # bump when an entry's fields change
_PKG = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Kernel:
    """A compiled kernel: its symbol, the cubin, threads per program and shared memory."""

    name: str
    cubin: bytes
    threads: int
    shared: int
    scratch: int  # Triton's own scratch memory per program (0 for every dcptool kernel; launches refuse more)


def cache_dir() -> Path:
    """$DCPTOOL_CACHE_DIR, else $XDG_CACHE_HOME/dcptool, else ~/.cache/dcptool; kernels under `kernels/`."""
    base = os.environ.get("DCPTOOL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "dcptool")
    return Path(base) / "kernels"


@functools.cache
def _sources() -> str:
    h = hashlib.sha256()
    for p in sorted(_PKG.rglob("*_tl.py")):
        h.update(p.relative_to(_PKG).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    try:
        h.update(metadata.version("triton").encode())
    except metadata.PackageNotFoundError:
        pass
    return h.hexdigest()


def key(module: str, name: str, signature: dict[str, str], constants: dict[str, object], warps: int,
        cc: int) -> str:
    """The cache key of one compiled kernel (hex)."""
    spec = json.dumps([CACHE_FORMAT, _sources(), module, name, signature, {k: str(v) for k, v in constants.items()},
                       warps, cc], sort_keys=True)
    return hashlib.sha256(spec.encode()).hexdigest()[:40]


def kernel(module: str, name: str, signature: dict[str, str], constants: dict[str, object], warps: int,
           cc: int) -> Kernel:
    """`module.name` compiled for compute capability `cc`: from the cache, else compiled and cached.

    `signature` maps each runtime argument, in order, to Triton's type ("*i32", "i64", ...); `constants`
    gives every constexpr argument its value."""
    k = key(module, name, signature, constants, warps, cc)
    path = cache_dir() / f"{k}.json"
    got = _read(path)
    if got is None:
        got = _compile(module, name, signature, constants, warps, cc)
        _write(path, got)
    return got


def _read(path: Path) -> Kernel | None:
    try:
        e = json.loads(path.read_text())
        return Kernel(e["name"], base64.b64decode(e["cubin"], validate=True), int(e["threads"]), int(e["shared"]),
                      int(e["scratch"]))
    except (OSError, ValueError, KeyError, TypeError):  # missing or damaged: compiled again
        return None


def _write(path: Path, k: Kernel) -> None:
    entry = {"name": k.name, "cubin": base64.b64encode(k.cubin).decode(), "threads": k.threads, "shared": k.shared,
             "scratch": k.scratch}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, [json.dumps(entry).encode()])
    except OSError:  # (WriteError too) a read-only home: the kernel is compiled again next time, nothing else changes
        pass


def _compile(module: str, name: str, signature: dict[str, str], constants: dict[str, object], warps: int,
             cc: int) -> Kernel:
    if interpreted():
        raise CudaError("TRITON_INTERPRET=1 is set: the kernels cannot be compiled for the GPU", "unset it")
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:  # pragma: no cover - triton is a Linux dependency
        raise CudaError(f"triton is not installed ({e})") from None
    fn = getattr(importlib.import_module(module), name)
    sig = {**signature, **{c: "constexpr" for c in constants}}
    try:
        with warnings.catch_warnings():  # (3.9 warns of its floating-point fusion default: these kernels are integer)
            warnings.simplefilter("ignore")
            ck = triton.compile(ASTSource(fn, sig, constants), target=GPUTarget("cuda", cc, 32),
                                options={"num_warps": warps})
    except Exception as e:  # (a GPU this Triton cannot compile for, its ptxas failing): the GPU scan cannot start
        words = " ".join(str(e).split())[:300] or type(e).__name__
        raise CudaError(f"compiling kernel {name} for sm_{cc} failed: {type(e).__name__}: {words}") from None
    md = ck.metadata
    scratch = int(getattr(md, "global_scratch_size", 0) or 0) + int(getattr(md, "profile_scratch_size", 0) or 0)
    return Kernel(md.name, bytes(ck.asm["cubin"]), 32 * md.num_warps * getattr(md, "num_ctas", 1), int(md.shared),
                  scratch)
