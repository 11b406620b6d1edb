"""simulate: the fixed pipeline replays clean, every fault is found as its rule exactly where it
touched (DESIGN §4), dumps are reproducible byte for byte, and the CLI behaves as documented."""

import json
import shlex
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, cli, cli_subprocess

from dcptool.check.replay import replay
from dcptool.dump import open_dumps, read_dump
from dcptool.engine.record import Recorder
from dcptool.model.runner import OPT_IN
from dcptool.model.simulate import FAULTS, SimConfig, applicability, capture_sizes, simulate

# Small engines (16 requests, 1024-token budget) keep each run quick while still crossing vLLM's
# micro-batching thresholds (32 decode / 512 prefill tokens) and padding requests for full graphs.
SMALL = dict(steps=7, dummy_every=3, max_num_reqs=16, token_budget=1024)

# (N, I, P, K, U, graph mode, spec method): every value of every axis of the issue's matrix appears,
# and every fault applies in at least one row (see test_every_fault_is_exercised).
MATRIX = [
    (1, 1, 1, 0, 1, "none", "mtp"),
    (1, 16, 2, 3, 2, "full", "mtp"),
    (2, 1, 1, 3, 2, "full", "mtp"),
    (2, 16, 2, 0, 1, "piecewise", "mtp"),
    (2, 1, 2, 3, 2, "full", "mtp"),
    (4, 1, 1, 0, 2, "piecewise", "mtp"),
    (4, 16, 2, 3, 1, "full", "mtp"),
    (4, 1, 2, 0, 2, "none", "dflash"),
    (8, 16, 1, 3, 2, "full", "dflash"),
    (8, 1, 2, 3, 2, "full", "mtp"),
    (8, 16, 2, 0, 1, "none", "mtp"),
    (2, 16, 1, 0, 1, "full", "mtp"),
]


def _cfg(row, seed, **kw) -> SimConfig:
    N, I_, P, K, U, g, m = row
    return SimConfig(dcp=N, interleave=I_, pcp=P, spec_tokens=K, ubatches=U, cudagraph=g, spec_method=m,
                     page_size=16, seed=seed, **{**SMALL, **kw})


def _run(cfg: SimConfig, tmp_path: Path, name: str = "run.safetensors", **kw):
    res = simulate(cfg, tmp_path / name, force=True, **kw)
    d = open_dumps(res.files)
    return res, d, replay(d, "torch")


def _verify(res, d, rr) -> None:
    """DESIGN §4: each fault's rule at exactly the observations it touched; nothing anywhere else.

    Keys are (file, index in file). `rank-sum` is a finding about a group of ranks, reported at the
    observation that completes it; it counts as a side finding when any member of the group was touched.
    Stale faults whose surviving rows happen to be right (simulate lists them as shape-only) can only
    be `shape`."""
    touched_all = set()
    by_rule: dict[str, set] = {}
    for f in rr.findings:
        by_rule.setdefault(f.rule, set()).add((f.file, f.obs))
    for rep in res.faults.values():
        if not rep.applicable:
            assert rep.count == 0
            continue
        touched = {(file, i) for file, v in rep.touched.items() for i in v}
        shape_only = {(file, i) for file, v in rep.shape_only.items() for i in v}
        touched_all |= touched
        assert touched - shape_only <= by_rule.get(rep.rule, set()), f"{rep.name}: {rep.rule} not found"
        assert shape_only <= by_rule.get("shape", set()), f"{rep.name}: shape-only not found as shape"
        if len(res.faults) == 1:  # a single fault: its rule is reported nowhere else
            assert by_rule.get(rep.rule, set()) <= touched, f"{rep.name}: {rep.rule} on untouched observations"
    for f in rr.findings:
        if f.rule == "rank-sum":
            assert {(f.file, o) for o in f.detail["obs"]} & touched_all, f.message
        else:
            assert (f.file, f.obs) in touched_all, f"{f.rule} on an untouched observation: {f.message}"
    # the dump carries the same ground truth
    for k, file in enumerate(d.files):
        assert (d.injected[k] or {}) == res.injected(file)


