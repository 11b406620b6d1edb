"""The Guard on the host path (CPU tensors, numpy): silent on a clean simulate run, one dump per per-observation fault
whose replay names the rule at the step and rank replaying the full recording does."""

import inspect
import os
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "model"))  # simulate's shared cases
from simulate_cases import EXERCISE, config_of  # noqa: E402

from dcptool.check.replay import replay  # noqa: E402
from dcptool.dcp.rules import RULE_OF_FAULT  # noqa: E402
from dcptool.dump import open_dumps, read_dump  # noqa: E402
from dcptool.dump.observation import ROW_TABLE  # noqa: E402
from dcptool.engine.guard.guard import Guard, GuardError  # noqa: E402
from dcptool.engine.recorder.record import Recorder  # noqa: E402
from dcptool.model.simulate import simulate  # noqa: E402

# The rules replay reports from one observation alone (not alias, rank-sum, rank-agree, ubatch-slice: groups).
PER_OBS_RULES = {"missing", "stale", "padding", "shape", "pages", "empty-mask", "tot-lens", "slots", "graph-addr"}
# slot-all-ranks' rule (slot-partition) is a group rule, but each rank's non-owner writes are `slots` per observation
PER_OBS_FAULTS = [f for f, r in RULE_OF_FAULT.items() if r in PER_OBS_RULES] + ["slot-all-ranks"]
_SCALARS = ("ubatch", "parent", "req_start", "tok_start", "tok_stop", "num_tokens_padded", "buffer", "graph")
LATE_ROWS = ROW_TABLE[[f.section for f in ROW_TABLE].index("sgrp") + 1:]  # the host values' row fields


def observations(d, tensors: bool):
    """Observe()'s keywords of every observation of a dump, in order (rows as CPU tensors or numpy arrays)."""
    c = d.columns
    arr = (lambda a: None if a is None else torch.from_numpy(np.array(a))) if tensors else (
        lambda a: None if a is None else np.array(a))
    for i in range(d.n):
        kw = dict(step=int(c["obs.step"][i]), site=d.site_name(i), rank=int(c["obs.rank"][i]),
                  num_reqs=int(c["obs.num_reqs"][i]), num_reqs_padded=int(c["obs.num_reqs_padded"][i]),
                  seq_lens=arr(d.seq_lens_of(i)), dcp_local_seq_lens=arr(d.dcp_of(i)))
        for k in _SCALARS:
            if f"obs.{k}" in c:
                v = int(c[f"obs.{k}"][i])
                kw[k] = v if v >= 0 or k == "ubatch" else None
        qsl = d.qsl_of(i)
        kw["query_start_loc"] = arr(qsl) if qsl is not None and qsl.size else None
        kw["kv_pages"] = arr(d.kv_pages_of(i))
        for k, v in (("dcp_query_start_loc", d.dqsl_of(i)), ("dcp_tot_seq_lens", d.tot_of(i))):
            kw[k] = arr(v) if v is not None and v.size else None
        if "obs.slots" in c and c["obs.slots"][i + 1] > c["obs.slots"][i]:
            a, b = c["obs.slots"][i], c["obs.slots"][i + 1]
            grp, pos, sl = c["rows.slot_group"][a:b], c["rows.positions"][a:b], c["rows.slot_mapping"][a:b]
            g0 = grp == grp[0]
            kw["positions"] = arr(pos[g0])
            kw["slot_mapping"] = {int(g): arr(sl[grp == g]) for g in np.unique(grp)}
        for f in LATE_ROWS:  # (the host values: numpy arrays, as an engine passes them)
            if f.column in c and c[f.offsets][i + 1] > c[f.offsets][i]:
                kw[f.name] = np.array(c[f.column][c[f.offsets][i]:c[f.offsets][i + 1]])
        yield kw


def guard_of(d, tmp_path, **kw) -> Guard:
    c = d.config
    return Guard(tmp_path / "guard", c.dcp_size, c.cp_interleave, sites=c.sites, pcp_size=c.pcp_size,
                 page_size=c.page_size, engine=c.engine, engine_version=c.engine_version,
                 kv_groups=[{"name": g.name, "dcp": g.dcp, "block_size": g.block_size} for g in c.kv_groups],
                 attn_tensors=c.attn_tensors, **kw)


