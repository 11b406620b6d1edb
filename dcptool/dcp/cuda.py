"""The CUDA driver API through ctypes: a GPU's context, memory, copies and kernel launches without torch.

The GPU scan of a fresh `dcptool replay` runs on this (issue 28 item 9): torch's import and its CUDA start-up
cost 3.9 s on the H200's host before a row was checked, against a read floor of 1.2-1.4 s at 10^6
observations. libcuda alone starts in a fraction of that. Kernels come from cubin.py (Triton-compiled).
Every call makes the device's primary context current on the calling thread first (torch uses the same
context, so a process that has both shares one), and every failure is a CudaError naming the call.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from ctypes import byref, c_int, c_size_t, c_uint, c_uint64, c_void_p

import numpy as np

from dcptool.errors import DcptoolError


class CudaError(DcptoolError, RuntimeError):
    """A CUDA driver call failed (names the call and the driver's own words)."""


_ATTR_CC_MAJOR, _ATTR_CC_MINOR = 75, 76  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_*
_FUNC_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_STREAM_NON_BLOCKING = 1
_EVENT_DISABLE_TIMING = 2
_STATIC_SHARED_MAX = 48 * 1024  # above this a kernel must opt in to its dynamic shared memory


@functools.cache
def _lib() -> ctypes.CDLL | None:
    """libcuda, or None where there is no NVIDIA driver."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    lib.cuGetErrorString.argtypes = [c_int, ctypes.POINTER(ctypes.c_char_p)]
    sigs = {
        "cuInit": [c_uint], "cuDeviceGetCount": [ctypes.POINTER(c_int)],
        "cuDeviceGet": [ctypes.POINTER(c_int), c_int],
        "cuDeviceGetAttribute": [ctypes.POINTER(c_int), c_int, c_int],
        "cuDevicePrimaryCtxRetain": [ctypes.POINTER(c_void_p), c_int], "cuCtxSetCurrent": [c_void_p],
        "cuModuleLoadData": [ctypes.POINTER(c_void_p), c_void_p],
        "cuModuleGetFunction": [ctypes.POINTER(c_void_p), c_void_p, ctypes.c_char_p],
        "cuFuncSetAttribute": [c_void_p, c_int, c_int],
        "cuMemAlloc_v2": [ctypes.POINTER(c_uint64), c_size_t], "cuMemFree_v2": [c_uint64],
        "cuMemHostAlloc": [ctypes.POINTER(c_void_p), c_size_t, c_uint], "cuMemFreeHost": [c_void_p],
        "cuMemcpyHtoDAsync_v2": [c_uint64, c_void_p, c_size_t, c_void_p],
        "cuMemcpyDtoHAsync_v2": [c_void_p, c_uint64, c_size_t, c_void_p],
        "cuStreamCreate": [ctypes.POINTER(c_void_p), c_uint], "cuStreamDestroy_v2": [c_void_p],
        "cuStreamSynchronize": [c_void_p], "cuStreamWaitEvent": [c_void_p, c_void_p, c_uint],
        "cuEventCreate": [ctypes.POINTER(c_void_p), c_uint], "cuEventDestroy_v2": [c_void_p],
        "cuEventRecord": [c_void_p, c_void_p], "cuEventSynchronize": [c_void_p],
        "cuLaunchKernel": [c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_void_p,
                           ctypes.POINTER(c_void_p), ctypes.POINTER(c_void_p)],
    }
    for name, args in sigs.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = args, c_int
    return lib


def _check(rc: int, call: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        _lib().cuGetErrorString(rc, byref(msg))
        words = msg.value.decode() if msg.value else f"error {rc}"
        raise CudaError(f"CUDA {call} failed: {words}; use --backend torch to replay on the CPU")


_lock = threading.Lock()
_ctx: list[Gpu] = []  # the process's one Gpu, once started


def available() -> bool:
    """A CUDA device is there (the driver loads, initialises and counts one or more), without starting a
    context: ~0.1 s the first time, nothing after."""
    return _count() > 0


@functools.cache
def _count() -> int:
    lib = _lib()
    if lib is None or lib.cuInit(0) != 0:
        return 0
    n = c_int()
    return n.value if lib.cuDeviceGetCount(byref(n)) == 0 else 0


def gpu() -> Gpu:
    """Device 0 with its primary context, started once per process (thread-safe)."""
    with _lock:
        if not _ctx:
            if not available():
                raise CudaError("no CUDA device: use --backend torch")
            _ctx.append(Gpu(0))
        return _ctx[0]


class Gpu:
    """One device's primary context: memory, streams, events, modules and launches."""

    def __init__(self, ordinal: int):
        lib = self.lib = _lib()
        dev, ctx = c_int(), c_void_p()
        _check(lib.cuDeviceGet(byref(dev), ordinal), "cuDeviceGet")
        _check(lib.cuDevicePrimaryCtxRetain(byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self.dev, self.ctx = dev, ctx
        self.bind()
        major, minor = c_int(), c_int()
        _check(lib.cuDeviceGetAttribute(byref(major), _ATTR_CC_MAJOR, dev), "cuDeviceGetAttribute")
        _check(lib.cuDeviceGetAttribute(byref(minor), _ATTR_CC_MINOR, dev), "cuDeviceGetAttribute")
        self.cc = major.value * 10 + minor.value  # e.g. 90 on Hopper (Triton's target)

    def bind(self) -> None:
        """Make the context current on this thread (each thread that calls the driver needs it once)."""
        _check(self.lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    # memory
    def alloc(self, nbytes: int) -> int:
        p = c_uint64()
        _check(self.lib.cuMemAlloc_v2(byref(p), max(int(nbytes), 1)), f"cuMemAlloc ({nbytes} bytes)")
        return p.value

    def free(self, ptr: int) -> None:
        _check(self.lib.cuMemFree_v2(ptr), "cuMemFree")

    def pinned(self, n: int, dtype) -> np.ndarray:
        """A page-locked host array (the copies from it are DMA at the link's speed); free with free_host."""
        dtype = np.dtype(dtype)
        p = c_void_p()
        nbytes = max(n * dtype.itemsize, 1)
        _check(self.lib.cuMemHostAlloc(byref(p), nbytes, 0), f"cuMemHostAlloc ({nbytes} bytes)")
        buf = (ctypes.c_char * nbytes).from_address(p.value)
        return np.frombuffer(buf, dtype=dtype, count=n)

    def free_host(self, a: np.ndarray) -> None:
        _check(self.lib.cuMemFreeHost(c_void_p(a.ctypes.data)), "cuMemFreeHost")

    def to_device(self, dst: int, src: np.ndarray, stream: int | None) -> None:
        """Queue a copy of src (contiguous; pinned for it to be asynchronous) to device address dst."""
        if src.nbytes:
            _check(self.lib.cuMemcpyHtoDAsync_v2(dst, c_void_p(src.ctypes.data), src.nbytes, stream),
                   "cuMemcpyHtoDAsync")

    def to_host(self, dst: np.ndarray, src: int, stream: int | None) -> None:
        """Queue a copy from device address src into dst (contiguous, pinned); it is there once the stream
        is synchronised."""
        if dst.nbytes:
            _check(self.lib.cuMemcpyDtoHAsync_v2(c_void_p(dst.ctypes.data), src, dst.nbytes, stream),
                   "cuMemcpyDtoHAsync")

    # streams and events
    def stream(self) -> int:
        s = c_void_p()
        _check(self.lib.cuStreamCreate(byref(s), _STREAM_NON_BLOCKING), "cuStreamCreate")
        return s.value

    def sync(self, stream: int | None) -> None:
        _check(self.lib.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def event(self) -> int:
        e = c_void_p()
        _check(self.lib.cuEventCreate(byref(e), _EVENT_DISABLE_TIMING), "cuEventCreate")
        return e.value

    def record(self, event: int, stream: int | None) -> None:
        _check(self.lib.cuEventRecord(event, stream), "cuEventRecord")

    def wait(self, stream: int | None, event: int) -> None:
        """The stream's later work waits for the event (no host wait)."""
        _check(self.lib.cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent")

    def wait_host(self, event: int) -> None:
        _check(self.lib.cuEventSynchronize(event), "cuEventSynchronize")

    def destroy(self, streams: list[int], events: list[int]) -> None:
        for e in events:
            _check(self.lib.cuEventDestroy_v2(e), "cuEventDestroy")
        for s in streams:
            _check(self.lib.cuStreamDestroy_v2(s), "cuStreamDestroy")

    # kernels
    def function(self, cubin: bytes, name: str, shared: int) -> int:
        """Load a compiled module and return its kernel `name` (the module stays loaded for the process)."""
        mod, fn = c_void_p(), c_void_p()
        _check(self.lib.cuModuleLoadData(byref(mod), ctypes.c_char_p(cubin)), f"cuModuleLoadData ({name})")
        _check(self.lib.cuModuleGetFunction(byref(fn), mod, name.encode()), f"cuModuleGetFunction ({name})")
        if shared > _STATIC_SHARED_MAX:
            _check(self.lib.cuFuncSetAttribute(fn, _FUNC_MAX_DYNAMIC_SHARED, shared), "cuFuncSetAttribute")
        return fn.value

    def launch(self, fn: int, grid: int, threads: int, shared: int, stream: int | None,
               params: list[tuple[int, int]]) -> None:
        """Launch fn on `grid` programs of `threads` threads; params are (bytes, value) in the kernel's order."""
        vals = [(c_uint64 if size == 8 else ctypes.c_uint32)(v & ((1 << (8 * size)) - 1)) for size, v in params]
        ptrs = (c_void_p * max(len(vals), 1))(*[ctypes.cast(byref(v), c_void_p) for v in vals])
        _check(self.lib.cuLaunchKernel(fn, grid, 1, 1, threads, 1, 1, shared, stream, ptrs, None), "cuLaunchKernel")
