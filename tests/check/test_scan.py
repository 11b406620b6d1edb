"""The chunked row scan == the torch reference on seeded random dumps (CPU path and the Triton kernel)."""

import numpy as np
import pytest
import torch
from conftest import random_dump

from dcptool.check import scan as scan_mod
from dcptool.dcp import cuda as cuda_mod
from dcptool.dcp.reference import check_rows
from dcptool.dump import open_dumps


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


# --------------------------------------------------------------------------------------------
# The GPU path's pipelined transfer (issue 16 item 3): chunks of whole observations, double-buffered staging
# (staging.Chunks). On the GPU the slots are pinned and copied by the CUDA driver (scan_cuda); under the
# interpreter they are ordinary buffers (scan._Interpreted), driven here as _gpu drives them.

CHUNKS = [0, 1, 127, 128, 129, 1000, 5000]


def _walk(run, n_chunks):
    """Drive an _Interpreted as _gpu does (load k+1 before using k) and return each chunk's buffers."""
    out = []
    if n_chunks:
        run.load(0)
    for k in range(n_chunks):
        if k + 1 < n_chunks:
            run.load(k + 1)
        out.append({key: run.host[k % 2][key][:n].copy() for key, n in run.n[k % 2].items()})
    run.close()
    return out


@pytest.mark.parametrize("target", CHUNKS)
def test_staging_hands_out_every_chunk_whole_and_in_order(tmp_path, monkeypatch, target):
    """Chunks cut only between observations (a target smaller than an observation still takes it whole),
    cover every row once, and chunk k's buffers are intact after chunk k+1 was loaded into the other slot;
    staging copies split across threads (pieces of 7 elements here) land where they belong."""
    from dcptool.check import staging

    monkeypatch.setattr(staging, "PIECE", 7)
    d = random_dump(tmp_path / "d.safetensors", np.random.default_rng(3), 80, 4, 2)
    rows, drows = d["obs.rows"], d["obs.dcp_rows"]
    b = scan_mod.bounds(rows, target)
    chunks = list(zip(b[:-1].tolist(), b[1:].tolist()))
    got = _walk(scan_mod._Interpreted(staging.Chunks(d, chunks), 4, 2, 16), len(chunks))
    assert [c[0] for c in chunks] == [0] + [c[1] for c in chunks[:-1]] and chunks[-1][1] == d.n
    if 1 <= target < 128:
        assert len(chunks) > 40  # nearly one observation a chunk: the slots are reused many times
    for (lo, hi), g in zip(chunks, got):
        assert np.array_equal(g["seq"], d["rows.seq_lens"][rows[lo] : rows[hi]])
        assert np.array_equal(g["dcp"], d["rows.dcp_local_seq_lens"][drows[lo] : drows[hi]])
        assert np.array_equal(g["kv"], d["rows.kv_pages"][rows[lo] : rows[hi]])
        assert np.array_equal(g["rows"], rows[lo : hi + 1] - rows[lo])
        assert np.array_equal(g["drows"], drows[lo : hi + 1] - drows[lo])
        for key, col in (("nr", "obs.num_reqs"), ("nrp", "obs.num_reqs_padded"), ("rank", "obs.rank")):
            assert np.array_equal(g[key], d[col][lo:hi])
    assert sum(g["seq"].size for g in got) == rows[-1]


@pytest.mark.kernel
@pytest.mark.parametrize("target", CHUNKS)
def test_triton_scan_in_chunks_equals_reference(tmp_path, monkeypatch, target):
    monkeypatch.setattr(scan_mod, "GPU_CHUNK_ROWS", target)
    d = random_dump(tmp_path / "d.safetensors", np.random.default_rng(11), 60, 4, 16)
    want_obs, want = reference_stats(d)
    got_obs, got = as_array(scan_mod.scan(d, "triton"))
    assert np.array_equal(got_obs, want_obs) and np.array_equal(got, want) and want_obs.size


