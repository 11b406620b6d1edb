"""Dumps recorded through the plugin from the installed vLLM's own code (0.29, 0.33, 0.34: `make test-vllm`).

Batches are built, sliced (UBatchRunner.prepare / _slice_input_batch, 0.30+), partitioned
(PCPManager.partition_batch), captured (prepare_inputs_to_capture, the DFlash capture path),
dummy-run (make_dummy / prepare_dummy_attn / set_dummy_context) and turned into attention metadata
(DefaultModelState.prepare_attn -> build_attn_metadata) by vLLM; the plugin records what
build_attn_metadata consumes; dcptool replays the files. Post-fix releases (0.30+) replay clean;
a pre-fix release (0.29) shows its real faults, where attention received wrong values, and only there.
"""

import dataclasses
import inspect
import json
import os
import subprocess
import sys

import engine as E
import numpy as np
import pytest
from vllm.v1.worker.gpu import attn_utils
from vllm.v1.worker.gpu.cudagraph_utils import prepare_inputs_to_capture
from vllm.v1.worker.gpu.model_states import default as default_state
from vllm.v1.worker.gpu.spec_decode.dflash import cudagraph as dflash

from dcptool.check.replay import local_np, replay
from dcptool.dump import open_dumps
from dcptool.engine import vllm as plugin

pytestmark = pytest.mark.vllm
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_ubatch = pytest.mark.skipif(not E.HAS_UBATCH, reason=f"vLLM {E.VERSION} has no model-runner-V2 micro-batching")
if E.HAS_UBATCH:
    from vllm.v1.worker.gpu import ubatch_utils
    from vllm.v1.worker.gpu.ubatch_utils import create_ubatch_slices


def replayed(files):
    d = open_dumps(files)
    return d, replay(d, "torch")


def rules_by_obs(d, res):
    out = {}
    for f in res.findings:
        key = (f.step, f.site, f.rank, f.ubatch)
        out.setdefault(key, set()).add(f.rule + (f"/{f.source.relation}" if f.source else ""))
    return out


def messages(res):
    return [f"{f.site} {f.rule}: {f.message}" for f in res.findings]


def test_the_plugin_is_loaded_by_vllm_and_hooks_its_functions():
    assert E.VERSION in plugin.TESTED
    assert plugin.STATE.registered and plugin.STATE.active, "register() ran through vllm.general_plugins"
    # every hooked module got its release line's own table (0.29, 0.31-0.33, 0.34)
    own = plugin.tables_for(E.VERSION)[0]
    assert E.VERSION.startswith(own.releases) and set(plugin.STATE.used.values()) == {own.line}, plugin.STATE.used
    assert attn_utils.build_attn_metadata.__wrapped_by_dcptool__
    # build_attn_metadata cuts both views to [:num_reqs] in every supported release: that is what is recorded
    assert {"seq_lens", "dcp_local_seq_lens"} <= attn_utils.build_attn_metadata.__dcptool_consumed__
    assert default_state.build_attn_metadata is attn_utils.build_attn_metadata  # the name the model state calls
    assert default_state.DefaultModelState.prepare_attn.__wrapped_by_dcptool__
    draft = getattr(E.DraftModelSpeculator, "_build_attn_metadata", None) or \
        E.DraftModelSpeculator._build_draft_attn_metadata
    hooked = [prepare_inputs_to_capture, dflash._prepare_dflash_inputs_to_capture, dflash.build_attn_metadata,
              E.PCPManager.partition_batch, draft, E.GPUModelRunner.execute_model]
    if E.HAS_UBATCH:
        hooked += [ubatch_utils.UBatchRunner.prepare, ubatch_utils._slice_input_batch]
    for fn in hooked:
        assert fn.__wrapped_by_dcptool__, fn
    # what the runner does where: the fix moved the DCP step from prepare_inputs into execute_model
    assert E.PRE_FIX == E.VERSION.startswith("0.29.")
    assert E.HAS_UBATCH == (not E.VERSION.startswith("0.29."))


