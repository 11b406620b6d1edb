"""The launch ways (launch.py): the launcher's C entry gets what Triton's wrapper passes (and an unknown Triton is
warned about and takes the next way), cuda.core launches the cubin with Triton's scratch pointers null, the first
way a check accepts is used, and DCPTOOL_LAUNCH picks the order."""

import sys
import types
import warnings

import pytest

from dcptool.engine.snapshot import launch as L
from dcptool.engine.snapshot.layout import ARGS_NEG

ARGS = (0xAB00, 7, 250, 256, 9 << 16 | ARGS_NEG, 816, 0xC000, 256, 0xD004, 256, 0xE000, 257, *(0xAB00, -1) * 5)


def _triton_launcher(monkeypatch, seen: list):
    """This Triton's CudaLauncher with a stand-in C entry that records its arguments (no GPU needed)."""
    import triton
    from triton.backends.nvidia.driver import CudaLauncher

    monkeypatch.setattr(triton.runtime.driver, "_active", types.SimpleNamespace(), raising=False)
    run = object.__new__(CudaLauncher)
    attrs = dict(launch=lambda *a: seen.append(a), num_ctas=1, global_scratch_size=0, global_scratch_align=1,
                 profile_scratch_size=0, profile_scratch_align=1, launch_cooperative_grid=False, launch_pdl=False,
                 gsan_enabled=False, arg_annotations=[("slot", "i64")], kernel_signature=b"\x05")
    for k, v in attrs.items():
        setattr(run, k, v)
    return types.SimpleNamespace(run=run, function=0xF00, packed_metadata=(4, 1, 0))


def test_the_c_entry_passes_what_tritons_launcher_passes(monkeypatch):
    """The launch through the compiled launcher's C entry gives `launch` exactly the arguments Triton's own
    wrapper (CudaLauncher.__call__, as the compiled launcher is called) gives it, for this Triton."""
    seen: list = []
    ck = _triton_launcher(monkeypatch, seen)
    go = L.way("c-entry", ck, False)
    assert go is not None, "this Triton's launcher wrapper is not one the c-entry way knows"
    L.way("compiled", ck, False)(0x5EED, 0xAB00)
    go(0x5EED, 0xAB00)
    assert len(seen) == 2 and seen[0] == seen[1]
    L.way("compiled", ck, True)(0x5EED, 3, *ARGS)
    L.way("c-entry", ck, True)(0x5EED, 3, *ARGS)
    assert len(seen) == 4 and seen[2] == seen[3] and seen[2] != seen[0] and seen[2][:3] == (3, 1, 1)  # the grid


def test_an_unknown_launcher_is_warned_about_once_and_not_used(monkeypatch):
    class Run:  # a launcher whose wrapper the c-entry way does not know
        launch = staticmethod(print)

        def __call__(self, *a):
            pass

    monkeypatch.setattr(L, "_WARNED", set())
    ck = types.SimpleNamespace(run=Run(), function=1, packed_metadata=(4, 1, 0))
    with pytest.warns(RuntimeWarning, match="not one dcptool knows"):
        assert L.way("c-entry", ck, False) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert L.way("c-entry", ck, True) is None  # (once)
        assert L.way("c-entry", types.SimpleNamespace(run=types.SimpleNamespace()), True) is None  # no C entry


class _FakeCore:
    """A stand-in cuda.core that records what is loaded and launched (the real one needs a GPU)."""

    def __init__(self, params: int):
        self.loaded, self.launched, self.params = [], [], params
        core = self

        class Kernel:
            num_arguments = params

        class ObjectCode:
            @staticmethod
            def from_cubin(b):
                core.loaded.append(b)
                return types.SimpleNamespace(get_kernel=lambda name: core.loaded.append(name) or Kernel())

        class Stream:
            from_handle = staticmethod(lambda h: ("stream", h))

        self.module = types.SimpleNamespace(ObjectCode=ObjectCode, Stream=Stream, LaunchConfig=lambda **kw: kw,
                                            launch=lambda *a: core.launched.append(a))


