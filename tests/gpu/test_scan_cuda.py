"""gpu/scan_cuda.py: the GPU scan. Here: its kernels' signatures against their source, the typed launch (packed by
cuda-core's own parameter packing, read back at the kernel's parameter sizes) and the parameter-size check (on a
stand-in device), a start-up that fails giving back what it had, a failure before the first chunk's result as a
CudaStartError (a CPU scan may take its place) and after it not, the staging of chunks and the whole scan under
Triton's interpreter (kernel tests). On a GPU (marked `cuda`): the scan at any chunking and the pairs' comparison
against the reference and the CPU path, on a worker thread too, a streamed read, the driver's parameter sizes, a
real allocation failure at start-up, and a fresh `dcptool replay` that never imports torch and finds what the CPU
path finds."""

import ast
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import random_dump
from scan_cases import Future, as_array, pair_dump, rank_pair_files, reference_stats, streamed_scan_agrees

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
    monkeypatch.setattr(cubin, "kernel", lambda module, name, *a: cubin.Kernel(name, b"\x7fELF", 128, shared, scratch))


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


def _packed(args, sizes):
    """What cuda-core's launch hands the driver for `args` (its own packing, cuda.core's ParamHolder), each
    parameter read back at the size the kernel reads it: a 4-byte integer as int32, 8 bytes as int64."""
    from cuda.core._kernel_arg_handler import ParamHolder

    held = ParamHolder(args)
    at = (ctypes.c_void_p * len(args)).from_address(held.ptr)
    return [(ctypes.c_int32 if n == 4 else ctypes.c_int64).from_address(a).value for a, n in zip(at, sizes)]


@pytest.mark.parametrize("n_ids", [0, 1, 127, 128, 129, 1000, 2**31 - 1])
def test_cuda_core_packs_each_argument_as_the_kernel_reads_it(monkeypatch, n_ids):
    """The launch's arguments, packed by cuda-core itself: each pointer as the buffer's 8-byte address, n_ids as the
    4-byte int32 the kernel reads (cuda-core would pack a Python int as an 8-byte pointer: in a 4-byte slot the
    kernel would read its low half and every later parameter would be misplaced), the scratch pointers null."""
    import cuda.core as cc

    _cached(monkeypatch)
    sig = list(scan_cuda.SIGNATURES["check_rows_kernel"].values())
    sizes = tuple(scan_cuda.size_of(t) for t in sig) + (8, 8)
    g = _Device(sizes)
    fn = scan_cuda.Fn(g, "check_rows_kernel", {}, 4)
    addresses = [0x7F00_0000_0000 + 0x1000 * i for i in range(len(sig))]
    bufs = [cc.Buffer.from_handle(a, 64) for a in addresses]  # (views of no memory: only their addresses travel)
    fn.launch("stream", 3, *bufs[:2], n_ids, *bufs[3:])
    args = g.launched[0][-1]
    assert len(args) == len(sizes) and type(args[2]) is np.int32
    assert _packed(args, sizes) == [*addresses[:2], n_ids, *addresses[3:], 0, 0]
    assert _packed((n_ids,), (8,)) == [n_ids]  # (the premise: a Python int takes 8 bytes)


@pytest.mark.parametrize("cut", [-1, 1])
def test_a_launch_with_an_argument_too_many_or_too_few_is_refused(monkeypatch, cut):
    _cached(monkeypatch)
    sig = list(scan_cuda.SIGNATURES["check_rows_kernel"].values())
    g = _Device(tuple(scan_cuda.size_of(t) for t in sig) + (8, 8))
    fn = scan_cuda.Fn(g, "check_rows_kernel", {}, 4)
    args = [object()] * (len(sig) + cut)
    with pytest.raises(cuda.CudaError, match=f"check_rows_kernel: {len(args)} arguments for {len(sig)} parameters"):
        fn.launch("stream", 5, *args)
    assert g.launched == []


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


