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


# --------------------------------------------------------------------------------------------
# The block renderer (render_texts, json_blocks: %-formats applied by map) against a per-finding reference

from types import SimpleNamespace  # noqa: E402

from dcptool.check.provenance import Source  # noqa: E402

# strings from a file that JSON must escape or that a format would misread: quotes, backslashes, control characters
# (ESC, BEL, NUL), non-ASCII, a character past the BMP, a lone surrogate (a non-UTF-8 file name), %, braces
AWKWARD = ['attn_metadata', 'q"uote', 'back\\slash', 'esc\x1b[31mred', 'bel\x07\x00nul', 'ünïcode', 'emoji\U0001f600',
           'bad\udcff\udc9b', '100%d%s', '{0}{ref}{', 'tab\tnew\nline', ' ', '']


class _StubDump:
    """What a FindingTable reads of a dump, with any strings for the files and sites."""

    def __init__(self, rng, n: int, files: list[str], sites: list[str]):
        self.files = files
        self.n = n
        self.file_index = rng.integers(0, len(files), n)
        self.file_obs = rng.integers(0, 10**7, n)
        self.columns = {"obs.step": rng.integers(0, 10**6, n), "obs.site": rng.integers(0, len(sites), n),
                        "obs.rank": rng.integers(0, 8, n), "obs.ubatch": rng.integers(-1, 3, n),
                        "obs.buffer": rng.integers(0, 2**48, n)}
        self.config = SimpleNamespace(sites=tuple(sites), dcp_size=int(rng.integers(1, 4097)),
                                      cp_interleave=int(rng.integers(1, 65)),
                                      page_size=[None, 16, int(rng.integers(1, 10**4))][int(rng.integers(0, 3))])

    def __getitem__(self, k):
        return self.columns[k]

    def order_of(self, idx):
        return np.asarray(idx, np.int64)

    def site_name(self, i):
        return self.config.sites[int(self.columns["obs.site"][i])]

    def file_of(self, i):
        return self.files[int(self.file_index[i])]


_REF_EXPLAIN = {  # (the texts as the per-finding renderer wrote them)
    "parent-rows": "copied from the parent batch (obs {ref}, {site}); recompute from the micro-batch's own seq_lens",
    "earlier-in-step": "derived from an earlier batch of this step (obs {ref}, {site}), e.g. the global batch "
                       "before the PCP partition; compute it from the final batch",
    "earlier-step": "left over from step {step} (obs {ref}, {site}); the buffer was not refreshed "
                    "(e.g. baked into a CUDA graph)",
}


def _reference_text(d, col: dict, r: int, stored: dict) -> tuple[str, dict]:
    """One finding's text and detail, one f-string each (the renderer before the blocks)."""
    cfg = d.config
    kind, code, i = int(col["kind"][r]), int(col["rule_code"][r]), int(col["index"][r])
    row, rec, exp, wr, a0, a1 = (int(col[x][r]) for x in ("row", "recorded", "expected", "wrong_rows", "a0", "a1"))
    ref = lambda j: f"{d.files[int(d.file_index[j])]}:{int(d.file_obs[j])}"  # noqa: E731
    if kind == F.STORED:
        return stored[r]
    if kind == F.MISSING:
        return (f"dcp_local_seq_lens is None with dcp_size {cfg.dcp_size}; attention metadata would fail with "
                "'NoneType' object is not subscriptable"), {}
    if kind == F.STRAY:
        return "a DCP view is present with dcp_size 1; the engine should pass None", {}
    if kind == F.SHAPE:
        return f"DCP view has {a0} rows, must have num_reqs_padded = {a1}", {"length": a0, "expected_length": a1}
    if kind == F.PADDING:
        return f"padded row {row} holds {rec}, must be 0 ({wr} bad padded row(s); rows >= num_reqs {a0})", {}
    if kind == F.PAGES:
        why = " = the global count: page counts were computed from the global length" if rec == a0 else ""
        return (f"attention plan claims {rec} pages for row {row}{why}; this rank owns {exp} "
                f"(cdiv(local {a1}, {cfg.page_size}))"), {"claimed": rec, "allowed": exp, "global": a0}
    buf = d["obs.buffer"]
    if kind == F.ALIAS_UB:
        return (f"micro-batch {int(d['obs.ubatch'][i])} reads the same DCP buffer as micro-batch "
                f"{int(d['obs.ubatch'][a0])} (obs {ref(a0)}); each micro-batch needs its own buffer"), \
            {"buffer": int(buf[i]), "other_obs": int(d.file_obs[a0]), "other_ref": ref(a0)}
    if kind == F.ALIAS_GRAPH:
        return (f"full-graph replay reads DCP buffer {int(buf[i]):#x} but the graph was captured on "
                f"{int(buf[a0]):#x} (obs {ref(a0)}); the replay sees stale values"), \
            {"buffer": int(buf[i]), "captured": int(buf[a0]), "capture_obs": int(d.file_obs[a0]),
             "capture_ref": ref(a0)}
    rws = f"row {row} is {rec}, expected {exp} ({wr} wrong row{'s' if wr > 1 else ''})"
    rule = RULES[code]
    if rule == "stale":
        s = max(int(col["source"][r]), 0)
        why = _REF_EXPLAIN[F.RELATIONS[int(col["relation"][r])]].format(
            ref=ref(s) if col["source"][r] >= 0 else f"{d.files[0]}:0",
            site=cfg.sites[int(d["obs.site"][s])] if col["source"][r] >= 0 else cfg.sites[0],
            step=int(d["obs.step"][s]) if col["source"][r] >= 0 else 0)
        return f"stale DCP view, {why}; {rws}", {}
    if rule == "global":
        return f"DCP view holds the global seq_lens, not this rank's local lengths; {rws}", {}
    if rule == "wrong-rank":
        return f"DCP view holds rank {a0}'s local lengths; pass this rank's dcp_rank; {rws}", {"rank": a0}
    if rule == "wrong-interleave":
        return (f"DCP view was computed with interleave {a0}, the dump's is {cfg.cp_interleave} (check "
                f"cp_kv_cache_interleave_size); {rws}"), {"interleave": a0}
    return rws, {}


