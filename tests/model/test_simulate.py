"""simulate: the command line as documented (a real subprocess, as a user runs it), the bundled samples
regenerate byte for byte, fault labels, and a capture buffer that is no fault."""

import json
import shlex
from pathlib import Path

import pytest
from conftest import ROOT, cli, cli_subprocess

from dcptool.check.replay import replay
from dcptool.dump import open_dumps, read_dump
from dcptool.engine.recorder.record import Recorder
from dcptool.model.config import OPT_IN
from dcptool.model.simulate import FAULTS, SimConfig, applicability


def test_cli_table_findings_only_under_legacy():
    p = cli("simulate", "--dcp", "4", "--steps", "12", "--max-num-reqs", "24")
    assert p.returncode == 0, p.stderr
    lines = {ln.split("│")[1].strip(): ln for ln in p.stdout.splitlines() if ln.count("│") >= 4}
    for site in ("attn_metadata", "ubatch", "dummy", "capture", "draft"):
        cells = [c.strip() for c in lines[site].split("│")]
        assert cells[3] == "clean" and cells[4] != "clean", lines[site]
    assert "not applicable" in p.stdout and "fixed: 0 findings" in p.stdout


def test_cli_json_table():
    p = cli("simulate", "--dcp", "2", "--pcp", "2", "--steps", "6", "--max-num-reqs", "16", "--inject",
            "pcp-stale,sentinel", "--json")
    assert p.returncode == 0, p.stderr
    objs = [json.loads(ln) for ln in p.stdout.splitlines()]
    assert objs[-1]["type"] == "summary" and objs[-1]["fixed"]["findings"] == 0
    faults = {o["fault"]: o for o in objs if o["type"] == "fault"}
    assert set(faults) == {"pcp-stale", "sentinel"}
    assert faults["pcp-stale"]["touched"] > 0 and faults["pcp-stale"]["found"] == faults["pcp-stale"]["touched"]
    assert {o["site"] for o in objs if o["type"] == "site"} >= {"prepare_inputs", "pcp_partition"}


def test_cli_done_when_pcp_legacy_then_replay(tmp_path):
    """simulate --dcp 4 --pcp 2 --pipeline legacy -o x && replay x reports missing, stale,
    shape, alias, padding and pages, each at observations simulate says it touched."""
    x = tmp_path / "x.safetensors"
    p = cli_subprocess("simulate", "--dcp", "4", "--pcp", "2", "--pipeline", "legacy", "-o", x)  # smoke
    assert p.returncode == 0, p.stderr
    p = cli("replay", x, "--json", "--backend", "torch")
    assert p.returncode == 1
    objs = [json.loads(ln) for ln in p.stdout.splitlines()]
    summary = objs[-1]
    assert {"missing", "stale", "shape", "alias", "padding", "pages"} <= set(summary["by_rule"])
    injected = read_dump(x).injected[0]
    touched = set().union(*map(set, injected.values()))
    found = [o for o in objs if o["type"] == "finding"]  # (problem objects come too)
    for f in found:
        if f["rule"] == "rank-sum":
            assert set(f["detail"]["obs"]) & touched
        else:
            assert f["obs"] in touched
    for fault, idx in injected.items():
        rule = FAULTS[fault][0]
        assert set(idx) <= {f["obs"] for f in found if f["rule"] in (rule, "shape")}, fault


def test_cli_output_refuses_overwrite_and_json(tmp_path):
    x = tmp_path / "x.safetensors"
    args = ("simulate", "--steps", "4", "--max-num-reqs", "16", "-o", x)
    p = cli(*args, "--json")
    assert p.returncode == 0, p.stderr
    info = json.loads(p.stdout)
    assert info["files"] == [str(x)] and info["pipeline"] == "fixed" and info["observations"] > 0
    before = x.read_bytes()
    p = cli(*args, "--seed", "5")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "--force" in p.stderr and "Traceback" not in p.stderr
    assert x.read_bytes() == before
    p = cli(*args, "--seed", "5", "--force")
    assert p.returncode == 0 and x.read_bytes() != before and "wrote" not in p.stdout  # status: stderr
    assert p.stderr.startswith(f"dcptool: wrote {x}: ") and p.stderr.count("\n") == 1


@pytest.mark.parametrize("args,msg", [
    (("--pipeline", "sideways"), "--pipeline"),
    (("--inject", "pcp-stale,bogus"), "bogus"),
    (("--interleave", "16", "--page-size", "8"), "multiple"),
    (("--per-rank",), "-o"),
    (("-o", "/nonexistent-dir/x.safetensors"), "does not exist"),
])
def test_cli_bad_usage_exits_2(args, msg):
    p = cli("simulate", "--steps", "2", *args)
    assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr
    assert p.stderr.strip().count("\n") == 0


