"""replay.py, the pipeline: --split, --obs row views, bounded replay, provenance cost on clean dumps."""

from conftest import write
from test_rules import run, worked_example

from dcptool.dump import open_dumps
from dcptool.replay import replay


def test_split_reproduces_vllm_micro_batches(tmp_path):
    from dcptool.replay import splits

    d = open_dumps([write(tmp_path / "d.safetensors", worked_example(False)[:1])])
    s = splits(d, 2)
    assert [(x.ub.slice.req_start, x.ub.slice.req_stop, x.ub.slice.tok_start, x.ub.slice.tok_stop) for x in s] == [
        (0, 3, 0, 7), (2, 5, 7, 14)]
    assert s[0].ub.query_start_loc.tolist() == [0, 1, 2, 7] and s[1].ub.query_start_loc.tolist() == [0, 5, 6, 7]
    assert s[0].ub.seq_lens.tolist() == [64, 96, 507] and s[1].ub.seq_lens.tolist() == [512, 32, 48]
    assert s[0].dcp_local_seq_lens.tolist() == [32, 48, 254] and s[1].dcp_local_seq_lens.tolist() == [256, 16, 24]


def test_split_checks_recorded_micro_batches(tmp_path):
    o = worked_example(False)
    d = open_dumps([write(tmp_path / "d.safetensors", o)])
    assert [f.rule for f in replay(d, "torch", split=2).findings] == []
    res = replay(d, "torch", split=3)  # recorded with K=2: disagrees with a 3-way split
    assert {f.rule for f in res.findings} == {"ubatch-slice"} and res.findings[0].detail["split"]


def test_rows_view(tmp_path):
    o = worked_example(True)
    d = open_dumps([write(tmp_path / "d.safetensors", o)])
    v = replay(d, "torch", obs=1).rows_view
    assert v.seq_lens == [64, 96, 507] and v.expected == [32, 48, 254] and v.recorded == [32, 48, 256]
    assert v.expected_all_ranks[2] == [254, 253]
    assert v.verdict == ["ok", "ok", "WRONG"] and [f.rule for f in v.findings] == ["stale"]


def test_provenance_costs_nothing_on_clean_dumps(tmp_path, monkeypatch):
    from dcptool.provenance import Provenance

    def boom(self, *a):
        raise AssertionError("provenance index built for a clean dump")

    monkeypatch.setattr(Provenance, "prepare", boom)
    monkeypatch.setattr(Provenance, "_lead", boom)
    assert run(tmp_path, worked_example(False)).findings == []


def test_bounded_replay_gives_the_same_findings(tmp_path):
    """Bounded mode (dumps larger than RAM) drops pages as it goes; the answer must not change."""
    from pathlib import Path

    sample = str(Path(__file__).resolve().parents[1] / "samples" / "legacy.safetensors")
    a = replay(open_dumps([sample], bounded=False), "torch")
    b = replay(open_dumps([sample], bounded=True), "torch", bounded=True)
    assert [f.to_json() for f in a.findings] == [f.to_json() for f in b.findings] and a.findings
