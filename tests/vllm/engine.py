"""Model runner V2's pieces on CPU, built from the installed vLLM's own classes and functions (0.29-0.34).

Only what needs a GPU is left out: vLLM's constructors for the model state, the runner, the
micro-batch runner, block tables and speculator allocate CUDA streams or pinned memory, so those
objects are made without __init__ and given the fields their methods read. Every method that
builds a batch, slices it, partitions it, computes DCP lengths or builds attention metadata is
vLLM's. Where releases differ, this driver asks the installed vLLM what it has (a module, a
parameter, a call in a function's source) and never its version string: the values always come
from the release under test.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
from types import SimpleNamespace

import numpy as np
import torch
import vllm
from vllm.config import CUDAGraphMode, ParallelConfig, VllmConfig
from vllm.distributed import parallel_state
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.worker.gpu import cp_utils
from vllm.v1.worker.gpu import input_batch as ib
from vllm.v1.worker.gpu.block_table import BlockTables
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers, prepare_pos_seq_lens
from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.v1.worker.gpu.model_states.default import DefaultModelState
from vllm.v1.worker.gpu.pcp_manager import PCPManager
from vllm.v1.worker.gpu.spec_decode.mtp.speculator import MTPSpeculator
from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

from dcptool.engine import vllm as plugin

VERSION = vllm.__version__
CPU = torch.device("cpu")
MAX_MODEL_LEN = 1 << 16
KV = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[])  # no layers: metadata only
MODES = {"none": CUDAGraphMode.NONE, "piecewise": CUDAGraphMode.PIECEWISE, "full": CUDAGraphMode.FULL}

# What this release has (0.27-0.29: no model-runner-V2 micro-batching)
HAS_UBATCH = importlib.util.find_spec("vllm.v1.worker.gpu.ubatch_utils") is not None
# The helper is prepare_dcp_local_seq_lens (0.29, 0.31+) or maybe_prepare_dcp_local_seq_lens (0.30)
DCP_HELPER = getattr(cp_utils, "prepare_dcp_local_seq_lens", None) or cp_utils.maybe_prepare_dcp_local_seq_lens


def _calls(fn, name: str) -> bool:
    return name in inspect.getsource(fn)


# Where the runner computes DCP lengths for a step: in prepare_inputs, from the global batch, and not
# for dummy runs (pre-fix, 0.27-0.29), or once in execute_model from the final batch (0.30+, PR #55212).
DCP_IN_PREPARE_INPUTS = _calls(GPUModelRunner.prepare_inputs, "prepare_dcp_local_seq_lens")
DCP_IN_EXECUTE_MODEL = _calls(GPUModelRunner.execute_model, "prepare_dcp_local_seq_lens")
PRE_FIX = DCP_IN_PREPARE_INPUTS and not DCP_IN_EXECUTE_MODEL

_BATCH_FIELDS = {f.name for f in dataclasses.fields(InputBatch)}


def _copy_to_device(x, out=None, device=None):
    """vLLM's async_copy_to_gpu without pinning the source (this machine has no accelerator to pin for)."""
    x = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
    return x.clone().to(device) if out is None else out.copy_(x)


# 0.29's PCP manager copies host arrays through async_copy_to_gpu, which pins them unconditionally: on a CPU-only
# machine that is the one call that cannot run, so it becomes a plain copy (a transfer, not a value)
try:
    torch.zeros(1).pin_memory()
except RuntimeError:
    import vllm.v1.worker.gpu.pcp_manager as _pcp

    if hasattr(_pcp, "async_copy_to_gpu") and "pin_memory()" in inspect.getsource(_pcp.async_copy_to_gpu):
        _pcp.async_copy_to_gpu = _copy_to_device
if HAS_UBATCH:
    from vllm.v1.worker.gpu.ubatch_utils import UBatchRunner

    # 0.34's UBatchRunner.prepare takes the batch's execution descriptor instead of the graph mode
    UB_TAKES_DESC = "batch_desc" in inspect.signature(UBatchRunner.prepare).parameters


