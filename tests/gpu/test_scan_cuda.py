"""gpu/scan_cuda.py: the GPU scan. Here: its kernels' signatures against their source, the typed launch and the
parameter-size check (on a stand-in device), the staging of chunks and the whole scan under Triton's interpreter
(kernel tests). On a GPU (marked `cuda`): the scan at any chunking and the pairs' comparison against the reference
and the CPU path, a streamed read, and a fresh `dcptool replay` that never imports torch and finds what the CPU
path finds."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import random_dump
from scan_cases import Future, as_array, pair_dump, reference_stats, streamed_scan_agrees

from dcptool.check import scan as scan_mod
from dcptool.dcp import fused
from dcptool.dcp.segments import obs_chunks
from dcptool.dump import open_dumps
from dcptool.gpu import cubin, cuda, scan_cuda, staging

CHUNKS = [0, 1, 127, 128, 129, 1000, 5000]
gpu = pytest.mark.skipif(not cuda.available(), reason="needs a CUDA GPU")


def test_each_signature_names_its_kernels_runtime_arguments_in_order():
    """The launches pass arguments by position: a kernel edited in fused_tl.py (an argument added, moved or
    retyped between pointer and integer) must be edited here too."""
    src = Path(fused.__file__).with_name("fused_tl.py").read_text()
    defs = {f.name: f for f in ast.parse(src).body if isinstance(f, ast.FunctionDef)}
    for name, sig in scan_cuda.SIGNATURES.items():
        args = defs[name].args.args
        const = [isinstance(a.annotation, ast.Attribute) and a.annotation.attr == "constexpr" for a in args]
        runtime = [a.arg for a, c in zip(args, const) if not c]
        assert list(sig) == runtime, name
        assert all(t.startswith("*") == a.endswith("_ptr") for a, t in sig.items()), name
    assert [scan_cuda.size_of(t) for t in ("*i32", "*i64", "i32", "i64")] == [8, 8, 4, 8]


class _Device:
    """A stand-in for gpu.cuda.Gpu: the driver's parameter sizes as given, launches recorded."""

    cc = 90

    def __init__(self, sizes):
        self.sizes, self.launched = sizes, []

    def kernel(self, cubin_bytes, name):
        return ("kernel", name)

    def parameter_sizes(self, kernel):
        return self.sizes

    def launch(self, kernel, stream, grid, threads, shared, args):
        self.launched.append((kernel, stream, grid, threads, shared, args))


def _cached(monkeypatch, scratch=0, shared=0):
    monkeypatch.setattr(cubin, "kernel", lambda *a: cubin.Kernel("check_rows_kernel", b"\x7fELF", 128, shared, scratch))


def test_a_launch_types_each_argument_by_the_signature_and_nulls_the_scratch_pointers(monkeypatch):
    _cached(monkeypatch)
    sig = list(scan_cuda.SIGNATURES["check_rows_kernel"].values())
    g = _Device(tuple(scan_cuda.size_of(t) for t in sig) + (8, 8))
    fn = scan_cuda.Fn(g, "check_rows_kernel", {}, 4)
    bufs = [object() for _ in sig]
    fn.launch("stream", 0, *bufs)  # no program: nothing launched
    fn.launch("stream", 7, *bufs[:2], 5, *bufs[3:])
    ((kernel, stream, grid, threads, shared, args),) = g.launched
    assert (kernel, stream, grid, threads, shared) == (("kernel", "check_rows_kernel"), "stream", 7, 128, 0)
    assert args[:2] == tuple(bufs[:2]) and args[3:-2] == tuple(bufs[3:]) and args[-2:] == (0, 0)
    assert type(args[2]) is np.int32 and args[2] == 5  # n_ids: i32, not a Python int (which passes as a pointer)


@pytest.mark.parametrize("sizes", [(8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8), (8, 8, 4), (8, 8, 4, 8, 8, 8, 8, 8, 8, 8, 8, 4)])
def test_a_kernel_whose_parameters_differ_from_its_signature_is_refused(monkeypatch, sizes):
    """A Triton that lays the parameters out otherwise (an i32 passed in 8 bytes, one missing, a 4-byte extra) is
    a one-line CudaError before any launch."""
    _cached(monkeypatch)
    with pytest.raises(cuda.CudaError, match="compiled kernel check_rows_kernel: parameters of"):
        scan_cuda.Fn(_Device(sizes), "check_rows_kernel", {}, 4)


@pytest.mark.parametrize("scratch,shared,what", [(64, 0, "scratch memory"), (0, 64 * 1024, "shared memory")])
def test_a_kernel_needing_what_the_launch_does_not_give_is_refused(monkeypatch, scratch, shared, what):
    _cached(monkeypatch, scratch, shared)
    with pytest.raises(cuda.CudaError, match=what):
        scan_cuda.Fn(_Device((8,) * 11), "check_rows_kernel", {}, 4)


# --------------------------------------------------------------------------------------------
# The pipelined transfer: chunks of whole observations, double-buffered staging (staging.Chunks). On the GPU the
# slots are pinned and copied through cuda-core (CudaScan); under the interpreter they are ordinary buffers
# (InterpretedScan), driven here as gpu_scan drives them.


