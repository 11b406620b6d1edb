"""gpu/cuda.py: the GPU through cuda-core. Without a GPU: it says so without importing cuda-core, torch or triton,
a broken install (a driver, no cuda-core) or a driver that fails to initialise is one line naming --backend torch,
a driver failure is one line and exit 2 with --backend triton and a warning and a CPU replay with auto; each thread
binds the context before cuda-core is asked for memory, streams or events; everything is released even when a
release fails. With a GPU (marked `cuda`): copies round-trip through pinned and device memory at awkward sizes, a
kernel from dcptool's cubin cache, launched with typed arguments, equals numpy, and a real allocation failure at
start-up replays on the CPU under auto."""

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import ROOT, cli, random_dump

from dcptool.dump import open_dumps
from dcptool.gpu import cuda

gpu = pytest.mark.skipif(not cuda.available(), reason="needs a CUDA GPU")
no_gpu = pytest.mark.skipif(cuda.available(), reason="a CUDA GPU is there")


@no_gpu
def test_without_a_gpu_it_says_so():
    assert not cuda.available()
    with pytest.raises(cuda.CudaError, match="^no CUDA device; use --backend torch to replay on the CPU$"):
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
    assert "cuda-core cannot be imported" in str(e.value) and "--backend torch" in str(e.value)
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
            with pytest.raises(cuda.CudaError, match="cuda-core cannot be imported .*--backend torch"):
                cuda.available()
        else:
            assert cuda.available() is False
    finally:
        cuda._count.cache_clear()


@pytest.mark.parametrize("result,loaded,want", [("CUDA_SUCCESS", True, 2), ("CUDA_ERROR_NO_DEVICE", True, 0),
                                                 ("CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", False, 0),
                                                 ("CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", True, None),
                                                 ("CUDA_ERROR_UNKNOWN", True, None)])
def test_cuinit_decides_whether_there_is_a_gpu(monkeypatch, result, loaded, want):
    """No device (none visible, no kernel driver) is no GPU; a loaded NVIDIA driver whose cuInit fails otherwise (its
    library and kernel module of different versions, a GPU fallen off the bus) is a GPU that cannot be used: one
    line naming cuInit and the driver's error, never a silent CPU or interpreter run."""
    from cuda.bindings import driver

    code = getattr(driver.CUresult, result)
    monkeypatch.setattr(driver, "cuInit", lambda flags: (code,))
    monkeypatch.setattr(driver, "cuDeviceGetCount", lambda: (driver.CUresult.CUDA_SUCCESS, 2))
    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: loaded if p == "/proc/driver/nvidia/version" else real_exists(p))
    cuda._count.cache_clear()
    try:
        if want is None:
            with pytest.raises(cuda.CudaError) as e:
                cuda.available()
            assert str(e.value) == f"CUDA cuInit failed: {result}; use --backend torch to replay on the CPU"
            assert e.value.what == f"CUDA cuInit failed: {result}"
        else:
            assert cuda._count() == want
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
    assert e.value.what == "CUDA cuMemAllocAsync failed: CUDA_ERROR_OUT_OF_MEMORY: out of memory"

    @cuda.driver_call("x")
    def ours():
        raise cuda.CudaError("as it was", None)

    with pytest.raises(cuda.CudaError, match="^as it was$"):
        ours()


def _start_fails():
    raise cuda.CudaError("CUDA cuMemAllocHost failed: CUDA_ERROR_OUT_OF_MEMORY: out of memory")


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_a_gpu_that_fails_to_start_is_one_line(tmp_path, monkeypatch, backend):
    """A GPU that the driver cannot start (here: said to be there, then failing) fails `--backend triton` in one line
    and exit 2 (never exit 1: findings); `auto` warns once in one line and replays on the CPU: the output and the
    exit code of `--backend torch`."""
    from dcptool.check import scan as scan_mod

    random_dump(tmp_path / "d.safetensors", np.random.default_rng(1), 40, 4, 1)
    monkeypatch.setattr(cuda, "available", lambda: True)
    monkeypatch.setattr(cuda, "gpu", _start_fails)
    monkeypatch.setattr(scan_mod, "GPU_MIN_OBS", 1)  # (auto takes the GPU for this small dump)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    r = cli("replay", tmp_path / "d.safetensors", "--backend", backend, "--json")
    assert "Traceback" not in r.stderr and r.stderr.endswith("\n") and r.stderr.count("\n") == 1, r.stderr
    if backend == "triton":
        assert r.returncode == 2
        assert r.stderr == ("dcptool: CUDA cuMemAllocHost failed: CUDA_ERROR_OUT_OF_MEMORY: out of memory; use "
                            "--backend torch to replay on the CPU\n")
        return
    assert r.stderr == ("dcptool replay: warning: --backend auto: CUDA cuMemAllocHost failed: "
                        "CUDA_ERROR_OUT_OF_MEMORY: out of memory; replaying on the CPU instead\n")
    cpu = cli("replay", tmp_path / "d.safetensors", "--backend", "torch", "--json")
    assert r.returncode == cpu.returncode == 1 and cpu.stderr == ""
    got, want = ([json.loads(x) for x in out.stdout.splitlines()] for out in (r, cpu))
    assert got[:-1] == want[:-1] and len(want) > 1  # every finding
    summary = {k: v for k, v in got[-1].items() if k != "seconds"}
    assert summary == {**{k: v for k, v in want[-1].items() if k != "seconds"},
                       "gpu_failed": "CUDA cuMemAllocHost failed: CUDA_ERROR_OUT_OF_MEMORY: out of memory"}
    assert (summary["backend"], summary["device"]) == ("torch", "cpu")
    text = cli("replay", tmp_path / "d.safetensors", "--backend", "auto")
    assert text.stderr.count("\n") == 1 and "replaying on the CPU instead" in text.stderr
    assert "backend torch on cpu" in text.stdout


