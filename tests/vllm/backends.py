"""vLLM's attention-metadata builders on CPU (0.29-0.34): FlashInfer's (its own constructor and build) and MLA's common
builder (its build), behind one attention group each, as build_attn_metadata runs them.

What needs a GPU is left out, and only that: FlashInfer's planners (`fast_plan_decode`, the decode and prefill wrappers
FlashInfer JIT-compiles CUDA for) are replaced by stand-ins that keep what they were given; the trtllm-gen decode path,
which the constructor picks on an SM100 GPU with FlashInfer's cubins, is picked by setting the two fields it sets; the
MLA builder is made without its constructor (it allocates a DCP KV-gather workspace through the model's MLA layers)
and given the fields its decode and prefill builds read. Every value the builders derive from the batch is vLLM's.
"""

from __future__ import annotations

from types import SimpleNamespace

import engine as E
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.attention import mla_attention as mla
from vllm.model_executor.layers.attention.attention import Attention
from vllm.v1.attention.backends import flashinfer as fi
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec
from vllm.v1.worker.utils import AttentionGroup

LAYER = "model.layers.0.self_attn.attn"
HAS_DCP_QSL = "dcp_query_start_loc" in getattr(fi.FlashInferTrtllmAPIDecode, "__dataclass_fields__", {})
NUM_HEADS, NUM_KV_HEADS, HEAD = 8, 2, 64


def _config(layer, mode: str, max_num_reqs: int, il: int, dcp: int):
    """What the builders' constructors read of VllmConfig (TRTLLM off: the constructor does not probe for cubins)."""
    return SimpleNamespace(
        cache_config=SimpleNamespace(cache_dtype="auto", block_size=16, get_resolved_kv_cache_layout=lambda: "NHD"),
        model_config=SimpleNamespace(max_model_len=E.MAX_MODEL_LEN, dtype=torch.bfloat16, get_head_size=lambda: HEAD,
                                     get_num_attention_heads=lambda pc: NUM_HEADS),
        attention_config=SimpleNamespace(use_trtllm_attention=False, disable_flashinfer_q_quantization=False),
        num_speculative_tokens=0, speculative_config=None,
        compilation_config=SimpleNamespace(cudagraph_mode=E.MODES[mode], max_cudagraph_capture_size=None,
                                           static_forward_context={LAYER: layer}),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=4096, max_num_seqs=max_num_reqs),
        parallel_config=SimpleNamespace(cp_kv_cache_interleave_size=il, dcp_kv_cache_interleave_size=il,
                                        dcp_comm_backend="ag_rs", decode_context_parallel_size=dcp,
                                        prefill_context_parallel_size=1))


class Plans:
    """FlashInfer's planners (GPU-only), replaced: each plan's arguments are kept, as the kernels would get them."""

    def __init__(self, monkeypatch, builder):
        self.decode, self.prefill = [], []
        monkeypatch.setattr(fi, "fast_plan_decode", lambda wrapper, **kw: self.decode.append(kw))
        builder._get_decode_wrapper = lambda *a, **k: SimpleNamespace(name="decode")
        dcp_prefill = fi.BatchDCPPrefillWrapper.__new__(fi.BatchDCPPrefillWrapper)
        dcp_prefill.plan = lambda **kw: self.prefill.append(kw)
        builder._get_prefill_wrapper = lambda *a, **k: dcp_prefill


def flashinfer(page_size: int, max_num_reqs: int, dcp: int, il: int, *, trtllm_decode: bool = False,
               mode: str = "none"):
    """FlashInferMetadataBuilder, made by vLLM's constructor for this rank (it reads the DCP group), in an attention
    group. `trtllm_decode`: the trtllm-gen decode path (the one whose metadata carries dcp_query_start_loc)."""
    spec = FullAttentionSpec(block_size=page_size, num_kv_heads=NUM_KV_HEADS, head_size=HEAD, dtype=torch.bfloat16)
    impl = fi.FlashInferImpl.__new__(fi.FlashInferImpl)  # what the builder reads of the layers' implementation
    impl.num_heads, impl.scale, impl.sliding_window, impl.logits_soft_cap, impl.sinks = NUM_HEADS, HEAD**-0.5, \
        None, None, None
    layer = Attention.__new__(Attention)
    layer.__dict__["impl"] = impl
    current = VllmConfig()
    current.attention_config.use_trtllm_attention = False  # (None: the constructor would probe for FlashInfer's cubins)
    with set_current_vllm_config(current):
        b = fi.FlashInferMetadataBuilder(spec, [LAYER], _config(layer, mode, max_num_reqs, il, dcp), E.CPU)
    if trtllm_decode:
        b.use_trtllm_decode_attention = True
        b.flashinfer_trtllm_api_decode_kernel = fi.FlashInferDecodeKernel.TRTLLM_GEN
    return b, _group(fi.FlashInferBackend, spec, b)


