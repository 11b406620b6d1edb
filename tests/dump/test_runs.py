"""dump/runs.py: files read together are one run, or look like several (replay, inspect, diff refuse those without
--merge). One run: per-rank files, PCP per-rank files, rolled files (sharing a boundary step). Several: different
engine versions, a rank's steps recorded twice."""

import numpy as np
import pytest
from conftest import ROOT, cli, obs, rollover_files, write

from dcptool.dump import open_dumps
from dcptool.dump.runs import several_runs
from dcptool.model.simulate import SimConfig, simulate

SAMPLES = ROOT / "samples"


def _sim(tmp_path, name, per_rank=True, **kw):
    cfg = SimConfig(steps=6, pipeline="legacy", **kw)
    return simulate(cfg, tmp_path / f"{name}.safetensors", per_rank=per_rank).files


@pytest.mark.parametrize("kw", [dict(dcp=4), dict(dcp=2, pcp=2), dict(dcp=1, pcp=2, spec_tokens=0)])
def test_per_rank_files_of_one_run(tmp_path, kw):
    assert several_runs(open_dumps(_sim(tmp_path, "run", **kw))) is None


@pytest.mark.parametrize("sorted_steps,files", [(True, 2), (True, 4), (True, 7)])
def test_rolled_files_share_at_most_a_boundary_step(tmp_path, rng, sorted_steps, files):
    assert several_runs(open_dumps(rollover_files(tmp_path, rng, files=files, sorted_steps=sorted_steps))) is None


def test_one_file_is_one_run():
    assert several_runs(open_dumps([str(SAMPLES / "legacy.safetensors")])) is None


def test_different_engine_versions_are_two_runs():
    why = several_runs(open_dumps([str(SAMPLES / "legacy.safetensors"), str(SAMPLES / "fixed.safetensors")]))
    assert why is not None and "legacy pipeline" in why and "fixed pipeline" in why and "look like two runs" in why


@pytest.mark.parametrize("per_rank", [True, False])
def test_a_rank_recorded_twice_is_two_runs(tmp_path, per_rank):
    """Same engine, same configuration, another seed: the same ranks' steps recorded by two sets of files."""
    a = _sim(tmp_path, "a", per_rank=per_rank, dcp=2, seed=1)
    b = _sim(tmp_path, "b", per_rank=per_rank, dcp=2, seed=2)
    why = several_runs(open_dumps(a + b))
    assert why is not None and "both record DCP rank 0" in why, why
    # PCP per-rank files hold each DCP rank pcp_size times: a third copy is one too many
    c = _sim(tmp_path, "c", dcp=1, pcp=2, spec_tokens=0)
    d = _sim(tmp_path, "d", dcp=1, pcp=2, spec_tokens=0, seed=4)
    assert several_runs(open_dumps(c)) is None and several_runs(open_dumps(c + d[:1])) is not None


def test_steps_touching_at_one_step_are_allowed_overlapping_ones_are_not(tmp_path):
    one = [write(tmp_path / "a.safetensors", [obs(step=s) for s in (0, 1, 2, 5)]),
           write(tmp_path / "b.safetensors", [obs(step=s) for s in (5, 5, 6)])]
    assert several_runs(open_dumps(one)) is None
    two = one + [write(tmp_path / "c.safetensors", [obs(step=s) for s in (4, 6)])]
    assert "at step 4" in several_runs(open_dumps(two))


def test_cli_refuses_two_runs_without_merge(tmp_path):
    legacy, fixed = str(SAMPLES / "legacy.safetensors"), str(SAMPLES / "fixed.safetensors")
    for cmd in (["replay"], ["inspect"]):
        r = cli(*cmd, legacy, fixed)
        assert (r.returncode, r.stdout) == (2, "") and r.stderr.count("\n") == 1, r.stderr
        assert "look like two runs" in r.stderr and "--merge" in r.stderr and "dcptool diff" in r.stderr
        assert cli(*cmd, legacy, fixed, "--merge").returncode in (0, 1)
    r = cli("diff", f"{legacy},{fixed}", fixed)
    assert r.returncode == 2 and "look like two runs" in r.stderr
    assert cli("diff", legacy, fixed).returncode == 1  # two runs compared: what diff is for
    merged = cli("replay", legacy, fixed, "--merge", "--json")
    assert merged.returncode == 1 and np.sum(['"type": "finding"' in x for x in merged.stdout.splitlines()]) > 1000
