"""connectors.py: a connector's plan as a transfer record, without vLLM: NIXL's ReadSpecs per group (whole kernel
blocks; local blocks split in the remote's finer units; a region's reads as its group's; the prefill's table of the
group a region holds there), LMCache's store ops, Mooncake's split metadata (ports naming PCP x TP workers); and a
NIXL module the plugin cannot hook costs its transfers only. tests/vllm/test_vllm_nixl.py, test_vllm_lmcache.py and
test_vllm_mooncake.py drive the real code."""

import types
from types import SimpleNamespace

import numpy as np
import pytest

from dcptool import Recorder
from dcptool.check.transfers import judge
from dcptool.dump import open_dumps
from dcptool.dump.transfer import Side, levels_of
from dcptool.engine.vllm import state, tables
from dcptool.engine.vllm.connectors import NIXL, lmcache_store, mooncake_pull, nixl_transfer


class MLAAttentionSpec:  # (named as vLLM's: the kind is read from the class names of its MRO)
    pass


class MambaSpec:
    pass


def fake_worker(*, kernel=16, phys=1, remote_kernel=16, remote_phys=1, dcp=2, rank=1, remote_tp=2, remote_dcp=2,
                kinds=(MLAAttentionSpec,), regions=None, remote_regions=None):
    info = SimpleNamespace(remote_tp_size=remote_tp, remote_dcp_size=remote_dcp, remote_block_size=remote_kernel,
                           remote_physical_blocks_per_logical=remote_phys)
    spec = SimpleNamespace(sliding_window=None)
    return SimpleNamespace(
        transfer_topo=SimpleNamespace(get_engine_info=lambda e: info), block_size=kernel,
        _physical_blocks_per_logical_kv_block=phys, world_size=dcp, dcp_size=dcp, dcp_rank=rank, pcp_size=1,
        _group_spec_types=kinds, _dcp_replicated_groups=set(),
        kv_cache_config=SimpleNamespace(transfer_groups=[SimpleNamespace(kv_cache_spec=spec)] * len(kinds)),
        region_group_ids=regions, dst_region_group_ids={"p": remote_regions})


def meta(remote, local, computed=(0,), tokens=40):
    return SimpleNamespace(remote=SimpleNamespace(engine_id="p", num_tokens=tokens, block_ids=remote),
                           local_block_ids=local, local_num_computed_blocks=computed)


def spec(rank, local, remote, by_region=False):
    return SimpleNamespace(remote_rank=rank, local_block_ids=local, remote_block_ids=remote,
                           block_ids_by_region=by_region)


def judged(tmp_path, records, dcp=2) -> list[dict]:
    path = tmp_path / "t.safetensors"
    with Recorder(path, dcp_size=dcp, force=True) as rec:
        for r in records:
            assert rec.record_transfer(r) >= 0
    from dcptool.dcp.kv_transfer import KINDS

    return [{KINDS[k]: int(n) for k, n in enumerate(row) if n} for row in judge(open_dumps([str(path)]))[1].count]


def test_nixl_reads_are_whole_kernel_blocks_of_the_remote_rank_s_shard(tmp_path, monkeypatch):
    monkeypatch.setattr(state.STATE, "interleave", 16)
    w = fake_worker()
    t = nixl_transfer(w, "req", meta([[5, 6]], [[7, 8]]), ([[5, 6]], [[7, 8]]), [spec(1, [[7, 8]], [[5, 6]])], 3)
    rows = levels_of(t)
    assert rows["xcopy"].tolist() == [[0, 1, 5, 0, 7, 0, 16], [0, 1, 6, 0, 8, 0, 16]]
    assert t.src == Side(tp=2, dcp=2, interleave=16) and t.seq_len == 40 and t.step == 3 and t.rank == 1
    assert judged(tmp_path, [t]) == [{}]
    bad = nixl_transfer(w, "req", meta([[5, 6]], [[7, 8]]), ([[5, 6]], [[7, 8]]), [spec(0, [[7, 8]], [[5, 6]])], 3)
    assert judged(tmp_path, [bad])[0]["wrong-source"] == 16  # (remote rank 0's shard holds other positions)


