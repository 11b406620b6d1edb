"""check/transfers.py: the `transfer` rule. Right plans on seeded random layouts replay clean; each way a connector
goes wrong is named by its kind, and every kind's count equals the per-slot Python account (tests/transfer_cases.py);
a keyed store of one shard is a partial store; chunked, merged and lazily merged dumps judge alike."""

import numpy as np
import pytest
from transfer_cases import PERTURB, account, random_transfer, world

from dcptool import Recorder
from dcptool.check import transfers
from dcptool.check.replay import replay
from dcptool.dcp.kv_transfer import KINDS, plan_transfer
from dcptool.dump import open_dumps
from dcptool.dump.transfer import GroupPlan, Side

MLA = GroupPlan("mla", [5, 6], [7, 8], 16, 16)


def record(path, transfers_, dcp=8):
    with Recorder(path, dcp_size=dcp) as rec:
        for k, t in enumerate(transfers_):
            assert rec.transfer(step=k, rank=k % dcp, **t) >= 0
    return str(path)


def counts(path) -> list[dict]:
    """Each transfer's kinds as the vectorised check counts them (in recording order)."""
    _, v = transfers.judge(open_dumps([path]))
    return [{KINDS[k]: int(n) for k, n in enumerate(row) if n} for row in v.count]


def test_right_plans_on_random_layouts_replay_clean(tmp_path):
    rng = np.random.default_rng(7)
    ts = [random_transfer(rng) for _ in range(300)]
    res = replay(open_dumps([record(tmp_path / "ok.safetensors", ts)]), "torch")
    assert len(res.findings) == 0 and "transfer" not in res.skipped


@pytest.mark.parametrize("kind", sorted(PERTURB))
def test_each_perturbation_is_found_and_counted_as_the_slot_account_counts(tmp_path, kind):
    """The vectorised counts equal the per-slot Python account on every perturbed plan (many kinds at once where a
    perturbation causes several), and the perturbation's own kind is among them."""
    rng = np.random.default_rng(hash(kind) % 1000)
    ts = []
    while len(ts) < 60:
        t = PERTURB[kind](random_transfer(rng), rng)
        if t is not None:
            ts.append(t)
    got = counts(record(tmp_path / "bad.safetensors", ts))
    want = [dict(account(t)) for t in ts]
    assert got == want
    # its kind is found on (nearly) every plan: a slot read from the wrong worker may lie past the sequence there
    also = {"wrong-source": {"past-sequence"}}.get(kind, set())
    assert sum(bool(({kind} | also) & set(w)) for w in want) >= 0.9 * len(ts), kind


def test_a_mixed_random_dump_counts_as_the_account_counts(tmp_path):
    rng = np.random.default_rng(11)
    ts = []
    for _ in range(200):
        t = random_transfer(rng)
        for f in PERTURB.values():
            if rng.random() < 0.3:
                t = f(t, rng) or t
        ts.append(t)
    assert counts(record(tmp_path / "mixed.safetensors", ts)) == [dict(account(t)) for t in ts]


def test_chunks_merged_and_lazy_dumps_judge_alike(tmp_path, monkeypatch):
    rng = np.random.default_rng(3)
    ts = [PERTURB["never"](random_transfer(rng), rng) or random_transfer(rng) for _ in range(40)]
    a, b = record(tmp_path / "a.safetensors", ts[:20]), record(tmp_path / "b.safetensors", ts[20:])
    whole = replay(open_dumps([a, b]), "torch").findings
    monkeypatch.setattr(transfers, "SLOTS_CHUNK", 7)
    for d in (open_dumps([a, b]), open_dumps([a, b], bounded=True)):
        got = replay(d, "torch").findings
        assert [(f.obs, f.file, f.text) for f in got] == [(f.obs, f.file, f.text) for f in whole]


# ---- each bug's shape, by hand


