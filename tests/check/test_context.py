"""context.py: the rule ctx-chunks on recorded chunked-context schedules, vectorised over the observations, against
dcp.chunks.first_problem (the plain reference) on seeded random schedules, vLLM's plans and broken ones."""

import numpy as np
import pytest

from dcptool.check.context import check_ctx_chunks
from dcptool.check.replay import replay
from dcptool.dcp import chunks as C
from dcptool.dump import open_dumps
from dcptool.engine.recorder.record import Recorder

BREAK = ("length", "max0", "chunk", "row", "empty", "max", "start", "gap", "coverage", "kv", "none")


def _broken(rng, s: np.ndarray, how: str, qsl: np.ndarray) -> np.ndarray:
    s = s.copy()
    k = 1 + 4 * int(rng.integers(0, (s.size - 1) // 4)) if s.size > 1 else 0
    if how == "length":
        return s[:-1] if s.size > 1 else np.r_[s, 5]
    if s.size == 1:
        return s
    if how == "max0":
        s[0] = 0
    elif how == "chunk":
        s[k] += 2
    elif how == "row":
        s[k + 1] = 10_000
    elif how == "empty":
        s[k + 3] = 0
    elif how == "max":
        s[0] += 1
    elif how == "start":
        s[k + 2] += 1
    elif how == "gap":
        s[k + 2] += 64
    elif how == "coverage":
        s[k + 3] += 1
    elif how == "kv":  # planned from the KV length (seq_len), not the computed context
        s[-1] += int(np.diff(qsl)[s[-3]])
    return s


def _observations(seed: int, n: int, N: int, I: int):
    """Random batches (decodes, then prefills with and without context), each with vLLM's plan, then broken one way
    or none; seq_lens / query_start_loc recorded whole."""
    rng = np.random.default_rng(seed)
    ws = C.workspace_size(4096, 8, 16, N, I)
    for i in range(n):
        rows = int(rng.integers(1, 40))
        q = np.where(rng.random(rows) < 0.4, 1, rng.integers(2, 300, rows))
        q.sort()
        ctx = np.where(rng.random(rows) < 0.3, 0, rng.integers(0, 9000, rows))
        seq, qsl = ctx + q, np.r_[0, np.cumsum(q)]
        nd = int(np.argmax(q > 1)) if (q > 1).any() else rows
        mx, plans = C.plan_chunks(ctx[nd:].tolist(), ws, 16, N, I)
        s = C.encode(mx, plans, np.arange(nd, rows))
        yield seq, qsl, _broken(rng, s, BREAK[i % len(BREAK)], qsl)


@pytest.mark.parametrize("N, I", [(1, 1), (2, 1), (4, 16), (3, 1), (8, 2)])
def test_the_check_is_the_reference_on_every_observation(tmp_path, N, I):
    rec = Recorder(tmp_path / "c.safetensors", dcp_size=N, cp_interleave=I)
    want = []
    for i, (seq, qsl, s) in enumerate(_observations(N * 7 + I, 220, N, I)):
        rec.observe(step=i, site="attn_metadata", rank=0, seq_lens=seq, num_reqs=seq.size, num_reqs_padded=seq.size,
                    dcp_local_seq_lens=C.np.zeros(seq.size, np.int32) if N > 1 else None, query_start_loc=qsl,
                    ctx_chunks=s)
        want.append(C.first_problem(s, seq, qsl, seq.size, N, I))
    d = open_dumps(rec.close())
    got = [None] * d.n
    for f in check_ctx_chunks(d):
        got[f.obs] = f.detail["problem"]
    assert got == want
    assert sum(w is not None for w in want) > 150 and {w for w in want} - {None} >= {"coverage", "row", "chunk"}


def test_a_vllm_plan_replays_clean_and_a_kv_length_plan_is_named(tmp_path):
    """A schedule planned from the KV length (seq_len, vllm-ascend #15600's) is named so; vLLM's own plan of the
    computed context is clean, and a dump without the column (no chunked context) is not told it was skipped."""
    seq, q = np.array([5, 40, 9000]), np.array([1, 20, 100])
    qsl = np.r_[0, np.cumsum(q)]
    ws = C.workspace_size(4096, 8, 16, 2, 1)
    good = C.encode(*C.plan_chunks((seq - q)[1:].tolist(), ws, 16, 2, 1), [1, 2])
    bad = C.encode(*C.plan_chunks(seq[1:].tolist(), ws, 16, 2, 1), [1, 2])
    rec = Recorder(tmp_path / "k.safetensors", dcp_size=2)
    for r, s in enumerate((good, good, bad, bad)):
        rec.observe(step=r // 2, site="attn_metadata", rank=r % 2, seq_lens=seq, num_reqs=3, num_reqs_padded=3,
                    dcp_local_seq_lens=(seq + 1 - r % 2) // 2, query_start_loc=qsl, ctx_chunks=s)
    res = replay(open_dumps(rec.close()), "torch")
    assert [(f.obs, f.rule) for f in res.findings] == [(2, "ctx-chunks"), (3, "ctx-chunks")]
    f = res.findings[0]
    assert f.detail == {"problem": "coverage", "kv_length": True} and (f.row, f.recorded, f.expected) == (1, 40, 20)
    assert "its KV length seq_len" in f.message
    rec = Recorder(tmp_path / "none.safetensors", dcp_size=2)
    rec.observe(step=0, site="s", rank=0, seq_lens=seq, num_reqs=3, num_reqs_padded=3, dcp_local_seq_lens=seq // 2)
    assert "ctx-chunks" not in replay(open_dumps(rec.close()), "torch").skipped  # (a feature the dump does not have)


def test_an_unaligned_max_context_chunk_is_vllms_assertion(tmp_path):
    """vLLM PR #41229's assertion: max_context_chunk % dcp_world_size; here of dcp_size x interleave."""
    mx, plans = C.legacy_plan([9000, 300, 10], 65536)
    s = C.legacy_encode(mx, plans, [9000, 300, 10], [0, 1, 2])
    assert mx == 21845
    rec = Recorder(tmp_path / "u.safetensors", dcp_size=4)
    rec.observe(step=0, site="attn_metadata", rank=0, seq_lens=[9001, 301, 11], num_reqs=3, num_reqs_padded=3,
                dcp_local_seq_lens=[2251, 76, 3], query_start_loc=[0, 1, 2, 3], ctx_chunks=s)
    (f,) = check_ctx_chunks(open_dumps(rec.close()))
    assert f.detail == {"problem": "max"} and (f.recorded, f.expected) == (21845, 21844)
    assert "not a multiple of dcp_size x interleave (4)" in f.message
