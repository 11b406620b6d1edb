"""The chunked row scan == the torch reference on seeded random dumps (CPU path and the Triton kernel)."""

import numpy as np
import pytest
from conftest import random_dump
from scan_cases import Future, as_array, pair_dump, reference_stats

from dcptool.check import scan as scan_mod
from dcptool.dump import open_dumps
from dcptool.gpu import cuda as cuda_mod


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
    monkeypatch.setattr(lazy, "max_open_files", lambda: 2)
    paths = _rollover(tmp_path, np.random.default_rng(6), n=150, files=5, sorted_steps=False)
    want_obs, want = reference_stats(open_dumps(paths, bounded=False))
    got_obs, got = as_array(scan_mod.scan(open_dumps(paths, bounded=True), "torch", bounded=True, threads=threads))
    assert np.array_equal(got_obs, want_obs) and np.array_equal(got, want) and want_obs.size


# --- scan(pairs=): rank-agree's row comparison on the scan's read of the rows ------------------------------


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("target", [1, 127, 128, 129, 1000, 1 << 18])
def test_cpu_scan_compares_pairs_exactly_at_any_chunking(tmp_path, monkeypatch, seed, target):
    """Equal rows, one row changed, one row short, pairs inside the chunk, before it, after it, itself, none."""
    monkeypatch.setattr(scan_mod, "CHUNK_ROWS", target)
    d, pairs, want = pair_dump(tmp_path / "d.safetensors", np.random.default_rng(seed))
    got = scan_mod.scan(d, "torch", pairs=pairs).differ
    assert np.array_equal(got, want) and 0 < want.size < d.n // 2
    assert scan_mod.scan(d, "torch").differ is None  # not asked: nothing compared


def test_cpu_scan_pairs_bounded_and_threaded_agree(tmp_path, monkeypatch):
    monkeypatch.setattr(scan_mod, "CHUNK_ROWS", 500)
    d, pairs, want = pair_dump(tmp_path / "d.safetensors", np.random.default_rng(9))
    assert np.array_equal(scan_mod.scan(d, "torch", pairs=pairs, threads=2).differ, want)
    b = open_dumps([str(tmp_path / "d.safetensors")], bounded=True)
    assert np.array_equal(scan_mod.scan(b, "torch", pairs=pairs, bounded=True).differ, want)


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_scan_takes_the_pairs_as_a_future(tmp_path, monkeypatch, threads):
    """A future of the pairs gives the array's answer, asked for once (the first chunk waits for it), with one
    thread or several asking at once."""
    monkeypatch.setattr(scan_mod, "CHUNK_ROWS", 700)
    monkeypatch.setattr(scan_mod, "CHUNK_ROWS_THREADED", 700)
    d, pairs, want = pair_dump(tmp_path / "d.safetensors", np.random.default_rng(5))
    f = Future(pairs)
    assert np.array_equal(scan_mod.scan(d, "torch", pairs=f, threads=threads).differ, want) and want.size
    assert f.got == 1


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
    d, pairs, want = pair_dump(tmp_path / "d.safetensors", np.random.default_rng(2))
    assert np.array_equal(scan_mod.scan(d, "torch", pairs=pairs).differ, want)


@pytest.mark.parametrize("run_rows", [1, 200, 1 << 16])
@pytest.mark.parametrize("read", ["memory", "stream", "bounded"])
def test_cpu_scan_compares_pairs_across_rank_files(tmp_path, monkeypatch, run_rows, read):
    """Rank files end to end: each observation's pair is the one of the rank before, in another file. Compared in
    the chunk against the column in memory (runs of one shift as two slices from RUN_ROWS rows on), or after the
    scan in a bounded read; exactly, at any chunking."""
    from scan_cases import rank_pair_files

    monkeypatch.setattr(scan_mod, "CHUNK_ROWS", 700)
    monkeypatch.setattr(scan_mod, "RUN_ROWS", run_rows)
    paths, pairs, want = rank_pair_files(tmp_path, np.random.default_rng(run_rows))
    d = open_dumps(paths, bounded=read == "bounded", stream=read == "stream")
    got = scan_mod.scan(d, "torch", pairs=pairs, bounded=d.bounded).differ
    d.finish()
    assert np.array_equal(got, want) and 0 < want.size < d.n // 2


@pytest.mark.parametrize("bulk", [1, 300])
def test_cpu_scan_checks_irregular_views_in_blocks(tmp_path, monkeypatch, bulk):
    """Views of another length than their batch are checked BULK_ROWS rows at a time: the same statistics."""
    d = random_dump(tmp_path / "d.safetensors", np.random.default_rng(11), 120, 4, 2)
    want_obs, want = reference_stats(d)
    monkeypatch.setattr(scan_mod, "BULK_ROWS", bulk)
    got_obs, got = as_array(scan_mod.scan(d, "torch"))
    assert np.array_equal(got_obs, want_obs) and np.array_equal(got, want) and want_obs.size
