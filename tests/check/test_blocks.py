"""blocks.py: kernel-block on seeded random recordings against a torch reference (vLLM's slot-mapping kernel as
0.22-0.28 and as 0.29+ compute it, on the positions themselves), and on hand-built builds that must and must not be
found."""

import math

import numpy as np
import pytest
import torch

from dcptool.check.blocks import check_kernel_block
from dcptool.dcp.reference import misdealt, slot_deal
from dcptool.dump import Dump, DumpConfig, KVGroup, Observation, pack
from dcptool.dump.schema import validate_columns

GROUPS = (KVGroup("attn", True), KVGroup("mamba", False))


def _vllm_slots(pos: torch.Tensor, deal_block: int, kernel_block: int, n: int, il: int, rank: int) -> torch.Tensor:
    """vLLM's _compute_slot_mappings_kernel (DCP branch) in torch, for a request whose block table lists kernel
    blocks 0, 1, 2, ... (manager block m = kernel blocks m * r ... m * r + r - 1): positions dealt by virtual blocks
    of deal_block * n, slots addressed in kernel blocks (0.29+: dealt by the manager's block; 0.22-0.28: by the
    kernel's, with the local offset added to the kernel block the virtual block's index names). -1: not this rank's."""
    vb = deal_block * n
    vo = pos % vb
    is_local = (vo // il) % n == rank
    local_off = vo // (il * n) * il + vo % il
    if deal_block == kernel_block:  # (0.22-0.28: block_sizes_tensor holds the kernel's sizes)
        slot = (pos // vb) * kernel_block + local_off
    else:
        local = pos // vb * deal_block + local_off
        slot = (local // kernel_block) * kernel_block + local % kernel_block
    return torch.where(is_local, slot, torch.full_like(slot, -1))


def _moves(deal: int, manager: int, kernel: int, n: int, il: int) -> bool:
    """The torch reference: some position of one period is written elsewhere (rank or slot) than by the fix."""
    pos = torch.arange(math.lcm(deal, manager) * n * 2, dtype=torch.int64)
    return any(not torch.equal(_vllm_slots(pos, deal, kernel, n, il, r), _vllm_slots(pos, manager, kernel, n, il, r))
               for r in range(n))


@pytest.mark.parametrize("manager, kernel, il, n", [(128, 64, 128, 4), (128, 64, 64, 4), (128, 64, 1, 4),
                                                    (16, 8, 16, 2), (16, 8, 8, 8), (48, 24, 16, 3), (32, 32, 32, 4),
                                                    (64, 16, 32, 2), (256, 64, 128, 8)])
def test_the_formula_moves_a_position_exactly_where_vllms_kernels_differ(manager, kernel, il, n):
    """slot_deal / misdealt against vLLM's two slot kernels in torch: dealing by the kernel's block moves a position
    iff the interleave does not divide the kernel's block, and the first one misdealt names is one that moved."""
    want = _moves(kernel, manager, kernel, n, il)
    got = misdealt(kernel, manager, n, il)
    assert (got >= 0) == want == (kernel % il != 0)
    if got >= 0:
        p = torch.tensor([got])
        assert any(not torch.equal(_vllm_slots(p, kernel, kernel, n, il, r), _vllm_slots(p, manager, kernel, n, il, r))
                   for r in range(n))
    owner, local = slot_deal(np.arange(manager * n * 3), manager, n, il)
    assert np.array_equal(owner, (np.arange(manager * n * 3) // il) % n)  # (the manager's deal: docs/dcp.md's owner)


def _dump(observations, dcp=4, il=16, groups=GROUPS) -> Dump:
    cfg, cols = pack(observations, DumpConfig(dcp_size=dcp, cp_interleave=il, kv_groups=groups))
    validate_columns("t", cfg, cols)
    n = len(observations)
    return Dump(files=["t"], config=cfg, columns=cols, file_index=np.zeros(n, np.int32),
                file_obs=np.arange(n, dtype=np.int64))


def _obs(step, sizes):
    return Observation(step=step, site="attn_metadata", rank=step % 4, num_reqs=1, num_reqs_padded=1,
                       seq_lens=np.array([9]), dcp_local_seq_lens=np.array([3]),
                       kv_block_sizes=None if sizes is None else np.array(sizes, np.int32).reshape(-1))


@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 1000])
def test_random_recordings_match_the_reference(n):
    rng = np.random.default_rng(n)
    il = 16
    observations, want = [], set()
    for i in range(n):
        manager = int(rng.choice([16, 32, 64]))
        kernel = manager // int(rng.choice([1, 2, 4]))
        deal = int(rng.choice([manager, kernel]))
        mamba = [int(rng.choice([16, 8])), 4, 4]  # (a replicated group: never checked, whatever it deals by)
        sizes = None if rng.random() < 0.1 else [[manager, kernel, deal], mamba]
        observations.append(_obs(i, sizes))
        if sizes is not None and deal != manager and _moves(deal, manager, kernel, 4, il):
            want.add(i)
    if not n:
        return
    found = {f.obs: f for f in check_kernel_block(_dump(observations, il=il))}
    assert want or n < 100
    assert sorted(found) == sorted(want)
    for i in want:
        f = found[i]
        assert f.rule == "kernel-block" and f.detail["group"] == "attn" and f.recorded == f.detail["dealt_by"]


def test_the_kernels_block_under_a_wide_interleave_is_found_and_the_managers_is_not():
    """vLLM #51031's case: block size and interleave 128, FlashInfer MLA's kernel block 64."""
    d = _dump([_obs(0, [[128, 64, 64], [128, 128, 128]]),  # 0.22-0.28: dealt by the kernel's block
               _obs(1, [[128, 64, 128], [128, 128, 128]]),  # 0.29+: by the manager's
               _obs(2, [[128, 128, 128], [64, 64, 64]]),
               _obs(3, [[0, 64, 64], [128, 128, 128]])],  # (unknown sizes: not checked)
              il=128)
    found = list(check_kernel_block(d))
    assert [f.obs for f in found] == [0]
    f = found[0]
    assert (f.recorded, f.expected) == (64, 128) and "by 64-token blocks (the attention kernel's block" in f.message
    p = f.detail["first_position"]
    moved = [[int(x) for x in slot_deal(np.arange(p + 1), b, 4, 128)[k]] for b in (64, 128) for k in (0, 1)]
    assert moved[0][p] != moved[2][p] or moved[1][p] != moved[3][p]  # (position p moved, none before it did)
    assert moved[0][:p] == moved[2][:p] and moved[1][:p] == moved[3][:p]
    assert f"position {p} goes to rank {moved[0][p]}" in f.message


def test_a_replicated_group_or_dcp_1_is_not_checked():
    sizes = [[128, 64, 64], [128, 64, 64]]
    assert list(check_kernel_block(_dump([_obs(0, sizes)], il=128, groups=(KVGroup("a", False),
                                                                           KVGroup("b", False))))) == []
    assert list(check_kernel_block(_dump([_obs(0, sizes)], dcp=1, il=128))) == []
    assert list(check_kernel_block(_dump([_obs(0, None)], il=128))) == []
