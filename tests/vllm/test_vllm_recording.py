"""Dumps recorded through the plugin from vLLM 0.33.0's own code replay clean; pre-fix behaviours do not.

Batches are built, sliced (UBatchRunner.prepare / _slice_input_batch), partitioned
(PCPManager.partition_batch), captured (prepare_inputs_to_capture, the DFlash capture path) and
turned into attention metadata (DefaultModelState.prepare_attn -> build_attn_metadata) by vLLM;
the plugin records what build_attn_metadata receives; dcptool replays the files.
"""

import dataclasses
import json
import os
import subprocess
import sys

import engine as E
import numpy as np
import pytest
from vllm.v1.worker.gpu import attn_utils, ubatch_utils
from vllm.v1.worker.gpu.cudagraph_utils import prepare_inputs_to_capture
from vllm.v1.worker.gpu.model_states import default as default_state
from vllm.v1.worker.gpu.spec_decode.dflash import cudagraph as dflash
from vllm.v1.worker.gpu.ubatch_utils import create_ubatch_slices

from dcptool.dump import open_dumps
from dcptool.integrations import vllm as plugin
from dcptool.replay import local_np, replay

pytestmark = pytest.mark.vllm
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def replayed(files):
    d = open_dumps(files)
    return d, replay(d, "torch")


def rules_by_obs(d, res):
    out = {}
    for f in res.findings:
        key = (f.step, f.site, f.rank, f.ubatch)
        out.setdefault(key, set()).add(f.rule + (f"/{f.source.relation}" if f.source else ""))
    return out


def test_the_plugin_is_loaded_by_vllm_and_hooks_its_functions():
    import vllm

    assert vllm.__version__ in plugin.TESTED
    assert plugin._S.registered and plugin._S.active, "register() ran through vllm.general_plugins"
    assert attn_utils.build_attn_metadata.__wrapped_by_dcptool__
    assert default_state.build_attn_metadata is attn_utils.build_attn_metadata  # the name the model state calls
    assert default_state.DefaultModelState.prepare_attn.__wrapped_by_dcptool__
    for fn in (ubatch_utils.UBatchRunner.prepare, ubatch_utils._slice_input_batch, prepare_inputs_to_capture,
               dflash._prepare_dflash_inputs_to_capture, dflash.build_attn_metadata,
               E.PCPManager.partition_batch, E.DraftModelSpeculator._build_attn_metadata):
        assert fn.__wrapped_by_dcptool__, fn


# --------------------------------------------------------------------------------------------
# Micro-batches (DBO): UBatchRunner.prepare -> _slice_input_batch -> prepare_attn per micro-batch


def drive_ubatches(query_lens, seq_lens, dcp, il, mode="none", ntp=None, nrp=None, k=2):
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
            ur.prepare(b, bt.get_dummy_block_tables(b.num_reqs_after_padding),
                       bt.get_dummy_slot_mappings(b.num_tokens_after_padding), cg_mode=E.MODES[mode])

    return drive


def test_ubatch_worked_example_is_recorded_and_replays_clean(tmp_path, monkeypatch):
    files = E.run_ranks(2, drive_ubatches([1, 1, 10, 1, 1], [64, 96, 512, 32, 48], 2, 1), tmp_path, monkeypatch)
    assert sorted(os.path.basename(f) for f in files) == ["rank0.00000.safetensors", "rank1.00000.safetensors"]
    d, res = replayed(files)
    assert d.n == 6 and d.config.engine == "vllm" and d.config.engine_version == "0.33.0"
    for rank in (0, 1):
        parent, ub0, ub1 = np.flatnonzero(d["obs.rank"] == rank)
        assert (d.site_name(parent), d["obs.ubatch"][parent]) == ("attn_metadata", -1)
        assert [d.site_name(i) for i in (ub0, ub1)] == ["ubatch", "ubatch"]
        assert d["obs.parent"][ub0] == d["obs.parent"][ub1] == parent
        # DESIGN §1's worked example, as vLLM computed it
        assert d.seq_lens_of(ub0).tolist() == [64, 96, 507] and d.qsl_of(ub0).tolist() == [0, 1, 2, 7]
        assert d.seq_lens_of(ub1).tolist() == [512, 32, 48] and d.qsl_of(ub1).tolist() == [0, 5, 6, 7]
        assert d.dcp_of(ub0).tolist() == [[32, 48, 254], [32, 48, 253]][rank]
        assert d.dcp_of(parent)[2] == 256
        assert (d["obs.req_start"][ub1], d["obs.tok_start"][ub1], d["obs.tok_stop"][ub1]) == (2, 7, 14)
        assert len({int(d["obs.buffer"][i]) for i in (parent, ub0, ub1)}) == 3  # each its own buffer
    assert res.findings == [], [f.message for f in res.findings]
    assert "ubatch-slice" not in res.skipped and "alias" not in res.skipped