def test_local_blocks_in_the_remote_s_finer_units_are_split_into_kernel_block_and_offset(tmp_path, monkeypatch):
    """block_size_ratio 2: a 16-token local kernel block is two 8-token remote ones (NIXL's mapped sub-blocks)."""
    monkeypatch.setattr(state.STATE, "interleave", 16)
    w = fake_worker(kernel=16, remote_kernel=8, remote_phys=2)
    reads = [spec(1, [[14, 15, 16, 17]], [[10, 11, 12, 13]])]  # local 7 -> 14, 15; local 8 -> 16, 17
    t = nixl_transfer(w, "req", meta([[5, 6]], [[7, 8]]), ([[5, 6]], [[7, 8]]), reads, 0)
    assert levels_of(t)["xcopy"][:, 2:].tolist() == [[10, 0, 7, 0, 8], [11, 0, 7, 8, 8], [12, 0, 8, 0, 8],
                                                     [13, 0, 8, 8, 8]]
    assert judged(tmp_path, [t]) == [{}]


def test_region_reads_are_their_groups_from_the_prefill_table_of_the_group_holding_the_region(tmp_path, monkeypatch):
    monkeypatch.setattr(state.STATE, "interleave", 16)
    w = fake_worker(kinds=(MLAAttentionSpec, MLAAttentionSpec), regions=[1, 0], remote_regions=[0, 1])
    tables_ = ([[5, 6], [25, 26]], [[7, 8], [27, 28]])
    reads = [spec(1, [[27, 28], [7, 8]], [[5, 6], [25, 26]], by_region=True)]  # region 0: P group 0 -> D group 1
    t = nixl_transfer(w, "req", meta(*tables_, computed=(0, 0)), tables_, reads, 0)
    assert [list(g.src_blocks) for g in t.groups] == [[25, 26], [5, 6]]
    assert judged(tmp_path, [t]) == [{}]


def test_mamba_reads_are_block_by_block(monkeypatch):
    monkeypatch.setattr(state.STATE, "interleave", 1)
    w = fake_worker(kinds=(MambaSpec,), dcp=1, rank=0, remote_dcp=1, remote_tp=1)
    t = nixl_transfer(w, "req", meta([[3]], [[4]]), ([[3]], [[4]]), [spec(0, [[4]], [[3]])], 0)
    assert t.groups[0].kind == "mamba" and levels_of(t)["xcopy"].tolist() == [[0, 0, 3, 0, 4, 0, 16]]


@pytest.mark.parametrize("pieces, clean", [(1, False), (4, True)])
def test_an_lmcache_store_claims_its_piece(tmp_path, pieces, clean):
    eng = Side(tp=4, dcp=4)
    recs = [lmcache_store(step=0, rank=r, request="req", engine=eng, block_ids=[10, 11], block_size=16,
                          tokens=(0, 100), piece=(r, pieces)) for r in range(4 if clean else 1)]
    got = judged(tmp_path, recs, dcp=4)
    assert got == [{}] * 4 if clean else got[0].keys() >= {"partial-store"}


