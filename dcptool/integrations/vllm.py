"""vLLM general plugin: with DCPTOOL_RECORD=<dir>, record every attention-metadata build of model runner V2.

Install dcptool next to vLLM (entry point group `vllm.general_plugins`, name `dcptool`); vLLM calls
`register()` in every process. Without DCPTOOL_RECORD it does nothing. With it, the worker
modules below are wrapped as they are imported, and every `build_attn_metadata` call of model
runner V2 (model states, speculators, DFlash capture) is recorded, with the batch it was built
for, into `<dir>/rank<r>.NNNNN.safetensors` through `dcptool.record.Recorder`.

Supported: vLLM 0.33.x (tested with 0.33.0). On another version it records nothing unless
DCPTOOL_VLLM_UNTESTED=1, and on any version it checks every hook point's signature first: if
vLLM's internals differ, or anything in the recording path fails, it logs one warning and stops
recording. The engine's own calls always run, with their own results and exceptions.
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import inspect
import logging
import os
import sys
import threading
from collections import Counter
from pathlib import Path

ENV_DIR = "DCPTOOL_RECORD"
ENV_ROLLOVER = "DCPTOOL_ROLLOVER"
ENV_UNTESTED = "DCPTOOL_VLLM_UNTESTED"
DEFAULT_ROLLOVER = 10_000  # observations per file: a long run leaves many closed files, not one open one
SUPPORTED = ("0.33.",)
TESTED = ("0.33.0",)
SITES = ("attn_metadata", "ubatch", "dummy", "capture", "dflash_capture", "draft", "prepare_inputs")
GRAPH = {"NONE": 0, "PIECEWISE": 1, "FULL": 3}  # runtime cudagraph mode -> obs.graph (2 = capture)

log = logging.getLogger("vllm.dcptool")

W = "vllm.v1.worker.gpu"
_PREPARE = ("input_batch", "cudagraph_mode", "for_capture", "ubatch_idx")


class _State:
    registered = False
    active = False  # hooks record only while True; False after any failure
    warned = False
    step = -1
    recorder = None
    rank = None
    interleave: int | None = None
    skipped: Counter = Counter()
    lock = threading.RLock()
    local = threading.local()
    atexit = False


_S = _State()


# --------------------------------------------------------------------------------------------
# Hook points


class _Sig:
    """Reads a call's arguments by name without binding the whole signature (hot path)."""

    def __init__(self, fn):
        params = list(inspect.signature(fn).parameters.values())
        self.names = [p.name for p in params]
        self.pos = {p.name: i for i, p in enumerate(params)}
        self.default = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}

    def get(self, args: tuple, kwargs: dict, name: str):
        if name in kwargs:
            return kwargs[name]
        i = self.pos[name]
        return args[i] if i < len(args) else self.default.get(name)


class _Frame:
    """One level of context (site, batch, step scope) around an engine call; never raises into it."""

    __slots__ = ("frame",)

    def __init__(self, make):
        self.frame = None
        if _S.active:
            try:
                self.frame = make()
            except Exception as e:  # an engine object without what we expect: stop recording
                _broken(e)

    def __enter__(self):
        if self.frame is not None:
            st = _stack()
            if self.frame.get("scope") and not any(f.get("scope") for f in st):
                _S.step += 1
            st.append(self.frame)
        return self.frame

    def __exit__(self, *exc):
        if self.frame is not None:
            st = _stack()
            if st and st[-1] is self.frame:
                st.pop()
        return False


def _stack() -> list[dict]:
    st = getattr(_S.local, "stack", None)
    if st is None:
        st = _S.local.stack = []
    return st


def _ctx() -> dict:
    out: dict = {}
    for f in _stack():
        out.update(f)  # inner frames win
    return out


def _mode(m) -> str:
    return getattr(m, "name", str(m))


def _learn(obj) -> None:
    """Remember the interleave from an engine object that knows it (runner, block tables, ...)."""
    il = getattr(obj, "cp_interleave", None)
    if isinstance(il, int) and il >= 1 and _S.interleave is None:
        _S.interleave = il


def _wrap_build(orig, sig):
    @functools.wraps(orig)
    def build_attn_metadata(*args, **kwargs):
        if _S.active:
            try:
                _record_build(sig, args, kwargs)
            except Exception as e:
                _broken(e)
        return orig(*args, **kwargs)

    return build_attn_metadata