def one(tmp_path, **kw):
    path = tmp_path / "one.safetensors"
    with Recorder(path, dcp_size=4, force=True) as rec:
        assert rec.transfer(step=0, rank=kw.pop("rank", 1), **kw) >= 0
    res = replay(open_dumps([str(path)]), "torch")
    return res, [dict(f.detail) for f in res.findings]


def test_matching_shards_by_dcp_rank_alone_reads_another_pcp_shard(tmp_path):
    """vLLM #38433's review: the prefill side's PCP ranks hold distinct shards (CP world 4); decode rank 3 of DCP 4
    stepping by dcp_size reads the blocks of PCP rank 0's DCP rank 1 (shard 1) instead of shard 3's."""
    src, dst = Side(tp=1, pcp=2, dcp=2, interleave=16, cp_shards=True), Side(tp=4, dcp=4, interleave=16)
    grp = GroupPlan("mla", [100, 101], [200, 201], 16, 16)
    right = plan_transfer(100, 3, src, dst, [grp])
    assert set(right[:, 1]) == {3}
    res, det = one(tmp_path, rank=3, request=1, src=src, dst=dst, groups=[grp], seq_len=100,
                   copies=np.where(np.arange(7) == 1, 1, right))
    assert det[0]["kind"] == "wrong-source" and det[0]["kinds"] == {"wrong-source": 16, "never": 16}
    assert res.problems[0].label == "transfer/wrong-source"
    assert "read from source worker 1, whose shard does not hold it" in res.findings[0].text


def test_a_keyed_store_of_rank_0s_shard_claiming_the_request_is_a_partial_store(tmp_path):
    """LMCache #4030: rank 0 alone stores its DCP shard under the full request's key (the key claims an unsharded
    layout); every shard storing its own piece under its own key is clean."""
    eng = Side(tp=4, dcp=4, interleave=1)
    ids = [10, 11, 12]
    grp = GroupPlan("mla", ids, ids, 16, 16)
    bad = plan_transfer(100, 0, eng, eng, [grp])  # rank 0's blocks, stored slot for slot
    res, det = one(tmp_path, rank=0, request=5, src=eng, dst=Side(), groups=[grp], seq_len=100, copies=bad,
                   store=True)
    assert det[0]["kind"] == "partial-store" and res.problems[0].label == "transfer/partial-store"
    assert "holds 1 of them: a partial shard stored as the whole request" in res.findings[0].text
    fine = tmp_path / "fine.safetensors"
    with Recorder(fine, dcp_size=4) as rec:
        for r in range(4):
            rec.transfer(step=0, rank=r, request=5, src=eng, dst=eng, dst_rank=r, groups=[grp], seq_len=100,
                         copies=plan_transfer(100, r, eng, eng, [grp]), store=True)
    assert len(replay(open_dumps([str(fine)]), "torch").findings) == 0


def test_a_decode_rank_reading_an_unsharded_prefill_by_its_own_block_index_gets_positions_it_does_not_own(tmp_path):
    """vllm-ascend #16492: decode DCP 4 (interleave = block size) receiving from an unsharded prefill pairs its local
    block j with the prefill's block j, as if the prefill were sharded like itself."""
    src, dst = Side(tp=1), Side(tp=4, dcp=4, interleave=16)
    grp = GroupPlan("mla", np.arange(100, 107), np.arange(200, 202), 16, 16)
    wrong = np.array([[0, 0, 100, 0, 200, 0, 16], [0, 0, 101, 0, 201, 0, 16]])
    res, det = one(tmp_path, rank=1, request=2, src=src, dst=dst, groups=[grp], seq_len=100, copies=wrong)
    assert det[0]["kind"] == "not-owner" and res.problems[0].label == "transfer/not-owner"
    right = plan_transfer(100, 1, src, dst, [grp])
    assert right[:, 2].tolist() == [101, 105]
    assert one(tmp_path, rank=1, request=2, src=src, dst=dst, groups=[grp], seq_len=100, copies=right)[1] == []


