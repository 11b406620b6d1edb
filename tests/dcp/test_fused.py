"""fused.py: the fused whole-dump kernels' launchers == the torch reference (interpreter on CPU, real on CUDA), at the
int32 extremes too, and replay's backends agreeing end to end."""

import numpy as np
import pytest
import torch
from conftest import EXTREME_SEQ, I32, ROOT, random_columns

from dcptool.dcp import fused, reference

pytestmark = pytest.mark.kernel


def _random_dump(rng, n_obs, N, I):
    """The shared builder's columns, as check_rows takes them."""
    c = random_columns(rng, n_obs, N, I, kv=False)
    return tuple(c[k] for k in ("rows.seq_lens", "obs.rows", "rows.dcp_local_seq_lens", "obs.dcp_rows", "obs.num_reqs",
                                "obs.num_reqs_padded", "obs.rank"))


@pytest.mark.parametrize("n_obs", [1, 7, 60])
@pytest.mark.parametrize("N,I", [(2, 1), (4, 16), (8, 2)])
def test_fused_kernels_match_reference(dev, n_obs, N, I):
    rng = np.random.default_rng(n_obs * 13 + N)
    seq, rows, dcp, drows, nreq, nrp, ranks = _random_dump(rng, n_obs, N, I)
    t = [torch.from_numpy(x) for x in (seq, rows, dcp, drows, nreq, nrp, ranks)]
    ref = reference.check_rows(*t, N, I).stacked()
    got = fused.check_rows(*[x.to(dev) for x in t], N, I).stacked().cpu()
    assert torch.equal(got, ref)
    assert int(ref[0].sum() + ref[2].sum()) > 0 or n_obs == 1  # the planted errors are seen
    exp_ref = reference.expected_rows(t[0], t[1], t[4], t[6], N, I)
    exp = fused.expected_rows(t[0].to(dev), t[1].to(dev), t[4].to(dev), t[6].to(dev), N, I).cpu()
    assert torch.equal(exp, exp_ref)


