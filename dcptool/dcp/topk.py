"""Sparse MLA's top-k under DCP (DeepSeek sparse attention: an indexer picks each query token's top-k KV positions;
attention reads only those): what dcptool records of it and the model simulate runs.

Under DCP every rank scores its own shard, the candidates are merged into one global top-k set per query token, and
each rank attends to the entries of that set it owns (vLLM's `_merge_dcp_topk_global`, then
`triton_filter_and_convert_dcp_index`; ROCm/ATOM's DCP sparse path). Two invariants follow:

- the set is the same on every rank of the DCP group (the partition of the set between ranks is exact only then: a
  tie at the k-th score broken differently on one rank gives it another set);
- a row of which a rank owns no entry (all -1 after the filter) gives that rank's partial output 0 and LSE -inf, so
  the LSE merge weighs it 0; a NaN there survives the weight (0 x NaN) and poisons every rank's output.

Recorded per query token (a prefix of the batch's tokens): `topk_fp`, a fingerprint of the set (`fingerprint`: a sum
of a 32-bit mix of each global token id, order-free, so two ranks' sets compare without storing them); `topk_owned`,
how many of its entries this rank owns (`owned`); `topk_state`, the row's partial result (`row_state`: bit 0 LSE
-inf on every head, bit 1 output all 0, bit 2 a NaN or infinite output, or a NaN / +inf LSE). The bodies are written
once against the operators numpy arrays and torch tensors share (an engine computes them on the device with torch;
replay and simulate with numpy).
"""

from __future__ import annotations

import numpy as np

MASK31 = 0x7FFFFFFF
_SIZE_MIX = 0x3C6EF372  # the set's size enters the fingerprint too (two sets of equal id sums differ by their size)

LSE_NEG_INF, OUT_ZERO, NON_FINITE = 1, 2, 4  # topk_state's bits
EMPTY_STATE = LSE_NEG_INF | OUT_ZERO  # what a row with no entry on this rank must give
STATE_BITS = LSE_NEG_INF | OUT_ZERO | NON_FINITE

# simulate's indexer: the top TOPK positions of each query token, scored by recency in buckets of BUCKET positions
# (equal scores within a bucket: the k-th score ties whenever the context is longer than TOPK)
TOPK = 2048
BUCKET = 768


def mix32(x):
    """A 32-bit integer mix of each int64 id (numpy array or torch tensor; values in [0, 2^31))."""
    h = (x * 2654435761 + 0x7F4A7C15) & 0xFFFFFFFF
    h = h ^ (h >> 16)
    h = (h * 0x045D9F3B) & 0xFFFFFFFF
    return h ^ (h >> 16)


def fingerprint(ids):
    """[..., k] global token ids (int64; -1 for none) -> [...] int64 in [0, 2^31): the set's fingerprint, independent
    of the entries' order."""
    valid = ids >= 0
    h = mix32(ids * valid) * valid
    return (h.sum(-1) + valid.sum(-1) * _SIZE_MIX) & MASK31


def owned(ids, rank, dcp_size: int, cp_interleave: int):
    """[..., k] global token ids (-1: none) -> [...]: how many this rank holds, position p living on rank
    (p // I) % N (the entries it attends to after the DCP filter)."""
    return (((ids // cp_interleave) % dcp_size == rank) & (ids >= 0)).sum(-1)


def row_state(out, lse):
    """A rank's partial result of sparse attention, [T, ...] output and [T, ...] LSE (numpy or torch, floating) ->
    [T] int64 topk_state: LSE_NEG_INF where every LSE of the row is -inf, OUT_ZERO where every output is 0, NON_FINITE
    where an output is NaN or infinite or an LSE NaN or +inf."""
    T = out.shape[0]
    o, s = out.reshape(T, int(np.prod(out.shape[1:]))), lse.reshape(T, int(np.prod(lse.shape[1:])))
    inf = float("inf")
    bad = ((o != o) | (abs(o) == inf)).any(-1) | ((s != s) | (s == inf)).any(-1)
    return (s == -inf).all(-1) * LSE_NEG_INF + (o == 0).all(-1) * OUT_ZERO + bad * NON_FINITE


def model_bounds(L: np.ndarray, lowest: bool = True, k: int = TOPK, bucket: int = BUCKET) -> tuple[np.ndarray, ...]:
    """simulate's indexer for query tokens attending to L positions (int64 [...]): the top-k set as two intervals
    [a, b) and [c, d). Every position when L <= k; else the k // bucket most recent buckets whole and, of the
    next one (the tie at the k-th score), the lowest ids (the stable tie-break every rank must share) or, with
    lowest=False, the highest ids (another tie-break: another set)."""
    L = np.asarray(L, np.int64)
    full = k // bucket * bucket
    rem = k - full
    long = L > k
    b = L.copy()
    a = np.where(long, L - full, 0)
    lo = np.maximum(L - full - bucket, 0)
    c = np.where(long, lo if lowest else L - full - rem, 0)
    d = np.where(long, c + rem, 0)
    return a, b, c, d


def model_ids(bounds: tuple[np.ndarray, ...], k: int = TOPK) -> np.ndarray:
    """The intervals of model_bounds as [..., k] ids, -1 padded (what the indexer's output buffer holds)."""
    a, b, c, d = (np.asarray(x, np.int64)[..., None] for x in bounds)
    j = np.arange(k, dtype=np.int64)
    n1 = b - a
    ids = np.where(j < n1, a + j, np.where(j < n1 + d - c, c + j - n1, -1))
    return ids


class Prefix:
    """Prefix sums of mix32 over positions [0, n): a set of intervals' fingerprint without its ids."""

    def __init__(self, n: int):
        self.sums = np.zeros(n + 1, np.int64)
        np.cumsum(mix32(np.arange(n, dtype=np.int64)), out=self.sums[1:])

    def fingerprint(self, bounds: tuple[np.ndarray, ...]) -> np.ndarray:
        a, b, c, d = bounds
        P = self.sums
        return (P[b] - P[a] + P[d] - P[c] + (b - a + d - c) * _SIZE_MIX) & MASK31


def model_owned(bounds: tuple[np.ndarray, ...], rank, dcp_size: int, cp_interleave: int) -> np.ndarray:
    """How many positions of the intervals rank `rank` owns (rank may be [N, 1]: every rank's)."""
    from dcptool.dcp.reference import local_np

    a, b, c, d = bounds

    def on(x):
        return local_np(x, dcp_size, rank, cp_interleave)

    return on(b) - on(a) + on(d) - on(c)


def state_problem(owned_: np.ndarray, state: np.ndarray) -> np.ndarray:
    """The rule topk-empty per row (int64 arrays): "" where fine, else what is wrong: "empty" (a row with no entry on
    this rank whose result is not output 0 and LSE -inf), "lse" (a row with entries whose LSE is -inf on every head or
    which has a non-finite value), "state" (bits that are not topk_state's)."""
    odd = (state & ~STATE_BITS) != 0
    empty = (owned_ == 0) & (state != EMPTY_STATE)
    held = (owned_ > 0) & ((state & (LSE_NEG_INF | NON_FINITE)) != 0)
    return np.where(odd, "state", np.where(empty, "empty", np.where(held, "lse", "")))
