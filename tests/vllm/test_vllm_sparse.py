"""Sparse MLA under DCP from vLLM's own code (0.29-0.34). The share of a query token's global top-k set each rank
attends to (dcp.topk.owned: rows.sparse_topk's second value) is the valid count vLLM's
triton_filter_and_convert_dcp_index hands the sparse kernel, and an empty share an all -1 row. vLLM's DCP merge
(correct_attn_out's kernel) recombines the ranks' partial results into attention over the whole set when the ranks
agree on it, and into something else when one breaks the k-th tie another way (topk-agree's class, ROCm/ATOM #1832);
an empty row's NaN partial (topk-empty's class) vLLM's merge zeroes (its factor == 0 guard), which is why no vLLM
release has that bug while a merge without the guard does."""

import numpy as np
import pytest
import torch
from vllm.v1.attention.backends.mla.sparse_utils import triton_filter_and_convert_dcp_index
from vllm.v1.attention.ops import dcp

from dcptool.dcp import topk as TK

pytestmark = pytest.mark.vllm
K_ = 256  # the filter's NUM_TOPK_TOKENS (a multiple of its BLOCK_N, 128)
BUCKET = 96  # (k // bucket = 2 whole buckets, then 64 of the tied third)


def _sets(L: np.ndarray, lowest: bool = True) -> np.ndarray:
    return TK.model_ids(TK.model_bounds(L, lowest, k=K_, bucket=BUCKET), k=K_)