def test_the_dump_says_which_sites_the_release_can_produce(tmp_path, monkeypatch):
    def drive(rank):
        bufs = E.buffers(4, 8)
        b = E.prepare_inputs([1, 1], [17, 25], bufs, dcp=(2, rank, 1))
        if not E.PRE_FIX:
            E.dcp_step(b, bufs, 2, rank, 1)
        bt = E.tables(4, 8, 2, rank, 1)
        with plugin.step(runner=E.runner(bt, 2, rank, 1, bufs)):
            E.attn(E.model_state(), b, bt)

    files = E.run_ranks(2, drive, tmp_path, monkeypatch)
    d = open_dumps(files)
    assert d.config.engine_version == E.VERSION and f"vLLM {E.VERSION}" in d.config.note
    assert ("not possible: ubatch" in d.config.note) == (not E.HAS_UBATCH)
    from typer.testing import CliRunner

    from dcptool.cli import app

    out = CliRunner().invoke(app, ["inspect", *map(str, files)]).output
    assert "sites possible: attn_metadata" in out and ("not possible: ubatch" in out) == (not E.HAS_UBATCH)


# --------------------------------------------------------------------------------------------
# Real steps, dummy runs, CUDA-graph capture (generic and DFlash): the whole engine, one release


def drive_engine(dcp, il, rank):
    """One rank's engine: capture (FULL and PIECEWISE sizes, DFlash), a profile dummy run and DP dummy runs,
    then real steps (eager, and FULL replays of a padded batch)."""
    mnr, mnt = 16, 64
    bufs, bt = E.buffers(mnr, mnt), E.tables(mnr, mnt, dcp, rank, il)
    ms = E.model_state()
    for nr, nt, full in ((8, 8, True), (4, 4, True), (2, 2, False)):
        prepare_inputs_to_capture(nr, nt, ms, bufs, bt, [[]], E.KV, full_cudagraph=full)
    dbufs = E.buffers(mnr, mnt)
    for nr, nt in ((4, 8), (8, 16)):
        dflash._prepare_dflash_inputs_to_capture(nr, nt, dbufs, bt, [[]], E.KV, E.MAX_MODEL_LEN, skip_attn=False,
                                                 causal=True)
    r = E.runner(bt, dcp, rank, il, bufs)
    E.dummy_run(r, ms, 4, 16, "none", context_len=100)  # profile run: decode-like with context
    E.dummy_run(r, ms, 8, 8, "full")  # DP dummy step replaying a FULL graph
    E.dummy_run(r, ms, 2, 2, "piecewise")
    for q, s, mode, nrp, ntp in (([1, 1, 1, 1, 1], [40, 33, 7, 1000, 64], "full", 8, 8),
                                 ([1, 9, 1], [17, 9, 2048], "none", None, None),
                                 ([1, 1, 1], [18, 26, 3], "full", 4, 4)):
        b = E.prepare_inputs(q, s, bufs, num_tokens_padded=ntp, num_reqs_padded=nrp, dcp=(dcp, rank, il))
        if not E.PRE_FIX:
            E.dcp_step(b, bufs, dcp, rank, il)
        with plugin.step():
            E.attn(ms, b, bt, mode)


@pytest.mark.parametrize("dcp,il", [(2, 1), (4, 16)])
def test_an_engine_run_replays_clean_after_the_fix_and_shows_the_pre_fix_faults(tmp_path, monkeypatch, dcp, il):
    d, res = replayed(E.run_ranks(dcp, lambda rank: drive_engine(dcp, il, rank), tmp_path, monkeypatch))
    sites = [d.site_name(i) for i in range(d.n)]
    assert sites.count("capture") == 3 * dcp and sites.count("dflash_capture") == 2 * dcp
    assert sites.count("dummy") == 3 * dcp and sites.count("attn_metadata") == 3 * dcp
    if not E.PRE_FIX:
        assert res.findings == [], messages(res)
        return
    # 0.29: the dummy runs hand attention None; everything else attention reads is right
    dummy = {i for i in range(d.n) if sites[i] == "dummy"}
    assert {(f.site, f.rule) for f in res.findings} == {("dummy", "missing")}, messages(res)
    assert {f.index for f in res.findings} == dummy
    assert d["obs.has_dcp"][sorted(dummy)].tolist() == [0] * len(dummy)


def test_dummy_runs(tmp_path, monkeypatch):
    def drive(rank):
        bufs, bt = E.buffers(8, 32), E.tables(8, 32, 2, rank, 1)
        r = E.runner(bt, 2, rank, 1, bufs)
        E.dummy_run(r, E.model_state(), 3, 7, "none", context_len=9)  # uneven: the last request gets 1 more

    d, res = replayed(E.run_ranks(2, drive, tmp_path, monkeypatch))
    assert d.n == 2 and {d.site_name(i) for i in range(2)} == {"dummy"}
    assert d.seq_lens_of(0).tolist() == [11, 11, 12]  # vLLM's make_dummy + set_dummy_context
    if E.PRE_FIX:
        assert [f.rule for f in res.findings] == ["missing"] * 2 and d["obs.has_dcp"].tolist() == [0, 0]
    else:
        assert res.findings == [], messages(res)
        assert [d.dcp_of(i).tolist() for i in range(2)] == [[6, 6, 6], [5, 5, 6]]


