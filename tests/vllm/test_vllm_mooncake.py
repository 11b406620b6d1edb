"""vllm-ascend's Mooncake pull planning, its own code on CPU (tests/vllm/mooncake_planning.py: vllm-ascend
0.23.0.post1's `_get_kv_split_metadata`, context-parallel path), recorded with Recorder.transfer and replayed: the
decode workers' plans over DCP layouts on both sides (a prefill with PCP whose ranks hold distinct shards, DCP
smaller than TP, prefix-cache hits, prompts shorter than the CP world) are clean; a KV-cache group split into
several transfer groups (MLA and the SFA indexer of one layer, as MTP and sparse attention make them) fails at the
second transfer group (vllm-ascend #13965: the CP path indexes the scheduler's block tables with the transfer-group
index), and a decode side with DCP receiving from an unsharded prefill has no path (vllm-ascend #16492's second
part: the release asserts)."""

import numpy as np
import pytest
from mooncake_planning import group, request, worker

from dcptool import Recorder
from dcptool.check.replay import replay
from dcptool.dump import open_dumps
from dcptool.dump.transfer import Side
from dcptool.engine.vllm.connectors import mooncake_pull

# (decode TP = DCP, prefill TP, prefill PCP, prefill DCP, prefill block, decode block): the prefill's CP world a
# multiple of the decode's; a decode block of r prefill blocks (kernel blocks of the prefill's size) where the
# prefill's CP world is a multiple of r times the decode's
LAYOUTS = [(2, 2, 1, 2, 16, 16), (4, 8, 1, 8, 16, 16), (2, 4, 2, 4, 16, 16), (4, 4, 2, 2, 128, 128),
           (1, 2, 2, 2, 16, 16), (2, 8, 1, 2, 16, 16), (4, 4, 1, 4, 1, 1), (8, 8, 2, 8, 16, 16),
           (2, 8, 1, 8, 16, 32), (1, 4, 1, 4, 16, 64)]


def random_requests(rng, d_cp: int, block: int, n: int = 10):
    """(prompt tokens, decode prefix-cache hit in tokens: whole decode blocks of B * DCP tokens) with awkward
    lengths, prompts shorter than the CP world among them."""
    out = []
    for k in range(n):
        L = int(rng.choice([1, 3, 15, 16, 17, 100, 257, 1000, 4097]))
        hit = int(rng.integers(0, 3)) * block * d_cp * (k % 3 == 0)
        out.append((L, hit if hit < L else 0))
    return out


