"""rules.py: DESIGN §3's rules on hand-built dumps, each triggered, each quiet, and precedence; the table itself."""

import numpy as np
import pytest
from conftest import expected_view, obs, write

from dcptool.dump import open_dumps
from dcptool.replay import replay
from dcptool.rules import RULE_CODES, RULES, TABLE, Finding
from dcptool.schema import KVGroup
from dcptool.slicing import split_batch

BACKENDS = ["torch", "triton"]

def run(tmp_path, observations, backend="torch", **cfg):
    return replay(open_dumps([write(tmp_path / "d.safetensors", observations, **cfg)]), backend)


def rules(res):
    return [(f.obs, f.rule) for f in res.findings]


@pytest.mark.parametrize("backend", BACKENDS)
def test_clean_dump_has_no_findings(tmp_path, backend, rng):
    o = []
    for step in range(6):
        for rank in range(4):
            nr = int(rng.integers(0, 9))
            seq = np.zeros(nr + 3, np.int32)
            seq[:nr] = rng.integers(1, 5000, nr)
            o.append(obs(step=step, rank=rank, seq=seq, num_reqs=nr, num_reqs_padded=nr + 3, dcp=4, il=16))
    res = run(tmp_path, o, backend, dcp=4, il=16)
    assert res.findings == [] and res.errors == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_missing_then_padding_in_order(tmp_path, backend):
    o = [obs(step=i) for i in range(7)]
    o[3] = obs(step=3, view=None)
    o[5] = obs(step=5, view=[9, 13, 0, -1])
    res = run(tmp_path, o, backend)
    assert rules(res) == [(3, "missing"), (5, "padding")]
    pad = res.findings[1]
    assert (pad.row, pad.recorded, pad.expected, pad.wrong_rows) == (3, -1, 0, 1)
    assert res.summary_json()["first"]["rule"] == "missing"


def test_none_is_fine_and_a_view_is_stray_with_dcp_1(tmp_path):
    res = run(tmp_path, [obs(dcp=1, view=None), obs(step=1, dcp=1, view=[17, 25, 0, 0])], dcp=1)
    assert rules(res) == [(1, "stray")]
    assert res.findings[0].severity == "warning" and res.errors == 0 and res.warnings == 1


def test_shape_short_and_long_views(tmp_path):
    o = [obs(view=[9, 13]), obs(step=1, view=[9, 13, 0, 0, 0]), obs(step=2)]
    res = run(tmp_path, o)
    assert rules(res) == [(0, "shape"), (1, "shape")]
    assert res.findings[0].detail == {"length": 2, "expected_length": 4}


def test_mismatch_names_first_wrong_row_and_count(tmp_path):
    res = run(tmp_path, [obs(seq=(100, 200, 300, 0), num_reqs=3, view=[50, 101, 149, 0])])
    (f,) = res.findings
    assert (f.rule, f.row, f.recorded, f.expected, f.wrong_rows) == ("mismatch", 1, 101, 100, 2)


def worked_example(copy_parent_rows: bool, rank: int = 0):
    """DESIGN §1: query lens [1,1,10,1,1], seq_lens [64,96,512,32,48], K=2, N=2, I=1."""
    q = np.array([0, 1, 2, 12, 13, 14], np.int32)
    seq = np.array([64, 96, 512, 32, 48], np.int32)
    parent = obs(step=3, rank=rank, seq=seq, num_reqs=5, num_reqs_padded=5, query_start_loc=q)
    out = [parent]
    for u, ub in enumerate(split_batch(q, seq, 5, 5, None, 2)):
        sl = ub.slice
        view = (parent.dcp_local_seq_lens[sl.req_start:sl.req_stop] if copy_parent_rows
                else expected_view(ub.seq_lens, ub.num_reqs, ub.num_reqs_padded, 2, rank))
        out.append(obs(step=3, rank=rank, site="ubatch", ubatch=u, seq=ub.seq_lens, num_reqs=ub.num_reqs,
                       num_reqs_padded=ub.num_reqs_padded, view=view, parent=0, req_start=sl.req_start,
                       tok_start=sl.tok_start, tok_stop=sl.tok_stop, query_start_loc=ub.query_start_loc))
    return out