class _Device:
    """cuda.core.Device's stand-in: one object per thread (as cuda-core makes them), whose allocations, streams and
    events are refused until its context is current on that thread."""

    made: list = []

    def __init__(self, ordinal):
        self.bound, self.thread = 0, threading.get_ident()
        _Device.made.append(self)

    def set_current(self):
        assert threading.get_ident() == self.thread
        self.bound += 1

    def _checked(self, what):
        if not self.bound or threading.get_ident() != self.thread:
            raise RuntimeError("Device 0 is not yet initialized, perhaps you forgot to call .set_current() first?")
        return what

    def allocate(self, size, *, stream):
        return self._checked(("buffer", size, stream))

    def create_stream(self, options=None):
        return self._checked(("stream", options))

    def create_event(self, options=None):
        return self._checked(("event", options))


class _Core:
    """cuda.core's stand-in module: the Device above and the option records."""

    Device = _Device
    StreamOptions = staticmethod(lambda **k: k)
    EventOptions = staticmethod(lambda **k: k)


def test_each_thread_binds_the_context_before_cuda_core_is_asked():
    """The first call of a thread that never called bind() (a scan on a worker thread) binds there first; bind()
    binds again (a library may have made another context current since)."""
    _Device.made = []
    g = cuda.Gpu.__new__(cuda.Gpu)  # (no device: the per-thread binding, on a stand-in cuda.core)
    g.cc_module, g.ordinal, g.here = _Core, 0, threading.local()
    assert g.alloc(0, "s") == ("buffer", 1, "s")  # (one byte at least)
    with ThreadPoolExecutor(1) as ex:
        assert ex.submit(g.stream).result() == ("stream", {"nonblocking": True})
        assert ex.submit(g.event).result() == ("event", {"timing_enabled": False})
    assert [d.bound for d in _Device.made] == [1, 1]  # one Device and one binding per thread
    g.bind()
    assert [d.bound for d in _Device.made] == [1, 1, 1] and g.here.device is _Device.made[-1]


class _Released:
    """A stream, event or buffer whose release is recorded; `fails` names the calls that fail."""

    def __init__(self, name, log, fails=()):
        self.name, self.log, self.fails = name, log, fails

    def _do(self, call, *a):
        self.log.append((self.name, call, *a))
        if call in self.fails:
            raise RuntimeError(f"CUDA_ERROR_ILLEGAL_ADDRESS: {self.name}.{call}")

    def sync(self):
        self._do("sync")

    def close(self, *a):
        self._do("close", *a)


@pytest.mark.parametrize("fails", [(), ("sync",)])
def test_everything_is_released_even_when_a_release_fails(fails):
    """A fault leaves the context failing every call: each buffer, stream and event is still released (freed on the
    first stream once its work is done), and the first failure is the one raised."""
    log = []
    s1, s2 = _Released("copy", log, fails), _Released("comp", log)
    bufs = [_Released(f"b{i}", log, ("close",) if fails else ()) for i in range(3)]
    events = [_Released(f"e{i}", log) for i in range(2)]
    g = cuda.Gpu.__new__(cuda.Gpu)
    if fails:
        with pytest.raises(cuda.CudaError, match="^CUDA cuMemFree failed: CUDA_ERROR_ILLEGAL_ADDRESS: copy.sync;"):
            g.free(bufs, [s1, s2], events)
    else:
        g.free(bufs, [s1, s2], events)
    assert log == [("copy", "sync"), ("comp", "sync"), *[(f"b{i}", "close", s1) for i in range(3)],
                   ("copy", "sync"), ("copy", "close"), ("comp", "sync"), ("comp", "close"),
                   ("e0", "close"), ("e1", "close")]


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
    g.cc_module = type("cc", (), {"Buffer": _Buffer, "Device": _Device})
    g.ordinal, g.here = 0, threading.local()
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