def set_dcp(size: int, rank: int) -> None:
    """The DCP group as vLLM's parallel_state exposes it (one process per rank in a real run)."""
    parallel_state._DCP = SimpleNamespace(world_size=size, rank_in_group=rank) if size > 1 else None


def buffers(max_num_reqs: int, max_num_tokens: int) -> InputBuffers:
    return InputBuffers(max_num_reqs, max_num_tokens, CPU)


def _kw(fn, **kw) -> dict:
    """The keyword arguments `fn` takes, of those given."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kw.items() if k in params}


def dcp_step(batch: InputBatch, bufs: InputBuffers, dcp: int, rank: int, il: int) -> None:
    """The runner's DCP step (0.30+: execute_model, from the final batch; 0.29: prepare_inputs): vLLM's helper
    into the batch's buffer, and the view [:num_reqs_padded] of it, as the runner takes it."""
    nrp = batch.num_reqs_after_padding
    out = DCP_HELPER(bufs.dcp_local_seq_lens, batch.seq_lens, batch.num_reqs, dcp, rank, il,
                     **_kw(DCP_HELPER, num_reqs_padded=nrp))
    batch.dcp_local_seq_lens = bufs.dcp_local_seq_lens[:nrp] if out is None else out


def prepare_inputs(query_lens, seq_lens, bufs: InputBuffers, *, num_tokens_padded: int | None = None,
                   num_reqs_padded: int | None = None, dcp: tuple[int, int, int] | None = None) -> InputBatch:
    """A batch as GPUModelRunner.prepare_inputs builds it (no draft tokens): vLLM's position/seq_len kernel
    fills the persistent buffers; requests with more than one query token are prefilling. The InputBatch is
    vLLM's make_dummy with this batch's fields put in, so every release's own fields are there.
    `dcp` = (size, rank, interleave): where this release's prepare_inputs computes DCP lengths (pre-fix), it does."""
    q = np.asarray(query_lens, np.int32)
    s = np.asarray(seq_lens, np.int32)
    nr, nt = q.size, int(q.sum())
    nrp = max(nr, num_reqs_padded or 0)
    ntp = max(nt, num_tokens_padded or 0)
    base = InputBatch.make_dummy(nr, nt, bufs)
    computed = s - q
    prefill_len = np.where(q > 1, s, computed).astype(np.int32)
    qsl = np.full(bufs.max_num_reqs + 1, nt, np.int32)
    qsl[0] = 0
    np.cumsum(q, out=qsl[1 : nr + 1])
    bufs.query_start_loc.copy_(torch.from_numpy(qsl))
    idx = np.arange(nr, dtype=np.intp)
    bufs.seq_lens.zero_()
    prepare_pos_seq_lens(torch.from_numpy(idx).long(), bufs.query_start_loc[: nrp + 1],
                         torch.from_numpy(computed.copy()), bufs.positions, bufs.seq_lens)
    upper = np.zeros(nrp, np.int32)
    upper[:nr] = s
    bufs.is_padding[:nt].fill_(False)
    bufs.is_padding[nt:ntp].fill_(True)
    ctd = np.minimum(computed, prefill_len).astype(np.int32)
    prefilling = ctd < prefill_len
    fields = dict(
        num_reqs_after_padding=nrp, num_scheduled_tokens=q, num_tokens_after_padding=ntp,
        query_start_loc=bufs.query_start_loc[: nrp + 1], query_start_loc_np=qsl[: nrp + 1],
        seq_lens=bufs.seq_lens[:nrp], seq_lens_cpu_upper_bound=torch.from_numpy(upper), dcp_local_seq_lens=None,
        num_computed_tokens_np=computed, prefill_len_np=prefill_len, num_computed_prefill_tokens_np=ctd,
        is_prefilling_np=prefilling, has_prefill=bool(prefilling.any()), decode_graph_eligible=not prefilling.any(),
        input_ids=bufs.input_ids[:ntp], positions=bufs.positions[:ntp], is_padding=bufs.is_padding[:ntp],
        logits_indices=bufs.query_start_loc[1 : nr + 1] - 1, max_query_len=int(q.max()))
    b = dataclasses.replace(base, **{k: v for k, v in fields.items() if k in _BATCH_FIELDS})
    if dcp is not None and DCP_IN_PREPARE_INPUTS:
        dcp_step(b, bufs, *dcp)
    return b


