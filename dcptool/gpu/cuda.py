"""The GPU on NVIDIA's cuda-core (`cuda.core`): device 0's context, device and pinned memory, copies, streams,
events, kernels loaded from cubins and their typed launches, without torch.

A fresh `dcptool replay` on a GPU pays the driver's start-up and the cached kernels' load here (gpu.cubin), never
torch's import and CUDA runtime start-up. Whether there is a GPU is asked of the driver through cuda-bindings
(cuInit, cuDeviceGetCount: no context started; without an NVIDIA driver the library is not found and the answer is
no); cuda.core itself is imported only once one is there. Every thread that calls the driver has the device's
primary context current (bind: torch uses the same context, so a process that has both shares one). Every
failure is one CudaError naming the call.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from dcptool.errors import DcptoolError

if TYPE_CHECKING:
    from cuda.core import Buffer, Event, Kernel, Stream

STATIC_SHARED_MAX = 48 * 1024  # a kernel asking more shared memory must opt in to it: dcptool's never do
CPU = "use --backend torch to replay on the CPU"
# cuda-core and its driver bindings are dependencies of dcptool on Linux (pyproject.toml); a GPU host without them
# (or with bindings cuda-core cannot use) has a broken install
MISSING = "cuda-core cannot be imported ({}): reinstall dcptool (pip install 'cuda-core>=1.2' 'cuda-bindings>=12.8')"
_NVIDIA = "/proc/driver/nvidia/version"  # there while an NVIDIA kernel driver is loaded


class CudaError(DcptoolError, RuntimeError):
    """A CUDA driver call failed, or the GPU cannot be used: `what` failed (the call and the driver's own words),
    then what to do (by default: replay on the CPU)."""

    def __init__(self, what: str, advice: str | None = CPU):
        super().__init__(what if advice is None else f"{what}; {advice}")
        self.what, self.advice = what, advice


class CudaStartError(CudaError):
    """The GPU scan failed before it produced anything: a scan on the CPU can take its place whole (what
    `--backend auto` does, with a warning)."""


def driver_call(call: str) -> Callable:
    """A function whose failure is a CudaError naming `call` (what cuda.core raised, on one line)."""

    def wrap(f: Callable) -> Callable:
        @functools.wraps(f)
        def checked(*a, **k):
            try:
                return f(*a, **k)
            except CudaError:
                raise
            except Exception as e:  # cuda.core's CUDAError, or what the driver's bindings raised
                words = " ".join(str(e).split()) or type(e).__name__
                raise CudaError(f"CUDA {call} failed: {words}") from None

        return checked

    return wrap


def available() -> bool:
    """A CUDA device is there (the driver loads, initialises and counts one or more), without starting a
    context: a fraction of a second the first time, nothing after. A device without cuda-core to drive it, or
    an NVIDIA driver that is loaded but fails to initialise, is a CudaError (the GPU is there and cannot be
    used), not a CPU replay."""
    n = _count()
    if n and importlib.util.find_spec("cuda.core") is None:
        raise CudaError(MISSING.format("no module cuda.core"))
    return n > 0


@functools.cache
def _count() -> int:
    try:
        from cuda.bindings import driver
    except ImportError as e:
        if os.path.exists(_NVIDIA):  # (an NVIDIA driver is loaded: the install is broken)
            raise CudaError(MISSING.format(e)) from None
        return 0
    try:
        (err,) = driver.cuInit(0)
    except Exception:  # no NVIDIA driver library: cuda-bindings cannot load libcuda
        return 0
    ok = driver.CUresult.CUDA_SUCCESS
    if err != ok:
        # none visible (CUDA_VISIBLE_DEVICES, a container without one) or no kernel driver: no GPU; a loaded driver
        # that fails otherwise (its library and kernel module of different versions, a GPU fallen off the bus) has
        # a GPU that cannot be used
        if err == driver.CUresult.CUDA_ERROR_NO_DEVICE or not os.path.exists(_NVIDIA):
            return 0
        raise CudaError(f"CUDA cuInit failed: {getattr(err, 'name', err)}")
    err, n = driver.cuDeviceGetCount()
    return int(n) if err == ok else 0


_lock = threading.Lock()
_gpus: list[Gpu] = []  # the process's one Gpu, once started


def gpu() -> Gpu:
    """Device 0 with its primary context, started once per process (thread-safe)."""
    with _lock:
        if not _gpus:
            if not available():
                raise CudaError("no CUDA device")
            _gpus.append(Gpu(0))
        return _gpus[0]


class Gpu:
    """One device's primary context: what cuda.core makes of it (memory, streams, events, kernels)."""

    @driver_call("device start-up")
    def __init__(self, ordinal: int):
        try:
            import cuda.core as cc
        except ImportError as e:  # (cuda-bindings of a CUDA major it does not support: an ImportError too)
            raise CudaError(MISSING.format(" ".join(str(e).split()))) from None
        self.cc_module, self.ordinal = cc, ordinal
        self.here = threading.local()  # .device: this thread's Device, its primary context made current (bind)
        self.bind()
        major, minor = self.current().compute_capability
        self.cc = 10 * major + minor  # e.g. 90 on Hopper (Triton's target)
        self.host = cc.LegacyPinnedMemoryResource()
        self.loaded: dict[tuple[str, bytes], tuple] = {}  # (name, cubin) -> (its module, the kernel)
        self.load_lock = threading.Lock()

    def current(self):
        """This thread's cuda.core Device (one object per thread), bound on the thread's first use: cuda.core
        refuses a Device's allocations, streams and events on a thread that has not made its context current."""
        d = getattr(self.here, "device", None)
        if d is None:
            self.bind()
            d = self.here.device
        return d

    @driver_call("cuCtxSetCurrent")
    def bind(self) -> None:
        """Make the primary context current on this thread (again: a library on this thread may have made another
        one current since)."""
        d = self.cc_module.Device(self.ordinal)
        d.set_current()
        self.here.device = d

    @driver_call("cuMemAllocAsync")
    def alloc(self, nbytes: int, stream: Stream) -> Buffer:
        """Device memory of at least one byte, ordered on `stream`: usable on others once it is synchronised."""
        return self.current().allocate(max(int(nbytes), 1), stream=stream)

    @driver_call("cuMemAllocHost")
    def pinned(self, n: int, dtype) -> tuple[np.ndarray, Buffer]:
        """n page-locked host values (the copies from them are DMA at the link's speed): the array, and the buffer
        that owns them (close it when done; the array must not be used after)."""
        dtype = np.dtype(dtype)
        self.current()  # (the buffer records the current context's default stream to free it on)
        buf = self.host.allocate(max(n, 1) * dtype.itemsize)  # (whole values, one at least: a view needs both)
        return _writable(np.from_dlpack(buf)).view(dtype)[:n], buf

    @driver_call("cuStreamCreate")
    def stream(self) -> Stream:
        return self.current().create_stream(options=self.cc_module.StreamOptions(nonblocking=True))

    @driver_call("cuEventCreate")
    def event(self) -> Event:
        return self.current().create_event(options=self.cc_module.EventOptions(timing_enabled=False))

    @driver_call("cuLibraryLoadData")
    def kernel(self, cubin: bytes, name: str) -> Kernel:
        """Kernel `name` of a compiled module, loaded once per process (the module stays loaded with it)."""
        with self.load_lock:
            if (name, cubin) not in self.loaded:
                module = self.cc_module.ObjectCode.from_cubin(cubin, name=name)
                self.loaded[name, cubin] = (module, module.get_kernel(name))
            return self.loaded[name, cubin][1]

    @driver_call("cuKernelGetParamInfo")
    def parameter_sizes(self, kernel: Kernel) -> tuple[int, ...]:
        """The byte size of each of the kernel's parameters, in order, as the driver reads them from its cubin."""
        return tuple(int(p.size) for p in kernel.arguments_info)

    @driver_call("cuLaunchKernel")
    def launch(self, kernel: Kernel, stream: Stream, grid: int, threads: int, shared: int, args: tuple) -> None:
        """`grid` programs of `threads` threads; `args` typed (a Buffer or an int address for a pointer, numpy
        scalars for the rest), in the kernel's order."""
        cc = self.cc_module
        cc.launch(stream, cc.LaunchConfig(grid=grid, block=threads, shmem_size=shared), kernel, *args)

    @driver_call("cuMemcpyAsync")
    def to_device(self, dst: Buffer, src: np.ndarray, stream: Stream) -> None:
        """Queue a copy of src (contiguous; pinned for it to be asynchronous) to the start of dst."""
        if src.nbytes:
            self._view(dst, src.nbytes).copy_from(self._view(src, src.nbytes), stream=stream)

    @driver_call("cuMemcpyAsync")
    def to_host(self, dst: np.ndarray, src: Buffer, stream: Stream) -> None:
        """Queue a copy of the start of src into dst (contiguous, pinned); it is there once the stream is
        synchronised."""
        if dst.nbytes:
            self._view(dst, dst.nbytes).copy_from(self._view(src, dst.nbytes), stream=stream)

    def _view(self, of: Buffer | np.ndarray, nbytes: int) -> Buffer:
        """The first `nbytes` of a device buffer or of an array's memory, as a Buffer that owns nothing (frees
        nothing). The views are the driver's raw addresses: a copy longer than the buffer is refused here, never
        written past its end."""
        if isinstance(of, np.ndarray):
            if not of.flags.c_contiguous:
                raise CudaError("a copy to or from the GPU needs a contiguous array")
            address = int(of.__array_interface__["data"][0])
        else:
            if nbytes > of.size:
                raise CudaError(f"a copy of {nbytes} bytes into or out of a device buffer of {of.size}")
            address = int(of.handle)
        return self.cc_module.Buffer.from_handle(address, nbytes)

    @driver_call("cuStreamSynchronize")
    def sync(self, stream: Stream) -> None:
        stream.sync()

    @driver_call("cuEventRecord")
    def record(self, event: Event, stream: Stream) -> None:
        stream.record(event)

    @driver_call("cuStreamWaitEvent")
    def wait(self, stream: Stream, event: Event) -> None:
        """The stream's later work waits for the event (no host wait)."""
        stream.wait(event)

    @driver_call("cuEventSynchronize")
    def wait_host(self, event: Event) -> None:
        event.sync()

    @driver_call("cuMemFree")
    def free(self, buffers: list[Buffer], streams: list[Stream], events: list[Event]) -> None:
        """Release memory once its streams' work is done, then the streams and events. Each is released even where
        one fails (a fault leaves the context failing every call): the first failure is raised after."""
        first: list[Exception] = []

        def attempt(f: Callable, *a) -> None:
            try:
                f(*a)
            except Exception as e:
                first[:] = first or [e]

        for s in streams:
            attempt(s.sync)
        for b in buffers:
            attempt(b.close, streams[0] if streams else None)
        for s in streams:
            attempt(s.sync)  # (a stream-ordered free is done before its stream goes)
            attempt(s.close)
        for e in events:
            attempt(e.close)
        if first:
            raise first[0]


def _writable(a: np.ndarray) -> np.ndarray:
    """`a` as a writable array of the same memory: numpy before 1.25 marks what it imports through DLPack read-only,
    while pinned staging memory is dcptool's own to write (the caller keeps the buffer that owns it alive)."""
    if a.flags.writeable:
        return a
    return np.ctypeslib.as_array((ctypes.c_int8 * a.nbytes).from_address(a.ctypes.data))
