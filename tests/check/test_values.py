"""values.py: the per-observation value rules (missing, mismatch, padding, shape, stray, pages) on hand-built
dumps, each triggered and each quiet."""

import numpy as np
import pytest
from conftest import obs, rules, run, worked_example

BACKENDS = ["torch", "triton"]


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


def test_pages_names_the_global_count(tmp_path):
    seq = np.array([100, 33, 0], np.int32)
    good = obs(seq=seq, num_reqs=2, num_reqs_padded=3, kv_pages=[4, 2, 0])  # local 50, 17 -> 4, 2 pages of 16
    bad = obs(step=1, seq=seq, num_reqs=2, num_reqs_padded=3, kv_pages=[7, 3, 0])  # cdiv(100,16), cdiv(33,16)
    res = run(tmp_path, [good, bad], page_size=16)
    (f,) = res.findings
    assert (f.obs, f.rule, f.row, f.wrong_rows) == (1, "pages", 0, 2)
    assert f.detail == {"claimed": 7, "allowed": 4, "global": 7}
    assert "global" in f.message
