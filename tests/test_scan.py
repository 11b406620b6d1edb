"""The chunked row scan == the torch reference on seeded random dumps (CPU path and the Triton kernel)."""

import numpy as np
import pytest
import torch
from conftest import random_dump

from dcptool import scan as scan_mod
from dcptool.dump import open_dumps
from dcptool.reference import check_rows


def reference_stats(d):
    t = lambda k: torch.from_numpy(np.ascontiguousarray(d[k]))  # noqa: E731
    kv = t("rows.kv_pages") if d.has("rows.kv_pages") else None
    st = check_rows(t("rows.seq_lens"), t("obs.rows"), t("rows.dcp_local_seq_lens"), t("obs.dcp_rows"),
                    t("obs.num_reqs"), t("obs.num_reqs_padded"), t("obs.rank"), d.config.dcp_size,
                    d.config.cp_interleave, kv_pages=kv, page_size=d.config.page_size or 1)
    st = st.stacked().numpy().astype(np.int64)
    if d.config.dcp_size == 1:
        st[0:4] = [[0], [-1], [0], [-1]]
    hit = np.flatnonzero((st[0] > 0) | (st[2] > 0) | (st[4] > 0))
    return hit, st[:, hit]


def as_array(s):
    return s.obs, np.stack([s.n_wrong, s.first_wrong, s.n_pad, s.first_pad, s.n_pages, s.first_pages])


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("N,I,one_rank", [(2, 1, False), (4, 16, True), (3, 5, False), (1, 1, False)])
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_scan_equals_reference(tmp_path, monkeypatch, seed, N, I, one_rank, threads):
    monkeypatch.setattr(scan_mod, "CHUNK_ROWS", 1000)  # many chunks, observations straddling none
    d = random_dump(tmp_path / "d.safetensors", np.random.default_rng(seed), 150, N, I, one_rank=one_rank)
    want_obs, want = reference_stats(d)
    got_obs, got = as_array(scan_mod.scan(d, "torch", threads=threads))
    assert np.array_equal(got_obs, want_obs) and np.array_equal(got, want)
    assert want_obs.size > 0  # the planted errors are there to be found


def test_bounded_scan_drops_pages_and_agrees(tmp_path, monkeypatch):
    monkeypatch.setattr(scan_mod, "CHUNK_ROWS", 4096)
    d = random_dump(tmp_path / "d.safetensors", np.random.default_rng(7), 400, 2, 1)
    a = as_array(scan_mod.scan(d, "torch", bounded=True))
    b = as_array(scan_mod.scan(open_dumps([str(tmp_path / "d.safetensors")]), "torch"))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.kernel
@pytest.mark.parametrize("N,I", [(2, 1), (4, 16)])
def test_triton_scan_equals_reference(tmp_path, N, I):
    d = random_dump(tmp_path / "d.safetensors", np.random.default_rng(11), 60, N, I)
    want_obs, want = reference_stats(d)
    got_obs, got = as_array(scan_mod.scan(d, "triton"))
    assert np.array_equal(got_obs, want_obs) and np.array_equal(got, want)


def test_bounds_cover_everything_once():
    rows = np.array([0, 5, 5, 300, 301, 900, 901])
    b = scan_mod.bounds(rows, 100)
    assert b[0] == 0 and b[-1] == 6 and (np.diff(b) > 0).all()
    assert scan_mod.bounds(np.array([0]), 100).tolist() == [0]
