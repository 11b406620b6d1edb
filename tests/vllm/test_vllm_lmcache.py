"""LMCache's multi-process connector under DCP, its planning code on CPU (tests/vllm/lmcache_planning.py), each store
recorded as a transfer (engine.vllm.connectors.lmcache_store) and replayed: LMCache #4030 where the code has it
(vLLM 0.29-0.34's in-tree connector and LMCache 0.5.4: only rank 0 stores, under a key claiming the whole request:
partial-store), and LMCache 0.5.6's one writer per DCP shard, each under its shard's piece, clean."""

import dataclasses

import numpy as np
import pytest
from engine import set_dcp
from lmcache_planning import V1, WHEELS, definitions, in_tree_stores, wheel_writers

from dcptool import Recorder
from dcptool.check.replay import replay
from dcptool.dump import open_dumps
from dcptool.dump.transfer import Side
from dcptool.engine.vllm.connectors import lmcache_store

BLOCK = 16
LENGTHS = (1, 15, 16, 100, 257, 1000)  # tokens each request stores (shorter than the CP world too)


def ops(dcp: int):
    """The store ops the scheduler hands every rank: one per request, its vLLM blocks (B * dcp tokens each)."""
    cls = definitions(V1 / "lmcache_integration" / "multi_process_adapter.py", ["LoadStoreOp"], {})["LoadStoreOp"]
    names = {f.name for f in dataclasses.fields(cls)}
    out = []
    for k, L in enumerate(LENGTHS):
        n = -(-L // (BLOCK * dcp))
        kw = dict(block_ids=list(range(100 * k, 100 * k + n)), token_ids=list(range(L)), start=0, end=L)
        out.append(cls(**{a: v for a, v in kw.items() if a in names}))
    return out


def replayed(tmp_path, dcp: int, stores: dict[int, tuple[tuple[int, int], list]]):
    """Every store of every writer rank, recorded and replayed."""
    path = tmp_path / "stores.safetensors"
    engine = Side(tp=dcp, dcp=dcp, interleave=1)
    with Recorder(path, dcp_size=dcp, force=True) as rec:
        for rank, (piece, submitted) in stores.items():
            for k, op in enumerate(submitted):
                rec.record_transfer(lmcache_store(step=0, rank=rank, request=f"req-{k}", engine=engine,
                                                  block_ids=op.block_ids, block_size=BLOCK, tokens=(op.start, op.end),
                                                  piece=piece))
        assert rec.dropped == 0
    return replay(open_dumps([str(path)]), "torch")


@pytest.mark.parametrize("dcp", [2, 4, 8])
def test_vllm_in_tree_connector_stores_rank_0s_shard_as_the_whole_request(dcp, tmp_path):
    """vLLM's own LMCacheMPConnector: MLA stores from the first rank of the TP group only, and its key's worker id
    leaves TP (and so DCP) out: one piece, claiming every token."""
    set_dcp(dcp, 0)
    stores = in_tree_stores(dcp, dcp, ops(dcp))
    set_dcp(1, 0)
    assert list(stores) == [0] and stores[0][0] == (0, 1)
    found = replayed(tmp_path, dcp, stores).findings
    # every request longer than rank 0's first interleave chunk (1 token here): all but the 1-token one
    assert [f.detail["kind"] for f in found] == ["partial-store"] * (len(LENGTHS) - 1)
    assert "a partial shard stored as the whole request" in found[0].text


@pytest.mark.parametrize("version, dcp, tp", [("0.5.4", 4, 4), ("0.5.6", 4, 4), ("0.5.4", 2, 4), ("0.5.6", 2, 4),
                                              ("0.5.6", 8, 8)])
def test_lmcache_elects_one_writer_per_dcp_shard_from_0_5_5(version, dcp, tp, tmp_path):
    """LMCache's own ParallelStrategy: 0.5.4 has rank 0 write one piece for all (LMCache #4030); 0.5.6 (PR #4679)
    one writer per DCP shard, each its shard's piece: the ranks of a TP group with DCP in it (dcp_rank = tp_rank %
    dcp)."""
    assert (WHEELS[version] / "lmcache").is_dir(), f"run tools/setup_vllm_env.sh: it unpacks lmcache {version}"
    writers = wheel_writers(version, tp, tp, dcp)
    submitted = ops(dcp)
    stores = {r: (piece, submitted) for r, piece in writers.items()}
    found = replayed(tmp_path, dcp, {r % dcp: v for r, v in stores.items()}).findings
    if version == "0.5.4":
        assert writers == {0: (0, 1)} and {f.detail["kind"] for f in found} == {"partial-store"}
    else:
        assert writers == {r: (r, dcp) for r in range(dcp)} and found == []
    assert np.all([op.end == L for op, L in zip(submitted, LENGTHS)])