@pytest.mark.parametrize("ports, clean", [([[30001], [30003]], True), ([[30003], [30001]], False)])
def test_a_mooncake_pull_reads_the_workers_its_ports_name(tmp_path, ports, clean):
    """Decode rank 1 of DCP 2 pulls a 100-token prompt (blocks 0-6 of 16 tokens) from a prefill of TP 2, PCP 2,
    DCP 2 whose four CP ranks hold the blocks round-robin: blocks 1 and 5 from CP rank 1 (port offset 1: PCP rank 0,
    TP rank 1), block 3 from CP rank 3 (offset 3: PCP rank 1, TP rank 1), into its local blocks 0, 2 and 1."""
    meta = SimpleNamespace(remote_block_ids=[[10, 11]], local_block_ids=[[20, 21, 22, 23]], remote_port=30000,
                           remote_block_size=16, num_computed_tokens=0, num_external_tokens=100, remote_engine_id="p")
    plan = (ports, [([20, 22],), ([21],)], [([10, 11],), ([10],)])
    t = mooncake_pull(step=0, rank=1, request="r", meta=meta, plan=plan, prefill=Side(tp=2, pcp=2, dcp=2,
                      interleave=16, cp_shards=True), decode=Side(tp=2, dcp=2, interleave=16), block_size=16)
    assert [r[0] for r in t.reads] == ([1, 3] if clean else [3, 1]) and t.seq_len == 100
    got = judged(tmp_path, [t])
    assert got == [{}] if clean else got[0].keys() >= {"wrong-source"}


def test_a_nixl_module_the_plugin_cannot_hook_loses_its_transfers_not_the_recording(caplog):
    st = state.STATE
    saved = (st.tables, st.active)
    st.tables, st.active = list(tables.TABLES), True
    try:
        tables.patch(NIXL, types.ModuleType(NIXL))  # (no NixlPullConnectorWorker)
        assert st.active and "not recording its KV transfers" in caplog.text
    finally:
        st.tables, st.active = saved
    assert NIXL in tables.OPTIONAL and np.all([NIXL in t.hooks for t in tables.TABLES])


def reference_copies(w, reads, r_kernel, l_kernel, rdcp):
    """The copies, pair by pair, as the definition reads (each pair once, the first kept)."""
    ratio, out = max(1, l_kernel // r_kernel), {}
    for s in reads:
        for k, (rids, lids) in enumerate(zip(s.remote_block_ids, s.local_block_ids)):
            g = w.region_group_ids[k] if s.block_ids_by_region else k
            if g < 0:
                continue
            mamba = w._group_spec_types[g] is MambaSpec
            for rid, lid in zip(rids, lids):
                c = ((g, s.remote_rank % rdcp, int(rid), 0, int(lid), 0, min(r_kernel, l_kernel)) if mamba or ratio == 1
                     else (g, s.remote_rank % rdcp, int(rid), 0, int(lid) // ratio, int(lid) % ratio * r_kernel,
                           r_kernel))
                out.setdefault(c, None)
    return [list(c) for c in out]


@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 1000])
@pytest.mark.parametrize("remote_kernel", [16, 8])
def test_nixl_copies_are_each_posted_pair_once_in_order(n, remote_kernel, monkeypatch):
    """Seeded reads over an attention and a mamba group and a shared region (-1), lists of unequal lengths (zip's
    pairs), pairs repeated across ReadSpecs and within one: the copies are the pair-by-pair reference's."""
    monkeypatch.setattr(state.STATE, "interleave", 16)
    rng = np.random.default_rng(n * 7 + remote_kernel)
    w = fake_worker(kernel=16, remote_kernel=remote_kernel, remote_phys=16 // remote_kernel,
                    kinds=(MLAAttentionSpec, MambaSpec), regions=[0, 1, -1], remote_regions=[0, 1, -1])

    def ids(k):
        return rng.integers(0, max(4, n // 2), k).tolist()  # (small ranges: repeated pairs)

    reads = [spec(r, [ids(n), ids(n + 1), ids(n)], [ids(n), ids(max(n - 1, 0)), ids(n)], by_region=True)
             for r in (1, 3)] + [spec(1, [ids(n), ids(n)], [ids(n), ids(n)])]
    reads.append(reads[0])
    t = nixl_transfer(w, "req", meta([ids(3), ids(3)], [ids(3), ids(3)], computed=(0, 0)),
                      ([ids(3), ids(3)], [ids(3), ids(3)]), reads, 0)
    assert t.copies.dtype == np.int64 and t.copies.shape[1] == 7
    assert t.copies.tolist() == reference_copies(w, reads, remote_kernel, 16, 2)
