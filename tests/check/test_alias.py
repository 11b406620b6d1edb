"""alias.py: micro-batches sharing a DCP buffer, graph replays reading another buffer than their capture."""

from conftest import obs, rules, run, worked_example


def test_alias_between_micro_batches_and_between_capture_and_replay(tmp_path):
    o = worked_example(False)
    o[1].buffer, o[2].buffer = 0x1000, 0x1000
    res = run(tmp_path, o)
    assert rules(res) == [(2, "alias")]
    o[2].buffer = 0x2000
    assert run(tmp_path, o).findings == []
    cap = [obs(step=-1, site="capture", graph=2, buffer=0xA0), obs(step=1, graph=3, buffer=0xA0),
           obs(step=2, graph=3, buffer=0xB0), obs(step=3, graph=3, num_reqs_padded=4, buffer=0xA0)]
    res = run(tmp_path, cap)
    assert rules(res) == [(2, "alias")]
    assert res.findings[0].detail["captured"] == 0xA0
