"""vLLM general plugin: with DCPTOOL_RECORD=<dir>, record every attention-metadata build of model runner V2.
(Over 450 lines: the hook table, per-release signature checks and the wrappers must be read together.)

Install dcptool next to vLLM (entry point group `vllm.general_plugins`, name `dcptool`); vLLM calls
`register()` in every process. Without DCPTOOL_RECORD it does nothing. With it, the worker
modules below are wrapped as they are imported, and every `build_attn_metadata` call of model
runner V2 (model states, speculators, DFlash capture) is recorded, with the batch it was built
for, into `<dir>/rank<r>.NNNNN.safetensors` through `dcptool.engine.record.Recorder`.

Supported: vLLM 0.29.x to 0.34.x, through one hook table per release line (TABLES). The table is
picked by what the installed vLLM has: the one named by its version first, then any other whose
hook points all have the parameters the wrappers read (checked per module as it is imported). A
version newer than every table is tried with the newest table; an older one records nothing
unless DCPTOOL_VLLM_UNTESTED=1. If no table matches a module's signatures, or anything in the
recording path fails, it logs one warning and stops recording. The engine's own calls always run,
with their own results and exceptions.

What is recorded is what attention consumes: vLLM's `build_attn_metadata` (every supported
release) first cuts `seq_lens` and `dcp_local_seq_lens` to `[:num_reqs]`; the plugin checks that
in the function's source when it wraps it, and records those views, not the arguments.
"""

from __future__ import annotations

import ast
import atexit
import functools
import importlib.abc
import inspect
import logging
import os
import re
import sys
import textwrap
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple


class UbatchOf(NamedTuple):
    """A micro-batch's attention build: which micro-batch, the observation it was sliced from, and the
    slice (_slice_input_batch's request start and token range)."""

    ubatch: int
    parent: int
    req_start: int
    tok_start: int
    tok_stop: int


def _graph():
    """schema.GraphMode, imported on the first observation (numpy: the Recorder needs it then anyway), not
    when vLLM loads the plugin."""
    from dcptool.dump.schema import GraphMode

    return GraphMode


ENV_DIR = "DCPTOOL_RECORD"
ENV_ROLLOVER = "DCPTOOL_ROLLOVER"
ENV_UNTESTED = "DCPTOOL_VLLM_UNTESTED"
DEFAULT_ROLLOVER = 10_000  # observations per file: a long run leaves many closed files, not one open one
SITES = ("attn_metadata", "ubatch", "dummy", "capture", "dflash_capture", "draft", "prepare_inputs")

log = logging.getLogger("vllm.dcptool")

W = "vllm.v1.worker.gpu"
_PREPARE = ("input_batch", "cudagraph_mode", "for_capture")  # + ubatch_idx where micro-batches exist (0.30+)


class _State:
    registered = False
    active = False  # hooks record only while True; False after any failure
    warned = False
    step = -1
    recorder = None
    rank = None
    interleave: int | None = None
    block_tables = None  # the runner's BlockTables, once seen (slot mappings' KV-cache groups: issue 15)
    kv_groups: list | None = None  # the groups the recorder's config names (set with the first slot mapping)
    skipped: Counter = Counter()
    tables: list = []  # candidate hook tables, best first (set by register())
    modules: frozenset = frozenset()  # the modules any of them hooks
    used: dict = {}  # module -> the release line of the table its hooks came from
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
    """Remember the interleave from an engine object that knows it (runner, block tables, ...), and the block
    tables (the slot mappings' KV-cache groups)."""
    il = getattr(obj, "cp_interleave", None)
    if isinstance(il, int) and il >= 1 and _S.interleave is None:
        _S.interleave = il
    bt = obj if hasattr(obj, "slot_mappings") else getattr(obj, "block_tables", None)
    if bt is not None and hasattr(bt, "slot_mappings") and hasattr(bt, "block_sizes"):
        _S.block_tables = bt