@pytest.mark.parametrize("scratch", [0, 1, 2])
def test_cuda_core_launches_the_cubin_with_the_scratch_pointers_null(monkeypatch, scratch):
    """The cuda-core way: the compiled kernel's cubin and name loaded once, each launch on the caller's stream with
    the grid, block (32 * num_warps) and shared memory of the kernel, its arguments as given and Triton's scratch
    pointers (the kernel's parameters past them) null."""
    fake = _FakeCore(len(ARGS) + scratch)
    monkeypatch.setitem(sys.modules, "cuda", types.SimpleNamespace(core=fake.module))
    monkeypatch.setitem(sys.modules, "cuda.core", fake.module)
    ck = types.SimpleNamespace(asm={"cubin": b"CUBIN"}, metadata=types.SimpleNamespace(name="snapshot_args_kernel",
                                                                                       num_warps=4, shared=96))
    go = L.way("cuda-core", ck, True)
    go(0x5EED, 3, *ARGS)
    go(0x5EED, 1, *ARGS)
    assert fake.loaded == [b"CUBIN", "snapshot_args_kernel"]
    (s, cfg, _, *args), second = fake.launched
    assert s == ("stream", 0x5EED) and cfg == dict(grid=3, block=128, shmem_size=96)
    assert tuple(args) == ARGS + (0,) * scratch and second[1]["grid"] == 1
    one = L.way("cuda-core", ck, False)
    one(0x5EED, 0xAB00)
    assert fake.launched[-1][3:] == (0xAB00,) + (0,) * (len(ARGS) + scratch - 1)


def test_cuda_core_is_no_way_where_it_is_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.core", None)
    assert L.way("cuda-core", types.SimpleNamespace(), True) is None


def test_the_cheapest_launch_is_the_first_the_check_accepts(monkeypatch):
    """cheapest tries the ways in order, keeps the first whose launch the check accepts and says why each way
    before it was refused; none: None and every reason."""
    class Run:  # a launcher wrapper the c-entry way does not know (so: no C entry)
        def __call__(self, *a):
            calls.append(a)

    monkeypatch.setitem(sys.modules, "cuda.core", None)
    calls: list = []
    ck = types.SimpleNamespace(run=Run(), function=0xF00, packed_metadata=(4, 1, 0))
    go, how, why = L.cheapest(None, lambda ring, go: go(0x5EED, 0xAB00), ck, variadic=False)
    assert how == "Triton's compiled launcher" and len(why) == 2 and "C entry" in why[0] and "cuda.core" in why[1]
    assert calls and calls[-1][3] == 0x5EED and calls[-1][-1] == 0xAB00  # (its launch ran: the check called it)

    def refuse(ring, go):
        raise RuntimeError("the slot holds garbage")

    go, how, why = L.cheapest(None, refuse, ck, variadic=True)
    assert go is None and how == "" and len(why) == 3 and "garbage" in why[2]


def test_dcptool_launch_picks_the_order(monkeypatch):
    monkeypatch.delenv(L.ENV_LAUNCH, raising=False)
    assert L.order() == ["c-entry", "cuda-core", "compiled"]
    monkeypatch.setenv(L.ENV_LAUNCH, "cuda-core, compiled")
    assert L.order() == ["cuda-core", "compiled"]
    monkeypatch.setenv(L.ENV_LAUNCH, "compiled,fastest")
    with pytest.warns(RuntimeWarning, match="names no launch way 'fastest'"):
        assert L.order() == ["c-entry", "cuda-core", "compiled"]
    calls: list = []
    ck = types.SimpleNamespace(run=lambda *a: calls.append(a), function=1, packed_metadata=(4, 1, 0))
    monkeypatch.setenv(L.ENV_LAUNCH, "compiled")
    assert L.cheapest(None, lambda ring, go: go(0, 1), ck, variadic=False)[1] == "Triton's compiled launcher"
