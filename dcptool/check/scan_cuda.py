"""The GPU scan on the CUDA driver (dcp.cuda), without torch: chunks staged in pinned memory and copied on a
side stream while the chunk before is checked by the fused kernels of gpu_tl.py (compiled by dcp.cubin).

A fresh `dcptool replay` on a GPU so pays libcuda's start-up and the cached kernels' load, not torch's import
and CUDA runtime start-up (3.9 s on the H200's host; issue 28 item 9, docs/performance.md).
"""

from __future__ import annotations

import numpy as np

from dcptool.check.staging import Chunks
from dcptool.dcp import cubin, cuda
from dcptool.dcp.reference import FUSED_BLOCK, FUSED_WARPS, fused_limits

TL = "dcptool.check.gpu_tl"
CHECK_WARPS = 4  # the exact pass's (Triton's default, as check.gpu launches it)
_COLS = {"seq_lens_ptr": "*i32", "rows_ptr": "*i64", "dcp_ptr": "*i32", "dcp_rows_ptr": "*i64",
         "num_reqs_ptr": "*i32", "num_reqs_padded_ptr": "*i32", "ranks_ptr": "*i32", "kv_ptr": "*i32"}
SIGNATURES = {
    "flag_rows_kernel": {"flags_ptr": "*i32", **_COLS},
    "check_rows_kernel": {"stats_ptr": "*i32", "ids_ptr": "*i64", "n_ids": "i32", **_COLS},
    "differ_rows_kernel": {"flags_ptr": "*i32", "seq_lens_ptr": "*i32", "rows_ptr": "*i64", "shift_ptr": "*i64"},
}


class _Fn:
    """One compiled kernel loaded on the GPU: launch(stream, grid, *args) with its scratch pointers null."""

    def __init__(self, g: cuda.Gpu, name: str, constants: dict, warps: int):
        k = cubin.kernel(TL, name, SIGNATURES[name], constants, warps, g.cc)
        if k.scratch:
            raise cuda.CudaError(f"kernel {name} asks for Triton scratch memory, which dcptool's launch does not give")
        self.g, self.k, self.n = g, k, len(SIGNATURES[name])
        self.fn = g.function(k.cubin, k.name, k.shared)

    def launch(self, stream: int, grid: int, *args: int) -> None:
        if grid:
            vals = list(args) + [0] * (len(self.k.params) - self.n)
            self.g.launch(self.fn, grid, self.k.threads, self.k.shared, stream, list(zip(self.k.params, vals)))


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
        self.flag = _Fn(g, "flag_rows_kernel", const, FUSED_WARPS)
        self.exact = _Fn(g, "check_rows_kernel", const, CHECK_WARPS)
        self.differ = _Fn(g, "differ_rows_kernel", {"BLOCK": FUSED_BLOCK}, FUSED_WARPS) if chunks.pairs else None
        self.dev_bufs: list[int] = []
        self.host_bufs: list[np.ndarray] = []
        self.host = [{k: self._pinned(n, t) for k, (n, t) in chunks.sizes.items()} for _ in range(2)]
        self.dev = [{k: self._alloc(n * t.itemsize) for k, (n, t) in chunks.sizes.items()} for _ in range(2)]
        m = chunks.most_obs
        self.flags_h, self.flags_d = self._pinned(m, np.int32), self._alloc(4 * m)
        self.dflags_h, self.dflags_d = self._pinned(m, np.int32), self._alloc(4 * m)
        self.ids_h, self.ids_d = self._pinned(m, np.int64), self._alloc(8 * m)
        self.sub_h, self.sub_d = self._pinned(6 * m, np.int32), self._alloc(24 * m)
        self.copy, self.comp = g.stream(), g.stream()
        self.copied, self.used = [g.event(), g.event()], [g.event(), g.event()]
        self.recorded = [False, False]
        self.n: list[dict[str, int]] = [{}, {}]

    def _pinned(self, n: int, dtype) -> np.ndarray:
        self.host_bufs.append(self.g.pinned(n, dtype))
        return self.host_bufs[-1]

    def _alloc(self, nbytes: int) -> int:
        self.dev_bufs.append(self.g.alloc(nbytes))
        return self.dev_bufs[-1]

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
        """Chunk k (loaded) checked: ([6, n] int64 stats as reference.check_rows stacks them, the chunk-relative
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
        g = self.g
        g.bind()
        g.sync(self.comp)
        g.sync(self.copy)
        g.destroy([self.copy, self.comp], self.copied + self.used)
        for p in self.dev_bufs:
            g.free(p)
        for a in self.host_bufs:
            g.free_host(a)
        self.c.close()