# --------------------------------------------------------------------------------------------
# Micro-batches (DBO, 0.30+): UBatchRunner.prepare -> _slice_input_batch -> prepare_attn per micro-batch


def drive_ubatches(query_lens, seq_lens, dcp, il, mode="none", ntp=None, nrp=None, k=2, uniform=None):
    nr = len(query_lens)
    mnr, mnt = max(nr, nrp or 0) + 1, max(sum(query_lens), ntp or 0) + 1

    def drive(rank):
        bufs = E.buffers(mnr, mnt)
        ms = E.model_state()
        b = E.prepare_inputs(query_lens, seq_lens, bufs, num_tokens_padded=ntp, num_reqs_padded=nrp)
        E.dcp_step(b, bufs, dcp, rank, il)
        bt = E.tables(mnr, mnt, dcp, rank, il)
        ur = E.ubatch_runner(ms, mnr, dcp, rank, il, k)
        with plugin.step():  # GPUModelRunner.execute_model opens this scope
            E.ubatch_prepare(ur, b, bt, mode, uniform_token_count=uniform)

    return drive


@needs_ubatch
def test_ubatch_worked_example_is_recorded_and_replays_clean(tmp_path, monkeypatch):
    files = E.run_ranks(2, drive_ubatches([1, 1, 10, 1, 1], [64, 96, 512, 32, 48], 2, 1), tmp_path, monkeypatch)
    assert sorted(os.path.basename(f) for f in files) == ["rank0.00000.safetensors", "rank1.00000.safetensors"]
    d, res = replayed(files)
    assert d.n == 6 and d.config.engine == "vllm" and d.config.engine_version == E.VERSION
    for rank in (0, 1):
        parent, ub0, ub1 = np.flatnonzero(d["obs.rank"] == rank)
        assert (d.site_name(parent), d["obs.ubatch"][parent]) == ("attn_metadata", -1)
        assert [d.site_name(i) for i in (ub0, ub1)] == ["ubatch", "ubatch"]
        assert d["obs.parent"][ub0] == d["obs.parent"][ub1] == parent
        # docs/dcp.md's worked example, as vLLM computed it
        assert d.seq_lens_of(ub0).tolist() == [64, 96, 507] and d.qsl_of(ub0).tolist() == [0, 1, 2, 7]
        assert d.seq_lens_of(ub1).tolist() == [512, 32, 48] and d.qsl_of(ub1).tolist() == [0, 5, 6, 7]
        assert d.dcp_of(ub0).tolist() == [[32, 48, 254], [32, 48, 253]][rank]
        assert d.dcp_of(parent)[2] == 256
        assert (d["obs.req_start"][ub1], d["obs.tok_start"][ub1], d["obs.tok_stop"][ub1]) == (2, 7, 14)
        assert len({int(d["obs.buffer"][i]) for i in (parent, ub0, ub1)}) == 3  # each its own buffer
    assert res.findings == [], messages(res)
    assert "ubatch-slice" not in res.skipped and "alias" not in res.skipped


UB_CASES = [  # (seed, dcp, interleave, graph mode, extra tokens of padding, extra request rows)
    (0, 2, 1, "none", 0, 0), (1, 2, 16, "full", 5, 3), (2, 4, 1, "full", 40, 2), (3, 4, 8, "none", 0, 0),
    (4, 2, 2, "full", 0, 0), (5, 3, 1, "none", 17, 0),
]


