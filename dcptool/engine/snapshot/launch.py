"""The ways a compiled Triton kernel can be launched from the engine's thread, cheapest first, and the first of them a
caller's check accepts (on known values, once: a way that writes anything else is never used).

WAYS, in the order they are tried (DCPTOOL_LAUNCH=way,way,... picks others, e.g. `cuda-core,compiled`):
- "c-entry": the compiled launcher's C entry, called with the arguments Triton's own Python wrapper
  (CudaLauncher.__call__) passes. The wrapper is private, so the entry is used only where its source is one of the
  two this module knows (_WRAPPED: triton 3.6 and 3.9); any other Triton takes the next way, with a warning.
- "cuda-core": NVIDIA's cuda.core (maintained, public): the kernel's cubin (compiled.asm["cubin"]) loaded as an
  ObjectCode and launched with cuda.core.launch on the engine's stream; where cuda.core is installed.
- "compiled": Triton's compiled launcher (CompiledKernel.run) as Triton's dispatch calls it, without the dispatch's
  argument binding and cache lookup.
Triton's dispatch itself (kernel[grid](...)) is the caller's reference and last resort.

A way is `go(raw_stream, grid, *args)` (variadic) or `go(raw_stream, arg)` (one argument on one program)."""

from __future__ import annotations

import os
import warnings

ENV_LAUNCH = "DCPTOOL_LAUNCH"


def _compiled(ck, variadic: bool = False):
    """A launch through Triton's compiled launcher (no dispatch: no argument binding, no cache lookup)."""
    run, fn, meta = ck.run, ck.function, ck.packed_metadata
    if variadic:
        return lambda raw, g, *a: run(g, 1, 1, raw, fn, meta, None, None, None, *a)
    return lambda raw, at: run(1, 1, 1, raw, fn, meta, None, None, None, at)


# The Python wrapper (CudaLauncher.__call__) of the launchers whose C entry `launch` is called directly: its
# call of `self.launch`, whitespace removed. Another wrapper (another Triton) is not used.
_WRAPPED = {  # triton 3.6: the kernel's arguments unpacked
    "self.launch(gridX,gridY,gridZ,stream,function,self.launch_cooperative_grid,self.launch_pdl,global_scratch,"
    "profile_scratch,*args)": 36,
    # triton 3.9: annotations, a signature and the kernel's arguments as one tuple
    "self.launch(gridX,gridY,gridZ,stream,function,self.launch_cooperative_grid,self.launch_pdl,kernel_metadata,"
    "launch_metadata,launch_enter_hook,launch_exit_hook,global_scratch,profile_scratch,self.arg_annotations,"
    "self.kernel_signature,kernel_args)": 39,
}
_WARNED: set = set()


def _c_entry(ck, variadic: bool = False):
    """A launch through the compiled launcher's C entry with the arguments its Python wrapper would pass (its
    Python frame saved per launch), for a wrapper known to pass exactly these (_WRAPPED) with no scratch memory to
    allocate; else None (warned once: an unknown Triton takes the next way)."""
    import inspect

    run = ck.run
    launch = getattr(run, "launch", None)
    try:
        src = "".join(inspect.getsource(type(run).__call__).split())
    except (OSError, TypeError):
        return None
    kind = [v for k, v in _WRAPPED.items() if k in src]
    if launch is not None and len(kind) != 1 and type(run) not in _WARNED:
        _WARNED.add(type(run))
        warnings.warn("dcptool: this Triton's kernel launcher is not one dcptool knows (triton 3.6 and 3.9 are); "
                      "its C entry is not used, the next launch way is (DCPTOOL_LAUNCH picks one)", RuntimeWarning,
                      stacklevel=4)
    if (launch is None or len(kind) != 1 or getattr(run, "global_scratch_size", 1) != 0
            or getattr(run, "profile_scratch_size", 1) != 0 or getattr(run, "gsan_enabled", False)):
        return None
    fn, meta, coop, pdl = ck.function, ck.packed_metadata, run.launch_cooperative_grid, run.launch_pdl
    if kind[0] == 36:
        if variadic:
            return lambda raw, g, *a: launch(g, 1, 1, raw, fn, coop, pdl, None, None, meta, None, None, None, *a)
        return lambda raw, at: launch(1, 1, 1, raw, fn, coop, pdl, None, None, meta, None, None, None, at)
    ann, sig = run.arg_annotations, run.kernel_signature
    if variadic:
        return lambda raw, g, *a: launch(g, 1, 1, raw, fn, coop, pdl, meta, None, None, None, None, None, ann, sig, a)
    return lambda raw, at: launch(1, 1, 1, raw, fn, coop, pdl, meta, None, None, None, None, None, ann, sig, (at,))