@pytest.mark.parametrize("N, I", [(2, 1), (4, 16), (8, 2), (3, 1)])
@pytest.mark.parametrize("T", [1, 127, 129])
def test_the_filter_hands_each_rank_dcptools_share(N, I, T):
    rng = np.random.default_rng(N * 100 + I + T)
    L = rng.integers(1, 5000, T)
    L[: min(T, 3)] = [1, 2, N * I][: min(T, 3)]  # (short contexts: ranks with no entry)
    scattered = np.full((T, K_), -1, np.int64)  # (random distinct ids, then -1: the merge's output form)
    for t in range(T):
        n = int(rng.integers(0, K_ + 1))
        scattered[t, :n] = rng.choice(5000, n, replace=False)
    for sets in (_sets(L), scattered):
        block = 64
        table = torch.arange(5000 // block + 2, dtype=torch.int32)[None]
        for r in range(N):
            out, cnt = triton_filter_and_convert_dcp_index(
                torch.zeros(T, dtype=torch.int32), table, torch.from_numpy(sets).int(), N, r, I, BLOCK_SIZE=block,
                NUM_TOPK_TOKENS=K_, BLOCK_N=128, return_valid_counts=True)
            own = TK.owned(sets, r, N, I)
            assert np.array_equal(cnt.numpy(), own) and np.array_equal((out >= 0).sum(1).numpy(), own)
            assert (out[torch.from_numpy(own == 0)] == -1).all()
            assert np.array_equal(TK.owned(torch.from_numpy(sets), r, N, I).numpy(), own)


def _partials(q, kv, sets, N, I, nan_empty=False):
    """Each rank's sparse attention over its share of each token's set: [T, H, D] outputs and [T, H] LSEs
    (natural log); a rank with no entry of a row: output 0 and LSE -inf, or a NaN output (0/0) with nan_empty."""
    T, H, D = q.shape
    outs, lses = [], []
    for r in range(N):
        out, lse = torch.zeros(T, H, D), torch.full((T, H), float("-inf"))
        for t in range(T):
            mine = [p for p in sets[r][t].tolist() if p >= 0 and (p // I) % N == r]
            if not mine:
                if nan_empty:
                    out[t] = float("nan")
                continue
            s = q[t] @ kv[mine].T  # [H, n]
            lse[t] = torch.logsumexp(s, -1)
            out[t] = torch.softmax(s, -1) @ kv[mine]
        outs.append(out)
        lses.append(lse)
    return outs, torch.stack(lses)


# vLLM's merge kernel (correct_attn_out's): 0.29's module-level Triton kernel, 0.30+'s CorrectAttnCPOutKernel.kernel
# (0.30+'s launcher reads compiled-kernel attributes the Triton interpreter does not have: the kernel is launched
# here with correct_attn_out's arguments)
MERGE = getattr(dcp, "_correct_attn_cp_out_kernel", None) or dcp.CorrectAttnCPOutKernel.kernel


def _correct(out: torch.Tensor, lses: torch.Tensor, rank: int) -> torch.Tensor:
    """correct_attn_out(out, lses, rank): this rank's output weighed by its share of the merged LSE."""
    B, H, D = out.shape
    new = torch.empty_like(out)
    lse = torch.empty(B, H)
    MERGE[(B, H, 1)](out, new, lses, lse, *out.stride(), *lses.stride(), rank, HEAD_DIM=D, N_ROUNDED=lses.shape[0],
                     IS_BASE_E=True)
    return new


def _merged(outs, lses):
    return sum(_correct(o.contiguous(), lses.contiguous(), r) for r, o in enumerate(outs))


@pytest.mark.parametrize("N, I", [(4, 1), (2, 16)])
def test_the_merge_is_attention_over_the_set_only_when_the_ranks_agree(N, I):
    """Every rank the same set: the merged output is softmax attention over the whole set. One rank breaking the
    k-th tie another way (its set has the tied bucket's highest ids): the ranks' shares no longer partition one set
    and the merge is attention over neither set; the fingerprints say so (topk-agree)."""
    rng = np.random.default_rng(N + I)
    L = np.r_[1, 5, 200, 300, 400, 1000]
    T, H, D = L.size, 2, 8
    q = torch.from_numpy(rng.standard_normal((T, H, D)).astype(np.float32))
    kv = torch.from_numpy(rng.standard_normal((int(L.max()), D)).astype(np.float32))
    ids, odd = _sets(L), _sets(L, lowest=False)

    def whole(sets):
        return torch.stack([torch.softmax(q[t] @ kv[[p for p in sets[t] if p >= 0]].T, -1)
                            @ kv[[p for p in sets[t] if p >= 0]] for t in range(T)])

    agree = _merged(*_partials(q, kv, [ids] * N, N, I))
    assert torch.allclose(agree, whole(ids), atol=1e-5)
    split = _merged(*_partials(q, kv, [ids] * (N - 1) + [odd], N, I))
    tied = torch.from_numpy(L > K_)
    assert torch.allclose(split[~tied], whole(ids)[~tied], atol=1e-5)
    for want in (whole(ids), whole(odd)):
        assert not torch.allclose(split[tied], want[tied], atol=1e-3)
    assert np.array_equal(TK.fingerprint(ids) != TK.fingerprint(odd), L > K_)


def test_an_empty_rows_nan_is_a_finding_and_vllms_merge_zeroes_it():
    """A rank with no entry of a row whose partial output is NaN (LSE -inf): its state is what topk-empty reports;
    vLLM's merge weighs it 0 and zeroes it (factor == 0), so the merged output is still attention over the set."""
    rng = np.random.default_rng(4)
    N, I = 4, 16
    L = np.r_[1, 3, 20, 700]  # the first tokens attend to rank 0's first interleave block only
    T, H, D = L.size, 2, 8
    q = torch.from_numpy(rng.standard_normal((T, H, D)).astype(np.float32))
    kv = torch.from_numpy(rng.standard_normal((int(L.max()), D)).astype(np.float32))
    ids = _sets(L)
    outs, lses = _partials(q, kv, [ids] * N, N, I, nan_empty=True)
    own = np.stack([TK.owned(ids, r, N, I) for r in range(N)])
    state = np.stack([TK.row_state(o, lses[r]).numpy() for r, o in enumerate(outs)])
    assert (own == 0).any() and np.array_equal(state == TK.LSE_NEG_INF | TK.NON_FINITE, own == 0)
    assert (TK.state_problem(own, state) == np.where(own == 0, "empty", "")).all()
    clean = _merged(*_partials(q, kv, [ids] * N, N, I))
    merged = _merged(outs, lses)
    assert not merged.isnan().any() and torch.allclose(merged, clean, atol=1e-6)