def run_sim(tmp_path, fault: str | None):
    row = EXERCISE[fault] if fault else (4, 16, 2, 3, 2, "full", "mtp")
    cfg = config_of(row, 3, inject=(fault,) if fault else (), steps=14)
    res = simulate(cfg, tmp_path / "run.safetensors", force=True)
    return open_dumps(res.files)


def test_observe_takes_exactly_recorders_keywords():
    want = inspect.signature(Recorder.observe).parameters
    got = inspect.signature(Guard.observe).parameters
    assert [(p.name, p.kind, p.default) for p in got.values()] == [(p.name, p.kind, p.default) for p in want.values()]


@pytest.mark.parametrize("tensors", [True, False])
def test_clean_simulate_run_writes_nothing(tmp_path, tensors):
    d = run_sim(tmp_path, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = guard_of(d, tmp_path)
        for kw in observations(d, tensors):
            assert g.observe(**kw) >= 0
        assert g.close() is None
    assert g.count == d.n and g.wrong == 0 and g.dropped == 0
    assert not (tmp_path / "guard").exists()


@pytest.mark.parametrize("fault", PER_OBS_FAULTS)
def test_each_per_observation_fault_dumps_once_and_replays_the_same(tmp_path, fault):
    d = run_sim(tmp_path, fault)
    full = replay(d, "torch")
    g = guard_of(d, tmp_path, keep=16)
    with pytest.warns(RuntimeWarning, match="dcptool Guard: wrong DCP metadata") as w:
        for kw in observations(d, True):
            g.observe(**kw)
    assert len([x for x in w if "dcptool Guard" in str(x.message)]) == 1
    path = g.close()
    assert path is not None and str(path) in str(w[0].message)
    assert list((tmp_path / "guard").iterdir()) == [path]  # once
    gd = read_dump(path)
    assert gd.n == min(16, g.first_index + 1)  # the flight recorder: the last `keep` observations ...
    last = gd.n - 1  # ... the wrong one last
    key = int(gd["obs.step"][last]), int(gd["obs.rank"][last]), gd.site_name(last), int(gd["obs.ubatch"][last])
    here = {f.rule for f in replay(gd, "torch").findings if f.obs == last and f.rule in PER_OBS_RULES}
    there = {f.rule for f in full.findings if (f.step, f.rank, f.site, f.ubatch) == key and f.rule in PER_OBS_RULES}
    assert here and here == there, (fault, key, here, there)
    assert RULE_OF_FAULT[fault] in {f.rule for f in full.findings}

def test_on_wrong_raise_and_count(tmp_path):
    d = run_sim(tmp_path, "sentinel")
    obs = list(observations(d, False))
    g = guard_of(d, tmp_path, on_wrong="count")
    for kw in obs:
        g.observe(**kw)
    assert g.wrong > 0 and g.close() is None and not (tmp_path / "guard").exists()
    g = guard_of(d, tmp_path, on_wrong="raise")
    with pytest.raises(GuardError, match="padding"):
        for kw in obs:
            g.observe(**kw)
    assert g.count < len(obs)
    assert not (tmp_path / "guard").exists()


def test_the_fields_only_replay_decides_are_left_out(tmp_path):
    """A field only rules across ranks read (host_checks.NOT_KEPT: the chunked-context schedule) is neither checked
    nor kept: the Guard's dump of a wrong observation holds every other field, and not that one."""
    from dcptool.engine.guard.host_checks import NOT_KEPT

    assert NOT_KEPT == ("ctx_chunks", "group_seq_lens", "verify_row_lens", "sparse_topk")
    g = Guard(tmp_path / "g", 2)
    seq = np.array([8, 5], np.int32)
    kw = dict(step=0, site="s", rank=0, seq_lens=seq, num_reqs=2, num_reqs_padded=2, ctx_chunks=np.arange(5),
              group_seq_lens=np.arange(4), verify_row_lens=np.arange(2), sparse_topk=np.arange(6))
    assert g.observe(**kw, dcp_local_seq_lens=np.array([4, 3], np.int32)) == 0 and g.first_rule is None
    with pytest.warns(RuntimeWarning, match="missing"):
        assert g.observe(**kw) == 1
    d = read_dump(g.close())
    assert d.n == 2 and not {"obs.ctx", "obs.gsl", "obs.vrl", "obs.topk"} & set(d.columns)
    assert d["rows.dcp_local_seq_lens"].tolist() == [4, 3]


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="on_wrong"):
        Guard(tmp_path, 2, on_wrong="log")
    with pytest.raises(ValueError, match="keep"):
        Guard(tmp_path, 2, keep=0)
    g = Guard(tmp_path, 2)
    assert g.observe(step=0, site="s", rank=0, seq_lens=[5, "x"], num_reqs=2, num_reqs_padded=2) == -1
    assert g.dropped == 1