class _Gpu(_Device):
    """A stand-in device for CudaScan's set-up: streams, events, pinned and device buffers as names, the call that
    fails (the k-th of `fail`'s kind) and what free() is handed."""

    def __init__(self, fail=None, at=0):
        super().__init__(None)
        self.fail, self.at, self.made, self.freed = fail, at, [], None

    def parameter_sizes(self, kernel):
        return tuple(scan_cuda.size_of(t) for t in scan_cuda.SIGNATURES[kernel[1]].values()) + (8, 8)

    def _make(self, kind):
        if kind == self.fail and sum(m.startswith(kind) for m in self.made) == self.at:
            raise cuda.CudaError(f"CUDA {kind} failed: CUDA_ERROR_OUT_OF_MEMORY: out of memory")
        self.made.append(f"{kind}{len(self.made)}")
        return self.made[-1]

    def bind(self):
        pass

    def stream(self):
        return self._make("stream")

    def event(self):
        return self._make("event")

    def pinned(self, n, dtype):
        return np.zeros(n, dtype), self._make("pinned")

    def alloc(self, nbytes, stream):
        assert stream == self.made[0]  # (ordered on the copy stream)
        return self._make("alloc")

    def sync(self, stream):
        self._make("sync")

    def free(self, buffers, streams, events):
        self.freed = (list(buffers), list(streams), list(events))


def _set_up(monkeypatch, tmp_path, g):
    _cached(monkeypatch)
    monkeypatch.setattr(cuda, "gpu", lambda: g)
    d = random_dump(tmp_path / "d.safetensors", np.random.default_rng(3), 30, 4, 2)
    return staging.Chunks(d, _chunks(d, 100))


@pytest.mark.parametrize("fail,at", [("stream", 0), ("stream", 1), ("event", 3), ("pinned", 0), ("pinned", 9),
                                     ("alloc", 0), ("alloc", 11), ("sync", 0)])
def test_a_start_up_that_fails_gives_back_what_it_had(tmp_path, monkeypatch, fail, at):
    """An allocation that fails midway through CudaScan's set-up (pinned memory the host cannot lock, device memory
    the GPU has not got) frees every stream, event and buffer made before it, then raises that failure: a CPU
    replay after it in the same process has the memory back."""
    g = _Gpu(fail, at)
    with pytest.raises(cuda.CudaError, match=f"CUDA {fail} failed"):
        scan_cuda.CudaScan(_set_up(monkeypatch, tmp_path, g), 4, 2, 16)
    buffers, streams, events = g.freed
    made = [m for m in g.made if not m.startswith("sync")]
    assert buffers + streams + events == sorted(made, key=lambda m: (not m.startswith(("pinned", "alloc")),
                                                                     not m.startswith("stream"), g.made.index(m)))
    assert streams == [m for m in made if m.startswith("stream")] and (not streams or streams[0] == g.made[0])


def test_a_start_up_that_succeeds_frees_it_all_on_close(tmp_path, monkeypatch):
    g = _Gpu()
    c = _set_up(monkeypatch, tmp_path, g)
    run = scan_cuda.CudaScan(c, 4, 2, 16)
    assert g.freed is None and g.made[-1].startswith("sync")  # (the allocations done before any use)
    run.close()
    buffers, streams, events = g.freed
    assert len(streams) == 2 and len(events) == 4 and len(buffers) == 2 * 2 * len(c.sizes) + 8
    assert sorted(buffers + streams + events) == sorted(m for m in g.made if not m.startswith("sync"))


class _Failing:
    """CudaScan's stand-in: chunk `at`'s check fails with a CUDA error (None: none does); its close fails too when
    `close_fails`; what happened is logged."""

    log: list = []

    def __init__(self, chunks, *const, at=None, close_fails=False):
        self.c, self.at, self.close_fails = chunks, at, close_fails

    def load(self, k):
        _Failing.log.append(("load", k))

    def check(self, k):
        _Failing.log.append(("check", k))
        if k == self.at:
            raise cuda.CudaError("CUDA cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE: invalid argument")
        n = self.c.chunks[k][1] - self.c.chunks[k][0]
        return np.array([[0] * n, [-1] * n] * 3, np.int64), np.zeros(0, np.int64)

    def close(self):
        _Failing.log.append(("close",))
        self.c.close()
        if self.close_fails:
            raise cuda.CudaError("CUDA cuStreamSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS")


