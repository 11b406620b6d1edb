"""A hybrid model's KV-cache groups and speculative verification under DCP, from vLLM's own code (0.29-0.34): the
plugin records each group's spec (its sliding window, its DCP size: 1 where the spec says DCP does not shard it),
the lengths each group's MLA builder reads (group_seq_lens), and AITER MLA's verify-row bounds (vLLM's
AiterMLAHelper.dcp_local_verify_row_lens, verify_row_lens); group-lens replays them (vLLM #47541's class)."""

import dataclasses
import inspect
from types import SimpleNamespace

import backends as B
import engine as E
import numpy as np
import pytest
import torch
from vllm.model_executor.layers.attention import mla_attention as mla
from vllm.v1.attention.backends.mla import rocm_aiter_mla as aiter
from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

from dcptool.check.replay import replay
from dcptool.dcp.reference import group_lens_np, local_np, verify_lens_np
from dcptool.dump import open_dumps
from dcptool.engine import vllm as plugin

pytestmark = pytest.mark.vllm
Q, S = [1, 1, 7, 30], [40, 17, 600, 2048]
WINDOW = 128
# 0.34's MLA builder runs DCP only for a group its spec shards (a replicated cache "sees no DCP"); 0.29-0.33's run
# it for every group under DCP (read from the constructor's source: it needs the model's MLA layers to run)
PER_SPEC = "dcp_sharded" in inspect.getsource(mla.MLACommonMetadataBuilder.__init__)


def _spec(cls, **kw):
    s = cls.__new__(cls)
    for k, v in kw.items():
        object.__setattr__(s, k, v)
    return s


def _hybrid(tmp_path, monkeypatch, dcp: int, il: int):
    """An attention group and a sliding-window group (its spec replicated where this release has the flag) with one
    MLA builder each, through vLLM's prepare_attn / build_attn_metadata with their slot mappings."""
    swa_flag = {"dcp_sharded": False} if E.HAS_DCP_SHARDED else {}
    specs = [_spec(MLAAttentionSpec), _spec(SlidingWindowMLASpec, sliding_window=WINDOW, **swa_flag)]
    replicated = E.HAS_DCP_SHARDED  # (0.29-0.30 have no flag: every attention spec counts as sharded)

    def drive(rank):
        bufs = E.buffers(16, 256)
        bt = E.slot_tables([16, 16], [True, not replicated], dcp, rank, il, max_num_reqs=16, max_num_tokens=256,
                           seed=3)
        b = E.prepare_inputs(Q, S, bufs, dcp=(dcp, rank, il))
        if E.DCP_IN_EXECUTE_MODEL:
            E.dcp_step(b, bufs, dcp, rank, il)
        sm = bt.compute_slot_mappings(torch.arange(len(Q), dtype=torch.int32), b.query_start_loc, b.positions,
                                      b.num_tokens_after_padding)
        groups = []
        for g in range(len(specs)):
            builder, (group, _) = B.mla_builder(16, dcp, il)
            if PER_SPEC and replicated and g == 1:
                builder.dcp_world_size = 1  # (0.34's constructor for a spec DCP does not shard)
            groups.append([dataclasses.replace(group, kv_cache_group_id=g)])
        kv = SimpleNamespace(num_blocks=64, kv_cache_tensors=[],
                             kv_cache_groups=[SimpleNamespace(kv_cache_spec=s, layer_names=[]) for s in specs])
        with plugin.step(runner=E.runner(bt, dcp, rank, il, bufs)):
            E.model_state().prepare_attn(b, E.MODES["none"], bt.get_dummy_block_tables(b.num_reqs_after_padding), sm,
                                         groups, kv)

    d = open_dumps(E.run_ranks(dcp, drive, tmp_path, monkeypatch))
    return d, replay(d, "torch"), replicated


