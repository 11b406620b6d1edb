"""The Recorder of DESIGN §5: private copies, never raising into the engine, rollover, same columns as pack()."""

import os
import warnings

import numpy as np
import pytest
import torch
from conftest import obs

from dcptool.dump import DumpConfig, open_dumps, pack, read_dump
from dcptool.engine.record import Recorder


def test_copies_at_once_and_round_trips(tmp_path):
    seq = torch.tensor([17, 25, 0, 0], dtype=torch.int32)
    view = torch.tensor([9, 13, 0, 0], dtype=torch.int32)
    with Recorder(tmp_path / "r.safetensors", dcp_size=2) as rec:
        i = rec.observe(step=0, site="attn_metadata", rank=0, seq_lens=seq, num_reqs=2, num_reqs_padded=4,
                        dcp_local_seq_lens=view, query_start_loc=[0, 1, 2, 2, 2])
        seq += 100  # the engine reuses its buffers: what was recorded must not move with them
        view.fill_(-1)
        j = rec.observe(step=1, site="dummy", rank=1, seq_lens=np.array([8]), num_reqs=1, num_reqs_padded=1,
                        dcp_local_seq_lens=None, parent=i)
    assert (i, j) == (0, 1)
    d = read_dump(tmp_path / "r.safetensors")
    assert d.seq_lens_of(0).tolist() == [17, 25, 0, 0] and d.dcp_of(0).tolist() == [9, 13, 0, 0]
    assert d.dcp_of(1) is None and d["obs.parent"].tolist() == [-1, 0]
    assert d.config.sites == ("attn_metadata", "dummy") and d["obs.buffer"][0] != 0  # storage identity recorded


