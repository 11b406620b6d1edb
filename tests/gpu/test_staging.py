"""gpu/staging.py: the GPU scan's chunks, staged whole (the sizes cover every chunk; threaded copies land
where they belong; the pairs' shifts are cut per chunk)."""

import numpy as np
import pytest
from conftest import random_dump

from dcptool.dcp.segments import obs_chunks
from dcptool.gpu import staging


class _Pairs:
    def __init__(self, shift):
        self.shift, self.cuts = shift, []

    def cut(self, lo, hi):
        self.cuts.append((lo, hi))
        return self.shift[lo:hi]


@pytest.mark.parametrize("target", [0, 1, 127, 128, 129, 1000, 1 << 22])
@pytest.mark.parametrize("piece", [7, staging.PIECE])
def test_every_chunk_fits_its_buffers_and_is_copied_exactly(tmp_path, monkeypatch, target, piece):
    monkeypatch.setattr(staging, "PIECE", piece)
    d = random_dump(tmp_path / "d.safetensors", np.random.default_rng(2), 90, 4, 2)
    rows = d["obs.rows"]
    chunks = obs_chunks(np.diff(rows), target)
    shift = np.arange(d.n, dtype=np.int64)
    c = staging.Chunks(d, chunks, _Pairs(shift))
    host = {k: np.full(n, -7, t) for k, (n, t) in c.sizes.items()}
    try:
        for k, (lo, hi) in enumerate(chunks):
            n = c.fill(k, host)
            assert n["nr"] == hi - lo and n["rows"] == hi - lo + 1 and n["seq"] == rows[hi] - rows[lo]
            assert all(n[key] <= c.sizes[key][0] for key in n)
            assert np.array_equal(host["seq"][: n["seq"]], d["rows.seq_lens"][rows[lo] : rows[hi]])
            assert np.array_equal(host["shift"][: n["shift"]], shift[lo:hi])
            assert host["rows"].dtype == np.int64 and host["seq"].dtype == np.int32
    finally:
        c.close()
    assert c.pairs.cuts == chunks
    assert c.most_obs == max(hi - lo for lo, hi in chunks)


def test_no_pairs_no_shift_column_and_no_kv_without_page_counts(tmp_path):
    from dcptool.dump import open_dumps

    d = random_dump(tmp_path / "d.safetensors", np.random.default_rng(2), 20, 2, 1)
    assert "shift" not in staging.Chunks(d, [(0, d.n)]).sizes
    assert "kv" in staging.Chunks(d, [(0, d.n)]).sizes
    cols = {k: d[k] for k in d.columns if k != "rows.kv_pages"}
    from dcptool.dump import write_dump

    write_dump(tmp_path / "e.safetensors", d.config, cols)
    e = open_dumps([str(tmp_path / "e.safetensors")])
    assert "kv" not in staging.Chunks(e, [(0, e.n)]).sizes
