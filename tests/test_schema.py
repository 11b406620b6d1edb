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


# issue 15: obs.dqsl / obs.tot (optional, with their row columns)


def _raw(path, cols_change):
    """A dump of two observations with both issue-15 columns, then `cols_change` applied, written unvalidated."""
    import numpy as np
    from conftest import obs

    from dcptool.dump import DumpConfig, encode, pack

    o = [obs(rank=r, dcp_query_start_loc=np.array([0, 1, 2]), dcp_tot_seq_lens=np.array([17, 25])) for r in (0, 1)]
    cfg, cols = pack(o, DumpConfig(dcp_size=2))
    cols_change(cols)
    header, tensors = encode(cfg, cols)
    path.write_bytes(header + b"".join(a.tobytes() for _, a in tensors))
    return str(path)


@pytest.mark.parametrize("change,key,what", [
    (lambda c: c.__setitem__("obs.dqsl", c["obs.dqsl"][[0, 2, 1]]), "obs.dqsl", "not monotone"),
    (lambda c: c.__setitem__("obs.tot", c["obs.tot"] + 1), "obs.tot", "must start at 0"),
    (lambda c: c.__setitem__("obs.tot", c["obs.tot"][:2]), "obs.tot", "offsets, expected n+1"),
    (lambda c: c.pop("rows.dcp_query_start_loc"), "rows.dcp_query_start_loc", "goes with obs.dqsl"),
    (lambda c: c.pop("obs.tot"), "obs.tot", "goes with rows.dcp_tot_seq_lens"),
    (lambda c: c["rows.dcp_tot_seq_lens"].__setitem__(1, -3), "rows.dcp_tot_seq_lens", "negative length -3"),
    (lambda c: c["obs.dqsl"].__setitem__(-1, 7), "obs.dqsl", "offsets end at 7 but the rows hold 6"),
])
def test_issue15_columns_bad_offsets_and_partners_exit_2_one_line(tmp_path, change, key, what):
    from conftest import cli

    p = _raw(tmp_path / "bad.safetensors", change)
    r = cli("replay", p)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.count("\n") == 1 and p in r.stderr and key in r.stderr and what in r.stderr, r.stderr


def test_issue15_columns_good_file_reads_and_inspect_lists_them(tmp_path):
    from conftest import cli

    from dcptool.dump import read_dump

    p = _raw(tmp_path / "ok.safetensors", lambda c: None)
    d = read_dump(p)
    assert d.dqsl_of(1).tolist() == [0, 1, 2] and d.tot_of(0).tolist() == [17, 25]
    r = cli("inspect", p, "--json")
    assert r.returncode == 0 and {"obs.dqsl", "rows.dcp_query_start_loc", "obs.tot",
                                  "rows.dcp_tot_seq_lens"} <= set(__import__("json").loads(r.stdout)["optional"])