def _consumed(fn) -> frozenset[str]:
    """The parameters `fn` cuts to `[:num_reqs]` (`x = x[:num_reqs]`) before using them, read from its source.

    That view, not the argument, is what attention consumes: 0.29's DFlash capture passes its whole
    buffer and the FULL model state the padded batch, and build_attn_metadata reads `[:num_reqs]` of
    either. Without the source (or with a vLLM that stops cutting), the argument is recorded as passed.
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    out = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        v, name = node.value, node.targets[0].id
        if (isinstance(v, ast.Subscript) and isinstance(v.value, ast.Name) and v.value.id == name
                and isinstance(v.slice, ast.Slice) and v.slice.lower is None and v.slice.step is None
                and isinstance(v.slice.upper, ast.Name) and v.slice.upper.id == "num_reqs"):
            out.add(name)
    return frozenset(out)


def _wrap_build(orig, sig):
    consumed = _consumed(orig)

    @functools.wraps(orig)
    def build_attn_metadata(*args, **kwargs):
        if _S.active:
            try:
                _record_build(sig, consumed, args, kwargs)
            except Exception as e:
                _broken(e)
        return orig(*args, **kwargs)

    build_attn_metadata.__dcptool_consumed__ = consumed
    return build_attn_metadata


def _record_build(sig: _Sig, consumed: frozenset, args: tuple, kwargs: dict) -> None:
    c = _ctx()
    if c.get("skip"):
        _S.skipped[c["skip"]] += 1
        return
    n = int(sig.get(args, kwargs, "num_reqs"))
    seq, dcp = sig.get(args, kwargs, "seq_lens"), sig.get(args, kwargs, "dcp_local_seq_lens")
    cut = "dcp_local_seq_lens" in consumed  # attention reads [:n] rows: that is the view to check
    if cut and dcp is not None:
        dcp = dcp[:n]
    if "seq_lens" in consumed:
        seq = seq[:n]
    batch = c.get("batch")
    kw: dict = {}
    if batch is not None:
        # The model state passes the padded count only for FULL graphs; the batch knows both.
        nr, nrp = batch.num_reqs, batch.num_reqs_after_padding
        if cut:
            nr, nrp = min(nr, n), n
        kw["query_start_loc"] = batch.query_start_loc_np[: nrp + 1]
        kw["num_tokens_padded"] = int(batch.num_tokens_after_padding)
    else:
        nr, nrp = int(c.get("num_reqs", n)), n
        kw["query_start_loc"] = sig.get(args, kwargs, "query_start_loc_cpu")
    ub = c.get("ubatch")
    if ub is not None:
        kw.update(ubatch=ub.ubatch, parent=ub.parent, req_start=ub.req_start, tok_start=ub.tok_start,
                  tok_stop=ub.tok_stop)
    _slot_kwargs(sig, args, kwargs, batch, kw)
    if "capture_graph" in c:
        graph = c["capture_graph"]
    elif "cg" in c:
        graph = _graph().of_vllm(c["cg"])
    else:
        graph = _graph().FULL_CAPTURE if sig.get(args, kwargs, "for_cudagraph_capture") else _graph().EAGER
    _observe(site="ubatch" if ub is not None else c.get("site", "attn_metadata"),
             seq_lens=seq, num_reqs=nr, num_reqs_padded=nrp, dcp_local_seq_lens=dcp, graph=int(graph), **kw)


def _slot_kwargs(sig: _Sig, args: tuple, kwargs: dict, batch, kw: dict) -> None:
    """Issue 15: the slot mappings build_attn_metadata hands every KV-cache group ([groups, tokens], what the KV
    writes use) with the tokens' positions (the batch's, else the call's), and the groups' sharding."""
    sm = sig.get(args, kwargs, "slot_mappings") if "slot_mappings" in sig.pos else None
    pos = getattr(batch, "positions", None) if batch is not None else None
    if pos is None and "positions" in sig.pos:
        pos = sig.get(args, kwargs, "positions")
    if sm is None or pos is None or getattr(sm, "ndim", 0) != 2 or getattr(pos, "ndim", 0) != 1:
        return
    t = int(sm.shape[1])
    if int(pos.shape[0]) < t:
        _S.skipped["slot mappings longer than the positions"] += 1
        return
    kvc = sig.get(args, kwargs, "kv_cache_config") if "kv_cache_config" in sig.pos else None
    groups = _kv_groups(kvc, int(sm.shape[0]))
    if _S.kv_groups is None:
        rec = _recorder()
        if rec is None:
            return
        rec.set_kv_groups(groups)  # (the recording's first slot mapping: no group recorded yet)
        _S.kv_groups = groups
    elif groups != _S.kv_groups:
        _S.skipped["slot mappings of other KV-cache groups than the first build's"] += 1
        return
    kw.update(positions=pos[:t], slot_mapping=sm)


@functools.cache
def _uses_kernel_block_sizes(cls) -> bool:
    """0.29-0.31's slot-mapping kernel addresses kernel blocks (kernel_block_sizes); 0.32+ KV blocks (block_sizes)."""
    try:
        return "kernel_block_sizes" in inspect.getsource(cls.init_block_table_layout_tensors)
    except (OSError, TypeError, AttributeError):
        return False


