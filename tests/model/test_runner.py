"""runner.py: on the issue's matrix the fixed pipeline replays clean and every fault is found as its rule exactly
where it touched (docs/faults.md); vLLM 0.34's micro-batch split rule."""

import numpy as np
import pytest
from simulate_cases import EXERCISE, MATRIX, PAIR, config_of, run, verify

from dcptool.check.replay import replay
from dcptool.model.config import OPT_IN
from dcptool.model.simulate import FAULTS, applicability


@pytest.mark.parametrize("row", MATRIX, ids=lambda r: "N{}-I{}-P{}-K{}-U{}-{}-{}".format(*r))
def test_matrix_fixed_clean_each_fault_exact_legacy_all(row, tmp_path):
    seed = MATRIX.index(row) * 7919 + 11
    res, d, rr = run(config_of(row, seed), tmp_path, "fixed.safetensors")
    assert rr.findings == [], [f.message for f in rr.findings[:3]]
    assert res.faults == {} and d.injected == [{}]
    legacy = config_of(row, seed, pipeline="legacy")
    res, d, rr = run(legacy, tmp_path, "legacy.safetensors")
    verify(res, d, rr)
    why = applicability(legacy)
    # (the decode-path and slot faults are opt-in: --inject only, not the pre-fix ordering legacy models)
    assert {f for f, r in res.faults.items() if r.applicable} == {f for f, w in why.items() if w is None} - OPT_IN
    for fault in FAULTS:
        if why[fault] is None:
            verify(*run(config_of(row, seed, inject=(fault,)), tmp_path, f"{fault}.safetensors"))


@pytest.mark.parametrize("row", [MATRIX[2], MATRIX[4], MATRIX[9]], ids=["N2-P1", "N2-P2", "N8-P2"])
def test_many_seeds_fixed_clean_legacy_exact(row, tmp_path):
    for seed in range(100, 106):
        res, d, rr = run(config_of(row, seed), tmp_path, f"f{seed}.safetensors")
        assert rr.findings == []
        verify(*run(config_of(row, seed, pipeline="legacy"), tmp_path, f"l{seed}.safetensors"))


@pytest.mark.parametrize("fault", list(FAULTS))
def test_every_fault_is_exercised(fault, tmp_path):
    cfg = config_of(EXERCISE[fault], 3, inject=(fault,), steps=14, **PAIR.get(fault, {}))
    res, d, rr = run(cfg, tmp_path)
    rep = res.faults[fault]
    assert rep.applicable and rep.count > 0
    verify(res, d, rr)
    assert FAULTS[fault][0] in rr.by_rule()


@pytest.mark.parametrize("row", [MATRIX[2], MATRIX[4], MATRIX[5], (2, 1, 1, 2, 2, "none", "mtp"),
                                 (4, 1, 1, 2, 3, "piecewise", "mtp")],
                         ids=["N2-full", "N2-P2-full", "N4-piecewise", "N2-eager", "N4-U3-piecewise"])
def test_engine_0_34_fixed_clean_faults_exact(row, tmp_path):
    """simulate --engine-version 0.34.0: the fixed pipeline replays clean under the 0.34 rule (the dump
    says 0.34.0, so replay checks the split points), and every fault is still found exactly."""
    seed = 5
    res, d, rr = run(config_of(row, seed, engine_version="0.34.0"), tmp_path, "f34.safetensors")
    assert rr.findings == [], [f.message for f in rr.findings[:3]]
    assert d.config.engine_version == "0.34.0" and "--engine-version 0.34.0" in d.config.note
    verify(*run(config_of(row, seed, engine_version="0.34.0", pipeline="legacy"), tmp_path, "l34.safetensors"))
    # and the same workload under 0.33's rule replays clean too
    assert run(config_of(row, seed, engine_version="0.33.0"), tmp_path, "f33.safetensors")[2].findings == []


def test_engine_0_34_splits_uniform_decodes_on_request_boundaries(tmp_path):
    """Eager micro-batched uniform decodes with an odd request count: 0.34 splits between requests where
    0.33 cuts one in two; replaying the 0.34 dump by 0.33's rule flags exactly those micro-batches."""
    row = (2, 1, 1, 2, 2, "none", "mtp")
    _, d33, _ = run(config_of(row, 0, engine_version="0.33.0"), tmp_path, "a.safetensors")
    _, d34, _ = run(config_of(row, 0, engine_version="0.34.0"), tmp_path, "b.safetensors")
    assert d33.n == d34.n  # the same workload: only the split differs
    ub = np.flatnonzero(d34["obs.ubatch"] >= 0)
    moved = ub[d33["obs.tok_start"][ub] != d34["obs.tok_start"][ub]]
    assert moved.size > 0
    for i in moved.tolist():  # each moved split is a request boundary of its parent: nothing straddles
        p = int(d34["obs.parent"][i])
        assert int(d34["obs.tok_start"][i]) in d34.qsl_of(p).tolist()
    rr = replay(d34, "torch", engine_version="0.33.0")
    assert {f.rule for f in rr.findings} == {"ubatch-slice"}
    flagged = {f.index for f in rr.findings}
    # a moved split point moves both of its neighbours (K=2: micro-batch 0's end and 1's start)
    assert flagged == {i for i in ub.tolist() if (d33["obs.tok_start"][i], d33["obs.tok_stop"][i])
                       != (d34["obs.tok_start"][i], d34["obs.tok_stop"][i])}