def test_bad_values_are_dropped_not_raised(tmp_path):
    rec = Recorder(tmp_path / "r.safetensors", dcp_size=2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert rec.observe(step=0, site="x", rank=0, seq_lens=[1, 2], num_reqs=3, num_reqs_padded=2) == -1
        assert rec.observe(step=0, site="x", rank=5, seq_lens=[1], num_reqs=1, num_reqs_padded=1) == -1
        assert rec.observe(step=0, site="x", rank=0, seq_lens=[2**40], num_reqs=1, num_reqs_padded=1) == -1
    assert rec.dropped == 3 and len(w) == 1  # warned once
    assert rec.observe(step=0, site="x", rank=1, seq_lens=[5], num_reqs=1, num_reqs_padded=1) == 0
    rec.close()
    assert read_dump(tmp_path / "r.safetensors").n == 1


def test_rollover_numbers_files_and_rebases_parents(tmp_path):
    with Recorder(tmp_path / "run.safetensors", dcp_size=2, rollover=3) as rec:
        for k in range(7):
            rec.observe(step=k, site="ubatch" if k % 2 else "attn_metadata", rank=0, seq_lens=[k + 1],
                        num_reqs=1, num_reqs_padded=1, dcp_local_seq_lens=[(k + 2) // 2],
                        parent=k - 1 if k % 2 else None)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["run.00000.safetensors", "run.00001.safetensors", "run.00002.safetensors"]
    parents = [read_dump(tmp_path / n).columns.get("obs.parent") for n in names]
    # obs 3's parent (2) is in the first file: unknown (-1); obs 5's parent (4) is in its own file;
    # the last file knows no parent at all, so it has no obs.parent column
    assert [p.tolist() for p in parents[:2]] == [[-1, 0, -1], [-1, -1, 1]] and parents[2] is None
    d = open_dumps([str(tmp_path / n) for n in names])
    assert d.n == 7 and d.config.sites == ("attn_metadata", "ubatch")


def test_refuses_an_earlier_recording_without_force(tmp_path):
    Recorder(tmp_path / "r.safetensors", dcp_size=2).close()
    with pytest.raises(FileExistsError):
        Recorder(tmp_path / "r.safetensors", dcp_size=2)
    Recorder(tmp_path / "r.safetensors", dcp_size=2, force=True).close()


def test_recorder_writes_the_columns_pack_writes(tmp_path):
    """Both writers go through dump.columns(): the same observations, the same columns."""
    o = [obs(step=0), obs(step=1, view=None, ubatch=0, parent=0, req_start=0, tok_start=0, tok_stop=2,
                          query_start_loc=[0, 1, 2, 2, 2], buffer=7, graph=3),
         obs(step=2, site="dummy", kv_pages=[1, 2, 0, 0])]
    _, want = pack(o, DumpConfig(dcp_size=2, page_size=16))
    with Recorder(tmp_path / "r.safetensors", dcp_size=2, page_size=16) as rec:
        for x in o:
            rec.observe(**{k: v for k, v in x.__dict__.items()})
    got = read_dump(tmp_path / "r.safetensors").columns
    assert sorted(got) == sorted(want)
    for k in want:
        assert np.array_equal(got[k], want[k]), k


# --------------------------------------------------------------------------------------------
# No silent loss (issue 12 item 5): one recording per path, threads, scalars that are not integers

CHILD = """
import sys, warnings
import numpy as np
from dcptool.engine.record import Recorder
warnings.simplefilter("always")
r = Recorder(sys.argv[1], 2, force=True)  # as the vLLM plugin: force, an engine is not stopped for old files
for i in range(5):
    r.observe(step=100 + i, site="child", rank=1, seq_lens=np.array([i + 1], np.int32), num_reqs=1, num_reqs_padded=1)
print(r.close()[0])
"""


def test_two_processes_on_one_path_both_keep_their_recording(tmp_path):
    """While this process records to run.safetensors, a second process (force=True, like the vLLM
    plugin) recording to the same path exits 0 as before, but into its own file and with a warning;
    both recordings are complete (today one of them was gone)."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    path = tmp_path / "run.safetensors"
    rec = Recorder(path, dcp_size=2)
    rec.observe(step=0, site="parent", rank=0, seq_lens=[7], num_reqs=1, num_reqs_padded=1)
    p = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    other = tmp_path / p.stdout.strip().rsplit("/", 1)[-1]
    assert other.name.startswith("run.p") and other.name.endswith(".safetensors") and other != path
    assert "is being recorded by another Recorder" in p.stderr and other.name in p.stderr
    assert rec.close() == [path] and rec.path == path
    mine, theirs = read_dump(path), read_dump(other)
    assert mine.n == 1 and mine.config.sites == ("parent",)
    assert theirs.n == 5 and theirs["obs.step"].tolist() == [100, 101, 102, 103, 104]


def test_second_recorder_in_one_process_is_separated_and_the_name_is_free_after_close(tmp_path):
    path = tmp_path / "r.safetensors"
    a = Recorder(path, dcp_size=2)
    with pytest.warns(RuntimeWarning, match="being recorded by another Recorder"):
        b = Recorder(path, dcp_size=2, force=True)
    assert b.path != path and b.requested_path == path and b.path.parent == tmp_path
    a.observe(step=0, site="a", rank=0, seq_lens=[1], num_reqs=1, num_reqs_padded=1)
    b.observe(step=0, site="b", rank=0, seq_lens=[2], num_reqs=1, num_reqs_padded=1)
    b.close()
    a.close()
    assert read_dump(path).config.sites == ("a",) and read_dump(b.path).config.sites == ("b",)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nobody holds the path now: no separation, no warning
        Recorder(path, dcp_size=2, force=True).close()
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted(["r.safetensors", b.path.name])  # no lock files


def test_a_file_someone_else_wrote_is_never_replaced_at_a_write(tmp_path):
    """Checked at every write, not only at construction: a file that appeared at our next target
    (a writer that is no Recorder) stays, and our observations go to a separate name."""
    from dcptool.dump import write_observations

    path = tmp_path / "run.safetensors"
    rec = Recorder(path, dcp_size=2, rollover=2)
    for k in range(2):
        rec.observe(step=k, site="mine", rank=0, seq_lens=[k + 1], num_reqs=1, num_reqs_padded=1)
    assert rec.files == [tmp_path / "run.00000.safetensors"]
    write_observations(tmp_path / "run.00001.safetensors", [obs(step=9, site="theirs")], DumpConfig(dcp_size=2))
    with pytest.warns(RuntimeWarning, match=r"run\.00001\.safetensors was written by another writer"):
        for k in range(2, 5):
            rec.observe(step=k, site="mine", rank=0, seq_lens=[k + 1], num_reqs=1, num_reqs_padded=1)
    files = rec.close()
    assert read_dump(tmp_path / "run.00001.safetensors").config.sites[0] == "theirs"  # untouched
    assert files[0].name == "run.00000.safetensors" and all(f.name.startswith("run.p") for f in files[1:])
    d = open_dumps(files)
    assert d.n == 5 and sorted(d["obs.step"].tolist()) == [0, 1, 2, 3, 4] and rec.write_errors == 0


def test_threads_sharing_one_recorder_with_rollover(tmp_path):
    """4 threads x 20,000 observations, rolling every 1,000: distinct indices, no drop, and the files
    hold exactly what was observed, parents included (today a ValueError reached the engine and
    indices repeated)."""
    import threading

    T, N = 4, 20_000
    rec = Recorder(tmp_path / "t.safetensors", dcp_size=T, rollover=1000)
    got: list[list[int]] = [[] for _ in range(T)]
    start = threading.Barrier(T)

    def work(t: int) -> None:
        start.wait()
        prev = None
        for i in range(N):
            prev = rec.observe(step=t * N + i, site=f"thread{t}", rank=t, seq_lens=np.array([t + 1, i], np.int32),
                               num_reqs=2, num_reqs_padded=2, parent=prev if i % 2 else None)
            got[t].append(prev)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        threads = [threading.Thread(target=work, args=(t,)) for t in range(T)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        files = rec.close()
    idx = np.concatenate([np.array(g) for g in got])
    assert rec.dropped == 0 and np.array_equal(np.sort(idx), np.arange(T * N))
    assert len(files) == T * N // 1000
    d = open_dumps(files)
    assert d.n == T * N
    step, rank = d["obs.step"].astype(np.int64), d["obs.rank"]
    rows = d["rows.seq_lens"].reshape(-1, 2)
    assert np.array_equal(np.sort(step), np.arange(T * N))  # every observation once
    assert np.array_equal(rows[:, 0], rank + 1) and np.array_equal(rows[:, 1], step - rank * N)
    # each file's observation k is global index (file start + k): the index observe() returned for it
    order = np.empty(T * N, np.int64)
    order[idx] = np.concatenate([t * N + np.arange(N) for t in range(T)])
    per_file = [read_dump(f) for f in files]
    assert np.array_equal(np.concatenate([f["obs.step"] for f in per_file]), order)
    start_of = 0
    for f in per_file:  # a parent is the same thread's previous observation, or -1 in an earlier file
        par = f["obs.parent"].astype(np.int64)
        s = f["obs.step"].astype(np.int64)
        has = par >= 0
        assert np.array_equal(s[par[has]], s[has] - 1)
        odd = (s % 2 == 1) & ~has
        assert np.all(idx_of(order, s[odd] - 1) < start_of)  # its parent went to an earlier file
        start_of += f.n


def idx_of(order: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """The global index of the observations with these steps."""
    inv = np.empty_like(order)
    inv[order] = np.arange(order.size)
    return inv[steps]


@pytest.mark.parametrize("bad", [dict(step=1.9), dict(rank="1"), dict(rank=1.0), dict(num_reqs=np.float64(1.0)),
                                 dict(num_reqs_padded=True), dict(ubatch=np.bool_(False)), dict(parent=0.5),
                                 dict(graph=2.0), dict(tok_start="0"), dict(buffer=1.5),
                                 dict(step=torch.tensor(1.0)), dict(num_reqs=torch.tensor([1]))])
def test_scalars_that_are_not_integers_are_dropped_not_coerced(tmp_path, bad):
    rec = Recorder(tmp_path / "r.safetensors", dcp_size=2)
    rec.observe(step=0, site="x", rank=0, seq_lens=[3], num_reqs=1, num_reqs_padded=1)
    kw = dict(step=1, site="x", rank=1, seq_lens=[5], num_reqs=1, num_reqs_padded=1)
    with pytest.warns(RuntimeWarning, match="must be an integer"):
        assert rec.observe(**{**kw, **bad}) == -1
    assert rec.observe_many(**{**{k: v for k, v in kw.items() if k != "rank"}, "ranks": [0, "1"]}) == [-1, -1]
    assert rec.dropped == 3
    rec.close()
    assert read_dump(tmp_path / "r.safetensors")["obs.step"].tolist() == [0]


def test_numpy_and_host_tensor_integers_are_integers(tmp_path):
    """The must-not-trigger side: numpy integer scalars (any width) and 0-d integer host tensors."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Recorder(tmp_path / "r.safetensors", dcp_size=2) as rec:
            i = rec.observe(step=np.int64(2**40), site="x", rank=np.int32(1), seq_lens=[5, 0], num_reqs=np.uint8(1),
                            num_reqs_padded=torch.tensor(2), ubatch=np.int16(-1), graph=np.int8(3))
            rec.observe(step=1, site="x", rank=0, seq_lens=[5], num_reqs=1, num_reqs_padded=1, parent=np.int64(i),
                        tok_start=np.int32(0), buffer=np.uint64(7))
    d = read_dump(tmp_path / "r.safetensors")
    assert rec.dropped == 0 and d["obs.step"].tolist() == [2**40, 1] and d["obs.parent"].tolist() == [-1, 0]
    assert d["obs.rank"].tolist() == [1, 0] and d["obs.graph"].tolist() == [3, 0]


# --------------------------------------------------------------------------------------------
# The device snapshot (issue 13 item 4), on the CPU: the kernel under the Triton interpreter and the
# ring's logic with host tensors standing in for CUDA ones (the CUDA tests below use the real thing)

from dcptool.engine import record as R  # noqa: E402

# The host ring runs the kernel in Triton's interpreter on host memory: not where a GPU compiles it
# (there the CUDA tests below cover the same ground with real launches).
hostring = pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                              reason="interpreter-only (CPU); the CUDA tests cover this on a GPU")


def _kernel_device() -> str:
    return "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _launch_slot(secs: list[tuple], seqno: int = 41, nr: int = 3, nrp: int = 5, pad: int = 64):
    """Write a slot header describing `secs` (tensor or None, negatives flagged) into a ring, launch the
    kernel with the slot's address only, and return the ring's words (numpy) and the slot's words."""
    from dcptool.engine.snapshot import snapshot_dispatch

    ent, words = [], R.FIXED + R.ENTRY * len(secs)
    for t, nonneg in secs:
        if t is None:
            ent += (0, -1, 0)
        else:
            ent += (t.data_ptr(), t.numel(), (t.dtype == torch.int64) | (2 if nonneg else 0))
            words += t.numel()
    words = (words + 7) & ~7
    dev = _kernel_device()
    ring = torch.full((words + R.HEAD_READ + pad,), -7, dtype=torch.int32, device=dev)
    host = np.full(ring.numel(), -7, np.int32)
    R._head_struct(len(secs)).pack_into(host, 0, seqno, -1, nr, nrp, len(secs), 0, words, 0, *ent)
    ring.copy_(torch.from_numpy(host))  # (on a GPU the header is written to device memory here; same reads)
    snapshot_dispatch(0, ring.data_ptr())
    return ring.cpu().numpy(), words


@pytest.mark.kernel
@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 1000, 1537])
def test_snapshot_slot_read_back_equals_the_sources(n):
    """The descriptor launch: the header the CPU wrote (seqno, num_reqs, num_reqs_padded, K, words and one
    entry per section) stays, `done` becomes the seqno, flags 0, and the rows are the sources back to back
    in section order (an int64 source narrowed, an unaligned view, absent sections taking no room), for
    every section length around the kernel's block; nothing past the slot is written."""
    from dcptool.engine.snapshot import SNAP_BLOCK, SNAP_ENTRY, SNAP_FIXED, SNAP_HEAD_READ, SNAP_MAX_SECTIONS

    assert (SNAP_FIXED, SNAP_ENTRY, SNAP_HEAD_READ) == (R.FIXED, R.ENTRY, R.HEAD_READ) and SNAP_BLOCK == 512
    assert len(R.SECTIONS) <= SNAP_MAX_SECTIONS
    dev = _kernel_device()
    g = torch.Generator().manual_seed(n)
    seq = torch.randint(0, 1 << 30, (n,), generator=g, dtype=torch.int32).to(dev)
    wide = torch.randint(-(1 << 31), 1 << 31, (n + 1,), generator=g, dtype=torch.int64).to(dev)  # fits int32
    base = torch.arange(n + 3, dtype=torch.int32, device=dev)
    view = base[3:]  # unaligned: 12 bytes into its storage
    got, words = _launch_slot([(seq, True), (None, False), (wide, False), (view, False), (None, True)], seqno=n)
    hdr = got[:R.FIXED].tolist()
    assert hdr == [n, n, 3, 5, 5, 0, words, 0]
    counts = got[R.FIXED:R.FIXED + 5 * R.ENTRY].reshape(5, R.ENTRY)[:, 2].tolist()
    assert counts == [n, -1, n + 1, n, -1]
    rows = R._slot_rows(got, 0, None)
    assert rows[1] is None and rows[4] is None
    assert np.array_equal(rows[0], seq.cpu().numpy()) and np.array_equal(rows[2], wide.cpu().numpy())
    assert np.array_equal(rows[3], np.arange(3, n + 3))
    end = R.FIXED + 5 * R.ENTRY + 3 * n + 1
    assert (got[end:] == -7).all()  # nothing past the slot's rows