def _spec_sharded(spec) -> bool | None:
    """Whether DCP should shard this KV-cache spec's positions: its own `dcp_sharded` (0.31+: attention True,
    Mamba/GDN False, a DCP-1 drafter's layers set False by the runner), else its kind (0.29-0.30 have no flag:
    attention specs are sharded, anything else, Mamba state, is replicated); None when unknown."""
    if spec is None:
        return None
    flag = getattr(spec, "dcp_sharded", None)
    if isinstance(flag, bool):
        return flag
    return any(c.__name__ == "AttentionSpec" for c in type(spec).__mro__)


def _kv_groups(kv_cache_config, count: int) -> list[dict]:
    """The KV-cache groups: whether DCP should shard each (its spec: _spec_sharded; without a spec, what the
    slot-mapping kernel does: BlockTables.dcp_sharded on 0.31+, every group on 0.29-0.30), the block size its
    slots are counted in, and the spec's class as the name. On 0.29-0.30 the kernel localises every group, so a
    replicated group's mapping is reported (`slots`): that is the release's behaviour, not the recording's."""
    specs = [getattr(g, "kv_cache_spec", None) for g in getattr(kv_cache_config, "kv_cache_groups", None) or ()]
    if len(specs) != count:
        specs = [None] * count
    names = [type(x).__name__ if x is not None else f"group{i}" for i, x in enumerate(specs)]
    bt = _S.block_tables
    flags = getattr(bt, "dcp_sharded", None)
    if flags is not None and len(flags) == count:
        kernel = [bool(x) for x in flags.tolist()]
    else:
        kernel = [True] * count  # 0.29-0.30 (no flag), or no block tables seen: attention's default
    dcp = [k if _spec_sharded(x) is None else _spec_sharded(x) for x, k in zip(specs, kernel)]
    sizes = [None] * count
    if bt is not None:
        got = bt.kernel_block_sizes if _uses_kernel_block_sizes(type(bt)) else bt.block_sizes
        if got is not None and len(got) == count:
            sizes = [int(b) for b in got]
    return [{"name": n, "dcp": f, **({"block_size": b} if b else {})} for n, f, b in zip(names, dcp, sizes)]


def _cg(sig: _Sig, args: tuple, kwargs: dict) -> str | None:
    """The call's CUDA-graph mode: a `cg_mode` parameter (0.30-0.33), a `batch_desc` (0.31+), or unknown."""
    if "cg_mode" in sig.pos:
        return _mode(sig.get(args, kwargs, "cg_mode"))
    if "batch_desc" in sig.pos:
        return _mode(sig.get(args, kwargs, "batch_desc").cg_mode)
    return None