UB_CASES = [  # (seed, dcp, interleave, graph mode, extra tokens of padding, extra request rows)
    (0, 2, 1, "none", 0, 0), (1, 2, 16, "full", 5, 3), (2, 4, 1, "full", 40, 2), (3, 4, 8, "none", 0, 0),
    (4, 2, 2, "full", 0, 0), (5, 3, 1, "none", 17, 0),
]


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
    assert res.findings == [], [f.message for f in res.findings]
    if mode == "full":
        assert set(d["obs.graph"].tolist()) == {3}  # a FULL step replays graphs
    # the recorded views are vLLM's kernel's, and they are the formula
    for i in np.flatnonzero(d["obs.ubatch"] >= 0):
        nr_i = int(d["obs.num_reqs"][i])
        want = local_np(d.seq_lens_of(i)[:nr_i], dcp, int(d["obs.rank"][i]), il)
        assert d.dcp_of(i)[:nr_i].tolist() == want.tolist()


def test_ubatches_that_copy_the_parents_rows_are_caught(tmp_path, monkeypatch):
    """The pre-fix slicing: a micro-batch took a view of its parent's DCP rows instead of its own."""
    real_prepare = ubatch_utils.prepare_dcp_local_seq_lens
    state = {}

    def parent_rows(buf, seq_lens, num_reqs, dcp_size, dcp_rank, cp_interleave, *, num_reqs_padded=None):
        s = state["slices"].pop(0)
        return state["parent"].dcp_local_seq_lens[s.request_slice]

    real_prepare_ub = ubatch_utils.UBatchRunner.prepare

    def prepare(self, input_batch, *a, **kw):  # note the slices vLLM will cut, then let vLLM cut them
        state["slices"], state["parent"] = create_ubatch_slices(input_batch, self.num_ubatches), input_batch
        return real_prepare_ub(self, input_batch, *a, **kw)

    monkeypatch.setattr(ubatch_utils, "prepare_dcp_local_seq_lens", parent_rows)
    monkeypatch.setattr(ubatch_utils.UBatchRunner, "prepare", prepare)
    files = E.run_ranks(2, drive_ubatches([1, 1, 10, 1, 1], [64, 96, 512, 32, 48], 2, 1), tmp_path, monkeypatch)
    monkeypatch.setattr(ubatch_utils, "prepare_dcp_local_seq_lens", real_prepare)
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
# PCP: PCPManager.partition_batch, then the runner's DCP step on the PCP manager's buffers


PCP_BATCH = ([1, 16, 1, 9], [40, 16, 50, 20])  # two decodes, two prefills


def drive_pcp(pcp_rank, dcp, il, mode="none", legacy=False):
    q, s = PCP_BATCH

    def drive(rank):
        bufs = E.buffers(8, 64)
        mgr = E.pcp_manager(2, pcp_rank, 8, 64, dcp, rank, il)
        b = E.prepare_inputs(q, s, bufs)
        if legacy:  # pre-fix: DCP lengths derived in prepare_inputs, from the global batch
            E.dcp_step(b, bufs, dcp, rank, il)
        with plugin.step():
            local = mgr.partition_batch(b, E.desc(mode, 64 if mode != "none" else sum(q), None))
            if legacy:  # ... and carried through the partition
                local = dataclasses.replace(local, dcp_local_seq_lens=b.dcp_local_seq_lens)
            else:
                E.dcp_step(local, mgr.input_buffers, dcp, rank, il)
            E.attn(E.model_state(), local, E.tables(16, 64, dcp, rank, il), mode)

    return drive