@pytest.mark.kernel
def test_snapshot_flags_values_int32_cannot_hold_and_forbidden_negatives():
    dev = _kernel_device()
    ok = torch.arange(1, 200, dtype=torch.int32, device=dev)
    big = torch.tensor([5, 2**33 + 7, 6], dtype=torch.int64, device=dev)
    neg = torch.tensor([4, -1], dtype=torch.int32, device=dev)
    got, _ = _launch_slot([(ok, True), (big, False)])
    assert got[5] == 1 and got[1] == 41  # bit 0; done still written
    assert R._slot_rows(got, 0, None)[1].tolist() == [5, 7, 6]  # narrowed (wrapped); the harvest drops it
    got, _ = _launch_slot([(neg, True), (ok, False)])
    assert got[5] == 2  # bit 1: a negative where the section forbids them
    got, _ = _launch_slot([(ok, True), (neg, False)])
    assert got[5] == 0  # a -1 in a view is a finding to record, not a bad value
    got, _ = _launch_slot([(neg, True), (big, False)])
    assert got[5] == 3


@hostring
@pytest.mark.kernel
def test_a_fifth_section_is_a_table_entry_not_kernel_code(tmp_path, monkeypatch):
    """Adding a row column to the device path: one SECTIONS entry (here two more past the table's own: one
    value per token with negatives forbidden, and one value per seq_lens row); the same kernel copies them,
    and their length rules apply."""
    from dcptool.engine.snapshot import snapshot_kernel

    kernel = snapshot_kernel()
    K = len(R.SECTIONS)
    monkeypatch.setattr(R, "SECTIONS", (*R.SECTIONS, R.Section("x1", "extra_tokens", R.ANY, nonneg=True),
                                        R.Section("x2", "extra_rows", R.ROWS)))
    rec = Recorder(tmp_path / "f.safetensors", dcp_size=2)
    ring = rec._use_host_ring()
    assert ring.kernel is kernel and rec._nsec == K + 2
    seq = torch.tensor([5, 9, 0], dtype=torch.int32)
    pos = torch.arange(11, dtype=torch.int64) * 3
    tot = torch.tensor([7, 8, 9], dtype=torch.int32)
    vals = rec._scalars(0, 1, -1, 2, 3, None, None, None, None, None, None, None)
    pad = (None,) * (K - 4)
    srcs = (seq, None, torch.tensor([0, 1, 2, 2], dtype=torch.int32), None, *pad, pos, tot)
    assert rec._observe_device(vals, "x", srcs) == 0
    with pytest.raises(ValueError, match="one value per seq_lens row"):  # (observe() drops and counts it)
        rec._observe_device(vals, "x", (*srcs[:K + 1], tot[:2]))
    bad = torch.tensor([1, -4], dtype=torch.int64)
    assert rec._observe_device(vals, "x", (*srcs[:K], bad, tot)) == 1
    with rec._lock, pytest.warns(RuntimeWarning, match="a negative"):
        rec._harvest(wait=True)
    assert rec.dropped == 1  # the negative value, found at harvest
    first, blk, lo = rec._landed[0]
    rows = R._slot_rows(blk, 0, None)
    assert first == 0 and len(rows) == K + 2 and rows[1] is None and rows[3] is None
    assert all(r is None for r in rows[4:K])
    assert rows[0].tolist() == [5, 9, 0] and rows[2].tolist() == [0, 1, 2, 2]
    assert rows[K].tolist() == list(range(0, 33, 3)) and rows[K + 1].tolist() == [7, 8, 9]
    rec.discard()


def test_the_direct_launch_passes_what_tritons_launcher_passes(monkeypatch):
    """The launch through the compiled launcher's C entry gives `launch` exactly the arguments Triton's own
    wrapper (CudaLauncher.__call__, as the compiled launcher is called) gives it, for this Triton; no GPU
    needed: `launch` is a stand-in that records its arguments."""
    import types

    import triton
    from triton.backends.nvidia.driver import CudaLauncher

    monkeypatch.setattr(triton.runtime.driver, "_active", types.SimpleNamespace(), raising=False)
    seen = []
    run = object.__new__(CudaLauncher)
    attrs = dict(launch=lambda *a: seen.append(a), num_ctas=1, global_scratch_size=0, global_scratch_align=1,
                 profile_scratch_size=0, profile_scratch_align=1, launch_cooperative_grid=False, launch_pdl=False,
                 gsan_enabled=False, arg_annotations=[("slot", "i64")], kernel_signature=b"\x05")
    for k, v in attrs.items():
        setattr(run, k, v)
    ck = types.SimpleNamespace(run=run, function=0xF00, packed_metadata=(4, 1, 0))
    go = R._direct_launch(ck)
    assert go is not None, "this Triton's launcher wrapper is not one _direct_launch knows"
    R._compiled_launch(ck)(0x5EED, 0xAB00)
    go(0x5EED, 0xAB00)
    assert len(seen) == 2 and seen[0] == seen[1]
    args = (0xAB00, 7, 250, 256, 9 | R._FAST_NEG, 816, 0xC000, 256, 0xD004, 256, 0xE000, 257)  # snapshot_args_kernel
    R._compiled_launch(ck, variadic=True)(0x5EED, *args)
    R._direct_launch(ck, variadic=True)(0x5EED, *args)
    assert len(seen) == 4 and seen[2] == seen[3] and seen[2] != seen[0]
    other = types.SimpleNamespace(run=types.SimpleNamespace(launch=print), function=1, packed_metadata=(4, 1, 0))
    assert R._direct_launch(other) is None  # a wrapper it does not know: the compiled launcher is used as it is


