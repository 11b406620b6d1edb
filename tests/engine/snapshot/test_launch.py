"""How the snapshot kernels are launched (launch.py): the launcher's C entry gets what Triton's wrapper passes, the
cheapest launch the self-check accepts is used, and the fast path's launch is checked before use."""

import pytest
from conftest import hostring

from dcptool.engine.snapshot.launch import _compiled_launch, _direct_launch, _fast_launch, _self_check_args, cheapest
from dcptool.engine.snapshot.ring import ARGS_NEG, SnapshotRing


def test_the_direct_launch_passes_what_tritons_launcher_passes(monkeypatch):
    """The launch through the compiled launcher's C entry gives `launch` exactly the arguments Triton's own
    wrapper (CudaLauncher.__call__, as the compiled launcher is called) gives it, for this Triton; no GPU
    needed: `launch` is a stand-in that records its arguments."""
    import types

    import triton
    from triton.backends.nvidia.driver import CudaLauncher

    monkeypatch.setattr(triton.runtime.driver, "_active", types.SimpleNamespace(), raising=False)
    seen = []
    run = object.__new__(CudaLauncher)
    attrs = dict(launch=lambda *a: seen.append(a), num_ctas=1, global_scratch_size=0, global_scratch_align=1,
                 profile_scratch_size=0, profile_scratch_align=1, launch_cooperative_grid=False, launch_pdl=False,
                 gsan_enabled=False, arg_annotations=[("slot", "i64")], kernel_signature=b"\x05")
    for k, v in attrs.items():
        setattr(run, k, v)
    ck = types.SimpleNamespace(run=run, function=0xF00, packed_metadata=(4, 1, 0))
    go = _direct_launch(ck)
    assert go is not None, "this Triton's launcher wrapper is not one _direct_launch knows"
    _compiled_launch(ck)(0x5EED, 0xAB00)
    go(0x5EED, 0xAB00)
    assert len(seen) == 2 and seen[0] == seen[1]
    args = (0xAB00, 7, 250, 256, 9 << 16 | ARGS_NEG, 816, 0xC000, 256, 0xD004, 256, 0xE000, 257,
            *(0xAB00, -1) * 5)  # snapshot_args_kernel's
    _compiled_launch(ck, variadic=True)(0x5EED, 3, *args)
    _direct_launch(ck, variadic=True)(0x5EED, 3, *args)
    assert len(seen) == 4 and seen[2] == seen[3] and seen[2] != seen[0] and seen[2][:3] == (3, 1, 1)  # the grid
    other = types.SimpleNamespace(run=types.SimpleNamespace(launch=print), function=1, packed_metadata=(4, 1, 0))
    assert _direct_launch(other) is None  # a wrapper it does not know: the compiled launcher is used as it is


def test_the_cheapest_launch_is_the_first_the_check_accepts():
    """cheapest tries the launcher's C entry, then the compiled launcher, keeps the first whose launch the
    self-check accepts, and says why each way before it was refused; neither: None and both reasons."""
    import types

    class Run:  # a launcher wrapper _direct_launch does not know (so: no C entry)
        def __call__(self, *a):
            calls.append(a)

    calls: list = []
    ck = types.SimpleNamespace(run=Run(), function=0xF00, packed_metadata=(4, 1, 0))
    go, how, why = cheapest(None, lambda ring, go: go(0x5EED, 0xAB00), ck, variadic=False)
    assert how == "Triton's compiled launcher" and len(why) == 1 and "C entry" in why[0]
    assert calls and calls[-1][3] == 0x5EED and calls[-1][-1] == 0xAB00  # (its launch ran: the check called it)

    def refuse(ring, go):
        raise RuntimeError("the slot holds garbage")

    go, how, why = cheapest(None, refuse, ck, variadic=True)
    assert go is None and how == "" and len(why) == 2 and "garbage" in why[1]


@hostring
@pytest.mark.kernel
def test_the_fast_launch_is_checked_before_use():
    """_fast_launch proves a launch way on known values before observe() uses it (none here: the interpreter
    has no compiled launcher, and through the dispatch the general path costs less); a launch that passes
    one argument wrong fails the check (and so is never used)."""
    from dcptool.engine.snapshot.kernels import snapshot_args_dispatch

    ring = SnapshotRing(4096, None)
    go, how = _fast_launch(ring)
    assert go is None and how.startswith("none, the general path instead (the launcher's C entry: ")
    go = snapshot_args_dispatch
    _self_check_args(ring, go)
    with pytest.raises(RuntimeError, match="self-check wrote"):
        _self_check_args(ring, lambda raw, g, *a: go(raw, g, *a[:-1], a[-1] - 1))  # the slot mapping one short
    with pytest.raises(RuntimeError, match="self-check wrote"):
        _self_check_args(ring, lambda raw, g, *a: go(raw, 1, *a))  # one program where three are needed
