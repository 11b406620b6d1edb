"""The GPU on NVIDIA's cuda-core (`cuda.core`): device 0's context, device and pinned memory, copies, streams,
events, kernels loaded from cubins and their typed launches, without torch.

A fresh `dcptool replay` on a GPU pays the driver's start-up and the cached kernels' load here (gpu.cubin), never
torch's import and CUDA runtime start-up. Whether there is a GPU is asked of the driver through cuda-bindings
(cuInit, cuDeviceGetCount: no context started; without an NVIDIA driver the library is not found and the answer is
no); cuda.core itself is imported only once one is there. Every thread that calls the driver makes the device's
primary context current first (bind: torch uses the same context, so a process that has both shares one). Every
failure is one CudaError naming the call.
"""

from __future__ import annotations

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
# cuda-core and its driver bindings are dependencies of dcptool on Linux (pyproject.toml); a GPU host without them
# has a broken install
MISSING = ("cuda-core is not installed ({}): reinstall dcptool (pip install 'cuda-core>=1.2' 'cuda-bindings>=12.8') "
           "or use --backend torch")


class CudaError(DcptoolError, RuntimeError):
    """A CUDA driver call failed (names the call and the driver's own words)."""


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
                raise CudaError(f"CUDA {call} failed: {words}; use --backend torch to replay on the CPU") from None

        return checked

    return wrap


def available() -> bool:
    """A CUDA device is there (the driver loads, initialises and counts one or more), without starting a
    context: a fraction of a second the first time, nothing after. A device without cuda-core to drive it is a
    CudaError (a broken install), not a CPU replay."""
    n = _count()
    if n and importlib.util.find_spec("cuda.core") is None:
        raise CudaError(MISSING.format("no module cuda.core"))
    return n > 0


@functools.cache
def _count() -> int:
    try:
        from cuda.bindings import driver
    except ImportError as e:
        if os.path.exists("/proc/driver/nvidia/version"):  # (an NVIDIA driver is loaded: the install is broken)
            raise CudaError(MISSING.format(e)) from None
        return 0
    try:
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return 0
        err, n = driver.cuDeviceGetCount()
    except Exception:  # no NVIDIA driver library: cuda-bindings cannot load libcuda
        return 0
    return int(n) if err == driver.CUresult.CUDA_SUCCESS else 0


_lock = threading.Lock()
_gpus: list[Gpu] = []  # the process's one Gpu, once started


def gpu() -> Gpu:
    """Device 0 with its primary context, started once per process (thread-safe)."""
    with _lock:
        if not _gpus:
            if not available():
                raise CudaError("no CUDA device: use --backend torch")
            _gpus.append(Gpu(0))
        return _gpus[0]


class Gpu:
    """One device's primary context: what cuda.core makes of it (memory, streams, events, kernels)."""

    @driver_call("device start-up")
    def __init__(self, ordinal: int):
        try:
            import cuda.core as cc
        except ImportError as e:
            raise CudaError(MISSING.format(e)) from None
        self.cc_module, self.ordinal = cc, ordinal
        self.bind()
        major, minor = self.device.compute_capability
        self.cc = 10 * major + minor  # e.g. 90 on Hopper (Triton's target)
        self.host = cc.LegacyPinnedMemoryResource()
        self.loaded: dict[tuple[str, bytes], tuple] = {}  # (name, cubin) -> (its module, the kernel)
        self.load_lock = threading.Lock()

    @property
    def device(self):
        return self.cc_module.Device(self.ordinal)  # (each thread's own Device object, one device)

    @driver_call("cuCtxSetCurrent")
    def bind(self) -> None:
        """Make the primary context current on this thread (each thread that calls the driver needs it once)."""
        self.device.set_current()

    @driver_call("cuMemAllocAsync")
    def alloc(self, nbytes: int, stream: Stream) -> Buffer:
        """Device memory of at least one byte, ordered on `stream`: usable on others once it is synchronised."""
        return self.device.allocate(max(int(nbytes), 1), stream=stream)

    @driver_call("cuMemAllocHost")
    def pinned(self, n: int, dtype) -> tuple[np.ndarray, Buffer]:
        """n page-locked host values (the copies from them are DMA at the link's speed): the array, and the buffer
        that owns them (close it when done; the array must not be used after)."""
        dtype = np.dtype(dtype)
        buf = self.host.allocate(max(n, 1) * dtype.itemsize)  # (whole values, one at least: a view needs both)
        return np.from_dlpack(buf).view(dtype)[:n], buf

    @driver_call("cuStreamCreate")
    def stream(self) -> Stream:
        return self.device.create_stream(options=self.cc_module.StreamOptions(nonblocking=True))

    @driver_call("cuEventCreate")
    def event(self) -> Event:
        return self.device.create_event(options=self.cc_module.EventOptions(timing_enabled=False))

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
            self._view(int(dst.handle), src.nbytes).copy_from(self._view(_address(src), src.nbytes), stream=stream)

    @driver_call("cuMemcpyAsync")
    def to_host(self, dst: np.ndarray, src: Buffer, stream: Stream) -> None:
        """Queue a copy of the start of src into dst (contiguous, pinned); it is there once the stream is
        synchronised."""
        if dst.nbytes:
            self._view(_address(dst), dst.nbytes).copy_from(self._view(int(src.handle), dst.nbytes), stream=stream)

    def _view(self, address: int, nbytes: int) -> Buffer:
        return self.cc_module.Buffer.from_handle(address, nbytes)  # (owns nothing: frees nothing)

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
        """Release memory (its streams' work done), then the streams and events."""
        for s in streams:
            s.sync()
        for b in buffers:
            b.close(streams[0] if streams else None)
        for s in streams:
            s.sync()
            s.close()
        for e in events:
            e.close()


def _address(a: np.ndarray) -> int:
    if not a.flags.c_contiguous:
        raise CudaError("a copy to or from the GPU needs a contiguous array")
    return int(a.__array_interface__["data"][0])
