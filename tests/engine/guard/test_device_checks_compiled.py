"""device_checks_tl.py compiled as a GPU compiles it, on any machine (conftest.compiled_for_a_gpu): the check kernel
with the GPU's blocks (1,024 rows, [2 groups, 2,048 tokens] tiles) through Triton's front end and ptxas for sm_90."""

from conftest import compiled_for_a_gpu

from dcptool.engine.guard.device_checks import GUARD_WARPS


def test_the_check_kernel_compiles_for_a_gpu(tmp_path):
    got = compiled_for_a_gpu("dcptool.engine.guard.device_checks_tl", "guard_kernel", GUARD_WARPS, tmp_path)
    assert got.returncode == 0, got.stderr[-3000:]
    ptx, cubin = (int(x) for x in got.stdout.split())
    assert ptx > 0 and cubin > 0