@pytest.mark.parametrize("rank,expected", [(0, 254), (1, 253)])
def test_worked_example_parent_rows_is_stale(tmp_path, rank, expected):
    o = worked_example(True, rank)
    assert o[1].seq_lens.tolist() == [64, 96, 507] and o[2].seq_lens.tolist() == [512, 32, 48]
    res = run(tmp_path, o)
    (f,) = res.findings
    assert (f.obs, f.rule, f.row, f.recorded, f.expected) == (1, "stale", 2, 256, expected)
    assert f.source.obs == 0 and f.source.relation == "parent-rows" and f.source.site == "attn_metadata"
    assert f.to_json()["source"]["relation"] == "parent-rows"


def test_worked_example_recomputed_is_clean(tmp_path):
    assert run(tmp_path, worked_example(False)).findings == []


def test_ubatch_slice_catches_an_untruncated_last_row(tmp_path):
    o = worked_example(False)
    o[1].seq_lens = np.array([64, 96, 512], np.int32)  # not reduced by the 5 tokens after the micro-batch
    o[1].dcp_local_seq_lens = expected_view(o[1].seq_lens, 3, 3, 2, 0)
    res = run(tmp_path, o)
    assert ("ubatch-slice" in [f.rule for f in res.findings])
    f = next(f for f in res.findings if f.rule == "ubatch-slice")
    assert (f.obs, f.detail["field"], f.row, f.recorded, f.expected) == (1, "seq_lens", 2, 512, 507)


def pcp_dump(stale: bool):
    """PCP 2: the global batch (1 decode + 1 prefill of 8), then rank 0's local batch."""
    g_seq = np.array([17, 40, 0, 0], np.int32)  # decode with 16 computed; prefill 32 computed + 8 new
    glob = obs(step=1, site="prepare_inputs", seq=g_seq, num_reqs=2, num_reqs_padded=4)
    # local rank 0: decode replicated [17]; prefill chunks 0 and 3 of 2 tokens: ends at 34 and 40
    l_seq = np.array([17, 34, 40, 0, 0, 0], np.int32)
    view = glob.dcp_local_seq_lens if stale else "auto"
    local = obs(step=1, site="pcp_partition", seq=l_seq, num_reqs=3, num_reqs_padded=6, view=view)
    return [obs(step=0), glob, local]


def test_pcp_local_batch_with_the_global_view_is_stale_earlier_in_step(tmp_path):
    res = run(tmp_path, pcp_dump(True))
    assert rules(res) == [(2, "stale"), (2, "shape")]
    f = res.findings[0]
    assert f.source.relation == "earlier-in-step" and f.source.obs == 1 and f.source.site == "prepare_inputs"
    assert run(tmp_path, pcp_dump(False)).findings == []


def test_global_wrong_rank_wrong_interleave(tmp_path):
    seq = np.array([1000, 77, 35, 0], np.int32)
    o = [obs(step=0, seq=seq, num_reqs=3, view=[1000, 77, 35, 0]),
         obs(step=1, seq=seq, num_reqs=3, view=expected_view(seq, 3, 4, 2, 1)),
         obs(step=2, seq=seq, num_reqs=3, view=expected_view(seq, 3, 4, 2, 0, il=16))]
    res = run(tmp_path, o)
    assert rules(res) == [(0, "global"), (1, "wrong-rank"), (2, "wrong-interleave")]
    assert res.findings[1].detail == {"rank": 1} and res.findings[2].detail == {"interleave": 16}


def test_wrong_interleave_tries_page_size(tmp_path):
    seq = np.array([1000, 77, 35, 0], np.int32)
    res = run(tmp_path, [obs(seq=seq, num_reqs=3, view=expected_view(seq, 3, 4, 2, 0, il=48))], page_size=48)
    assert res.findings[0].detail == {"interleave": 48}