def model_state() -> DefaultModelState:
    ms = DefaultModelState.__new__(DefaultModelState)
    ms.model_config = SimpleNamespace(max_model_len=MAX_MODEL_LEN, is_mm_prefix_lm=False)
    if not isinstance(getattr(DefaultModelState, "max_model_len", None), property):
        ms.max_model_len = MAX_MODEL_LEN
    ms.supports_mm_inputs, ms.encoder_cache = False, None
    return ms


def tables(max_num_reqs: int, max_num_tokens: int, dcp: int, rank: int, il: int) -> BlockTables:
    bt = BlockTables.__new__(BlockTables)  # vLLM's constructor pins host memory
    bt.block_sizes, bt.num_kv_cache_groups, bt.kernel_block_sizes, bt.blocks_per_kv_block = [16], 1, [16], [1]
    bt.cp_size, bt.cp_rank, bt.cp_interleave = dcp, rank, il
    bt.input_block_tables = [torch.zeros(max_num_reqs, 64, dtype=torch.int32)]
    # no slot mapping is ever computed on these tables: the buffer holds what get_dummy_slot_mappings leaves
    # (PAD_SLOT_ID), so builds that read it write nothing (slot_tables has real ones)
    bt.slot_mappings = torch.full((1, max_num_tokens), -1, dtype=torch.int64)
    bt._num_dirty_rows = 0
    return bt


def attn(ms, batch: InputBatch, bt: BlockTables, mode: str = "none", for_capture: bool = False):
    """ModelState.prepare_attn as execute_model calls it for a batch without micro-batches."""
    return ms.prepare_attn(batch, MODES[mode], bt.get_dummy_block_tables(batch.num_reqs_after_padding),
                           bt.get_dummy_slot_mappings(batch.num_tokens_after_padding), [[]], KV,
                           for_capture=for_capture)


def runner(bt: BlockTables, dcp: int, rank: int, il: int, bufs: InputBuffers) -> GPUModelRunner:
    r = GPUModelRunner.__new__(GPUModelRunner)  # vLLM's constructor loads a model and allocates on the GPU
    r.block_tables, r.pcp_manager, r.device, r.input_buffers = bt, None, CPU, bufs
    r.dcp_size, r.dcp_rank, r.cp_interleave, r.use_dcp = dcp, rank, il, dcp > 1
    r.kv_cache_config, r.max_model_len = KV, MAX_MODEL_LEN
    return r


def dummy_run(r: GPUModelRunner, ms, num_reqs: int, num_tokens: int, mode: str = "none", context_len: int = 0):
    """GPUModelRunner.execute_model(dummy_run=True)'s attention path, in the release's order: make_dummy,
    prepare_dummy_attn, set_dummy_context, the runner's DCP step where this release's execute_model has one
    (0.30+; pre-fix releases hand attention None), prepare_attn."""
    b = InputBatch.make_dummy(num_reqs, num_tokens, r.input_buffers)
    block_tables, slot_mappings = r.prepare_dummy_attn(b)
    if context_len:
        ib.set_dummy_context(b, r.block_tables, context_len, KV.num_blocks, MAX_MODEL_LEN)
    if DCP_IN_EXECUTE_MODEL and r.dcp_size > 1:
        dcp_step(b, r.input_buffers, r.dcp_size, r.dcp_rank, r.cp_interleave)
    with plugin.step(dummy=True, runner=r):  # execute_model(dummy_run=True) opens this scope
        return ms.prepare_attn(b, MODES[mode], block_tables, slot_mappings, [[]], KV,
                               for_capture=mode == "full")


