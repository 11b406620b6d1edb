"""`slots` and `slot-partition` against vLLM's own slot mapping (BlockTables.compute_slot_mappings and
its Triton kernel, run in the interpreter): on seeded random batches of awkward sizes, every rank's slot mapping
as vLLM computes it, recorded with dcptool's Recorder, replays clean; the ownership and local-offset formulas
dcptool checks are the kernel's, entry by entry; and a wrong claim about a group is found."""

import engine as E
import numpy as np
import pytest
import torch

from dcptool.check.replay import replay
from dcptool.dump import open_dumps
from dcptool.engine.recorder.record import Recorder

pytestmark = pytest.mark.vllm

# (N, I, block sizes): interleave 1, inside a block, equal to the block; groups of different block sizes
CONFIGS = [(2, 1, (16, 16)), (4, 8, (16, 32)), (3, 16, (16, 16)), (8, 1, (64, 16)), (2, 4, (4, 8))]
TOKENS = (0, 1, 127, 128, 129, 1000, 1500)


def batch(rng, total: int, max_reqs: int = 8, max_pos: int = 2000):
    """Query lengths adding up to `total` over 1..max_reqs requests (0 requests for 0 tokens), each with a
    random number of computed tokens; positions as prepare_pos_seq_lens writes them."""
    if total == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    n = int(rng.integers(1, min(max_reqs, total) + 1))
    cuts = np.sort(rng.choice(np.arange(1, total), n - 1, replace=False)) if n > 1 else np.zeros(0, np.int64)
    q = np.diff(np.r_[0, cuts, total]).astype(np.int64)
    comp = rng.integers(0, max_pos, n)
    pos = np.concatenate([np.arange(c, c + k) for c, k in zip(comp, q)])
    return q, comp, pos