def test_the_cheapest_launch_is_the_first_the_check_accepts():
    """_cheapest tries the launcher's C entry, then the compiled launcher, keeps the first whose launch the
    self-check accepts, and says why each way before it was refused; neither: None and both reasons."""
    import types

    class Run:  # a launcher wrapper _direct_launch does not know (so: no C entry)
        def __call__(self, *a):
            calls.append(a)

    calls: list = []
    ck = types.SimpleNamespace(run=Run(), function=0xF00, packed_metadata=(4, 1, 0))
    go, how, why = R._cheapest(None, lambda ring, go: go(0x5EED, 0xAB00), ck, variadic=False)
    assert how == "Triton's compiled launcher" and len(why) == 1 and "C entry" in why[0]
    assert calls and calls[-1][3] == 0x5EED and calls[-1][-1] == 0xAB00  # (its launch ran: the check called it)

    def refuse(ring, go):
        raise RuntimeError("the slot holds garbage")

    go, how, why = R._cheapest(None, refuse, ck, variadic=True)
    assert go is None and how == "" and len(why) == 2 and "garbage" in why[1]


def _obs_stream(n: int, seed: int):
    """Varied observations as an engine hands them over (host tensors here; CUDA in the GPU tests)."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        rows = int(rng.integers(1, 400))
        nr = int(rng.integers(0, rows + 1))
        seq = torch.from_numpy(rng.integers(0, 1 << 20, rows).astype(np.int32 if i % 5 else np.int64))
        kw = dict(step=i // 4, site=("attn_metadata", "ubatch", "dummy")[i % 3], rank=i % 2, seq_lens=seq,
                  num_reqs=nr, num_reqs_padded=rows, ubatch=0 if i % 3 == 1 else -1,
                  parent=i - 1 if i % 3 == 1 else None)
        if i % 7:
            view = torch.from_numpy(rng.integers(0, 1 << 19, 2 * rows).astype(np.int32))
            kw["dcp_local_seq_lens"] = view[::2] if i % 4 == 0 else view[1:rows + 1]  # strided / unaligned
        q = np.concatenate([[0], np.cumsum(rng.integers(0, 3, rows))]).astype(np.int32)
        kw["query_start_loc"] = q if i % 2 else torch.from_numpy(q)  # numpy: the host holds it (mixed)
        if i % 6 == 0:
            kw["kv_pages"] = torch.from_numpy(rng.integers(0, 50, rows).astype(np.int32))
        if i % 11 == 0:
            kw["query_start_loc"] = torch.zeros(rows, dtype=torch.int32)  # wrong length: not recorded
        yield kw


def _columns(files):
    d = open_dumps(files)
    return {k: np.asarray(v) for k, v in d.columns.items()}


@hostring
@pytest.mark.kernel
@pytest.mark.parametrize("ring_words", [4096, 1 << 16])
def test_ring_records_what_the_host_path_records(tmp_path, ring_words):
    """Through the ring (wrapping many times with 4,096 words) or the host path: the same file."""
    a = Recorder(tmp_path / "a.safetensors", dcp_size=2, page_size=16)
    b = Recorder(tmp_path / "b.safetensors", dcp_size=2, page_size=16)
    ring = b._use_host_ring(ring_words)
    for kw in _obs_stream(150, 3):
        assert a.observe(**kw) == b.observe(**kw)
    fa, fb = a.close(), b.close()
    assert a.dropped == b.dropped == 0 and not ring.pending and ring.words == ring_words
    ca, cb = _columns(fa), _columns(fb)
    assert sorted(ca) == sorted(cb)
    for key in ca:
        assert np.array_equal(ca[key], cb[key]) or key == "obs.buffer", key


def _slot_words(rows: int) -> int:
    """Words of a ring slot holding one section of `rows` values (the header grows with SECTIONS)."""
    return (R.FIXED + R.ENTRY * len(R.SECTIONS) + rows + 7) & ~7


@hostring
@pytest.mark.kernel
def test_a_full_ring_waits_and_loses_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(R._HostEvent, "hold", True)  # no launch finishes until waited for
    monkeypatch.setattr(R._HostEvent, "waits", 0)
    rec = Recorder(tmp_path / "w.safetensors", dcp_size=2)
    rec._use_host_ring(3 * _slot_words(300) + 8)
    seen = []
    for i in range(12):
        seen.append(np.arange(i, i + 300, dtype=np.int32))
        assert rec.observe(step=i, site="x", rank=0, seq_lens=torch.from_numpy(seen[-1]), num_reqs=300,
                           num_reqs_padded=300) == i
    assert R._HostEvent.waits == 3  # 3 slots fit: the 4th, 7th and 10th waited for those before
    rec.close()
    d = read_dump(tmp_path / "w.safetensors")
    assert rec.dropped == 0 and d.n == 12 and all(np.array_equal(d.seq_lens_of(i), seen[i]) for i in range(12))


@hostring
@pytest.mark.kernel
def test_a_full_ring_drops_and_counts_when_told_to(tmp_path, monkeypatch):
    monkeypatch.setattr(R._HostEvent, "hold", True)
    rec = Recorder(tmp_path / "d.safetensors", dcp_size=2, ring_full="drop")
    rec._use_host_ring(3 * _slot_words(300) + 8)
    with pytest.warns(RuntimeWarning, match="snapshot ring is full"):
        got = [rec.observe(step=i, site="x", rank=0, seq_lens=torch.full((300,), i, dtype=torch.int32),
                           num_reqs=300, num_reqs_padded=300) for i in range(6)]
    assert got == [0, 1, 2, -1, -1, -1] and rec.ring_drops == rec.dropped == 3
    rec.close()
    d = read_dump(tmp_path / "d.safetensors")
    assert d.n == 3 and [int(d.seq_lens_of(i)[0]) for i in range(3)] == [0, 1, 2]  # the kept ones, intact


@hostring
@pytest.mark.kernel
def test_device_values_that_cannot_be_stored_are_dropped_at_harvest(tmp_path):
    """A negative seq_len or an int64 value int32 cannot hold is only seen when the slot is
    harvested: that observation is dropped and counted, the others keep their rows, and a parent
    pointing at a dropped one becomes unknown."""
    rec = Recorder(tmp_path / "h.safetensors", dcp_size=2)
    rec._use_host_ring()
    t = torch.tensor
    with pytest.warns(RuntimeWarning, match="int32 cannot hold"):
        i0 = rec.observe(step=0, site="x", rank=0, seq_lens=t([5, 6], dtype=torch.int32), num_reqs=2,
                         num_reqs_padded=2)
        i1 = rec.observe(step=0, site="x", rank=0, seq_lens=t([5, 2**31], dtype=torch.int64), num_reqs=2,
                         num_reqs_padded=2)
        i2 = rec.observe(step=0, site="y", rank=0, seq_lens=t([8], dtype=torch.int32), num_reqs=1,
                         num_reqs_padded=1, parent=i1)
        i3 = rec.observe(step=1, site="y", rank=1, seq_lens=t([-3, 4], dtype=torch.int32), num_reqs=2,
                         num_reqs_padded=2, parent=i0)
        i4 = rec.observe(step=1, site="y", rank=1, seq_lens=t([9], dtype=torch.int32), num_reqs=1,
                         num_reqs_padded=1, parent=i2, dcp_local_seq_lens=t([2**40], dtype=torch.int64))
        i5 = rec.observe(step=2, site="y", rank=1, seq_lens=t([9], dtype=torch.int64), num_reqs=1,
                         num_reqs_padded=1, parent=i2, dcp_local_seq_lens=t([-1], dtype=torch.int64))
        rec.close()
    assert [i0, i1, i2, i3, i4, i5] == list(range(6)) and rec.dropped == 3 and len(rec) == 3
    d = read_dump(tmp_path / "h.safetensors")
    assert d.n == 3 and d["obs.step"].tolist() == [0, 0, 2] and d["obs.parent"].tolist() == [-1, -1, 1]
    assert d.dcp_of(2).tolist() == [-1]  # a -1 sentinel in the view is a finding to record, not a bad value


@hostring
@pytest.mark.kernel
def test_rollover_waits_for_the_slots_of_its_file(tmp_path, monkeypatch):
    monkeypatch.setattr(R._HostEvent, "hold", True)
    rec = Recorder(tmp_path / "r.safetensors", dcp_size=2, rollover=3)
    rec._use_host_ring()
    for i in range(10):
        rec.observe(step=i, site="x", rank=0, seq_lens=torch.tensor([i], dtype=torch.int32), num_reqs=1,
                    num_reqs_padded=1)
    assert rec.files == []  # their values are still in flight: the write waits, the engine does not
    monkeypatch.setattr(R._HostEvent, "hold", False)
    for i in range(10, 80):
        rec.observe(step=i, site="x", rank=0, seq_lens=torch.tensor([i], dtype=torch.int32), num_reqs=1,
                    num_reqs_padded=1)
    assert len(rec.files) >= 2
    files = rec.close()
    d = open_dumps(files)
    assert d.n == 80 and d["rows.seq_lens"].tolist() == list(range(80)) and rec.write_errors == 0


def test_nothing_is_recorded_inside_cuda_graph_capture(tmp_path):
    rec = Recorder(tmp_path / "c.safetensors", dcp_size=2)
    rec._on = "is_cpu"
    rec._capturing = lambda: True
    assert rec.observe(step=0, site="capture", rank=0, seq_lens=torch.tensor([3]), num_reqs=1,
                       num_reqs_padded=1) == -1
    assert rec.observe(step=0, site="x", rank=0, seq_lens=np.array([3]), num_reqs=1, num_reqs_padded=1) == 0
    rec.close()
    assert rec.skipped_capture == 1 and rec.dropped == 0 and read_dump(tmp_path / "c.safetensors").n == 1


# --------------------------------------------------------------------------------------------
# The device snapshot on a GPU

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@cuda
def test_cuda_observe_does_not_wait_and_keeps_the_values_of_observe_time(tmp_path):
    dev = torch.device("cuda")
    seq = torch.arange(1, 257, dtype=torch.int32, device=dev)
    dcp = (seq // 2).to(torch.int32)
    qsl = torch.arange(257, dtype=torch.int32, device=dev)
    rec = Recorder(tmp_path / "a.safetensors", dcp_size=2)
    kw = dict(site="attn_metadata", rank=0, seq_lens=seq, num_reqs=250, num_reqs_padded=256,
              dcp_local_seq_lens=dcp, query_start_loc=qsl)
    rec.observe(step=0, **kw)  # the first one starts the ring (and checks the kernel once, synchronously)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising torch call raises from here on
    try:
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of queued GPU work ahead of the snapshot
        assert rec.observe(step=1, **kw) == 1
        busy = not torch.cuda.current_stream().query()
        seq.fill_(12345)  # the engine overwrites its buffers right after the build (queued behind it)
        dcp.fill_(77)
        for i in range(2, 70):  # enough for a fence and a harvest attempt inside observe()
            rec.observe(step=i, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert busy  # observe() returned while the GPU was still sleeping: it did not wait for the stream
    rec.close()
    d = read_dump(tmp_path / "a.safetensors")
    assert rec.dropped == 0 and d.n == 70
    want = np.arange(1, 257, dtype=np.int32)
    assert np.array_equal(d.seq_lens_of(1), want) and np.array_equal(d.dcp_of(1), want // 2)
    q = d["obs.qsl"]
    assert np.array_equal(d["rows.query_start_loc"][q[1]:q[2]], np.arange(257))
    assert (d.seq_lens_of(2) == 12345).all() and (d.dcp_of(68) == 77).all()


@pytest.mark.cuda
@cuda
def test_cuda_snapshot_carries_issue15_rows_like_the_synchronous_copy(tmp_path):
    """dcp_query_start_loc and the global companion go through the ring as device sections (a negative
    companion dropped at harvest), slot entries ride along on the host: the same file as cuda_mode="sync"."""
    kv = [{"name": "attn", "dcp": True, "block_size": 16}, {"name": "mamba", "dcp": False}]
    a = Recorder(tmp_path / "a.safetensors", dcp_size=2, page_size=16, cuda_mode="sync", kv_groups=kv)
    b = Recorder(tmp_path / "b.safetensors", dcp_size=2, page_size=16, kv_groups=kv)
    for k, kw in enumerate(_obs_stream(120, 6)):
        kw = {x: v.cuda() if isinstance(v, torch.Tensor) else v for x, v in kw.items()}
        extra = {} if k % 3 == 0 else {"dcp_query_start_loc": torch.arange(k % 5 + 1, device="cuda"),
                                       "dcp_tot_seq_lens": torch.full((k % 4,), k, device="cuda")}
        if k % 4 == 1:
            extra["positions"] = torch.arange(3, device="cuda") + k
            extra["slot_mapping"] = {0: torch.tensor([k, -1, k + 2], device="cuda"),
                                     1: torch.arange(3, device="cuda") + 3 * k}
        assert a.observe(**kw, **extra) == b.observe(**kw, **extra)
    fa, fb = a.close(), b.close()
    assert a.dropped == b.dropped == 0 and b._ring is not None and not b._ring.pending
    ca, cb = _columns(fa), _columns(fb)
    assert {"obs.dqsl", "obs.tot", "obs.slots"} <= set(ca) and sorted(ca) == sorted(cb)
    for key in ca:
        assert np.array_equal(ca[key], cb[key]) or key == "obs.buffer", key


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("ring_bytes", [16 << 10, 4 << 20])
def test_cuda_snapshot_records_what_the_synchronous_copy_records(tmp_path, ring_bytes):
    """Varied CUDA observations (int64, strided and unaligned views, host parts, wrong lengths, a ring
    small enough to wrap and grow): the same file as cuda_mode="sync"."""
    a = Recorder(tmp_path / "a.safetensors", dcp_size=2, page_size=16, cuda_mode="sync")
    b = Recorder(tmp_path / "b.safetensors", dcp_size=2, page_size=16, ring_bytes=ring_bytes)
    for kw in _obs_stream(300, 4):
        kw = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        if isinstance(kw.get("dcp_local_seq_lens"), torch.Tensor) and kw["step"] % 2:
            full = torch.zeros(2 * kw["num_reqs_padded"] + 1, dtype=torch.int32, device="cuda")
            full[1:2 * kw["num_reqs_padded"] + 1:2] = kw["dcp_local_seq_lens"]
            kw["dcp_local_seq_lens"] = full[1::2]  # unaligned and strided on the device
        assert a.observe(**kw) == b.observe(**kw)
    fa, fb = a.close(), b.close()
    assert a.dropped == b.dropped == 0 and b._ring is not None and not b._ring.pending
    ca, cb = _columns(fa), _columns(fb)
    assert sorted(ca) == sorted(cb)
    for key in ca:
        assert np.array_equal(ca[key], cb[key]) or key == "obs.buffer", key


@pytest.mark.cuda
@cuda
def test_cuda_graph_capture_records_nothing_and_counts_it(tmp_path):
    seq = torch.arange(1, 9, dtype=torch.int32, device="cuda")
    rec = Recorder(tmp_path / "g.safetensors", dcp_size=2)
    rec.observe(step=0, site="x", rank=0, seq_lens=seq, num_reqs=8, num_reqs_padded=8)
    out = seq * 2
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = seq * 2
        assert rec.observe(step=1, site="capture", rank=0, seq_lens=seq, num_reqs=8, num_reqs_padded=8) == -1
    seq.add_(1)
    g.replay()  # the capture is intact (a host copy inside it would have invalidated it)
    torch.cuda.synchronize()
    assert out.tolist() == [2 * (i + 1) for i in range(1, 9)]
    rec.close()
    assert rec.skipped_capture == 1 and rec.dropped == 0 and read_dump(tmp_path / "g.safetensors").n == 1


@pytest.mark.cuda
@cuda
def test_cuda_threads_on_their_own_streams(tmp_path):
    import threading

    rec = Recorder(tmp_path / "s.safetensors", dcp_size=2, rollover=100)
    bufs = [torch.zeros(64, dtype=torch.int32, device="cuda") for _ in range(2)]
    torch.cuda.synchronize()

    def work(t: int) -> None:
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            for i in range(1000):
                bufs[t].fill_(t * 10_000 + i)
                rec.observe(step=t * 10_000 + i, site=f"t{t}", rank=t, seq_lens=bufs[t], num_reqs=64,
                            num_reqs_padded=64)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    d = open_dumps(rec.close())
    assert rec.dropped == 0 and d.n == 2000
    rows = d["rows.seq_lens"].reshape(-1, 64)
    assert np.array_equal(rows[:, 0], d["obs.step"]) and (rows == rows[:, :1]).all()


# issue 15: dcp_query_start_loc and dcp_tot_seq_lens (host path)


def test_issue15_rows_round_trip_observe_and_observe_many(tmp_path):
    import torch

    r = Recorder(tmp_path / "a.safetensors", dcp_size=2)
    q = np.array([0, 1, 2, 3], np.int64)
    i0 = r.observe(step=1, site="attn_metadata", rank=0, seq_lens=np.array([7, 40, 16], np.int32), num_reqs=3,
                   num_reqs_padded=3, dcp_local_seq_lens=np.array([4, 20, 8], np.int32), dcp_query_start_loc=q,
                   dcp_tot_seq_lens=torch.tensor([7, 40, 16]))
    q[1] = 99  # copied at once: a later change of the engine's array is not recorded
    i1 = r.observe(step=1, site="attn_metadata", rank=1, seq_lens=np.array([7, 40, 16], np.int32), num_reqs=3,
                   num_reqs_padded=3, dcp_local_seq_lens=np.array([3, 20, 8], np.int32))  # not recorded: empty
    many = r.observe_many(step=2, site="attn_metadata", ranks=[0, 1], seq_lens=np.array([9, 5]), num_reqs=2,
                          num_reqs_padded=2, dcp_local_seq_lens=np.array([[5, 3], [4, 2]]),
                          dcp_query_start_loc=np.array([0, 1, 2]), dcp_tot_seq_lens=np.array([[9, 5], [5, 3]]))
    assert [i0, i1, *many] == [0, 1, 2, 3] and r.dropped == 0
    d = read_dump(r.close()[0])
    assert d.dqsl_of(0).tolist() == [0, 1, 2, 3] and d.dqsl_of(1).tolist() == []
    assert d.dqsl_of(2).tolist() == d.dqsl_of(3).tolist() == [0, 1, 2]
    assert [d.tot_of(i).tolist() for i in range(4)] == [[7, 40, 16], [], [9, 5], [5, 3]]
    assert d["rows.dcp_query_start_loc"].dtype == np.int32 and d["obs.tot"].dtype == np.int64


def test_issue15_rows_absent_when_never_given_and_bad_ones_dropped(tmp_path):
    r = Recorder(tmp_path / "a.safetensors", dcp_size=2)
    r.observe(step=1, site="s", rank=0, seq_lens=[3], num_reqs=1, num_reqs_padded=1, dcp_local_seq_lens=[2])
    with pytest.warns(RuntimeWarning, match="dropped"):
        assert r.observe(step=1, site="s", rank=1, seq_lens=[3], num_reqs=1, num_reqs_padded=1,
                         dcp_local_seq_lens=[1], dcp_tot_seq_lens=np.array([2**40])) == -1
    d = read_dump(r.close()[0])
    assert d.n == 1 and not d.has("obs.dqsl") and not d.has("obs.tot")


@hostring
@pytest.mark.kernel
def test_issue15_rows_through_the_ring_match_the_host_path(tmp_path):
    """The snapshot path keeps the issue-15 rows (host-copied for now) beside its ring slots, in ROW_FIELDS order."""
    a = Recorder(tmp_path / "a.safetensors", dcp_size=2, page_size=16)
    b = Recorder(tmp_path / "b.safetensors", dcp_size=2, page_size=16)
    b._use_host_ring(4096)
    for k, kw in enumerate(_obs_stream(40, 5)):
        extra = {} if k % 3 == 0 else {"dcp_query_start_loc": torch.arange(k % 5 + 1),
                                       "dcp_tot_seq_lens": torch.full((k % 4,), k)}
        assert a.observe(**kw, **extra) == b.observe(**kw, **extra)
    ca, cb = _columns(a.close()), _columns(b.close())
    assert {"obs.dqsl", "obs.tot"} <= set(ca) and sorted(ca) == sorted(cb)
    for key in ca:
        assert np.array_equal(ca[key], cb[key]) or key == "obs.buffer", key
# --------------------------------------------------------------------------------------------
# issue 15 item 3: positions= and slot_mapping= (host path, CUDA tensors too for now), kv_groups=

KV = [{"name": "attn", "dcp": True, "block_size": 16}, {"name": "mamba", "dcp": False}]


def test_slot_kwargs_round_trip_every_form(tmp_path):
    """1-D (group 0), [groups, tokens], a dict of groups, torch int64 and lists: one entry per token and group,
    groups ascending; observations without slots have none; observe_many takes one mapping per rank."""
    with Recorder(tmp_path / "s.safetensors", dcp_size=2, kv_groups=KV) as rec:
        rec.observe(**_base(0), positions=torch.tensor([3, 4], dtype=torch.int64), slot_mapping=torch.tensor([-1, 7]))
        rec.observe(**_base(1), positions=[3, 4], slot_mapping=np.array([[5, -1], [30, 31]]))
        rec.observe(**_base(0), positions=np.array([9, 10]), slot_mapping={1: [1, 2], 0: torch.tensor([-1, -1])})
        rec.observe(**_base(1))
        rec.observe_many(**{k: v for k, v in _base(0).items() if k not in ("rank", "dcp_local_seq_lens")}, ranks=[0, 1],
                         dcp_local_seq_lens=np.array([[9, 13, 0, 0], [8, 12, 0, 0]]), positions=[0, 1],
                         slot_mapping={0: np.array([[0, -1], [-1, 0]]), 1: torch.tensor([[0, 1], [0, 1]])})
    d = read_dump(tmp_path / "s.safetensors")
    assert rec.dropped == 0 and d.config.kv_groups[0].block_size == 16 and not d.config.kv_groups[1].dcp
    assert d["obs.slots"].tolist() == [0, 2, 6, 10, 10, 14, 18]
    assert d["rows.positions"].tolist() == [3, 4, 3, 4, 3, 4, 9, 10, 9, 10, 0, 1, 0, 1, 0, 1, 0, 1]
    assert d["rows.slot_mapping"].tolist() == [-1, 7, 5, -1, 30, 31, -1, -1, 1, 2, 0, -1, 0, 1, -1, 0, 0, 1]
    assert d["rows.slot_group"].tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1]
    # pack() writes the same columns from Observation(positions=, slot_mapping=)
    o = [obs(positions=[3, 4], slot_mapping=[-1, 7]), obs(step=1)]
    _, cols = pack(o, DumpConfig(dcp_size=2))
    assert cols["obs.slots"].tolist() == [0, 2, 2] and cols["rows.slot_group"].tolist() == [0, 0]


def _base(rank):
    return dict(step=0, site="attn_metadata", rank=rank, seq_lens=np.array([17, 25, 0, 0]), num_reqs=2,
                num_reqs_padded=4, dcp_local_seq_lens=np.array([9, 13, 0, 0]) if rank == 0 else np.array([8, 12, 0, 0]))


@pytest.mark.parametrize("bad", [
    dict(positions=[1, 2]),  # without slot_mapping
    dict(slot_mapping=[1, 2]),  # without positions
    dict(positions=[1, 2], slot_mapping=[1, 2, 3]),  # not one per position
    dict(positions=[1, 2], slot_mapping={2: [1, 2]}),  # a group the config does not list
    dict(positions=[1, 2], slot_mapping={-1: [1, 2]}),
    dict(positions=[1, -2], slot_mapping=[1, 2]),
    dict(positions=[1, 2], slot_mapping=np.array([1, 2**31])),  # int32 cannot hold it
    dict(positions=[1, 2], slot_mapping=np.array([1.5, 2])),
], ids=["no-slots", "no-positions", "length", "group", "negative-group", "negative-position", "int64", "float"])
def test_slot_values_that_cannot_be_stored_drop_the_observation(tmp_path, bad):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Recorder(tmp_path / "b.safetensors", dcp_size=2, kv_groups=KV) as rec:
            assert rec.observe(**_base(0), **bad) == -1
            assert rec.observe(**_base(1), positions=[1, 2], slot_mapping=[-1, 3]) == 0
    assert rec.dropped == 1 and read_dump(tmp_path / "b.safetensors").n == 1


def test_kv_groups_set_later_must_cover_what_was_recorded(tmp_path):
    with Recorder(tmp_path / "k.safetensors", dcp_size=2) as rec:
        rec.observe(**_base(0), positions=[1, 2], slot_mapping={1: [3, 4]})
        with pytest.raises(ValueError, match="group 1 was recorded"):
            rec.set_kv_groups([{"name": "attn", "dcp": True}])
        rec.set_kv_groups(KV)
    assert read_dump(tmp_path / "k.safetensors").config.kv_groups[1].name == "mamba"
    with pytest.raises(ValueError, match="dcp must be true or false"):
        Recorder(tmp_path / "x.safetensors", dcp_size=2, kv_groups=[{"name": "a", "dcp": "yes"}])


@hostring
@pytest.mark.kernel
def test_device_path_carries_slot_entries(tmp_path):
    """Through the snapshot ring (host tensors in the CPU tests), slot entries ride along on the host."""
    a = Recorder(tmp_path / "a.safetensors", dcp_size=2, kv_groups=KV)
    a._use_host_ring()
    b = Recorder(tmp_path / "b.safetensors", dcp_size=2, kv_groups=KV)
    for rec in (a, b):
        rec.observe(**{**_base(0), "seq_lens": torch.tensor([17, 25, 0, 0])}, positions=torch.tensor([16, 17]),
                    slot_mapping=torch.tensor([[4, -1], [0, 1]]))
        rec.close()
    da, db = read_dump(tmp_path / "a.safetensors"), read_dump(tmp_path / "b.safetensors")
    for k in ("obs.slots", "rows.positions", "rows.slot_mapping", "rows.slot_group", "rows.seq_lens"):
        assert np.array_equal(da[k], db[k]), k


# --------------------------------------------------------------------------------------------
# observe()'s fast path (issue 13 item 4): the engine's call, the header as kernel arguments

def _launch_args(seq, dcp, qsl, seqno: int = 41, nr: int = 3, nrp: int = 5, pad: int = 64):
    """snapshot_args_kernel on seq/dcp/qsl (tensors, or None: absent) into a fresh ring filled with -7, as
    observe()'s fast path launches it; returns the ring's words (numpy) and the slot's words."""
    from dcptool.engine.snapshot import snapshot_args_dispatch

    k = len(R.SECTIONS)
    words = (R.FIXED + R.ENTRY * k + sum(t.numel() for t in (seq, dcp, qsl) if t is not None) + 7) & ~7
    ring = torch.full((words + R.HEAD_READ + pad,), -7, dtype=torch.int32, device=_kernel_device())
    args = []
    for t in (seq, dcp, qsl):
        args += (ring.data_ptr(), -1) if t is None else (t.data_ptr(), t.numel())
    snapshot_args_dispatch(0, ring.data_ptr(), seqno, nr, nrp, k | R._FAST_NEG, words, *args)
    return ring.cpu().numpy(), words