def flash_attn(page_size: int, max_num_reqs: int, dcp: int, il: int, mode: str = "none"):
    """FlashAttentionMetadataBuilder, made by vLLM's constructor for this rank (it reads the DCP group), in an
    attention group; FlashAttention's scheduler (FA3's, a GPU's) is off, as vLLM has it without the extension."""
    from vllm.v1.attention.backends import flash_attn as fa

    spec = FullAttentionSpec(block_size=page_size, num_kv_heads=NUM_KV_HEADS, head_size=HEAD, dtype=torch.bfloat16)
    cfg = _config(None, mode, max_num_reqs, il, dcp)
    cfg.model_config.rswa_window, cfg.model_config.is_mm_prefix_lm = None, False
    cfg.model_config.hf_config = SimpleNamespace(model_type="llama")
    cfg.kernel_config = SimpleNamespace(enable_jit_warmup=False)
    cfg.attention_config.flash_attn_max_num_splits_for_cuda_graph = 32
    with set_current_vllm_config(VllmConfig()):
        b = fa.FlashAttentionMetadataBuilder(spec, [LAYER], cfg, E.CPU)
    return b, _group(fa.FlashAttentionBackend, spec, b)


def mla_builder(page_size: int, dcp: int, il: int, workspace: int = 256):
    """vLLM's MLA common builder (as the Triton MLA backend has it) with the fields its decode and prefill builds read:
    a chunked-prefill workspace of `workspace` rows (the KV gather into it is the model's forward, not the build: no
    DCP manager), and a prefill backend whose metadata hook does nothing (what it prepares is for its kernels)."""
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend, TritonMLAMetadataBuilder

    spec = MLAAttentionSpec(block_size=page_size, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    b = TritonMLAMetadataBuilder.__new__(TritonMLAMetadataBuilder)
    b.metadata_cls, b.kv_cache_spec, b.device, b.page_size = mla.MLACommonMetadata, spec, E.CPU, page_size
    b.model_config = SimpleNamespace(get_head_size=lambda: 576, dtype=torch.bfloat16)
    b.use_pcp, b.non_causal_multi_token_decode, b.aot_schedule = False, False, False
    b.dcp_world_size, b.cp_kv_cache_interleave_size = dcp, il
    b.dcp_local_block_size, b.dcp_virtual_block_size = il, il * dcp
    b.chunked_prefill_workspace_size, b.dcp_manager = workspace, None
    b.chunked_prefill_workspace = torch.empty(workspace + workspace // dcp, 8)
    b.reorder_batch_threshold, b.q_data_type = 1, torch.bfloat16
    b.vllm_config = SimpleNamespace(attention_config=SimpleNamespace(trtllm_ragged_backend=None))
    b._prefill_backend = SimpleNamespace(get_name=lambda: "STUB", prepare_metadata=lambda md: None)
    return b, _group(TritonMLABackend, spec, b)


def _group(backend, spec, builder):
    g = AttentionGroup(backend=backend, layer_names=[LAYER], kv_cache_spec=spec, kv_cache_group_id=0,
                       metadata_builders=[builder])
    return g, KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec([LAYER], spec)])


def attn(ms, batch, bt, group, mode: str = "none"):
    """ModelState.prepare_attn with one attention group (its builder runs), as execute_model calls it."""
    g, kv = group
    return ms.prepare_attn(batch, E.MODES[mode], bt.get_dummy_block_tables(batch.num_reqs_after_padding),
                           bt.get_dummy_slot_mappings(batch.num_tokens_after_padding), [[g]], kv)[LAYER]


def tables(max_num_reqs: int, max_num_tokens: int, dcp: int, rank: int, il: int):
    """engine.tables with block-table rows wide enough for every page a plan claims (512: 8k tokens of 16)."""
    bt = E.tables(max_num_reqs, max_num_tokens, dcp, rank, il)
    bt.input_block_tables = [torch.zeros(max_num_reqs, 512, dtype=torch.int32)]
    return bt
