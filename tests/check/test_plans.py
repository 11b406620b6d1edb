"""plans.py: plan-pages on seeded random recordings against a torch reference (FlashInfer's plans as the fixed
builder makes them, from the local lengths), and on hand-built builds that must and must not be found."""

import numpy as np
import pytest
import torch

from dcptool.check.plans import check_plan_pages
from dcptool.dcp.reference import dcp_local_seq_lens
from dcptool.dump import Dump, DumpConfig, Observation, pack
from dcptool.dump.schema import validate_columns

PAGE, N, IL = 16, 2, 1


def _dump(observations) -> Dump:
    cfg, cols = pack(observations, DumpConfig(dcp_size=N, cp_interleave=IL, page_size=PAGE))
    validate_columns("t", cfg, cols)
    n = len(observations)
    return Dump(files=["t"], config=cfg, columns=cols, file_index=np.zeros(n, np.int32),
                file_obs=np.arange(n, dtype=np.int64))


def _fixed_plan(seq, q, nd, rank):
    """vLLM 0.30+'s FlashInfer DCP plans in torch: the prefill rows' context (seq_len - query_len) and the decode
    rows' seq_len, localised, then counted in pages and their last page."""
    covered = torch.tensor(seq) - torch.tensor(q) * (torch.arange(len(q)) >= nd)
    local = dcp_local_seq_lens(covered, N, rank, IL)
    last = local % PAGE
    last = torch.where((last == 0) & (local != 0), torch.full_like(last, PAGE), last)
    return (-(-local // PAGE)).numpy(), last.numpy()


def _obs(step, seq, q, rank, pre, last):
    seq = np.asarray(seq)
    return Observation(step=step, site="attn_metadata", rank=rank, num_reqs=seq.size, num_reqs_padded=seq.size,
                       seq_lens=seq, dcp_local_seq_lens=dcp_local_seq_lens(torch.tensor(seq), N, rank, IL).numpy(),
                       query_start_loc=np.r_[0, np.cumsum(q)], kv_prefill_pages=np.asarray(pre, np.int32),
                       kv_last_page=np.asarray(last, np.int32))


@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 1000])
def test_random_recordings_match_the_reference(n):
    rng = np.random.default_rng(31 + n)
    observations, want = [], set()
    for i in range(n):
        nd, npf = int(rng.integers(0, 4)), int(rng.integers(0, 4)) or 1
        q = [1] * nd + rng.integers(2, 300, npf).tolist()
        seq = (rng.choice([0, 1, 127, 128, 129, 1000, 1500], nd + npf) + q).tolist()
        rank = int(rng.integers(0, N))
        pages, last = _fixed_plan(seq, q, nd, rank)
        pre = np.where(np.arange(len(q)) >= nd, pages, -1)
        if rng.random() < 0.3:  # 0.29: counted from the global lengths
            glob = -(-np.asarray(seq) // PAGE)
            pre = np.where(np.arange(len(q)) >= nd, glob, -1)
        if rng.random() < 0.2:
            last = np.where(np.arange(len(q)) < nd, (np.asarray(seq) % PAGE), last)
        if rng.random() < 0.2:
            last = np.full(len(q), -1)  # (none read)
        observations.append(_obs(i, seq, q, rank, pre, last))
        good_pre, good_last = _fixed_plan(seq, q, nd, rank)
        if ((pre >= 0) & (pre != good_pre)).any() or ((last >= 0) & (last != good_last)).any():
            want.add(i)
    if not n:
        return
    found = {f.obs for f in check_plan_pages(_dump(observations))}
    assert want or n < 100
    assert found == want


def test_a_fresh_prefill_claiming_the_global_pages_is_found_and_the_local_plan_is_not():
    """The issue's case: a fresh 20-token prefill has no local context, but 0.29's plan claims cdiv(20, 16) = 2
    pages; the fixed plan claims 0 (last page 0); a decode row's last page of its global length is found too."""
    d = _dump([_obs(0, [20], [20], 0, [2], [4]),  # 0.29: global count and last page
               _obs(1, [20], [20], 0, [0], [0]),  # 0.30+: no context
               _obs(2, [40, 20], [1, 20], 1, [-1, 0], [4, 0]),  # decode row 0 (global 40: last 8; local 20: 4)
               _obs(3, [40, 20], [1, 20], 1, [-1, 0], [8, 0]),  # decode row's last page of the global length
               _obs(4, [40, 20], [1, 20], 1, [-1, -1], [-1, -1])])  # (nothing read: nothing checked)
    found = list(check_plan_pages(d))
    assert [(f.obs, f.row, f.recorded, f.expected) for f in found] == [(0, 0, 2, 0), (3, 0, 8, 4)]
    assert "the count of the global seq_len" in found[0].message
    assert "that of the global length" in found[1].message and found[1].detail["row_kind"] == "decode"
