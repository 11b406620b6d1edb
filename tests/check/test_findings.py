"""Columnar findings (issue 16 item 2): the FindingTable, lazy messages, and output byte-identical to the
per-finding Finding objects replay built before (golden outputs made by main a364428)."""

from __future__ import annotations

import json
import sys

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
    real, real_many = F.render_text, F.render_texts
    monkeypatch.setattr(F, "render_text", lambda *a: calls.append(1) or real(*a))
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


def test_concat_sorts_stably_and_keeps_issue_texts(legacy):
    d, _ = legacy
    from dcptool.check.findings import Issue, findings_of

    a = findings_of(d, [Issue(5, "alias", "second", {"detail": {"x": 1}}), Issue(2, "alias", "a", {})])
    b = FindingTable.build(d, [5, 1], "missing", F.MISSING)
    c = findings_of(d, [Issue(5, "alias", "third", {"row": 3, "recorded": -1, "expected": 0})])
    t = FindingTable.concat(d, [a, b, c])
    assert [(f.index, f.rule, f.text if f.rule == "alias" else "") for f in t] == [
        (1, "missing", ""), (2, "alias", "a"), (5, "missing", ""), (5, "alias", "second"), (5, "alias", "third")]
    assert t[3].detail == {"x": 1} and (t[4].row, t[4].recorded, t[4].expected) == (3, -1, 0)
    assert (t[3].row, t[3].recorded) == (None, None)
    assert FindingTable.concat(d, []) == [] and len(FindingTable.concat(d, [t[:2], t[3:]])) == 4


def test_old_style_results_still_slot_in(legacy):
    """A check that still returns (index, Finding) pairs, or Issues, is collected like a table (other branches'
    rules: their `found += ...` lines keep working)."""
    d, res = legacy
    from dcptool.check.findings import Issue

    col = F.Collector(d)
    col += [(f.index, f) for f in res.findings[:3]]
    col += [Issue(0, "stray", "x", {})]
    col += res.findings[3:6]
    t = col.table()
    assert list(t) == sorted([*res.findings[:6], F.Finding(**{**res.findings[0].__dict__, "rule": "stray",
                                                                "index": 0, "text": "x", "row": None,
                                                                "recorded": None, "expected": None,
                                                                "wrong_rows": 0, "source": None, "detail": {},
                                                                "obs": 0, "step": int(d["obs.step"][0]),
                                                                "site": d.site_name(0),
                                                                "rank": int(d["obs.rank"][0]),
                                                                "ubatch": int(d["obs.ubatch"][0])})],
                             key=lambda f: (f.index, RULE_ORDER[f.rule]))


def test_message_is_where_then_text():
    f = Finding(rule="stray", index=0, obs=0, file="f", step=3, site="a: b", rank=1, ubatch=-1, row=None,
                recorded=None, expected=None, wrong_rows=0, text="a DCP view is present")
    assert f.message == "step 3 a: b rank 1: a DCP view is present" and f.to_json()["message"] == f.message
    assert Finding(**{**f.__dict__, "ubatch": 2}).where == "step 3 a: b rank 1 ubatch 2"
