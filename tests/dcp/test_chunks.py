"""chunks.py: MLA's chunked prefill context as vLLM 0.29-0.34 plan it (the plan itself is checked against vLLM's own
function in tests/vllm/test_vllm_chunks.py), the legacy plan, the recorded schedule and its reference check."""

import math

import numpy as np
import pytest

from dcptool.dcp import chunks as C


def _pieces(mx, plans, ctx):
    """Per request: its pieces (start, length) in plan order."""
    out = {}
    for p in plans:
        for k, (s, n) in enumerate(zip(p.starts, p.lens)):
            out.setdefault(p.request_start + k, []).append((s, n))
    return out


@pytest.mark.parametrize("reqs", [0, 1, 127, 128, 129, 1000])
@pytest.mark.parametrize("N, I", [(1, 1), (2, 1), (4, 16), (8, 1), (3, 2)])
def test_plan_covers_every_context_within_the_workspace(reqs, N, I):
    """Every request with context is covered once, in order, its pieces back to back; a split starts on the DCP
    virtual block; each chunk's local rows fit workspace // N; max_context_chunk is the workspace rounded down to
    lcm(page, N * I)."""
    rng = np.random.default_rng(reqs * 10 + N)
    ctx = np.where(rng.random(reqs) < 0.3, 0, rng.integers(1, 40000, reqs)).tolist()
    ws = C.workspace_size(32768, 64, 16, N, I)
    mx, plans = C.plan_chunks(ctx, ws, 16, N, I)
    if max(ctx, default=0) == 0:
        assert (mx, plans) == (0, [])
        return
    align = 16 if N == 1 else math.lcm(16, N * I)
    assert mx == ws // align * align and mx % align == 0
    got = _pieces(mx, plans, ctx)
    assert sorted(got) == [i for i, c in enumerate(ctx) if c > 0]
    for i, pieces in got.items():
        assert [s for s, _ in pieces] == list(np.cumsum([0] + [n for _, n in pieces[:-1]]))
        assert sum(n for _, n in pieces) == ctx[i] and all(s % (N * I if N > 1 else 16) == 0 for s, _ in pieces)
    for p in plans:
        used = sum(C.padded_rows(s + n, N, I) - C.padded_rows(s, N, I) for s, n in zip(p.starts, p.lens))
        assert 0 < used <= (ws // N if N > 1 else ws)


def test_plan_splits_a_long_context_and_packs_short_ones():
    """A worked case (N=2, I=1, page 16, a 64-row workspace: 32 local rows a chunk): 100 rows of context are split at
    multiples of 16 rows; the short contexts after it share the last chunk while they fit."""
    mx, plans = C.plan_chunks([100, 0, 10, 6], 64, 16, 2, 1)
    assert mx == 64
    assert plans == [C.Plan(0, [0], [64]), C.Plan(0, [64], [36]), C.Plan(2, [0, 0], [10, 6])]
    s = C.encode(mx, plans, np.array([5, 6, 7, 8]))
    assert s.tolist() == [64, 0, 5, 0, 64, 1, 5, 64, 36, 2, 7, 0, 10, 2, 8, 0, 6]
    assert C.gathers(s, 2, 1) == [32, 18, 8] and C.gathers(C.NO_CONTEXT, 2, 1) == []
    q = np.array([1, 1, 1, 1, 1, 20, 1, 10, 5])
    seq = np.array([9, 9, 9, 9, 9, 100, 0, 10, 6]) + q  # computed context + the new tokens
    assert C.first_problem(s, seq, np.cumsum(np.r_[0, q]), 9, 2, 1) is None
    assert C.first_problem(s, seq + q, np.cumsum(np.r_[0, q]), 9, 2, 1) == "coverage"


def test_legacy_plan_is_unaligned():
    """Before vLLM aligned chunks: the workspace over the prefills with context, the same offsets in every request."""
    mx, plans = C.legacy_plan([100, 0, 10, 37], 96)
    assert mx == 32 and [p.starts[0] for p in plans] == [0, 32, 64, 96]
    s = C.legacy_encode(mx, plans, [100, 0, 10, 37], [0, 1, 2, 3])
    assert s.reshape(-1)[1:].reshape(-1, 4).tolist() == [[0, 0, 0, 32], [0, 2, 0, 10], [0, 3, 0, 32], [1, 0, 32, 32],
                                                          [1, 3, 32, 5], [2, 0, 64, 32], [3, 0, 96, 4]]
    assert C.first_problem(s, [100, 5, 10, 37], None, 4, 3, 1) == "max"
    assert C.legacy_plan([0, 0], 96) == (0, [])


@pytest.mark.parametrize("mutate, kind", [
    (lambda s: s[:-1], "length"), (lambda s: np.r_[0, s[1:]], "max0"), (lambda s: _set(s, 0, 0, 1), "chunk"),
    (lambda s: _set(s, 0, 1, 9), "row"), (lambda s: _set(s, 1, 3, 0), "empty"), (lambda s: np.r_[65, s[1:]], "max"),
    (lambda s: _set(s, 1, 2, 41), "start"), (lambda s: _set(s, 1, 2, 128), "gap"),
    (lambda s: _set(s, 2, 3, 11), "coverage")])
def test_first_problem_names_each_kind(mutate, kind):
    mx, plans = C.plan_chunks([100, 0, 10, 6], 64, 16, 2, 1)
    s = C.encode(mx, plans, np.array([0, 1, 2, 3]))
    seq, qsl = np.array([120, 3, 12, 10]), np.array([0, 20, 23, 25, 29])
    assert C.first_problem(s, seq, qsl, 4, 2, 1) is None
    assert C.first_problem(mutate(s.copy()), seq, qsl, 4, 2, 1) == kind


def _set(s, entry, field, value):
    s[1 + 4 * entry + field] = value
    return s


def test_padded_rows_and_workspace():
    assert [C.padded_rows(n, 4, 16) for n in (0, 1, 64, 65)] == [0, 16, 16, 32] and C.padded_rows(7, 1, 8) == 7
    assert C.workspace_size(32768, 64, 16, 1, 1) == 65536 and C.workspace_size(100, 2, 16, 3, 16) == 816
