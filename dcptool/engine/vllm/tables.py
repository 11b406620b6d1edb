"""The vLLM plugin's hook tables (one per release line), the signature checks that pick one, and the import hook."""

from __future__ import annotations

import importlib.abc
import re
import sys
from dataclasses import dataclass

from dcptool.engine.vllm.builders import (
    wrap_ctx_plan,
    wrap_flash_attn,
    wrap_flashinfer,
    wrap_mla,
    wrap_plan,
    wrap_verify,
)
from dcptool.engine.vllm.connectors import NIXL, wrap_nixl_read
from dcptool.engine.vllm.hooks import (
    PREPARE,
    Sig,
    wrap_build,
    wrap_capture,
    wrap_draft,
    wrap_execute,
    wrap_partition,
    wrap_prepare_attn,
    wrap_slice,
    wrap_ubatch_prepare,
)
from dcptool.engine.vllm.state import SITES, STATE, broken, log

W = "vllm.v1.worker.gpu"
_BUILD = ("common_prefix_len", "common_attn_metadata")  # AttentionMetadataBuilder.build

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
    # the slot columns (build_attn_metadata's slot_mappings, every release) and how groups are sharded
    slots: str = "slot mappings per KV-cache group, each group's sharding from its spec (dcp_sharded)"
    # what the attention-metadata builders hand attention (builders)
    builders: str = ("dcp_query_start_loc (FlashInfer's trtllm-gen/XQA decode), kv_pages, kv_prefill_pages and "
                     "kv_last_page (FlashInfer's native plans: decode rows, DCP prefill rows, last pages, where a "
                     "kernel reads them), dcp_tot_seq_lens (MLA's decode), ctx_chunks (MLA's chunked prefill "
                     "context), verify_row_lens (AITER MLA's verify rows), attn_addrs (FlashAttention's "
                     "dcp_context_kv_lens and seq_lens, at capture and replay)")


def _hooks(*, ubatch_idx: bool, ubatch_prepare: tuple[str, ...] | None, draft: tuple[str, tuple[str, ...]],
           partition: tuple[str, ...]) -> Hooks:
    prep = PREPARE + (("ubatch_idx",) if ubatch_idx else ())
    h: Hooks = {
        f"{W}.attn_utils": [("build_attn_metadata", wrap_build,
                             ("num_reqs", "seq_lens", "dcp_local_seq_lens", "query_start_loc_cpu",
                              "for_cudagraph_capture"))],  # (+ slot_mappings, positions: read where present)
        f"{W}.model_states.default": [("DefaultModelState.prepare_attn", wrap_prepare_attn, prep)],
        f"{W}.model_states.mamba_hybrid": [("MambaHybridModelState.prepare_attn", wrap_prepare_attn, prep)],
        f"{W}.model_states.encoder_decoder": [("EncoderDecoderModelState.prepare_attn", wrap_prepare_attn, prep)],
        f"{W}.model_states.encoder_only": [("EncoderOnlyModelState.prepare_attn", wrap_prepare_attn, prep)],
        f"{W}.model_runner": [("GPUModelRunner.execute_model", wrap_execute, ("dummy_run",))],
        f"{W}.cudagraph_utils": [("prepare_inputs_to_capture", wrap_capture("capture", "full_cudagraph"),
                                  ("block_tables", "model_state", "full_cudagraph"))],
        f"{W}.spec_decode.speculator": [(f"DraftModelSpeculator.{draft[0]}", wrap_draft, draft[1])],
        f"{W}.spec_decode.dflash.cudagraph": [("_prepare_dflash_inputs_to_capture",
                                               wrap_capture("dflash_capture", None), ("block_tables",))],
        f"{W}.pcp_manager": [("PCPManager.partition_batch", wrap_partition, ("input_batch",) + partition)],
        # the attention-metadata builders (their modules import with the flashinfer package installed)
        "vllm.v1.attention.backends.flashinfer": [
            ("FlashInferMetadataBuilder.build", wrap_flashinfer, _BUILD),
            ("FlashInferMetadataBuilder._compute_flashinfer_kv_metadata", wrap_plan,
             ("num_blocks_np", "num_reqs", "page_size"))],
        "vllm.model_executor.layers.attention.mla_attention": [
            ("MLACommonMetadataBuilder.build", wrap_mla, _BUILD),
            ("plan_mla_context_chunks", wrap_ctx_plan, ("context_lens", "max_context_chunk"))],
        # (a ROCm module: hooked where vLLM imports it)
        "vllm.v1.attention.backends.mla.rocm_aiter_mla": [
            ("AiterMLAHelper.dcp_local_verify_row_lens", wrap_verify, ("tot_seq_lens", "qlen"))],
        "vllm.v1.attention.backends.flash_attn": [("FlashAttentionMetadataBuilder.build", wrap_flash_attn, _BUILD)],
        # NIXL's pull plans (KV transfers; engine.vllm.connectors): 0.29-0.34 plan DCP-aware reads here
        NIXL: [("NixlPullConnectorWorker._read_blocks_for_req", wrap_nixl_read, ("req_id", "meta"))],
    }
    if ubatch_prepare is not None:
        h[f"{W}.ubatch_utils"] = [("UBatchRunner.prepare", wrap_ubatch_prepare,
                                   ("input_batch", "for_capture") + ubatch_prepare),
                                  ("_slice_input_batch", wrap_slice, ("input_batch", "ubatch_slice"))]
    return h