def desc(mode: str, num_tokens: int, num_reqs: int | None, **kw) -> BatchExecutionDescriptor:
    return BatchExecutionDescriptor(cg_mode=MODES[mode], num_tokens=num_tokens, num_reqs=num_reqs,
                                    **_kw(BatchExecutionDescriptor, **kw))


def ubatch_runner(ms, max_num_reqs: int, dcp: int, rank: int, il: int, k: int = 2):
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


def ubatch_prepare(ur, batch: InputBatch, bt: BlockTables, mode: str, uniform_token_count: int | None = None,
                   for_capture: bool = False):
    """UBatchRunner.prepare as execute_model calls it: with the graph mode (0.30-0.33) or the batch's
    execution descriptor (0.34, which also carries the uniform token count the split follows)."""
    kw = {"for_capture": for_capture}
    if UB_TAKES_DESC:
        kw["batch_desc"] = desc(mode, batch.num_tokens_after_padding, batch.num_reqs_after_padding,
                                uniform_token_count=uniform_token_count, num_ubatches=ur.num_ubatches)
    else:
        kw["cg_mode"] = MODES[mode]
    return ur.prepare(batch, bt.get_dummy_block_tables(batch.num_reqs_after_padding),
                      bt.get_dummy_slot_mappings(batch.num_tokens_after_padding), **kw)


def pcp_manager(pcp: int, pcp_rank: int, max_num_reqs: int, max_num_tokens: int, dcp: int, rank: int,
                il: int) -> PCPManager:
    kw = _kw(PCPManager.__init__, shard_decode_requests=False)
    if "req_states" in inspect.signature(PCPManager.__init__).parameters:
        # 0.29 gathers the local batch's sampled/draft token ids from the request states (their constructor
        # needs UVA): what it reads, no more; none of it reaches the DCP metadata
        zeros = torch.zeros(max_num_reqs, 1, dtype=torch.int64)
        prefill_len = SimpleNamespace(gpu=torch.zeros(max_num_reqs, dtype=torch.int32))
        kw["req_states"] = SimpleNamespace(last_sampled_tokens=zeros, draft_tokens=zeros.clone(),
                                           prefill_len=prefill_len)
    return PCPManager(pcp, pcp_rank, CPU, max_num_reqs=max_num_reqs, max_num_tokens=max_num_tokens,
                      block_tables=None, dcp_world_size=dcp, dcp_rank=rank, cp_interleave=il, **kw)


def partition(mgr: PCPManager, batch: InputBatch, mode: str, num_tokens_padded: int):
    """PCPManager.partition_batch with what this release takes: a descriptor (0.31+) or padded sizes."""
    params = inspect.signature(mgr.partition_batch).parameters
    if "batch_desc" in params:
        return mgr.partition_batch(batch, desc(mode, num_tokens_padded, None))
    return mgr.partition_batch(batch, num_tokens_padded, **_kw(mgr.partition_batch, padded_num_reqs=None))


def speculator(max_num_reqs: int, max_num_tokens: int, dcp: int, bt: BlockTables) -> DraftModelSpeculator:
    sp = MTPSpeculator.__new__(MTPSpeculator)  # vLLM's constructor loads a draft model config
    sp.vllm_config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=MAX_MODEL_LEN))
    sp.input_buffers = buffers(max_num_reqs, max_num_tokens)
    sp.block_tables, sp.dcp_size, sp.draft_max_seq_len = bt, dcp, MAX_MODEL_LEN
    if not isinstance(getattr(type(sp), "max_model_len", None), property):
        sp.max_model_len = MAX_MODEL_LEN
    sp.attn_groups, sp.kv_cache_config = [[]], KV
    sp.draft_is_prefilling = torch.zeros(max_num_reqs, dtype=torch.bool)
    sp.arange = torch.arange(max_num_reqs + 1, dtype=torch.int32)
    return sp