@pytest.mark.kernel
@pytest.mark.parametrize("n", [0, 1, 300, 513])
def test_the_args_kernel_writes_the_slot_the_descriptor_kernel_writes(n):
    """The fast path's kernel takes the header as arguments and writes it itself: word for word the slot that
    the CPU's header and snapshot_kernel make (header, rows, flags, done; nothing past the slot), with any
    of the three sections absent, for lengths around the kernel's block (empty sections: the same but for
    the address words, which the interpreter cannot take as 0)."""
    dev = _kernel_device()
    g = torch.Generator().manual_seed(n)
    base = torch.randint(0, 1 << 30, (n + 1,), generator=g, dtype=torch.int32).to(dev)
    seq = base[1:]  # unaligned
    dcp = torch.randint(-5, 1 << 20, (n,), generator=g, dtype=torch.int32).to(dev)  # negatives allowed here
    qsl = torch.arange(n + 1, dtype=torch.int32, device=dev)
    for secs in ((seq, dcp, qsl), (seq, None, qsl), (seq, dcp, None), (seq, None, None)):
        got, words = _launch_args(*secs, seqno=n + 3)
        flags = [(t, k == 0) for k, t in enumerate(secs)] + [(None, False)] * (len(R.SECTIONS) - 3)
        want, want_words = _launch_slot(flags, seqno=n + 3)
        if n == 0:
            addr = R.FIXED + R.ENTRY * np.arange(3)[:, None] + np.arange(2)
            got[addr], want[addr] = 0, 0
        assert words == want_words and np.array_equal(got, want), [t is None for t in secs]
        assert got[1] == n + 3 and got[5] == 0