@pytest.mark.kernel
@pytest.mark.parametrize("n", [0, 1, 5])
def test_triton_scan_of_empty_dumps(tmp_path, monkeypatch, n):
    """No observations, or observations of no rows at all: no chunk to stage, or chunks of nothing."""
    from dcptool.dump import DumpConfig, write_dump

    monkeypatch.setattr(scan_mod, "GPU_CHUNK_ROWS", 1)
    z = np.zeros(n, np.int32)
    cols = {"obs.step": np.arange(n, dtype=np.int64), "obs.site": z, "obs.rank": z, "obs.ubatch": z - 1,
            "obs.num_reqs": z, "obs.num_reqs_padded": z, "obs.rows": np.zeros(n + 1, np.int64),
            "rows.seq_lens": np.zeros(0, np.int32), "obs.has_dcp": np.ones(n, np.uint8),
            "obs.dcp_rows": np.zeros(n + 1, np.int64), "rows.dcp_local_seq_lens": np.zeros(0, np.int32)}
    write_dump(tmp_path / "e.safetensors", DumpConfig(dcp_size=2, sites=("x",)), cols)
    d = open_dumps([str(tmp_path / "e.safetensors")])
    for backend in ("triton", "torch"):
        assert scan_mod.scan(d, backend).obs.size == 0


@pytest.mark.kernel
def test_triton_scan_of_rollover_files_read_lazily(tmp_path, monkeypatch):
    """Several files merged lazily (rows gathered from the files per chunk): the staged chunks are those rows."""
    from conftest import rollover_files as _rollover

    monkeypatch.setattr(scan_mod, "GPU_CHUNK_ROWS", 700)
    paths = _rollover(tmp_path, np.random.default_rng(2), n=80, files=3, sorted_steps=False)
    lazy = open_dumps(paths, bounded=True)
    want_obs, want = reference_stats(open_dumps(paths, bounded=False))
    got_obs, got = as_array(scan_mod.scan(lazy, "triton", bounded=True))
    assert lazy.bounded and np.array_equal(got_obs, want_obs) and np.array_equal(got, want) and want_obs.size


def test_auto_picks_the_cpu_below_the_measured_crossover(monkeypatch):
    from dcptool.check.replay import resolve_backend

    monkeypatch.setattr(cuda_mod, "available", lambda: True)
    assert resolve_backend("auto", scan_mod.GPU_MIN_OBS - 1) == ("torch", "cpu")
    assert resolve_backend("auto", scan_mod.GPU_MIN_OBS) == ("triton", "cuda")
    assert resolve_backend("auto") == ("triton", "cuda")  # size unknown: the GPU, as before
    assert resolve_backend("triton", 10) == ("triton", "cuda")  # asked for by name: always honoured
    monkeypatch.setattr(cuda_mod, "available", lambda: False)
    assert resolve_backend("auto", 10**9) == ("torch", "cpu")
    assert resolve_backend("triton", 10) == ("triton", "cpu (Triton interpreter)")


def test_below_the_crossover_auto_never_asks_the_driver(monkeypatch):
    """A small dump's replay does not pay libcuda's start-up (nor torch's import) to learn it will not use it."""
    from dcptool.check.replay import resolve_backend

    def asked():
        raise AssertionError("the driver was asked")

    monkeypatch.setattr(cuda_mod, "available", asked)
    assert resolve_backend("auto", scan_mod.GPU_MIN_OBS - 1) == ("torch", "cpu")
    assert resolve_backend("torch", 10**9) == ("torch", "cpu")
    with pytest.raises(AssertionError, match="asked"):
        resolve_backend("auto", scan_mod.GPU_MIN_OBS)


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_scan_of_rollover_files_read_lazily(tmp_path, monkeypatch, threads):
    """The CPU scan over lazily merged files (interleaved; few files mapped at once; two threads sharing them)."""
    from conftest import rollover_files as _rollover

    from dcptool.dump import lazy

    monkeypatch.setattr(scan_mod, "CHUNK_ROWS", 900)
    monkeypatch.setattr(lazy, "_max_open_files", lambda: 2)
    paths = _rollover(tmp_path, np.random.default_rng(6), n=150, files=5, sorted_steps=False)
    want_obs, want = reference_stats(open_dumps(paths, bounded=False))
    got_obs, got = as_array(scan_mod.scan(open_dumps(paths, bounded=True), "torch", bounded=True, threads=threads))
    assert np.array_equal(got_obs, want_obs) and np.array_equal(got, want) and want_obs.size


