"""dcp/fused_spec.py: the layouts the fused kernels refuse (they compute in int32) and the launch shape both
launchers share."""

import subprocess
import sys

import pytest

from dcptool.dcp import fused_spec

I32 = 2**31 - 1


@pytest.mark.parametrize("dcp, interleave, page", [(1, 1, 1), (8, 16, 16), (2, 1, 1024), (I32, 1, 1), (1, I32, I32),
                                                   (46340, 46340, 16)])
def test_a_layout_within_int32_is_accepted(dcp, interleave, page):
    fused_spec.fused_limits(dcp, interleave, page)


@pytest.mark.parametrize("dcp, interleave, page", [(0, 1, 1), (1, 0, 1), (1, 1, 0), (-2, 1, 16), (2**16, 2**15, 16),
                                                   (1, 1, I32 + 1), (I32 + 1, 1, 1), (46341, 46341, 16)])
def test_a_layout_past_int32_is_refused_with_its_values(dcp, interleave, page):
    with pytest.raises(ValueError, match=f"got {dcp}, {interleave}, {page}"):
        fused_spec.fused_limits(dcp, interleave, page)


def test_the_torch_launchers_and_the_cuda_core_scan_launch_one_shape():
    from dcptool.dcp import fused
    from dcptool.gpu import scan_cuda

    for name in ("TL", "FUSED_BLOCK", "FUSED_WARPS", "CHECK_WARPS", "fused_limits"):
        assert getattr(fused, name) is getattr(fused_spec, name) is getattr(scan_cuda, name), name


def test_it_imports_no_torch():
    p = subprocess.run([sys.executable, "-c", "import sys, dcptool.dcp.fused_spec; print('torch' in sys.modules)"],
                       capture_output=True, text=True)
    assert (p.returncode, p.stdout.strip()) == (0, "False"), p.stderr