def _wrap_prepare_attn(orig, sig):
    @functools.wraps(orig)
    def prepare_attn(*args, **kwargs):
        def make():
            batch = sig.get(args, kwargs, "input_batch")
            f = {"scope": True, "batch": batch, "cg": _mode(sig.get(args, kwargs, "cudagraph_mode"))}
            for parent in reversed(_stack()):
                sliced = parent.get("sliced")
                if sliced is not None and id(batch) in sliced:
                    i = int(sig.get(args, kwargs, "ubatch_idx")) if "ubatch_idx" in sig.pos else 0
                    f["ubatch"] = UbatchOf(i, parent["parent"], *sliced[id(batch)])
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
                f.update(site="capture", capture_graph=_graph().FULL_CAPTURE)
            site = f.get("site", outer.get("site", "attn_metadata"))
            graph = _graph().FULL_CAPTURE if capture else _graph().of_vllm(_cg(sig, args, kwargs))
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
            f = {"site": "draft", "batch": None, "num_reqs": int(sig.get(args, kwargs, "num_reqs"))}
            cg = _cg(sig, args, kwargs)
            if cg is not None:
                f["cg"] = cg
            # 0.30+ keep the speculator's DCP size, 0.29 its block tables'
            size = getattr(spec, "dcp_size", None)
            if size is None:
                size = getattr(getattr(spec, "block_tables", None), "cp_size", None)
            if size == 1 and _dcp()[0] > 1:
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
                # 0.30+ partition a batch without a view; 0.29 one whose view prepare_inputs derived from the
                # global batch (and recomputes it from the local one). Anything that reaches the local batch
                # from it is stale: record the source.
                if batch.dcp_local_seq_lens is not None:
                    _observe_batch("prepare_inputs", batch, _graph().of_vllm(_cg(sig, args, kwargs)))
            except Exception as e:
                _broken(e)
        return orig(*args, **kwargs)

    return partition_batch


Hooks = dict[str, list[tuple[str, object, tuple[str, ...]]]]  # module -> [(attribute, wrapper factory, params)]


@dataclass(frozen=True)
class Table:
    """The hook points of one release line of vLLM, and the sites it can produce."""

    line: str  # "0.31-0.33"
    releases: tuple[str, ...]  # version prefixes it was written for ("0.31.", ...)
    tested: tuple[str, ...]  # releases `make test-vllm` drives it against
    hooks: Hooks
    sites: tuple[str, ...]
    why_not: str = ""  # the sites it cannot produce, and why
    # issue 15: the slot columns (build_attn_metadata's slot_mappings, every release) and how groups are sharded
    slots: str = "slot mappings per KV-cache group, each group's sharding from its spec (dcp_sharded)"


def _hooks(*, ubatch_idx: bool, ubatch_prepare: tuple[str, ...] | None, draft: tuple[str, tuple[str, ...]],
           partition: tuple[str, ...]) -> Hooks:
    prep = _PREPARE + (("ubatch_idx",) if ubatch_idx else ())
    h: Hooks = {
        f"{W}.attn_utils": [("build_attn_metadata", _wrap_build,
                             ("num_reqs", "seq_lens", "dcp_local_seq_lens", "query_start_loc_cpu",
                              "for_cudagraph_capture"))],  # (+ slot_mappings, positions: read where present)
        f"{W}.model_states.default": [("DefaultModelState.prepare_attn", _wrap_prepare_attn, prep)],
        f"{W}.model_states.mamba_hybrid": [("MambaHybridModelState.prepare_attn", _wrap_prepare_attn, prep)],
        f"{W}.model_states.encoder_decoder": [("EncoderDecoderModelState.prepare_attn", _wrap_prepare_attn, prep)],
        f"{W}.model_states.encoder_only": [("EncoderOnlyModelState.prepare_attn", _wrap_prepare_attn, prep)],
        f"{W}.model_runner": [("GPUModelRunner.execute_model", _wrap_execute, ("dummy_run",))],
        f"{W}.cudagraph_utils": [("prepare_inputs_to_capture", _wrap_capture("capture", "full_cudagraph"),
                                  ("block_tables", "model_state", "full_cudagraph"))],
        f"{W}.spec_decode.speculator": [(f"DraftModelSpeculator.{draft[0]}", _wrap_draft, draft[1])],
        f"{W}.spec_decode.dflash.cudagraph": [("_prepare_dflash_inputs_to_capture",
                                               _wrap_capture("dflash_capture", None), ("block_tables",))],
        f"{W}.pcp_manager": [("PCPManager.partition_batch", _wrap_partition, ("input_batch",) + partition)],
    }
    if ubatch_prepare is not None:
        h[f"{W}.ubatch_utils"] = [("UBatchRunner.prepare", _wrap_ubatch_prepare,
                                   ("input_batch", "for_capture") + ubatch_prepare),
                                  ("_slice_input_batch", _wrap_slice, ("input_batch", "ubatch_slice"))]
    return h