# --- scan(pairs=): rank-agree's row comparison on the scan's read of the rows ------------------------------

def _pair_dump(path, rng, n=240):
    """Observations whose seq_lens rows repeat (a few templates of awkward lengths, some cut short or with one
    row changed), and pairs pointing back, forward, at themselves or nowhere: -> (dump, pairs, want)."""
    from dcptool.dump import DumpConfig, write_dump

    tmpl = [rng.integers(0, 9, k).astype(np.int32) for k in (0, 1, 127, 128, 129, 300, 1031)]
    pick = rng.integers(0, len(tmpl), n)
    seqs = [tmpl[k].copy() for k in pick]
    for s in seqs:
        if s.size and rng.random() < 0.15:
            s[rng.integers(0, s.size)] += 1
        elif s.size and rng.random() < 0.05:
            s.resize(s.size - 1, refcheck=False)
    lens = np.array([s.size for s in seqs], np.int64)
    rows = np.zeros(n + 1, np.int64)
    rows[1:] = np.cumsum(lens)
    z = np.zeros(n, np.int32)
    cols = {"obs.step": np.arange(n, dtype=np.int64), "obs.site": z, "obs.rank": (np.arange(n) % 4).astype(np.int32),
            "obs.ubatch": z - 1, "obs.num_reqs": lens.astype(np.int32), "obs.num_reqs_padded": lens.astype(np.int32),
            "obs.rows": rows, "obs.has_dcp": z.astype(np.uint8), "obs.dcp_rows": np.zeros(n + 1, np.int64),
            "rows.seq_lens": np.concatenate(seqs), "rows.dcp_local_seq_lens": np.zeros(0, np.int32)}
    write_dump(path, DumpConfig(dcp_size=4, cp_interleave=1, sites=("x",)), cols)
    # the pair with the same template mostly (an earlier one, else a later one), sometimes any or none
    pairs = np.full(n, -1, np.int64)
    for i in range(n):
        same = np.flatnonzero(pick == pick[i])
        r = rng.random()
        pairs[i] = (same[same < i][-1] if (same < i).any() and r < 0.6 else same[-1] if r < 0.8
                    else rng.integers(0, n) if r < 0.9 else i if r < 0.95 else -1)
    want = np.array([p >= 0 and not np.array_equal(seqs[i], seqs[p]) for i, p in enumerate(pairs)])
    return open_dumps([str(path)]), pairs, np.flatnonzero(want)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("target", [1, 127, 128, 129, 1000, 1 << 18])
def test_cpu_scan_compares_pairs_exactly_at_any_chunking(tmp_path, monkeypatch, seed, target):
    """Equal rows, one row changed, one row short, pairs inside the chunk, before it, after it, itself, none."""
    monkeypatch.setattr(scan_mod, "CHUNK_ROWS", target)
    d, pairs, want = _pair_dump(tmp_path / "d.safetensors", np.random.default_rng(seed))
    got = scan_mod.scan(d, "torch", pairs=pairs).differ
    assert np.array_equal(got, want) and 0 < want.size < d.n // 2
    assert scan_mod.scan(d, "torch").differ is None  # not asked: nothing compared


def test_cpu_scan_pairs_bounded_and_threaded_agree(tmp_path, monkeypatch):
    monkeypatch.setattr(scan_mod, "CHUNK_ROWS", 500)
    d, pairs, want = _pair_dump(tmp_path / "d.safetensors", np.random.default_rng(9))
    assert np.array_equal(scan_mod.scan(d, "torch", pairs=pairs, threads=2).differ, want)
    b = open_dumps([str(tmp_path / "d.safetensors")], bounded=True)
    assert np.array_equal(scan_mod.scan(b, "torch", pairs=pairs, bounded=True).differ, want)