@pytest.mark.parametrize("dcp, il", [(2, 1), (4, 16)])
def test_a_sliding_window_group_is_recorded_and_read_as_this_release_reads_it(tmp_path, monkeypatch, dcp, il):
    d, res, replicated = _hybrid(tmp_path, monkeypatch, dcp, il)
    g = d.config.kv_groups
    assert [(x.name, x.dcp, x.sliding_window, x.cp_size) for x in g] == [
        ("MLAAttentionSpec", True, None, dcp), ("SlidingWindowMLASpec", not replicated, WINDOW,
                                                1 if replicated else dcp)]
    assert d.has("obs.gsl") == replicated  # (alike groups: the view is the whole story)
    if not replicated:
        assert res.findings == [], [f.message for f in res.findings]
        return
    for i in range(d.n):
        r = int(d["obs.rank"][i])
        got = d["rows.group_seq_lens"][d["obs.gsl"][i]:d["obs.gsl"][i + 1]]
        reads_local = [True, not PER_SPEC]  # 0.31-0.33's builder ignores the spec: the replicated group reads local
        assert np.array_equal(got, group_lens_np(np.asarray(S), len(S), r, dcp, il, reads_local))
    rules = {f.rule for f in res.findings}
    if PER_SPEC:
        assert res.findings == [], [f.message for f in res.findings]
    else:
        assert rules == {"group-lens"} and all(f.detail["group"] == 1 and f.detail["replicated"]
                                               for f in res.findings), [f.message for f in res.findings]


class _VerifyBuilder:
    """AITER MLA's decode build under DCP, as far as the verify rows go (_build_dcp_verify_row_view: vLLM's own
    AiterMLAHelper.dcp_local_verify_row_lens on the decodes' global lengths; the rest is GPU kernels' metadata)."""

    supports_update_block_table = False

    def __init__(self, dcp: int, rank: int, il: int, qlen: int):
        self.dcp_world_size, self.dcp_rank, self.il, self.qlen = dcp, rank, il, qlen

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        cm = common_attn_metadata
        nd = int((np.diff(cm.query_start_loc_cpu.numpy()[: cm.num_reqs + 1]) == self.qlen).sum())
        rows = aiter.AiterMLAHelper.dcp_local_verify_row_lens(cm.seq_lens[:nd], self.qlen, self.dcp_world_size,
                                                              self.dcp_rank, self.il)
        return SimpleNamespace(row_lens=rows)


@pytest.mark.parametrize("after_shard", [False, True], ids=["vllm", "local-minus-k"])
def test_aiter_verify_rows_are_recorded_and_replayed(tmp_path, monkeypatch, after_shard):
    """Three verify tokens per decode: vLLM's bounds are local(seq_len - k), dcptool's too; taken after the shard
    mapping (local(seq_len) - k, as PR #46076's review caught) group-lens names the tokens."""
    dcp, il, qlen = 2, 1, 3
    q, s = [qlen] * 3, [10, 7, 130]
    if after_shard:
        def shifted(tot, qlen, n, r, il):
            k = torch.arange(qlen - 1, -1, -1, dtype=tot.dtype)
            return (torch.as_tensor(local_np(tot.numpy(), n, r, il), dtype=tot.dtype)[:, None] - k).flatten()

        monkeypatch.setattr(aiter.AiterMLAHelper, "dcp_local_verify_row_lens", staticmethod(
            plugin.builders.wrap_verify(shifted, None).__func__))

    def drive(rank):
        bufs = E.buffers(16, 256)
        b = E.prepare_inputs(q, s, bufs, dcp=(dcp, rank, il))
        if E.DCP_IN_EXECUTE_MODEL:
            E.dcp_step(b, bufs, dcp, rank, il)
        builder, (group, kv) = B.mla_builder(16, dcp, il)
        group.metadata_builders = [_VerifyBuilder(dcp, rank, il, qlen)]
        bt = B.tables(16, 256, dcp, rank, il)
        with plugin.step(runner=E.runner(bt, dcp, rank, il, bufs)):
            B.attn(E.model_state(), b, bt, (group, kv))

    d = open_dumps(E.run_ranks(dcp, drive, tmp_path, monkeypatch))
    res = replay(d, "torch")
    for i in range(d.n):
        got = d["rows.verify_row_lens"][d["obs.vrl"][i]:d["obs.vrl"][i + 1]]
        want = verify_lens_np(np.asarray(s), d.qsl_of(i), 9, int(d["obs.rank"][i]), dcp, il)
        assert np.array_equal(got, want) != after_shard
    if not after_shard:
        assert res.findings == [], [f.message for f in res.findings]
        return
    assert {f.rule for f in res.findings} == {"group-lens"} and all(f.detail["after_shard"] for f in res.findings)
