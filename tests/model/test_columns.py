"""columns.py (issue 15): the decode path's dcp_query_start_loc and global companion, the slot mappings, and the
faults injected on them, each found exactly where it touched."""

import numpy as np
import pytest
from simulate_cases import EXERCISE, MATRIX, SMALL, config_of, run, verify

from dcptool.check.replay import replay
from dcptool.dump import open_dumps
from dcptool.model.config import OPT_IN
from dcptool.model.simulate import FAULTS, SimConfig, simulate


def test_tot_local_with_a_sentinel_records_every_observation(tmp_path):
    """tot-local hands the global companion this rank's local lengths; with `sentinel` the view's padded rows hold
    -1, which no global length can be: only the real rows are taken, so no observation is dropped (it was, and
    the tot-local fault with it) and tot-lens still finds the fault."""
    import warnings

    cfg = config_of(EXERCISE["tot-local"], 3, inject=("tot-local", "sentinel"), steps=20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a dropped observation warns
        res, d, rr = run(cfg, tmp_path)
    assert res.faults["tot-local"].count > 0 and res.faults["sentinel"].count > 0
    assert "tot-lens" in rr.by_rule() and "padding" in rr.by_rule()
    assert (d["rows.dcp_tot_seq_lens"] >= 0).all()


def test_issue15_faults_are_opt_in_not_legacy_and_fixed_records_the_decode_path(tmp_path):
    assert OPT_IN == {"dcp-qsl-local", "tot-local", "rank-disagree", "slot-wrong-group", "slot-all-ranks"}
    assert OPT_IN <= set(FAULTS)
    assert not OPT_IN & set(config_of(MATRIX[2], 1, pipeline="legacy").faults)
    res, d, rr = run(config_of(MATRIX[5], 1), tmp_path)
    assert rr.findings == [] and not {"empty-mask", "tot-lens"} & set(rr.skipped)
    q, t = np.diff(d["obs.dqsl"]), np.diff(d["obs.tot"])
    assert (q > 0).sum() > 0 and np.array_equal(t[q > 0], q[q > 0] - 1)  # companion: num_decodes rows
    for i in np.flatnonzero(q > 0)[:50]:  # Q is query_start_loc's prefix, the same on every rank
        assert np.array_equal(d.dqsl_of(i), d.qsl_of(i)[: q[i]])
        assert np.array_equal(d.tot_of(i), d.seq_lens_of(i)[: t[i]])
    sites = {d.site_name(i) for i in np.flatnonzero(q > 0)}
    assert "prepare_inputs" not in sites and "attn_metadata" in sites  # attention builds only


@pytest.mark.parametrize("fault", ["dcp-qsl-local", "tot-local", "rank-disagree"])
def test_issue15_fault_found_exactly_where_it_touched_per_rank_files_too(fault, tmp_path):
    for per_rank in (False, True):
        cfg = config_of(EXERCISE[fault], 5, inject=(fault,))
        res = simulate(cfg, tmp_path / f"{per_rank}.safetensors", force=True, per_rank=per_rank)
        d = open_dumps(res.files)
        rr = replay(d, "torch")
        assert res.faults[fault].count > 0
        verify(res, d, rr)
        assert set(rr.by_rule()) == {FAULTS[fault][0]}


def test_slot_faults_per_rank_files_like_one_file(tmp_path):
    """Issue 15: the slot columns go through observe() per rank as through observe_many(), and each slot fault
    is found exactly where it touched in either layout; the fixed pipeline writes them and replays clean."""
    cfg = SimConfig(dcp=4, interleave=2, pcp=1, inject=("slot-wrong-group", "slot-all-ranks"), **SMALL)
    one, d1, r1 = run(cfg, tmp_path, "one.safetensors")
    many, dn, rn = run(cfg, tmp_path, "many.safetensors", per_rank=True)
    assert d1.has("obs.slots") and dn.has("obs.slots") and d1.config.kv_groups == dn.config.kv_groups
    assert np.array_equal(np.sort(d1["rows.slot_mapping"]), np.sort(dn["rows.slot_mapping"]))
    for res, d, rr in ((one, d1, r1), (many, dn, rn)):
        verify(res, d, rr)
        assert {"slots", "slot-partition"} <= set(rr.by_rule())
    fixed = run(SimConfig(dcp=4, interleave=2, pcp=1, **SMALL), tmp_path, "fixed.safetensors")[2]
    assert fixed.findings == [] and "slots" not in fixed.skipped