@pytest.mark.parametrize("row", MATRIX, ids=lambda r: "N{}-I{}-P{}-K{}-U{}-{}-{}".format(*r))
def test_matrix_fixed_clean_each_fault_exact_legacy_all(row, tmp_path):
    seed = MATRIX.index(row) * 7919 + 11
    res, d, rr = _run(_cfg(row, seed), tmp_path, "fixed.safetensors")
    assert rr.findings == [], [f.message for f in rr.findings[:3]]
    assert res.faults == {} and d.injected == [{}]
    legacy = _cfg(row, seed, pipeline="legacy")
    res, d, rr = _run(legacy, tmp_path, "legacy.safetensors")
    _verify(res, d, rr)
    why = applicability(legacy)
    # (issue 15's faults are opt-in: --inject only, not the pre-fix ordering legacy models)
    assert {f for f, r in res.faults.items() if r.applicable} == {f for f, w in why.items() if w is None} - OPT_IN
    for fault in FAULTS:
        if why[fault] is None:
            _verify(*_run(_cfg(row, seed, inject=(fault,)), tmp_path, f"{fault}.safetensors"))


@pytest.mark.parametrize("row", [MATRIX[2], MATRIX[4], MATRIX[9]], ids=["N2-P1", "N2-P2", "N8-P2"])
def test_many_seeds_fixed_clean_legacy_exact(row, tmp_path):
    for seed in range(100, 106):
        res, d, rr = _run(_cfg(row, seed), tmp_path, f"f{seed}.safetensors")
        assert rr.findings == []
        _verify(*_run(_cfg(row, seed, pipeline="legacy"), tmp_path, f"l{seed}.safetensors"))


