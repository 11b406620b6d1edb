"""The vLLM plugin's state and Recorder (state) against a fake vLLM: file names and rollover, DCP size and rank,
CUDA-graph capture, and a failure that stops recording without reaching the engine."""

import os

from vllm_cases import STEPS, run_case


def test_rolls_files_and_names_them_by_rank(tmp_path):
    body = """
    ps._DCP = ps.Group(2, 1)
    for _ in range(5):
        build(batch(view=(8, 12, 0, 0)), NONE)
    """
    out = run_case(tmp_path, body, env={"DCPTOOL_ROLLOVER": "2"})
    assert [os.path.basename(f) for f in out["files"]] == [f"rank1.0000{i}.safetensors" for i in range(3)]
    d = out["dump"]
    assert d.n == 5 and d["obs.rank"].tolist() == [1] * 5 and d["obs.step"].tolist() == list(range(5))


def test_builds_inside_graph_capture_are_skipped_not_copied(tmp_path):
    before = """
    import types
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(is_available=lambda: True, is_current_stream_capturing=lambda: True)
    sys.modules["torch"] = torch
    """
    out = run_case(tmp_path, STEPS, before=before)
    assert out["files"] == [] and out["results"][0] == {"num_reqs": 4, "dcp": [9, 13, 0, 0]}
    assert "disabled" not in out["stderr"]


def test_without_a_dcp_group_it_records_dcp_size_1(tmp_path):
    body = """
    ps._DCP = None
    build(batch(view=None), NONE)
    """
    out = run_case(tmp_path, body)
    d = out["dump"]
    assert d.config.dcp_size == 1 and d["obs.has_dcp"].tolist() == [0]


def test_a_failure_while_recording_never_reaches_the_engine(tmp_path):
    body = """
    b = batch()
    del b.num_tokens_after_padding  # a batch without a field only the recorder reads
    out["results"].append(build(b, NONE))
    out["results"].append(build(batch(), NONE))  # recording has stopped; the engine goes on
    """
    out = run_case(tmp_path, body)
    assert out["results"] == [{"num_reqs": 2, "dcp": [9, 13]}] * 2
    assert out["stderr"].count("dcptool: vLLM recording disabled") == 1 and "AttributeError" in out["stderr"]
    assert out["files"] == []


def test_dcptool_record_max_gb_caps_the_recording(tmp_path):
    body = """
    ps._DCP = ps.Group(2, 1)
    for _ in range(5):
        build(batch(view=(8, 12, 0, 0)), NONE)
    """
    out = run_case(tmp_path, body, env={"DCPTOOL_ROLLOVER": "2", "DCPTOOL_RECORD_MAX_GB": "1e-9"})
    assert [os.path.basename(f) for f in out["files"]] == ["rank1.00000.safetensors"]
    assert out["dump"].n == 2 and out["dump"].capped == [1] and "size cap" in out["stderr"]


GUARD = {"DCPTOOL_RECORD": "", "DCPTOOL_GUARD": "{guard}"}


def _guard_case(tmp_path, body, before=""):
    env = {k: v.format(guard=tmp_path / "guard") for k, v in GUARD.items()}
    return run_case(tmp_path, body, before=before, env=env)


def test_guard_is_silent_on_right_builds_and_checks_captured_ones(tmp_path):
    """DCPTOOL_GUARD alone: the Guard instead of the Recorder; right builds write nothing, inside capture too."""
    before = """
    import types
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(is_available=lambda: True, is_current_stream_capturing=lambda: True)
    torch.Tensor = type("Tensor", (), {})  # (the builds hand numpy arrays: the Guard's host path)
    sys.modules["torch"] = torch
    """
    right = """
    with plugin.step():
        out["results"].append(build(batch(), FULL))
        out["results"].append(build(batch(), NONE))
    """
    out = _guard_case(tmp_path, right, before)
    assert out["files"] == [] and not (tmp_path / "guard").exists() and not (tmp_path / "rec").exists()
    assert "disabled" not in out["stderr"]
    wrong = """
    with plugin.step():
        build(batch(view=(9, 12, 0, 0)), FULL)
    """
    out = _guard_case(tmp_path, wrong, before)
    assert len(out["files"]) == 1 and out["dump"].n == 1  # checked inside capture (the Recorder skips those)
    out = _guard_case(tmp_path, STEPS, before)  # (its last build hands attention None)
    assert len(out["files"]) == 1 and out["dump"].n == 3 and "(missing) at step 1" in out["stderr"]


def test_guard_dumps_the_first_wrong_build(tmp_path):
    body = """
    for k in range(3):
        with plugin.step():
            build(batch(view=(9, 13, 0, 0) if k != 1 else (9, 12, 0, 0)), FULL)
    """
    out = _guard_case(tmp_path, body)
    assert len(out["files"]) == 1 and os.path.dirname(out["files"][0]) == str(tmp_path / "guard")
    d = out["dump"]
    assert d.n == 2 and d["obs.step"].tolist() == [0, 1] and d.config.engine == "vllm"
    assert "dcptool Guard: wrong DCP metadata (values) at step 1" in out["stderr"]


def test_record_wins_when_both_are_set(tmp_path):
    out = run_case(tmp_path, STEPS, env={"DCPTOOL_GUARD": str(tmp_path / "guard")})
    assert out["files"] and out["dump"].n > 0 and not (tmp_path / "guard").exists()
    assert "DCPTOOL_GUARD is ignored" in out["stderr"]
