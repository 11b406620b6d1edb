"""handed.py: what else simulate's builds hand attention (the metadata tensors' addresses), the faults on it found
exactly where they touched across the issue's matrix (PCP 2, micro-batches, MTP, DFlash, per-rank files), and
nothing recorded where no such fault is injected."""

import numpy as np
import pytest
from simulate_cases import MATRIX, config_of, run, verify

from dcptool.dump import word_addrs
from dcptool.dump.schema import GraphMode
from dcptool.model.config import SimConfig
from dcptool.model.handed import TENSORS, Handed

FULL_ROWS = [r for r in MATRIX if r[5] == "full" and r[0] > 1]


def _ids(rows: list[tuple]) -> list[str]:
    return [f"N{r[0]}-I{r[1]}-P{r[2]}-K{r[3]}-U{r[4]}-{r[5]}-{r[6]}" for r in rows]


def _found_only(cfg: SimConfig, fault: str, rule: str, tmp_path):
    """Simulate cfg with `fault`, replay it: the fault applied, every observation it touched found (verify), and no
    rule but `rule`. Returns the simulation, the dump, the replay and the fault's report."""
    res, d, rr = run(cfg, tmp_path)
    rep = res.faults[fault]
    assert rep.applicable and rep.count > 0
    verify(res, d, rr)
    assert set(rr.by_rule()) == {rule}
    return res, d, rr, rep


def test_without_a_fault_on_them_nothing_is_recorded(tmp_path):
    res, d, rr = run(config_of(MATRIX[2], 3), tmp_path)
    assert not d.has("obs.addrs") and not d.has("obs.gaddrs") and d.config.attn_tensors is None


def test_the_buffers_stay_put_without_the_fault():
    """Persistent buffers: a replay's build hands the addresses its graph's capture did (per process, per model)."""
    h = Handed(SimConfig(dcp=2), frozenset({"graph-addr-moved"}) - {"graph-addr-moved"})
    h.on = True
    marks: list = []
    cap, _ = h.addrs(range(2), "capture", 1, GraphMode.FULL_CAPTURE, (8, 8, -1), marks)
    rep, g = h.addrs(range(2), "final", 1, GraphMode.FULL_REPLAY, (8, 8, -1), marks)
    assert np.array_equal(cap, rep) and np.array_equal(g, cap) and marks == []
    eager, g = h.addrs(range(2), "final", 1, GraphMode.EAGER, (5, 5, -1), marks)
    assert g is None and np.array_equal(eager, cap)
    draft, _ = h.addrs(range(2), "draft", 3, GraphMode.EAGER, (5, 5, -1), marks)
    assert not np.array_equal(word_addrs(draft[0])[0], word_addrs(cap[0])[0])  # (the drafter's own builder)


def test_the_fault_moves_the_tensor_at_every_build_and_touches_the_replays():
    h = Handed(SimConfig(dcp=4), frozenset({"graph-addr-moved"}))
    marks: list = []
    cap, _ = h.addrs(range(4), "capture", 1, GraphMode.FULL_CAPTURE, (8, 8, -1), marks)
    rep, g = h.addrs(range(4), "final", 1, GraphMode.FULL_REPLAY, (8, 8, -1), marks)
    assert np.array_equal(g, cap) and marks[0][0] == "graph-addr-moved" and marks[0][1].all()
    a, b = word_addrs(rep[0]), word_addrs(cap[0])
    assert a[0] != b[0] and a[1] == b[1]  # dcp_context_kv_lens moved; seq_lens is the runner's buffer
    assert len(TENSORS) == a.size


@pytest.mark.parametrize("row", FULL_ROWS, ids=_ids(FULL_ROWS))
def test_graph_addr_moved_is_found_exactly_where_it_touched(row, tmp_path):
    cfg = config_of(row, 7, inject=("graph-addr-moved",), steps=10)
    res, d, rr, rep = _found_only(cfg, "graph-addr-moved", "graph-addr", tmp_path)
    assert d.config.attn_tensors == TENSORS
    replays = np.flatnonzero((d["obs.graph"] == 3) & (np.diff(d["obs.gaddrs"]) > 0))
    assert sorted(rep.touched[res.files[0]]) == replays.tolist()