def _record_build(sig: _Sig, args: tuple, kwargs: dict) -> None:
    c = _ctx()
    if c.get("skip"):
        _S.skipped[c["skip"]] += 1
        return
    n = int(sig.get(args, kwargs, "num_reqs"))
    batch = c.get("batch")
    kw: dict = {}
    if batch is not None:
        # The model state passes the padded count only for FULL graphs; the batch knows both.
        nr, nrp = batch.num_reqs, batch.num_reqs_after_padding
        kw["query_start_loc"] = batch.query_start_loc_np[: nrp + 1]
        kw["num_tokens_padded"] = int(batch.num_tokens_after_padding)
    else:
        nr, nrp = int(c.get("num_reqs", n)), n
        kw["query_start_loc"] = sig.get(args, kwargs, "query_start_loc_cpu")
    ub = c.get("ubatch")
    if ub is not None:
        kw.update(ubatch=ub[0], parent=ub[1], req_start=ub[2], tok_start=ub[3], tok_stop=ub[4])
    if "capture_graph" in c:
        graph = c["capture_graph"]
    elif "cg" in c:
        graph = GRAPH.get(c["cg"], 0)
    else:
        graph = 2 if sig.get(args, kwargs, "for_cudagraph_capture") else 0
    _observe(site="ubatch" if ub is not None else c.get("site", "attn_metadata"),
             seq_lens=sig.get(args, kwargs, "seq_lens"), num_reqs=nr, num_reqs_padded=nrp,
             dcp_local_seq_lens=sig.get(args, kwargs, "dcp_local_seq_lens"), graph=graph, **kw)


def _wrap_prepare_attn(orig, sig):
    @functools.wraps(orig)
    def prepare_attn(*args, **kwargs):
        def make():
            batch = sig.get(args, kwargs, "input_batch")
            f = {"scope": True, "batch": batch, "cg": _mode(sig.get(args, kwargs, "cudagraph_mode"))}
            for parent in reversed(_stack()):
                sliced = parent.get("sliced")
                if sliced is not None and id(batch) in sliced:
                    f["ubatch"] = (int(sig.get(args, kwargs, "ubatch_idx")), parent["parent"]) + sliced[id(batch)]
                    break
            return f

        with _Frame(make):
            return orig(*args, **kwargs)

    prepare_attn.__dcptool_prepare__ = True
    return prepare_attn


def _ensure_prepare_wrapped(model_state) -> None:
    """Wrap prepare_attn of the model state a runner really uses (model-specific subclasses too)."""
    for cls in type(model_state).__mro__:
        fn = cls.__dict__.get("prepare_attn")
        if fn is None or getattr(fn, "__dcptool_prepare__", False) or not callable(fn):
            continue
        sig = _Sig(fn)
        if all(p in sig.pos for p in _PREPARE):
            cls.prepare_attn = _wrap_prepare_attn(fn, sig)


def _wrap_execute(orig, sig):
    @functools.wraps(orig)
    def execute_model(*args, **kwargs):
        def make():
            runner = args[0]
            _learn(runner)
            if getattr(runner, "model_state", None) is not None:
                _ensure_prepare_wrapped(runner.model_state)
            return {"scope": True, "site": "dummy" if sig.get(args, kwargs, "dummy_run") else "attn_metadata"}

        with _Frame(make):
            return orig(*args, **kwargs)

    return execute_model


def _wrap_capture(site: str, full_param: str | None):
    """prepare_inputs_to_capture (full_cudagraph) and the DFlash capture path (FULL only)."""

    def make_wrapper(orig, sig):
        @functools.wraps(orig)
        def capture(*args, **kwargs):
            def make():
                _learn(sig.get(args, kwargs, "block_tables"))
                if "model_state" in sig.pos:
                    _ensure_prepare_wrapped(sig.get(args, kwargs, "model_state"))
                full = True if full_param is None else bool(sig.get(args, kwargs, full_param))
                return {"scope": True, "site": site, "capture_graph": 2 if full else 1, "batch": None}

            with _Frame(make):
                return orig(*args, **kwargs)

        return capture

    return make_wrapper