@needs_ubatch
@pytest.mark.parametrize("seed,dcp,il,mode,pad_tok,pad_req", UB_CASES)
def test_random_ubatches_replay_clean(tmp_path, monkeypatch, seed, dcp, il, mode, pad_tok, pad_req):
    rng = np.random.default_rng(seed)
    nr = int(rng.choice([1, 2, 7, 129 if seed == 2 else 12]))
    q = rng.integers(1, 4, nr)
    q[rng.random(nr) < 0.3] = int(rng.integers(5, 40))  # some prefills
    if q.sum() < 2:
        q[0] = 2
    s = q + rng.integers(0, 3000, nr)
    nt = int(q.sum())
    drive = drive_ubatches(q.tolist(), s.tolist(), dcp, il, mode, ntp=nt + pad_tok,
                           nrp=nr + pad_req if mode == "full" else None)
    files = E.run_ranks(dcp, drive, tmp_path, monkeypatch)
    d, res = replayed(files)
    assert d.n == 3 * dcp and set(d["obs.ubatch"].tolist()) == {-1, 0, 1}
    assert res.findings == [], messages(res)
    if mode == "full":
        assert set(d["obs.graph"].tolist()) == {3}  # a FULL step replays graphs
    # the recorded views are vLLM's kernel's, and they are the formula
    for i in np.flatnonzero(d["obs.ubatch"] >= 0):
        nr_i = int(d["obs.num_reqs"][i])
        want = local_np(d.seq_lens_of(i)[:nr_i], dcp, int(d["obs.rank"][i]), il)
        assert d.dcp_of(i)[:nr_i].tolist() == want.tolist()


@needs_ubatch
def test_uniform_multi_token_batch_split_replays_clean(tmp_path, monkeypatch):
    """5 requests x 3 tokens (spec-decode verification), K=2: 0.34 splits at a request boundary, 0.33 mid-request.
    Replay checks each micro-batch against the slices vLLM recorded, so both replay clean."""
    drive = drive_ubatches([3] * 5, [40, 50, 60, 70, 80], 2, 1, uniform=3)
    d, res = replayed(E.run_ranks(2, drive, tmp_path, monkeypatch))
    ub = np.flatnonzero((d["obs.rank"] == 0) & (d["obs.ubatch"] >= 0))
    got = [(int(d["obs.req_start"][i]), int(d["obs.tok_start"][i]), int(d["obs.tok_stop"][i])) for i in ub]
    assert got == ([(0, 0, 6), (2, 6, 15)] if E.UB_TAKES_DESC else [(0, 0, 7), (2, 7, 15)])  # vLLM's own split
    assert res.findings == [], messages(res)


@needs_ubatch
def test_replay_split_of_a_uniform_multi_token_batch_agrees_with_the_release(tmp_path, monkeypatch):
    """`replay --split 2` re-splits each parent by dcptool's rule and compares with what vLLM recorded."""
    drive = drive_ubatches([3] * 5, [40, 50, 60, 70, 80], 2, 1, uniform=3)
    d = open_dumps(E.run_ranks(2, drive, tmp_path, monkeypatch))
    res = replay(d, "torch", split=2)
    assert res.findings == [], messages(res)


@needs_ubatch
def test_ubatches_that_copy_the_parents_rows_are_caught(tmp_path, monkeypatch):
    """The slicer on vLLM main between releases: a micro-batch took a view of its parent's DCP rows."""
    name = "prepare_dcp_local_seq_lens" if hasattr(ubatch_utils, "prepare_dcp_local_seq_lens") else \
        "maybe_prepare_dcp_local_seq_lens"
    state = {}

    def parent_rows(buf, seq_lens, num_reqs, dcp_size, dcp_rank, cp_interleave, *, num_reqs_padded=None):
        s = state["slices"].pop(0)
        return state["parent"].dcp_local_seq_lens[s.request_slice]

    real_prepare_ub = ubatch_utils.UBatchRunner.prepare

    def prepare(self, input_batch, *a, **kw):  # note the slices vLLM will cut, then let vLLM cut them
        state["slices"], state["parent"] = create_ubatch_slices(input_batch, self.num_ubatches), input_batch
        return real_prepare_ub(self, input_batch, *a, **kw)

    monkeypatch.setattr(ubatch_utils, name, parent_rows)
    monkeypatch.setattr(ubatch_utils.UBatchRunner, "prepare", prepare)
    files = E.run_ranks(2, drive_ubatches([1, 1, 10, 1, 1], [64, 96, 512, 32, 48], 2, 1), tmp_path, monkeypatch)
    monkeypatch.undo()
    d, res = replayed(files)
    assert rules_by_obs(d, res) == {
        (0, "ubatch", 0, 0): {"stale/parent-rows"},
        (0, "ubatch", 1, 0): {"stale/parent-rows", "rank-sum"},  # 256 + 256 != 507
        (0, "ubatch", 0, 1): {"alias"},  # both micro-batches read the parent's buffer
        (0, "ubatch", 1, 1): {"alias"},
    }
    f = next(f for f in res.findings if f.rule == "stale" and f.rank == 1)
    assert (f.row, f.recorded, f.expected) == (2, 256, 253)


