"""rules.py: DESIGN §3's rules on hand-built dumps, each triggered, each quiet, and precedence; the table itself."""

import numpy as np
import pytest
from conftest import expected_view, obs, write

from dcptool.dump import open_dumps
from dcptool.replay import replay
from dcptool.rules import RULE_CODES, RULES, TABLE, Finding
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
        nr = int(rng.integers(0, 9))  # one batch per step, seen by every rank (else: rank-agree)
        seq = np.zeros(nr + 3, np.int32)
        seq[:nr] = rng.integers(1, 5000, nr)
        for rank in range(4):
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
                     "stray", "ubatch-slice", "alias", "rank-sum", "pages", "empty-mask", "tot-lens", "rank-agree")
    assert len({c.lower() for c in RULE_CODES.values()}) == len(RULES)
    assert all(callable(getattr(dcptool.rules, r.check)) for r in TABLE)
    assert {f: rule for f, (rule, _) in FAULTS.items()} == {f: r.name for r in TABLE for f in r.faults}
    assert [r.name for r in TABLE if r.severity == "warning"] == ["stray"]


def test_message_is_where_then_text():
    f = Finding(rule="stray", index=0, obs=0, file="f", step=3, site="a: b", rank=1, ubatch=-1, row=None,
                recorded=None, expected=None, wrong_rows=0, text="a DCP view is present")
    assert f.message == "step 3 a: b rank 1: a DCP view is present" and f.to_json()["message"] == f.message
    assert Finding(**{**f.__dict__, "ubatch": 2}).where == "step 3 a: b rank 1 ubatch 2"


# ---------------------------------------------------------------------------------------------
# issue 15: empty-mask, tot-lens, rank-agree

import json  # noqa: E402
from pathlib import Path  # noqa: E402

from dcptool.dump import Dump, DumpConfig, Observation, pack  # noqa: E402
from dcptool.reference import local_np  # noqa: E402
from dcptool.rules import check_empty_mask, check_rank_agree, check_tot_lens, decode_counts, lse_mask  # noqa: E402
from dcptool.schema import validate_columns  # noqa: E402


def _dump(observations, N, I=1) -> Dump:
    cfg, cols = pack(observations, DumpConfig(dcp_size=N, cp_interleave=I))
    validate_columns("t", cfg, cols)
    n = len(observations)
    return Dump(files=["t"], config=cfg, columns=cols, file_index=np.zeros(n, np.int32),
                file_obs=np.arange(n, dtype=np.int64))


def _batch(N, I, seq, nrp, qsl, ntp, graph, step=1, Q=None):
    """One decode batch on every rank, as the FlashInfer DCP decode path receives it (Q = qsl prefix)."""
    seq = np.zeros(nrp, np.int64) + np.pad(np.asarray(seq), (0, nrp - len(seq)))
    nr = int(np.count_nonzero(seq))
    qsl = np.asarray(qsl)
    Q = qsl if Q is None else np.asarray(Q)
    out = []
    for r in range(N):
        S = np.zeros(nrp, np.int64)
        S[:nr] = local_np(seq[:nr], N, r, I)
        out.append(Observation(step=step, site="attn_metadata", rank=r, num_reqs=nr, num_reqs_padded=nrp,
                               seq_lens=seq, dcp_local_seq_lens=S, query_start_loc=qsl, num_tokens_padded=ntp,
                               graph=graph, dcp_query_start_loc=Q, dcp_tot_seq_lens=seq[: Q.size - 1]))
    return out


def _masked(o: Observation, rows: int) -> list[int]:
    q = o.dcp_query_start_loc
    return np.flatnonzero(lse_mask(q, o.dcp_local_seq_lens[: q.size - 1], rows)).tolist()


def _em(d):
    return [(i.index, i.fields["detail"]["field"]) for i in check_empty_mask(d)]


