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


def test_one_exception_root():
    from dcptool.cli import Trouble
    from dcptool.dump import DumpError, OutputExistsError, WriteError
    from dcptool.kernel import BackendError
    from dcptool.replay import LimitError
    from dcptool.runner import SimError
    from dcptool.schema import DcptoolError

    for cls in (DumpError, WriteError, OutputExistsError, LimitError, SimError, BackendError, Trouble):
        assert issubclass(cls, DcptoolError), cls
    # the old bases stay, for callers that catch them
    assert issubclass(DumpError, ValueError) and issubclass(SimError, ValueError)
    assert issubclass(BackendError, RuntimeError) and issubclass(WriteError, OSError)


def test_library_error_is_one_line_exit_2(tmp_path, monkeypatch):
    """cli.py catches DcptoolError in one place: one line on stderr, exit 2, whatever raised it."""
    from conftest import cli, obs, write

    import dcptool.replay
    from dcptool.replay import LimitError

    def boom(*a, **k):
        raise LimitError("somewhere deep: past a documented limit")

    monkeypatch.setattr(dcptool.replay, "replay", boom)
    r = cli("replay", write(tmp_path / "d.safetensors", [obs()]))
    assert r.returncode == 2 and r.stderr == "dcptool: somewhere deep: past a documented limit\n" and r.stdout == ""
