"""kernels_tl.py compiled as a GPU compiles it, on any machine (conftest.compiled_for_a_gpu): the snapshot kernels
through Triton's front end and ptxas for sm_90, at the warps their launches use."""

import pytest
from conftest import compiled_for_a_gpu

from dcptool.engine.snapshot.kernels import SNAP_ARGS_WARPS, SNAP_WARPS


@pytest.mark.parametrize("kernel, warps", [("snapshot_kernel", SNAP_WARPS), ("snapshot_args_kernel", SNAP_ARGS_WARPS)])
def test_the_snapshot_kernels_compile_for_a_gpu(tmp_path, kernel, warps):
    got = compiled_for_a_gpu("dcptool.engine.snapshot.kernels_tl", kernel, warps, tmp_path)
    assert got.returncode == 0, got.stderr[-3000:]
    ptx, cubin = (int(x) for x in got.stdout.split())
    assert ptx > 0 and cubin > 0