# Oldest first. What differs between release lines (read from each release's own code):
#  0.29  no micro-batching in model runner V2 (no ubatch_utils), prepare_attn has no ubatch_idx, the
#        speculator builds drafts in _build_draft_attn_metadata(num_reqs, num_reqs_padded, ...),
#        partition_batch(input_batch, padded_num_tokens); pre-fix: dummy runs pass None; FlashInfer's decode
#        metadata has no dcp_query_start_loc, and its plans count pages before localising (PR #48003).
#  0.30  UBatchRunner.prepare(..., cg_mode), ubatch_idx, _build_attn_metadata(num_reqs, batch_desc),
#        partition_batch(input_batch, padded_num_tokens, padded_num_reqs); the first release with the fix.
#  0.31-0.33  partition_batch(input_batch, batch_desc).
#  0.34  UBatchRunner.prepare(..., batch_desc, dp_sync_state, for_capture).
_DRAFT = ("_build_attn_metadata", ("num_reqs", "batch_desc"))
_NO_UBATCH = "ubatch: this release has no model-runner-V2 micro-batching (vllm/v1/worker/gpu/ubatch_utils.py)"
_BUILDERS_029 = ("kv_pages, kv_prefill_pages and kv_last_page (FlashInfer's native plans, counted before DCP "
                 "localises the lengths: replay's pages and plan-pages), dcp_tot_seq_lens (MLA's decode), ctx_chunks "
                 "(MLA's chunked prefill context, planned from the batch it is handed: under PCP the rank's own), "
                 "attn_addrs (FlashAttention's dcp_context_kv_lens and seq_lens, at capture and replay); no "
                 "dcp_query_start_loc: this release's FlashInfer decode metadata has none")
_ALL_SHARDED = ("slot mappings per KV-cache group, each group's sharding from its spec's kind; this release's "
                "slot-mapping kernel has no dcp_sharded flag and localises every group (replay: slots on a "
                "replicated group)")
TABLES: tuple[Table, ...] = (
    Table("0.29", ("0.29.",), ("0.29.0",),
          _hooks(ubatch_idx=False, ubatch_prepare=None,
                 draft=("_build_draft_attn_metadata", ("num_reqs", "num_reqs_padded")),
                 partition=("padded_num_tokens",)),
          tuple(s for s in SITES if s != "ubatch"), _NO_UBATCH, _ALL_SHARDED, _BUILDERS_029),
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
OPTIONAL = frozenset({NIXL})  # modules whose hooks may not fit without stopping the recording


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
        sig = Sig(fn)
        missing = [p for p in params if p not in sig.pos]
        if missing:
            return [], f"{modname}.{path} has no parameter {', '.join(missing)}"
        plan.append((owner, attr, fn, make(fn, sig)))
    return plan, None


def patch(modname: str, module) -> None:
    """Wrap this module's hook points with the first candidate table whose hooks all match; else stop recording."""
    first = None
    for table in STATE.tables:
        if modname not in table.hooks:
            continue
        plan, why = _plan(modname, module, table.hooks[modname])
        if why is not None:
            first = first or why
            continue
        STATE.used[modname] = table.line
        for owner, attr, fn, wrapper in plan:
            wrapper.__wrapped_by_dcptool__ = True
            setattr(owner, attr, wrapper)
            if owner is module:  # modules that imported the function by name before we got here
                for m in list(sys.modules.values()):
                    if getattr(m, "__name__", "").startswith("vllm") and getattr(m, attr, None) is fn:
                        setattr(m, attr, wrapper)
        return
    if first is not None:
        if modname in OPTIONAL:  # (a connector's hook that does not fit: its transfers go unrecorded, builds not)
            log.warning("dcptool: %s: not recording its KV transfers (%s)", modname, first)
            return
        broken(first)


def hooked_modules() -> set[str]:
    return {m for t in STATE.tables for m in t.hooks}


class Finder(importlib.abc.MetaPathFinder):
    """Patches a hooked module right after it executes, so nothing is imported early."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in STATE.modules:
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
        if STATE.active:
            try:
                patch(module.__name__, module)
            except Exception as e:
                broken(e)

    def __getattr__(self, name):
        return getattr(self._inner, name)
