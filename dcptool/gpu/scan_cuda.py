"""The GPU scan: the fused kernels of dcp/fused_tl.py over chunks of whole observations, each chunk staged and copied
to the device while the one before it is checked. On a GPU through cuda-core (gpu.cuda: pinned staging, a copy
stream beside the compute stream, the kernels from dcptool's cubin cache: a fresh replay never imports torch); under
Triton's interpreter (no GPU: CI's kernel runs) into ordinary buffers that torch tensors share, the same kernels
launched through torch (dcp.fused)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np

from dcptool.dcp.backend import interpreted
from dcptool.dcp.fused_spec import CHECK_WARPS, FUSED_BLOCK, FUSED_WARPS, TL, fused_limits
from dcptool.dcp.reference import RowStats
from dcptool.dcp.segments import obs_chunks
from dcptool.dump import Dump
from dcptool.gpu import cubin, cuda
from dcptool.gpu.staging import Chunks

# Rows per chunk of the pipelined transfer (16 MB per row column). Small enough that copying chunk k+1 overlaps
# checking chunk k from the start, large enough that a chunk's fixed cost (two launches, one sync, ~0.1 ms) is small
# against its copy (~1 ms for 48 MB at 50 GB/s).
GPU_CHUNK_ROWS = 1 << 22
_COLS = {"seq_lens_ptr": "*i32", "rows_ptr": "*i64", "dcp_ptr": "*i32", "dcp_rows_ptr": "*i64",
         "num_reqs_ptr": "*i32", "num_reqs_padded_ptr": "*i32", "ranks_ptr": "*i32", "kv_ptr": "*i32"}
# Each kernel's runtime arguments in order, with Triton's types (tests hold them to fused_tl.py's definitions)
SIGNATURES = {
    "flag_rows_kernel": {"flags_ptr": "*i32", **_COLS},
    "check_rows_kernel": {"stats_ptr": "*i32", "ids_ptr": "*i64", "n_ids": "i32", **_COLS},
    "differ_rows_kernel": {"flags_ptr": "*i32", "seq_lens_ptr": "*i32", "rows_ptr": "*i64", "shift_ptr": "*i64"},
}
_SCALARS = {"i32": np.int32, "i64": np.int64}


def size_of(triton_type: str) -> int:
    """A parameter's bytes: 8 for a pointer or an i64, 4 for an i32."""
    return 8 if triton_type.startswith("*") or triton_type == "i64" else 4


class Fn:
    """One compiled kernel loaded on the GPU: launch(stream, grid, *args) with its arguments typed by its signature
    (a device Buffer for a pointer) and Triton's scratch pointers null. The sizes of its parameters, as the driver
    reads them from the cubin, are checked against the signature once: a kernel or a Triton that lays them out
    otherwise is refused, never launched with misplaced arguments."""

    def __init__(self, g: cuda.Gpu, name: str, constants: dict, warps: int):
        k = cubin.kernel(TL, name, SIGNATURES[name], constants, warps, g.cc)
        if k.scratch:
            raise cuda.CudaError(f"kernel {name} asks for Triton scratch memory, which dcptool's launch does not give")
        if k.shared > cuda.STATIC_SHARED_MAX:
            raise cuda.CudaError(f"kernel {name} asks for {k.shared} bytes of shared memory, more than a launch "
                                 f"gets without opting in ({cuda.STATIC_SHARED_MAX})")
        self.g, self.k, self.types = g, k, tuple(SIGNATURES[name].values())
        self.kernel = g.kernel(k.cubin, k.name)
        sizes = g.parameter_sizes(self.kernel)
        want = tuple(size_of(t) for t in self.types)
        if sizes[: len(want)] != want or any(s != 8 for s in sizes[len(want):]):
            raise cuda.CudaError(f"compiled kernel {name}: parameters of {list(sizes)} bytes, its signature says "
                                 f"{list(want)} then Triton's 8-byte scratch pointers")
        self.scratch = (0,) * (len(sizes) - len(want))

    def launch(self, stream, grid: int, *args) -> None:
        """`grid` programs; one argument per signature entry (cuda-core packs a Python int as a pointer: an
        integer parameter is passed as the numpy scalar of its width)."""
        if len(args) != len(self.types):
            raise cuda.CudaError(f"kernel {self.k.name}: {len(args)} arguments for {len(self.types)} parameters")
        if grid:
            typed = tuple(a if t.startswith("*") else _SCALARS[t](a) for t, a in zip(self.types, args))
            self.g.launch(self.kernel, stream, grid, self.k.threads, self.k.shared, typed + self.scratch)


