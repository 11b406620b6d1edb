"""The block sizes vLLM's slot mapping works with, recorded through the plugin from the runner's own BlockTables
(vLLM #51031): the KV-cache manager's block, the attention kernel's (FlashInfer MLA splits 128 into 64) and the one
the release's slot-mapping kernel deals positions to the DCP ranks by (`block_sizes_tensor`, laid out by the
release's own init_block_table_layout_tensors), with the slot mappings its kernel computes in the interpreter."""

import engine as E
import numpy as np
import pytest
import torch

from dcptool.check.replay import replay
from dcptool.dump import open_dumps
from dcptool.engine import vllm as plugin

pytestmark = pytest.mark.vllm
MANAGER, KERNEL, IL = 128, 64, 128  # the PR's case: --block-size 128, --cp-kv-cache-interleave-size 128
Q, SEQ = [1, 1, 1, 5], [300, 77, 513, 260]


def _tables(dcp: int, rank: int, before_fix: bool):
    """The runner's BlockTables for one attention group whose kernel block is half the manager's; `before_fix`:
    block_sizes_tensor laid out as 0.22-0.28's constructor did (from kernel_block_sizes)."""
    bt = E.slot_tables([MANAGER], [True], dcp, rank, IL, max_num_tokens=256, seed=rank)
    bt.kernel_block_sizes, bt.blocks_per_kv_block = [KERNEL], [MANAGER // KERNEL]
    bt.init_block_table_layout_tensors()
    if before_fix:
        bt.block_sizes_tensor = torch.tensor(bt.kernel_block_sizes, dtype=torch.int32)
    return bt


def _steps(dcp: int, rank: int, before_fix: bool, steps: int = 3) -> None:
    bt, bufs = _tables(dcp, rank, before_fix), E.buffers(8, 256)
    for k in range(steps):
        batch = E.prepare_inputs(Q, [s + k for s in SEQ], bufs, dcp=(dcp, rank, IL))
        if not E.PRE_FIX:
            E.dcp_step(batch, bufs, dcp, rank, IL)
        n = int(batch.num_tokens_after_padding)
        sm = bt.compute_slot_mappings(torch.arange(len(Q), dtype=torch.int32), batch.query_start_loc,
                                      batch.positions, n)
        tables = bt.get_dummy_block_tables(batch.num_reqs_after_padding)
        with plugin.step(runner=E.runner(bt, dcp, rank, IL, bufs)):
            E.model_state().prepare_attn(batch, E.MODES["none"], tables, sm, [[]], E.KV)


def _run(dcp, before_fix, tmp_path, monkeypatch):
    d = open_dumps(E.run_ranks(dcp, lambda rank: _steps(dcp, rank, before_fix), tmp_path, monkeypatch))
    return d, replay(d, "torch")


def test_the_releases_slot_mapping_deals_by_the_managers_block_and_replays_clean(tmp_path, monkeypatch):
    """Every release of the matrix has the fix (0.29): the slot mapping deals by the manager's block, recorded
    beside the kernel's; kernel-block and the slot rules run and stay silent."""
    d, res = _run(2, False, tmp_path, monkeypatch)
    got = np.flatnonzero(np.diff(d["obs.kvbs"]) > 0)
    assert got.size == 6 and (d["rows.kv_block_sizes"].reshape(-1, 3) == [MANAGER, KERNEL, MANAGER]).all()
    assert d.has("obs.slots") and (d["rows.slot_mapping"] >= 0).any()
    assert res.findings == [], [f.message for f in res.findings]
    assert "kernel-block" not in res.skipped and "slots" not in res.skipped


def test_dealing_by_the_kernels_block_is_found_at_every_build(tmp_path, monkeypatch):
    """The release's own kernel handed 0.22-0.28's block_sizes_tensor (the kernel's sizes): every build is
    kernel-block, and the positions it sends to the wrong rank are `slots` findings."""
    d, res = _run(2, True, tmp_path, monkeypatch)
    found = {(f.rank, f.step) for f in res.findings if f.rule == "kernel-block"}
    assert len(found) == 6 and (d["rows.kv_block_sizes"].reshape(-1, 3) == [MANAGER, KERNEL, KERNEL]).all()
    assert {f.rule for f in res.findings} <= {"kernel-block", "slots", "slot-partition"}
    assert "slots" in {f.rule for f in res.findings}