def test_empty_mask_worked_example_eager_n2_i16():
    """Issue 15, computed by vLLM 0.33.0 and 0.34.0: N=2, I=16, eager, seq_lens [7,40,16,17]."""
    o = _batch(2, 16, [7, 40, 16, 17], 4, [0, 1, 2, 3, 4], 4, 0)
    assert o[0].dcp_query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert [x.dcp_local_seq_lens.tolist() for x in o] == [[7, 24, 16, 16], [0, 16, 0, 1]]
    assert [_masked(x, 4) for x in o] == [[], [0, 2]]
    assert np.flatnonzero(lse_mask(np.arange(5), np.array([7, 40, 16, 17]), 4)).tolist() == []  # global: nothing
    d = _dump(o, 2, 16)
    assert check_empty_mask(d) == [] and check_rank_agree(d) == [] and check_tot_lens(d) == []
    # broken Q: rank-local (rank 1 drops its empty shards' query tokens)
    bad = _batch(2, 16, [7, 40, 16, 17], 4, [0, 1, 2, 3, 4], 4, 0)
    bad[1].dcp_query_start_loc = np.array([0, 0, 1, 1, 2])
    got = check_empty_mask(_dump(bad, 2, 16))
    assert [(i.index, i.fields["detail"]["field"]) for i in got] == [(1, "dcp_query_start_loc")]
    assert got[0].fields["row"] == 1 and got[0].fields["recorded"] == 0 and got[0].fields["expected"] == 1
    assert got[0].fields["detail"]["expected_masked"] == [0, 2] and got[0].fields["detail"]["masked"] != [0, 2]
    # broken S: global lengths on rank 1 mask nothing where rows 0 and 2 must be masked
    bad = _batch(2, 16, [7, 40, 16, 17], 4, [0, 1, 2, 3, 4], 4, 0)
    bad[1].dcp_local_seq_lens = np.array([7, 40, 16, 17])
    got = check_empty_mask(_dump(bad, 2, 16))
    assert [(i.index, i.fields["detail"]["field"]) for i in got] == [(1, "mask")]
    assert got[0].fields["detail"]["masked"] == [] and got[0].fields["detail"]["expected_masked"] == [0, 2]
    assert "all_ranks_masked" not in got[0].fields["detail"]


def test_empty_mask_worked_example_full_graph_n4_i4():
    """Issue 15: N=4, I=4, FULL graph, seq_lens [5,20,3] padded to 4 requests / 4 tokens."""
    o = _batch(4, 4, [5, 20, 3], 4, [0, 1, 2, 3, 3], 4, 3)
    assert o[0].dcp_query_start_loc.tolist() == [0, 1, 2, 3, 3]  # num_decodes 4: the padded row is a decode
    assert [x.dcp_local_seq_lens.tolist() for x in o] == [[4, 8, 3, 0], [1, 4, 0, 0], [0, 4, 0, 0], [0, 4, 0, 0]]
    assert [_masked(x, 4) for x in o] == [[3], [2, 3], [0, 2, 3], [0, 2, 3]]
    d = _dump(o, 4, 4)
    assert check_empty_mask(d) == [] and check_rank_agree(d) == [] and check_tot_lens(d) == []
    # broken Q: the padded row not counted as a decode (num_decodes 3)
    bad = _batch(4, 4, [5, 20, 3], 4, [0, 1, 2, 3, 3], 4, 3, Q=[0, 1, 2, 3])
    got = check_empty_mask(_dump(bad, 4, 4))
    assert [(i.index, i.fields["detail"]["field"]) for i in got] == [(k, "num_decodes") for k in range(4)]
    assert got[0].fields["recorded"] == 3 and got[0].fields["expected"] == 4
    # broken S: rank 2 holds rank 1's lengths, so it keeps row 0 it must mask
    bad = _batch(4, 4, [5, 20, 3], 4, [0, 1, 2, 3, 3], 4, 3)
    bad[2].dcp_local_seq_lens = np.array([1, 4, 0, 0])
    got = check_empty_mask(_dump(bad, 4, 4))
    assert [(i.index, i.fields["detail"]["field"]) for i in got] == [(2, "mask")]
    assert got[0].fields["detail"]["masked"] == [2, 3] and got[0].fields["detail"]["expected_masked"] == [0, 2, 3]


def test_empty_mask_row_masked_on_every_rank_is_named(tmp_path):
    """Every real row must be unmasked on at least one rank: rank 0 zeroing request 0 leaves row 0 to nobody."""
    o = _batch(2, 16, [7, 40, 16, 17], 4, [0, 1, 2, 3, 4], 4, 0)
    o[0].dcp_local_seq_lens = np.array([0, 24, 16, 16])
    got = check_empty_mask(_dump(o, 2, 16))
    assert [(i.index, i.fields["detail"]["field"]) for i in got] == [(0, "mask")]
    assert got[0].fields["detail"]["all_ranks_masked"] == [0] and "every rank" in got[0].text
    # through replay: the view's own rule first (DESIGN table order), then empty-mask
    res = run(tmp_path, o, dcp=2, il=16)
    assert rules(res) == [(0, "mismatch"), (0, "empty-mask"), (1, "rank-sum")]