def test_earlier_step_names_the_most_recent_source(tmp_path):
    a, b = np.array([300, 301, 0], np.int32), np.array([500, 9, 0], np.int32)
    o = [obs(step=0, seq=a, num_reqs=2, num_reqs_padded=3), obs(step=1, seq=b, num_reqs=2, num_reqs_padded=3),
         obs(step=2, seq=a, num_reqs=2, num_reqs_padded=3),
         obs(step=3, seq=b, num_reqs=2, num_reqs_padded=3, view=expected_view(a, 2, 3, 2, 0))]
    (f,) = run(tmp_path, o).findings
    assert f.rule == "stale" and f.source.relation == "earlier-step" and f.source.obs == 2 and f.source.step == 2


def test_precedence_parent_rows_before_earlier_in_step(tmp_path):
    o = worked_example(True)
    # an earlier observation of the same step whose expected rows equal the copied parent rows
    o.insert(0, obs(step=3, site="prepare_inputs", seq=[64, 96, 512], num_reqs=3, num_reqs_padded=3))
    for x in o[2:]:
        x.parent = 1
    (f,) = run(tmp_path, o).findings
    assert f.source.relation == "parent-rows"


def test_precedence_global_before_wrong_rank(tmp_path):
    # rank 1, L = 1: global [1] and rank 0's [1] both hold; global comes first
    (f,) = run(tmp_path, [obs(rank=1, seq=[1, 0], num_reqs=1, num_reqs_padded=2, view=[1, 0])]).findings
    assert f.rule == "global"


def test_precedence_earlier_in_step_before_global(tmp_path):
    seq = np.array([8, 8, 0], np.int32)
    o = [obs(step=0, site="a", seq=[16, 16, 0], num_reqs=2, num_reqs_padded=3),
         obs(step=0, site="b", seq=seq, num_reqs=2, num_reqs_padded=3, view=[8, 8, 0])]
    (f,) = run(tmp_path, o).findings
    assert (f.rule, f.source.relation) == ("stale", "earlier-in-step")


def test_stale_source_must_be_the_same_rank(tmp_path):
    seq = np.array([17, 17, 0], np.int32)  # rank 0 must hold [9, 9]
    o = [obs(step=0, rank=1, site="a", seq=[17, 17, 0], num_reqs=2, num_reqs_padded=3),  # rank 1: [8, 8]
         obs(step=0, rank=0, site="b", seq=seq, num_reqs=2, num_reqs_padded=3, view=[8, 8, 0])]
    (f,) = run(tmp_path, o).findings
    assert f.rule == "wrong-rank"  # rank 1's rows of this very batch, not stale from rank 1's other batch


def test_rank_sum_at_the_observation_completing_the_set(tmp_path):
    seq = np.array([101, 7, 0], np.int32)
    o = [obs(rank=r, seq=seq, num_reqs=2, num_reqs_padded=3, dcp=4) for r in range(4)]
    assert run(tmp_path, o, dcp=4).findings == []
    o[1].dcp_local_seq_lens = np.array([30, 2, 0], np.int32)  # 25 expected
    res = run(tmp_path, o, dcp=4)
    assert rules(res) == [(1, "mismatch"), (3, "rank-sum")]
    rs = res.findings[1]
    assert (rs.row, rs.recorded, rs.expected) == (0, 106, 101)
    assert rs.detail == {"obs": [0, 1, 2, 3]}


def test_rank_sum_needs_all_ranks(tmp_path):
    seq = np.array([101, 7, 0], np.int32)
    o = [obs(rank=r, seq=seq, num_reqs=2, num_reqs_padded=3, dcp=4) for r in range(3)]
    o[1].dcp_local_seq_lens = np.array([30, 2, 0], np.int32)
    assert rules(run(tmp_path, o, dcp=4)) == [(1, "mismatch")]