def test_cli_not_applicable_is_said(tmp_path):
    p = cli("simulate", "--steps", "3", "--max-num-reqs", "16", "--inject", "pcp-stale,dummy-none", "-o",
            tmp_path / "y.safetensors")
    assert p.returncode == 0, p.stderr
    assert "pcp-stale [main only]: not applicable (needs --pcp > 1)" in p.stdout
    assert "dummy-none [0.27–0.29]: touched" in p.stdout


def _sample_commands() -> list[list[str]]:
    readme = (ROOT / "samples" / "README.md").read_text()
    block = readme.split("```sh\n", 1)[1].split("```", 1)[0]
    line = " ".join(ln.rstrip("\\").strip() for ln in block.strip().splitlines())
    return [shlex.split(c)[1:] for c in line.split("&&")]  # drop the leading "dcptool"


def test_samples_are_small_replayable_and_regenerate_byte_identical(tmp_path):
    cmds = _sample_commands()
    assert len(cmds) == 2
    for cmd in cmds:
        out = Path(cmd[cmd.index("-o") + 1])
        sample = ROOT / out
        assert sample.stat().st_size < 3_000_000  # (1 MB before PCP dumps carried slot columns)
        cmd = [str(tmp_path / out.name) if c == str(out) else c for c in cmd]
        p = cli(*cmd, cwd=ROOT)
        assert p.returncode == 0, p.stderr
        assert (tmp_path / out.name).read_bytes() == sample.read_bytes(), f"{out}: regenerate with samples/README.md"
    legacy = read_dump(ROOT / "samples" / "legacy.safetensors")
    fixed = read_dump(ROOT / "samples" / "fixed.safetensors")
    assert legacy.config.dcp_size == fixed.config.dcp_size == 4
    assert replay(fixed, "torch").findings == []
    rules = replay(legacy, "torch").by_rule()
    assert {"missing", "stale", "shape", "alias", "padding", "pages"} <= set(rules)
    assert set(legacy.injected[0]) == {f for f, w in applicability(SimConfig(dcp=4, pcp=2)).items()
                                       if w is None} - OPT_IN


def test_fault_labels_in_table_json_and_errors():
    from typer.testing import CliRunner

    from dcptool.cli import app
    from dcptool.model.simulate import FAULT_WHERE

    run = CliRunner()
    args = ["simulate", "--steps", "3", "--max-num-reqs", "16", "--token-budget", "512"]
    r = run.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in r.output.splitlines() if '"type": "fault"' in x]
    assert {x["fault"]: x["where"] for x in rows} == {f: w for f, w in FAULT_WHERE.items() if f not in OPT_IN}
    r = run.invoke(app, args, env={"COLUMNS": "250"})
    assert "in vLLM" in r.output and "0.27–0.28" in r.output and "main only" in r.output
    r = run.invoke(app, [*args, "--inject", "bogus"])
    assert r.exit_code == 2 and "ubatch-parent-rows [main only]" in r.output
    r = run.invoke(app, [*args, "--engine-version", "newest"])
    assert r.exit_code == 2 and "--engine-version: 'newest'" in r.output
    assert "[0.27–0.29]" in run.invoke(app, ["simulate", "--help"], env={"COLUMNS": "400"}).output


def test_0_29_dflash_capture_buffer_is_not_a_fault(tmp_path):
    """vLLM 0.29's DFlash capture fills the whole persistent buffer (max_num_reqs rows) and passes all of
    it; build_attn_metadata slices [:num_reqs] before use. What attention consumes is right, so simulate
    has no fault for it: recording the consumed view replays clean, while recording the argument would
    be a `shape` finding for rows attention never reads (docs/dcp.md: what attention consumes)."""
    import torch

    from dcptool.dcp.reference import prepare_dcp_local_seq_lens

    max_num_reqs, num_reqs, N = 8, 3, 2
    seq = torch.tensor([3, 3, 4, 0, 0, 0, 0, 0], dtype=torch.int32)  # make_dummy: seq_len = query_len
    buf = torch.full((max_num_reqs,), -1, dtype=torch.int32)
    arg = prepare_dcp_local_seq_lens(buf, seq, num_reqs, N, 0, 1)  # 0.29 passes this (no num_reqs_padded)
    consumed = arg[:num_reqs]
    with Recorder(tmp_path / "d.safetensors", dcp_size=N, engine_version="0.29.0") as rec:
        for view in (consumed, arg):
            rec.observe(step=0, site="dflash_capture", rank=0, seq_lens=seq[:num_reqs], num_reqs=num_reqs,
                        num_reqs_padded=num_reqs, dcp_local_seq_lens=view)
    rr = replay(open_dumps([str(tmp_path / "d.safetensors")]), "torch")
    assert [(f.obs, f.rule) for f in rr.findings] == [(1, "shape")]
