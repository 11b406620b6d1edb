"""rules.py: DESIGN §3's rules on hand-built dumps, each triggered, each quiet, and precedence; the table itself."""

import numpy as np
import pytest
from conftest import expected_view, obs, write

from dcptool.check.replay import replay
from dcptool.check.rules import RULE_CODES, RULES, TABLE, Finding
from dcptool.dcp.slicing import split_batch
from dcptool.dump import open_dumps
from dcptool.dump.schema import KVGroup

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
    import importlib

    import dcptool.check.rules
    from dcptool.model.simulate import FAULTS

    assert RULES == ("missing", "stale", "global", "wrong-rank", "wrong-interleave", "mismatch", "padding", "shape",
                     "stray", "ubatch-slice", "alias", "rank-sum", "pages", "empty-mask", "tot-lens", "rank-agree",
                     "slots", "slot-partition")
    assert len({c.lower() for c in RULE_CODES.values()}) == len(RULES)
    def function(name):  # "check_x" of rules.py, or "module.check_x" of another dcptool module
        mod, _, f = name.rpartition(".")
        return getattr(importlib.import_module(f"dcptool.check.{mod}") if mod else dcptool.check.rules, f)

    assert all(callable(function(r.check)) for r in TABLE)
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

from dcptool.check.rules import check_empty_mask, check_rank_agree, check_tot_lens, decode_counts, lse_mask  # noqa: E402
from dcptool.dcp.reference import local_np  # noqa: E402
from dcptool.dump import Dump, DumpConfig, Observation, pack  # noqa: E402
from dcptool.dump.schema import validate_columns  # noqa: E402


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


