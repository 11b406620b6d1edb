"""pair.py: the disaggregated pair. Without a fault every transfer replays clean, whatever the two sides' layouts; each
transfer fault reproduces on a decode side with DCP 4 and full CUDA graphs, with or without PCP 2, micro-batches, MTP
or DFlash, and replay finds it exactly at the transfers it touched and nowhere else; the decode side's workload is
the same with or without the pair."""

import numpy as np
import pytest
from simulate_cases import PAIR, config_of, run, verify

from dcptool.dcp.kv_transfer import plan_transfer
from dcptool.dump.transfer import GroupPlan, Side
from dcptool.model.config import TRANSFER_FAULTS, SimConfig, SimError
from dcptool.model.pair import slot_map

# the decode side: DCP 4, full graphs; PCP 1 or 2, micro-batches 1 or 2, MTP or DFlash (N, I, P, K, U, graphs, method)
DECODE = [(4, 16, 1, 2, 2, "full", "mtp"), (4, 16, 2, 2, 1, "full", "mtp"), (4, 1, 2, 3, 2, "full", "mtp"),
          (4, 16, 1, 3, 2, "full", "dflash"), (4, 1, 1, 0, 1, "full", "mtp")]


@pytest.mark.parametrize("fault", TRANSFER_FAULTS)
@pytest.mark.parametrize("row", DECODE, ids=lambda r: "I{1}-P{2}-K{3}-U{4}-{6}".format(*r))
def test_each_transfer_fault_is_found_exactly_where_it_touched(fault, row, tmp_path):
    cfg = config_of(row, 17, inject=(fault,), steps=12, **PAIR[fault])
    res, d, rr = run(cfg, tmp_path)
    rep = res.faults[fault]
    if fault == "mooncake-group-scale" and (row[6] != "mtp" or row[3] == 0):  # (the bug needs MTP)
        assert not rep.applicable and "MTP" in rep.why
        return
    assert rep.applicable and rep.count > 0, fault
    verify(res, d, rr)
    assert set(rr.by_rule()) == {"transfer"} and d.site_name(int(np.flatnonzero(d[
        "obs.site"] == d.config.sites.index("transfer"))[0])) == "transfer"


@pytest.mark.parametrize("seed", range(6))
def test_the_pair_replays_clean_on_random_layouts(seed, tmp_path):
    rng = np.random.default_rng(seed)
    N = int(rng.choice([1, 2, 3, 4, 8]))
    I_ = int(rng.choice([1, 16]))
    pd = int(rng.integers(1, 9))
    kw = dict(kv_connector=str(rng.choice(["nixl", "mooncake", "lmcache"])))
    if kw["kv_connector"] != "lmcache":
        kw |= dict(prefill_dcp=pd, prefill_pcp=int(rng.integers(1, 3)), prefill_interleave=int(rng.choice([1, 16])),
                   prefill_block_size=int(rng.choice([16, 64])), prefill_kv_shards=str(rng.choice(["dcp", "cp"])))
    row = (N, I_, int(rng.integers(1, 3)), 2, 2, "full", "mtp")
    steps = 40 if kw["kv_connector"] == "lmcache" else 10  # (a store needs a request to finish)
    res, d, rr = run(config_of(row, seed, steps=steps, **kw), tmp_path)
    assert rr.findings == [], [f.message for f in rr.findings[:3]]
    assert res.by_site.get("transfer", 0) > 0


def test_the_decode_side_is_the_same_with_or_without_the_pair(tmp_path):
    row = (4, 16, 2, 2, 2, "full", "mtp")
    _, plain, _ = run(config_of(row, 5), tmp_path, "plain.safetensors")
    _, pair, _ = run(config_of(row, 5, kv_connector="nixl", prefill_dcp=8), tmp_path, "pair.safetensors")
    keep = pair["obs.site"] != pair.config.sites.index("transfer")
    assert plain.n == int(keep.sum()) and pair.config.sites[: len(plain.config.sites)] == plain.config.sites
    for key in ("obs.step", "obs.rank", "obs.num_reqs", "obs.site"):
        assert np.array_equal(plain[key], pair[key][keep]), key


@pytest.mark.parametrize("bad, why", [
    (dict(prefill_dcp=2), "--prefill-dcp: a prefill instance needs --kv-connector nixl or mooncake"),
    (dict(kv_connector="lmcache", prefill_pcp=2), "--prefill-pcp: a prefill instance needs"),
    (dict(kv_connector="rdma"), "--kv-connector: 'rdma': choose none, nixl, mooncake or lmcache"),
    (dict(kv_connector="nixl", prefill_kv_shards="tp"), "--prefill-kv-shards: 'tp': choose dcp or cp"),
    (dict(kv_connector="nixl", prefill_block_size=24, prefill_interleave=16), "--prefill-block-size: 24 must be"),
])
def test_a_pair_simulate_cannot_run_is_refused_in_one_line(bad, why):
    with pytest.raises(SimError, match=why):
        SimConfig(**bad).validate()


def test_a_plan_written_another_way_moving_the_same_slots_touches_nothing():
    """The ground truth compares what plans move, not how they are written: whole blocks split in two runs are the
    same plan; a slot from another shard is not."""
    src = dst = Side(tp=2, dcp=2)
    grp = [GroupPlan("mla", [5, 6], [7, 8], 16, 16)]
    a = plan_transfer(40, 1, src, dst, grp)
    b = np.concatenate([np.array([[0, 1, 5, 0, 7, 0, 8], [0, 1, 5, 8, 7, 8, 8]]), a[1:]])
    assert np.array_equal(slot_map(a, 40, 1, src, dst, grp), slot_map(b, 40, 1, src, dst, grp))
    c = a.copy()
    c[0, 1] = 0
    assert not np.array_equal(slot_map(a, 40, 1, src, dst, grp), slot_map(c, 40, 1, src, dst, grp))
