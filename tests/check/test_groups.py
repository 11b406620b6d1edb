"""groups.py: the rule group-lens (per KV-cache group lengths and per query token verify bounds), vectorised over
the observations, against dcp.reference's group_lens_np and verify_lens_np one batch at a time, on seeded random
batches with and without broken values."""

import numpy as np
import pytest

from dcptool.check.groups import check_group_lens
from dcptool.check.replay import replay
from dcptool.dcp.reference import group_lens_np, local_np, verify_lens_np
from dcptool.dump import open_dumps
from dcptool.engine.recorder.record import Recorder

GROUPS = [{"name": "attn", "dcp": True}, {"name": "mamba", "dcp": False},
          {"name": "swa", "dcp": False, "sliding_window": 128, "cp_size": 1}]
SHARDED = [g["dcp"] for g in GROUPS]


def _batches(seed: int, n: int, N: int, I: int):
    """Random batches (decodes of q tokens, then prefills, then request padding), every rank's group lengths and
    verify bounds, each observation broken one way or left right; yields the observation and its expected kind."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        nr = int(rng.choice([0, 1, 2, 127, 128, 129]))
        nrp = nr + int(rng.integers(0, 3))
        qd = int(rng.integers(1, 5))
        nd = int(rng.integers(0, nr + 1))
        q = np.r_[np.full(nd, qd), rng.integers(qd + 1, 300, nr - nd), np.zeros(nrp - nr, np.int64)]
        seq = np.r_[q[:nr] + rng.integers(0, 5000, nr), np.zeros(nrp - nr, np.int64)]
        qsl = np.r_[0, np.cumsum(q)]
        rank = int(rng.integers(0, N))
        gl = group_lens_np(seq, nr, rank, N, I, SHARDED)
        T = int(qsl[nd])
        vl = verify_lens_np(seq, qsl, T, rank, N, I) if T else None
        kind = None
        how = i % 5
        if how == 1 and nr and N > 1:  # the sliding-window group handed the local lengths
            loc = local_np(seq[:nr], N, rank, I)
            if (loc != seq[:nr]).any():
                gl[2 * nrp:2 * nrp + nr] = loc
                kind = "group"
        elif how == 2 and vl is not None and qd > 1:  # local(seq_len) - k
            row = np.repeat(np.arange(nd), qd)
            k = qsl[row + 1] - 1 - np.arange(T)
            bad = local_np(seq[row], N, rank, I) - k
            if (bad != vl).any():
                vl, kind = bad, "verify"
        elif how == 3 and nrp:
            gl, kind = gl[:-1], "length"
        yield dict(step=i, site="attn_metadata", rank=rank, seq_lens=seq, num_reqs=nr, num_reqs_padded=nrp,
                   dcp_local_seq_lens=local_np(seq, N, rank, I) * (np.arange(nrp) < nr), query_start_loc=qsl,
                   group_seq_lens=gl, verify_row_lens=vl), kind


@pytest.mark.parametrize("N, I", [(1, 1), (2, 1), (4, 16), (3, 2), (8, 1)])
def test_the_check_is_the_reference_on_every_observation(tmp_path, N, I):
    rec = Recorder(tmp_path / "g.safetensors", dcp_size=N, cp_interleave=I, kv_groups=GROUPS)
    want = []
    for kw, kind in _batches(N * 11 + I, 200, N, I):
        rec.observe(**kw)
        want.append(kind)
    d = open_dumps(rec.close())
    got = [None] * d.n
    for f in check_group_lens(d):
        got[f.obs] = f.detail["problem"]
    assert got == want
    assert N == 1 or {"group", "verify", "length"} <= set(want)


def test_the_worked_example_of_vllm_pr_46076():
    """DCP 2, rank 1, a request of final length 10 verifying three tokens: the tokens' bounds [8, 9, 10] localise to
    [4, 4, 5]; subtracting the offsets from local(10) = 5 gives [3, 4, 5] (what the review caught)."""
    assert verify_lens_np(np.array([10]), np.array([0, 3]), 3, 1, 2, 1).tolist() == [4, 4, 5]
    assert (local_np(np.array([10]), 2, 1, 1) - np.array([2, 1, 0])).tolist() == [3, 4, 5]


def test_findings_say_what_went_wrong(tmp_path):
    seq, qsl = np.array([10, 300]), np.array([0, 3, 103])
    rec = Recorder(tmp_path / "w.safetensors", dcp_size=2, kv_groups=GROUPS)
    base = dict(site="attn_metadata", rank=1, seq_lens=seq, num_reqs=2, num_reqs_padded=2,
                dcp_local_seq_lens=local_np(seq, 2, 1, 1), query_start_loc=qsl)
    gl = group_lens_np(seq, 2, 1, 2, 1, SHARDED)
    rec.observe(step=0, **base, group_seq_lens=gl, verify_row_lens=[4, 4, 5])
    swa = gl.copy()
    swa[4:] = local_np(seq, 2, 1, 1)
    rec.observe(step=1, **base, group_seq_lens=swa, verify_row_lens=[3, 4, 5])
    res = replay(open_dumps(rec.close()), "torch")
    assert [(f.obs, f.rule) for f in res.findings] == [(1, "group-lens")]
    f = res.findings[0]
    assert f.detail == {"problem": "group", "group": 2, "replicated": True} and (f.row, f.recorded, f.expected) == (
        0, 5, 10)
    assert "KV-cache group 'swa' row 0 gets length 5, expected 10: this rank's DCP-local length, but the group is " \
           "replicated" in f.message
    rec = Recorder(tmp_path / "v.safetensors", dcp_size=2, kv_groups=GROUPS)
    rec.observe(step=0, **base, group_seq_lens=gl, verify_row_lens=[3, 4, 5])
    (f,) = replay(open_dumps(rec.close()), "torch").findings
    assert f.detail == {"problem": "verify", "token": 0, "after_shard": True} and (f.recorded, f.expected) == (3, 4)
    assert "= local(seq_len 10) - 2: the causal offset taken after the shard mapping; it must be local(seq_len - 2)" \
        in f.message


def test_a_dump_without_the_columns_has_nothing_to_check(tmp_path):
    rec = Recorder(tmp_path / "n.safetensors", dcp_size=2)
    rec.observe(step=0, site="s", rank=0, seq_lens=[9, 5], num_reqs=2, num_reqs_padded=2, dcp_local_seq_lens=[5, 3])
    res = replay(open_dumps(rec.close()), "torch")
    assert res.findings == [] and "group-lens" not in res.skipped
