"""Root causes: findings grouped into problems, and known vLLM bugs named only where the
signature and the recorded version match."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import ROOT, cli, obs, write

from dcptool.check.problems import PATTERNS, STRADDLE, known_bugs, match_known, parse_version, problems
from dcptool.check.replay import replay
from dcptool.dcp.rules import RULE_OF_FAULT
from dcptool.dump import open_dumps
from dcptool.model.simulate import SimConfig, simulate

SAMPLES = ROOT / "samples"


def _own_obs(d, res, p) -> set[int]:
    return {res.findings[k].obs for k in p.findings.tolist() if res.findings[k].rule == p.rule}


def _each_fault_one_problem(d, res):
    """Every fault that touched something is exactly one problem of its rule, at exactly its observations."""
    touched = {k: set(v) for k, v in d.injected[0].items() if v}
    probs = res.problems
    assert len(probs) == len(touched)
    for fault, where in touched.items():
        mine = [p for p in probs if p.rule == RULE_OF_FAULT[fault] and _own_obs(d, res, p) == where]
        assert len(mine) == 1, fault
    # every finding belongs to exactly one problem
    held = np.sort(np.concatenate([p.findings for p in probs]))
    assert held.tolist() == list(range(len(res.findings)))


def test_legacy_sample_each_fault_is_a_problem_side_findings_attached():
    d = open_dumps([str(SAMPLES / "legacy.safetensors")])
    res = replay(d, "torch")
    _each_fault_one_problem(d, res)
    # rank-sum is never a problem of its own here: each joins the fault whose wrong rows broke the sum
    assert not [p for p in res.problems if p.rule == "rank-sum"]
    assert sum(p.side.get("rank-sum", 0) for p in res.problems) == res.by_rule()["rank-sum"]
    parent = next(p for p in res.problems if p.relation == "parent-rows")
    assert parent.pattern == PATTERNS[STRADDLE]
    # numbered by first occurrence
    assert [int(p.findings[0]) for p in res.problems] == sorted(int(p.findings[0]) for p in res.problems)


@pytest.fixture(scope="module")
def legacy_029(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim") / "legacy029.safetensors"
    simulate(SimConfig(pipeline="legacy", steps=20, engine_version="0.29.0"), out)
    d = open_dumps([str(out)])
    return d, replay(d, "torch")


def test_legacy_simulation_each_fault_is_a_problem(legacy_029):
    _each_fault_one_problem(*legacy_029)


def test_pcp_legacy_simulation_copied_rows_are_one_problem(tmp_path):
    # under PCP a micro-batch that copies its parent's rows is wrong in several rows, not only the straddling
    # one: still one mechanism, one problem
    out = tmp_path / "pcp.safetensors"
    simulate(SimConfig(pipeline="legacy", dcp=4, pcp=2, steps=60), out)
    d = open_dumps([str(out)])
    res = replay(d, "torch")
    _each_fault_one_problem(d, res)
    copied = next(p for p in res.problems if p.relation == "parent-rows")
    assert copied.pattern.startswith("real rows; in ") and "straddling" in copied.pattern


def test_known_bugs_named_where_signature_and_version_match(legacy_029):
    d, res = legacy_029
    named = {p.rule + (f"/{p.relation}" if p.relation else "") + "@" + ",".join(p.sites): p.known.bug.id
             for p in res.problems if p.known is not None and p.known.named}
    assert named["missing@dummy"] == "pr55212-dummy-none"
    assert named["missing@ubatch"] == "v1-ubatch-none"
    assert any(v == "pr48003-flashinfer-global-pages" for v in named.values())
    # main-only and no-release faults are not claimed for a release
    assert "pr55212-ubatch-parent-rows" not in named.values()
    line = next(p.line for p in res.problems if p.rule == "missing" and p.sites == ("dummy",))
    assert "matches vLLM PR #55212 (fixed in 0.30.0); you recorded 0.29.0" in line
    unnamed = [p for p in res.problems if p.rule in ("padding", "alias") or p.relation == "parent-rows"]
    assert unnamed and all("PR #" not in p.line for p in unnamed)


def test_known_bugs_not_named_post_fix_or_without_version(legacy_029):
    d, res = legacy_029
    post = replay(d, "torch", engine_version="0.30.0").problems
    assert len(post) == len(res.problems)
    # 0.30.0 has #55212 and the FlashInfer fix; only the V1 runner's micro-batches (until 0.34) still drop it
    assert [p.known.bug.id for p in post if p.known is not None and p.known.named] == ["v1-ubatch-none"]
    assert all("PR #" not in p.line for p in post)
    post = replay(d, "torch", engine_version="0.34.0").problems
    assert all(p.known is None or not p.known.named for p in post)
    assert all("matches" not in p.line for p in post)
    sample = replay(open_dumps([str(SAMPLES / "legacy.safetensors")]), "torch").problems
    dummy = next(p for p in sample if p.rule == "missing" and p.sites == ("dummy",))
    assert "no engine version recorded" in dummy.line and "PR #" not in dummy.line
    assert all("PR #" not in p.line for p in sample)


@pytest.mark.parametrize("rule,relation,sites,version,verdict", [
    ("missing", None, ("dummy",), "0.29.0", "match"),
    ("missing", None, ("dummy",), "vLLM 0.27.1", "match"),
    ("missing", None, ("dummy",), "0.30.0", "fixed"),
    ("missing", None, ("dummy",), "0.30.0.dev12+g1a2b3c", "dev"),
    ("missing", None, ("dummy",), None, "no-version"),
    ("missing", None, ("dummy",), "model (legacy pipeline)", "no-version"),
    ("missing", None, ("dummy",), "0.26.0", "not-affected"),
    ("missing", None, ("dflash_capture",), "0.29.0", "fixed"),
    ("missing", None, ("dflash_capture",), "0.28.0", "match"),
    ("stale", "parent-rows", ("ubatch",), "0.29.0", "not-affected"),
    ("stale", "parent-rows", ("ubatch",), "0.30.0.dev3", "dev"),
    ("pages", None, ("draft", "ubatch"), "0.29.0", "match"),
    ("ctx-agree", None, ("pcp_partition",), "0.29.0", "match"),
    ("ctx-agree", None, ("attn_metadata",), "0.30.0", "fixed"),
    ("ctx-chunks", None, ("ubatch",), "0.27.0", "match"),
    ("ctx-chunks", None, ("ubatch",), "0.28.0", "fixed"),
    ("topk-agree", None, ("attn_metadata",), "0.34.0", "not-affected"),  # (ROCm/ATOM #1832: no vLLM release)
    ("topk-agree", None, ("attn_metadata",), "0.35.0.dev2", "dev"),
    ("topk-empty", None, ("capture",), "0.29.0", "not-affected"),
])
def test_match_known_verdicts(rule, relation, sites, version, verdict):
    m = match_known(rule, relation, sites, version)
    assert m is not None and m.verdict == verdict
    assert m.named == (verdict in ("match", "dev"))


@pytest.mark.parametrize("rule,relation,sites", [
    ("padding", None, ("ubatch",)), ("alias", None, ("ubatch",)), ("missing", None, ("draft",)),
    ("stale", "earlier-step", ("ubatch",)), ("shape", None, ("pcp_partition",)), ("wrong-rank", None, ("x",)),
])
def test_no_signature_for_other_rules(rule, relation, sites):
    assert match_known(rule, relation, sites, "0.29.0") is None


def test_the_sparse_top_k_bugs_cite_rocm_atom_1832():
    by_rule = {b.rule: b for b in known_bugs()}
    for rule in ("topk-agree", "topk-empty"):
        b = by_rule[rule]
        assert "ROCm/ATOM PR #1832" in b.title and b.pr is None and b.main and "no vLLM release" in b.main


def test_known_bug_file_is_well_formed():
    bugs = known_bugs()
    assert {b.pr for b in bugs} >= {55212, 48003}
    for b in bugs:
        assert (b.main is None) == (b.before is not None), b.id
        if b.before is not None:
            assert b.fixed_in == b.before and parse_version(b.since) < parse_version(b.before)


def test_parse_version():
    assert parse_version("0.29.0") == ((0, 29, 0), False)
    assert parse_version("vLLM 0.33") == ((0, 33, 0), False)
    assert parse_version("0.30.0rc1") == ((0, 30, 0), True)
    assert parse_version("0.30.0.dev5+gabc") == ((0, 30, 0), True)
    assert parse_version("model runner V2") is None and parse_version(None) is None


def test_side_shape_joins_its_problem_but_a_cut_view_is_its_own(tmp_path):
    # obs 0: the global lengths, one row too long (global + shape of another length: one problem);
    # obs 1: a view cut to num_reqs (shape, padded rows missing: a mechanism of its own)
    p = write(tmp_path / "d.safetensors", [obs(step=0, view=[17, 25, 0, 0, 0]), obs(step=1, view=[9, 13])])
    d = open_dumps([p])
    res = replay(d, "torch")
    assert sorted(f.rule for f in res.findings) == ["global", "shape", "shape"]
    probs = res.problems
    assert [(q.rule, q.side, q.pattern) for q in probs] == [("global", {"shape": 1}, "real rows"),
                                                            ("shape", {}, "view cut to num_reqs")]


def test_grouping_is_deterministic_and_independent_of_object_identity():
    d = open_dumps([str(SAMPLES / "legacy.safetensors")])
    res = replay(d, "torch")
    from dcptool.check.findings import FindingTable

    a = [q.to_json() for q in problems(d, res.findings)]
    b = [q.to_json() for q in problems(d, FindingTable.concat(d, [res.findings[:]]))]  # (other Finding objects)
    c = [q.to_json() for q in problems(d, replay(open_dumps([str(SAMPLES / "legacy.safetensors")]), "torch").findings)]
    assert a == b == c and json.loads(json.dumps(a)) == a


def test_replay_report_leads_with_problems_and_json_references_findings():
    r = cli("replay", SAMPLES / "legacy.safetensors", "--max-findings", "3")
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert lines[0] == "Problems (8)" and all(x.startswith("problem ") for x in lines[1:9])
    assert "Findings (1116)" in r.stdout  # the details follow, as before
    j = cli("replay", SAMPLES / "legacy.safetensors", "--json")
    objs = [json.loads(x) for x in j.stdout.splitlines()]
    found = [o for o in objs if o["type"] == "finding"]
    probs = [o for o in objs if o["type"] == "problem"]
    assert objs[-1]["type"] == "summary" and len(probs) == 8
    assert sorted(k for o in probs for k in o["findings"]) == list(range(len(found)))
    for o in probs:
        own = [found[k] for k in o["findings"] if found[k]["rule"] == o["rule"]]
        assert len(own) == o["count"] and {f["site"] for f in own} == set(o["sites"])
        assert o["first"] == {k: own[0][k] for k in ("obs", "file", "ref", "step", "site", "rank", "ubatch")} | {
            "finding": o["findings"][0]} or o["side"]


def test_clean_dump_has_no_problems():
    r = cli("replay", SAMPLES / "fixed.safetensors")
    assert r.returncode == 0 and "Problems" not in r.stdout


def test_known_bugs_ship_in_the_wheel(tmp_path):
    """The data file is package data: a wheel built from a copy of the source holds it."""
    import shutil
    import subprocess
    import sys
    import zipfile

    src = tmp_path / "src"
    shutil.copytree(ROOT / "dcptool", src / "dcptool", ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(tmp_path / "w"), str(src)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    (wheel,) = (tmp_path / "w").glob("dcptool-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "dcptool/check/known_bugs.json" in names and "dcptool/check/problems.py" in names


def test_every_rule_has_a_mechanism_sentence():
    """A problem line explains its mechanism; a rule added to the table without one would print 'X findings'."""
    from dcptool.check.problems import VIEW, explain
    from dcptool.dcp.rules import RULES

    for rule in RULES:
        relation = "parent-rows" if rule == "stale" else None  # (a stale finding always names its source)
        assert explain(rule, relation, VIEW, ("attn_metadata",)) != f"{rule} findings", rule
    from dcptool.dcp.kv_transfer import KINDS

    for kind in KINDS:  # (a transfer finding names its kind as its relation: each its own mechanism)
        assert explain("transfer", kind, VIEW, ("transfer",)) != explain("transfer", None, VIEW, ("transfer",))


@pytest.mark.parametrize("fault, version, bug", [("ctx-rank-local", "0.29.0", "issue53573-ctx-rank-local"),
                                                 ("ctx-chunk-unaligned", "0.27.0", "pr41229-ctx-unaligned")])
def test_chunked_context_problems_name_their_bug(tmp_path, fault, version, bug):
    """simulate --inject FAULT --engine-version V: replay's problem names the vLLM bug the recorded release had."""
    out = tmp_path / "c.safetensors"
    simulate(SimConfig(dcp=3 if fault == "ctx-chunk-unaligned" else 4, pcp=2, steps=16, inject=(fault,),
                       engine_version=version), out)
    res = replay(open_dumps([str(out)]), "torch")
    named = {p.rule: p.known.bug.id for p in res.problems if p.known is not None and p.known.named}
    assert named == {RULE_OF_FAULT[fault]: bug}
    line = next(p.line for p in res.problems if p.rule == RULE_OF_FAULT[fault])
    assert f"you recorded {version}" in line
@pytest.mark.parametrize("version, named", [("0.29.0", None), ("vllm-ascend 0.30.0rc1", "dev"),
                                            ("vllm-ascend 0.30.0", "not-affected"), (None, None)])
def test_another_projects_bug_is_matched_only_where_the_engine_names_it(version, named):
    """vllm-ascend #16168's signature (capacity) names vllm-ascend's PR, and only for an engine that says it is
    vllm-ascend (its releases are not vLLM's); a vLLM or unnamed engine gets no known bug for it."""
    m = match_known("capacity", None, ("capture",), version)
    if named is None:
        assert m is None
        return
    assert m.verdict == named and m.bug.name == "vllm-ascend PR #16168" and m.bug.project == "vllm-ascend"
