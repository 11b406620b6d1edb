"""sparse.py: the rule topk-empty on recorded sparse top-k rows, vectorised over the observations, against
dcp.topk.state_problem (the plain reference) on seeded random rows, row states computed from real tensors with
torch, and broken ones."""

import numpy as np
import pytest
import torch

from dcptool.check.replay import replay
from dcptool.check.sparse import check_topk_empty
from dcptool.dcp import topk as TK
from dcptool.dump import open_dumps
from dcptool.engine.recorder.record import Recorder


def _rows(rng, T: int, broken: bool) -> np.ndarray:
    """T query tokens' (fingerprint, owned, state), the state computed by torch from a partial result that matches
    the share (empty rows: output 0, LSE -inf) or, where `broken`, a few rows given NaN outputs or -inf LSEs."""
    owned = np.where(rng.random(T) < 0.3, 0, rng.integers(1, 2048, T))
    out = torch.from_numpy(rng.standard_normal((T, 4, 8)).astype(np.float32))
    lse = torch.from_numpy(rng.standard_normal((T, 4)).astype(np.float32))
    e = torch.from_numpy(owned == 0)
    out[e] = 0
    lse[e] = float("-inf")
    if broken and T:
        k = rng.integers(0, T, 1 + T // 50)
        what = rng.integers(0, 3, k.size)
        for j, w in zip(k.tolist(), what.tolist()):
            if w == 0:
                out[j, 0, 0] = float("nan")  # (an empty row: 0 x NaN in a merge without the guard)
            elif w == 1:
                lse[j] = float("-inf")  # (a row with entries: no KV weighed)
            else:
                lse[j, 1] = float("inf")
    state = TK.row_state(out, lse).numpy()
    return np.stack([rng.integers(0, TK.MASK31, T), owned, state], 1).ravel()


@pytest.mark.parametrize("T", [0, 1, 127, 128, 129, 1000])
def test_the_check_is_the_reference_on_every_observation(tmp_path, T):
    rng = np.random.default_rng(T + 11)
    rec = Recorder(tmp_path / "s.safetensors", dcp_size=4)
    want = []
    for i in range(60):
        n = T if i % 3 else int(rng.integers(0, T + 1))
        rows = _rows(rng, n, broken=i % 2 == 1)
        seq = np.array([n + 5])
        rec.observe(step=i, site="attn_metadata", rank=i % 4, seq_lens=seq, num_reqs=1, num_reqs_padded=1,
                    dcp_local_seq_lens=np.zeros(1, np.int32), query_start_loc=[0, n], sparse_topk=rows)
        p = TK.state_problem(rows[1::3], rows[2::3])
        bad = np.flatnonzero(p != "")
        want.append((int(bad[0]), str(p[bad[0]])) if bad.size else None)
    d = open_dumps(rec.close())
    got = [None] * d.n
    for f in check_topk_empty(d):
        got[f.obs] = (f.detail["token"], f.detail["problem"])
    assert got == want
    assert T < 127 or sum(w is not None for w in want) >= 25


def test_an_empty_row_with_a_nan_output_is_named_and_a_clean_one_is_not(tmp_path):
    """ROCm/ATOM #1832's empty owner: a row this rank owns no top-k entry of must give output 0 and LSE -inf; one
    that gives NaN is found with what the merge does with it; a dump without the column is not told it was
    skipped; a length that is not three per token is malformed."""
    rec = Recorder(tmp_path / "e.safetensors", dcp_size=2)
    base = dict(site="attn_metadata", seq_lens=[3, 9000], num_reqs=2, num_reqs_padded=2, query_start_loc=[0, 1, 2])
    good = [11, 0, 3, 12, 4, 0]  # token 0: no entry here, output 0 and LSE -inf; token 1: 4 entries, finite
    rec.observe(step=0, rank=0, dcp_local_seq_lens=[2, 4500], sparse_topk=good, **base)
    rec.observe(step=0, rank=1, dcp_local_seq_lens=[1, 4500], sparse_topk=[11, 0, 5, 12, 4, 0], **base)
    rec.observe(step=1, rank=0, dcp_local_seq_lens=[2, 4500], sparse_topk=[11, 1, 1, 12, 4, 0, 7], **base)
    rec.observe(step=1, rank=1, dcp_local_seq_lens=[1, 4500], **base)
    res = replay(open_dumps(rec.close()), "torch")
    assert [(f.obs, f.rule) for f in res.findings] == [(1, "topk-empty"), (2, "topk-empty")]
    f = res.findings[0]
    assert f.detail == {"problem": "empty", "token": 0, "owned": 0} and (f.recorded, f.expected) == (5, 3)
    assert "gives LSE -inf, a NaN or infinite value, expected LSE -inf, output 0" in f.message
    assert "0 x NaN" in f.message
    assert res.findings[1].detail == {"problem": "length"}
    rec = Recorder(tmp_path / "none.safetensors", dcp_size=2)
    rec.observe(step=0, rank=0, dcp_local_seq_lens=[2, 4500], **base)
    assert "topk-empty" not in replay(open_dumps(rec.close()), "torch").skipped


def test_a_negative_value_is_dropped_at_the_door(tmp_path):
    """No fingerprint, count or state is negative: the Recorder drops such an observation (and says so)."""
    rec = Recorder(tmp_path / "n.safetensors", dcp_size=2)
    with pytest.warns(RuntimeWarning, match="negative sparse_topk"):
        rec.observe(step=0, site="s", rank=0, seq_lens=[3], num_reqs=1, num_reqs_padded=1, dcp_local_seq_lens=[2],
                    sparse_topk=[1, -1, 3])
    rec.observe(step=1, site="s", rank=0, seq_lens=[3], num_reqs=1, num_reqs_padded=1, dcp_local_seq_lens=[2],
                sparse_topk=[1, 1, 0])
    d = open_dumps(rec.close())
    assert d.n == 1 and d["rows.sparse_topk"].tolist() == [1, 1, 0]