def _reference_line(d, t: FindingTable, r: int) -> str:
    """json.dumps of the Finding that column row r is, built field by field."""
    col, stored = t._cols, t._stored
    i, s = int(col["index"][r]), int(col["source"][r])
    text, detail = _reference_text(d, col, r, stored)
    opt = [int(col[f][r]) if col[m][r] else None for f, m in zip(("row", "recorded", "expected"), F._MASK)]
    source = None if s < 0 else Source(index=s, obs=int(d.file_obs[s]), file=d.file_of(s), step=int(d["obs.step"][s]),
                                       relation=F.RELATIONS[int(col["relation"][r])], site=d.site_name(s),
                                       ubatch=int(d["obs.ubatch"][s]))
    f = Finding(rule=RULES[int(col["rule_code"][r])], index=i, obs=int(d.file_obs[i]), file=d.file_of(i),
                step=int(d["obs.step"][i]), site=d.site_name(i), rank=int(d["obs.rank"][i]),
                ubatch=int(d["obs.ubatch"][i]), row=opt[0], recorded=opt[1], expected=opt[2],
                wrong_rows=int(col["wrong_rows"][r]), text=text, source=source, detail=detail)
    return json.dumps(f.to_json())


def _random_table(rng, d, n: int) -> FindingTable:
    """n findings of every kind (and of each VALUE rule, stale by each relation, with a source or none) on random
    observations and numbers, some fields absent, in a random order."""
    parts = []
    big = lambda: rng.integers(-(2**40), 2**40, n)  # noqa: E731
    masks = {m: rng.random(n) < 0.8 for m in F._MASK}
    for kind in (F.VALUE, F.MISSING, F.PADDING, F.SHAPE, F.STRAY, F.PAGES, F.ALIAS_UB, F.ALIAS_GRAPH):
        idx = rng.integers(0, d.n, n)
        rule = {F.VALUE: rng.choice([RULES.index(x) for x in ("stale", "global", "wrong-rank", "wrong-interleave",
                                                               "mismatch", "rank-sum")], n),
                F.MISSING: "missing", F.PADDING: "padding", F.SHAPE: "shape", F.STRAY: "stray", F.PAGES: "pages",
                F.ALIAS_UB: "alias", F.ALIAS_GRAPH: "alias"}[kind]
        rec, a0 = big(), big()
        same = rng.random(n) < 0.5  # (pages: the global count claimed)
        a0[same] = rec[same]
        other = rng.integers(0, d.n, n)
        src = np.where(rng.random(n) < 0.9, rng.integers(0, d.n, n), -1)
        parts.append(FindingTable.build(
            d, idx, rule, kind, row=rng.integers(0, 10**6, n), recorded=rec, expected=big(),
            wrong_rows=rng.integers(0, 4, n), a0=other if kind in (F.ALIAS_UB, F.ALIAS_GRAPH) else a0, a1=big(),
            source=np.where(rule == RULES.index("stale"), src, -1) if kind == F.VALUE else None,
            relation=rng.integers(0, 3, n) if kind == F.VALUE else None, **masks))
    w = F.Written(d)
    for k in range(n):
        w.add(int(rng.integers(0, d.n)), RULES[int(rng.integers(0, len(RULES)))], rng.choice(AWKWARD) + f" {k}",
              row=None if k % 3 == 0 else k, recorded=-k, detail={rng.choice(AWKWARD): [k, rng.choice(AWKWARD)]},
              relation=rng.choice([None, *F.RELATIONS]))
    parts.append(w.table())
    t = FindingTable.concat(d, parts)
    return t[rng.permutation(len(t))]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n", [1, 7, 60])
def test_block_rendering_equals_a_per_finding_reference(seed, n):
    """Every kind of finding, files and sites with strings JSON must escape (or % and str.format would misread):
    the JSON lines (blocks of 1, 5 and the default) and each finding's text and detail read alone equal the
    per-finding reference's, byte for byte."""
    rng = np.random.default_rng(seed)
    files = [str(x) for x in rng.choice(AWKWARD, int(rng.integers(1, 4)), replace=False)]
    d = _StubDump(rng, 50, [f + ".safetensors" for f in files], [str(x) for x in rng.permutation(AWKWARD)])
    t = _random_table(rng, d, n)
    rows = t._rows().tolist()
    want = [_reference_line(d, t, r) for r in rows]
    assert len(want) == 9 * n
    for block in (1, 5, 16384):
        assert list(t.json_lines(block)) == want
    for k, r in enumerate(rows):
        text, detail = _reference_text(d, t._cols, r, t._stored)
        assert (t[k].text, t[k].detail) == (text, detail)
        assert json.dumps(t[k].to_json()) == want[k]
