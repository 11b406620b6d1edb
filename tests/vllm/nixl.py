"""The installed release's NIXL pull worker, on CPU, planning reads with its own code: `nixl` itself is never imported
(the worker's constructor would start an agent); the worker is built without it, with the state its handshake sets
(the remote engine registered in its TransferTopology, its TP mapping from the release's compute_tp_mapping), and
the transfer stubbed at `_read_blocks` (each ReadSpec kept, nothing moved). Not a test module."""

from __future__ import annotations

import dataclasses
import inspect
from collections import defaultdict
from types import SimpleNamespace

from vllm.distributed.kv_transfer.kv_connector import utils as kvu
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata as nmeta
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import pull_worker, tp_mapping
from vllm.v1 import kv_cache_interface as kvi

ENGINE = "prefill-engine"
SPECS = {"mla": "MLAAttentionSpec", "attention": "FullAttentionSpec", "swa": "SlidingWindowSpec",
         "mamba": "MambaSpec"}


def _spec(kind: str, block: int):
    """A KV-cache spec instance of the release (its fields vary: filled by name, defaults kept)."""
    cls = getattr(kvi, SPECS[kind])
    values = dict(block_size=block, num_kv_heads=1, head_size=576, dtype=__import__("torch").bfloat16,
                  sliding_window=128, shapes=((1,),), dtypes=(__import__("torch").bfloat16,))
    fields = {f.name for f in dataclasses.fields(cls)}
    need = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING}
    return cls(**{k: v for k, v in values.items() if k in fields and (k in need or k == "block_size")})


@dataclasses.dataclass
class Layout:
    """One side as NIXL sees it: TP ranks (transfer ranks), DCP size, kernel block size, kernel blocks per logical
    block."""

    tp: int
    dcp: int
    kernel: int
    phys: int = 1

    @property
    def block(self) -> int:
        return self.kernel * self.phys


def worker(local: Layout, remote: Layout, tp_rank: int, kinds=("mla",), *, local_regions=None, remote_regions=None):
    """A NixlPullConnectorWorker of the installed release for decode rank tp_rank, handshaken with a prefill engine
    of layout `remote`; its reads are kept in `.reads` (ReadSpecs) instead of posted."""
    W = pull_worker.NixlPullConnectorWorker
    w = object.__new__(W)
    groups = [SimpleNamespace(kv_cache_spec=_spec(k, local.block), layer_names=[f"l{g}"])
              for g, k in enumerate(kinds)]
    w.kv_cache_config = SimpleNamespace(transfer_groups=groups, kv_cache_groups=groups,
                                        transfer_group_ids=list(range(len(groups))), num_blocks=1 << 20)
    w.tp_rank, w.world_size, w.dcp_size = tp_rank, local.tp, local.dcp
    w.pcp_size, w.pcp_rank, w.pcp_dcp_sharded = 1, 0, False
    w.transfer_tp_size, w.transfer_tp_rank = local.tp, tp_rank
    w.dcp_rank = tp_rank % local.dcp
    w.block_size, w._physical_blocks_per_logical_kv_block = local.kernel, local.phys
    w.use_mla = all(k in ("mla", "mamba") for k in kinds)
    w._has_mamba = "mamba" in kinds
    w.engine_id = "decode-engine"
    w._group_spec_types = tuple(type(g.kv_cache_spec) for g in groups)
    w._dcp_replicated_groups = set()
    topo_kw = dict(tp_rank=tp_rank, tp_size=local.tp, block_size=local.kernel, engine_id=w.engine_id,
                   is_mla=w.use_mla, is_mamba=w._has_mamba, total_num_kv_heads=1, attn_backends=[])
    if "dcp_size" in inspect.signature(kvu.TransferTopology).parameters:
        topo_kw["dcp_size"] = local.dcp
    topo = kvu.TransferTopology(**topo_kw)
    info = dict(remote_tp_size=remote.tp, remote_block_len=remote.kernel * 1152, remote_block_size=remote.kernel,
                remote_physical_blocks_per_logical=remote.phys, remote_dcp_size=remote.dcp)
    known = {f.name for f in dataclasses.fields(kvu.EngineTransferInfo)}
    topo.register_remote_engine(ENGINE, kvu.EngineTransferInfo(**{k: v for k, v in info.items() if k in known}))
    w.transfer_topo = topo
    mapping = inspect.signature(tp_mapping.compute_tp_mapping).parameters
    kw = dict(transfer_topology=topo, remote_tp_size=remote.tp, group_spec_types=w._group_spec_types)
    if "remote_dcp_size" in mapping:
        kw["remote_dcp_size"] = remote.dcp
    w.tp_mappings = {ENGINE: tp_mapping.compute_tp_mapping(**kw)}
    w._invalid_remote_engines, w._remote_registration_generations = set(), {}
    w._remote_agents = {ENGINE: {(0, r): f"agent{r}" for r in range(remote.tp)}}
    w._engine_last_active, w._recving_transfers, w._recving_metadata = {}, {}, {}
    w._bidirectional_kv_xfer_enabled = False
    w.region_group_ids = local_regions
    w.dst_region_group_ids = {ENGINE: remote_regions if remote_regions is not None else list(range(len(kinds)))}
    w.num_regions = len(remote_regions or kinds)
    same = local_regions is None or local_regions == remote_regions
    w._dst_pairs = {ENGINE: SimpleNamespace(groups_match=same, remote=tuple(range(w.num_regions)),
                                            local=tuple(range(w.num_regions)))}
    w.src_xfer_handles_by_block_size = defaultdict(int)
    w.src_xfer_handles_by_tp_ratio = defaultdict(lambda: defaultdict(int))
    w._dram_src_handles_by_block_size = defaultdict(int)
    w.dst_xfer_side_handles = {ENGINE: defaultdict(int)}
    w._mixed_mem_types = False
    w.reads = []

    def read(*args, **kwargs):  # the transfer: kept, not posted
        w.reads.append(kwargs.get("read_spec", args[0] if args else None))
        return True

    w._read_blocks = read
    return w


def request(w, remote_ids, local_ids, computed, num_tokens):
    """NIXL's ReqMeta for one request as the decode scheduler hands it: the prefill's logical block ids per group,
    this side's uncached ones and its prefix-cache hit in blocks per group, the prompt's tokens."""
    fields = {f.name for f in dataclasses.fields(nmeta.RemoteMeta)}
    remote = dict(block_ids=[list(g) for g in remote_ids], host="p", port=1, engine_id=ENGINE, request_id="r",
                  num_tokens=num_tokens)
    rm = nmeta.RemoteMeta(**{k: v for k, v in remote.items() if k in fields})
    meta_fields = {f.name for f in dataclasses.fields(nmeta.ReqMeta)}
    kw = dict(local_block_ids=[list(g) for g in local_ids], local_physical_block_ids=[], tp_size=w.world_size,
              dcp_size=w.dcp_size, local_num_computed_blocks=tuple(computed), remote=rm)
    meta = nmeta.ReqMeta(**{k: v for k, v in kw.items() if k in meta_fields})
    meta.local_physical_block_ids = w._logical_to_kernel_block_ids(meta.local_block_ids,
                                                                   w._physical_blocks_per_logical_kv_block)
    return meta