def draft_build(sp, num_reqs: int, mode: str, num_reqs_padded: int | None, qsl: np.ndarray,
                seq_lens_upper: torch.Tensor, step: int):
    """One draft step's attention build: _build_attn_metadata(num_reqs, batch_desc, ...) (0.30+) or
    _build_draft_attn_metadata(num_reqs, num_reqs_padded, num_tokens_padded, ...) (0.29)."""
    nrp = num_reqs_padded or num_reqs
    if hasattr(type(sp), "_build_attn_metadata"):
        return sp._build_attn_metadata(num_reqs, desc(mode, nrp, num_reqs_padded), qsl, seq_lens_upper, step)
    return sp._build_draft_attn_metadata(num_reqs, nrp, nrp, seq_lens_upper, step, query_start_loc_np=qsl)


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


# --------------------------------------------------------------------------------------------
# Slot mappings: vLLM's BlockTables.compute_slot_mappings and its Triton kernel on CPU

# 0.31+ take which KV-cache groups DCP shards (KVCacheSpec.dcp_sharded); 0.29-0.30 localise every group
HAS_DCP_SHARDED = "dcp_sharded" in inspect.signature(BlockTables.__init__).parameters


def _interpreter_bool_masks() -> None:
    """Triton's interpreter refuses a load mask that numpy does not hold as bool, and vLLM 0.31+'s slot-mapping
    kernel builds one from a loaded torch.bool (on a GPU a mask is i1 whatever its source). Cast it there; every
    value is still the kernel's."""
    from triton.runtime import interpreter as it

    orig = it.InterpreterBuilder.create_masked_load
    if getattr(orig, "_dcptool_bool_masks", False):
        return

    def create_masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        if mask.data.dtype != bool:
            mask = it.TensorHandle(mask.data.astype(bool), mask.dtype)
        return orig(self, ptrs, mask, other, cache_policy, is_volatile)

    create_masked_load._dcptool_bool_masks = True
    it.InterpreterBuilder.create_masked_load = create_masked_load


_interpreter_bool_masks()


def slot_tables(block_sizes: list[int], dcp_sharded: list[bool], dcp: int, rank: int, il: int, *, max_num_reqs: int = 8,
                max_blocks: int = 512, max_num_tokens: int = 4096, seed: int = 0) -> BlockTables:
    """BlockTables with one group per block size, every request's blocks a random permutation (distinct block
    ids, as vLLM's allocator hands out), built without vLLM's constructor (it pins host memory) and laid out by
    vLLM's own init_block_table_layout_tensors. `dcp_sharded` reaches the kernel only on 0.31+."""
    bt = BlockTables.__new__(BlockTables)
    g = len(block_sizes)
    bt.block_sizes, bt.kernel_block_sizes, bt.num_kv_cache_groups = list(block_sizes), list(block_sizes), g
    bt.blocks_per_kv_block = [1] * g
    bt.device, bt.max_num_reqs, bt.max_num_batched_tokens = CPU, max_num_reqs, max_num_tokens
    bt.cp_size, bt.cp_rank, bt.cp_interleave = dcp, rank, il
    gen = torch.Generator().manual_seed(seed)
    bt.block_tables = [SimpleNamespace(gpu=torch.randperm(max_num_reqs * max_blocks, generator=gen)
                                       .view(max_num_reqs, max_blocks).to(torch.int32)) for _ in range(g)]
    bt.input_block_tables = [b.gpu.clone() for b in bt.block_tables]
    bt._slot_mapping_enabled, bt._sliding_window_reach, bt._num_dirty_rows = [True] * g, [0] * g, 0
    if HAS_DCP_SHARDED:
        bt.dcp_sharded = torch.tensor(dcp_sharded, dtype=torch.bool)
    bt.slot_mappings = torch.zeros(g, max_num_tokens, dtype=torch.int64)
    bt.init_block_table_layout_tensors()
    return bt


def vllm_groups(dcp_sharded: list[bool]) -> list[bool]:
    """Which groups this release's kernel shards: the flag on 0.31+, every group before."""
    return list(dcp_sharded) if HAS_DCP_SHARDED else [True] * len(dcp_sharded)