def _walk(run, n_chunks):
    """Drive a scan as gpu_scan does (load k+1 before using k) and return each chunk's buffers."""
    out = []
    if n_chunks:
        run.load(0)
    for k in range(n_chunks):
        if k + 1 < n_chunks:
            run.load(k + 1)
        out.append({key: run.host[k % 2][key][:n].copy() for key, n in run.n[k % 2].items()})
    run.close()
    return out


def _chunks(d, target):
    return obs_chunks(np.diff(d["obs.rows"]), target)


@pytest.mark.parametrize("target", CHUNKS)
def test_staging_hands_out_every_chunk_whole_and_in_order(tmp_path, monkeypatch, target):
    """Chunks cut only between observations (a target smaller than an observation still takes it whole),
    cover every row once, and chunk k's buffers are intact after chunk k+1 was loaded into the other slot;
    staging copies split across threads (pieces of 7 elements here) land where they belong."""
    monkeypatch.setattr(staging, "PIECE", 7)
    d = random_dump(tmp_path / "d.safetensors", np.random.default_rng(3), 80, 4, 2)
    rows, drows = d["obs.rows"], d["obs.dcp_rows"]
    chunks = _chunks(d, target)
    got = _walk(scan_cuda.InterpretedScan(staging.Chunks(d, chunks), 4, 2, 16), len(chunks))
    assert [c[0] for c in chunks] == [0] + [c[1] for c in chunks[:-1]] and chunks[-1][1] == d.n
    if 1 <= target < 128:
        assert len(chunks) > 40  # nearly one observation a chunk: the slots are reused many times
    for (lo, hi), g in zip(chunks, got):
        assert np.array_equal(g["seq"], d["rows.seq_lens"][rows[lo] : rows[hi]])
        assert np.array_equal(g["dcp"], d["rows.dcp_local_seq_lens"][drows[lo] : drows[hi]])
        assert np.array_equal(g["kv"], d["rows.kv_pages"][rows[lo] : rows[hi]])
        assert np.array_equal(g["rows"], rows[lo : hi + 1] - rows[lo])
        assert np.array_equal(g["drows"], drows[lo : hi + 1] - drows[lo])
        for key, col in (("nr", "obs.num_reqs"), ("nrp", "obs.num_reqs_padded"), ("rank", "obs.rank")):
            assert np.array_equal(g[key], d[col][lo:hi])
    assert sum(g["seq"].size for g in got) == rows[-1]


@pytest.mark.kernel
@pytest.mark.parametrize("target", CHUNKS)
def test_triton_scan_in_chunks_equals_reference(tmp_path, monkeypatch, target):
    monkeypatch.setattr(scan_cuda, "GPU_CHUNK_ROWS", target)
    d = random_dump(tmp_path / "d.safetensors", np.random.default_rng(11), 60, 4, 16)
    want_obs, want = reference_stats(d)
    got_obs, got = as_array(scan_mod.scan(d, "triton"))
    assert np.array_equal(got_obs, want_obs) and np.array_equal(got, want) and want_obs.size


@pytest.mark.kernel
@pytest.mark.parametrize("n", [0, 1, 5])
def test_triton_scan_of_empty_dumps(tmp_path, monkeypatch, n):
    """No observations, or observations of no rows at all: no chunk to stage, or chunks of nothing."""
    from dcptool.dump import DumpConfig, write_dump

    monkeypatch.setattr(scan_cuda, "GPU_CHUNK_ROWS", 1)
    z = np.zeros(n, np.int32)
    cols = {"obs.step": np.arange(n, dtype=np.int64), "obs.site": z, "obs.rank": z, "obs.ubatch": z - 1,
            "obs.num_reqs": z, "obs.num_reqs_padded": z, "obs.rows": np.zeros(n + 1, np.int64),
            "rows.seq_lens": np.zeros(0, np.int32), "obs.has_dcp": np.ones(n, np.uint8),
            "obs.dcp_rows": np.zeros(n + 1, np.int64), "rows.dcp_local_seq_lens": np.zeros(0, np.int32)}
    write_dump(tmp_path / "e.safetensors", DumpConfig(dcp_size=2, sites=("x",)), cols)
    d = open_dumps([str(tmp_path / "e.safetensors")])
    for backend in ("triton", "torch"):
        assert scan_mod.scan(d, backend).obs.size == 0


@pytest.mark.kernel
def test_triton_scan_of_rollover_files_read_lazily(tmp_path, monkeypatch):
    """Several files merged lazily (rows gathered from the files per chunk): the staged chunks are those rows."""
    from conftest import rollover_files as _rollover

    monkeypatch.setattr(scan_cuda, "GPU_CHUNK_ROWS", 700)
    paths = _rollover(tmp_path, np.random.default_rng(2), n=80, files=3, sorted_steps=False)
    lazy = open_dumps(paths, bounded=True)
    want_obs, want = reference_stats(open_dumps(paths, bounded=False))
    got_obs, got = as_array(scan_mod.scan(lazy, "triton", bounded=True))
    assert lazy.bounded and np.array_equal(got_obs, want_obs) and np.array_equal(got, want) and want_obs.size