# Oldest first. What differs between release lines (read from each release's own code):
#  0.29  no micro-batching in model runner V2 (no ubatch_utils), prepare_attn has no ubatch_idx, the
#        speculator builds drafts in _build_draft_attn_metadata(num_reqs, num_reqs_padded, ...),
#        partition_batch(input_batch, padded_num_tokens); pre-fix: dummy runs pass None.
#  0.30  UBatchRunner.prepare(..., cg_mode), ubatch_idx, _build_attn_metadata(num_reqs, batch_desc),
#        partition_batch(input_batch, padded_num_tokens, padded_num_reqs); the first release with the fix.
#  0.31-0.33  partition_batch(input_batch, batch_desc).
#  0.34  UBatchRunner.prepare(..., batch_desc, dp_sync_state, for_capture).
_DRAFT = ("_build_attn_metadata", ("num_reqs", "batch_desc"))
_NO_UBATCH = "ubatch: this release has no model-runner-V2 micro-batching (vllm/v1/worker/gpu/ubatch_utils.py)"
_ALL_SHARDED = ("slot mappings per KV-cache group, each group's sharding from its spec's kind; this release's "
                "slot-mapping kernel has no dcp_sharded flag and localises every group (replay: slots on a "
                "replicated group)")
TABLES: tuple[Table, ...] = (
    Table("0.29", ("0.29.",), ("0.29.0",),
          _hooks(ubatch_idx=False, ubatch_prepare=None,
                 draft=("_build_draft_attn_metadata", ("num_reqs", "num_reqs_padded")),
                 partition=("padded_num_tokens",)),
          tuple(s for s in SITES if s != "ubatch"), _NO_UBATCH, _ALL_SHARDED),
    Table("0.30", ("0.30.",), ("0.30.0",),
          _hooks(ubatch_idx=True, ubatch_prepare=("cg_mode",), draft=_DRAFT,
                 partition=("padded_num_tokens", "padded_num_reqs")), SITES, slots=_ALL_SHARDED),
    Table("0.31-0.33", ("0.31.", "0.32.", "0.33."), ("0.31.0", "0.32.0", "0.33.0"),
          _hooks(ubatch_idx=True, ubatch_prepare=("cg_mode",), draft=_DRAFT,
                 partition=("batch_desc",)), SITES),
    Table("0.34", ("0.34.",), ("0.34.0",),
          _hooks(ubatch_idx=True, ubatch_prepare=("batch_desc",),
                 draft=_DRAFT, partition=("batch_desc",)), SITES),
)
TESTED = tuple(v for t in TABLES for v in t.tested)


def _release(version: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m[1]), int(m[2])) if m else None


def tables_for(version: str, untested: bool = False) -> list[Table]:
    """The hook tables to try for a vLLM version, best first (empty: not supported).

    The release line's own table comes first, then the others newest first, so a build whose
    internals are another line's (a backport, a dev build) is still recorded when every hook matches.
    A version newer than every table gets the newest (checked like any other); an older or
    unreadable one gets nothing unless `untested`.
    """
    own = [t for t in TABLES if version.startswith(t.releases)]
    rest = [t for t in reversed(TABLES) if t not in own]
    if own:
        return own + rest
    rel, newest = _release(version), _release(TABLES[-1].releases[-1])
    if rel is not None and newest is not None and rel > newest:
        return [TABLES[-1]]
    return rest if untested else []


