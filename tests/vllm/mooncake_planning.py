"""vllm-ascend's Mooncake connector's pull planning, its own code on CPU: per decode worker and request, which prefill
workers it reads (handshake ports) and which remote and local kernel blocks per KV-cache group
(`MooncakeConnectorWorker._get_kv_split_metadata`, the context-parallel path, with the helpers it calls). The module
imports torch_npu and Mooncake's TransferEngine at import, so the definitions that plan are taken from its source as
they are (ast) and run alone on a worker holding the state its constructor and handshake set; nothing is moved.
The source is vllm-ascend 0.23.0.post1's (PyPI's newest; `tools/setup_vllm_env.sh` unpacks it). Not a test module."""

from __future__ import annotations

import copy
import hashlib
import logging
import random
import struct
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypedDict

import numpy as np
from lmcache_planning import definitions

VERSION = "0.23.0.post1"
SOURCE = (Path(sys.prefix) / f"vllm-ascend-{VERSION}" / "vllm_ascend" / "distributed" / "kv_transfer" / "kv_p2p" /
          "mooncake_connector.py")
PLANNING = ["_expand_block_ids", "_local_kernel_ids_for_shard", "_group_compress_ratio", "_get_kv_cache_group_id",
            "_get_kernel_block_scale", "_get_group_kernel_params", "_get_local_remote_cp_params",
            "_get_kernel_block_ids", "_get_kv_split_metadata", "_get_tp_num_need_pulls",
            "_get_remote_host_info_by_port", "_get_remote_rank", "_get_remote_tp_ranks", "_get_remote_ranks_for_req"]
REMOTE_PORT, LOCAL_PORT = 30000, 40000


def code() -> dict:
    """ReqMeta and the worker's planning methods of the release, executed alone."""
    globs = dict(copy=copy, hashlib=hashlib, random=random, struct=struct, np=np, logger=logging.getLogger("mooncake"),
                 Any=Any, TypedDict=TypedDict, BlockIds=list)
    return definitions(SOURCE, ["ReqMeta", "string_to_int64_hash", "MooncakeConnectorWorker:" + ",".join(PLANNING)],
                       globs)


def group(kind: str, layers: list[int], kv_cache_group_id: int) -> tuple[dict, list[int]]:
    """One transfer group as `_build_kv_group2layeridx` serialises it: its spec type, layers and KV-cache group."""
    spec = {"MambaSpec": "MambaSpec", "mla": "MLAAttentionSpec", "indexer": "AscendSFAIndexerCacheSpec"}[kind]
    return ({"layer_names": [f"model.layers.{i}.self_attn.attn" for i in layers], "kv_cache_spec_type": spec,
             "kv_cache_spec": {"num_kv_heads": 1}, "kv_cache_group_id": kv_cache_group_id}, layers)


def worker(tp: int, pcp: int, dcp: int, rank: int, block: int, groups: dict, *, prefill_tp: int,
           scales: list[list[int]] | None = None):
    """A decode worker of TP `tp` (its DCP group `dcp` of them, PCP `pcp`) at TP rank `rank`, MLA, `block`-token
    blocks, transfer groups `groups` (transfer group id -> group()), per layer kernel block scales `scales` (as
    register_kv_caches measures them: 1 where not given)."""
    c = code()
    w = object.__new__(c["MooncakeConnectorWorker"])
    w.tp_size, w.tp_rank, w.pcp_size, w.dcp_size = tp, rank, pcp, dcp
    w.pcp_rank, w.dcp_rank = 0, rank % dcp
    w.block_size, w.use_mla, w.use_sparse, w.num_key_value_heads = block, True, False, 1
    w._prefill_tp_size, w.tp_num_need_pulls, w._is_hma_required = prefill_tp, 1, False
    w._decode_tp_size, w._prefill_pp_size = tp, 1
    w.side_channel_port, w.handshake_port = LOCAL_PORT, LOCAL_PORT + rank
    w.local_remote_block_port_mapping, w.remote_port_send_num = {}, {}
    w.kv_group2layeridx = groups
    w.block_size_scale = scales if scales is not None else [[1]] * 64
    w.vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_port=REMOTE_PORT),
                                    model_config=SimpleNamespace(is_deepseek_mla=True))
    return w, c["ReqMeta"]


def request(meta_cls, *, prompt: int, computed: int, remote: list[list[int]], local: list[list[int]], block: int,
            pcp: int, dcp: int, tp: int):
    """The ReqMeta the decode scheduler hands the worker (MooncakeConnectorMetadata.add_new_req's fields): the
    prefill's block tables per KV-cache group, this side's uncached ones, the prompt's blocks on the prefill."""
    return meta_cls(local_block_ids=local, num_external_tokens=prompt - computed, num_computed_tokens=computed,
                    remote_block_ids=remote, remote_host="p", remote_port=REMOTE_PORT, remote_engine_id="prefill",
                    remote_request_id="r", remote_pcp_size=pcp, remote_dcp_size=dcp, remote_ptp_size=tp,
                    remote_multi_nodes_meta_mapping={}, num_prompt_blocks=-(-prompt // block), remote_block_size=block)

