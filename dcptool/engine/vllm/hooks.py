"""The vLLM plugin's wrappers of vLLM's functions: each reads its call into a frame or an observation, and runs it.

What a wrapper reads: the batch, the DCP view attention consumes, the graph mode, the slot mappings and their
KV-cache groups, and (through builders) what the attention-metadata builders derived from them. The engine's
own call always runs, with its own result and exceptions."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import NamedTuple

from dcptool.engine.vllm.builders import Build, builder_kwargs
from dcptool.engine.vllm.state import (
    STATE,
    Frame,
    broken,
    context,
    dcp_group,
    observe,
    observe_batch,
    query_start_loc,
    recorder,
    stack,
)


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


PREPARE = ("input_batch", "cudagraph_mode", "for_capture")  # + ubatch_idx where micro-batches exist (0.30+)


class Sig:
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


def _mode(m) -> str:
    return getattr(m, "name", str(m))


def learn(obj) -> None:
    """Remember the interleave from an engine object that knows it (runner, block tables, ...), and the block
    tables (the slot mappings' KV-cache groups)."""
    il = getattr(obj, "cp_interleave", None)
    if isinstance(il, int) and il >= 1 and STATE.interleave is None:
        STATE.interleave = il
    bt = obj if hasattr(obj, "slot_mappings") else getattr(obj, "block_tables", None)
    if bt is not None and hasattr(bt, "slot_mappings") and hasattr(bt, "block_sizes"):
        STATE.block_tables = bt
    kb = getattr(obj, "kernel_block_sizes", None)
    if obj is not bt and isinstance(kb, list) and all(isinstance(x, int) for x in kb):
        STATE.kernel_block_sizes = kb


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


def wrap_build(orig, sig):
    consumed = _consumed(orig)

    @functools.wraps(orig)
    def build_attn_metadata(*args, **kwargs):
        kw = None
        if STATE.active:
            try:
                kw = _read_build(sig, consumed, args, kwargs)
            except Exception as e:
                broken(e)
        if kw is None:
            return orig(*args, **kwargs)
        # recorded once the builders ran (whatever they raised): the observation carries what they handed attention
        with Build() as got:
            try:
                return orig(*args, **kwargs)
            finally:
                if STATE.active:
                    try:
                        _record_build(sig, args, kwargs, kw, got)
                    except Exception as e:
                        broken(e)

    build_attn_metadata.__dcptool_consumed__ = consumed
    return build_attn_metadata


def _read_build(sig: Sig, consumed: frozenset, args: tuple, kwargs: dict) -> dict | None:
    """The observation of a build_attn_metadata call, read before it runs; None: not recorded (counted)."""
    c = context()
    if c.get("skip"):
        STATE.skipped[c["skip"]] += 1
        return None
    n = int(sig.get(args, kwargs, "num_reqs"))
    seq, dcp = sig.get(args, kwargs, "seq_lens"), sig.get(args, kwargs, "dcp_local_seq_lens")
    cut = "dcp_local_seq_lens" in consumed  # attention reads [:n] rows: that is the view to check
    if cut and dcp is not None:
        dcp = dcp[:n]
    if "seq_lens" in consumed:
        seq = seq[:n]
    if getattr(seq, "is_cuda", True) is False:
        # a host tensor: 0.29's FlashInfer builder subtracts prefill query lengths in place from the host copy of
        # seq_lens, which on the host is seq_lens itself; keep the values handed in (device tensors are not written)
        seq = seq.clone()
    batch = c.get("batch")
    kw: dict = {"seq_lens": seq, "dcp_local_seq_lens": dcp}
    if batch is not None:
        # The model state passes the padded count only for FULL graphs; the batch knows both.
        nr, nrp = batch.num_reqs, batch.num_reqs_after_padding
        if cut:
            nr, nrp = min(nr, n), n
        kw["query_start_loc"] = query_start_loc(batch, nrp)
        kw["num_tokens_padded"] = int(batch.num_tokens_after_padding)
    else:
        nr, nrp = int(c.get("num_reqs", n)), n
        kw["query_start_loc"] = sig.get(args, kwargs, "query_start_loc_cpu")
    ub = c.get("ubatch")
    if ub is not None:
        kw.update(ubatch=ub.ubatch, parent=ub.parent, req_start=ub.req_start, tok_start=ub.tok_start,
                  tok_stop=ub.tok_stop)
    if "capture_graph" in c:
        graph = c["capture_graph"]
    elif "cg" in c:
        graph = _graph().of_vllm(c["cg"])
    else:
        graph = _graph().FULL_CAPTURE if sig.get(args, kwargs, "for_cudagraph_capture") else _graph().EAGER
    kw.update(site="ubatch" if ub is not None else c.get("site", "attn_metadata"), num_reqs=nr, num_reqs_padded=nrp,
              graph=int(graph), batch=batch)
    return kw


def _record_build(sig: Sig, args: tuple, kwargs: dict, kw: dict, got: dict) -> None:
    """Record the build read by _read_build, with what its builders handed attention and its slot mappings."""
    batch = kw.pop("batch")
    if got:
        builder_kwargs(got, int(kw["seq_lens"].shape[0]), kw)
    _slot_kwargs(sig, args, kwargs, batch, kw)
    _group_kwargs(sig, args, kwargs, kw)
    observe(**kw)


def _slot_kwargs(sig: Sig, args: tuple, kwargs: dict, batch, kw: dict) -> None:
    """The slot mappings build_attn_metadata hands every KV-cache group ([groups, tokens], what the KV
    writes use) with the tokens' positions (the batch's, else the call's), and the groups' sharding."""
    sm = sig.get(args, kwargs, "slot_mappings") if "slot_mappings" in sig.pos else None
    pos = getattr(batch, "positions", None) if batch is not None else None
    if pos is None and "positions" in sig.pos:
        pos = sig.get(args, kwargs, "positions")
    if sm is None or pos is None or getattr(sm, "ndim", 0) != 2 or getattr(pos, "ndim", 0) != 1:
        return
    t = int(sm.shape[1])
    if int(pos.shape[0]) < t:
        STATE.skipped["slot mappings longer than the positions"] += 1
        return
    kvc = sig.get(args, kwargs, "kv_cache_config") if "kv_cache_config" in sig.pos else None
    groups = _kv_groups(kvc, int(sm.shape[0]))
    if STATE.kv_groups is None:
        rec = recorder()
        if rec is None:
            return
        rec.set_kv_groups(groups)  # (the recording's first slot mapping: no group recorded yet)
        STATE.kv_groups = groups
    elif groups != STATE.kv_groups:
        STATE.skipped["slot mappings of other KV-cache groups than the first build's"] += 1
        return
    kw.update(positions=pos[:t], slot_mapping=sm)
    sizes = _block_sizes(int(sm.shape[0]))
    if sizes is not None:
        kw["kv_block_sizes"] = sizes


def _block_sizes(count: int):
    """rows.kv_block_sizes of the runner's BlockTables (per KV-cache group: the manager's block, the attention
    kernel's, and the one the slot-mapping kernel deals positions by, `block_sizes_tensor`: the kernel's on
    0.22-0.28, the manager's since 0.29), read once per tables object (one copy of a small device tensor); None
    where the tables do not say or list another number of groups."""
    bt = STATE.block_tables
    if bt is None:
        return None
    if STATE.block_sizes[0] is bt:
        return STATE.block_sizes[1]
    manager = list(getattr(bt, "block_sizes", None) or ())
    kernel = getattr(bt, "kernel_block_sizes", None) or STATE.kernel_block_sizes or manager
    dealt_t = getattr(bt, "block_sizes_tensor", None)
    dealt = [int(x) for x in dealt_t.tolist()] if dealt_t is not None else manager
    got = None
    if len(manager) == len(kernel) == len(dealt) == count:
        import numpy as np  # (the Recorder has imported it by now)

        got = np.array([manager, list(kernel), dealt], np.int32).T.reshape(-1)
    STATE.block_sizes = (bt, got)
    return got


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
    bt = STATE.block_tables
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
    wins = [getattr(x, "sliding_window", None) for x in specs]
    wins = [w if type(w) is int and w >= 1 else None for w in wins]
    N = dcp_group()[0]
    return [{"name": n, "dcp": f, **({"block_size": b} if b else {}), **({"sliding_window": w} if w else {}),
             "cp_size": N if f else 1} for n, f, b, w in zip(names, dcp, sizes, wins)]


def _group_kwargs(sig: Sig, args: tuple, kwargs: dict, kw: dict) -> None:
    """A hybrid model's KV-cache groups (some DCP-sharded, some not): the lengths each group's metadata builder reads
    of the build's common metadata, one row per seq_lens row each (group_seq_lens): the DCP-local lengths where
    the builder runs DCP (its dcp_world_size > 1: vLLM 0.33+ sets 1 for a group whose spec DCP does not shard), the
    global ones where it does not. Not recorded where a group has no builder (nothing reads its lengths) or the
    model's groups are alike (the view is the whole story)."""
    groups = STATE.kv_groups
    if groups is None or len({g["dcp"] for g in groups}) < 2 or "attn_groups" not in sig.pos:
        return
    attn = sig.get(args, kwargs, "attn_groups")
    seq, dcp = kw["seq_lens"], kw["dcp_local_seq_lens"]
    builders = [getattr(a[0], "metadata_builders", [None])[0] if a else None for a in attn or ()]
    if len(builders) != len(groups) or any(b is None for b in builders):
        return
    parts = [dcp if int(getattr(b, "dcp_world_size", 1)) > 1 else seq for b in builders]
    if any(p is None or int(p.shape[0]) != int(seq.shape[0]) for p in parts):
        return  # (a missing or odd-length view: `missing` / `shape` say so; no per-group lengths to add)
    kw["group_seq_lens"] = _concat(parts)


def _concat(parts: list):
    """Host arrays or tensors end to end (a tensor stays on its device: no host sync)."""
    if all(hasattr(p, "untyped_storage") for p in parts):
        import torch  # (vLLM has imported it)

        return torch.cat(parts)
    import numpy as np

    return np.concatenate([np.asarray(p.cpu() if hasattr(p, "cpu") else p) for p in parts])


def _cg(sig: Sig, args: tuple, kwargs: dict) -> str | None:
    """The call's CUDA-graph mode: a `cg_mode` parameter (0.30-0.33), a `batch_desc` (0.31+), or unknown."""
    if "cg_mode" in sig.pos:
        return _mode(sig.get(args, kwargs, "cg_mode"))
    if "batch_desc" in sig.pos:
        return _mode(sig.get(args, kwargs, "batch_desc").cg_mode)
    return None


def _framed(orig, frame):
    """orig's wrapper: each call runs inside the frame that frame(args, kwargs) makes (Frame: one that cannot be made
    stops recording, never the call)."""
    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        with Frame(lambda: frame(args, kwargs)):
            return orig(*args, **kwargs)

    return wrapper


def wrap_prepare_attn(orig, sig):
    def frame(args, kwargs) -> dict:
        batch = sig.get(args, kwargs, "input_batch")
        f = {"scope": True, "batch": batch, "cg": _mode(sig.get(args, kwargs, "cudagraph_mode"))}
        for parent in reversed(stack()):
            sliced = parent.get("sliced")
            if sliced is not None and id(batch) in sliced:
                i = int(sig.get(args, kwargs, "ubatch_idx")) if "ubatch_idx" in sig.pos else 0
                f["ubatch"] = UbatchOf(i, parent["parent"], *sliced[id(batch)])
                break
        return f

    prepare_attn = _framed(orig, frame)
    prepare_attn.__dcptool_prepare__ = True
    return prepare_attn


def _ensure_prepare_wrapped(model_state) -> None:
    """Wrap prepare_attn of the model state a runner really uses (model-specific subclasses too)."""
    for cls in type(model_state).__mro__:
        fn = cls.__dict__.get("prepare_attn")
        if fn is None or getattr(fn, "__dcptool_prepare__", False) or not callable(fn):
            continue
        sig = Sig(fn)
        if all(p in sig.pos for p in PREPARE):
            cls.prepare_attn = wrap_prepare_attn(fn, sig)


def wrap_execute(orig, sig):
    def frame(args, kwargs) -> dict:
        runner = args[0]
        learn(runner)
        if getattr(runner, "model_state", None) is not None:
            _ensure_prepare_wrapped(runner.model_state)
        return {"scope": True, "site": "dummy" if sig.get(args, kwargs, "dummy_run") else "attn_metadata"}

    return _framed(orig, frame)


def wrap_capture(site: str, full_param: str | None):
    """prepare_inputs_to_capture (full_cudagraph) and the DFlash capture path (FULL only)."""

    def make_wrapper(orig, sig):
        def frame(args, kwargs) -> dict:
            learn(sig.get(args, kwargs, "block_tables"))
            if "model_state" in sig.pos:
                _ensure_prepare_wrapped(sig.get(args, kwargs, "model_state"))
            full = True if full_param is None else bool(sig.get(args, kwargs, full_param))
            return {"scope": True, "site": site, "capture_graph": 2 if full else 1, "batch": None}

        return _framed(orig, frame)

    return make_wrapper


def wrap_ubatch_prepare(orig, sig):
    @functools.wraps(orig)
    def prepare(*args, **kwargs):
        def make():
            runner, batch = args[0], sig.get(args, kwargs, "input_batch")
            learn(runner)
            _ensure_prepare_wrapped(runner.model_state)
            outer = context()
            capture = bool(sig.get(args, kwargs, "for_capture")) and "site" not in outer
            f = {"scope": True, "sliced": {}, "parent": -1}
            if capture:
                f.update(site="capture", capture_graph=_graph().FULL_CAPTURE)
            site = f.get("site", outer.get("site", "attn_metadata"))
            graph = _graph().FULL_CAPTURE if capture else _graph().of_vllm(_cg(sig, args, kwargs))
            # The merged batch is no attention build, but it is what the micro-batches are sliced from:
            # record it when it carries a view (a capture's merged batch never gets one, legitimately).
            if batch.dcp_local_seq_lens is not None or dcp_group()[0] == 1:
                f["pending"] = (site, batch, graph)
            return f

        with Frame(make) as f:
            if f is not None and "pending" in f:
                try:
                    f["parent"] = observe_batch(*f.pop("pending"))
                except Exception as e:
                    broken(e)
            return orig(*args, **kwargs)

    return prepare


def wrap_slice(orig, sig):
    @functools.wraps(orig)
    def _slice_input_batch(*args, **kwargs):
        out = orig(*args, **kwargs)
        if STATE.active:
            try:
                s = sig.get(args, kwargs, "ubatch_slice")
                for f in reversed(stack()):
                    if "sliced" in f:
                        f["sliced"][id(out)] = (int(s.request_slice.start), int(s.token_slice.start),
                                                int(s.token_slice.stop))
                        break
            except Exception as e:
                broken(e)
        return out

    return _slice_input_batch


def wrap_draft(orig, sig):
    def frame(args, kwargs) -> dict:
        spec = args[0]
        learn(getattr(spec, "block_tables", None))
        f = {"site": "draft", "batch": None, "num_reqs": int(sig.get(args, kwargs, "num_reqs"))}
        cg = _cg(sig, args, kwargs)
        if cg is not None:
            f["cg"] = cg
        # 0.30+ keep the speculator's DCP size, 0.29 its block tables'
        size = getattr(spec, "dcp_size", None)
        if size is None:
            size = getattr(getattr(spec, "block_tables", None), "cp_size", None)
        if size == 1 and dcp_group()[0] > 1:
            f["skip"] = "draft builds of a speculator whose KV cache is not DCP-sharded"
        return f

    return _framed(orig, frame)


def wrap_partition(orig, sig):
    @functools.wraps(orig)
    def partition_batch(*args, **kwargs):
        if STATE.active:
            try:
                learn(args[0])
                batch = sig.get(args, kwargs, "input_batch")
                # 0.30+ partition a batch without a view; 0.29 one whose view prepare_inputs derived from the
                # global batch (and recomputes it from the local one). Anything that reaches the local batch
                # from it is stale: record the source.
                if batch.dcp_local_seq_lens is not None:
                    observe_batch("prepare_inputs", batch, _graph().of_vllm(_cg(sig, args, kwargs)))
            except Exception as e:
                broken(e)
        return orig(*args, **kwargs)

    return partition_batch