def _wrap_ubatch_prepare(orig, sig):
    @functools.wraps(orig)
    def prepare(*args, **kwargs):
        def make():
            runner, batch = args[0], sig.get(args, kwargs, "input_batch")
            _learn(runner)
            _ensure_prepare_wrapped(runner.model_state)
            outer = _ctx()
            capture = bool(sig.get(args, kwargs, "for_capture")) and "site" not in outer
            f = {"scope": True, "sliced": {}, "parent": -1}
            if capture:
                f.update(site="capture", capture_graph=2)
            site = f.get("site", outer.get("site", "attn_metadata"))
            graph = 2 if capture else GRAPH.get(_mode(sig.get(args, kwargs, "cg_mode")), 0)
            # The merged batch is no attention build, but it is what the micro-batches are sliced from:
            # record it when it carries a view (a capture's merged batch never gets one, legitimately).
            if batch.dcp_local_seq_lens is not None or _dcp()[0] == 1:
                f["pending"] = (site, batch, graph)
            return f

        with _Frame(make) as f:
            if f is not None and "pending" in f:
                try:
                    f["parent"] = _observe_batch(*f.pop("pending"))
                except Exception as e:
                    _broken(e)
            return orig(*args, **kwargs)

    return prepare


def _wrap_slice(orig, sig):
    @functools.wraps(orig)
    def _slice_input_batch(*args, **kwargs):
        out = orig(*args, **kwargs)
        if _S.active:
            try:
                s = sig.get(args, kwargs, "ubatch_slice")
                for f in reversed(_stack()):
                    if "sliced" in f:
                        f["sliced"][id(out)] = (int(s.request_slice.start), int(s.token_slice.start),
                                                int(s.token_slice.stop))
                        break
            except Exception as e:
                _broken(e)
        return out

    return _slice_input_batch


def _wrap_draft(orig, sig):
    @functools.wraps(orig)
    def _build_attn_metadata(*args, **kwargs):
        def make():
            spec = args[0]
            _learn(getattr(spec, "block_tables", None))
            f = {"site": "draft", "batch": None, "num_reqs": int(sig.get(args, kwargs, "num_reqs")),
                 "cg": _mode(sig.get(args, kwargs, "batch_desc").cg_mode)}
            if getattr(spec, "dcp_size", None) == 1 and _dcp()[0] > 1:
                f["skip"] = "draft builds of a speculator whose KV cache is not DCP-sharded"
            return f

        with _Frame(make):
            return orig(*args, **kwargs)

    return _build_attn_metadata


def _wrap_partition(orig, sig):
    @functools.wraps(orig)
    def partition_batch(*args, **kwargs):
        if _S.active:
            try:
                _learn(args[0])
                batch = sig.get(args, kwargs, "input_batch")
                # vLLM 0.33 partitions a batch without a view; a view here was derived from the global
                # batch, and anything that reaches the local batch from it is stale: record the source.
                if batch.dcp_local_seq_lens is not None:
                    _observe_batch("prepare_inputs", batch,
                                   GRAPH.get(_mode(sig.get(args, kwargs, "batch_desc").cg_mode), 0))
            except Exception as e:
                _broken(e)
        return orig(*args, **kwargs)

    return partition_batch


# module -> [(attribute path, wrapper factory, parameters the wrapper reads)]
HOOKS: dict[str, list[tuple[str, object, tuple[str, ...]]]] = {
    f"{W}.attn_utils": [("build_attn_metadata", _wrap_build,
                         ("num_reqs", "seq_lens", "dcp_local_seq_lens", "query_start_loc_cpu",
                          "for_cudagraph_capture"))],
    f"{W}.model_states.default": [("DefaultModelState.prepare_attn", _wrap_prepare_attn, _PREPARE)],
    f"{W}.model_states.mamba_hybrid": [("MambaHybridModelState.prepare_attn", _wrap_prepare_attn, _PREPARE)],
    f"{W}.model_states.encoder_decoder": [("EncoderDecoderModelState.prepare_attn", _wrap_prepare_attn, _PREPARE)],
    f"{W}.model_states.encoder_only": [("EncoderOnlyModelState.prepare_attn", _wrap_prepare_attn, _PREPARE)],
    f"{W}.model_runner": [("GPUModelRunner.execute_model", _wrap_execute, ("dummy_run",))],
    f"{W}.ubatch_utils": [("UBatchRunner.prepare", _wrap_ubatch_prepare, ("input_batch", "cg_mode", "for_capture")),
                          ("_slice_input_batch", _wrap_slice, ("input_batch", "ubatch_slice"))],
    f"{W}.cudagraph_utils": [("prepare_inputs_to_capture", _wrap_capture("capture", "full_cudagraph"),
                              ("block_tables", "model_state", "full_cudagraph"))],
    f"{W}.spec_decode.speculator": [("DraftModelSpeculator._build_attn_metadata", _wrap_draft,
                                     ("num_reqs", "batch_desc"))],
    f"{W}.spec_decode.dflash.cudagraph": [("_prepare_dflash_inputs_to_capture", _wrap_capture("dflash_capture", None),
                                           ("block_tables",))],
    f"{W}.pcp_manager": [("PCPManager.partition_batch", _wrap_partition, ("input_batch", "batch_desc"))],
}