# --------------------------------------------------------------------------------------------
# PCP: PCPManager.partition_batch, then the runner's DCP step (0.30+) or the partition's own (0.29)


PCP_BATCH = ([1, 16, 1, 9], [40, 16, 50, 20])  # two decodes, two prefills


def drive_pcp(pcp_rank, dcp, il, mode="none", legacy=False):
    q, s = PCP_BATCH

    def drive(rank):
        bufs = E.buffers(8, 64)
        mgr = E.pcp_manager(2, pcp_rank, 8, 64, dcp, rank, il)
        b = E.prepare_inputs(q, s, bufs, dcp=(dcp, rank, il))  # 0.29 derives a view here, from the global batch
        if legacy and b.dcp_local_seq_lens is None:
            E.dcp_step(b, bufs, dcp, rank, il)
        with plugin.step():
            local = E.partition(mgr, b, mode, 64 if mode != "none" else sum(q))
            if legacy:  # a fault: the global batch's view carried through the partition
                local = dataclasses.replace(local, dcp_local_seq_lens=b.dcp_local_seq_lens)
            elif E.DCP_IN_EXECUTE_MODEL:
                E.dcp_step(local, mgr.input_buffers, dcp, rank, il)
            E.attn(E.model_state(), local, E.tables(16, 64, dcp, rank, il), mode)

    return drive


@pytest.mark.parametrize("mode", ["none", "piecewise"])
@pytest.mark.parametrize("il", [1, 4])
def test_pcp_partitioned_batches_replay_clean(tmp_path, monkeypatch, mode, il):
    for p in (0, 1):
        files = E.run_ranks(2, drive_pcp(p, 2, il, mode), tmp_path / f"pcp{p}", monkeypatch)
        d, res = replayed(files)
        sites = [d.site_name(i) for i in range(d.n)]
        # 0.29's prepare_inputs gives the global batch a view (right for it) that the partition replaces
        assert sites == (["prepare_inputs", "attn_metadata"] if E.PRE_FIX else ["attn_metadata"]) * 2
        assert d.config.dcp_size == 2 and d.config.cp_interleave == il
        assert res.findings == [], messages(res)
        assert d["obs.num_reqs"][sites.index("attn_metadata")] > 4  # the local batch: prefill chunks as rows


def test_pcp_view_carried_from_the_global_batch_is_caught(tmp_path, monkeypatch):
    files = E.run_ranks(2, drive_pcp(0, 2, 1, legacy=True), tmp_path, monkeypatch)
    d, res = replayed(files)
    assert [d.site_name(i) for i in range(d.n)] == ["prepare_inputs", "attn_metadata"] * 2
    got = rules_by_obs(d, res)
    for rank in (0, 1):
        assert "stale/earlier-in-step" in got[(0, "attn_metadata", rank, -1)]
        assert "shape" in got[(0, "attn_metadata", rank, -1)]
        assert (0, "prepare_inputs", rank, -1) not in got  # right for the global batch it was made from
    src = next(f.source for f in res.findings if f.rule == "stale")
    assert src.site == "prepare_inputs"


# --------------------------------------------------------------------------------------------
# CUDA-graph capture (generic and DFlash) and speculator drafts


@pytest.mark.parametrize("full", [True, False])
def test_capture_inputs_replay_clean(tmp_path, monkeypatch, full):
    def drive(rank):
        bufs, bt = E.buffers(8, 32), E.tables(8, 32, 2, rank, 1)
        for num_reqs, num_tokens in ((4, 4), (8, 16), (1, 1)):
            prepare_inputs_to_capture(num_reqs, num_tokens, E.model_state(), bufs, bt, [[]], E.KV, full_cudagraph=full)

    d, res = replayed(E.run_ranks(2, drive, tmp_path, monkeypatch))
    assert d.n == 6 and {d.site_name(i) for i in range(d.n)} == {"capture"}
    assert set(d["obs.graph"].tolist()) == {2 if full else 1}
    assert res.findings == [], messages(res)
    # the seq_lens capture hands attention, as each release prepares them: 0.29-0.30 capture the bare dummy batch
    # (seq_len = query_len); 0.31+ FULL captures first add dcp*interleave tokens of context (set_dcp_capture_context)
    with_context = full and "set_dcp_capture_context" in inspect.getsource(prepare_inputs_to_capture)
    assert d.seq_lens_of(0).tolist() == ([3] * 4 if with_context else [1] * 4)


