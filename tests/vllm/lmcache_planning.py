"""LMCache's multi-process connector's planning, its own code on CPU: which ranks store a request's KV and under
which key piece. Its modules import LMCache's CUDA ops at import (lmcache.device_ops: not on a CPU machine), so the
definitions that plan are taken from their source files as they are (ast) and run alone: vLLM's in-tree
`extract_world_size_and_kv_rank`, `ParallelStrategy`, the worker adapter's properties and the connector's
`wait_for_save` (the store request stubbed at `batched_submit_store_requests`, the CUDA event at torch.cuda), and
LMCache's own `ParallelStrategy` (lmcache/integration/vllm/vllm_multi_process_adapter.py) from the wheels
`tools/setup_vllm_env.sh` unpacks with --no-deps. Not a test module."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import math
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import vllm

V1 = Path(vllm.__file__).parent / "distributed" / "kv_transfer" / "kv_connector" / "v1"
WHEELS = {v: Path(sys.prefix) / f"lmcache-{v}" for v in ("0.5.4", "0.5.6")}  # (setup_vllm_env.sh)


def definitions(path: Path, names: list[str], globs: dict) -> dict:
    """The module-level functions and classes `names` of a source file, executed alone in `globs`; "Class:a,b"
    takes only methods a and b of the class (decorators kept)."""
    tree = ast.parse(path.read_text())
    body = []
    for name in names:
        cls, _, only = name.partition(":")
        node = next(n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == cls)
        if only:
            keep = set(only.split(","))
            node = ast.ClassDef(name=node.name, bases=[], keywords=[], decorator_list=[], type_params=[],
                                body=[n for n in node.body if isinstance(n, ast.FunctionDef) and n.name in keep])
        body.append(node)
    module = ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))
    mod = types.ModuleType(f"planning_{len(sys.modules)}")  # (a dataclass looks its module up)
    sys.modules[mod.__name__] = mod
    ns = mod.__dict__
    ns.update({"dataclass": dataclasses.dataclass, "field": dataclasses.field, "math": math, **globs})
    exec(compile(module, str(path), "exec"), ns)
    return {n.partition(":")[0]: ns[n.partition(":")[0]] for n in names}


def _fake_torch():
    """torch.cuda as wait_for_save uses it: a stream context and an IPC event (nothing to wait for on CPU)."""
    event = SimpleNamespace(record=lambda: None)
    cuda = SimpleNamespace(stream=lambda s: contextlib.nullcontext(), current_stream=lambda: None,
                           Event=lambda **kw: event)
    return SimpleNamespace(cuda=cuda)


def in_tree_stores(world: int, tp: int, ops: list) -> dict[int, tuple[tuple[int, int], list]]:
    """vLLM's builtin LMCacheMPConnectorUpstream (this release): per rank that stores, its key piece (kv_worker_id,
    kv_world_size) and the ops it submits, for an MLA model with TP `tp` in a world of `world` ranks."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

    conn = definitions(V1 / "lmcache_mp_connector.py",
                       ["extract_world_size_and_kv_rank", "LMCacheMPConnectorMetadata", "LMCacheMPConnectorUpstream:"
                        "wait_for_save"], {"mla_enabled": lambda model_config: True, "torch": _fake_torch(),
                                           "KVConnectorMetadata": KVConnectorMetadata})
    adapter = definitions(V1 / "lmcache_integration" / "multi_process_adapter.py",
                          ["ParallelStrategy", "LMCacheMPWorkerAdapter:world_size,worker_id,use_mla,"
                                               "is_first_rank_of_pp_group"], {})
    config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp), model_config=None)
    fields = [f.name for f in dataclasses.fields(adapter["ParallelStrategy"])]
    out = {}
    for rank in range(world):
        kv_world, kv_rank = conn["extract_world_size_and_kv_rank"](world, rank, config)
        args = dict(use_mla=True, kv_world_size=kv_world, kv_worker_id=kv_rank, actual_world_size=world,
                    actual_worker_id=rank, tp_size=tp, pp_size=1)
        a = object.__new__(adapter["LMCacheMPWorkerAdapter"])
        a.parallel_strategy = adapter["ParallelStrategy"](**{k: args[k] for k in fields})
        submitted = []
        a.batched_submit_store_requests = lambda ids, o, event, got=submitted, **kw: got.append(list(o))  # transport
        c = object.__new__(conn["LMCacheMPConnectorUpstream"])
        c.worker_adapter = a
        md = conn["LMCacheMPConnectorMetadata"]()
        md.requests = [SimpleNamespace(direction="STORE", request_id=f"req-{k}", op=op, cache_salt=None)
                       for k, op in enumerate(ops)]
        c._get_connector_metadata = lambda md=md: md
        c.wait_for_save()
        if submitted:
            out[rank] = ((a.worker_id, a.world_size), submitted[0])
    return out


def wheel_writers(version: str, world: int, tp: int, dcp: int) -> dict[int, tuple[int, int]]:
    """LMCache `version`'s own ParallelStrategy: per rank that writes, its key piece (kv_worker_id, kv_world_size)."""
    path = WHEELS[version] / "lmcache" / "integration" / "vllm" / "vllm_multi_process_adapter.py"
    cls = definitions(path, ["ParallelStrategy"], {})["ParallelStrategy"]
    fields = {f.name for f in dataclasses.fields(cls)}
    out = {}
    for rank in range(world):
        args = dict(mla_only=True, vllm_world_size=world, vllm_worker_id=rank, tp_size=tp, pp_size=1, n_servers=1,
                    dcp_size=dcp)
        s = cls(**{k: v for k, v in args.items() if k in fields})
        if s.is_kv_writer:
            out[rank] = (s.kv_worker_id, s.kv_world_size)
    return out
