"""gpu/cuda.py: the GPU through cuda-core. Without a GPU: it says so without importing cuda-core, torch or triton,
a broken install (a driver, no cuda-core) is one line naming --backend torch, a driver failure is one line and exit
2. With one (marked `cuda`): copies round-trip through pinned and device memory at awkward sizes, and a kernel from
dcptool's cubin cache, launched with typed arguments, equals numpy."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, cli, random_dump

from dcptool.gpu import cuda

gpu = pytest.mark.skipif(not cuda.available(), reason="needs a CUDA GPU")
no_gpu = pytest.mark.skipif(cuda.available(), reason="a CUDA GPU is there")


@no_gpu
def test_without_a_gpu_it_says_so():
    assert not cuda.available()
    with pytest.raises(cuda.CudaError, match="no CUDA device: use --backend torch"):
        cuda.gpu()


@no_gpu
def test_asking_imports_neither_cuda_core_nor_torch_nor_triton():
    """`--backend auto` on a large dump asks whether there is a GPU: the driver's bindings only."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json, sys\nfrom dcptool.gpu import cuda\na = cuda.available()\n"
            "print(json.dumps([a, sorted(m for m in ('torch', 'triton', 'cuda.core') if m in sys.modules)]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**env, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == [False, []]


def test_a_device_without_cuda_core_is_one_line_naming_the_cpu_backend(monkeypatch):
    """A device the driver counts, but no cuda.core to drive it: a CudaError (exit 2), never a silent CPU replay."""
    import importlib.util

    monkeypatch.setattr(cuda, "_count", lambda: 1)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cuda.core" else real(name, *a))
    with pytest.raises(cuda.CudaError) as e:
        cuda.available()
    assert "cuda-core is not installed" in str(e.value) and "--backend torch" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("driver", [True, False])
def test_without_the_driver_bindings_the_driver_decides(monkeypatch, driver):
    """No cuda-bindings: with an NVIDIA driver loaded the install is broken (CudaError); without one, no GPU."""
    real_exists = os.path.exists
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # (its import fails)
    monkeypatch.setattr(os.path, "exists", lambda p: driver if p == "/proc/driver/nvidia/version" else real_exists(p))
    cuda._count.cache_clear()
    try:
        if driver:
            with pytest.raises(cuda.CudaError, match="cuda-core is not installed .*--backend torch"):
                cuda.available()
        else:
            assert cuda.available() is False
    finally:
        cuda._count.cache_clear()


def test_a_driver_call_fails_in_one_line_naming_it():
    @cuda.driver_call("cuMemAllocAsync")
    def broken():
        raise RuntimeError("CUDA_ERROR_OUT_OF_MEMORY:\n  out of memory")

    with pytest.raises(cuda.CudaError) as e:
        broken()
    assert str(e.value) == ("CUDA cuMemAllocAsync failed: CUDA_ERROR_OUT_OF_MEMORY: out of memory; use --backend "
                            "torch to replay on the CPU")

    @cuda.driver_call("x")
    def ours():
        raise cuda.CudaError("as it was")

    with pytest.raises(cuda.CudaError, match="^as it was$"):
        ours()


def test_a_driver_failure_is_one_line_and_exit_2(tmp_path, monkeypatch):
    """A GPU that the driver cannot start (here: said to be there, then failing) is bad input to the run, not a
    traceback and never exit 1 (findings)."""
    random_dump(tmp_path / "d.safetensors", np.random.default_rng(1), 40, 4, 1)

    def broken():
        raise cuda.CudaError("CUDA device start-up failed: out of memory; use --backend torch to replay on the CPU")

    monkeypatch.setattr(cuda, "available", lambda: True)
    monkeypatch.setattr(cuda, "gpu", broken)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    r = cli("replay", tmp_path / "d.safetensors", "--backend", "triton")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "device start-up failed" in r.stderr
    assert "Traceback" not in r.stderr


class _Host:
    """A stand-in pinned memory resource: host memory numpy exports through DLPack, as cuda-core's pinned buffers
    export theirs."""

    def __init__(self):
        self.sizes = []

    def allocate(self, size):
        self.sizes.append(size)
        return np.zeros(size, np.int8)


class _Buffer:
    """cuda.core.Buffer.from_handle's stand-in: the views a copy is made between, and the copies."""

    copies: list = []

    def __init__(self, address, size):
        self.address, self.size = address, size

    @classmethod
    def from_handle(cls, address, size):
        return cls(address, size)

    @property
    def handle(self):
        return self.address

    def copy_from(self, src, stream):
        _Buffer.copies.append(((self.address, self.size), (src.address, src.size), stream))


def _host_only_gpu():
    g = cuda.Gpu.__new__(cuda.Gpu)  # (no device: what these methods do on the host)
    g.host = _Host()
    g.cc_module = type("cc", (), {"Buffer": _Buffer})
    return g


@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 1000, 100_003])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_pinned_memory_is_a_writable_array_of_n_values(n, dtype):
    g = _host_only_gpu()
    a, buf = g.pinned(n, dtype)
    assert a.shape == (n,) and a.dtype == dtype and a.flags.writeable and a.flags.c_contiguous
    assert g.host.sizes == [max(n, 1) * np.dtype(dtype).itemsize] and buf.size == g.host.sizes[0]
    a[:] = np.arange(n)
    assert np.array_equal(buf.view(dtype)[:n], np.arange(n))  # (the array is the buffer's memory)