def test_empty_mask_q_checks_and_short_view():
    base = dict(N=2, I=1, seq=[9, 5], nrp=2, qsl=[0, 1, 2], ntp=2, graph=0)
    for Q, field in (([1, 1, 2], "dcp_query_start_loc"), ([0, 2, 1], "dcp_query_start_loc")):
        o = _batch(**base, Q=Q)
        assert _em(_dump(o, 2)) == [(0, field), (1, field)], Q
    o = _batch(**base)
    o[0].dcp_local_seq_lens = np.array([5])  # shorter than num_decodes: vLLM raises in the mask
    assert _em(_dump(o, 2)) == [(0, "seq_lens")]
    # a mixed batch: decodes end at the first query longer than 1
    o = _batch(2, 1, [9, 5, 30], 3, [0, 1, 2, 12], 12, 0, Q=[0, 1, 2])
    assert _em(_dump(o, 2)) == []
    o = _batch(2, 1, [9, 5, 30], 3, [0, 1, 2, 12], 12, 0, Q=[0, 1, 2, 12])
    assert _em(_dump(o, 2)) == [(0, "num_decodes"), (1, "num_decodes")]
    # the builder's num_reqs is num_reqs_padded under a FULL graph: there the real count alone is wrong;
    # outside one either count is accepted (eager builds see num_reqs, a drafter's padded batch the padded one)
    o = _batch(2, 1, [9, 5], 3, [0, 1, 2, 2], 2, 3, Q=[0, 1, 2])
    assert _em(_dump(o, 2)) == [(0, "num_decodes"), (1, "num_decodes")]
    for Q in ([0, 1, 2], [0, 1, 2, 2]):
        assert _em(_dump(_batch(2, 1, [9, 5], 3, [0, 1, 2, 2], 2, 0, Q=Q), 2)) == []
    # no query_start_loc recorded: Q checked on its own (starts at 0, never decreases), the mask from Q
    o = _batch(**base)
    for x in o:
        x.query_start_loc = None
    assert _em(_dump(o, 2)) == []
    o[1].dcp_query_start_loc = np.array([0, 2, 1])
    assert _em(_dump(o, 2)) == [(1, "dcp_query_start_loc")]


def test_lse_mask_and_decode_split_are_vllms():
    """tests/data/empty_mask_oracle.json: vLLM 0.34.0's mask_dcp_empty_shards_ and split_decodes_and_prefills
    (threshold 1, require_uniform both ways) on seeded random batches (make_empty_mask_oracle.py; 0.33.0's
    mask agrees)."""
    o = json.loads((Path(__file__).parent / "data" / "empty_mask_oracle.json").read_text())
    for c in o["mask"]:
        assert np.flatnonzero(lse_mask(np.array(c["q"]), np.array(c["s"]), c["rows"])).tolist() == c["masked"], c
    obs_ = [Observation(step=0, site="a", rank=0, num_reqs=len(c["ql"]), num_reqs_padded=len(c["ql"]),
                        seq_lens=np.full(len(c["ql"]), 5), dcp_local_seq_lens=None,
                        query_start_loc=np.concatenate([[0], np.cumsum(c["ql"])])) for c in o["split"]]
    d = _dump(obs_, 2)
    a, b = decode_counts(d, np.arange(d.n), np.array([len(c["ql"]) for c in o["split"]]))
    assert a.tolist() == [c["a"] for c in o["split"]] and b.tolist() == [c["b"] for c in o["split"]]


def _reference_empty_mask(d: Dump) -> set[int]:
    """Per observation, in plain Python: the observations check_empty_mask must flag."""
    c = d.config
    out = set()
    for i in range(d.n):
        Q = d.dqsl_of(i).astype(np.int64)
        if Q.size == 0:
            continue
        nd = Q.size - 1
        qsl = d.qsl_of(i).astype(np.int64)
        nr, nrp = int(d["obs.num_reqs"][i]), int(d["obs.num_reqs_padded"][i])
        fits = set()
        for R in ((nrp,) if d["obs.graph"][i] >= 2 else (nrp, nr)):  # the builder's num_reqs (FULL: padded)
            ql = np.diff(qsl[: R + 1])
            a = next((j for j in range(R) if ql[j] > 1), R)
            b = a if not (R and ql[0] == 0 and a < R) else next(j for j in range(R) if ql[j] >= 1)
            fits |= {(a, R), (b, R)}
        R = next((r for x, r in fits if x == nd), None)
        if Q[0] != 0 or (np.diff(Q) < 0).any() or R is None or not np.array_equal(Q, qsl[: nd + 1]):
            out.add(i)
            continue
        view = d.dcp_of(i)
        if view.size < nd:
            out.add(i)
            continue
        seq = d.seq_lens_of(i).astype(np.int64)
        exp = np.array([local_np(seq[j], c.dcp_size, int(d["obs.rank"][i]), c.cp_interleave) if j < nr else 0
                        for j in range(nd)], np.int64)
        T = max(int(d["obs.num_tokens_padded"][i]), int(qsl[nd])) if nd == R else int(qsl[nd])
        if not np.array_equal(lse_mask(Q, view[:nd], T), lse_mask(Q, exp, T)):
            out.add(i)
    return out


