"""dcp/kv_transfer.py: where each side keeps a request's KV and what a destination rank must receive, against the
definitions counted position by position, on seeded random layouts with awkward sizes (interleave 1 and the block
size, DCP 1-8, PCP 1-2, prefix-cache hits, sequences shorter than the CP world)."""

import numpy as np
import pytest
from transfer_cases import SEQ_LENS, account, random_groups, random_side, random_transfer

from dcptool.dcp.kv_transfer import (
    Layout,
    local_count,
    local_index,
    owner,
    plan,
    plan_transfer,
    position,
    shard_of,
    side_of,
)
from dcptool.dump.transfer import GroupPlan, Side


@pytest.mark.parametrize("W, I", [(1, 1), (2, 1), (3, 16), (8, 1), (8, 16), (5, 7), (16, 64)])
def test_position_and_local_index_are_inverse_and_counted_right(W, I):
    p = np.arange(4 * W * I + 5)
    sh, loc = owner(p, W, I), local_index(p, W, I)
    assert np.array_equal(position(loc, sh, W, I), p)
    for r in range(W):  # the rank's positions in order
        assert np.array_equal(loc[sh == r], np.arange((sh == r).sum()))
    for n in (0, 1, W - 1, W * I, W * I + 1, 4 * W * I + 5):  # sequences shorter than the CP world too
        assert local_count(n, np.arange(W), W, I).tolist() == [int((sh[:n] == r).sum()) for r in range(W)]
    assert local_count(7, 0, W, I, sharded=False) == 7


def test_a_worker_holds_its_cp_shard_or_its_dcp_shard():
    w = np.arange(8)  # PCP 2 x DCP 4: worker pcp_rank * 4 + dcp_rank
    assert shard_of(w, 4, True).tolist() == list(range(8))
    assert shard_of(w, 4, False).tolist() == [0, 1, 2, 3] * 2
    assert Layout.of(2, 4, 16, True) == (8, 16, True) and Layout.of(2, 4, 16, False) == (4, 16, True)


@pytest.mark.parametrize("seed", range(40))
def test_the_plan_is_every_needed_position_once_from_its_holder(seed):
    """plan() against the definition, position by position: the destination shard's positions below L, from its
    table's first block, in the window; each from the source shard holding it, at its slot."""
    rng = np.random.default_rng(seed)
    block = int(rng.choice([16, 64]))
    src, dst = random_side(rng, block), random_side(rng, block)
    L = int(rng.choice(SEQ_LENS))
    for grp in random_groups(rng, L, src, dst):
        if grp.kind == "mamba":
            continue
        s, d = side_of(src, grp, True), side_of(dst, grp, False)
        d_shard = int(rng.integers(0, d.layout.world))
        got = plan(L, d_shard, s, d, grp.window)
        want = [p for p in range(L) if (not d.layout.sharded or owner(p, d.layout.world, d.layout.interleave)
                                         == d_shard) and p >= L - (grp.window or L)]
        dl = [int(local_index(p, d.layout.world, d.layout.interleave)) if d.layout.sharded else p for p in want]
        want = [p for p, lc in zip(want, dl) if lc >= d.first * d.block]
        assert got.position.tolist() == want
        for k, p in enumerate(want):
            if s.layout.sharded:
                assert got.src_shard[k] == owner(p, s.layout.world, s.layout.interleave)
                ls = local_index(p, s.layout.world, s.layout.interleave)
            else:
                ls = p
            idx = ls // s.block - s.first
            ratio = s.block // s.kernel
            assert got.src_block_id[k] == (s.table[idx] * ratio + (ls % s.block) // s.kernel if idx < s.table.size
                                           else -1)
            assert got.src_offset[k] == ls % s.kernel


@pytest.mark.parametrize("seed", range(200))
def test_the_reference_plan_is_clean_slot_by_slot(seed):
    """plan_transfer's copies, counted one slot at a time in plain Python: nothing wrong, nothing missing."""
    t = random_transfer(np.random.default_rng(seed))
    assert account(t) == {}, t


def test_docs_dcp_example_decode_dcp4_from_pcp2_dcp2_with_cp_shards():
    """docs/dcp.md "KV transfers": decode rank 1 reads from shard 1 (PCP rank 0, DCP rank 1), rank 3 from shard 3."""
    src, dst = Side(tp=1, pcp=2, dcp=2, interleave=16, cp_shards=True), Side(tp=4, dcp=4, interleave=16)
    grp = GroupPlan("mla", np.arange(100, 104), np.arange(200, 204), 16, 16)
    for rank, worker in ((1, 1), (3, 3)):
        c = plan_transfer(256, rank, src, dst, [grp])
        assert set(c[:, 1].tolist()) == {worker}
        assert c[:, 2].tolist() == [100, 101, 102, 103] and c[:, 6].tolist() == [16] * 4
    first = plan(256, 1, side_of(src, grp, True), side_of(dst, grp, False)).position[:3].tolist()
    assert first == [16, 17, 18]