@pytest.mark.parametrize("at", [None, 0, 1])
@pytest.mark.parametrize("close_fails", [False, True])
def test_only_a_failure_before_the_first_result_may_be_replaced_by_the_cpu(tmp_path, monkeypatch, at, close_fails):
    """gpu_scan raises a CudaStartError for a failure before the first chunk's result was kept (nothing reported,
    no progress: a CPU scan can take the whole scan's place), the CudaError itself after (chunk 0's result is
    out); the first failure is the one raised (a close failing after it does not hide it) and the staging's
    threads end either way."""
    _Failing.log = []
    monkeypatch.setattr(scan_cuda, "GPU_CHUNK_ROWS", 100)
    monkeypatch.setattr(cuda, "available", lambda: True)
    monkeypatch.setattr(scan_cuda, "interpreted", lambda: False)
    monkeypatch.setattr(scan_cuda, "CudaScan", lambda c, *k: _Failing(c, *k, at=at, close_fails=close_fails))
    closed = []
    real_close = staging.Chunks.close
    monkeypatch.setattr(staging.Chunks, "close", lambda self: closed.append(1) or real_close(self))
    d = random_dump(tmp_path / "d.safetensors", np.random.default_rng(3), 60, 4, 2)
    assert len(_chunks(d, 100)) > 3
    done = []
    if at is None and not close_fails:
        scan_cuda.gpu_scan(d, True, done.append)
    else:
        with pytest.raises(cuda.CudaError) as e:
            scan_cuda.gpu_scan(d, True, done.append)
        first = "cuLaunchKernel" if at is not None else "cuStreamSynchronize"
        assert e.value.what.startswith(f"CUDA {first} failed")
        assert isinstance(e.value, cuda.CudaStartError) == (at == 0)
        assert bool(done) == (at != 0)  # (a result was reported: progress moved)
    assert _Failing.log[-1] == ("close",) and closed == [1]
    assert ("check", at) in _Failing.log if at is not None else True