def plans(tmp_path, layout, requests, groups=None):
    """Every decode worker plans every request with the release's code; each plan recorded as the docs say
    (engine.vllm.connectors.mooncake_pull), one file."""
    d, p_tp, p_pcp, p_dcp, Bp, Bd = layout
    groups = groups or {0: group("mla", [0, 1, 2], 0)}
    n_kv = 1 + max(spec["kv_cache_group_id"] for spec, _ in groups.values())
    path = tmp_path / "mooncake.safetensors"
    src = Side(tp=p_tp, pcp=p_pcp, dcp=p_dcp, interleave=Bp, cp_shards=True)
    dst = Side(tp=d, dcp=d, interleave=Bd)
    with Recorder(path, dcp_size=d, force=True) as rec:
        for rank in range(d):
            w, meta_cls = worker(d, 1, d, rank, Bd, groups, prefill_tp=p_tp, scales=[[Bd // Bp]] * 8)
            for k, (L, hit) in enumerate(requests):
                remote = [list(range(1000 * (k + 50 * g), 1000 * (k + 50 * g) + -(-L // (Bp * p_pcp * p_dcp))))
                          for g in range(n_kv)]
                ext = -(-(L - hit) // Bd)
                local = [list(range(500_000 + 1000 * (k + 50 * g), 500_000 + 1000 * (k + 50 * g) + -(-ext // d)))
                         for g in range(n_kv)]
                meta = request(meta_cls, prompt=L, computed=hit, remote=remote, local=local, block=Bp, pcp=p_pcp,
                               dcp=p_dcp, tp=p_tp)
                plan = w._get_kv_split_metadata(f"req-{k}", meta)
                rec.record_transfer(mooncake_pull(step=k, rank=rank, request=f"req-{k}", meta=meta, plan=plan,
                                                  prefill=src, decode=dst, block_size=Bd, kernel_block_size=Bp))
    return path


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "D{}-P{}x{}x{}-B{}-{}".format(*x))
def test_mooncake_cp_plans_replay_clean(layout, tmp_path):
    path = plans(tmp_path, layout, random_requests(np.random.default_rng(sum(layout)), layout[0], layout[5]))
    d = open_dumps([path])
    assert [f.message for f in replay(d, "torch").findings] == []
    assert int(np.diff(d["obs.xfer"]).sum()) == layout[0] * 10  # every worker, every request
    # a decode rank reads from every prefill worker holding its positions: several where the prefill is finer
    per = np.diff(d["obs.xcopy"])[np.diff(d["obs.xfer"]) > 0]
    assert per.max() >= (2 if layout[2] * layout[3] > layout[0] else 1)


def test_a_wrong_plan_written_the_same_way_is_caught(tmp_path):
    """The harness can fail: the release's plan with its shards' source workers swapped is `wrong-source`."""
    d_, B = 2, 16
    w, meta_cls = worker(d_, 1, d_, 0, B, {0: group("mla", [0], 0)}, prefill_tp=4)
    remote, local = [list(range(100, 102))], [list(range(200, 204))]
    meta = request(meta_cls, prompt=100, computed=0, remote=remote, local=local, block=B, pcp=1, dcp=4, tp=4)
    good = mooncake_pull(step=0, rank=0, request="r", meta=meta, plan=w._get_kv_split_metadata("r", meta),
                         prefill=Side(tp=4, dcp=4, interleave=B), decode=Side(tp=2, dcp=2, interleave=B), block_size=B)
    r = good.reads
    assert len(r) == 2 and {x[0] for x in r} == {0, 2}  # decode rank 0 holds blocks 0, 2, 4 ...: workers 0, 2
    path = tmp_path / "bad.safetensors"
    with Recorder(path, dcp_size=d_, force=True) as rec:
        rec.record_transfer(good)
        rec.record_transfer(good._replace(step=1, reads=[(r[1][0], r[0][1], r[0][2]), (r[0][0], r[1][1], r[1][2])]))
    found = replay(open_dumps([path]), "torch").findings
    assert len(found) == 1 and found[0].detail["kind"] == "wrong-source" and found[0].step == 1


def test_a_kv_cache_group_split_into_transfer_groups_fails_or_reads_scaled_blocks(tmp_path):
    """vllm-ascend #13965 in 0.23.0.post1: one KV-cache group (MLA, kernel scale 1, and the SFA indexer of the same
    layers, scale 8) is two Mooncake transfer groups. With DCP the CP path reads the scheduler's tables (one per
    KV-cache group) at the transfer-group index: the second one is past them. Without CP the plan keeps one list per
    KV-cache group, so the indexer's expanded ids (x 8) replace the MLA ones and the MLA layers read them: block ids
    scaled by 8 (`block-ids`)."""
    groups = {0: group("mla", [0, 1], 0), 1: group("indexer", [2, 3], 0)}
    scales = [[1], [1], [8], [8]]
    w, meta_cls = worker(2, 1, 2, 0, 128, groups, prefill_tp=2, scales=scales)
    meta = request(meta_cls, prompt=1000, computed=0, remote=[list(range(4))], local=[list(range(4))], block=128,
                   pcp=1, dcp=2, tp=2)
    with pytest.raises(IndexError):
        w._get_kv_split_metadata("r", meta)
    w, meta_cls = worker(1, 1, 1, 0, 128, groups, prefill_tp=1, scales=scales)
    src, dst = list(range(10, 18)), list(range(20, 28))
    meta = request(meta_cls, prompt=1000, computed=0, remote=[src], local=[dst], block=128, pcp=1, dcp=1, tp=1)
    plan = w._get_kv_split_metadata("r", meta)
    assert plan[2][0][0] == [b * 8 + k for b in src for k in range(8)]  # the MLA group's list, scaled
    path = tmp_path / "scaled.safetensors"
    with Recorder(path, dcp_size=1, force=True) as rec:  # the MLA group as the recv thread reads it
        rec.record_transfer(mooncake_pull(step=0, rank=0, request="r", meta=meta, plan=plan, prefill=Side(),
                                          decode=Side(), block_size=128))
    found = replay(open_dumps([path]), "torch").findings
    assert len(found) == 1 and found[0].detail["kind"] == "block-ids", [f.message for f in found]
    assert "no table of the request holds" in found[0].message


def test_a_decode_side_with_dcp_from_an_unsharded_prefill_has_no_path():
    """vllm-ascend #16492 (a decode side with DCP receiving from an unsharded prefill): 0.23.0.post1's CP path
    requires the prefill's CP world to be a multiple of the decode's, and asserts."""
    w, meta_cls = worker(4, 1, 4, 1, 16, {0: group("mla", [0], 0)}, prefill_tp=4)
    meta = request(meta_cls, prompt=100, computed=0, remote=[list(range(7))], local=[list(range(2))], block=16,
                   pcp=1, dcp=1, tp=4)
    with pytest.raises(AssertionError):
        w._get_kv_split_metadata("r", meta)