@pytest.mark.parametrize("n", [0, 1, 129])
def test_copies_go_between_the_array_and_the_start_of_the_buffer(n):
    """A copy views the start of the device buffer and the array's own bytes (a slice of a pinned array starts
    where it starts); nothing is queued for an empty array; a strided one is refused."""
    g = _host_only_gpu()
    _Buffer.copies = []
    a, _ = g.pinned(2 * n + 1, np.int64)
    dev = _Buffer(0x7000, 10**6)
    g.to_device(dev, a[1 : n + 1], "s")
    g.to_host(a[n : 2 * n], dev, "t")
    at = a.__array_interface__["data"][0]
    want = [((0x7000, 8 * n), (at + 8, 8 * n), "s"), ((at + 8 * n, 8 * n), (0x7000, 8 * n), "t")] if n else []
    assert _Buffer.copies == want
    with pytest.raises(cuda.CudaError, match="contiguous"):
        g.to_device(dev, g.pinned(8, np.int64)[0][::2], "s")


# --------------------------------------------------------------------------------------------
# On a GPU


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 1000, 100_003])
def test_copies_round_trip_through_the_device(n):
    """Pinned host -> device -> pinned host, ordered by a stream and by an event waited on from the host; a copy
    of part of a buffer (the staging's way: the first cnt values) leaves the rest alone."""
    g = cuda.gpu()
    g.bind()
    src = np.random.default_rng(n).integers(-(2**31), 2**31 - 1, n, dtype=np.int64).astype(np.int32)
    (host, hb), (back, bb) = g.pinned(n, np.int32), g.pinned(n, np.int32)
    assert host.shape == (n,) and host.dtype == np.int32 and host.flags.writeable
    host[:] = src
    s = g.stream()
    d = g.alloc(4 * n, s)
    e = g.event()
    try:
        g.sync(s)
        back[:] = -1
        g.to_device(d, back, s)
        g.sync(s)  # (the copy reads `back`: done before it is cleared)
        back[:] = 0
        g.to_host(back, d, s)
        g.sync(s)
        assert (back == -1).all()
        g.to_device(d, host, s)
        g.record(e, s)
        g.wait_host(e)
        g.to_host(back, d, s)
        g.sync(s)
        assert np.array_equal(back, src)
        half = n // 2
        back[:] = 7
        g.to_host(back[:half], d, s)
        g.sync(s)
        assert np.array_equal(back[:half], src[:half]) and (back[half:] == 7).all()
    finally:
        g.free([d, hb, bb], [s], [e])


@pytest.mark.cuda
@gpu
def test_a_second_stream_waits_for_an_event_of_the_first():
    g = cuda.gpu()
    g.bind()
    n = 1 << 20
    (host, hb), (back, bb) = g.pinned(n, np.int64), g.pinned(n, np.int64)
    host[:] = np.arange(n)
    a, b = g.stream(), g.stream()
    d = g.alloc(8 * n, a)
    e = g.event()
    try:
        g.sync(a)
        g.to_device(d, host, a)
        g.record(e, a)
        g.wait(b, e)  # b's copy back starts after a's copy in
        g.to_host(back, d, b)
        g.sync(b)
        assert np.array_equal(back, host)
    finally:
        g.free([d, hb, bb], [a, b], [e])


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("seed", range(3))
def test_a_cached_kernel_launched_with_typed_arguments_equals_numpy(seed, tmp_path, monkeypatch):
    """differ_rows_kernel compiled into dcptool's cubin cache, loaded by cuda-core (ObjectCode.from_cubin), its
    parameter sizes read from the cubin and launched (cuda.core.launch) against the scan's numpy twin; loaded
    again from the cache, the same."""
    from dcptool.check import scan as scan_mod
    from dcptool.dcp.fused import TL
    from dcptool.gpu import cubin
    from dcptool.gpu.scan_cuda import SIGNATURES, Fn

    monkeypatch.setenv("DCPTOOL_CACHE_DIR", str(tmp_path / "cache"))
    rng = np.random.default_rng(seed)
    lens = rng.choice([0, 1, 127, 128, 129, 1031], 300)
    rows = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    seq = rng.integers(0, 3, int(rows[-1])).astype(np.int32)
    other = np.array([rng.choice(np.flatnonzero(lens == v)) for v in lens])
    shift = np.where(rng.random(300) < 0.9, rows[:-1] - rows[other], 0).astype(np.int64)
    want = scan_mod._shifted_differ(seq, rows, shift)
    g = cuda.gpu()
    g.bind()
    kernels = []
    for _ in range(2):  # compiled, then from the cache (and the module loaded once)
        fn = Fn(g, "differ_rows_kernel", {"BLOCK": 256}, 2)
        kernels.append(fn.kernel)
        assert fn.k == cubin.kernel(TL, "differ_rows_kernel", SIGNATURES["differ_rows_kernel"],
                                    {"BLOCK": 256}, 2, g.cc)
        s = g.stream()
        bufs = [g.alloc(a.nbytes, s) for a in (seq, rows, shift)] + [g.alloc(4 * 300, s)]
        pins = [g.pinned(a.size, a.dtype) for a in (seq, rows, shift)] + [g.pinned(300, np.int32)]
        try:
            g.sync(s)
            for (p, _), a in zip(pins, (seq, rows, shift)):
                p[:] = a
            for b, (p, _) in zip(bufs, pins):
                g.to_device(b, p, s)
            fn.launch(s, 300, bufs[3], *bufs[:3])
            flags = pins[3][0]
            g.to_host(flags, bufs[3], s)
            g.sync(s)
            assert np.array_equal(np.flatnonzero(flags), want) and want.size
        finally:
            g.free(bufs + [b for _, b in pins], [s], [])
    assert kernels[0] is kernels[1]
