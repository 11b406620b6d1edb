"""`dcptool reduce`: ddmin over steps, observations and rows; parents renumbered."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import ROOT, cli, cli_subprocess, obs, write

from dcptool.check.replay import replay
from dcptool.diagnose.reduce import (
    closure,
    ddmin,
    drop_requests,
    drop_rows,
    find_target,
    parse_finding,
    reduce_dump,
    subset,
)
from dcptool.dump import open_dumps
from dcptool.model.simulate import SimConfig, simulate

SAMPLES = ROOT / "samples"


@pytest.fixture(scope="module")
def parent_rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim") / "pr.safetensors"
    simulate(SimConfig(inject=("ubatch-parent-rows",), steps=12), out)
    return out


def test_ddmin_finds_a_one_minimal_set():
    need = {3, 17}
    got = ddmin(list(range(40)), lambda u: need <= set(u), deadline=float("inf"))
    assert sorted(got) == [3, 17]


def test_subset_renumbers_parents_and_keeps_rows(parent_rows):
    d = open_dumps([str(parent_rows)])
    kids = np.flatnonzero(d["obs.parent"] >= 0)
    keep = np.zeros(d.n, bool)
    keep[kids[-3:]] = True
    keep = closure(d, keep)
    s = subset(d, keep)
    old = np.flatnonzero(keep)
    for new_i, old_i in enumerate(old.tolist()):
        p_new, p_old = int(s["obs.parent"][new_i]), int(d["obs.parent"][old_i])
        assert (p_new < 0) == (p_old < 0)
        if p_old >= 0:
            assert old[p_new] == p_old  # the renumbered parent is the same observation
        assert np.array_equal(s.seq_lens_of(new_i), d.seq_lens_of(old_i))
        assert (s.dcp_of(new_i) is None) == (d.dcp_of(old_i) is None)
        assert np.array_equal(s.qsl_of(new_i), d.qsl_of(old_i))


def test_drop_rows_keeps_an_observation_consistent(tmp_path):
    qsl = np.array([0, 1, 2, 12, 13, 13], np.int32)
    p = write(tmp_path / "d.safetensors", [obs(seq=(64, 96, 512, 32, 0), num_reqs=4, num_reqs_padded=5,
                                               query_start_loc=qsl, num_tokens_padded=14)])
    d = open_dumps([p])
    s = drop_rows(d, {(0, 2), (0, 4)})
    assert s.seq_lens_of(0).tolist() == [64, 96, 32]
    assert int(s["obs.num_reqs"][0]) == 3 and int(s["obs.num_reqs_padded"][0]) == 3
    assert s.qsl_of(0).tolist() == [0, 1, 2, 3]
    assert int(s["obs.num_tokens_padded"][0]) == 4
    assert s.dcp_of(0).tolist() == [32, 48, 16]  # the view's rows go with their requests
    assert replay(s, "torch").findings == []


def test_dropping_a_parent_request_follows_into_its_micro_batches(tmp_path):
    # docs/dcp.md's worked example: query lens [1,1,10,1,1], seq_lens [64,96,512,32,48], K=2, N=2, I=1
    qsl = np.array([0, 1, 2, 12, 13, 14], np.int32)
    parent = obs(seq=(64, 96, 512, 32, 48), num_reqs=5, num_reqs_padded=5, query_start_loc=qsl, num_tokens_padded=14)
    ub0 = obs(seq=(64, 96, 507), num_reqs=3, num_reqs_padded=3, ubatch=0, parent=0, req_start=0, tok_start=0,
              tok_stop=7, query_start_loc=np.array([0, 1, 2, 7], np.int32), num_tokens_padded=7)
    ub1 = obs(seq=(512, 32, 48), num_reqs=3, num_reqs_padded=3, ubatch=1, parent=0, req_start=2, tok_start=7,
              tok_stop=14, query_start_loc=np.array([0, 5, 6, 7], np.int32), num_tokens_padded=7)
    d = open_dumps([write(tmp_path / "d.safetensors", [parent, ub0, ub1], engine_version="0.33.0")])
    assert replay(d, "torch").findings == []
    s = drop_requests(d, {(0, 0), (0, 4)})  # requests 0 and 4: one before the split, one after
    assert s.seq_lens_of(0).tolist() == [96, 512, 32] and s.qsl_of(0).tolist() == [0, 1, 11, 12]
    assert s.seq_lens_of(1).tolist() == [96, 507] and s.seq_lens_of(2).tolist() == [512, 32]
    assert [int(s[k][1]) for k in ("obs.req_start", "obs.tok_start", "obs.tok_stop")] == [0, 0, 6]
    assert [int(s[k][2]) for k in ("obs.req_start", "obs.tok_start", "obs.tok_stop")] == [1, 6, 12]
    assert s.qsl_of(2).tolist() == [0, 5, 6]
    assert replay(s, "torch").findings == []  # still a consistent recording: the ubatch-slice check agrees


def test_reduce_shrinks_a_simulated_fault_to_a_handful(parent_rows):
    d = open_dumps([str(parent_rows)])
    res = replay(d, "torch")
    target = find_target(str(parent_rows), res.findings, "stale", d)
    red = reduce_dump(d, target, {f.rule for f in res.findings}, max_seconds=60)
    assert red.after["observations"] <= 3 and red.after["steps"] == 1 and not red.stopped
    assert red.after["rows"] <= 4  # one request in the parent, its straddling part in the micro-batch
    again = replay(red.dump, "torch")
    assert target.holds(again.findings)
    assert [(p.rule, p.relation) for p in again.problems] == [("stale", "parent-rows")]
    # the micro-batch kept its parent, renumbered
    kid = next(f.index for f in again.findings if f.rule == "stale")
    par = int(red.dump["obs.parent"][kid])
    assert par >= 0 and int(red.dump["obs.ubatch"][par]) == -1


@pytest.mark.parametrize("spec", ["missing", "stale/earlier-in-step", "padding", "shape", "pages"])
def test_reduce_every_sample_problem(spec):
    d = open_dumps([str(SAMPLES / "legacy.safetensors")])
    res = replay(d, "torch")
    target = find_target("legacy", res.findings, spec, d)
    red = reduce_dump(d, target, {f.rule for f in res.findings}, max_seconds=60)
    assert red.after["observations"] <= 3 and red.after["rows"] <= 4 and target.holds(red.findings)
    if spec == "stale/earlier-in-step":  # the PCP-local row went with the global batch's row of the same request
        assert red.after == {"observations": 2, "steps": 1, "rows": 2}


def test_reduce_stops_at_the_budget_with_what_it_has(parent_rows):
    d = open_dumps([str(parent_rows)])
    res = replay(d, "torch")
    target = find_target("x", res.findings, "stale", d)
    red = reduce_dump(d, target, {f.rule for f in res.findings}, max_seconds=0.0)
    assert red.stopped and target.holds(red.findings)


def test_parse_finding():
    assert parse_finding("stale/parent-rows@12") == ("stale", "parent-rows", (None, 12))
    assert parse_finding("stale@run/x.rank3.safetensors:12") == ("stale", None, ("run/x.rank3.safetensors", 12))
    assert parse_finding("missing") == ("missing", None, None)


def test_reduce_takes_a_finding_at_the_reference_the_reports_print(tmp_path):
    """RULE@FILE:I names the observation as every report does; on several files the file must be named."""
    from dcptool.model.simulate import SimConfig, simulate

    res = simulate(SimConfig(dcp=2, steps=6, pipeline="legacy", seed=3), tmp_path / "run.safetensors", per_rank=True)
    d = open_dumps(res.files)
    findings = replay(d, "torch").findings
    f = next(f for f in findings if f.rule == "missing" and f.file == res.files[1])  # rank 1's file
    target = find_target("run", findings, f"missing@{f.ref}", d)
    assert (target.finding.file, target.finding.obs) == (f.file, f.obs)
    with pytest.raises(Exception, match="name the observation as FILE:I"):
        find_target("run", findings, f"missing@{f.obs}", d)


def test_cli_reduce_writes_a_dump_that_replays_with_the_problem(tmp_path, parent_rows):
    out = tmp_path / "small.safetensors"
    r = cli("reduce", parent_rows, "--finding", "stale", "-o", out, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["after"]["observations"] <= 3 and info["relation"] == "parent-rows"
    d = open_dumps([str(out)])
    assert "reduced by dcptool reduce" in d.config.note
    assert d.injected[0]["ubatch-parent-rows"]  # the fault's ground truth follows the observations it kept
    again = cli("replay", out, "--json")
    assert again.returncode == 1
    assert [json.loads(x)["rule"] for x in again.stdout.splitlines() if '"type": "problem"' in x] == ["stale"]
    assert cli("reduce", parent_rows, "--finding", "stale", "-o", out).returncode == 2  # exists, no --force


@pytest.mark.parametrize("finding,needle", [("bogus", "unknown rule 'bogus'"), ("padding", "no padding finding"),
                                            ("stale@x", "expected RULE@FILE:I"), ("stale@9999", ":9999")])
def test_cli_reduce_bad_finding_exits_2_one_line(tmp_path, parent_rows, finding, needle):
    r = cli("reduce", parent_rows, "--finding", finding, "-o", tmp_path / "o.safetensors")
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o.safetensors").exists()


def test_cli_reduce_subprocess_smoke(tmp_path):
    out = tmp_path / "small.safetensors"
    p = cli_subprocess("reduce", SAMPLES / "legacy.safetensors", "--finding", "missing@0", "-o", out)
    assert p.returncode == 0, p.stderr
    assert "1136 -> 1 observations" in p.stdout
    assert open_dumps([str(out)]).n == 1


def test_drop_rows_carries_the_issue15_columns(tmp_path):
    """The empty-shard mask's Q loses the dropped request's boundary, the global companion its row, and the slot
    entries of an observation that loses rows are cleared (0 entries: not recorded); the result is a valid dump."""
    from dcptool.dump.schema import validate_columns

    qsl = np.array([0, 1, 2, 3], np.int32)
    o = obs(seq=(64, 96, 32), num_reqs=3, num_reqs_padded=3, query_start_loc=qsl, num_tokens_padded=3,
            dcp_query_start_loc=qsl, dcp_tot_seq_lens=np.array([64, 96, 32]),
            positions=np.array([63, 95, 31]), slot_mapping=np.array([-1, 95, 31]))
    d = open_dumps([write(tmp_path / "d.safetensors", [o])])
    s = drop_rows(d, {(0, 1)})
    validate_columns("reduced", s.config, s.columns)
    assert s.dqsl_of(0).tolist() == [0, 1, 2] and s.tot_of(0).tolist() == [64, 32]
    assert np.diff(s["obs.slots"]).tolist() == [0]
    kept = drop_rows(d, {(1, 0)})  # no such observation: nothing changes
    assert kept.dqsl_of(0).tolist() == [0, 1, 2, 3] and np.diff(kept["obs.slots"]).tolist() == [3]