def test_check_rows_reports_first_wrong_row(dev):
    seq = torch.tensor([17, 25, 0, 0], dtype=torch.int32)
    rows = torch.tensor([0, 4])
    dcp = torch.tensor([9, 12, 0, -1], dtype=torch.int32)  # row 1 wrong (13), padded row 3 = -1
    kv = torch.tensor([1, 2, 0, 0], dtype=torch.int32)  # pages of 8: 9 -> 2 (row 0 claims 1), 13 -> 2
    args = (seq, rows, dcp, torch.tensor([0, 4]), torch.tensor([2]), torch.tensor([4]), torch.tensor([0]), 2, 1)
    want = [[1], [1], [1], [3], [1], [0]]
    assert reference.check_rows(*args, kv_pages=kv, page_size=8).stacked().tolist() == want
    got = fused.check_rows(*[a.to(dev) if isinstance(a, torch.Tensor) else a for a in args], kv_pages=kv.to(dev),
                            page_size=8)
    assert got.stacked().tolist() == want
    with pytest.raises(ValueError, match="device"):
        fused.check_rows(*args[:6], torch.tensor([0], device="meta"), 2, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_backend_uses_triton_on_cuda():
    from dcptool.check.replay import resolve_backend

    assert resolve_backend("auto") == ("triton", "cuda")


# --------------------------------------------------------------------------------------------
# Extremes of the int32 range the reader accepts: the backends must agree.


def _extreme_case(N: int, I: int, page: int):
    """One observation per rank holding every extreme seq_len; views and page counts exactly right,
    so any finding is a false one; plus a copy with the last row of each view off by one."""
    seq = np.array(EXTREME_SEQ + [N * I - 1, N * I, min(N * I + 1, I32), (I32 // (N * I)) * N * I], np.int64)
    seq = np.unique(np.clip(seq, 0, I32)).astype(np.int32)
    ranks = np.unique([0, 1 % N, N // 2, N - 1]).astype(np.int32)
    n, m = 2 * ranks.size, seq.size
    rows = np.arange(n + 1, dtype=np.int64) * m
    exp = np.concatenate([reference.dcp_local_seq_lens(torch.from_numpy(seq), N, int(r), I).numpy()
                          for r in ranks] * 2)
    dcp = exp.copy()
    dcp[ranks.size * m + m - 1 :: m] += 1  # the second half: one wrong last row each
    local = exp.astype(np.int64)
    kv = (local // page + (local % page != 0)).astype(np.int32)
    return dict(seq_lens=np.tile(seq, n), rows=rows, dcp=dcp.astype(np.int32), dcp_rows=rows,
                num_reqs=np.full(n, m, np.int32), num_reqs_padded=np.full(n, m, np.int32),
                ranks=np.tile(ranks, 2), kv_pages=kv)


@pytest.mark.parametrize("N,I", [(1, 1), (2, 1), (3, 7), (8, 2**20), (1, 2**30), (2**15, 2**16 - 1), (I32, 1),
                                 (1, I32), (46340, 46340)])
@pytest.mark.parametrize("page", [1, 16, 2**30, I32])
def test_backends_agree_at_int32_extremes(dev, N, I, page):
    c = _extreme_case(N, I, page)
    t = {k: torch.from_numpy(v) for k, v in c.items()}
    args = (t["seq_lens"], t["rows"], t["dcp"], t["dcp_rows"], t["num_reqs"], t["num_reqs_padded"], t["ranks"])
    want = reference.check_rows(*args, N, I, kv_pages=t["kv_pages"], page_size=page)
    got = fused.check_rows(*(a.to(dev) for a in args), N, I, kv_pages=t["kv_pages"].to(dev), page_size=page)
    assert torch.equal(got.stacked().cpu(), want.stacked())
    half = c["num_reqs"].size // 2
    assert (want.n_wrong[:half] == 0).all() and (want.n_wrong[half:] == 1).all()  # the planted wrong rows, nothing else
    assert (want.n_pages == 0).all()  # page counts are right: no `pages` finding on either backend
    exp = fused.expected_rows(t["seq_lens"].to(dev), t["rows"].to(dev), t["num_reqs"].to(dev), t["ranks"].to(dev),
                               N, I)
    assert torch.equal(exp.cpu(), reference.expected_rows(t["seq_lens"], t["rows"], t["num_reqs"], t["ranks"], N, I))


def test_issue_example_dcp1_page16_seq_max_is_clean_on_triton(dev):
    """dcp_size 1, page_size 16, seq_len 2**31-1: `(local + PAGE - 1) // PAGE` wrapped to a negative count."""
    one = lambda *v, dt=torch.int32: torch.tensor(v, dtype=dt, device=dev)  # noqa: E731
    stats = fused.check_rows(one(I32), one(0, 1, dt=torch.int64), one(I32), one(0, 1, dt=torch.int64), one(1),
                              one(1), one(0), 1, 1, kv_pages=one(2**27), page_size=16)
    assert stats.n_pages.tolist() == [0]


def test_fused_kernels_refuse_layouts_past_int32(dev):
    z = torch.zeros(1, dtype=torch.int32, device=dev)
    o = torch.zeros(2, dtype=torch.int64, device=dev)
    with pytest.raises(ValueError, match="2\\*\\*31"):
        fused.check_rows(z, o, z, o, z, z, z, 65536, 65536)
    with pytest.raises(ValueError, match="2\\*\\*31"):
        fused.expected_rows(z, o, z, z, 65536, 65536)


@pytest.mark.parametrize("N,I,page", [(1, 1, 16), (2, 1, 16), (8, 2**20, 1), (4, 16, 2**30)])
def test_replay_backends_agree_on_a_dump_at_the_extremes(tmp_path, N, I, page):
    """End to end, the issue's case first: dcp_size 1, page_size 16, seq_len 2**31-1 gave a false `pages`
    finding on Triton only. Right views and page counts: both backends clean; one planted wrong page count
    and one wrong view row: both find exactly those."""
    from dcptool.check.replay import replay
    from dcptool.dump import DumpConfig, Observation, open_dumps, write_observations

    seq = np.array([I32, I32 - 1, 2**30, 1, 0], np.int32)
    o = []
    for r in sorted({0, N - 1}):
        local = reference.dcp_local_seq_lens(torch.from_numpy(seq), N, r, I).numpy().astype(np.int64)
        kv = (local // page + (local % page != 0)).astype(np.int32)
        o.append(Observation(step=r, site="attn", rank=r, num_reqs=5, num_reqs_padded=5, seq_lens=seq,
                             dcp_local_seq_lens=local.astype(np.int32) if N > 1 else None, kv_pages=kv))
    write_observations(tmp_path / "ok.safetensors", o, DumpConfig(dcp_size=N, cp_interleave=I, page_size=page))
    o[-1].kv_pages = o[-1].kv_pages.copy()
    o[-1].kv_pages[0] += 1
    if N > 1:
        o[-1].dcp_local_seq_lens = o[-1].dcp_local_seq_lens.copy()
        o[-1].dcp_local_seq_lens[1] -= 1
    write_observations(tmp_path / "bad.safetensors", o, DumpConfig(dcp_size=N, cp_interleave=I, page_size=page))
    value = ("mismatch", "wrong-rank", "global", "wrong-interleave", "stale")  # provenance may explain the row
    for name, want in (("ok", []), ("bad", [("pages", 0)] + ([("value", 1)] if N > 1 else []))):
        d = open_dumps([tmp_path / f"{name}.safetensors"])
        got = {b: sorted(("value" if f.rule in value else f.rule, f.row) for f in replay(d, b).findings)
               for b in ("torch", "triton")}
        assert got["torch"] == got["triton"] == sorted(want), (name, got)


@pytest.mark.kernel
def test_replay_backends_agree_on_the_legacy_sample():
    """Every fault of the old ordering, provenance included: the Triton path (which builds provenance's keys
    while the scan runs) names the same findings, sources and all, as the CPU path."""
    from dcptool.check.replay import replay
    from dcptool.dump import open_dumps

    sample = ROOT / "samples" / "legacy.safetensors"
    got = {b: [f.to_json() for f in replay(open_dumps([sample]), b).findings] for b in ("torch", "triton")}
    assert got["torch"] == got["triton"] and any(f.get("source") for f in got["torch"])