@pytest.mark.kernel
def test_the_args_kernel_flags_like_the_descriptor_kernel():
    dev = _kernel_device()
    ok = torch.arange(1, 9, dtype=torch.int32, device=dev)
    neg = torch.tensor([4, -1, 3, 2, 1, 0, 5, 6], dtype=torch.int32, device=dev)
    assert _launch_args(neg, ok, None)[0][5] == 2  # a negative seq_len: bit 1
    assert _launch_args(ok, neg, torch.full((9,), -3, dtype=torch.int32, device=dev))[0][5] == 0  # allowed there


@hostring
@pytest.mark.kernel
def test_the_fast_launch_is_checked_before_use():
    """_fast_launch proves a launch way on known values before observe() uses it (none here: the interpreter
    has no compiled launcher, and through the dispatch the general path costs less); a launch that passes
    one argument wrong fails the check (and so is never used)."""
    from dcptool.engine.snapshot import snapshot_args_dispatch

    ring = R._SnapshotRing(4096, None)
    go, how = R._fast_launch(ring)
    assert go is None and how.startswith("none, the general path instead (the launcher's C entry: ")
    go = snapshot_args_dispatch
    R._self_check_args(ring, go)
    with pytest.raises(RuntimeError, match="self-check wrote"):
        R._self_check_args(ring, lambda raw, at, *a: go(raw, at, *a[:-1], a[-1] - 1))  # qsl one value short