@pytest.mark.parametrize("mode", ["none", "piecewise"])
@pytest.mark.parametrize("il", [1, 4])
def test_pcp_partitioned_batches_replay_clean(tmp_path, monkeypatch, mode, il):
    for p in (0, 1):
        files = E.run_ranks(2, drive_pcp(p, 2, il, mode), tmp_path / f"pcp{p}", monkeypatch)
        d, res = replayed(files)
        assert d.n == 2 and set(d.config.sites[i] for i in d["obs.site"]) == {"attn_metadata"}
        assert d.config.dcp_size == 2 and d.config.cp_interleave == il
        assert res.findings == [], [f.message for f in res.findings]
        assert d["obs.num_reqs"][0] > 4  # the local batch: prefill chunks as rows, not the global batch


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
    if full:  # capture adds dcp*interleave tokens of context before computing DCP lengths
        assert d.seq_lens_of(0).tolist() == [3, 3, 3, 3]
    assert res.findings == [], [f.message for f in res.findings]


def test_dflash_capture_replays_clean_and_its_pre_fix_none_is_caught(tmp_path, monkeypatch):
    def drive(rank):
        bufs, bt = E.buffers(8, 32), E.tables(8, 32, 2, rank, 1)
        for num_reqs, num_tokens in ((4, 8), (8, 32)):
            dflash._prepare_dflash_inputs_to_capture(num_reqs, num_tokens, bufs, bt, [[]], E.KV, E.MAX_MODEL_LEN,
                                                     skip_attn=False, causal=True)

    d, res = replayed(E.run_ranks(2, drive, tmp_path / "fixed", monkeypatch))
    assert d.n == 4 and {d.site_name(i) for i in range(d.n)} == {"dflash_capture"} and res.findings == []
    monkeypatch.setattr(dflash, "prepare_dcp_local_seq_lens", lambda *a, **k: None)  # pre-fix: no DCP at all
    d, res = replayed(E.run_ranks(2, drive, tmp_path / "legacy", monkeypatch))
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
                sp._build_attn_metadata(nr, E.desc(mode, nrp or nr, nrp), qsl,
                                        E.torch.from_numpy(target), step)

    d, res = replayed(E.run_ranks(2, drive, tmp_path, monkeypatch))
    assert d.n == 4 and {d.site_name(i) for i in range(d.n)} == {"draft"}
    assert d["obs.num_reqs"].tolist() == [4] * 4 and d["obs.num_reqs_padded"].tolist() == [nrp or 4] * 4
    assert d.seq_lens_of(1)[:4].tolist() == [35, 9, 1026, 131]
    assert res.findings == [], [f.message for f in res.findings]


def test_cli_replays_and_diffs_recorded_runs(tmp_path, monkeypatch):
    fixed = E.run_ranks(2, drive_ubatches([1, 1, 10, 1, 1], [64, 96, 512, 32, 48], 2, 1), tmp_path / "a",
                        monkeypatch)
    again = E.run_ranks(2, drive_ubatches([1, 1, 10, 1, 1], [64, 96, 512, 32, 48], 2, 1), tmp_path / "b",
                        monkeypatch)
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-m", "dcptool", "replay", "--backend", "triton", *fixed, "--json"],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads(p.stdout.splitlines()[-1])["findings"] == 0
    # two runs of the same batches: other buffer addresses, the same run
    p = subprocess.run([sys.executable, "-m", "dcptool", "diff", str(tmp_path / "a"), str(tmp_path / "b")],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert len(again) == 2
