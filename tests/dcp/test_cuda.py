"""dcp/cuda.py: the CUDA driver through ctypes. Without a GPU: it says so, and a replay asked for the GPU ends
in one line, exit 2. With one: memory, copies, streams, events and a compiled kernel's launch, against numpy."""

import numpy as np
import pytest
from conftest import cli, random_dump

from dcptool.check import scan as scan_mod
from dcptool.check.scan_cuda import SIGNATURES, TL
from dcptool.dcp import cubin, cuda

gpu = pytest.mark.skipif(not cuda.available(), reason="needs a CUDA GPU")
no_gpu = pytest.mark.skipif(cuda.available(), reason="a CUDA GPU is there")


@no_gpu
def test_without_a_gpu_it_says_so():
    assert not cuda.available()
    with pytest.raises(cuda.CudaError, match="no CUDA device: use --backend torch"):
        cuda.gpu()


def test_a_driver_failure_is_one_line_and_exit_2(tmp_path, monkeypatch):
    """A GPU that the driver cannot start (here: said to be there, then failing) is bad input to the run, not a
    traceback and never exit 1 (findings)."""
    random_dump(tmp_path / "d.safetensors", np.random.default_rng(1), 40, 4, 1)

    def broken():
        raise cuda.CudaError("CUDA cuDevicePrimaryCtxRetain failed: out of memory; use --backend torch to replay "
                             "on the CPU")

    monkeypatch.setattr(cuda, "available", lambda: True)
    monkeypatch.setattr(cuda, "gpu", broken)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    r = cli("replay", tmp_path / "d.safetensors", "--backend", "triton")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "cuDevicePrimaryCtxRetain failed" in r.stderr
    assert "Traceback" not in r.stderr


@gpu
@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 1000, 100_003])
def test_copies_round_trip_through_the_device(n):
    g = cuda.gpu()
    g.bind()
    src = np.random.default_rng(n).integers(-(2**31), 2**31 - 1, n, dtype=np.int64).astype(np.int32)
    host, back = g.pinned(n, np.int32), g.pinned(n, np.int32)
    host[:] = src
    d = g.alloc(4 * n)
    s = g.stream()
    e = g.event()
    try:
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
    finally:
        g.destroy([s], [e])
        g.free(d)
        g.free_host(host)
        g.free_host(back)


@gpu
@pytest.mark.parametrize("seed", range(3))
def test_a_compiled_kernel_launched_through_the_driver_equals_numpy(seed):
    """differ_rows_kernel from the cubin cache, launched by cuLaunchKernel, against the scan's numpy twin."""
    from dcptool.check.scan_cuda import _Fn

    rng = np.random.default_rng(seed)
    lens = rng.choice([0, 1, 127, 128, 129, 1031], 300)
    rows = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    seq = rng.integers(0, 3, int(rows[-1])).astype(np.int32)
    other = np.array([rng.choice(np.flatnonzero(lens == v)) for v in lens])
    shift = np.where(rng.random(300) < 0.9, rows[:-1] - rows[other], 0).astype(np.int64)
    want = scan_mod._shifted_differ(seq, rows, shift)
    g = cuda.gpu()
    g.bind()
    fn = _Fn(g, "differ_rows_kernel", {"BLOCK": 256}, 2)
    assert fn.k == cubin.kernel(TL, "differ_rows_kernel", SIGNATURES["differ_rows_kernel"], {"BLOCK": 256}, 2, g.cc)
    bufs = [g.alloc(a.nbytes) for a in (seq, rows, shift)] + [g.alloc(4 * 300)]
    s = g.stream()
    try:
        for b, a in zip(bufs, (seq, rows, shift)):
            g.to_device(b, np.ascontiguousarray(a), s)
        fn.launch(s, 300, bufs[3], *bufs[:3])
        flags = np.empty(300, np.int32)
        g.to_host(flags, bufs[3], s)
        g.sync(s)
    finally:
        for b in bufs:
            g.free(b)
        g.destroy([s], [])
    assert np.array_equal(np.flatnonzero(flags), want) and want.size
