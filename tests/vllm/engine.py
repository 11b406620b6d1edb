"""Model runner V2's pieces on CPU, built from vLLM 0.33.0's own classes and functions.

Only what needs a GPU is left out: vLLM's constructors for the model state, the micro-batch
runner, block tables and speculator allocate CUDA streams or pinned memory, so those objects are
made without __init__ and given the fields their methods read. Every method that builds a batch,
slices it, partitions it, computes DCP lengths or builds attention metadata is vLLM's.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from vllm.config import CUDAGraphMode, ParallelConfig, VllmConfig
from vllm.distributed import parallel_state
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.worker.gpu import cp_utils
from vllm.v1.worker.gpu.block_table import BlockTables
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers, prepare_pos_seq_lens
from vllm.v1.worker.gpu.model_states.default import DefaultModelState
from vllm.v1.worker.gpu.pcp_manager import PCPManager
from vllm.v1.worker.gpu.spec_decode.mtp.speculator import MTPSpeculator
from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator
from vllm.v1.worker.gpu.ubatch_utils import UBatchRunner

from dcptool.integrations import vllm as plugin

CPU = torch.device("cpu")
MAX_MODEL_LEN = 1 << 16
KV = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[])  # no layers: metadata only
MODES = {"none": CUDAGraphMode.NONE, "piecewise": CUDAGraphMode.PIECEWISE, "full": CUDAGraphMode.FULL}


def set_dcp(size: int, rank: int) -> None:
    """The DCP group as vLLM's parallel_state exposes it (one process per rank in a real run)."""
    parallel_state._DCP = SimpleNamespace(world_size=size, rank_in_group=rank) if size > 1 else None


def buffers(max_num_reqs: int, max_num_tokens: int) -> InputBuffers:
    return InputBuffers(max_num_reqs, max_num_tokens, CPU)


def prepare_inputs(query_lens, seq_lens, bufs: InputBuffers, *, num_tokens_padded: int | None = None,
                   num_reqs_padded: int | None = None) -> InputBatch:
    """A batch as GPUModelRunner.prepare_inputs builds it (no draft tokens): vLLM's position/seq_len kernel
    fills the persistent buffers; requests with more than one query token are prefilling."""
    q = np.asarray(query_lens, np.int32)
    s = np.asarray(seq_lens, np.int32)
    nr, nt = q.size, int(q.sum())
    nrp = max(nr, num_reqs_padded or 0)
    ntp = max(nt, num_tokens_padded or 0)
    computed = s - q
    prefill_len = np.where(q > 1, s, computed).astype(np.int32)
    qsl = np.full(bufs.max_num_reqs + 1, nt, np.int32)
    qsl[0] = 0
    np.cumsum(q, out=qsl[1 : nr + 1])
    bufs.query_start_loc.copy_(torch.from_numpy(qsl))
    idx = np.arange(nr, dtype=np.intp)
    prepare_pos_seq_lens(torch.from_numpy(idx).long(), bufs.query_start_loc[: nrp + 1],
                         torch.from_numpy(computed.copy()), bufs.positions, bufs.seq_lens)
    upper = np.zeros(nrp, np.int32)
    upper[:nr] = s
    bufs.is_padding[:nt].fill_(False)
    bufs.is_padding[nt:ntp].fill_(True)
    ctd = np.minimum(computed, prefill_len).astype(np.int32)
    prefilling = ctd < prefill_len
    return InputBatch(
        req_ids=[f"r{i}" for i in range(nr)], num_reqs=nr, num_reqs_after_padding=nrp,
        idx_mapping=torch.from_numpy(idx).long(), idx_mapping_np=idx, expanded_idx_mapping=torch.from_numpy(idx).long(),
        expanded_local_pos=torch.zeros(nr, dtype=torch.int32), num_scheduled_tokens=q, num_tokens=nt,
        num_tokens_after_padding=ntp, num_draft_tokens=0, num_draft_tokens_per_req=None,
        query_start_loc=bufs.query_start_loc[: nrp + 1], query_start_loc_np=qsl[: nrp + 1],
        seq_lens=bufs.seq_lens[:nrp], seq_lens_cpu_upper_bound=torch.from_numpy(upper), dcp_local_seq_lens=None,
        num_computed_tokens_np=computed, prefill_len_np=prefill_len, num_computed_prefill_tokens_np=ctd,
        is_prefilling_np=prefilling, has_prefill=bool(prefilling.any()), decode_graph_eligible=not prefilling.any(),
        input_ids=bufs.input_ids[:ntp], positions=bufs.positions[:ntp], is_padding=bufs.is_padding[:ntp],
        logits_indices=bufs.query_start_loc[1 : nr + 1] - 1, cu_num_logits=torch.arange(nr + 1, dtype=torch.int32),
        cu_num_logits_np=np.arange(nr + 1, dtype=np.int32), has_structured_output_reqs=False, prompt_lens=None)