def _engine_kw(i: int, seq, dcp, qsl) -> dict:
    return dict(step=i // 4, site="attn_metadata", rank=i % 2, seq_lens=seq, num_reqs=seq.numel() - 1,
                num_reqs_padded=seq.numel(), dcp_local_seq_lens=dcp, query_start_loc=qsl)


@hostring
@pytest.mark.kernel
def test_the_engines_call_takes_the_fast_path_and_records_the_same(tmp_path, monkeypatch):
    """What an engine passes each step (seq_lens, dcp_local_seq_lens, query_start_loc as int32 device
    tensors, or query_start_loc as numpy: the vLLM plugin's form) goes through observe()'s fast path
    after the first observation at a site (the general path checks and remembers the site name); the
    file equals the host path's, buffer ids included."""
    calls = []
    general = Recorder._observe_device
    monkeypatch.setattr(Recorder, "_observe_device", lambda self, *a: calls.append(a[1]) or general(self, *a))
    a = Recorder(tmp_path / "a.safetensors", dcp_size=2)
    b = Recorder(tmp_path / "b.safetensors", dcp_size=2)
    b._use_host_ring()
    rng = np.random.default_rng(7)
    store = torch.zeros(1024, dtype=torch.int32)  # a persistent buffer the engine hands out views of
    for i in range(40):
        rows = int(rng.integers(1, 300))
        seq = torch.from_numpy(rng.integers(0, 1 << 20, rows).astype(np.int32))
        store[8:8 + rows] = seq // 2
        q = np.concatenate([[0], np.cumsum(rng.integers(0, 3, rows))]).astype(np.int32)
        kw = _engine_kw(i, seq, store[8:8 + rows], q if i % 2 else torch.from_numpy(q))
        assert a.observe(**kw) == b.observe(**kw) == i
    fa, fb = a.close(), b.close()
    assert calls == ["attn_metadata"] and a.dropped == b.dropped == 0
    ca, cb = _columns(fa), _columns(fb)
    assert sorted(ca) == sorted(cb) and all(np.array_equal(ca[k], cb[k]) for k in ca)


