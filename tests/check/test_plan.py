"""plan.py: the checks replay runs on a dump, read from the rule table, and the skipped ones with why."""

import dataclasses

import numpy as np
import pytest
from conftest import ROOT, obs, worked_example, write

from dcptool.check.plan import checks, plan, run_check
from dcptool.dcp.rules import RULE, TABLE
from dcptool.dump import open_dumps


def test_every_check_once_with_its_rules_in_table_order():
    c = checks()
    assert [r for rules in c.values() for r in rules] == sorted(TABLE, key=lambda r: list(c).index(r.check))
    assert c["values.check_values"] == tuple(RULE[r] for r in ("stale", "global", "wrong-rank", "wrong-interleave",
                                                               "mismatch"))
    assert c["slots.check_slot_rules"] == (RULE["slots"], RULE["slot-partition"])


def test_a_sample_with_every_column_runs_every_check_at_its_dcp_size():
    """The sample records every column but a feature's (MLA's chunked context, KV transfers) and what only some
    engines record (the metadata tensors' addresses ...): it runs every other check, and replay does not say it
    skipped those (quiet) checks."""
    p = plan(open_dumps([str(ROOT / "samples" / "legacy.safetensors")]))
    quiet = {r.check for r in TABLE if r.quiet}
    assert quiet == {"context.check_ctx_chunks", "ranks.check_ctx_agree", "ranks.check_topk_agree",
                     "sparse.check_topk_empty", "transfers.check_transfer", "buffers.check_graph_addr",
                     "buffers.check_capacity", "copies.check_host_copy", "plans.check_plan_pages",
                     "blocks.check_kernel_block"}  # (the sample records no KV transfer)
    assert p.skipped == {} and set(p.run) == set(checks()) - {"values.check_stray"} - quiet
    assert not p.runs("transfer")
    assert p.runs("stale") and p.first("values.check_values").name == "stale" and not p.runs("stray")


def test_a_quiet_check_runs_where_its_feature_is_recorded_and_says_so_at_dcp_size_1(tmp_path):
    o = obs(dcp=1, view=None)
    o.ctx_chunks = np.array([0])
    p = plan(open_dumps([write(tmp_path / "d.safetensors", [o], dcp=1)]))
    assert p.runs("ctx-chunks") and p.skipped["ctx-agree"] == "dcp_size is 1"
    both = [obs(rank=r) for r in (0, 1)]
    for o in both:
        o.ctx_chunks = np.array([0])
    p = plan(open_dumps([write(tmp_path / "e.safetensors", both)]))
    assert p.runs("ctx-chunks") and p.runs("ctx-agree")


def test_dcp_size_1_runs_stray_and_says_which_cross_rank_checks_it_skips(tmp_path):
    d = open_dumps([write(tmp_path / "d.safetensors", [obs(dcp=1, view=None)], dcp=1)])
    p = plan(d)
    assert p.runs("stray") and not p.runs("missing") and not p.runs("mismatch")
    assert list(p.skipped) == ["rank-sum", "ubatch-slice", "stale/parent-rows", "alias", "pages", "empty-mask",
                               "tot-lens", "rank-agree", "slots"]  # (SKIPPED_ORDER)
    assert p.skipped["rank-sum"] == p.skipped["rank-agree"] == "dcp_size is 1"
    assert p.skipped["ubatch-slice"] == RULE["ubatch-slice"].unrecorded


def test_a_part_is_named_when_its_rule_has_its_columns_but_not_the_parts(tmp_path):
    """alias runs on obs.buffer; its graph pairs need obs.graph too. stale's parent rows need obs.parent."""
    d = open_dumps([write(tmp_path / "d.safetensors", [obs(buffer=1234)])])
    p = plan(d)
    assert p.runs("alias") and p.skipped["alias/graph"] == "needs obs.graph for capture/replay pairs"
    assert p.skipped["stale/parent-rows"] == "needs obs.parent and obs.req_start"
    d = open_dumps([write(tmp_path / "e.safetensors", worked_example(False))])
    assert "stale/parent-rows" not in plan(d).skipped and "alias/graph" not in plan(d).skipped


@pytest.mark.parametrize("lazy", [False, True])
def test_run_check_calls_the_named_check_with_the_rows_inputs(tmp_path, lazy):
    """ubatch-slice takes the engine version; a value still being computed (later()) is waited for."""
    from dcptool.check.later import Later
    from dcptool.dcp.rules import VERSION

    o = worked_example(True)
    o[1] = dataclasses.replace(o[1], req_start=1)  # a micro-batch that is not its parent sliced where it says
    d = open_dumps([write(tmp_path / "d.safetensors", o)])
    version = Later(lambda: None) if lazy else None
    t = run_check(d, RULE["ubatch-slice"], {VERSION: version})
    assert t.rule.tolist() == ["ubatch-slice"] and t.index.tolist() == [1]
    assert np.array_equal(run_check(d, RULE["missing"], {}).index, np.zeros(0, np.int64))


@pytest.mark.parametrize("ranks,alone", [((1,), 1), ((0, 1), None), ((2,), 2), ((0, 3), None)])
def test_one_ranks_file_alone_says_the_cross_rank_rules_were_not_checked(tmp_path, ranks, alone):
    """One file of the plugin's layout (one rank of dcp_size N): rank-sum and rank-agree are not run and say why;
    slot-partition, which shares its check with the per-rank `slots`, is named while `slots` runs. Two ranks: run."""
    n = 4
    o = [obs(rank=r, dcp=n, seq=(37, 129, 0, 0)) for r in ranks]
    p = plan(open_dumps([write(tmp_path / "d.safetensors", o, dcp=n)]))
    across = ("rank-sum", "rank-agree", "slot-partition")
    if alone is None:
        assert not set(across) & set(p.skipped) and p.runs("rank-sum") and p.runs("rank-agree")
        return
    why = f"only rank {alone} of {n} is recorded here: replay the ranks' files together (a directory or a glob)"
    assert [p.skipped.get(r) for r in across] == [why, why, None]  # (slots: this dump records no slot columns)
    assert not p.runs("rank-sum") and not p.runs("rank-agree") and p.runs("stale")


def test_a_rank_file_of_a_simulated_run_alone_and_all_together(tmp_path):
    from dcptool.model.config import SimConfig
    from dcptool.model.simulate import simulate

    simulate(SimConfig(steps=3, dcp=4), tmp_path / "run.safetensors", per_rank=True)
    files = sorted(str(f) for f in tmp_path.glob("run.rank*.safetensors"))
    alone = plan(open_dumps(files[2:3]))
    assert alone.skipped["slot-partition"].startswith("only rank 2 of 4") and alone.runs("slots")
    assert "rank-sum" in alone.skipped and not any(k in plan(open_dumps(files)).skipped for k in alone.skipped)