def _patch(modname: str, module) -> None:
    """Wrap this module's hook points, after checking every one of them; any mismatch stops recording."""
    plan = []
    for path, make, params in HOOKS[modname]:
        owner, attr = module, path
        if "." in path:
            cls, attr = path.split(".")
            owner = getattr(module, cls, None)
            if owner is None:
                return _broken(f"{modname}.{cls} not found")
        fn = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if fn is None or not callable(fn):
            return _broken(f"{modname}.{path} not found")
        if getattr(fn, "__wrapped_by_dcptool__", False):
            continue
        sig = _Sig(fn)
        missing = [p for p in params if p not in sig.pos]
        if missing:
            return _broken(f"{modname}.{path} has no parameter {', '.join(missing)}")
        plan.append((owner, attr, fn, make(fn, sig)))
    for owner, attr, fn, wrapper in plan:
        wrapper.__wrapped_by_dcptool__ = True
        setattr(owner, attr, wrapper)
        if owner is module:  # modules that imported the function by name before we got here
            for m in list(sys.modules.values()):
                if getattr(m, "__name__", "").startswith("vllm") and getattr(m, attr, None) is fn:
                    setattr(m, attr, wrapper)


class _Finder(importlib.abc.MetaPathFinder):
    """Patches a hooked module right after it executes, so nothing is imported early."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in HOOKS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        if _S.active:
            try:
                _patch(module.__name__, module)
            except Exception as e:
                _broken(e)

    def __getattr__(self, name):
        return getattr(self._inner, name)


# --------------------------------------------------------------------------------------------
# Recording


def _broken(why) -> None:
    """Stop recording for good and say so once; what was recorded so far is still written at exit."""
    _S.active = False
    if not _S.warned:
        _S.warned = True
        log.warning("dcptool: vLLM recording disabled, nothing more is recorded (%s%s)",
                    type(why).__name__ + ": " if isinstance(why, BaseException) else "", why)


def _dcp() -> tuple[int, int]:
    """(DCP world size, this process's DCP rank) from vLLM's DCP group; (1, 0) before it exists, as vLLM does."""
    from vllm.distributed import parallel_state as ps

    if getattr(ps, "_DCP", None) is None:
        return 1, 0
    g = ps.get_dcp_group()
    return int(g.world_size), int(g.rank_in_group)


def _capturing() -> bool:
    """True inside CUDA-graph capture, where a host copy would invalidate the graph (we skip, counted)."""
    torch = sys.modules.get("torch")  # no torch imported: nothing can be capturing
    if torch is None or not _has_cuda(torch):
        return False
    return torch.cuda.is_current_stream_capturing()


@functools.cache
def _has_cuda(torch) -> bool:
    return bool(torch.cuda.is_available())


def _interleave() -> int | None:
    if _S.interleave is None:
        try:
            from vllm.config import get_current_vllm_config_or_none

            cfg = get_current_vllm_config_or_none()
            if cfg is not None:
                _S.interleave = int(cfg.parallel_config.cp_kv_cache_interleave_size)
        except Exception:
            pass
    return _S.interleave


def _file_name(rank: int, dcp_size: int) -> str:
    """rank<r>, plus the global rank when several processes share DCP rank r (TP/PP/DP groups)."""
    try:
        dist = getattr(sys.modules.get("torch"), "distributed", None)  # a vLLM worker has imported it
        if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() != dcp_size:
            return f"rank{rank}.g{dist.get_rank()}.safetensors"
    except Exception:
        pass
    return f"rank{rank}.safetensors"


def _recorder():
    if _S.recorder is not None:
        return _S.recorder
    il = _interleave()
    if il is None:
        _S.skipped["cp_kv_cache_interleave_size not known yet"] += 1
        return None
    import vllm

    from dcptool.record import Recorder

    dcp_size, rank = _dcp()
    pcp = 1
    try:
        from vllm.distributed import parallel_state as ps

        if getattr(ps, "_PCP", None) is not None:
            pcp = int(ps.get_pcp_group().world_size)
    except Exception:
        pass
    out = Path(os.environ[ENV_DIR])
    out.mkdir(parents=True, exist_ok=True)
    path = out / _file_name(rank, dcp_size)
    roll = int(os.environ.get(ENV_ROLLOVER) or DEFAULT_ROLLOVER)
    if list(out.glob(f"{path.stem}.*{path.suffix}")):
        log.warning("dcptool: %s already holds dumps named %s.*; this run replaces them (all of them, when it "
                    "writes its first file), record into an empty directory to keep them", out, path.stem)
    # force: an engine is not stopped for an old recording (the Recorder would refuse it otherwise)
    _S.recorder = Recorder(path, dcp_size, il, sites=SITES, pcp_size=pcp, engine="vllm",
                           engine_version=vllm.__version__, rollover=roll, force=True,
                           note=f"dcptool.integrations.vllm, pid {os.getpid()}")
    _S.rank = rank
    if not _S.atexit:
        _S.atexit = True
        atexit.register(close)
    log.info("dcptool: recording DCP metadata to %s (%d observations per file)", path, roll)
    return _S.recorder


def _observe(**kw) -> int:
    if _capturing():
        _S.skipped["built during CUDA-graph capture"] += 1
        return -1
    rec = _recorder()
    if rec is None:
        return -1
    if not _stack():  # a build outside any step scope is a step of its own
        _S.step += 1
    with _S.lock:
        return rec.observe(step=max(_S.step, 0), rank=_dcp()[1], **kw)


def _observe_batch(site: str, batch, graph: int) -> int:
    """Record a whole InputBatch that is no attention build itself (a micro-batch parent, a PCP input)."""
    nrp = batch.num_reqs_after_padding
    return _observe(site=site, seq_lens=batch.seq_lens, num_reqs=batch.num_reqs, num_reqs_padded=nrp,
                    dcp_local_seq_lens=batch.dcp_local_seq_lens, query_start_loc=batch.query_start_loc_np[: nrp + 1],
                    num_tokens_padded=int(batch.num_tokens_after_padding), graph=graph)


# --------------------------------------------------------------------------------------------
# Public


def register() -> None:
    """vLLM's plugin entry point (every process). Does nothing unless DCPTOOL_RECORD is set."""
    if _S.registered or not os.environ.get(ENV_DIR):
        return
    _S.registered = True
    try:
        import vllm

        version = getattr(vllm, "__version__", "unknown")
        if not version.startswith(SUPPORTED) and not os.environ.get(ENV_UNTESTED):
            return _broken(f"vLLM {version} is not supported (tested with {', '.join(TESTED)}); "
                           f"{ENV_UNTESTED}=1 records anyway if every hook point matches")
        _S.active = True
        sys.meta_path.insert(0, _Finder())
        for name in HOOKS:
            if name in sys.modules:
                _patch(name, sys.modules[name])
    except Exception as e:
        _broken(e)


class step:
    """Group builds into one engine step, as GPUModelRunner.execute_model does (for drivers and tests)."""

    def __enter__(self):
        self._f = _Frame(lambda: {"scope": True})
        return self._f.__enter__()

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)


def close() -> list[Path]:
    """Write what is recorded (atomically) and start over; runs at process exit. Returns the files."""
    with _S.lock:
        rec, _S.recorder = _S.recorder, None
        files = rec.close() if rec is not None else []
        if rec is not None:
            log.info("dcptool: wrote %d observations to %d file(s) in %s%s", len(rec), len(files),
                     files[0].parent if files else "?",
                     "; not recorded: " + ", ".join(f"{k} ({v})" for k, v in _S.skipped.items()) if _S.skipped else "")
        _S.step = -1
        _S.interleave = None
        _S.skipped.clear()
        return files