# Where each fault is sure to touch something (and, for most, the default configuration exercises it).
EXERCISE = {
    "dummy-none": (2, 1, 1, 2, 2, "full", "mtp"),
    "dflash-capture-none": (2, 1, 1, 3, 1, "full", "dflash"),
    "ubatch-none": (4, 1, 1, 2, 2, "full", "mtp"),
    "ubatch-parent-rows": (4, 1, 1, 2, 2, "none", "mtp"),
    "pcp-stale": (4, 1, 2, 2, 1, "piecewise", "mtp"),
    "pcp-unpadded": (4, 1, 2, 2, 1, "full", "mtp"),
    "capture-wrong-buffer": (4, 1, 2, 2, 1, "full", "mtp"),
    "graph-stale": (2, 1, 1, 2, 2, "full", "mtp"),
    "sentinel": (4, 16, 1, 2, 1, "full", "mtp"),
    "flashinfer-global-pages": (8, 1, 1, 0, 1, "none", "mtp"),
    "dcp-qsl-local": (4, 1, 1, 0, 2, "piecewise", "mtp"),
    "tot-local": (2, 16, 1, 0, 1, "full", "mtp"),
    "rank-disagree": (2, 1, 1, 3, 2, "full", "mtp"),
    "slot-wrong-group": (4, 2, 1, 2, 2, "full", "mtp"),
    "slot-all-ranks": (3, 16, 1, 2, 2, "piecewise", "mtp"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_every_fault_is_exercised(fault, tmp_path):
    cfg = _cfg(EXERCISE[fault], 3, inject=(fault,), steps=14)
    res, d, rr = _run(cfg, tmp_path)
    rep = res.faults[fault]
    assert rep.applicable and rep.count > 0
    _verify(res, d, rr)
    assert FAULTS[fault][0] in rr.by_rule()


def test_tot_local_with_a_sentinel_records_every_observation(tmp_path):
    """tot-local hands the global companion this rank's local lengths; with `sentinel` the view's padded rows hold
    -1, which no global length can be: only the real rows are taken, so no observation is dropped (it was, and
    the tot-local fault with it) and tot-lens still finds the fault."""
    import warnings

    cfg = _cfg(EXERCISE["tot-local"], 3, inject=("tot-local", "sentinel"), steps=20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a dropped observation warns
        res, d, rr = _run(cfg, tmp_path)
    assert res.faults["tot-local"].count > 0 and res.faults["sentinel"].count > 0
    assert "tot-lens" in rr.by_rule() and "padding" in rr.by_rule()
    assert (d["rows.dcp_tot_seq_lens"] >= 0).all()


def test_not_applicable_faults_are_reported_not_injected(tmp_path):
    res, d, rr = _run(SimConfig(dcp=2, pcp=1, cudagraph="none", inject=("pcp-stale", "sentinel", "dummy-none"),
                                **SMALL), tmp_path)
    assert not res.faults["pcp-stale"].applicable and "--pcp > 1" in res.faults["pcp-stale"].why
    assert not res.faults["sentinel"].applicable
    assert res.faults["dummy-none"].applicable and res.faults["dummy-none"].count > 0
    assert set(d.injected[0]) == {"dummy-none"}
    assert set(applicability(SimConfig(dcp=1)).values()) == {"needs --dcp > 1"}


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    cfg = SimConfig(dcp=4, pcp=2, pipeline="legacy", **SMALL)
    a = simulate(cfg, tmp_path / "a.safetensors").files[0]
    b = simulate(cfg, tmp_path / "b.safetensors").files[0]
    c = simulate(SimConfig(**{**cfg.__dict__, "seed": 1}), tmp_path / "c.safetensors").files[0]
    assert Path(a).read_bytes() == Path(b).read_bytes()
    assert Path(a).read_bytes() != Path(c).read_bytes()


def test_per_rank_files_replay_like_one_file(tmp_path):
    cfg = SimConfig(dcp=2, pcp=2, pipeline="legacy", **SMALL)
    one, d1, r1 = _run(cfg, tmp_path, "one.safetensors")
    many, dn, rn = _run(cfg, tmp_path, "many.safetensors", per_rank=True)
    assert [Path(f).name for f in many.files] == [f"many.pcp{p}.rank{r}.safetensors" for p in (0, 1) for r in (0, 1)]
    assert dn.n == d1.n and sum(r.count for r in many.faults.values()) == sum(r.count for r in one.faults.values())
    _verify(many, dn, rn)
    assert rn.by_rule().keys() == r1.by_rule().keys()
    for f in many.files:  # each file is one process: one DCP rank, and it reads on its own
        assert np.unique(read_dump(f)["obs.rank"]).size == 1


def test_workload_is_realistic(tmp_path):
    """Arrivals, chunked prefill under the budget, decodes with drafts, graph padding: on the default sizes."""
    res = simulate(SimConfig(dcp=2, steps=40), tmp_path / "w.safetensors")
    d = read_dump(res.files[0])
    final = d["obs.site"] == d.config.sites.index("attn_metadata")
    nr, nrp = d["obs.num_reqs"][final], d["obs.num_reqs_padded"][final]
    q = np.diff(d["rows.query_start_loc"][d["obs.qsl"][:-1][final][:, None] + np.arange(2)], axis=1)
    assert nr.max() >= 30 and (nrp > nr).any()  # tens of requests, some graph padding
    assert d["obs.num_tokens_padded"][final].max() > 512  # prefill chunks big enough to micro-batch
    assert (q == 3).any()  # decodes: 1 + 2 draft tokens
    assert len(set(d["obs.graph"][final].tolist())) >= 2  # replays and eager/piecewise steps
    sizes = capture_sizes(64, 2048, 3)
    assert sizes[:4] == [1, 2, 3, 4] and sizes[-1] == 384 and 256 in sizes and 264 not in sizes


def test_observe_many_records_what_observe_records(tmp_path):
    """The batched call simulate uses writes the same bytes as one observe() per rank."""
    rng = np.random.default_rng(0)
    a = Recorder(tmp_path / "a.safetensors", dcp_size=4, page_size=16)
    b = Recorder(tmp_path / "b.safetensors", dcp_size=4, page_size=16)
    for step in range(20):
        n = int(rng.integers(1, 9))
        seq = rng.integers(0, 9000, n)
        qsl = np.concatenate([[0], np.cumsum(rng.integers(1, 5, n))])
        views = None if step % 5 == 0 else rng.integers(0, 3000, (4, n))
        kv = rng.integers(0, 99, (4, n))
        parents = [None] * 4 if step == 0 else [step * 4 - 4 + r for r in range(4)]
        for r in range(4):
            a.observe(step=step, site="s", rank=r, seq_lens=seq, num_reqs=n, num_reqs_padded=n,
                      dcp_local_seq_lens=None if views is None else views[r], parent=parents[r],
                      query_start_loc=qsl, buffer=r + 1, graph=3, kv_pages=kv[r])
        b.observe_many(step=step, site="s", ranks=range(4), seq_lens=seq, num_reqs=n, num_reqs_padded=n,
                       dcp_local_seq_lens=views, parents=parents, query_start_loc=qsl, buffers=[1, 2, 3, 4],
                       graph=3, kv_pages=kv)
    with pytest.warns(RuntimeWarning):
        assert b.observe_many(step=0, site="s", ranks=[0, 1], seq_lens=[-1], num_reqs=1, num_reqs_padded=1) == [-1] * 2
    assert b.dropped == 2
    a.close(), b.close()
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


# ---------------------------------------------------------------------------------------------
# The command line (a real subprocess, as a user runs it)


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
    """Issue 4: simulate --dcp 4 --pcp 2 --pipeline legacy -o x && replay x reports missing, stale,
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
    found = [o for o in objs if o["type"] == "finding"]  # (issue 17: problem objects come too)
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
    assert p.returncode == 0 and x.read_bytes() != before and "wrote" in p.stdout


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


# ---------------------------------------------------------------------------------------------
# The bundled samples


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
        assert sample.stat().st_size < 1_000_000
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


# ---------------------------------------------------------------------------------------------
# vLLM 0.34's split rule in simulate, and where each fault really occurred


@pytest.mark.parametrize("row", [MATRIX[2], MATRIX[4], MATRIX[5], (2, 1, 1, 2, 2, "none", "mtp"),
                                 (4, 1, 1, 2, 3, "piecewise", "mtp")],
                         ids=["N2-full", "N2-P2-full", "N4-piecewise", "N2-eager", "N4-U3-piecewise"])
def test_engine_0_34_fixed_clean_faults_exact(row, tmp_path):
    """simulate --engine-version 0.34.0: the fixed pipeline replays clean under the 0.34 rule (the dump
    says 0.34.0, so replay checks the split points), and every fault is still found exactly."""
    seed = 5
    res, d, rr = _run(_cfg(row, seed, engine_version="0.34.0"), tmp_path, "f34.safetensors")
    assert rr.findings == [], [f.message for f in rr.findings[:3]]
    assert d.config.engine_version == "0.34.0" and "--engine-version 0.34.0" in d.config.note
    _verify(*_run(_cfg(row, seed, engine_version="0.34.0", pipeline="legacy"), tmp_path, "l34.safetensors"))
    # and the same workload under 0.33's rule replays clean too
    assert _run(_cfg(row, seed, engine_version="0.33.0"), tmp_path, "f33.safetensors")[2].findings == []


def test_engine_0_34_splits_uniform_decodes_on_request_boundaries(tmp_path):
    """Eager micro-batched uniform decodes with an odd request count: 0.34 splits between requests where
    0.33 cuts one in two; replaying the 0.34 dump by 0.33's rule flags exactly those micro-batches."""
    row = (2, 1, 1, 2, 2, "none", "mtp")
    _, d33, _ = _run(_cfg(row, 0, engine_version="0.33.0"), tmp_path, "a.safetensors")
    _, d34, _ = _run(_cfg(row, 0, engine_version="0.34.0"), tmp_path, "b.safetensors")
    assert d33.n == d34.n  # the same workload: only the split differs
    ub = np.flatnonzero(d34["obs.ubatch"] >= 0)
    moved = ub[d33["obs.tok_start"][ub] != d34["obs.tok_start"][ub]]
    assert moved.size > 0
    for i in moved.tolist():  # each moved split is a request boundary of its parent: nothing straddles
        p = int(d34["obs.parent"][i])
        assert int(d34["obs.tok_start"][i]) in d34.qsl_of(p).tolist()
    rr = replay(d34, "torch", engine_version="0.33.0")
    assert {f.rule for f in rr.findings} == {"ubatch-slice"}
    flagged = {f.index for f in rr.findings}
    # a moved split point moves both of its neighbours (K=2: micro-batch 0's end and 1's start)
    assert flagged == {i for i in ub.tolist() if (d33["obs.tok_start"][i], d33["obs.tok_stop"][i])
                       != (d34["obs.tok_start"][i], d34["obs.tok_stop"][i])}


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
    assert r.exit_code == 2 and "--engine-version 'newest'" in r.output
    assert "[0.27–0.29]" in run.invoke(app, ["simulate", "--help"], env={"COLUMNS": "400"}).output


def test_0_29_dflash_capture_buffer_is_not_a_fault(tmp_path):
    """vLLM 0.29's DFlash capture fills the whole persistent buffer (max_num_reqs rows) and passes all of
    it; build_attn_metadata slices [:num_reqs] before use. What attention consumes is right, so simulate
    has no fault for it: recording the consumed view replays clean, while recording the argument would
    be a `shape` finding for rows attention never reads (DESIGN §1, "record what attention consumes")."""
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


# ---------------------------------------------------------------------------------------------
# issue 15: the decode path's dcp_query_start_loc / global companion, and the faults of its rules


def test_issue15_faults_are_opt_in_not_legacy_and_fixed_records_the_decode_path(tmp_path):
    assert OPT_IN == {"dcp-qsl-local", "tot-local", "rank-disagree", "slot-wrong-group", "slot-all-ranks"}
    assert OPT_IN <= set(FAULTS)
    assert not OPT_IN & set(_cfg(MATRIX[2], 1, pipeline="legacy").faults)
    res, d, rr = _run(_cfg(MATRIX[5], 1), tmp_path)
    assert rr.findings == [] and not {"empty-mask", "tot-lens"} & set(rr.skipped)
    q, t = np.diff(d["obs.dqsl"]), np.diff(d["obs.tot"])
    assert (q > 0).sum() > 0 and np.array_equal(t[q > 0], q[q > 0] - 1)  # companion: num_decodes rows
    for i in np.flatnonzero(q > 0)[:50]:  # Q is query_start_loc's prefix, the same on every rank
        assert np.array_equal(d.dqsl_of(i), d.qsl_of(i)[: q[i]])
        assert np.array_equal(d.tot_of(i), d.seq_lens_of(i)[: t[i]])
    sites = {d.site_name(i) for i in np.flatnonzero(q > 0)}
    assert "prepare_inputs" not in sites and "attn_metadata" in sites  # attention builds only


@pytest.mark.parametrize("fault", ["dcp-qsl-local", "tot-local", "rank-disagree"])
def test_issue15_fault_found_exactly_where_it_touched_per_rank_files_too(fault, tmp_path):
    for per_rank in (False, True):
        cfg = _cfg(EXERCISE[fault], 5, inject=(fault,))
        res = simulate(cfg, tmp_path / f"{per_rank}.safetensors", force=True, per_rank=per_rank)
        d = open_dumps(res.files)
        rr = replay(d, "torch")
        assert res.faults[fault].count > 0
        _verify(res, d, rr)
        assert set(rr.by_rule()) == {FAULTS[fault][0]}
def test_slot_faults_per_rank_files_like_one_file(tmp_path):
    """Issue 15: the slot columns go through observe() per rank as through observe_many(), and each slot fault
    is found exactly where it touched in either layout; the fixed pipeline writes them and replays clean."""
    cfg = SimConfig(dcp=4, interleave=2, pcp=1, inject=("slot-wrong-group", "slot-all-ranks"), **SMALL)
    one, d1, r1 = _run(cfg, tmp_path, "one.safetensors")
    many, dn, rn = _run(cfg, tmp_path, "many.safetensors", per_rank=True)
    assert d1.has("obs.slots") and dn.has("obs.slots") and d1.config.kv_groups == dn.config.kv_groups
    assert np.array_equal(np.sort(d1["rows.slot_mapping"]), np.sort(dn["rows.slot_mapping"]))
    for res, d, rr in ((one, d1, r1), (many, dn, rn)):
        _verify(res, d, rr)
        assert {"slots", "slot-partition"} <= set(rr.by_rule())
    fixed = _run(SimConfig(dcp=4, interleave=2, pcp=1, **SMALL), tmp_path, "fixed.safetensors")[2]
    assert fixed.findings == [] and "slots" not in fixed.skipped