def test_alias_between_micro_batches_and_between_capture_and_replay(tmp_path):
    o = worked_example(False)
    o[1].buffer, o[2].buffer = 0x1000, 0x1000
    res = run(tmp_path, o)
    assert rules(res) == [(2, "alias")]
    o[2].buffer = 0x2000
    assert run(tmp_path, o).findings == []
    cap = [obs(step=-1, site="capture", graph=2, buffer=0xA0), obs(step=1, graph=3, buffer=0xA0),
           obs(step=2, graph=3, buffer=0xB0), obs(step=3, graph=3, num_reqs_padded=4, buffer=0xA0)]
    res = run(tmp_path, cap)
    assert rules(res) == [(2, "alias")]
    assert res.findings[0].detail["captured"] == 0xA0


def test_pages_names_the_global_count(tmp_path):
    seq = np.array([100, 33, 0], np.int32)
    good = obs(seq=seq, num_reqs=2, num_reqs_padded=3, kv_pages=[4, 2, 0])  # local 50, 17 -> 4, 2 pages of 16
    bad = obs(step=1, seq=seq, num_reqs=2, num_reqs_padded=3, kv_pages=[7, 3, 0])  # cdiv(100,16), cdiv(33,16)
    res = run(tmp_path, [good, bad], page_size=16)
    (f,) = res.findings
    assert (f.obs, f.rule, f.row, f.wrong_rows) == (1, "pages", 0, 2)
    assert f.detail == {"claimed": 7, "allowed": 4, "global": 7}
    assert "global" in f.message


def test_skipped_checks_are_named(tmp_path):
    res = run(tmp_path, [obs()])
    assert {"ubatch-slice", "alias", "pages", "stale/parent-rows"} <= set(res.skipped)


def test_table_is_design_s3():
    """One row per rule in DESIGN §3's order; codes distinct ignoring case; every check is a function of
    rules.py; every fault of simulate maps to the rule of the row that lists it."""
    import dcptool.rules
    from dcptool.simulate import FAULTS

    assert RULES == ("missing", "stale", "global", "wrong-rank", "wrong-interleave", "mismatch", "padding", "shape",
                     "stray", "ubatch-slice", "alias", "rank-sum", "pages", "slots", "slot-partition")
    assert len({c.lower() for c in RULE_CODES.values()}) == len(RULES)
    assert all(callable(getattr(dcptool.rules, r.check)) for r in TABLE)
    assert {f: rule for f, (rule, _) in FAULTS.items()} == {f: r.name for r in TABLE for f in r.faults}
    assert [r.name for r in TABLE if r.severity == "warning"] == ["stray"]


def test_message_is_where_then_text():
    f = Finding(rule="stray", index=0, obs=0, file="f", step=3, site="a: b", rank=1, ubatch=-1, row=None,
                recorded=None, expected=None, wrong_rows=0, text="a DCP view is present")
    assert f.message == "step 3 a: b rank 1: a DCP view is present" and f.to_json()["message"] == f.message
    assert Finding(**{**f.__dict__, "ubatch": 2}).where == "step 3 a: b rank 1 ubatch 2"


# --------------------------------------------------------------------------------------------
# issue 15 item 3: slots and slot-partition (vLLM's rule: tests/vllm/test_vllm_slots.py checks it against
# vLLM's own kernel; here a numpy model of it builds the dumps)

KV2 = ({"name": "attn", "dcp": True, "block_size": 16}, {"name": "mamba", "dcp": False, "block_size": 16})