def test_a_start_up_failure_is_a_start_error(tmp_path, monkeypatch):
    """A GPU that fails to start (the context, a kernel, the staging) has reported nothing: a CudaStartError
    carrying the failure's words, and the staging's threads end."""
    monkeypatch.setattr(cuda, "available", lambda: True)
    monkeypatch.setattr(scan_cuda, "interpreted", lambda: False)
    monkeypatch.setattr(cuda, "gpu", lambda: (_ for _ in ()).throw(cuda.CudaError("CUDA device start-up failed: "
                                                                                   "CUDA_ERROR_UNKNOWN")))
    closed = []
    monkeypatch.setattr(staging.Chunks, "close", lambda self: closed.append(1))
    d = random_dump(tmp_path / "d.safetensors", np.random.default_rng(3), 20, 4, 2)
    with pytest.raises(cuda.CudaStartError) as e:
        scan_cuda.gpu_scan(d, True)
    assert str(e.value) == "CUDA device start-up failed: CUDA_ERROR_UNKNOWN; use --backend torch to replay on the CPU"
    assert closed == [1]


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
@pytest.mark.parametrize("read", ["stream", "bounded"])
def test_triton_scan_compares_pairs_across_rank_files(tmp_path, monkeypatch, read):
    """Rank files end to end: each pair lies in another file, outside the staged chunk; the host compares it (while
    the device checks a chunk, or after a bounded scan): the same observations differ."""
    monkeypatch.setattr(scan_cuda, "GPU_CHUNK_ROWS", 1000)
    monkeypatch.setattr(scan_mod, "RUN_ROWS", 200)
    paths, pairs, want = rank_pair_files(tmp_path, np.random.default_rng(3), steps=30)
    d = open_dumps(paths, bounded=read == "bounded", stream=read == "stream")
    assert np.array_equal(scan_mod.scan(d, "triton", pairs=pairs, bounded=d.bounded).differ, want) and want.size


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
def test_cuda_scan_on_a_worker_thread_equals_reference(tmp_path, monkeypatch):
    """The GPU started on this thread, the scan run on another (a library caller's pool): that thread binds the
    context before cuda-core is asked for anything, and the scan equals the reference."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(scan_cuda, "GPU_CHUNK_ROWS", 1000)
    cuda.gpu()
    d = random_dump(tmp_path / "d.safetensors", np.random.default_rng(12), 300, 4, 16)
    want_obs, want = reference_stats(d)
    with ThreadPoolExecutor(1) as ex:
        got_obs, got = as_array(ex.submit(scan_mod.scan, d, "triton").result())
    assert np.array_equal(got_obs, want_obs) and np.array_equal(got, want) and want_obs.size


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("name", list(scan_cuda.SIGNATURES))
def test_the_driver_reads_each_kernels_parameters_as_its_signature_says(tmp_path, monkeypatch, name):
    """cuKernelGetParamInfo (cuda-core's Kernel.arguments_info) on the loaded cubin: the signature's sizes (8 for
    a pointer or an i64, 4 for an i32) in order, then Triton's 8-byte scratch pointers, nulled by each launch."""
    monkeypatch.setenv("DCPTOOL_CACHE_DIR", str(tmp_path / "k"))
    const = ({"BLOCK": fused.FUSED_BLOCK} if name == "differ_rows_kernel" else
             dict(DCP_SIZE=4, INTERLEAVE=2, PAGE=16, HAS_PAGES=True, BLOCK=fused.FUSED_BLOCK))
    g = cuda.gpu()
    fn = scan_cuda.Fn(g, name, const, fused.FUSED_WARPS)
    sizes = g.parameter_sizes(fn.kernel)
    sig = [scan_cuda.size_of(t) for t in scan_cuda.SIGNATURES[name].values()]
    assert list(sizes[: len(sig)]) == sig and list(sizes[len(sig):]) == [8] * len(fn.scratch)
    assert fn.scratch == (0,) * len(fn.scratch)


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


def test_the_gpu_scan_modules_import_no_torch():
    """What a fresh GPU replay loads (the CLI, replay, every module of dcptool.gpu) imports no torch: checked here
    without a GPU, where the test below cannot run."""
    code = ("import importlib, pkgutil, sys, dcptool.gpu as g\n"
            "for m in pkgutil.iter_modules(g.__path__): importlib.import_module('dcptool.gpu.' + m.name)\n"
            "import dcptool.check.replay, dcptool.check.scan, dcptool.cli\n"
            "print(sorted(k for k in sys.modules if k == 'torch' or k.startswith('torch.')))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (p.returncode, p.stdout.strip()) == (0, "[]"), p.stderr[-2000:] or p.stdout[:400]


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


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_a_fresh_replay_whose_kernels_the_driver_refuses(tmp_path, backend):
    """A fresh `dcptool replay` whose cached cubins the driver cannot load (entries that read back whole but hold
    no kernel image: the driver's own error, in a real process): `triton` exits 2 with one line naming
    cuLibraryLoadData; `auto` warns once in one line and replays on the CPU, with the CPU's findings and exit
    code."""
    import base64

    from dcptool.dcp.fused import CHECK_WARPS, FUSED_BLOCK, FUSED_WARPS, TL

    random_dump(tmp_path / "d.safetensors", np.random.default_rng(8), 300, 4, 16)
    cc = cuda.gpu().cc
    const = dict(DCP_SIZE=4, INTERLEAVE=16, PAGE=16, HAS_PAGES=True, BLOCK=FUSED_BLOCK)
    (tmp_path / "k" / "kernels").mkdir(parents=True)
    for name, c, warps in (("flag_rows_kernel", const, FUSED_WARPS), ("check_rows_kernel", const, CHECK_WARPS),
                           ("differ_rows_kernel", {"BLOCK": FUSED_BLOCK}, FUSED_WARPS)):
        key = cubin.key(TL, name, scan_cuda.SIGNATURES[name], c, warps, cc)
        entry = {"name": name, "cubin": base64.b64encode(b"no kernel image here").decode(), "threads": 32 * warps,
                 "shared": 0, "scratch": 0}
        (tmp_path / "k" / "kernels" / f"{key}.json").write_text(json.dumps(entry))
    code = ("import sys, runpy\nimport dcptool.check.scan as s; s.GPU_MIN_OBS = 1\n"
            "sys.argv = ['dcptool', 'replay', sys.argv[1], '--json', '--backend', sys.argv[2]]\n"
            "runpy.run_module('dcptool', run_name='__main__')")
    env = {**os.environ, "DCPTOOL_CACHE_DIR": str(tmp_path / "k")}
    got = {b: subprocess.run([sys.executable, "-c", code, str(tmp_path / "d.safetensors"), b], capture_output=True,
                             text=True, env=env) for b in (backend, "torch")}
    p, cpu = got[backend], got["torch"]
    assert p.stderr.count("\n") == 1 and "CUDA cuLibraryLoadData failed: " in p.stderr, p.stderr[-2000:]
    if backend == "triton":
        assert p.returncode == 2 and p.stdout == ""
        assert p.stderr.endswith("; use --backend torch to replay on the CPU\n")
        return
    assert p.stderr.startswith("dcptool replay: warning: --backend auto: CUDA cuLibraryLoadData failed: ")
    assert p.stderr.endswith("; replaying on the CPU instead\n")
    assert p.returncode == cpu.returncode == 1 and cpu.stderr == ""
    lines, want = ([json.loads(x) for x in q.stdout.splitlines()] for q in (p, cpu))
    assert lines[:-1] == want[:-1] and (lines[-1]["backend"], lines[-1]["device"]) == ("torch", "cpu")
    assert lines[-1]["gpu_failed"].startswith("CUDA cuLibraryLoadData failed: ")