def test_page_size_and_kv_groups_set_later(tmp_path):
    """As the vLLM plugin learns them after the first build: the pages and slot checks use them, the dump holds them."""
    g = Guard(tmp_path / "g", 2, on_wrong="count")
    seq = np.array([8, 5], np.int32)
    kw = dict(step=0, site="s", rank=0, seq_lens=seq, num_reqs=2, num_reqs_padded=2,
              dcp_local_seq_lens=np.array([4, 3], np.int32), kv_pages=np.array([2, 1], np.int32))
    g.observe(**kw)  # no page size yet: pages not checked
    assert g.wrong == 0 and g.set_page_size(4) == 4 and g.set_page_size(8) == 4
    g.observe(**kw)  # cdiv(4, 4) = 1, not 2
    assert g.first_rule == "pages"
    g = Guard(tmp_path / "h", 2)
    g.set_kv_groups([{"name": "mamba", "dcp": False, "block_size": 4}])
    with pytest.warns(RuntimeWarning, match=r"\(slots\)"):  # a replicated group written by the owner only
        g.observe(**dict(kw, kv_pages=None, positions=np.array([0, 1], np.int32),
                         slot_mapping=np.array([[0, -1]], np.int32)))
    assert read_dump(g.close()).config.kv_groups[0].name == "mamba"


@pytest.mark.parametrize("where", ["free", "taken", "unwritable"])
def test_a_dump_never_replaces_another_nor_breaks_the_engine(tmp_path, where):
    """The dump is named by process, rank and step; a name already there (a second Guard in one process, a process
    id used again) gets .1, .2 ...; a directory it cannot write into is said in the warning, observe() goes on."""
    seq = np.array([8, 5], np.int32)
    kw = dict(step=3, site="s", rank=1, seq_lens=seq, num_reqs=2, num_reqs_padded=2,
              dcp_local_seq_lens=np.array([4, 3], np.int32))  # rank 1 of 2: 4, 2
    out = tmp_path / "g"
    if where == "unwritable":
        out.write_text("a file, not a directory")
    for _ in range(1 + (where == "taken")):
        g = Guard(out, 2)
        with pytest.warns(RuntimeWarning, match=r"\(values\) at step 3"):
            assert g.observe(**kw) == 0
        assert g.observe(**dict(kw, step=4)) == 1 and g.close() == g.dumped
    if where == "unwritable":
        assert g.dumped is None and out.read_text() == "a file, not a directory"
        return
    name = f"guard.{os.getpid()}.rank1.step3"
    assert g.dumped.name == (f"{name}.1.safetensors" if where == "taken" else f"{name}.safetensors")
    assert sorted(p.name for p in out.iterdir()) == sorted({f"{name}.safetensors", g.dumped.name})


@pytest.mark.parametrize("compiled", [False, True])
def test_kernel_true_with_cpu_tensors_on_a_gpu_machine_takes_the_host_path(tmp_path, monkeypatch, compiled):
    """kernel=True sends CPU tensors to the check kernel where Triton's interpreter runs it; where it is compiled for a
    GPU (it would read host memory at device addresses: an illegal address that ends the process) they take the
    host path: checked, none dropped, the wrong view named."""
    import dcptool.engine.guard.guard as guard

    monkeypatch.setattr(guard, "_compiled_on_a_gpu", lambda: compiled)
    g = Guard(tmp_path, 2, 1, kernel=True, on_wrong="count")
    assert (g._kernel is None) == compiled
    if compiled:
        seq = torch.tensor([8, 5, 3], dtype=torch.int32)
        g.observe(step=0, site="s", rank=0, seq_lens=seq, num_reqs=3, num_reqs_padded=3,
                  dcp_local_seq_lens=torch.tensor([4, 3, 1], dtype=torch.int32))  # (rank 0 of 2: 4, 3, 2)
        g.close()
        assert (g.count, g.dropped, g.first_rule, g._dev) == (1, 0, "values", None)