def _cuda_core(ck, variadic: bool = False):
    """A launch through NVIDIA's cuda.core: the kernel's cubin loaded once, launched with cuda.core.launch on the
    caller's stream (wrapped once per stream), one LaunchConfig per grid size. The kernel's parameters past the
    caller's arguments (Triton's global and profile scratch pointers) are passed as null. Python ints go as 8-byte
    values; the driver copies each parameter's own size of them (an int32 parameter: the low 4 bytes). None where
    cuda.core is not installed."""
    try:
        from cuda.core import LaunchConfig, ObjectCode, Stream, launch
    except ImportError:
        return None
    meta = ck.metadata
    if getattr(meta, "shared", 0) > 48 * 1024:
        return None  # (more shared memory than a launch gets without an attribute set first)
    kernel = ObjectCode.from_cubin(ck.asm["cubin"]).get_kernel(meta.name)
    block = 32 * meta.num_warps
    configs: dict = {}
    streams: dict = {}
    extra: list = []  # (the null scratch pointers, counted at the first launch from the kernel's parameters)

    def go(raw, g, *a):
        s = streams.get(raw)
        if s is None:
            s = streams[raw] = Stream.from_handle(raw)
            extra[:] = [0] * (kernel.num_arguments - len(a))
        c = configs.get(g)
        if c is None:
            c = configs[g] = LaunchConfig(grid=g, block=block, shmem_size=meta.shared)
        launch(s, c, kernel, *a, *extra)

    if variadic:
        return go
    return lambda raw, at: go(raw, 1, at)


WAYS = {"c-entry": ("the launcher's C entry", _c_entry), "cuda-core": ("cuda.core", _cuda_core),
        "compiled": ("Triton's compiled launcher", _compiled)}


def order() -> list[str]:
    """The ways to try, in order: DCPTOOL_LAUNCH's (names of WAYS, comma-separated; an unknown name warns), else
    WAYS' order."""
    got = [w.strip() for w in os.environ.get(ENV_LAUNCH, "").split(",") if w.strip()]
    unknown = [w for w in got if w not in WAYS]
    if unknown:
        warnings.warn(f"dcptool: {ENV_LAUNCH}={os.environ[ENV_LAUNCH]!r} names no launch way {unknown[0]!r} (known: "
                      f"{', '.join(WAYS)}); launching in the default order", RuntimeWarning, stacklevel=3)
        got = []
    return got or list(WAYS)


def way(name: str, ck, variadic: bool):
    """One way's launch of compiled kernel `ck`, or None where this way cannot launch it here."""
    return WAYS[name][1](ck, variadic=variadic)


def cheapest(target, check, ck, variadic: bool) -> tuple:
    """(go, how, why): the first launch of compiled kernel `ck` (in order()) that `check(target, go)` accepts; (None,
    "", why) when none does. `why` says what each rejected way raised."""
    why = []
    for name in order():
        how = WAYS[name][0]
        try:
            go = way(name, ck, variadic)
            if go is None:
                raise RuntimeError("not available here")
            check(target, go)
            return go, how, why
        except Exception as e:  # not callable so here: the next way
            why.append(f"{how}: {e!r}")
    return None, "", why