def test_ids_scaled_by_another_groups_kernel_ratio_name_no_block_of_the_request(tmp_path):
    """vllm-ascend #13965: the MLA group's block ids expanded by the sparse indexer's scale (8)."""
    src = dst = Side(tp=4, dcp=4)
    grp = GroupPlan("mla", [3, 4], [5, 6], 16, 16)
    c = plan_transfer(100, 1, src, dst, [grp])
    c[:, 2] *= 8
    res, det = one(tmp_path, request=3, src=src, dst=dst, groups=[grp], seq_len=100, copies=c)
    assert det[0]["kind"] == "block-ids" and det[0]["kinds"] == {"block-ids": 25, "never": 25}
    assert "reads source block 24, which no table of the request holds" in res.findings[0].text


def test_reading_every_block_from_one_source_worker_and_its_padding(tmp_path):
    """vLLM #57389: a DCP-8 prefill supplies decode rank 1 of DCP 4 from workers 1 and 5; the region path read every
    block from the first source worker, end-trimmed, including its allocation padding past the sequence."""
    src, dst = Side(tp=8, dcp=8, interleave=16), Side(tp=4, dcp=4, interleave=16)
    grp = GroupPlan("mla", [50, 51, 52], [60, 61, 62], 16, 16)
    right = plan_transfer(200, 1, src, dst, [grp])
    assert right[:, 1].tolist() == [1, 5, 1] and right[:, 2].tolist() == [50, 50, 51]
    one_source = right.copy()
    one_source[:, 1] = 1
    one_source[:, 2] = [50, 51, 52]  # its list end-trimmed to the decode side's length: block 52 is padding
    res, det = one(tmp_path, request=4, src=src, dst=dst, groups=[grp], seq_len=200, copies=one_source)
    assert det[0]["kind"] == "wrong-source" and set(det[0]["kinds"]) == {"wrong-source", "past-sequence", "never"}


def test_a_sequence_length_unknown_checks_placement_only(tmp_path):
    src = dst = Side(tp=2, dcp=2)
    c = plan_transfer(40, 1, src, dst, [MLA])
    # (what was not moved cannot be counted without the length: a partial plan placed right is clean)
    assert one(tmp_path, request=1, src=src, dst=dst, groups=[MLA], seq_len=-1, copies=c[:1])[1] == []
    c[:, 1] = 0
    assert one(tmp_path, request=1, src=src, dst=dst, groups=[MLA], seq_len=-1, copies=c)[1][0]["kind"] == \
        "wrong-source"


def test_copies_naming_a_group_the_transfer_lacks_or_running_past_a_block(tmp_path):
    src = dst = Side(tp=2, dcp=2)
    c = plan_transfer(40, 1, src, dst, [MLA])
    for bad, why in (((0, 3), "names a KV-cache group the transfer does not have"), ((3, 9), "runs past its kernel")):
        x = c.copy()
        x[0, bad[0]] = bad[1]
        res, det = one(tmp_path, request=1, src=src, dst=dst, groups=[MLA], seq_len=40, copies=x)
        assert "block-ids" in det[0]["kinds"] and why in res.findings[0].text
    assert world(Side(pcp=2, dcp=3, cp_shards=True)) == 6
    res, det = one(tmp_path, request=1, src=src, dst=dst, groups=[], seq_len=40, copies=c)  # (no group at all)
    assert det[0]["kinds"] == {"block-ids": int(c[:, 6].sum())} and "does not have" in res.findings[0].text


def test_a_block_of_another_group_is_named_as_such(tmp_path):
    src = dst = Side(tp=2, dcp=2)
    groups = [MLA, GroupPlan("mla", [15, 16], [17, 18], 16, 16)]
    c = plan_transfer(40, 1, src, dst, groups)
    c[0, 2] = 15  # group 0's copy reads group 1's block
    res, det = one(tmp_path, request=1, src=src, dst=dst, groups=groups, seq_len=40, copies=c)
    assert "reads source block 15, which is in another group's table" in res.findings[0].text