@hostring
@pytest.mark.kernel
def test_what_the_fast_path_does_not_take_goes_the_general_way(tmp_path, monkeypatch):
    """Anything but the engine's plain call (int64 or strided views, another row column, a numpy scalar, a
    graph mode by name) leaves the fast path: the same file as the host path, and the general path saw
    each of them."""
    calls = []
    general = Recorder._observe_device
    monkeypatch.setattr(Recorder, "_observe_device", lambda self, *a: calls.append(a[1]) or general(self, *a))
    a = Recorder(tmp_path / "a.safetensors", dcp_size=2, page_size=16)
    b = Recorder(tmp_path / "b.safetensors", dcp_size=2, page_size=16)
    b._use_host_ring()
    seq = torch.arange(1, 9, dtype=torch.int32)
    kw = _engine_kw(0, seq, seq // 2, torch.arange(9, dtype=torch.int32))
    odd = [dict(seq_lens=seq.long()), dict(dcp_local_seq_lens=torch.arange(16, dtype=torch.int32)[::2]),
           dict(kv_pages=seq), dict(step=np.int64(3)), dict(graph="replay"), dict(ubatch=np.int32(0)),
           dict(query_start_loc=torch.arange(9))]
    # (a query_start_loc that does not cover the rows stays on the fast path: not recorded, as on the host)
    for i, extra in enumerate([{}, *odd, {}, dict(query_start_loc=seq)]):
        assert a.observe(**{**kw, **extra}) == b.observe(**{**kw, **extra}) == i
    fa, fb = a.close(), b.close()
    assert len(calls) == 1 + len(odd) and a.dropped == b.dropped == 0
    ca, cb = _columns(fa), _columns(fb)
    assert sorted(ca) == sorted(cb) and all(np.array_equal(ca[k], cb[k]) for k in ca)


@hostring
@pytest.mark.kernel
def test_the_fast_path_drops_and_skips_what_the_general_path_does(tmp_path):
    rec = Recorder(tmp_path / "d.safetensors", dcp_size=2)
    rec._use_host_ring()
    seq = torch.arange(1, 9, dtype=torch.int32)
    kw = _engine_kw(0, seq, seq // 2, torch.arange(9, dtype=torch.int32))
    assert rec.observe(**kw) == 0
    with pytest.warns(RuntimeWarning, match="dropped"):
        got = [rec.observe(**{**kw, **bad}) for bad in (dict(rank=2), dict(parent=1), dict(num_reqs=9),
                                                          dict(num_reqs_padded=2**31), dict(step=2**63),
                                                          dict(tok_start=-2), dict(graph=4))]
    assert got == [-1] * 7 and rec.dropped == 7
    rec._capturing = lambda: True
    assert rec.observe(**kw) == -1 and rec.skipped_capture == 1
    rec._capturing = lambda: False
    assert rec.observe(**{**kw, "parent": 0}) == 1
    rec.close()
    assert rec.observe(**kw) == -1 and rec.dropped == 8  # after close()
    d = read_dump(tmp_path / "d.safetensors")
    assert d.n == 2 and d["obs.parent"].tolist() == [-1, 0] and d.seq_lens_of(1).tolist() == list(range(1, 9))


@pytest.mark.cuda
@cuda
def test_cuda_fast_path_launches_through_a_checked_launcher_and_records_what_sync_records(tmp_path, monkeypatch):
    """On a GPU the engine's call takes the fast path (snapshot_args_kernel through the launcher's C entry or
    the compiled launcher, checked at start) without synchronising, and the file equals cuda_mode="sync"'s."""
    calls = []
    general = Recorder._observe_device
    monkeypatch.setattr(Recorder, "_observe_device", lambda self, *a: calls.append(a[1]) or general(self, *a))
    a = Recorder(tmp_path / "a.safetensors", dcp_size=2, cuda_mode="sync")
    b = Recorder(tmp_path / "b.safetensors", dcp_size=2)  # (a ring that never fills: no wait to synchronise)
    rng = np.random.default_rng(11)
    store = torch.zeros(1024, dtype=torch.int32, device="cuda")
    for i in range(300):
        rows = int(rng.integers(1, 300))
        seq = torch.from_numpy(rng.integers(0, 1 << 20, rows).astype(np.int32)).cuda()
        store[8:8 + rows] = seq // 2
        q = np.concatenate([[0], np.cumsum(rng.integers(0, 3, rows))]).astype(np.int32)
        kw = _engine_kw(i, seq, store[8:8 + rows], q if i % 2 else torch.from_numpy(q).cuda())
        if i == 1:
            torch.cuda.set_sync_debug_mode("error")  # from here on, any synchronising torch call raises
        try:
            got_b = b.observe(**kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert a.observe(**kw) == got_b == i
    assert b._ring.go3 is not None and b._ring.how3 in ("the launcher's C entry", "Triton's compiled launcher")
    fa, fb = a.close(), b.close()
    assert calls == ["attn_metadata"] and a.dropped == b.dropped == 0
    ca, cb = _columns(fa), _columns(fb)
    assert sorted(ca) == sorted(cb) and all(np.array_equal(ca[k], cb[k]) for k in ca)