def _plan(modname: str, module, hooks) -> tuple[list, str | None]:
    """The wrappers for one table's hooks of this module, or why that table does not fit it."""
    plan = []
    for path, make, params in hooks:
        owner, attr = module, path
        if "." in path:
            cls, attr = path.split(".")
            owner = getattr(module, cls, None)
            if owner is None:
                return [], f"{modname}.{cls} not found"
        fn = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
        if fn is None or not callable(fn):
            return [], f"{modname}.{path} not found"
        if getattr(fn, "__wrapped_by_dcptool__", False):
            continue
        sig = _Sig(fn)
        missing = [p for p in params if p not in sig.pos]
        if missing:
            return [], f"{modname}.{path} has no parameter {', '.join(missing)}"
        plan.append((owner, attr, fn, make(fn, sig)))
    return plan, None


def _patch(modname: str, module) -> None:
    """Wrap this module's hook points with the first candidate table whose hooks all match; else stop recording."""
    first = None
    for table in _S.tables:
        if modname not in table.hooks:
            continue
        plan, why = _plan(modname, module, table.hooks[modname])
        if why is not None:
            first = first or why
            continue
        _S.used[modname] = table.line
        for owner, attr, fn, wrapper in plan:
            wrapper.__wrapped_by_dcptool__ = True
            setattr(owner, attr, wrapper)
            if owner is module:  # modules that imported the function by name before we got here
                for m in list(sys.modules.values()):
                    if getattr(m, "__name__", "").startswith("vllm") and getattr(m, attr, None) is fn:
                        setattr(m, attr, wrapper)
        return
    if first is not None:
        _broken(first)


def _hooked_modules() -> set[str]:
    return {m for t in _S.tables for m in t.hooks}


class _Finder(importlib.abc.MetaPathFinder):
    """Patches a hooked module right after it executes, so nothing is imported early."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _S.modules:
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

    from dcptool.engine.record import Recorder

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
    sites = _S.tables[0].sites if _S.tables else SITES
    _S.recorder = Recorder(path, dcp_size, il, sites=sites, pcp_size=pcp, engine="vllm",
                           engine_version=vllm.__version__, rollover=roll, force=True,
                           note=f"dcptool.engine.vllm, pid {os.getpid()}; {sites_note(vllm.__version__)}")
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
                    num_tokens_padded=int(batch.num_tokens_after_padding), graph=int(graph))


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
        _S.tables = tables_for(version, bool(os.environ.get(ENV_UNTESTED)))
        if not _S.tables:
            return _broken(f"vLLM {version} is not supported (supported: {', '.join(t.line for t in TABLES)}; "
                           f"tested with {', '.join(TESTED)}); {ENV_UNTESTED}=1 records anyway if every hook "
                           "point matches")
        if not version.startswith(tuple(r for t in TABLES for r in t.releases)):
            log.warning("dcptool: vLLM %s is newer than the releases this plugin knows; recording with the hook "
                        "table of %s, if every hook point matches", version, _S.tables[0].line)
        _S.modules = frozenset(_hooked_modules())
        _S.active = True
        sys.meta_path.insert(0, _Finder())
        for name in sorted(_S.modules):
            if name in sys.modules:
                _patch(name, sys.modules[name])
    except Exception as e:
        _broken(e)


def sites_note(version: str) -> str:
    """What a recording of this vLLM version can hold (written into the dump's config `note`)."""
    t = _S.tables[0] if _S.tables else None
    if t is None:
        return ""
    used = sorted(set(_S.used.values()))
    s = f"vLLM {version}, hook table {'/'.join(used) if used else t.line}; sites possible: {', '.join(t.sites)}"
    return s + (f"; not possible: {t.why_not}" if t.why_not else "") + f"; columns: {t.slots}"


class step:
    """Group builds into one engine step, as GPUModelRunner.execute_model does (for drivers and tests);
    `dummy=True` as execute_model(dummy_run=True) does: its builds are recorded at site `dummy`; `runner`:
    the GPUModelRunner, read as the execute_model hook reads it (the interleave)."""

    def __init__(self, dummy: bool = False, runner=None):
        self._frame = {"scope": True, "site": "dummy"} if dummy else {"scope": True}
        self._runner = runner

    def _make(self) -> dict:
        if self._runner is not None:
            _learn(self._runner)
        return dict(self._frame)

    def __enter__(self):
        self._f = _Frame(self._make)
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
        _S.block_tables = None
        _S.kv_groups = None
        _S.skipped.clear()
        return files