class _Future:
    """The pairs as replay hands them to the scan: a future (rank_pairs on another thread), counted."""

    def __init__(self, value):
        self.value, self.got = value, 0

    def result(self):
        self.got += 1
        return self.value


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_scan_takes_the_pairs_as_a_future(tmp_path, monkeypatch, threads):
    """A future of the pairs gives the array's answer, asked for once (the first chunk waits for it), with one
    thread or several asking at once."""
    monkeypatch.setattr(scan_mod, "CHUNK_ROWS", 700)
    monkeypatch.setattr(scan_mod, "CHUNK_ROWS_THREADED", 700)
    d, pairs, want = _pair_dump(tmp_path / "d.safetensors", np.random.default_rng(5))
    f = _Future(pairs)
    assert np.array_equal(scan_mod.scan(d, "torch", pairs=f, threads=threads).differ, want) and want.size
    assert f.got == 1


@pytest.mark.kernel
@pytest.mark.parametrize("target", [1, 129, 1000, 1 << 22])
def test_triton_scan_compares_pairs_exactly(tmp_path, monkeypatch, target):
    monkeypatch.setattr(scan_mod, "GPU_CHUNK_ROWS", target)
    d, pairs, want = _pair_dump(tmp_path / "d.safetensors", np.random.default_rng(4), n=120)
    assert np.array_equal(scan_mod.scan(d, "triton", pairs=pairs).differ, want) and want.size
    # the pairs known only after the first chunks (the rest compared after the scan)
    assert np.array_equal(scan_mod.scan(d, "triton", pairs=_Future(pairs)).differ, want)


def _streamed_scan_agrees(tmp_path, monkeypatch, backend: str) -> None:
    """scan of a streamed read (the rows still coming in pieces while the chunks go) against one read."""
    import dcptool.dump as dump_mod
    from dcptool.dump import stream

    monkeypatch.setattr(stream, "STREAM_PIECE", 1024)
    path = tmp_path / "r.safetensors"
    d = random_dump(path, np.random.default_rng(11), 200, 4, 16)
    prev = np.arange(d.n) - 1
    want = scan_mod.scan(d, backend, pairs=prev)
    s = dump_mod.read_dump(path, stream=True)
    got = scan_mod.scan(s, backend, pairs=prev)
    s.finish()
    assert all(np.array_equal(x, y) for x, y in zip(as_array(got), as_array(want))) and want.obs.size
    assert np.array_equal(got.differ, want.differ)


@pytest.mark.kernel
def test_triton_scan_of_a_streamed_read(tmp_path, monkeypatch):
    monkeypatch.setattr(scan_mod, "GPU_CHUNK_ROWS", 700)
    _streamed_scan_agrees(tmp_path, monkeypatch, "triton")


@pytest.mark.skipif(not cuda_mod.available(), reason="needs a CUDA GPU")
def test_cuda_scan_of_a_streamed_read(tmp_path, monkeypatch):
    monkeypatch.setattr(scan_mod, "GPU_CHUNK_ROWS", 700)
    _streamed_scan_agrees(tmp_path, monkeypatch, "triton")


@pytest.mark.parametrize("cores,bounded,want", [(1, False, 1), (2, False, 1), (3, False, 1), (4, False, 2),
                                                (16, False, 4), (16, True, 1), (None, False, 1)])
def test_default_threads_leave_replays_checks_a_core(monkeypatch, cores, bounded, want):
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    assert scan_mod.default_threads(bounded) == want


def test_cpu_scan_default_threads_agree(tmp_path, monkeypatch):
    """The default on a many-core host (4 threads, big chunks) gives one thread's answer: the findings of a
    random dump with wrong views, and the pairs' comparison."""
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    monkeypatch.setattr(scan_mod, "CHUNK_ROWS_THREADED", 700)
    d = random_dump(tmp_path / "r.safetensors", np.random.default_rng(3), 300, 4, 16)
    prev = np.arange(d.n) - 1
    many, one = scan_mod.scan(d, "torch", pairs=prev), scan_mod.scan(d, "torch", pairs=prev, threads=1)
    assert all(np.array_equal(x, y) for x, y in zip(as_array(many), as_array(one))) and many.obs.size
    assert np.array_equal(many.differ, one.differ) and many.differ.size
    d, pairs, want = _pair_dump(tmp_path / "d.safetensors", np.random.default_rng(2))
    assert np.array_equal(scan_mod.scan(d, "torch", pairs=pairs).differ, want)