@pytest.mark.kernel
@pytest.mark.parametrize("target", [1, 129, 1000, 1 << 22])
def test_triton_scan_compares_pairs_exactly(tmp_path, monkeypatch, target):
    monkeypatch.setattr(scan_cuda, "GPU_CHUNK_ROWS", target)
    d, pairs, want = pair_dump(tmp_path / "d.safetensors", np.random.default_rng(4), n=120)
    assert np.array_equal(scan_mod.scan(d, "triton", pairs=pairs).differ, want) and want.size
    # the pairs known only after the first chunks (the rest compared after the scan)
    assert np.array_equal(scan_mod.scan(d, "triton", pairs=Future(pairs)).differ, want)


@pytest.mark.kernel
def test_triton_scan_of_a_streamed_read(tmp_path, monkeypatch):
    monkeypatch.setattr(scan_cuda, "GPU_CHUNK_ROWS", 700)
    streamed_scan_agrees(tmp_path, monkeypatch, "triton")


# --------------------------------------------------------------------------------------------
# On a GPU


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("target", CHUNKS + [1 << 22])
def test_cuda_scan_in_chunks_equals_reference(tmp_path, monkeypatch, target):
    monkeypatch.setattr(scan_cuda, "GPU_CHUNK_ROWS", target)
    monkeypatch.setattr(staging, "PIECE", 1000)  # threaded staging on these small chunks too
    d = random_dump(tmp_path / "d.safetensors", np.random.default_rng(5), 400, 4, 16)
    want_obs, want = reference_stats(d)
    got_obs, got = as_array(scan_mod.scan(d, "triton"))
    assert np.array_equal(got_obs, want_obs) and np.array_equal(got, want) and want_obs.size
    cpu_obs, cpu = as_array(scan_mod.scan(d, "torch"))
    assert np.array_equal(got_obs, cpu_obs) and np.array_equal(got, cpu)


@pytest.mark.cuda
@gpu
def test_cuda_scan_uses_the_device_path(tmp_path, monkeypatch):
    """On a GPU the triton backend's scan is CudaScan (cuda-core), never the interpreter's."""
    used = []
    real = scan_cuda.CudaScan.__init__
    monkeypatch.setattr(scan_cuda.CudaScan, "__init__", lambda self, *a: used.append(1) or real(self, *a))
    monkeypatch.setattr(scan_cuda.InterpretedScan, "__init__", lambda *a: pytest.fail("the interpreter ran"))
    d = random_dump(tmp_path / "d.safetensors", np.random.default_rng(6), 50, 2, 1)
    assert scan_mod.scan(d, "triton").obs.size and used == [1]


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("target", [129, 1 << 22])
def test_cuda_scan_compares_pairs_exactly(tmp_path, monkeypatch, target):
    monkeypatch.setattr(scan_cuda, "GPU_CHUNK_ROWS", target)
    d, pairs, want = pair_dump(tmp_path / "d.safetensors", np.random.default_rng(4))
    assert np.array_equal(scan_mod.scan(d, "triton", pairs=pairs).differ, want) and want.size
    assert np.array_equal(scan_mod.scan(d, "triton", pairs=Future(pairs)).differ, want)


@pytest.mark.cuda
@gpu
def test_cuda_scan_of_a_streamed_read(tmp_path, monkeypatch):
    monkeypatch.setattr(scan_cuda, "GPU_CHUNK_ROWS", 700)
    streamed_scan_agrees(tmp_path, monkeypatch, "triton")


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_a_fresh_gpu_replay_never_imports_torch(tmp_path, backend):
    """The GPU path of a fresh `dcptool replay` runs on cuda-core: torch's import is not paid; the findings are
    those of the CPU path. `auto` takes the GPU from scan.GPU_MIN_OBS observations: lowered here to this dump's."""
    random_dump(tmp_path / "d.safetensors", np.random.default_rng(8), 300, 4, 16)
    code = ("import sys, runpy\nimport dcptool.check.scan as s; s.GPU_MIN_OBS = 1\n"
            "sys.argv = ['dcptool', 'replay', sys.argv[1], '--json', '--backend', sys.argv[2]]\n"
            "try:\n    runpy.run_module('dcptool', run_name='__main__')\n"
            "finally:\n    print('torch imported:', 'torch' in sys.modules, file=sys.stderr)")
    got = {}
    for b in (backend, "torch"):
        p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "d.safetensors"), b], capture_output=True,
                           text=True, env={**os.environ, "DCPTOOL_CACHE_DIR": str(tmp_path / "k")})
        assert p.returncode == 1 and "torch imported: False" in p.stderr, p.stderr[-2000:]
        lines = [json.loads(x) for x in p.stdout.splitlines()]
        got[b] = [x for x in lines if x.get("type") == "finding"]
        if b == backend:
            assert lines[-1]["backend"] == "triton" and lines[-1]["device"] == "cuda"
    assert got[backend] == got["torch"] and got["torch"]
    assert list((tmp_path / "k" / "kernels").glob("*.json"))  # the kernels came through dcptool's cubin cache
