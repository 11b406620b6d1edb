"""The ring's launches (arm.py): each checked on known values before use; the fast path's launch refused where no way
cheaper than the dispatch writes what it should; on a GPU, every launch way checked for both kernels."""

import pytest
import torch
from conftest import hostring

from dcptool.engine.snapshot.arm import _fast_launch, _self_check_args, arm, every_way
from dcptool.engine.snapshot.kernels import snapshot_args_dispatch, snapshot_dispatch
from dcptool.engine.snapshot.ring import SnapshotRing


@hostring
@pytest.mark.kernel
def test_the_fast_launch_is_checked_before_use():
    """_fast_launch proves a launch way on known values before observe() uses it (none here: the interpreter
    has no compiled launcher, and through the dispatch the general path costs less); a launch that passes
    one argument wrong fails the check (and so is never used)."""
    ring = SnapshotRing(4096, None)
    go, how = _fast_launch(ring)
    assert go is None and how.startswith("none, the general path instead (the launcher's C entry: ")
    go = snapshot_args_dispatch
    _self_check_args(ring, go)
    with pytest.raises(RuntimeError, match="self-check wrote"):
        _self_check_args(ring, lambda raw, g, *a: go(raw, g, *a[:-1], a[-1] - 1))  # the slot mapping one short
    with pytest.raises(RuntimeError, match="self-check wrote"):
        _self_check_args(ring, lambda raw, g, *a: go(raw, 1, *a))  # one program where three are needed


@hostring
@pytest.mark.kernel
def test_the_host_ring_launches_through_the_interpreter():
    ring = SnapshotRing(4096, None)
    arm(ring)
    assert (ring.go, ring.go3) == (snapshot_dispatch, snapshot_args_dispatch)
    assert ring.how == ring.how3 == "the Triton interpreter"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_launch_way_writes_what_the_kernels_should_on_a_gpu():
    """On a GPU: the launcher's C entry (this Triton's), cuda.core (where installed) and the compiled launcher each
    pass both self-checks; the ring's own launches are the first of them in launch.order()."""
    ring = SnapshotRing(1 << 16, torch.cuda.current_device())
    got = every_way(ring)
    assert got["compiled"][0] is not None, got
    assert got["c-entry"][0] is not None, got  # (triton 3.6 and 3.9: a known wrapper)
    try:
        import cuda.core  # noqa: F401
    except ImportError:
        pass
    else:
        assert got["cuda-core"][0] is not None, got
    arm(ring)
    assert ring.go3 is not None and not ring.how3.startswith("none")
