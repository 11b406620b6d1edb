"""runner.py: the configuration checks and the fault table of the runner model (simulate drives it)."""

import pytest

from dcptool.model.runner import FAULT_WHERE, FAULTS, SimConfig, SimError


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
    # DESIGN §1 "Checked against vLLM's releases": the two faults no release shipped
    assert FAULT_WHERE["ubatch-parent-rows"] == FAULT_WHERE["pcp-stale"] == "main only"
    assert FAULT_WHERE["dummy-none"] == "0.27–0.29" and FAULT_WHERE["dflash-capture-none"] == "0.27–0.28"
