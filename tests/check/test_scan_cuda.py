"""check/scan_cuda.py: the GPU scan on the CUDA driver. Its kernels' signatures against their source (here);
on a GPU: the scan at any chunking and the pairs' comparison against the reference and the CPU path, and a
fresh `dcptool replay` that never imports torch."""

import ast
from pathlib import Path

import numpy as np
import pytest
from conftest import random_dump
from test_scan import CHUNKS, _Future, _pair_dump, as_array, reference_stats

from dcptool.check import scan as scan_mod
from dcptool.check.scan_cuda import SIGNATURES
from dcptool.dcp import cuda as cuda_mod


def test_each_signature_names_its_kernels_runtime_arguments_in_order():
    """The driver's launches pass arguments by position: a kernel edited in gpu_tl.py (an argument added,
    moved or retyped between pointer and integer) must be edited here too."""
    src = Path(scan_mod.__file__).with_name("gpu_tl.py").read_text()
    defs = {f.name: f for f in ast.parse(src).body if isinstance(f, ast.FunctionDef)}
    for name, sig in SIGNATURES.items():
        args = defs[name].args.args
        const = [isinstance(a.annotation, ast.Attribute) and a.annotation.attr == "constexpr" for a in args]
        runtime = [a.arg for a, c in zip(args, const) if not c]
        assert list(sig) == runtime, name
        assert all(t.startswith("*") == a.endswith("_ptr") for a, t in sig.items()), name


cuda = pytest.mark.skipif(not cuda_mod.available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_a_fresh_gpu_replay_never_imports_torch(tmp_path, backend):
    """The GPU path of a fresh `dcptool replay` runs on the CUDA driver: torch's import (1.8 s on the H200's
    host) is not paid (issue 28 item 9); the findings are those of the CPU path."""
    import json
    import subprocess
    import sys

    random_dump(tmp_path / "d.safetensors", np.random.default_rng(8), 300, 4, 16)
    code = ("import sys, runpy; sys.argv = ['dcptool', 'replay', sys.argv[1], '--json', '--backend', sys.argv[2]]\n"
            "try:\n    runpy.run_module('dcptool', run_name='__main__')\n"
            "finally:\n    print('torch imported:', 'torch' in sys.modules, file=sys.stderr)")
    got = {}
    for b in (backend, "torch"):
        p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "d.safetensors"), b], capture_output=True,
                           text=True, env={**__import__("os").environ, "DCPTOOL_CACHE_DIR": str(tmp_path / "k")})
        assert p.returncode == 1 and "torch imported: False" in p.stderr, p.stderr[-2000:]
        lines = [json.loads(x) for x in p.stdout.splitlines()]
        got[b] = [x for x in lines if x.get("type") == "finding"]
        if b == backend and backend == "triton":
            assert lines[-1]["device"] == "cuda"
    assert got[backend] == got["torch"] and got["torch"]


@cuda
@pytest.mark.parametrize("target", CHUNKS + [1 << 22])
def test_cuda_scan_in_chunks_equals_reference(tmp_path, monkeypatch, target):
    from dcptool.check import staging

    monkeypatch.setattr(scan_mod, "GPU_CHUNK_ROWS", target)
    monkeypatch.setattr(staging, "PIECE", 1000)  # threaded staging on these small chunks too
    d = random_dump(tmp_path / "d.safetensors", np.random.default_rng(5), 400, 4, 16)
    want_obs, want = reference_stats(d)
    got_obs, got = as_array(scan_mod.scan(d, "triton"))
    assert np.array_equal(got_obs, want_obs) and np.array_equal(got, want) and want_obs.size
    cpu_obs, cpu = as_array(scan_mod.scan(d, "torch"))
    assert np.array_equal(got_obs, cpu_obs) and np.array_equal(got, cpu)


@cuda
@pytest.mark.parametrize("target", [129, 1 << 22])
def test_cuda_scan_compares_pairs_exactly(tmp_path, monkeypatch, target):
    monkeypatch.setattr(scan_mod, "GPU_CHUNK_ROWS", target)
    d, pairs, want = _pair_dump(tmp_path / "d.safetensors", np.random.default_rng(4))
    assert np.array_equal(scan_mod.scan(d, "triton", pairs=pairs).differ, want) and want.size
    assert np.array_equal(scan_mod.scan(d, "triton", pairs=_Future(pairs)).differ, want)