def test_empty_mask_seeded_random_matches_reference(rng):
    """Random decode/mixed batches on every rank with random corruptions of Q and S; the vectorised check
    flags exactly what the per-observation reference (vLLM's mask, spelled out) flags."""
    for trial in range(6):
        N, I = int(rng.choice([2, 3, 4])), int(rng.choice([1, 2, 16]))
        o = []
        for step in range(25):
            nr = int(rng.integers(1, 7))
            nrp = nr + int(rng.integers(0, 3))
            ql = np.concatenate([np.sort(rng.choice([1, 1, 1, 5], nr)), np.zeros(nrp - nr, np.int64)])
            qsl = np.concatenate([[0], np.cumsum(ql)])
            seq = np.concatenate([rng.integers(1, 3 * N * I, nr) + ql[:nr], np.zeros(nrp - nr, np.int64)])
            graph = int(rng.choice([0, 3])) if nrp == nr else 3  # requests are padded for FULL graphs only
            R = nrp if graph == 3 else nr
            nd = next((j for j in range(R) if ql[j] > 1), R)
            batch = _batch(N, I, seq[:nr].tolist(), nrp, qsl, int(qsl[-1]) + int(rng.integers(0, 3)), graph,
                           step=step, Q=qsl[: nd + 1])
            for x in batch:
                x.seq_lens = seq
                u = rng.random()
                if u < 0.1 and x.dcp_query_start_loc.size > 1:
                    q = x.dcp_query_start_loc.copy()
                    q[rng.integers(1, q.size)] += int(rng.choice([-1, 1]))
                    x.dcp_query_start_loc = q
                elif u < 0.25:
                    v = x.dcp_local_seq_lens.copy()
                    v[rng.integers(0, nrp)] = int(rng.choice([0, 1, 7]))
                    x.dcp_local_seq_lens = v
                elif u < 0.3:
                    x.dcp_query_start_loc = x.dcp_query_start_loc[:-1] if x.dcp_query_start_loc.size > 1 else \
                        x.dcp_query_start_loc
            o += batch
        d = _dump(o, N, I)
        assert {i.index for i in check_empty_mask(d)} == _reference_empty_mask(d), trial


def test_tot_lens_triggers_on_local_companion_not_on_global(tmp_path):
    o = _batch(2, 1, [9, 5, 30], 4, [0, 1, 2, 3, 3], 4, 3)
    assert check_tot_lens(_dump(o, 2)) == []
    o[1].dcp_tot_seq_lens = o[1].dcp_local_seq_lens[:4]
    got = check_tot_lens(_dump(o, 2))
    assert [(i.index, i.fields["row"], i.fields["recorded"], i.fields["expected"]) for i in got] == [(1, 0, 4, 9)]
    assert "local lengths" in got[0].text and got[0].fields["wrong_rows"] == 3
    # padded rows of the companion are not real rows
    o = _batch(2, 1, [9, 5, 30], 4, [0, 1, 2, 3, 3], 4, 3)
    o[0].dcp_tot_seq_lens = np.array([9, 5, 30, 77])
    assert check_tot_lens(_dump(o, 2)) == []


def test_new_checks_are_skipped_by_name_without_their_columns(tmp_path):
    res = run(tmp_path, [obs(rank=0), obs(rank=1)])
    assert res.findings == []
    assert "obs.dqsl" in res.skipped["empty-mask"] and "obs.tot" in res.skipped["tot-lens"]
    assert "rank-agree" not in res.skipped  # needs only the required columns
    res = run(tmp_path, _batch(2, 1, [9, 5], 2, [0, 1, 2], 2, 0))
    assert res.findings == [] and not {"empty-mask", "tot-lens"} & set(res.skipped)