def dcp_step(batch: InputBatch, bufs: InputBuffers, dcp: int, rank: int, il: int) -> None:
    """GPUModelRunner.execute_model's DCP step: once, from the final batch, into the batch's buffers."""
    batch.dcp_local_seq_lens = cp_utils.prepare_dcp_local_seq_lens(
        bufs.dcp_local_seq_lens, batch.seq_lens, batch.num_reqs, dcp, rank, il,
        num_reqs_padded=batch.num_reqs_after_padding)


def model_state() -> DefaultModelState:
    ms = DefaultModelState.__new__(DefaultModelState)
    ms.model_config = SimpleNamespace(max_model_len=MAX_MODEL_LEN)
    ms.supports_mm_inputs, ms.encoder_cache = False, None
    return ms


def tables(max_num_reqs: int, max_num_tokens: int, dcp: int, rank: int, il: int) -> BlockTables:
    bt = BlockTables.__new__(BlockTables)  # vLLM's constructor pins host memory
    bt.block_sizes, bt.num_kv_cache_groups = [16], 1
    bt.cp_size, bt.cp_rank, bt.cp_interleave = dcp, rank, il
    bt.input_block_tables = [torch.zeros(max_num_reqs, 64, dtype=torch.int32)]
    bt.slot_mappings = torch.zeros(1, max_num_tokens, dtype=torch.int64)
    bt._num_dirty_rows = 0
    return bt


def attn(ms, batch: InputBatch, bt: BlockTables, mode: str = "none", for_capture: bool = False):
    """ModelState.prepare_attn as execute_model calls it for a batch without micro-batches."""
    return ms.prepare_attn(batch, MODES[mode], bt.get_dummy_block_tables(batch.num_reqs_after_padding),
                           bt.get_dummy_slot_mappings(batch.num_tokens_after_padding), [[]], KV,
                           for_capture=for_capture)


def ubatch_runner(ms, max_num_reqs: int, dcp: int, rank: int, il: int, k: int = 2) -> UBatchRunner:
    ur = UBatchRunner.__new__(UBatchRunner)  # vLLM's constructor creates CUDA streams
    ur.vllm_config = VllmConfig(parallel_config=ParallelConfig(data_parallel_size=2))  # DBO needs DP > 1
    ur.parallel_config = ur.vllm_config.parallel_config
    ur.num_ubatches, ur.dcp_size, ur.dcp_rank, ur.cp_interleave = k, dcp, rank, il
    ur.model_state, ur.attn_groups, ur.kv_cache_config = ms, [[]], KV
    ur.ubatch_query_start_loc = [torch.zeros(max_num_reqs + 1, dtype=torch.int32) for _ in range(k)]
    ur.ubatch_seq_lens = [torch.zeros(max_num_reqs, dtype=torch.int32) for _ in range(k)]
    ur.ubatch_dcp_local_seq_lens = [torch.zeros(max_num_reqs, dtype=torch.int32) if dcp > 1 else None
                                    for _ in range(k)]
    return ur


def pcp_manager(pcp: int, pcp_rank: int, max_num_reqs: int, max_num_tokens: int, dcp: int, rank: int,
                il: int) -> PCPManager:
    return PCPManager(pcp, pcp_rank, CPU, False, max_num_reqs=max_num_reqs, max_num_tokens=max_num_tokens,
                      block_tables=None, dcp_world_size=dcp, dcp_rank=rank, cp_interleave=il)


def desc(mode: str, num_tokens: int, num_reqs: int | None) -> BatchExecutionDescriptor:
    return BatchExecutionDescriptor(cg_mode=MODES[mode], num_tokens=num_tokens, num_reqs=num_reqs)


def speculator(max_num_reqs: int, max_num_tokens: int, dcp: int, bt: BlockTables) -> DraftModelSpeculator:
    sp = MTPSpeculator.__new__(MTPSpeculator)  # vLLM's constructor loads a draft model config
    sp.vllm_config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=MAX_MODEL_LEN))
    sp.input_buffers = buffers(max_num_reqs, max_num_tokens)
    sp.block_tables, sp.dcp_size, sp.draft_max_seq_len = bt, dcp, MAX_MODEL_LEN
    sp.attn_groups, sp.kv_cache_config = [[]], KV
    sp.draft_is_prefilling = torch.zeros(max_num_reqs, dtype=torch.bool)
    return sp


def run_ranks(dcp: int, drive, out_dir, monkeypatch) -> list:
    """Drive one engine per DCP rank (as one process each would) and return the files recorded."""
    files = []
    for rank in range(dcp):
        monkeypatch.setenv(plugin.ENV_DIR, str(out_dir))
        set_dcp(dcp, rank)
        drive(rank)
        files += plugin.close()
    set_dcp(1, 0)
    return files
