"""slot_pass.py: the slot entries' layout helpers, vLLM's offset, and the one pass (its findings and the members
slot-partition reads) against the rules checked one at a time."""

import numpy as np
import pytest
from conftest import write
from test_slots import KV2, random_slot_dump, slot_batch

from dcptool.check import slot_pass as P
from dcptool.dump import open_dumps
from dcptool.dump.schema import KVGroup


@pytest.mark.parametrize("N,I_,B", [(1, 1, 16), (2, 1, 16), (4, 16, 64), (8, 4, 32), (3, 2, 6)])
def test_want_offset_arrays_and_ints_are_vllms(N, I_, B):
    """The sharded offset (p % (B*N)) // (I*N) * I + p % I, the replicated p % B; every rank's block of B*N
    positions puts each of its positions at a distinct offset."""
    p = np.arange(0, 5 * B * N + 129, dtype=np.int64)
    got = P.want_offset(p, B, True, N, I_)
    assert np.array_equal(got, (p % (B * N)) // (I_ * N) * I_ + p % I_)
    assert np.array_equal(P.want_offset(p, B, False, N, I_), p % B)
    assert [int(P.want_offset(int(x), B, True, N, I_)) for x in p[:200]] == got[:200].tolist()
    owner = (p // I_) % N
    for r in range(N):
        block = got[(owner == r) & (p < B * N)]
        assert np.unique(block).size == block.size and ((0 <= block) & (block < B)).all()


def test_slot_runs_put_entries_in_observation_group_order():
    """The Recorder's layout (groups ascending in each observation) is kept as is; another is sorted, stably."""
    grp = np.array([0, 0, 1, 1, 0, 1], np.int32)
    cnt = np.array([4, 2])
    order, g, start = P.slot_runs(grp, cnt)
    assert order is None and g.tolist() == grp.tolist() and start.tolist() == [0, 2, 4, 5]
    grp = np.array([1, 0, 1, 0, 0, 1], np.int32)
    order, g, start = P.slot_runs(grp, np.array([4, 2]))
    assert order.tolist() == [1, 3, 0, 2, 4, 5] and g.tolist() == [0, 0, 1, 1, 0, 1] and start.tolist() == [0, 2, 4, 5]
    order, g, start = P.slot_runs(np.zeros(0, np.int32), np.zeros(0, np.int64))
    assert order is None and start.size == 0


def test_real_tokens_and_group_tables(tmp_path):
    o = slot_batch(0, [3, 1, 4], [10, 26, 0], 2, 1, ntp=10)
    write(tmp_path / "s.safetensors", o, dcp=2, il=1, kv_groups=tuple(KVGroup.of(g) for g in KV2))
    d = open_dumps([str(tmp_path / "s.safetensors")])
    assert P.real_tokens(d).tolist() == [8, 8]  # qsl[num_reqs]; 2 padded tokens
    sharded, block = P.group_tables(d, np.array([0, 1, 1]))
    assert sharded.tolist() == [True, False, False] and block.tolist() == [16, 16, 16]
    assert P.group_name(d, 1) == "1 (mamba)" and P.group_name(d, 7) == "7"


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("chunk", [1, 129, 1 << 18])
def test_one_pass_gives_the_slots_findings_and_the_members(tmp_path, monkeypatch, threads, chunk):
    """slot_pass in any chunking and on any threads: the findings of check_slots, and members that make
    check_slot_partition find what it finds from its own pass."""
    from dcptool.check.slots import check_slot_partition, check_slots

    d = random_slot_dump(tmp_path / "r.safetensors", np.random.default_rng(5), 60, 4, 2)
    want = check_slots(d), check_slot_partition(d)
    assert len(want[0]) and len(want[1])
    monkeypatch.setattr(P, "SLOT_CHUNK", chunk)
    monkeypatch.setattr(P, "SLOT_CHUNK_THREADED", chunk)
    found, members = P.slot_pass(d, threads=threads)
    assert found == want[0] and check_slot_partition(d, members) == want[1]
    assert members.obs.size and (np.diff(members.obs) >= 0).all()
    assert P.slot_pass(d, members=False)[1] is None


def test_a_clean_dump_and_an_empty_one_have_no_findings(tmp_path):
    o = []
    for step in range(3):
        o += slot_batch(step, [40, 1, 90], [step * 7, 300, 1000], 4, 1, ntp=135)
    write(tmp_path / "c.safetensors", o, dcp=4, il=1, kv_groups=tuple(KVGroup.of(g) for g in KV2))
    d = open_dumps([str(tmp_path / "c.safetensors")])
    found, members = P.slot_pass(d)
    assert found == [] and members.quiet.all() and members.writes.all()
    e = slot_batch(0, [], [], 2, 1, ntp=0)
    write(tmp_path / "e.safetensors", e, dcp=2, il=1, kv_groups=tuple(KVGroup.of(g) for g in KV2))
    assert P.slot_pass(open_dumps([str(tmp_path / "e.safetensors")])) == ([], None)