@pytest.mark.parametrize("over", [1, 8, 1000])
def test_a_copy_longer_than_its_device_buffer_is_refused(over):
    """A copy goes between raw addresses (views that own nothing): one longer than the device buffer would write
    past its end (or read past it into the host array), so it is refused before anything is queued."""
    g = _host_only_gpu()
    _Buffer.copies = []
    a, _ = g.pinned(64 + over, np.int8)
    dev = _Buffer(0x7000, 64)
    g.to_device(dev, a[:64], "s")
    g.to_host(a[:64], dev, "s")
    for copy in (lambda: g.to_device(dev, a, "s"), lambda: g.to_host(a, dev, "s")):
        with pytest.raises(cuda.CudaError, match=f"^a copy of {64 + over} bytes into or out of a device buffer of 64"):
            copy()
    assert len(_Buffer.copies) == 2


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
    want = scan_mod.shifted_differ(seq, rows, 0, 300, shift)
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


@pytest.mark.cuda
@gpu
def test_a_worker_thread_gets_memory_streams_and_events_without_binding_first():
    """cuda-core refuses a Device's allocations, streams and events on a thread that has not made the context
    current: a thread's first call binds it (the scan may run on another thread than the one that started the
    GPU), and a copy made there round-trips."""
    g = cuda.gpu()

    def on_a_worker():
        s, e = g.stream(), g.event()
        d = g.alloc(8 * 1000, s)
        (host, hb), (back, bb) = g.pinned(1000, np.int64), g.pinned(1000, np.int64)
        try:
            host[:] = np.arange(1000)
            g.sync(s)
            g.to_device(d, host, s)
            g.record(e, s)
            g.wait_host(e)
            g.to_host(back, d, s)
            g.sync(s)
            return back.copy()
        finally:
            g.free([d, hb, bb], [s], [e])

    with ThreadPoolExecutor(1) as ex:
        assert np.array_equal(ex.submit(on_a_worker).result(), np.arange(1000))


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_a_real_allocation_failure_at_start_up(tmp_path, monkeypatch, backend):
    """The GPU scan's set-up asks the device for more memory than it has (one allocation of 2**50 bytes: the
    driver's own out-of-memory): `auto` warns once and replays on the CPU, `triton` fails in one line (exit 2);
    what the set-up had was given back (every buffer closed) and the GPU scans again in this process."""
    from dcptool.check import scan as scan_mod

    random_dump(tmp_path / "d.safetensors", np.random.default_rng(4), 300, 4, 16)
    monkeypatch.setattr(scan_mod, "GPU_MIN_OBS", 1)
    monkeypatch.setenv("DCPTOOL_CACHE_DIR", str(tmp_path / "k"))
    made, allocs, real_alloc, real_pinned = [], [], cuda.Gpu.alloc, cuda.Gpu.pinned

    def alloc(self, nbytes, stream):  # (the sixth device allocation fails)
        allocs.append(nbytes)
        made.append(real_alloc(self, 1 << 50 if len(allocs) == 6 else nbytes, stream))
        return made[-1]

    def pinned(self, n, dtype):
        a, buf = real_pinned(self, n, dtype)
        made.append(buf)
        return a, buf

    monkeypatch.setattr(cuda.Gpu, "alloc", alloc)
    monkeypatch.setattr(cuda.Gpu, "pinned", pinned)
    r = cli("replay", tmp_path / "d.safetensors", "--backend", backend, "--json")
    assert r.stderr.count("\n") == 1 and "CUDA cuMemAllocAsync failed: " in r.stderr, r.stderr
    assert "OUT_OF_MEMORY" in r.stderr and "Traceback" not in r.stderr
    assert len(allocs) == 6 and len(made) > 5 and all(b.is_closed for b in made)
    if backend == "triton":
        assert r.returncode == 2 and r.stderr.endswith("; use --backend torch to replay on the CPU\n")
    else:
        assert r.stderr.startswith("dcptool replay: warning: --backend auto: CUDA cuMemAllocAsync failed: ")
        assert r.stderr.endswith("; replaying on the CPU instead\n")
        cpu = cli("replay", tmp_path / "d.safetensors", "--backend", "torch", "--json")
        assert r.returncode == cpu.returncode == 1
        assert r.stdout.splitlines()[:-1] == cpu.stdout.splitlines()[:-1]
    monkeypatch.setattr(cuda.Gpu, "alloc", real_alloc)
    d = open_dumps([str(tmp_path / "d.safetensors")])
    got, want = scan_mod.scan(d, "triton"), scan_mod.scan(d, "torch")
    assert np.array_equal(got.obs, want.obs) and got.obs.size