def vllm_slot_mapping(q, comp, ntp, rank, N, I_, B=16, sharded=True):
    """The slot this rank writes per token, as vLLM's _compute_slot_mappings_kernel does: request i's block k
    is block i*4096 + k, the owner of position p in a sharded group is (p // I) % N, padding writes -1."""
    pos = np.concatenate([np.arange(c, c + k) for c, k in zip(comp, q)] + [np.zeros(0, np.int64)]).astype(np.int64)
    req = np.repeat(np.arange(len(q)), q)
    if sharded:
        vo = pos % (B * N)
        local = pos // (B * N) * B + vo // (I_ * N) * I_ + vo % I_
        mine = (pos // I_) % N == rank
    else:
        local, mine = pos, np.ones(pos.size, bool)
    slot = np.where(mine, (req * 4096 + local // B) * B + local % B, -1)
    full_pos = np.zeros(ntp, np.int64)
    full_pos[: pos.size] = pos
    full_slot = np.full(ntp, -1, np.int64)
    full_slot[: pos.size] = slot
    return full_pos, full_slot


def slot_batch(step, q, comp, N, I_, ntp=None, site="attn_metadata", dummy=False, edit=None):
    """One batch on every rank with both groups' slot mappings (dummy: all -1, as get_dummy_slot_mappings);
    edit(rank, group, pos, slot) may change a rank's mapping in place."""
    q, comp = np.asarray(q, np.int64), np.asarray(comp, np.int64)
    ntp = int(q.sum()) if ntp is None else ntp
    seq = (q + comp).astype(np.int32)
    qsl = np.r_[0, np.cumsum(q)]
    out = []
    for r in range(N):
        maps = {}
        for g, kv in enumerate(KV2):
            pos, slot = vllm_slot_mapping(q, comp, ntp, r, N, I_, kv["block_size"], kv["dcp"])
            if dummy:
                slot[:] = -1
            if edit is not None:
                edit(r, g, pos, slot)
            maps[g] = slot
        out.append(obs(step=step, site=site, rank=r, seq=seq, num_reqs=q.size, num_reqs_padded=q.size, dcp=N,
                       il=I_, view=None if N == 1 else "auto", query_start_loc=qsl, num_tokens_padded=ntp,
                       positions=pos, slot_mapping=maps))
    return out


def run_slots(tmp_path, observations, N, I_):
    return run(tmp_path, observations, dcp=N, il=I_, kv_groups=tuple(KVGroup.of(g) for g in KV2))


@pytest.mark.parametrize("N,I_", [(1, 1), (2, 1), (4, 16), (3, 2), (8, 4)])
def test_slots_clean_on_random_batches_must_not_trigger(tmp_path, rng, N, I_):
    o = []
    for step, total in enumerate((0, 1, 127, 128, 129, 1031)):
        n = min(total, int(rng.integers(1, 6))) if total else 0
        q = np.diff(np.r_[0, np.sort(rng.choice(np.arange(1, total), n - 1, replace=False)), total]) if n > 1 else (
            np.array([total] * n, np.int64))
        comp = rng.integers(0, 5000, n)
        o += slot_batch(step, q, comp, N, I_, ntp=total + int(rng.integers(0, 9)))
        o += slot_batch(step, q, comp, N, I_, site="dummy", dummy=True)  # dummy runs write nothing: not a finding
    res = run_slots(tmp_path, o, N, I_)
    assert [f.message for f in res.findings] == []
    assert "slots" not in res.skipped


def _kinds(res):
    return {(f.obs, f.rule, f.detail.get("kind")) for f in res.findings}


def test_slots_each_kind_triggers(tmp_path):
    N, I_ = 2, 1
    q, comp = [3, 1, 4], [10, 26, 0]  # positions 10 11 12 | 26 | 0 1 2 3

    def put(rank, group, token, value):
        def edit(r, g, pos, slot):
            if (r, g) == (rank, group):
                slot[token] = value
        return edit

    cases = [
        ("padded", put(0, 0, 9, 5), 0),  # token 9 of 10 padded tokens (8 real)
        ("value", put(1, 1, 0, -7), 1),
        ("non-owner", put(1, 0, 0, 123), 1),  # position 10 belongs to rank 0
        ("owner-missing", put(0, 0, 0, -1), 0),
        ("replicated-missing", put(1, 1, 2, -1), 1),
        ("offset", put(0, 0, 0, 16 * 99 + 3), 0),  # position 10 sits at local offset 5 on rank 0
        # position 26 takes position 10's slot (same block offset): two tokens, one slot
        ("duplicate", put(0, 1, 3, int(vllm_slot_mapping(q, comp, 10, 0, N, I_, 16, False)[1][0])), 0),
    ]
    for step, (kind, edit, rank) in enumerate(cases):
        res = run_slots(tmp_path, slot_batch(step, q, comp, N, I_, ntp=10, edit=edit), N, I_)
        got = [(f.rank, f.rule, f.detail.get("kind")) for f in res.findings if f.rule == "slots"]
        assert got == [(rank, "slots", kind)], (kind, [f.message for f in res.findings])
        f = next(f for f in res.findings if f.rule == "slots")
        assert f.severity == "error" and f.message.startswith(f"step {step} attn_metadata rank {rank}: token ")


def test_slots_message_names_owner_and_counts(tmp_path):
    def all_ranks(r, g, pos, slot):  # rank 1 also writes every token of the sharded group
        if (r, g) == (1, 0):
            slot[:8] = np.arange(8) + 1000
    res = run_slots(tmp_path, slot_batch(0, [3, 1, 4], [10, 40, 0], 2, 1, edit=all_ranks), 2, 1)
    f = next(f for f in res.findings if f.rule == "slots")
    assert f.rank == 1 and f.detail == {"kind": "non-owner", "group": 0, "position": 10, "token": 0, "slot": 1000,
                                        "owner": 0}
    # 4 tokens it does not own, and its own 4 at wrong offsets
    assert "belongs to rank 0 ((p // 1) % 2)" in f.message and "(8 wrong entries)" in f.message
    assert "0 (attn)" in f.message


def test_slot_partition_double_write_at_non_owner_and_unwritten_at_owner(tmp_path):
    N, I_ = 4, 2

    def steal(r, g, pos, slot):  # rank 3 writes positions it does not own (like vLLM #57260's mask missing)
        if (r, g) == (3, 0):
            slot[:4] = np.arange(4) + 7000

    res = run_slots(tmp_path, slot_batch(0, [5, 3], [0, 20], N, I_, edit=steal), N, I_)
    part = [f for f in res.findings if f.rule == "slot-partition"]
    assert [(f.rank, f.obs) for f in part] == [(3, 3)]
    # positions 0..3 of request 0: 0,1 belong to rank 0, 2,3 to rank 1
    assert part[0].detail["written_by_several"] == [0, 1, 2, 3] and part[0].detail["unwritten"] == []
    assert part[0].detail["obs"] == [0, 1, 2, 3] and "written by several ranks" in part[0].message

    def lose(r, g, pos, slot):  # rank 1 writes nothing in the sharded group while the others write
        if (r, g) == (1, 0):
            slot[:] = -1

    res = run_slots(tmp_path, slot_batch(1, [5, 3], [0, 20], N, I_, edit=lose), N, I_)
    part = [f for f in res.findings if f.rule == "slot-partition"]
    assert [f.rank for f in part] == [1]
    # positions 0..4 and 20..22: rank 1 owns 2 and 3
    assert part[0].detail["unwritten"] == [2, 3] and "written by no rank" in part[0].message
    # the rank's own slots rule is quiet: a build that writes nothing in a group is not asked to (dummy runs)
    assert [f.rule for f in res.findings] == ["slot-partition"]


def test_slot_partition_needs_every_rank_and_ignores_replicated_groups(tmp_path):
    N, I_ = 2, 1

    def dup(r, g, pos, slot):
        if (r, g) == (1, 0):
            slot[0] = 555
    o = slot_batch(0, [2], [0], N, I_, edit=dup)
    res = run_slots(tmp_path, o[1:], N, I_)  # rank 0 not recorded: no set to partition
    assert [f.rule for f in res.findings] == ["slots"]
    res = run_slots(tmp_path, slot_batch(1, [6, 2], [3, 9], N, I_), N, I_)  # replicated: N writers each, fine
    assert res.findings == []


def test_slots_skipped_without_columns_and_group_defaults(tmp_path):
    assert "slots" in run(tmp_path, [obs()]).skipped
    # without kv_groups every group is DCP-sharded (vLLM 0.29-0.30 localise every group)
    o = slot_batch(0, [4], [0], 2, 1)
    res = run(tmp_path, o, dcp=2, il=1)
    assert {f.detail["kind"] for f in res.findings if f.rule == "slots"} == {"non-owner"}  # group 1 looks sharded
