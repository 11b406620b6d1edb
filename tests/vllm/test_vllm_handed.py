"""What else vLLM's builds hand attention, recorded through the plugin from the release's own builders and replayed:
the addresses of FlashAttention's per-request tensors at capture and at each replay (graph-addr)."""

import backends as B
import engine as E
import numpy as np
import pytest
import torch
from vllm.v1.attention.backends import flash_attn as fa
from vllm.v1.worker.gpu.cudagraph_utils import prepare_inputs_to_capture

from dcptool.check.replay import replay
from dcptool.dump import open_dumps, word_addrs
from dcptool.engine import vllm as plugin
from dcptool.engine.vllm.builders import wrap_flash_attn

pytestmark = pytest.mark.vllm
DECODES = ([1, 1, 1], [40, 33, 7])


def run(dcp, drive, tmp_path, monkeypatch):
    d = open_dumps(E.run_ranks(dcp, drive, tmp_path, monkeypatch))
    return d, replay(d, "torch")


def messages(res):
    return [f"{f.site} {f.rule}: {f.message}" for f in res.findings]


def _captures_then_steps(rank, dcp, steps):
    """A FlashAttention model: FULL graphs captured for 4 and 8 requests (prepare_inputs_to_capture, the builder
    run for each), then `steps` real steps replaying the 4-request graph, all on the runner's persistent buffers."""
    bufs, bt = E.buffers(16, 64), B.tables(16, 64, dcp, rank, 1)
    b, g = B.flash_attn(16, 16, dcp, 1, mode="full")
    for nr in (8, 4):
        prepare_inputs_to_capture(nr, nr, E.model_state(), bufs, bt, [[g[0]]], g[1], full_cudagraph=True)
    for k in range(steps):
        q, s = DECODES
        batch = E.prepare_inputs(q, [x + k for x in s], bufs, num_tokens_padded=4, num_reqs_padded=4,
                                 dcp=(dcp, rank, 1))
        if not E.PRE_FIX:
            E.dcp_step(batch, bufs, dcp, rank, 1)
        with plugin.step(runner=E.runner(bt, dcp, rank, 1, bufs)):
            B.attn(E.model_state(), batch, bt, g, "full")
    return b


def test_flash_attn_addresses_at_capture_and_replay_are_the_same_buffers(tmp_path, monkeypatch):
    """Every release of the matrix keeps dcp_context_kv_lens in the builder's persistent buffer (vLLM #36070's fix,
    0.20): each replay's build hands attention the addresses its graph captured, and graph-addr stays silent."""
    kept = []

    def drive(rank):
        kept.append(_captures_then_steps(rank, 2, 3))

    d, res = run(2, drive, tmp_path, monkeypatch)
    assert d.config.attn_tensors == ("dcp_context_kv_lens", "seq_lens")
    replays = np.flatnonzero(d["obs.graph"] == 3)
    assert replays.size == 6 and (np.diff(d["obs.gaddrs"])[replays] == 4).all()
    for i in replays:
        a = word_addrs(d["rows.attn_addrs"][d["obs.addrs"][i]:d["obs.addrs"][i + 1]])
        assert a[0] == kept[int(d["obs.rank"][i])]._dcp_context_kv_lens.data_ptr()
    assert [f for f in res.findings if f.rule == "graph-addr"] == [], messages(res)


def test_a_tensor_allocated_anew_at_each_build_is_found_at_every_replay(tmp_path, monkeypatch):
    """Before 0.20, FlashAttention's build returned dcp_context_kv_lens as a fresh tensor (get_dcp_local_seq_lens'
    result), so a FULL graph read the one it captured: that build on the release's own code (its result handed on
    as a new tensor) is graph-addr at every replay, and nowhere else."""
    build = fa.FlashAttentionMetadataBuilder.build.__wrapped__  # (the release's own, under the plugin's wrapper)
    fresh = []

    def anew(self, *a, **k):
        md = build(self, *a, **k)
        if md.dcp_context_kv_lens is not None:
            fresh.append(md.dcp_context_kv_lens.clone())  # (kept alive: each one its own address)
            md.dcp_context_kv_lens = fresh[-1]
        return md

    anew.__wrapped_by_dcptool__ = True
    monkeypatch.setattr(fa.FlashAttentionMetadataBuilder, "build", wrap_flash_attn(anew, None))
    d, res = run(2, lambda rank: _captures_then_steps(rank, 2, 3), tmp_path, monkeypatch)
    replays = {(int(d["obs.rank"][i]), int(d["obs.step"][i])) for i in np.flatnonzero(d["obs.graph"] == 3)}
    found = {(f.rank, f.step) for f in res.findings if f.rule == "graph-addr"}
    assert found == replays and len(found) == 6, messages(res)
    assert all("dcp_context_kv_lens" in f.message for f in res.findings if f.rule == "graph-addr")


def test_flash_attn_buffer_capacities_hold_every_padded_batch(tmp_path, monkeypatch):
    """vllm-ascend #16168's class on vLLM's own FlashAttention builder: the capacity of the buffers behind
    dcp_context_kv_lens (the builder's, max_num_seqs rows) and seq_lens (the runner's) is recorded at every build,
    and every padded batch of the run fits them: capacity stays silent."""
    kept = []

    def drive(rank):
        kept.append(_captures_then_steps(rank, 2, 3))

    d, res = run(2, drive, tmp_path, monkeypatch)
    caps = d["rows.attn_caps"].reshape(-1, 2)
    assert caps.shape[0] == d.n and (caps[:, 0] == kept[0]._dcp_context_kv_lens.numel()).all()
    assert (caps[:, 1] >= 16).all()
    assert [f for f in res.findings if f.rule == "capacity"] == [], messages(res)


def test_a_buffer_one_row_short_of_the_largest_capture_is_found_there(tmp_path, monkeypatch):
    """The release's build handing on a view of a builder buffer sized one row below the largest capture (8
    requests), as vllm-ascend's max_num_seqs sizing did: the [:num_reqs] view is cut to 7 rows; capacity finds the
    8-request capture build at each rank, and nothing else."""
    build = fa.FlashAttentionMetadataBuilder.build.__wrapped__
    small = {}

    def short(self, *a, **k):
        md = build(self, *a, **k)
        if md.dcp_context_kv_lens is not None:
            buf = small.setdefault(id(self), torch.zeros(7, dtype=torch.int32))
            n = min(md.dcp_context_kv_lens.numel(), 7)
            buf[:n] = md.dcp_context_kv_lens[:n]
            md.dcp_context_kv_lens = buf[: md.dcp_context_kv_lens.numel()]  # (cut short, as the slice is)
        return md

    short.__wrapped_by_dcptool__ = True
    monkeypatch.setattr(fa.FlashAttentionMetadataBuilder, "build", wrap_flash_attn(short, None))
    d, res = run(2, lambda rank: _captures_then_steps(rank, 2, 3), tmp_path, monkeypatch)
    eight = {(int(d["obs.rank"][i]), int(d["obs.step"][i])) for i in np.flatnonzero(d["obs.num_reqs_padded"] > 7)}
    found = {(f.rank, f.step) for f in res.findings if f.rule == "capacity"}
    assert found == eight and len(found) == 2, messages(res)
    assert {f.rule for f in res.findings} == {"capacity"}