class CudaScan:
    """Chunk k of `chunks` staged (load) and checked (check) on device 0, two slots in turn: load(k+1) fills
    slot (k+1) % 2 and queues its copy while chunk k's kernels may still run; events keep a slot from being
    overwritten while its copy or the kernels reading it run. close() frees everything."""

    def __init__(self, chunks: Chunks, dcp_size: int, cp_interleave: int, page_size: int):
        fused_limits(dcp_size, cp_interleave, page_size)
        self.c = chunks
        g = self.g = cuda.gpu()
        g.bind()
        const = dict(DCP_SIZE=dcp_size, INTERLEAVE=cp_interleave, PAGE=page_size, HAS_PAGES=chunks.kv,
                     BLOCK=FUSED_BLOCK)
        self.flag = Fn(g, "flag_rows_kernel", const, FUSED_WARPS)
        self.exact = Fn(g, "check_rows_kernel", const, CHECK_WARPS)
        self.differ = Fn(g, "differ_rows_kernel", {"BLOCK": FUSED_BLOCK}, FUSED_WARPS) if chunks.pairs else None
        # what close() gives back: every device and pinned buffer, the streams (the copy stream first: buffers are
        # freed on it), the events
        self.buffers: list = []
        self.streams: list = []
        self.events: list = []
        try:
            self._setup()
        except BaseException:  # what was had is given back (a CPU replay may follow in this process), the first
            with contextlib.suppress(cuda.CudaError):  # failure reported
                self._free()
            raise
        self.recorded = [False, False]
        self.n: list[dict[str, int]] = [{}, {}]

    def _setup(self) -> None:
        g, chunks = self.g, self.c
        self.copy, self.comp = self._own(self.streams, g.stream), self._own(self.streams, g.stream)
        self.copied = [self._own(self.events, g.event) for _ in range(2)]
        self.used = [self._own(self.events, g.event) for _ in range(2)]
        self.host = [{k: self._pinned(n, t) for k, (n, t) in chunks.sizes.items()} for _ in range(2)]
        self.dev = [{k: self._alloc(n * t.itemsize) for k, (n, t) in chunks.sizes.items()} for _ in range(2)]
        m = chunks.most_obs
        self.flags_h, self.flags_d = self._pinned(m, np.int32), self._alloc(4 * m)
        self.dflags_h, self.dflags_d = self._pinned(m, np.int32), self._alloc(4 * m)
        self.ids_h, self.ids_d = self._pinned(m, np.int64), self._alloc(8 * m)
        self.sub_h, self.sub_d = self._pinned(6 * m, np.int32), self._alloc(24 * m)
        g.sync(self.copy)  # (the allocations, ordered on the copy stream, are done before any stream uses them)

    @staticmethod
    def _own(into: list, make):
        into.append(make())
        return into[-1]

    def _pinned(self, n: int, dtype) -> np.ndarray:
        a, buf = self.g.pinned(n, dtype)
        self.buffers.append(buf)
        return a

    def _alloc(self, nbytes: int):
        return self._own(self.buffers, lambda: self.g.alloc(nbytes, self.copy))

    def load(self, k: int) -> None:
        """Stage chunk k into slot k % 2 and queue its copy to the device."""
        g, slot = self.g, k % 2
        g.bind()  # (cheap: the scan may run on another thread than the one that set up)
        if self.recorded[slot]:
            g.wait_host(self.copied[slot])  # the copy out of this host slot (chunk k-2's) is complete
            g.wait(self.copy, self.used[slot])  # and chunk k-2's kernels are done with its device twin
        self.n[slot] = n = self.c.fill(k, self.host[slot])
        for key, cnt in n.items():
            g.to_device(self.dev[slot][key], self.host[slot][key][:cnt], self.copy)
        g.record(self.copied[slot], self.copy)
        self.recorded[slot] = True

    def check(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Chunk k (loaded) checked: ([6, n] int64 stats as RowStats.stacked lays them out, the chunk-relative
        observations whose rows differ from their pair's)."""
        g, slot, s = self.g, k % 2, self.comp
        n = self.n[slot]["nr"]
        dv = self.dev[slot]
        cols = [dv["seq"], dv["rows"], dv["dcp"], dv["drows"], dv["nr"], dv["nrp"], dv["rank"],
                dv.get("kv", self.flags_d)]
        g.bind()
        g.wait(s, self.copied[slot])
        self.flag.launch(s, n, self.flags_d, *cols)
        g.to_host(self.flags_h[:n], self.flags_d, s)
        if self.differ is not None:
            self.differ.launch(s, n, self.dflags_d, dv["seq"], dv["rows"], dv["shift"])
            g.to_host(self.dflags_h[:n], self.dflags_d, s)
        g.sync(s)
        stats = np.zeros((6, n), np.int64)
        stats[1::2] = -1
        ids = np.flatnonzero(self.flags_h[:n])
        m = ids.size
        if m:  # exact counts for the flagged few (a second launch, one program each)
            self.ids_h[:m] = ids
            g.to_device(self.ids_d, self.ids_h[:m], s)
            self.exact.launch(s, m, self.sub_d, self.ids_d, m, *cols)
            g.to_host(self.sub_h[: 6 * m], self.sub_d, s)
            g.sync(s)
            stats[:, ids] = self.sub_h[: 6 * m].reshape(6, m)
        g.record(self.used[slot], s)
        differ = np.flatnonzero(self.dflags_h[:n]) if self.differ is not None else np.zeros(0, np.int64)
        return stats, differ

    def close(self) -> None:
        try:
            self._free()
        finally:
            self.c.close()

    def _free(self) -> None:
        self.g.bind()
        self.g.free(self.buffers, self.streams, self.events)
        self.buffers, self.streams, self.events = [], [], []


class InterpretedScan:
    """The same chunks under Triton's interpreter: staged (Chunks) into ordinary buffers that torch tensors share,
    the fused kernels launched through torch (dcp.fused)."""

    def __init__(self, chunks: Chunks, dcp_size: int, cp_interleave: int, page_size: int):
        self.c, self.const = chunks, (dcp_size, cp_interleave)
        self.page = page_size
        self.host = [{k: np.empty(n, t) for k, (n, t) in chunks.sizes.items()} for _ in range(2)]
        self.n: list[dict[str, int]] = [{}, {}]

    def load(self, k: int) -> None:
        self.n[k % 2] = self.c.fill(k, self.host[k % 2])

    def check(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        import torch

        from dcptool.dcp.fused import check_rows, differ_rows

        t = {key: torch.from_numpy(self.host[k % 2][key][:n]) for key, n in self.n[k % 2].items()}
        st = check_rows(t["seq"], t["rows"], t["dcp"], t["drows"], t["nr"], t["nrp"], t["rank"], *self.const,
                        kv_pages=t.get("kv"), page_size=self.page)
        got = differ_rows(t["seq"], t["rows"], t["shift"]) if "shift" in t else torch.zeros(0, dtype=torch.int64)
        return st.stacked().numpy().astype(np.int64), got.numpy().astype(np.int64)

    def close(self) -> None:
        self.c.close()


def gpu_scan(d: Dump, views: bool, progress: Callable[[int], None] | None = None, bounded: bool = False,
             pairs=None) -> RowStats:
    """Every observation's view (where `views`: dcp_size > 1) and page counts checked by the fused kernels, on the
    GPU where there is one (CudaScan) and under the interpreter otherwise (InterpretedScan): the observations with
    something wrong. `pairs` (the scan's pairs: cut(lo, hi) each chunk's shifts, `found` takes the differing
    observations, settle(d) compares on the host those whose pair lies outside their chunk) asks for rank-agree's
    row comparison too.

    The GPU failing before the first chunk's result is kept (its start-up, the first chunk's copies and kernels)
    is a CudaStartError: nothing was reported yet, so a CPU scan can take the whole scan's place."""
    c = d.config
    chunks = obs_chunks(np.diff(d["obs.rows"]), GPU_CHUNK_ROWS)
    staged = Chunks(d, chunks, pairs)
    parts: list[RowStats] = []
    try:
        on_gpu = cuda.available() and not interpreted()
        run = (CudaScan if on_gpu else InterpretedScan)(staged, c.dcp_size, c.cp_interleave, c.page_size or 1)
    except BaseException as e:
        staged.close()
        _raise_as_start(e)
        raise
    try:
        if chunks:
            run.load(0)
        for k, (lo, hi) in enumerate(chunks):
            if bounded:  # staged: its pages are no longer needed
                d.release(lo, hi)
            if k + 1 < len(chunks):
                run.load(k + 1)
            if pairs is not None and not bounded:  # pairs outside their chunk (another rank's file), on the host
                pairs.settle(d)  # while the device checks chunk k
            stats, differ = run.check(k)
            if pairs is not None and differ.size:
                pairs.found.append(differ + lo)
            if not views:  # dcp_size 1: a present view is `stray`, its values are not checked
                stats[0:4] = [[0], [-1], [0], [-1]]
            parts.append(RowStats(*stats).sparse(lo))
            if progress:
                progress(hi - lo)
    except BaseException as e:
        with contextlib.suppress(cuda.CudaError):  # (the first failure is the one to report)
            run.close()
        if not parts:  # (nor progress, nor a pair found)
            _raise_as_start(e)
        raise
    run.close()
    return RowStats.concat(parts)


def _raise_as_start(e: BaseException) -> None:
    """A CudaError of a scan that has reported nothing raised again as a CudaStartError (anything else: nothing)."""
    if isinstance(e, cuda.CudaError) and not isinstance(e, cuda.CudaStartError):
        raise cuda.CudaStartError(e.what, e.advice) from e