def vllm_slots(bt, q, pos, ntp: int) -> np.ndarray:
    qsl = torch.tensor(np.r_[0, np.cumsum(q)], dtype=torch.int32)
    p = torch.zeros(max(ntp, 1), dtype=torch.int64)
    p[: pos.size] = torch.from_numpy(pos)
    p[pos.size : ntp] = 7  # whatever the buffer held past the real tokens
    out = bt.compute_slot_mappings(torch.arange(q.size, dtype=torch.int32), qsl, p, ntp)
    return out.numpy().copy(), p[:ntp].numpy().copy()


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "N{}-I{}-B{}".format(c[0], c[1], "/".join(map(str, c[2]))))
def test_vllm_slot_mappings_replay_clean_and_match_the_rule(cfg, tmp_path):
    N, I_, sizes = cfg
    flags = [True, False]  # an attention group and a replicated one (Mamba/GDN state, a DCP-1 drafter's layers)
    groups = E.vllm_groups(flags)
    rng = np.random.default_rng(hash(cfg) % 2**32)
    tables = [E.slot_tables(list(sizes), flags, N, r, I_, seed=5) for r in range(N)]
    kv = [{"name": f"g{k}", "dcp": groups[k], "block_size": sizes[k]} for k in range(len(sizes))]
    path = tmp_path / "slots.safetensors"
    checked = 0
    with Recorder(path, dcp_size=N, cp_interleave=I_, kv_groups=kv) as rec:
        for step, total in enumerate(TOKENS):
            q, comp, pos = batch(rng, total)
            ntp = total + int(rng.integers(0, 9))  # CUDA-graph token padding
            seq = comp + q
            qsl = np.r_[0, np.cumsum(q)].astype(np.int64)
            per_rank = [vllm_slots(tables[r], q, pos, ntp) for r in range(N)]
            for r, (sm, p) in enumerate(per_rank):
                rec.observe(step=step, site="attn_metadata", rank=r, seq_lens=seq, num_reqs=q.size,
                            num_reqs_padded=q.size, query_start_loc=qsl, num_tokens_padded=ntp, positions=p,
                            slot_mapping=sm)
                # the rule dcptool checks, entry by entry against the kernel's output
                for g, B in enumerate(sizes):
                    owner = (pos // I_) % N
                    writes = sm[g, : pos.size] >= 0
                    want = (owner == r) if groups[g] else np.ones(pos.size, bool)
                    assert np.array_equal(writes, want), (g, r)
                    vo = pos % (B * N)
                    off = np.where(groups[g], vo // (I_ * N) * I_ + vo % I_, pos % B)
                    assert np.array_equal(sm[g, : pos.size][writes] % B, off[writes])
                    assert (sm[g, pos.size :] == -1).all()
                    checked += pos.size
            # across ranks: each position of a sharded group written exactly once
            for g in range(len(sizes)):
                count = sum((sm[g, : pos.size] >= 0).astype(int) for sm, _ in per_rank)
                assert (count == (1 if groups[g] else N)).all()
    assert checked > 1000 * N
    d = open_dumps([path])
    res = replay(d, "torch")
    assert [f for f in res.findings if f.rule in ("slots", "slot-partition")] == [], [f.message for f in
                                                                                     res.findings[:3]]
    assert "slots" not in res.skipped


def test_claiming_the_wrong_sharding_is_found(tmp_path):
    """The same recording with group 0 (sharded) declared replicated and group 1 declared sharded: replay
    reports what a slot mapping that localises the wrong groups looks like."""
    N, I_, sizes = 2, 1, (16, 16)
    flags = [True, False]
    tables = [E.slot_tables(list(sizes), flags, N, r, I_, seed=3) for r in range(N)]
    rng = np.random.default_rng(7)
    q, comp, pos = batch(rng, 129)
    path = tmp_path / "wrong.safetensors"
    kv = [{"name": "attn", "dcp": not E.vllm_groups(flags)[0]}, {"name": "state", "dcp": not E.vllm_groups(flags)[1]}]
    with Recorder(path, dcp_size=N, cp_interleave=I_, kv_groups=kv) as rec:
        for r in range(N):
            sm, p = vllm_slots(tables[r], q, pos, 129)
            rec.observe(step=0, site="attn_metadata", rank=r, seq_lens=comp + q, num_reqs=q.size,
                        num_reqs_padded=q.size, query_start_loc=np.r_[0, np.cumsum(q)], positions=p,
                        slot_mapping=sm)
    res = replay(open_dumps([path]), "torch")
    kinds = {f.detail.get("kind") for f in res.findings if f.rule == "slots"}
    assert {f.rank for f in res.findings if f.rule == "slots"} == set(range(N))
    assert "replicated-missing" in kinds


# --------------------------------------------------------------------------------------------
# Through the plugin: build_attn_metadata's slot mappings, as vLLM computes them, recorded per KV-cache group

from types import SimpleNamespace  # noqa: E402

from dcptool.engine import vllm as plugin  # noqa: E402

# two groups without attention layers: build_attn_metadata skips their builders, the slot mappings are still vLLM's
KV2 = SimpleNamespace(num_blocks=64, kv_cache_tensors=[],
                      kv_cache_groups=[SimpleNamespace(kv_cache_spec=None, layer_names=[]) for _ in range(2)])


def _step(rank, dcp, il, q, seq, mode, ntp, ubatches, kv=KV2, flags=(True, False)):
    bufs = E.buffers(16, 512)
    bt = E.slot_tables([16, 32], list(flags), dcp, rank, il, max_num_reqs=16, max_num_tokens=512, seed=11)
    b = E.prepare_inputs(q, seq, bufs, num_tokens_padded=ntp, dcp=(dcp, rank, il))
    if E.DCP_IN_EXECUTE_MODEL:
        E.dcp_step(b, bufs, dcp, rank, il)
    sm = bt.compute_slot_mappings(E.torch.arange(len(q), dtype=E.torch.int32), b.query_start_loc, b.positions,
                                  b.num_tokens_after_padding)
    r = E.runner(bt, dcp, rank, il, bufs)
    ms = E.model_state()
    with plugin.step(runner=r):
        if ubatches:
            ur = E.ubatch_runner(ms, 16, dcp, rank, il)
            ur.kv_cache_config, ur.attn_groups = kv, [[], []]
            kw = {"for_capture": False}
            if E.UB_TAKES_DESC:
                kw["batch_desc"] = E.desc(mode, b.num_tokens_after_padding, b.num_reqs_after_padding, num_ubatches=2)
            else:
                kw["cg_mode"] = E.MODES[mode]
            ur.prepare(b, bt.get_dummy_block_tables(b.num_reqs_after_padding), sm, **kw)
        else:
            ms.prepare_attn(b, E.MODES[mode], bt.get_dummy_block_tables(b.num_reqs_after_padding), sm, [[], []], kv)


@pytest.mark.parametrize("dcp,il,ubatches", [(2, 1, False), (4, 8, False), (2, 1, True), (3, 16, True)])
def test_plugin_records_slot_mappings_and_they_replay_clean(tmp_path, monkeypatch, dcp, il, ubatches):
    if ubatches and not E.HAS_UBATCH:
        pytest.skip(f"vLLM {E.VERSION} has no model-runner-V2 micro-batching")
    q = [1, 1, 40, 1, 1]
    seq = [64, 96, 512, 33, 200]
    files = E.run_ranks(dcp, lambda rank: _step(rank, dcp, il, q, seq, "none", 52, ubatches), tmp_path, monkeypatch)
    d = open_dumps(files)
    res = replay(d, "torch")
    slot_findings = [f.message for f in res.findings if f.rule in ("slots", "slot-partition")]
    assert slot_findings == []
    # what was recorded: both groups, as this release's kernel treats them, with the kernel's block sizes
    want = E.vllm_groups([True, False])
    assert [g.dcp for g in d.config.kv_groups] == want and [g.block_size for g in d.config.kv_groups] == [16, 32]
    assert "slots" not in res.skipped and d.has("obs.slots")
    # the dump's note (what `dcptool inspect` shows) says how this release shards the groups
    assert "columns: slot mappings per KV-cache group" in d.config.note
    assert ("has no dcp_sharded flag and localises every group" in d.config.note) == (not E.HAS_DCP_SHARDED)
    att = [i for i in range(d.n) if d.site_name(i) in ("attn_metadata", "ubatch") and d["obs.ubatch"][i] >= (
        0 if ubatches else -1)]
    assert att, "slot mappings recorded at the attention builds"
    writes = d["rows.slot_mapping"] >= 0
    assert writes.any() and (d["rows.slot_group"][writes] == 1).any()
    # tokens past the real 44 write nothing on any rank (CUDA-graph padding to 52)
    sel = d["obs.ubatch"] == -1
    for i in np.flatnonzero(sel):
        lo, hi = d["obs.slots"][i], d["obs.slots"][i + 1]
        g, sm = d["rows.slot_group"][lo:hi], d["rows.slot_mapping"][lo:hi]
        for k in (0, 1):
            assert (sm[g == k][44:] == -1).all()


def test_plugin_recording_with_a_broken_slot_mask_is_caught(tmp_path, monkeypatch):
    """vLLM's kernel with every rank writing every token of the sharded group (the non-owner mask dropped: what
    vLLM #57260's class of bug leaves): slot-partition at the ranks that should not have written."""
    dcp, il = 2, 1
    orig = E.BlockTables.compute_slot_mappings

    def all_ranks(self, idx, qsl, pos, ntp, out=None):
        sm = orig(self, idx, qsl, pos, ntp, out)
        rank = self.cp_rank
        self.cp_rank = 1 - rank  # the other rank's slots for the tokens it owns: written here too
        other = orig(self, idx, qsl, pos, ntp, self.slot_mappings.clone()).clone()
        self.cp_rank = rank
        sm[0] = E.torch.where(sm[0] >= 0, sm[0], other[0])
        return sm

    monkeypatch.setattr(E.BlockTables, "compute_slot_mappings", all_ranks)
    files = E.run_ranks(dcp, lambda rank: _step(rank, dcp, il, [3, 1], [40, 9], "none", 4, False), tmp_path,
                        monkeypatch)
    res = replay(open_dumps(files), "torch")
    part = [f for f in res.findings if f.rule == "slot-partition"]
    assert {f.rank for f in part} == {0, 1} and all(f.detail["written_by_several"] for f in part)


def _specs():
    """An attention group and a Mamba group as the release's own KV-cache spec classes (built without their
    constructors: only their kind and class-level dcp_sharded default are read)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    return SimpleNamespace(num_blocks=64, kv_cache_tensors=[],
                           kv_cache_groups=[SimpleNamespace(kv_cache_spec=cls.__new__(cls), layer_names=[])
                                            for cls in (FullAttentionSpec, MambaSpec)])


@pytest.mark.parametrize("kernel_flags", [(True, False), (True, True)], ids=["flags-right", "mamba-flagged-sharded"])
def test_groups_are_named_by_their_spec_and_a_localised_mamba_group_is_found(tmp_path, monkeypatch, kernel_flags):
    """The recording says what each group should be (its spec: attention sharded, Mamba replicated), not what the
    kernel did: 0.31+ with the right flags replays clean; a kernel that localises the Mamba group (0.29-0.30,
    which have no flag, or a wrong flag: the class of vLLM #57260) is reported as `slots` on the ranks that left
    Mamba tokens unwritten."""
    dcp, il = 2, 1
    files = E.run_ranks(dcp, lambda rank: _step(rank, dcp, il, [3, 1, 5], [40, 9, 77], "none", 9, False,
                                                kv=_specs(), flags=kernel_flags), tmp_path, monkeypatch)
    d = open_dumps(files)
    assert [(g.name, g.dcp) for g in d.config.kv_groups] == [("FullAttentionSpec", True), ("MambaSpec", False)]
    res = replay(d, "torch")
    localised = not E.HAS_DCP_SHARDED or kernel_flags[1]
    kinds = {(f.rule, f.detail.get("kind"), f.detail.get("group")) for f in res.findings}
    if localised:
        # tokens of the other rank left unwritten, and its own at the localised offset instead of p % block_size
        assert ("slots", "replicated-missing", 1) in kinds, [f.message for f in res.findings]
        assert kinds <= {("slots", "replicated-missing", 1), ("slots", "offset", 1)}
        assert {f.rank for f in res.findings} == {0, 1}
    else:
        assert res.findings == [], [f.message for f in res.findings]