@pytest.mark.parametrize("fault", ["graph-addr-moved", "buffer-undersized", "host-seq-stale", "host-seq-written"])
def test_per_rank_files_like_one_file(tmp_path, fault):
    row = (4, 1, 2, 2, 2, "full", "mtp")
    one = run(config_of(row, 3, inject=(fault,)), tmp_path, "one.safetensors")
    from dcptool.check.replay import replay
    from dcptool.dump import open_dumps
    from dcptool.model.simulate import simulate

    res = simulate(config_of(row, 3, inject=(fault,)), tmp_path / "pr.safetensors", per_rank=True)
    d = open_dumps(res.files)
    rr = replay(d, "torch")
    verify(res, d, rr)
    assert rr.by_rule() == one[2].by_rule() and res.faults[fault].count == one[0].faults[fault].count > 0


# vllm-ascend #16168 on --dcp 4 with full graphs: with and without PCP 2, micro-batches, MTP and DFlash, and eager
BUFFER_ROWS = [(4, 1, 1, 2, 1, "full", "mtp"), (4, 1, 2, 2, 2, "full", "mtp"), (4, 16, 1, 3, 2, "full", "dflash"),
               (4, 1, 2, 0, 2, "full", "mtp"), (2, 1, 1, 0, 1, "none", "mtp")]


@pytest.mark.parametrize("row", BUFFER_ROWS, ids=_ids(BUFFER_ROWS))
def test_buffer_undersized_is_found_exactly_at_the_builds_that_need_the_missing_row(row, tmp_path):
    """The builder's buffer one row short of max_num_reqs: capacity at exactly the builds padded to max_num_reqs
    requests (the largest full graph's capture and replays, a full eager batch), every rank; the addresses are
    recorded with it (persistent buffers: graph-addr silent); nothing else anywhere."""
    cfg = config_of(row, 13, inject=("buffer-undersized",), steps=10)
    res, d, rr, rep = _found_only(cfg, "buffer-undersized", "capacity", tmp_path)
    assert d.config.attn_tensors == TENSORS
    caps = np.flatnonzero(np.diff(d["obs.caps"]) > 0)
    need = caps[d["obs.num_reqs_padded"][caps] > cfg.max_num_reqs - 1]
    assert sorted(rep.touched[res.files[0]]) == need.tolist()
    assert (d["rows.attn_caps"].reshape(-1, 2) == [cfg.max_num_reqs - 1, cfg.max_num_reqs]).all()



# vLLM #29449 and #48003's second half on --dcp 4 with full graphs: with and without PCP 2, micro-batches, MTP, DFlash
COPY_ROWS = [(4, 1, 1, 2, 1, "full", "mtp"), (4, 1, 2, 2, 2, "full", "mtp"), (4, 16, 1, 3, 2, "full", "dflash"),
             (4, 1, 2, 0, 2, "full", "mtp"), (2, 1, 1, 2, 1, "piecewise", "mtp")]


@pytest.mark.parametrize("fault", ["host-seq-stale", "host-seq-written"])
@pytest.mark.parametrize("row", COPY_ROWS, ids=_ids(COPY_ROWS))
def test_host_copy_faults_are_found_exactly_where_they_touched(row, fault, tmp_path):
    """The host copy of seq_lens recorded at every real step's attention build, drafts' too (not dummy runs or
    capture): the stale copy at the builds with verify rows (drafts), the in-place write at the builds with prefill
    rows; host-copy exactly there, every rank; nothing else anywhere; the copy equals the device's elsewhere."""
    cfg = config_of(row, 17, inject=(fault,), steps=10)
    if fault == "host-seq-stale" and row[3] == 0:  # (no draft tokens: no verify rows to be stale for)
        res, d, rr = run(cfg, tmp_path)
        assert not res.faults[fault].applicable and rr.findings == [] and not d.has("obs.hseq")
        return
    res, d, rr, rep = _found_only(cfg, fault, "host-copy", tmp_path)
    assert {f.detail["kind"] for f in rr.findings} == {"stale" if fault == "host-seq-stale" else "written-in-place"}
    recorded = np.flatnonzero(np.diff(d["obs.hseq"]) > 0)
    assert {d.site_name(i) for i in recorded} <= {"attn_metadata", "pcp_partition", "ubatch", "draft"}
