"""NIXL's pull planning, the installed release's own code on CPU (the transfer stubbed at `_read_blocks`), recorded
by the plugin and replayed: the decode workers' plans over DCP layouts on both sides (DCP 1-8 sizes that divide
one another, a prefill with PCP whose DCP group spans it, prefix-cache hits, prompts shorter than the CP world) are
clean on every release in the matrix; the region-mapped pull (a decoder laying out its cache groups otherwise, as
HiSparse does) shows vLLM #57389 on 0.30 and is clean from 0.31 on."""

import numpy as np
import pytest
import vllm
from engine import set_dcp
from nixl import Layout, request, worker

from dcptool.check.replay import replay
from dcptool.dump import open_dumps
from dcptool.engine import vllm as plugin

RELEASE = tuple(int(x) for x in vllm.__version__.split(".")[:2])
# (decode TP = DCP, prefill TP, prefill DCP, block): both sides fully sharded or replicated, sizes dividing one
# another (NIXL's DCP support: dcp_size in (1, tp_size) per side); interleave = the block size (vLLM sets it so)
LAYOUTS = [(4, 8, 8, 16), (4, 4, 4, 16), (2, 8, 8, 64), (8, 2, 2, 16), (4, 4, 1, 16), (1, 4, 4, 16), (2, 2, 2, 1),
           (8, 8, 8, 16)]


def plans(tmp_path, monkeypatch, layout, requests, *, regions=None, kernel_split=1):
    """Every decode worker plans every request (id, prompt tokens, prefix-hit blocks, padding blocks) with the
    release's code through the plugin; the dumps, one per worker."""
    d_dcp, p_tp, p_dcp, block = layout
    local = Layout(d_dcp, d_dcp, block // kernel_split, kernel_split)
    remote = Layout(p_tp, p_dcp, block // kernel_split, kernel_split)
    files = []
    for rank in range(d_dcp):
        monkeypatch.setenv(plugin.ENV_DIR, str(tmp_path))
        set_dcp(d_dcp, rank)
        kinds = ("mla",) * (1 if regions is None else len(regions))
        w = worker(local, remote, rank, kinds, local_regions=None if regions is None else regions[1],
                   remote_regions=None if regions is None else regions[0])
        w.vllm_config = type("C", (), {"parallel_config": type("P", (), {"cp_kv_cache_interleave_size": block})})
        for rid, L, hit, pad in requests:
            n_src = -(-L // (block * p_dcp)) + pad
            n_dst = -(-L // (block * d_dcp))
            hit = min(hit, n_dst)
            src = [list(range(1000 * (rid + 100 * g), 1000 * (rid + 100 * g) + n_src)) for g in range(len(kinds))]
            dst = [list(range(500_000 + 1000 * (rid + 100 * g) + hit, 500_000 + 1000 * (rid + 100 * g) + n_dst))
                   for g in range(len(kinds))]
            w._read_blocks_for_req(f"req-{rid}", request(w, src, dst, [hit] * len(kinds), L))
        files += plugin.close()
    set_dcp(1, 0)
    return files


def random_requests(rng, n=12):
    """(id, prompt tokens, prefix-cache hit in blocks, prefill padding blocks): awkward lengths."""
    return [(k, int(rng.choice([1, 3, 15, 16, 17, 100, 257, 1000, 4097])), int(rng.integers(0, 3)) * (k % 3 == 0), 0)
            for k in range(n)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "D{}-P{}x{}-B{}".format(*x))
def test_nixl_plans_replay_clean_on_every_release(layout, tmp_path, monkeypatch):
    files = plans(tmp_path, monkeypatch, layout, random_requests(np.random.default_rng(sum(layout))))
    res = replay(open_dumps(files), "torch")
    transfers = int((res.findings.d["obs.site"] == res.findings.d.config.sites.index("transfer")).sum()) if len(
        res.findings) else None
    assert [f.message for f in res.findings] == [], transfers
    d = open_dumps(files)
    assert int(np.diff(d["obs.xfer"]).sum()) == layout[0] * 12  # every worker, every request
    # each plan reads from the prefill workers that hold the decode rank's positions: several where the prefill
    # is sharded finer
    several = layout[2] > layout[0]
    per = np.diff(d["obs.xcopy"])[np.diff(d["obs.xfer"]) > 0]
    assert per.max() >= (2 if several else 1)


def test_nixl_plans_with_kernel_blocks_smaller_than_the_block(tmp_path, monkeypatch):
    """Logical blocks of 64 tokens in 16-token kernel blocks on the decode side (_logical_to_kernel_block_ids)."""
    files = plans(tmp_path, monkeypatch, (2, 2, 2, 64), random_requests(np.random.default_rng(5)), kernel_split=4)
    assert replay(open_dumps(files), "torch").findings == []


def test_region_mapped_pulls_show_vllm_57389_on_0_30(tmp_path, monkeypatch):
    """A decoder laying out its cache regions otherwise (HiSparse): 0.30 assumes one source rank (an assertion
    where a DCP prefill supplies several) and, with one, end-trims the prefill's list to the decode side's count,
    unbounded by the sequence: with a padding block on the prefill side it reads the wrong blocks. 0.31+ read per
    source rank, bounded by the prompt."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    if RELEASE < (0, 30):  # (nothing to show: the release has no region-mapped pulls)
        assert not hasattr(base_worker.NixlBaseConnectorWorker, "_block_ids_by_region")
        return
    reqs = [(k, L, 0, pad) for k, (L, pad) in enumerate([(100, 1), (257, 1), (64, 0), (1000, 2)])]
    regions = ([0, 1], [1, 0])  # the prefill's region -> group, the decode side's: the groups' layers swapped
    single = plans(tmp_path / "one", monkeypatch, (2, 2, 2, 16), reqs, regions=regions)
    found = replay(open_dumps(single), "torch").findings
    if RELEASE < (0, 31):
        # the requests with a padding block on the prefill side, on both decode ranks, each group
        kinds = {f.detail["kind"] for f in found}
        assert len(found) == 6 and kinds <= {"past-sequence", "block-ids", "wrong-source"}, [f.text for f in found]
    else:
        assert found == []
    if RELEASE < (0, 31):
        with pytest.raises(AssertionError):
            plans(tmp_path / "several", monkeypatch, (2, 4, 4, 16), reqs, regions=regions)
    else:
        several = plans(tmp_path / "several", monkeypatch, (2, 4, 4, 16), reqs, regions=regions)
        assert replay(open_dumps(several), "torch").findings == []