@pytest.mark.parametrize("seed", range(3))
def test_rank_agree_with_the_scans_pairs_equals_reading_the_rows_itself(monkeypatch, seed):
    """replay hands check_rank_agree the scan's comparison of each member with the one before it; the findings
    are the standalone check's, whatever the chunking (pairs across chunk edges), and the planted ones."""
    from dcptool.check import scan as scan_mod
    from dcptool.check.rules import rank_pairs

    rng = np.random.default_rng(seed)
    o, planted = [], set()
    for step in range(40):
        n = int(rng.choice([1, 2, 5, 40]))
        b = _batch(3, 1, rng.integers(1, 50, n), n + 1, np.arange(n + 2).clip(0, n), n + 1, 3, step=step)
        if rng.random() < 0.3:
            k = int(rng.integers(0, 3))
            b[k].seq_lens = b[k].seq_lens.copy()
            b[k].seq_lens[int(rng.integers(0, n))] += 1
            planted.add((step, k))
        o += b
    d = _dump(o, 3)
    want = check_rank_agree(d)
    assert {(i.index // 3, i.fields["detail"]["ranks"][0]) for i in want} == planted and planted
    pairs = rank_pairs(d)
    for target in (1, 7, 64, 1 << 18):
        monkeypatch.setattr(scan_mod, "CHUNK_ROWS", target)
        got = check_rank_agree(d, pairs, scan_mod.scan(d, "torch", pairs=pairs.prev).differ)
        assert got == want, target


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
    from dcptool.check.rules import _row_hashes
    from dcptool.check.scan import rows_differ

    o = [obs(step=k // 2, rank=k % 2, seq=rng.integers(0, 3, int(rng.integers(0, 4))).astype(np.int32),
             num_reqs=0, num_reqs_padded=0, view=[]) for k in range(60)]
    d = _dump(o, 2)
    other = rng.integers(0, d.n, d.n)
    want = np.array([not np.array_equal(d.seq_lens_of(i), d.seq_lens_of(other[i])) for i in range(d.n)])
    idx = np.arange(d.n)
    whole = _row_hashes(d, "obs.rows", "rows.seq_lens", idx)
    assert np.array_equal(whole == whole[other], ~want | (whole == whole[other]))  # equal rows: equal hashes
    for step in (1, 3, 17, 1 << 22):
        assert np.array_equal(rows_differ(d, "obs.rows", "rows.seq_lens", idx, other, step), want), step
        assert np.array_equal(_row_hashes(d, "obs.rows", "rows.seq_lens", idx, step), whole), step
    # a trailing 0 changes the hash (the length is compared beside it too)
    d = _dump([obs(seq=[3, 0], num_reqs=1, num_reqs_padded=2), obs(seq=[3, 1], num_reqs=1, num_reqs_padded=2)], 2)
    h = _row_hashes(d, "obs.rows", "rows.seq_lens", np.arange(2))
    assert h[0] != h[1]
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


# issue 16: the slot checks in chunks (SLOT_CHUNK entries; whole rank-sets for slot-partition) give the same
# findings as the whole-column implementation they replaced (tests/slot_reference.py), on seeded random dumps

KV3 = (KVGroup("attn", True, 16), KVGroup("mamba", False, 16), KVGroup("big", True, 32))


def random_slot_dump(path, rng, batches, N, I_, kv=KV3, bounded=None, faulty=0.6, dup=0.3, reorder=0.1,
                     noqsl=0.2):
    """`batches` batches on (mostly) every rank, observations shuffled so a set's members lie far apart: real
    token counts 0, 1, 127, 128, 129, 1000+, padding, dummy builds, with wrong entries of every kind (padded
    writes, bad values, non-owners, missing owners, wrong offsets, duplicates: in a `faulty` / `dup` share of
    the builds), groups sometimes (`reorder`) out of order or interleaved, query_start_loc sometimes (`noqsl`)
    not recorded."""
    groups = [(True, 0)] if kv is None else [(g.dcp, g.block_size or 0) for g in kv]
    per = []  # (step, rank, nreq, qsl or None, [(group, pos, slot)])
    for b in range(batches):
        T = int(rng.choice([0, 1, 5, 127, 128, 129, 1031]))
        nreq = int(min(T, rng.integers(0, 4))) if T else 0
        cuts = np.sort(rng.choice(np.arange(1, T), nreq - 1, replace=False)) if nreq > 1 else np.zeros(0, int)
        qsl = np.r_[0, cuts, T][: nreq + 1] if nreq else np.zeros(1, np.int64)
        ntp = T + int(rng.integers(0, 9))
        comp = int(rng.integers(0, 3000))
        dummy = rng.random() < 0.1
        ranks = [r for r in range(N) if rng.random() > 0.05]
        ranks += [int(rng.integers(0, N))] if rng.random() < 0.05 else []  # a rank twice
        for r in ranks:
            ents = []
            for g, (sh, B) in enumerate(groups):
                if rng.random() < 0.1:
                    continue  # the group not recorded in this build
                pos = np.zeros(ntp, np.int64)
                pos[:T] = comp + np.arange(T)
                Bv = max(B, 1)
                if sh:
                    vo = pos % (Bv * N)
                    local = pos // (Bv * N) * Bv + vo // (I_ * N) * I_ + vo % I_
                    mine = (pos // I_) % N == r
                else:
                    local, mine = pos, np.ones(ntp, bool)
                slot = np.where(mine, 7 * Bv * 4096 + local, -1)
                slot[T:] = -1
                if dummy:
                    slot[:] = -1
                if rng.random() < faulty:
                    k = rng.random(ntp)
                    slot[k < 0.004] = -1  # owner missing
                    slot[(k > 0.996)] = slot[k > 0.996] + 1  # wrong offset (or a -1 turned 0: a non-owner writes)
                    hit = rng.random(ntp) < 0.003
                    slot[hit] = rng.choice([-7, 5, 123456])  # bad value, stray writes
                w = np.flatnonzero(slot[:T] >= 0)
                if w.size > 1 and rng.random() < dup:  # a duplicate: a later token at the same block offset
                    same = w[1:][(local[w[1:]] - local[w[0]]) % Bv == 0]
                    if same.size:
                        slot[same[-1]] = slot[w[0]]
                ents.append((g, pos, slot))
            per.append((b // 2, r, nreq, qsl if rng.random() < 1 - noqsl else None, ents))
    order = rng.permutation(len(per))
    cols = {k: [] for k in ("step", "rank", "nreq", "qsl", "cnt", "pos", "slot", "grp")}
    for i in order:
        step, r, nreq, qsl, ents = per[i]
        g = np.concatenate([np.full(p.size, gi, np.int32) for gi, p, _ in ents] + [np.zeros(0, np.int32)])
        p = np.concatenate([p for _, p, _ in ents] + [np.zeros(0, np.int64)])
        s = np.concatenate([s for _, _, s in ents] + [np.zeros(0, np.int64)])
        if g.size and rng.random() < reorder:  # groups out of the Recorder's order: reversed, or interleaved
            o = np.argsort(-g, kind="stable") if rng.random() < 0.5 else np.argsort(rng.random(g.size) < 0.5,
                                                                                    kind="stable")
            g, p, s = g[o], p[o], s[o]
        cols["step"].append(step)
        cols["rank"].append(r)
        cols["nreq"].append(nreq)
        cols["qsl"].append(qsl)
        cols["cnt"].append(g.size)
        cols["pos"].append(p)
        cols["slot"].append(s)
        cols["grp"].append(g)
    n = len(order)
    nreq = np.array(cols["nreq"], np.int64)
    rows = np.r_[0, np.cumsum(nreq)]
    qlen = np.array([0 if q is None else q.size for q in cols["qsl"]], np.int64)
    out = {"obs.step": np.array(cols["step"], np.int64), "obs.site": np.zeros(n, np.int32),
           "obs.rank": np.array(cols["rank"], np.int32), "obs.ubatch": np.full(n, -1, np.int32),
           "obs.num_reqs": nreq.astype(np.int32), "obs.num_reqs_padded": nreq.astype(np.int32), "obs.rows": rows,
           "obs.has_dcp": np.zeros(n, np.uint8), "obs.dcp_rows": np.zeros(n + 1, np.int64),
           "rows.seq_lens": np.full(int(rows[-1]), 5000, np.int32), "rows.dcp_local_seq_lens": np.zeros(0, np.int32),
           "obs.qsl": np.r_[0, np.cumsum(qlen)],
           "rows.query_start_loc": np.concatenate([q for q in cols["qsl"] if q is not None] + [np.zeros(0)]).astype(
               np.int32),
           "obs.slots": np.r_[0, np.cumsum(cols["cnt"])].astype(np.int64)}
    for key, name in (("pos", "positions"), ("slot", "slot_mapping"), ("grp", "slot_group")):
        out["rows." + name] = np.concatenate(cols[key] + [np.zeros(0)]).astype(np.int32)
    from dcptool.dump import DumpConfig, write_dump

    write_dump(path, DumpConfig(dcp_size=N, cp_interleave=I_, sites=("x",), kv_groups=kv), out)
    return open_dumps([str(path)], bounded=bounded)


@pytest.mark.parametrize("seed,N,I_,kv", [(0, 4, 1, KV3), (1, 8, 4, KV3), (2, 3, 2, KV3), (3, 2, 1, None),
                                          (4, 4, 16, KV3[:2]), (5, 1, 1, KV3)])
def test_slot_checks_in_chunks_equal_the_whole_column_reference(tmp_path, monkeypatch, seed, N, I_, kv):
    from slot_reference import old_check_slot_partition, old_check_slots

    import dcptool.check.slots as R

    rng = np.random.default_rng(seed)
    d = random_slot_dump(tmp_path / "s.safetensors", rng, 60, N, I_, kv)
    want = old_check_slots(d), old_check_slot_partition(d)
    assert len(want[0]) > 10 and (N == 1 or len(want[1]) > 0)  # the dump has findings of both rules
    kinds = {i.fields["detail"]["kind"] for i in want[0]}
    assert kinds >= {"padded", "value", "owner-missing", "duplicate"} | ({"non-owner"} if N > 1 else set()) | (
        {"offset"} if kv else set())
    for chunk in (1, 7, 128, 1 << 22):
        monkeypatch.setattr(R, "SLOT_CHUNK", chunk)
        monkeypatch.setattr(R, "SLOT_CHUNK_THREADED", chunk)
        assert R.check_slots(d) == want[0], chunk
        assert R.check_slot_partition(d) == want[1], chunk
        for threads in (1, 3):  # chunks on several threads: the same findings, in the same order
            found, members = R._slot_pass(d, members=N > 1, threads=threads)
            assert (found, R.check_slot_partition(d, members)) == want, (chunk, threads)
    b = open_dumps([str(tmp_path / "s.safetensors")], bounded=True)
    monkeypatch.setattr(R, "SLOT_CHUNK", 129)
    assert (R.check_slots(b), R.check_slot_partition(b)) == want


@pytest.mark.parametrize("size", [0, 1, 127, 128, 129, 1031])
def test_slot_checks_in_chunks_clean_and_awkward_sizes_must_not_trigger(tmp_path, monkeypatch, size):
    from slot_reference import old_check_slot_partition, old_check_slots

    import dcptool.check.slots as R

    o = slot_batch(0, [size], [3], 4, 2) + slot_batch(1, [size], [17], 4, 2, ntp=size + 3)
    write(tmp_path / "c.safetensors", o, dcp=4, il=2, kv_groups=tuple(KVGroup.of(g) for g in KV2))
    d = open_dumps([str(tmp_path / "c.safetensors")])
    for chunk in (1, 7, 128):
        monkeypatch.setattr(R, "SLOT_CHUNK", chunk)
        assert R.check_slots(d) == [] == old_check_slots(d)
        assert R.check_slot_partition(d) == [] == old_check_slot_partition(d)


class _ReadSpy:
    """A row column that records the largest read (a slice or an index array) and a read of it whole."""

    def __init__(self, a, log):
        self.a, self.log, self.size, self.shape, self.dtype, self.ndim = a, log, a.size, a.shape, a.dtype, 1

    def __len__(self):
        return self.size

    def __getitem__(self, k):
        out = self.a[k]
        self.log.append(np.size(out))
        return out

    def __array__(self, dtype=None, copy=None):
        self.log.append(self.size)
        return self.a if dtype is None else self.a.astype(dtype)


@pytest.mark.parametrize("threads", [1, 3])
def test_slot_checks_read_the_dump_a_chunk_at_a_time(tmp_path, monkeypatch, threads):
    """Peak memory bounded by the chunk, not the dump: no read of a slot column is much larger than
    SLOT_CHUNK entries (the whole-column implementation read every column whole); on several threads, by
    SLOT_CHUNK_THREADED entries per thread (the threads a host of many cores gets, forced here)."""
    import dcptool.check.slots as R

    monkeypatch.setattr(R, "default_threads", lambda bounded=False: 1 if bounded else threads)
    monkeypatch.setattr(R, "SLOT_CHUNK_THREADED", 1000)

    d = random_slot_dump(tmp_path / "s.safetensors", np.random.default_rng(7), 80, 4, 1)
    want = R.check_slots(d), R.check_slot_partition(d)
    total = int(d["obs.slots"][-1])
    log: list[int] = []
    for k in ("rows.positions", "rows.slot_mapping", "rows.slot_group"):
        d.columns[k] = _ReadSpy(d.columns[k], log)
    monkeypatch.setattr(R, "SLOT_CHUNK", 1000)
    most = int(np.diff(d["obs.slots"]).max())
    assert R.check_slots(d) == want[0] and len(want[0]) > 0
    assert R.check_slot_partition(d) == want[1] and len(want[1]) > 0
    assert log and max(log) <= 1000 + 4 * most < total // 4, (max(log), total)


def test_slot_partition_many_wrong_entries_per_member_equal_the_reference(tmp_path, monkeypatch):
    """A rank writing all 1031 tokens (more than the 64 positions a finding keeps): counts and the first
    positions as the whole-column reference has them, in chunks too."""
    from slot_reference import old_check_slot_partition, old_check_slots

    import dcptool.check.slots as R

    def all_ranks(r, g, pos, slot):
        if r in (1, 3) and g == 0:
            slot[:] = np.arange(slot.size) + 9000
            slot[r * 100: r * 100 + 70] = -1  # and some of its own positions unwritten

    o = slot_batch(0, [1000, 31], [5, 77], 4, 1, edit=all_ranks) + slot_batch(1, [129], [0], 4, 1, edit=all_ranks)
    write(tmp_path / "m.safetensors", o, dcp=4, il=1, kv_groups=tuple(KVGroup.of(g) for g in KV2))
    d = open_dumps([str(tmp_path / "m.safetensors")])
    want = old_check_slots(d), old_check_slot_partition(d)
    assert len(want[1]) >= 4 and max(i.fields["wrong_rows"] for i in want[1]) > 700
    for chunk in (7, 1 << 22):
        monkeypatch.setattr(R, "SLOT_CHUNK", chunk)
        assert (R.check_slots(d), R.check_slot_partition(d)) == want


# issue 16 (performance): a screen of cheap whole-chunk passes picks the runs that can have a finding; only
# their observations get the exact work, only sets with such a member slot-partition's second read

KV_ODD = (KVGroup("attn", True, 24), KVGroup("mamba", False, 12), KVGroup("big", True, 1 << 14))  # (no lo16)


@pytest.mark.parametrize("seed,N,I_,kv", [(10, 4, 1, KV3), (11, 8, 4, KV3), (12, 3, 2, KV3), (13, 2, 1, None),
                                          (14, 8, 1, KV_ODD), (15, 4, 2, KV_ODD), (16, 1, 1, KV3)])
def test_slot_screen_misses_no_rare_fault_equal_to_both_references(tmp_path, monkeypatch, seed, N, I_, kv):
    """Mostly clean builds with a rare wrong entry of each kind (so most runs pass the screen and a missed one
    would show): the findings of the whole-column and the chunked reference, at several chunk sizes; block
    sizes that are no power of two or too big for the uint16 fast path (KV_ODD) take the int64 path."""
    from slot_reference import (
        chunked_check_slot_partition,
        chunked_check_slots,
        old_check_slot_partition,
        old_check_slots,
    )

    import dcptool.check.slots as R

    rng = np.random.default_rng(seed)
    d = random_slot_dump(tmp_path / "s.safetensors", rng, 160, N, I_, kv, faulty=0.04, dup=0.03, reorder=0.02,
                         noqsl=0.01)
    want = old_check_slots(d), old_check_slot_partition(d)
    assert (chunked_check_slots(d), chunked_check_slot_partition(d)) == want
    assert 0 < len(want[0]) < d.n // 2  # most observations clean, some not
    for chunk in (1, 64, 1000, 1 << 18):
        monkeypatch.setattr(R, "SLOT_CHUNK", chunk)
        assert R.check_slots(d) == want[0], chunk
        assert R.check_slot_partition(d) == want[1], chunk


def test_slot_screen_duplicates_across_requests(tmp_path):
    """A duplicate between two requests of one build (each request's slots increasing: two segments whose
    ranges overlap) is found; overlapping ranges without a shared slot are not a finding."""
    def edit(r, g, pos, slot):
        if g == 1:  # (replicated, blocks of 16)
            if r == 0:
                slot[35] = slot[3]  # request 1's position 3 takes request 0's position 3's slot
            if r == 1:
                slot[16:32] += 16  # request 0 in blocks 0 and 2, request 1 in block 1: ranges overlap, slots differ
                slot[32:] = 16 + np.arange(10)
    q, comp = [32, 10], [0, 0]
    o = slot_batch(0, q, comp, 2, 1, edit=edit)
    res = run_slots(tmp_path, o, 2, 1)
    assert [(f.rank, f.rule, f.detail.get("kind")) for f in res.findings] == [(0, "slots", "duplicate")]


def test_slot_screen_sends_only_suspect_observations_to_the_exact_work(tmp_path, monkeypatch):
    """A clean recording gets no exact work at all; one wrong entry sends its observation only."""
    import dcptool.check.slots as R

    calls = []
    real = R._slot_findings
    monkeypatch.setattr(R, "_slot_findings", lambda d, oid, *a: calls.append(oid.tolist()) or real(d, oid, *a))

    def one(r, g, pos, slot):
        if r == 2 and g == 0:
            slot[5] = -1 if slot[5] >= 0 else 77

    for bad in (None, 4):
        o = []
        for step in range(6):
            o += slot_batch(step, [40, 1, 90], [step * 7, 300, 1000], 4, 1, ntp=135, edit=one if step == bad else None)
        write(tmp_path / f"c{bad}.safetensors", o, dcp=4, il=1, kv_groups=tuple(KVGroup.of(g) for g in KV2))
        d = open_dumps([str(tmp_path / f"c{bad}.safetensors")])
        got = R.check_slots(d)
        if bad is None:
            assert got == [] and calls == []
        else:
            assert [i.index for i in got] == [4 * 4 + 2] and calls == [[18]]


class _IndexSpy(_ReadSpy):
    """A row column that records its reads as ('slice', n) or ('gather', n)."""

    def __getitem__(self, k):
        out = self.a[k]
        self.log.append(("slice" if isinstance(k, slice) else "gather", np.size(out)))
        return out


def test_slot_partition_reads_clean_sets_once_and_takes_the_pass_summaries(tmp_path):
    """slot-partition gathers the entries of sets with a suspect member only (none on a clean recording), and
    given the summaries of a pass made already (check_slot_rules' pass) reads no entry at all."""
    from slot_reference import old_check_slot_partition

    import dcptool.check.slots as R

    o = []
    for step in range(8):
        o += slot_batch(step, [40, 1, 90], [step * 7, 300, 1000], 4, 1, ntp=135)
        o += slot_batch(step, [3], [step], 4, 1, site="dummy", dummy=True)
    write(tmp_path / "s.safetensors", o, dcp=4, il=1, kv_groups=tuple(KVGroup.of(g) for g in KV2))
    d = open_dumps([str(tmp_path / "s.safetensors")])
    log: list = []
    for k in ("rows.positions", "rows.slot_mapping", "rows.slot_group"):
        d.columns[k] = _IndexSpy(d.columns[k], log)
    found, members = R._slot_pass(d)
    assert found == [] and log and all(kind == "slice" for kind, _ in log)
    log.clear()
    assert R.check_slot_partition(d, members) == [] and log == []  # the pass's summaries, clean sets unread
    assert R.check_slot_partition(d) == [] and log and all(kind == "slice" for kind, _ in log)  # its own pass
    f = random_slot_dump(tmp_path / "f.safetensors", np.random.default_rng(4), 60, 4, 1)
    want = old_check_slot_partition(f)
    assert want and R.check_slot_partition(f, R._slot_pass(f)[1]) == want == R.check_slot_partition(f)


def test_slot_rules_make_one_pass_for_both(tmp_path, monkeypatch):
    """check_slot_rules (what replay runs, on one background thread) reads the entries once for both rules, with
    the findings of the reference and of the two rules called alone; on two threads at once as well."""
    from concurrent.futures import ThreadPoolExecutor

    from slot_reference import old_check_slot_partition, old_check_slots

    import dcptool.check.slots as R

    d = random_slot_dump(tmp_path / "s.safetensors", np.random.default_rng(21), 80, 4, 2)
    want = old_check_slots(d), old_check_slot_partition(d)
    passes = []
    real = R._slot_pass
    monkeypatch.setattr(R, "_slot_pass", lambda *a, **k: passes.append(1) or real(*a, **k))
    assert R.check_slot_rules(d) == want and len(passes) == 1
    assert (R.check_slot_partition(d), R.check_slots(d)) == want[::-1] and len(passes) == 3
    with ThreadPoolExecutor(2) as pool:
        for _ in range(3):
            a, b = pool.submit(R.check_slot_rules, d), pool.submit(R.check_slot_rules, d)
            assert a.result() == b.result() == want


@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 1000, 4099])
def test_true_before_counts_like_a_cumsum(rng, n):
    """The screen's per-run counts (8 bools summed per 64-bit word): runs of every length, starts in any
    byte of a word, repeated starts, the padding past n."""
    from dcptool.check.slots import _true_before

    for density in (0.0, 0.3, 1.0):
        wpad = np.zeros((n // 8 + 1) * 8, bool)
        wpad[:n] = rng.random(n) < density
        start = np.unique(np.r_[0, rng.integers(0, n + 1, 40), n])
        start = np.sort(np.r_[start, start[: 3]])  # (repeats)
        assert (_true_before(wpad, start) == np.r_[0, np.cumsum(wpad[:n])][start]).all()