def test_dflash_capture_replays_clean_with_the_view_attention_reads(tmp_path, monkeypatch):
    passed = []
    wrapper = dflash.build_attn_metadata

    def spy(**kw):  # what the capture path passes; the plugin records what build_attn_metadata reads of it
        passed.append(None if kw["dcp_local_seq_lens"] is None else tuple(kw["dcp_local_seq_lens"].shape))
        return wrapper(**kw)

    monkeypatch.setattr(dflash, "build_attn_metadata", spy)

    def drive(rank):
        bufs, bt = E.buffers(8, 32), E.tables(8, 32, 2, rank, 1)
        for num_reqs, num_tokens in ((4, 8), (8, 32)):
            dflash._prepare_dflash_inputs_to_capture(num_reqs, num_tokens, bufs, bt, [[]], E.KV, E.MAX_MODEL_LEN,
                                                     skip_attn=False, causal=True)

    d, res = replayed(E.run_ranks(2, drive, tmp_path, monkeypatch))
    assert d.n == 4 and {d.site_name(i) for i in range(d.n)} == {"dflash_capture"}
    assert res.findings == [], messages(res)
    assert sorted(len(d.dcp_of(i)) for i in range(4)) == [4, 4, 8, 8]
    # 0.29 passes its whole 8-row buffer even for 4 requests; attention reads [:num_reqs] of it
    assert passed == ([(8,)] * 4 if E.PRE_FIX else [(4,), (8,)] * 2)


def test_dflash_capture_without_a_view_is_caught(tmp_path, monkeypatch):
    """The fault 0.27-0.28 shipped (DFlash capture with no DCP view): block tables that see no DCP in a DCP run."""
    def drive(rank):
        bufs, bt = E.buffers(8, 32), E.tables(8, 32, 1, 0, 1)
        for num_reqs, num_tokens in ((4, 8), (8, 32)):
            dflash._prepare_dflash_inputs_to_capture(num_reqs, num_tokens, bufs, bt, [[]], E.KV, E.MAX_MODEL_LEN,
                                                     skip_attn=False, causal=True)

    d, res = replayed(E.run_ranks(2, drive, tmp_path, monkeypatch))
    assert [f.rule for f in res.findings] == ["missing"] * 4
    assert {f.site for f in res.findings} == {"dflash_capture"}


@pytest.mark.parametrize("mode,nrp", [("none", None), ("full", 6)])
def test_draft_builds_replay_clean(tmp_path, monkeypatch, mode, nrp):
    def drive(rank):
        bt = E.tables(8, 32, 2, rank, 1)
        sp = E.speculator(8, 32, 2, bt)
        nr = 4
        target = np.array([33, 7, 1024, 129], np.int32)
        with plugin.step():
            for step in (1, 2):  # draft steps advance the draft's own sequence lengths
                sp.input_buffers.seq_lens[:nr] = E.torch.from_numpy(target + step)
                qsl = np.arange(nr + 1, dtype=np.int32)
                E.draft_build(sp, nr, mode, nrp, qsl, E.torch.from_numpy(target), step)

    d, res = replayed(E.run_ranks(2, drive, tmp_path, monkeypatch))
    assert d.n == 4 and {d.site_name(i) for i in range(d.n)} == {"draft"}
    assert d["obs.num_reqs"].tolist() == [4] * 4 and d["obs.num_reqs_padded"].tolist() == [nrp or 4] * 4
    assert d.seq_lens_of(1)[:4].tolist() == [35, 9, 1026, 131]
    assert res.findings == [], messages(res)


def test_cli_replays_and_diffs_recorded_runs(tmp_path, monkeypatch):
    def drive(rank):
        drive_engine(2, 1, rank)

    fixed = E.run_ranks(2, drive, tmp_path / "a", monkeypatch)
    again = E.run_ranks(2, drive, tmp_path / "b", monkeypatch)
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-m", "dcptool", "replay", "--backend", "triton", *fixed, "--json"],
                       capture_output=True, text=True, env=env)
    assert p.returncode == (1 if E.PRE_FIX else 0), p.stdout + p.stderr
    summary = json.loads(p.stdout.splitlines()[-1])
    assert summary["findings"] == (6 if E.PRE_FIX else 0), p.stdout  # 0.29: 3 dummy runs x 2 ranks, missing
    # two runs of the same batches: other buffer addresses, the same run
    p = subprocess.run([sys.executable, "-m", "dcptool", "diff", str(tmp_path / "a"), str(tmp_path / "b")],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert len(again) == 2
