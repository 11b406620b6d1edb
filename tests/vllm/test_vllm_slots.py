"""Issue 15's `slots` and `slot-partition` against vLLM's own slot mapping (BlockTables.compute_slot_mappings and
its Triton kernel, run in the interpreter): on seeded random batches of awkward sizes, every rank's slot mapping
as vLLM computes it, recorded with dcptool's Recorder, replays clean; the ownership and local-offset formulas
dcptool checks are the kernel's, entry by entry; and a wrong claim about a group is found."""

import engine as E
import numpy as np
import pytest
import torch

from dcptool.dump import open_dumps
from dcptool.record import Recorder
from dcptool.replay import replay

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