def test_rank_agree_names_the_differing_ranks_once_per_batch():
    base = _batch(3, 1, [9, 5, 30], 4, [0, 1, 2, 3, 3], 4, 3)
    assert check_rank_agree(_dump(base, 3)) == []
    cases = {"seq_lens": lambda x: setattr(x, "seq_lens", np.array([9, 6, 30, 0])),
             "num_reqs_padded": lambda x: setattr(x, "num_reqs_padded", 5) or setattr(
                 x, "seq_lens", np.array([9, 5, 30, 0, 0])) or setattr(x, "dcp_local_seq_lens", np.pad(
                     x.dcp_local_seq_lens, (0, 1))) or setattr(x, "query_start_loc", np.array([0, 1, 2, 3, 3, 3])),
             "query_start_loc": lambda x: setattr(x, "query_start_loc", np.array([0, 1, 2, 3, 4])),
             "num_tokens_padded": lambda x: setattr(x, "num_tokens_padded", 8),
             "graph": lambda x: setattr(x, "graph", 0),
             "num_reqs": lambda x: setattr(x, "num_reqs", 2)}
    for field, change in cases.items():
        o = _batch(3, 1, [9, 5, 30], 4, [0, 1, 2, 3, 3], 4, 3)
        change(o[2])  # the majority (ranks 0, 1) is the reference
        got = check_rank_agree(_dump(o, 3))
        assert [(i.index, i.fields["detail"]["field"], i.fields["detail"]["ranks"]) for i in got] == [
            (2, field, [2])], field
        assert "rank 2" in got[0].text
    # two ranks of three differ: one finding, at the first of them, naming both
    o = _batch(3, 1, [9, 5, 30], 4, [0, 1, 2, 3, 3], 4, 3) + _batch(3, 1, [9, 5, 30], 4, [0, 1, 2, 3, 3], 4, 3, step=2)
    o[4].seq_lens = np.array([9, 6, 30, 0])
    o[5].num_tokens_padded = 8
    got = check_rank_agree(_dump(o, 3))
    assert [(i.index, i.fields["detail"]["ranks"]) for i in got] == [(4, [1, 2])]
    assert got[0].fields["detail"]["fields"] == {"1": "seq_lens", "2": "num_tokens_padded"}
    # N=2 tie: the lower rank's values are the reference
    o = _batch(2, 1, [9, 5], 2, [0, 1, 2], 2, 0)
    o[0].seq_lens = np.array([9, 4])
    assert [i.index for i in check_rank_agree(_dump(o, 2))] == [1]
    # different batches at different steps or sites are not compared
    o = _batch(2, 1, [9, 5], 2, [0, 1, 2], 2, 0) + _batch(2, 1, [8, 3], 2, [0, 1, 2], 2, 0, step=2)
    o[2].site = o[3].site = "draft"
    assert check_rank_agree(_dump(o, 2)) == []


def test_rank_agree_in_replay_output_names_the_rule(tmp_path):
    from conftest import cli

    o = _batch(2, 1, [9, 5], 2, [0, 1, 2], 2, 0)
    o[1].seq_lens = np.array([9, 6])
    o[1].dcp_local_seq_lens = np.array([4, 3])
    o[1].dcp_tot_seq_lens = np.array([9, 6])
    p = write(tmp_path / "d.safetensors", o)
    r = cli("replay", p)
    assert r.returncode == 1 and "rank-agree" in r.stdout and "rank 1 seq_lens [9, 6]" in r.stdout
    r = cli("replay", p, "--json")
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [(x["rule"], x["obs"], x["detail"]["ranks"]) for x in lines if x["type"] == "finding"] == [
        ("rank-agree", 1, [1])]
    assert lines[-1]["by_rule"] == {"rank-agree": 1}


def test_rank_agree_row_compare_and_hashes_do_not_depend_on_the_chunking(rng):
    from dcptool.rules import _row_hashes, _rows_differ

    o = [obs(step=k // 2, rank=k % 2, seq=rng.integers(0, 3, int(rng.integers(0, 4))).astype(np.int32),
             num_reqs=0, num_reqs_padded=0, view=[]) for k in range(60)]
    d = _dump(o, 2)
    other = rng.integers(0, d.n, d.n)
    want = np.array([not np.array_equal(d.seq_lens_of(i), d.seq_lens_of(other[i])) for i in range(d.n)])
    idx = np.arange(d.n)
    whole = _row_hashes(d, "obs.rows", "rows.seq_lens", idx)
    assert np.array_equal(whole == whole[other], ~want | (whole == whole[other]))  # equal rows: equal hashes
    for step in (1, 3, 17, 1 << 22):
        assert np.array_equal(_rows_differ(d, "obs.rows", "rows.seq_lens", other, step), want), step
        assert np.array_equal(_row_hashes(d, "obs.rows", "rows.seq_lens", idx, step), whole), step
    # a trailing 0 changes the hash (the length is compared beside it too)
    d = _dump([obs(seq=[3, 0], num_reqs=1, num_reqs_padded=2), obs(seq=[3, 1], num_reqs=1, num_reqs_padded=2)], 2)
    h = _row_hashes(d, "obs.rows", "rows.seq_lens", np.arange(2))
    assert h[0] != h[1]
