"""schema.py: the one encoding of obs.graph (DESIGN §2)."""

import pytest

from dcptool.schema import GraphMode


def test_graph_mode_values_are_design_s2():
    assert [int(m) for m in GraphMode] == [0, 1, 2, 3]
    assert [m.name for m in GraphMode] == ["EAGER", "PIECEWISE", "FULL_CAPTURE", "FULL_REPLAY"]


def test_recorder_names_parse_as_before():
    old = {"eager": 0, "piecewise": 1, "capture": 2, "full-capture": 2, "replay": 3, "full-replay": 3}
    assert {k: int(GraphMode.parse(k)) for k in old} == old
    with pytest.raises(KeyError):
        GraphMode.parse("full")


def test_vllm_runtime_modes_and_dispatch_as_recorded():
    assert [GraphMode.of_vllm(n) for n in ("NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE", None)] == [0, 1, 3, 0, 0]
    assert GraphMode.FULL_REPLAY.recorded(capturing=True) is GraphMode.FULL_CAPTURE
    assert GraphMode.FULL_CAPTURE.recorded(capturing=False) is GraphMode.FULL_REPLAY
    assert GraphMode.PIECEWISE.recorded(capturing=True) is GraphMode.PIECEWISE
    assert not GraphMode.PIECEWISE.full and GraphMode.FULL_REPLAY.full
