"""MLA's chunked prefill context from vLLM's own code (0.29-0.34): dcptool's plan (dcp.chunks, what simulate records)
is vLLM's build_mla_chunked_context_metadata; the plugin records the chunks the MLA common builder hands attention
(ctx_chunks) and they replay clean; and vLLM #53573 on the releases that had it: under PCP + DCP 0.29's builder plans
from each PCP rank's own batch and its DCP group spans the PCP ranks, so the ranks call different DCP KV gathers
(ctx-agree), where 0.30+ replicate the short prefill and refuse PCP + DCP on dense MLA."""

import backends as B
import engine as E
import numpy as np
import pytest
import torch
from vllm.model_executor.layers.attention import mla_attention as mla

from dcptool.check.replay import replay
from dcptool.dcp import chunks as C
from dcptool.dump import open_dumps
from dcptool.engine import vllm as plugin
from dcptool.engine.vllm.builders import ctx_schedule

pytestmark = pytest.mark.vllm
REFUSES_PCP_DCP = getattr(mla.MLAAttention, "supports_pcp_dcp", None) is False  # 0.30+: dense MLA refuses it


def vllm_plan(ctx: list[int], ws: int, page: int, dcp: int, il: int, monkeypatch):
    """vLLM's chunked-context metadata for these prefill contexts, and the max_context_chunk its plan was given."""
    given = []
    plan = mla.plan_mla_context_chunks

    def spy(*a, **k):
        given.append(k.get("max_context_chunk", a[2] if len(a) > 2 else None))
        return plan(*a, **k)

    monkeypatch.setattr(mla, "plan_mla_context_chunks", spy)
    q = np.ones(len(ctx) + 1, np.int64).cumsum() - 1
    cc = mla.build_mla_chunked_context_metadata(
        context_lens_cpu=torch.tensor(ctx, dtype=torch.int32), prefill_query_start_loc_cpu=torch.tensor(q),
        chunked_prefill_workspace=torch.empty(ws + ws // dcp, 4), chunked_prefill_workspace_size=ws,
        block_size=page, align_chunk_to_block=True, device=E.CPU, dcp_world_size=dcp, dcp_local_block_size=il,
        dcp_virtual_block_size=dcp * il, dcp_manager=None)
    monkeypatch.setattr(mla, "plan_mla_context_chunks", plan)
    return cc, (given[0] if given else 0)


@pytest.mark.parametrize("reqs", [1, 2, 127, 128, 129, 1000])
@pytest.mark.parametrize("dcp, il, page, ws", [(1, 1, 16, 4096), (2, 1, 16, 256), (4, 16, 64, 1024),
                                                (3, 1, 16, 768), (8, 2, 16, 65536)])
def test_dcptool_plans_the_chunks_vllm_plans(monkeypatch, reqs, dcp, il, page, ws):
    """Seeded contexts (none, short, long enough to split): the schedule the plugin reads off vLLM's metadata is
    dcptool's plan of the same contexts, max_context_chunk included; under DCP each piece's local start is
    padded_rows of its global start."""
    rng = np.random.default_rng(reqs * 31 + dcp)
    ctx = np.where(rng.random(reqs) < 0.25, 0, rng.integers(1, 5000, reqs)).tolist()
    ctx[0] = max(ctx[0], 1)
    cc, mx = vllm_plan(ctx, ws, page, dcp, il, monkeypatch)
    got = ctx_schedule(cc, 0, mx)
    assert got == C.encode(*C.plan_chunks(ctx, ws, page, dcp, il), np.arange(reqs)).tolist()
    assert C.first_problem(got, np.asarray(ctx) + 1, np.arange(reqs + 1), reqs, dcp, il) is None
    if dcp > 1:
        e = np.asarray(got[1:]).reshape(-1, 4)
        local = [s for chunk in cc.chunks for s in chunk.local_starts]
        assert local == [C.padded_rows(int(s), dcp, il) for s in e[:, 2]]


MIXED = ([1, 1, 9, 16, 5], [40, 17, 600, 2048, 5])  # two decodes, prefills on 591 and 2032 of context, a fresh one


@pytest.mark.parametrize("dcp, il", [(2, 1), (4, 16), (3, 1)])
def test_the_plugin_records_the_mla_builders_chunked_context(tmp_path, monkeypatch, dcp, il):
    q, s = MIXED
    built = []

    def step(qq, ss, rank):
        bufs = E.buffers(16, 256)
        b = E.prepare_inputs(qq, ss, bufs, dcp=(dcp, rank, il))
        if not E.PRE_FIX:
            E.dcp_step(b, bufs, dcp, rank, il)
        bt = B.tables(16, 256, dcp, rank, il)
        with plugin.step(runner=E.runner(bt, dcp, rank, il, bufs)):
            return B.attn(E.model_state(), b, bt, B.mla_builder(16, dcp, il, workspace=256 * dcp)[1])

    def drive(rank):
        built.append(step(q, s, rank))
        step([1, 1], [40, 17], rank)  # decodes only: no chunked context

    d = open_dumps(E.run_ranks(dcp, drive, tmp_path, monkeypatch))
    want = C.encode(*C.plan_chunks([591, 2032, 0], 256 * dcp, 16, dcp, il), [2, 3, 4]).tolist()
    run = np.argsort(d.order_of(np.arange(d.n)))  # the run's order: by step, then rank file
    got = [d["rows.ctx_chunks"][d["obs.ctx"][i]:d["obs.ctx"][i + 1]].tolist() for i in run]
    assert got == [want] * dcp + [[0]] * dcp  # (by step: every rank's mixed batch, then every rank's decodes)
    assert len(built[0].prefill.chunked_context.chunks) == len(C.gathers(want, dcp, il)) > 1
    res = replay(d, "torch")
    assert res.findings == [], [f.message for f in res.findings]


def _pcp_dcp(tmp_path, monkeypatch, q, s):
    """DCP 2 over PCP 2 (TP 1: DCP rank r is PCP rank r, as vLLM's groups are built, "DCP spans PCP first"): each
    rank's own PCP-local batch through the MLA builder (use_pcp), recorded as its process would."""
    out = []

    def drive(rank):
        bufs = E.buffers(16, 256)
        b = E.prepare_inputs(q, s, bufs)
        mgr = E.pcp_manager(2, rank, 16, 256, 2, rank, 1)
        local = E.partition(mgr, b, "none", 256)
        if E.DCP_IN_EXECUTE_MODEL:
            E.dcp_step(local, mgr.input_buffers, 2, rank, 1)
        builder, group = B.mla_builder(16, 2, 1)
        builder.use_pcp = True
        bt = B.tables(16, 256, 2, rank, 1)
        with plugin.step(runner=E.runner(bt, 2, rank, 1, bufs)):
            out.append(B.attn(E.model_state(), local, bt, group))

    d = open_dumps(E.run_ranks(2, drive, tmp_path, monkeypatch))
    return d, replay(d, "torch"), out


def test_issue_53573_pcp_dcp_ranks_plan_different_gathers_on_the_releases_that_had_it(tmp_path, monkeypatch):
    """The issue's two-token prefill with PCP 2 and DCP 2. 0.29: PCP rank 0 holds token 0 (no context: no chunked
    context, it skips the DCP KV gather), PCP rank 1 token 1 (one token of context: it enters it); replay names the
    rank that calls another gather, and the bug. 0.30+ (PR #56157): the prefill is replicated on both PCP ranks, the
    ranks plan alike, and dense MLA refuses PCP + DCP anyway."""
    d, res, built = _pcp_dcp(tmp_path, monkeypatch, [2], [2])
    ctx = [d["rows.ctx_chunks"][d["obs.ctx"][i]:d["obs.ctx"][i + 1]].tolist() for i in range(d.n)]
    if REFUSES_PCP_DCP:
        assert ctx[0] == ctx[1] and "ctx-agree" not in {f.rule for f in res.findings}
        return
    assert ctx == [[0], [256, 0, 0, 0, 1]] and built[0].prefill.chunked_context is None
    (f,) = [f for f in res.findings if f.rule == "ctx-agree"]
    assert f.rank == 1 and f.detail["gathers"] == {"1": [1]} and f.detail["reference_gathers"] == []
    assert "a schedule that calls no DCP KV gather" in f.message
    named = {p.rule: p.known.bug.id for p in res.problems if p.known is not None and p.known.named}
    assert named.get("ctx-agree") == "issue53573-ctx-rank-local"
