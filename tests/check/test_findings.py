"""findings.py: the FindingTable (columns, a Finding made per row read, lazy messages), Written, and every report's
output byte-identical to the golden outputs (tests/data/golden)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from conftest import ROOT

GOLDEN = ROOT / "tests" / "data" / "golden"
sys.path.insert(0, str(GOLDEN))

import make_golden  # noqa: E402

EXPECTED = json.loads((GOLDEN / "golden.json").read_text())


@pytest.mark.parametrize("dump", [p.stem for p in make_golden.dumps()])
def test_output_is_byte_identical_to_the_per_finding_objects(dump, tmp_path):
    """Text, JSON Lines, HTML, --split and --obs outputs of every golden dump hash as before (seconds masked).
    On a failure, `python tests/data/golden/make_golden.py outputs DIR` on the old and new code shows the diff."""
    path = next(p for p in make_golden.dumps() if p.stem == dump)
    bad = []
    for mode, args in make_golden.MODES:
        got = make_golden.digest(make_golden.run_mode(path, mode, args, tmp_path))
        if got != EXPECTED[f"{dump}.{mode}"]:
            bad.append(mode)
    assert not bad, f"{dump}: output differs from the golden in {bad}"


# --------------------------------------------------------------------------------------------
# FindingTable semantics

from dcptool.check import findings as F  # noqa: E402
from dcptool.check.findings import Finding, FindingTable  # noqa: E402
from dcptool.check.replay import replay  # noqa: E402
from dcptool.dcp.rules import RULE_ORDER, RULES  # noqa: E402
from dcptool.dump import open_dumps  # noqa: E402

LEGACY = str(ROOT / "samples" / "legacy.safetensors")


@pytest.fixture(scope="module")
def legacy():
    d = open_dumps([LEGACY])
    return d, replay(d, "torch")


def test_table_is_a_sequence_of_findings_in_design_order(legacy):
    d, res = legacy
    t = res.findings
    assert isinstance(t, FindingTable) and len(t) == len(list(t)) > 100
    items = list(t)
    assert all(isinstance(f, Finding) for f in items)
    keys = [(f.index, RULE_ORDER[f.rule]) for f in items]
    assert keys == sorted(keys)  # observation order, then the rule table's order
    assert t[0] == items[0] and t[-1] == items[-1] and t[len(t) - 1] == items[-1]
    with pytest.raises(IndexError):
        t[len(t)]
    part = t[10:20]
    assert isinstance(part, FindingTable) and len(part) == 10 and list(part) == items[10:20]
    assert list(t[::7]) == items[::7] and list(t[-3:]) == items[-3:]
    assert t == items and t[:0] == [] and t != items[:-1]
    assert t[5] is t[5]  # read by position: the same object (the HTML report finds row views' findings by id)


def test_array_accessors_match_the_findings(legacy):
    d, res = legacy
    t = res.findings
    items = list(t)
    assert t.index.tolist() == [f.index for f in items]
    assert t.rule.tolist() == [f.rule for f in items]
    assert [RULES[k] for k in t.rule_code.tolist()] == [f.rule for f in items]
    for name in ("obs", "step", "rank", "ubatch", "wrong_rows"):
        assert getattr(t, name).tolist() == [getattr(f, name) for f in items], name
    assert t.site.tolist() == [f.site for f in items]
    for name in ("row", "recorded", "expected"):
        got = [v if h else None for v, h in zip(getattr(t, name).tolist(), getattr(t, "has_" + name).tolist())]
        assert got == [getattr(f, name) for f in items], name
    assert t.source.tolist() == [-1 if f.source is None else f.source.index for f in items]
    rel = [F.RELATIONS[k] if k >= 0 else None for k in t.relation.tolist()]
    assert rel == [None if f.source is None else f.source.relation for f in items]
    assert t.severity_code.tolist() == [int(f.severity == "error") for f in items]
    sl = t[3:9]
    assert sl.index.tolist() == t.index[3:9].tolist() and sl.step.tolist() == t.step[3:9].tolist()
    assert res.by_rule() == {r: sum(f.rule == r for f in items) for r in RULES if any(f.rule == r for f in items)}


def test_json_lines_stream_equals_the_findings_own_json(legacy):
    _, res = legacy
    import json as js

    assert list(res.findings.json_lines()) == [js.dumps(f.to_json()) for f in res.findings]
    assert list(res.findings[7:30].json_lines()) == [js.dumps(f.to_json()) for f in res.findings[7:30]]


def test_messages_are_rendered_only_for_what_is_shown(monkeypatch, tmp_path):
    """The text report renders the 100 findings it shows (and the first), not the other thousands: counted
    through a patched renderer."""
    from conftest import cli

    calls = []
    real_many = F.render_texts
    monkeypatch.setattr(F, "render_texts", lambda t, rows: calls.extend([1] * rows.size) or real_many(t, rows))
    d = open_dumps([LEGACY])
    res = replay(d, "torch")
    made = len(getattr(res, "problems", []))  # replay renders one finding per problem (its first), nothing else
    assert len(res.findings) > 1000 and len(calls) <= made < 50
    calls.clear()
    assert res.errors + res.warnings == len(res.findings) and res.by_site() and calls == []
    r = cli("replay", LEGACY)
    assert r.returncode == 1 and 0 < len(calls) <= 101 + made
    calls.clear()
    r = cli("replay", LEGACY, "--json", "--max-findings", "5")
    assert r.stdout.count('"type": "finding"') == 5 + 1 and 5 <= len(calls) <= 6 + made  # 5 lines, the first


def test_concat_sorts_stably_and_keeps_written_texts(legacy):
    d, _ = legacy
    a = F.Written(d)
    a.add(5, "alias", "second", detail={"x": 1})
    a.add(2, "alias", "a")
    b = FindingTable.build(d, [5, 1], "missing", F.MISSING)
    c = F.Written(d)
    c.add(5, "alias", "third", row=3, recorded=-1, expected=0, wrong_rows=2)
    t = FindingTable.concat(d, [a.table(), b, c.table()])
    assert [(f.index, f.rule, f.text if f.rule == "alias" else "") for f in t] == [
        (1, "missing", ""), (2, "alias", "a"), (5, "missing", ""), (5, "alias", "second"), (5, "alias", "third")]
    assert t[3].detail == {"x": 1} and (t[4].row, t[4].recorded, t[4].expected, t[4].wrong_rows) == (3, -1, 0, 2)
    assert (t[3].row, t[3].recorded, t[3].expected, t[3].wrong_rows) == (None, None, None, 0)
    assert FindingTable.concat(d, []) == [] and len(FindingTable.concat(d, [t[:2], t[3:]])) == 4
    assert F.Written(d).table() == [] and list(t[2:4].json_lines()) == [json.dumps(f.to_json()) for f in t[2:4]]


def test_a_row_read_alone_renders_as_the_block_writer_does(legacy):
    """t[k] (text and detail of one row) and the JSON Lines writer (a block of rows) give the same finding, for
    every kind of finding the legacy recording has."""
    _, res = legacy
    t = res.findings
    kinds = {}
    for k, kind in enumerate(t.kind.tolist()):
        kinds.setdefault((kind, t.rule_code[k]), k)
    assert len(kinds) >= 6
    for k in kinds.values():
        fresh = FindingTable.concat(t.d, [t[k : k + 1]])  # (no Finding made yet in this table)
        assert json.dumps(fresh[0].to_json()) == next(t[k : k + 1].json_lines())


def test_cells_are_the_timelines_columns(legacy):
    d, res = legacy
    t = res.findings
    cells = t.cells()
    assert cells.shape == (len(t), 5) and cells.dtype == np.int64
    assert cells[:, 0].tolist() == t.site_code.tolist() and cells[:, 4].tolist() == t.rule_code.tolist()
    assert [tuple(r) for r in cells[:50].tolist()] == [
        (d.config.sites.index(f.site), f.rank, f.step, f.ubatch, RULES.index(f.rule)) for f in t[:50]]


def test_message_is_where_then_text():
    f = Finding(rule="stray", index=0, obs=0, file="f", step=3, site="a: b", rank=1, ubatch=-1, row=None,
                recorded=None, expected=None, wrong_rows=0, text="a DCP view is present")
    assert f.message == "step 3 a: b rank 1: a DCP view is present" and f.to_json()["message"] == f.message
    assert Finding(**{**f.__dict__, "ubatch": 2}).where == "step 3 a: b rank 1 ubatch 2"
