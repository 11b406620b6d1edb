"""config.py: the configuration checks, the fault table, and which faults a configuration exercises."""

import pytest
from simulate_cases import SMALL, run

from dcptool.model.config import FAULT_WHERE, FAULTS, SimConfig, SimError, applicability


def test_validation_errors():
    for kw, msg in ((dict(dcp=0), "--dcp"), (dict(pipeline="new"), "--pipeline"), (dict(inject=("nope",)), "nope"),
                    (dict(interleave=16, page_size=8), "multiple of --interleave"),
                    (dict(pipeline="legacy", inject=("sentinel",)), "already injects"),
                    (dict(cudagraph="full-decode"), "--cudagraph"),
                    (dict(pcp=2, spec_method="dflash"), "only MTP")):
        with pytest.raises(SimError, match=msg):
            SimConfig(**kw).validate()


def test_fault_labels_cover_every_fault():
    assert list(FAULT_WHERE) == list(FAULTS)
    # docs/faults.md: the two faults no release shipped (main only)
    assert FAULT_WHERE["ubatch-parent-rows"] == FAULT_WHERE["pcp-stale"] == "main only"
    assert FAULT_WHERE["dummy-none"] == "0.27–0.29" and FAULT_WHERE["dflash-capture-none"] == "0.27–0.28"


def test_not_applicable_faults_are_reported_not_injected(tmp_path):
    res, d, rr = run(SimConfig(dcp=2, pcp=1, cudagraph="none", inject=("pcp-stale", "sentinel", "dummy-none"),
                               **SMALL), tmp_path)
    assert not res.faults["pcp-stale"].applicable and "--pcp > 1" in res.faults["pcp-stale"].why
    assert not res.faults["sentinel"].applicable
    assert res.faults["dummy-none"].applicable and res.faults["dummy-none"].count > 0
    assert set(d.injected[0]) == {"dummy-none"}
    assert set(applicability(SimConfig(dcp=1)).values()) == {"needs --dcp > 1"}
