"""observe()'s device path (device.py): the snapshot ring on the CPU (host tensors, the interpreted kernel) and on a
GPU records what the host path records, waits or drops when full, drops at harvest what cannot be stored; the
fast path takes the engine's call and only that."""

import numpy as np
import pytest
import torch
from conftest import hostring

from dcptool.dump import open_dumps, read_dump
from dcptool.engine.recorder.record import Recorder
from dcptool.engine.snapshot.device import DevicePath

# --------------------------------------------------------------------------------------------
# The device snapshot, on the CPU: the ring's logic with host tensors standing in for CUDA ones
# and the kernel under the Triton interpreter (the CUDA tests below use the real thing)


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
    ring = b._device.use_host_ring(ring_words)
    for kw in _obs_stream(150, 3):
        assert a.observe(**kw) == b.observe(**kw)
    fa, fb = a.close(), b.close()
    assert a.dropped == b.dropped == 0 and not ring.pending and ring.words == ring_words
    ca, cb = _columns(fa), _columns(fb)
    assert sorted(ca) == sorted(cb)
    for key in ca:
        assert np.array_equal(ca[key], cb[key]) or key == "obs.buffer", key


@hostring
@pytest.mark.kernel
def test_device_values_that_cannot_be_stored_are_dropped_at_harvest(tmp_path):
    """A negative seq_len or an int64 value int32 cannot hold is only seen when the slot is
    harvested: that observation is dropped and counted, the others keep their rows, and a parent
    pointing at a dropped one becomes unknown."""
    rec = Recorder(tmp_path / "h.safetensors", dcp_size=2)
    rec._device.use_host_ring()
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
    """dcp_query_start_loc, the global companion and the slot sections go through the ring as device sections
    (a negative companion dropped at harvest): the same file as cuda_mode="sync"."""
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
    assert a.dropped == b.dropped == 0 and b._device.ring is not None and not b._device.ring.pending
    ca, cb = _columns(fa), _columns(fb)
    assert {"obs.dqsl", "obs.tot", "obs.slots"} <= set(ca) and sorted(ca) == sorted(cb)
    for key in ca:
        assert np.array_equal(ca[key], cb[key]) or key == "obs.buffer", key


@pytest.mark.cuda
@cuda
def test_cuda_every_section_the_plugin_passes_goes_without_a_host_sync(tmp_path):
    """The vLLM plugin's full argument set (the fast-path set, buffer=, positions + [groups, tokens] int64 slot
    mappings, rows, kv_pages) under torch.cuda.set_sync_debug_mode("error"): no call waits for the
    stream, and the file equals cuda_mode="sync"'s."""
    kv = [{"name": "attn", "dcp": True, "block_size": 16}, {"name": "mamba", "dcp": False}]
    a = Recorder(tmp_path / "a.safetensors", dcp_size=2, page_size=16, cuda_mode="sync", kv_groups=kv)
    b = Recorder(tmp_path / "b.safetensors", dcp_size=2, page_size=16, kv_groups=kv)
    rng = np.random.default_rng(12)
    obs = []
    for i in range(80):
        rows, n = int(rng.integers(1, 300)), int(rng.integers(0, 2000))
        g = lambda *shape, lo=0: torch.from_numpy(rng.integers(lo, 1 << 20, shape)).cuda()  # noqa: E731
        seq = g(rows).to(torch.int32)
        obs.append(dict(step=i, site="attn_metadata", rank=i % 2, seq_lens=seq, num_reqs=rows, num_reqs_padded=rows,
                        dcp_local_seq_lens=seq // 2, query_start_loc=torch.arange(rows + 1, device="cuda"),
                        buffer=i, positions=g(n), slot_mapping=g(2, n, lo=-1), dcp_query_start_loc=g(rows + 1),
                        dcp_tot_seq_lens=g(rows), kv_pages=(seq // 16 + 1).int()))
    b.observe(**obs[0])  # (starts the ring: its launch check synchronises once)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = [b.observe(**kw) for kw in obs[1:]]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got == list(range(1, 80)) and [a.observe(**kw) for kw in obs] == list(range(80))
    fa, fb = a.close(), b.close()
    assert a.dropped == b.dropped == 0
    ca, cb = _columns(fa), _columns(fb)
    assert sorted(ca) == sorted(cb) and all(np.array_equal(ca[k], cb[k]) for k in ca)


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
    assert a.dropped == b.dropped == 0 and b._device.ring is not None and not b._device.ring.pending
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


@hostring
@pytest.mark.kernel
def test_issue15_rows_through_the_ring_match_the_host_path(tmp_path):
    """The snapshot path records the issue-15 rows and the chunked-context schedule as device sections, in
    ROW_FIELDS order."""
    a = Recorder(tmp_path / "a.safetensors", dcp_size=2, page_size=16)
    b = Recorder(tmp_path / "b.safetensors", dcp_size=2, page_size=16)
    b._device.use_host_ring(4096)
    for k, kw in enumerate(_obs_stream(40, 5)):
        extra = {} if k % 3 == 0 else {"dcp_query_start_loc": torch.arange(k % 5 + 1),
                                       "dcp_tot_seq_lens": torch.full((k % 4,), k)}
        if k % 4 == 1:
            extra["ctx_chunks"] = torch.arange(1 + 4 * (k % 3))
        if k % 5 == 2:
            extra.update(group_seq_lens=torch.arange(k % 7), verify_row_lens=torch.arange(k % 3) - 1,
                         sparse_topk=torch.arange(3 * (k % 4)).reshape(-1, 3))
        assert a.observe(**kw, **extra) == b.observe(**kw, **extra)
    ca, cb = _columns(a.close()), _columns(b.close())
    assert {"obs.dqsl", "obs.tot", "obs.ctx", "obs.gsl", "obs.vrl", "obs.topk"} <= set(ca) and sorted(ca) == sorted(cb)
    for key in ca:
        assert np.array_equal(ca[key], cb[key]) or key == "obs.buffer", key



def _slot_forms(n: int, rng) -> list[dict]:
    """positions= and slot_mapping= in every form observe() takes, at n tokens (host tensors: the host ring)."""
    pos = torch.from_numpy(rng.integers(0, 1 << 20, n))  # int64, as vLLM's
    sm = torch.from_numpy(rng.integers(-1, 1 << 20, (2, n)))
    wide = torch.from_numpy(rng.integers(-1, 1 << 20, (n, 3)).astype(np.int32))
    return [dict(positions=pos, slot_mapping=sm[0]), dict(positions=pos.to(torch.int32), slot_mapping=sm[:1]),
            dict(positions=pos, slot_mapping=sm), dict(positions=pos, slot_mapping={1: sm[1], 0: sm[0]}),
            dict(positions=pos, slot_mapping={1: sm[1].to(torch.int32)}),
            dict(positions=pos[:n], slot_mapping=wide[:, 1:].T),  # strided rows, int32
            dict(positions=pos, slot_mapping={}), dict(positions=pos, slot_mapping=sm[:0])]


@hostring
@pytest.mark.kernel
def test_slot_sections_through_the_ring_equal_the_host_path(tmp_path, monkeypatch):
    """positions and slot_mapping of the device path (every form: 1-D, [groups, tokens], a dict, no group; int64
    and int32, strided) at awkward sizes are snapshotted raw, never copied on the host (no `HostPath.slots`), with
    the other device sections; the entries built at harvest equal the host path's, column for column."""
    kv = [{"name": "attn", "dcp": True, "block_size": 16}, {"name": "mamba", "dcp": False}]
    a = Recorder(tmp_path / "a.safetensors", dcp_size=2, page_size=16, kv_groups=kv)
    b = Recorder(tmp_path / "b.safetensors", dcp_size=2, page_size=16, kv_groups=kv)
    b._device.use_host_ring(4096)
    monkeypatch.setattr(b._host, "slots", lambda *x: pytest.fail("the device path copied the slots on the host"))
    rng = np.random.default_rng(11)
    i = 0
    for n in (0, 1, 127, 128, 129, 1000, 1500):
        for extra in _slot_forms(n, rng):
            seq = torch.from_numpy(rng.integers(0, 1 << 12, 3).astype(np.int32))
            kw = dict(step=i, site="attn_metadata", rank=i % 2, seq_lens=seq, num_reqs=3, num_reqs_padded=3,
                      buffer=i * 8, kv_pages=seq // 16 + 1, dcp_query_start_loc=torch.arange(4),
                      dcp_tot_seq_lens=seq.long(), **extra)
            assert a.observe(**kw) == b.observe(**kw) == i
            i += 1
    fa, fb = a.close(), b.close()
    assert a.dropped == b.dropped == 0 and not b._device.ring.pending and len(b) == i
    ca, cb = _columns(fa), _columns(fb)
    assert {"obs.slots", "rows.positions", "rows.slot_group"} <= set(ca) and sorted(ca) == sorted(cb)
    for key in ca:
        assert np.array_equal(ca[key], cb[key]), key
    assert cb["rows.positions"].size == 2 * (1 + 1 + 2 + 2 + 1 + 2) * sum((0, 1, 127, 128, 129, 1000, 1500)) // 2


@hostring
@pytest.mark.kernel
def test_slot_values_that_cannot_be_stored_are_dropped_at_harvest_or_at_once(tmp_path):
    """Negative positions and slot values int32 cannot hold are seen at harvest (dropped, counted, the others
    kept); lengths and groups are known from the shapes, so those are dropped at observe()."""
    rec = Recorder(tmp_path / "s.safetensors", dcp_size=2, kv_groups=[{"name": "attn", "dcp": True}])
    rec._device.use_host_ring()
    rec._host.slots = lambda *x: pytest.fail("the device path copied the slots on the host")
    t = torch.tensor
    base = dict(site="x", rank=0, seq_lens=t([5, 6], dtype=torch.int32), num_reqs=2, num_reqs_padded=2)
    good = dict(positions=t([3, 4]), slot_mapping=t([7, -1]))
    with pytest.warns(RuntimeWarning, match="dropped"):
        got = [rec.observe(step=k, **base, **x) for k, x in enumerate([
            good, dict(positions=t([3, -4]), slot_mapping=t([7, 8])),  # a negative position: at harvest
            dict(positions=t([3, 4]), slot_mapping=t([[7, 2**31]])), good,  # int32 cannot hold it: at harvest
            dict(positions=t([3, 4]), slot_mapping=t([7, 8, 9])),  # not one per position: at once
            dict(positions=t([3, 4]), slot_mapping={1: t([7, 8])}),  # a group the config does not name
            dict(positions=t([3, 4])), dict(positions=t([3, 4]), slot_mapping={0: t([1, 2]), 1: t([1])})])]
        rec.close()
    assert got[:4] == [0, 1, 2, 3] and got[4:] == [-1] * 4 and rec.dropped == 6 and len(rec) == 2
    d = read_dump(tmp_path / "s.safetensors")
    assert d["obs.step"].tolist() == [0, 3] and d["rows.positions"].tolist() == [3, 4, 3, 4]
    assert d["rows.slot_mapping"].tolist() == [7, -1, 7, -1]


@hostring
@pytest.mark.kernel
def test_buffer_keeps_the_fast_path(tmp_path, monkeypatch):
    """buffer= (a host int) rides on the fast path's launch: the general path never sees the engine's call, and the
    file holds the buffer given (or, without it, the view's storage), as the host path's does."""
    calls, a, b = _host_and_ring(monkeypatch, tmp_path)
    seq = torch.arange(1, 9, dtype=torch.int32)
    for i, buf in enumerate([None, 5, 2**40, None, 0, -3]):
        kw = _engine_kw(i, seq, seq // 2, torch.arange(9, dtype=torch.int32))
        assert a.observe(**kw, buffer=buf) == b.observe(**kw, buffer=buf) == i
    with pytest.warns(RuntimeWarning, match="dropped"):
        assert b.observe(**kw, buffer=2**63) == -1  # the general path's check, and its drop
    fa, fb = a.close(), b.close()
    assert calls == ["attn_metadata", "attn_metadata"] and b.dropped == 1
    assert read_dump(fb[0])["obs.buffer"].tolist()[1:3] == [5, 2**40]
    ca, cb = _columns(fa), _columns(fb)
    assert sorted(ca) == sorted(cb)
    for key in ca:
        assert np.array_equal(ca[key], cb[key]) or key == "obs.buffer", key


def _engine_kw(i: int, seq, dcp, qsl) -> dict:
    return dict(step=i // 4, site="attn_metadata", rank=i % 2, seq_lens=seq, num_reqs=seq.numel() - 1,
                num_reqs_padded=seq.numel(), dcp_local_seq_lens=dcp, query_start_loc=qsl)


def _host_and_ring(monkeypatch, tmp_path, **config) -> tuple[list, Recorder, Recorder]:
    """A host-path Recorder and a host-ring one, and the sites of the calls the general device path sees."""
    calls = []
    general = DevicePath.observe_device
    monkeypatch.setattr(DevicePath, "observe_device", lambda self, *a: calls.append(a[1]) or general(self, *a))
    a = Recorder(tmp_path / "a.safetensors", dcp_size=2, **config)
    b = Recorder(tmp_path / "b.safetensors", dcp_size=2, **config)
    b._device.use_host_ring()
    return calls, a, b



@hostring
@pytest.mark.kernel
def test_the_engines_call_takes_the_fast_path_and_records_the_same(tmp_path, monkeypatch):
    """What an engine passes each step (seq_lens, dcp_local_seq_lens, query_start_loc as int32 device
    tensors, or query_start_loc as numpy: the vLLM plugin's form) goes through observe()'s fast path
    after the first observation at a site (the general path checks and remembers the site name); the
    file equals the host path's, buffer ids included."""
    calls, a, b = _host_and_ring(monkeypatch, tmp_path)
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
    """Anything but what the fast path takes (int64 or strided views of the first three sections, a strided or
    int16 later one, a slot mapping as a dict, 2-D positions, a numpy scalar, a graph mode by name) leaves the
    fast path: the same file as the host path, and the general path saw each of them."""
    calls, a, b = _host_and_ring(monkeypatch, tmp_path, page_size=16)
    seq = torch.arange(1, 9, dtype=torch.int32)
    kw = _engine_kw(0, seq, seq // 2, torch.arange(9, dtype=torch.int32))
    pos = torch.arange(5, dtype=torch.int64)
    odd = [dict(seq_lens=seq.long()), dict(dcp_local_seq_lens=torch.arange(16, dtype=torch.int32)[::2]),
           dict(kv_pages=torch.arange(16, dtype=torch.int32)[::2]), dict(dcp_tot_seq_lens=seq.to(torch.int16)),
           dict(positions=pos, slot_mapping={0: pos * 3}), dict(positions=pos[None], slot_mapping=pos[None]),
           dict(step=np.int64(3)), dict(graph="replay"), dict(ubatch=np.int32(0)),
           dict(query_start_loc=torch.arange(9)), dict(ctx_chunks=torch.arange(5, dtype=torch.int32)),
           dict(group_seq_lens=seq), dict(verify_row_lens=seq - 3), dict(sparse_topk=seq[:6].reshape(2, 3))]
    # (a query_start_loc that does not cover the rows stays on the fast path: not recorded, as on the host)
    for i, extra in enumerate([{}, *odd, {}, dict(query_start_loc=seq)]):
        assert a.observe(**{**kw, **extra}) == b.observe(**{**kw, **extra}) == i
    fa, fb = a.close(), b.close()
    assert len(calls) == 1 + len(odd) and a.dropped == b.dropped == 0
    ca, cb = _columns(fa), _columns(fb)
    assert sorted(ca) == sorted(cb) and all(np.array_equal(ca[k], cb[k]) for k in ca)


@hostring
@pytest.mark.kernel
@pytest.mark.parametrize("groups", [1, 2])
def test_every_argument_set_the_plugin_passes_takes_the_fast_path(tmp_path, monkeypatch, groups):
    """The sets bench_record.py --sets measures (the fast-path set, + positions + an int64 [groups, tokens] slot
    mapping, + dcp_query_start_loc + dcp_tot_seq_lens, + kv_pages; the slot mapping also 1-D) all go through the
    fast path after the first observation, no host copy of a slot section, over sizes around the kernel's block
    of 1,024 values (several programs): the file equals the host path's, slot entries included."""
    kv = [{"name": "attn", "dcp": True, "block_size": 16}, {"name": "mamba", "dcp": False}]
    calls, a, b = _host_and_ring(monkeypatch, tmp_path, page_size=16, kv_groups=kv)
    copies = []
    host = b._host.slots
    b._host.slots = lambda *x: copies.append(1) or host(*x)
    rng = np.random.default_rng(groups)
    for i, (rows, toks) in enumerate([(3, 9), (1, 0), (2, 1), (127, 381), (129, 600), (16, 1100), (300, 300)] * 2):
        seq = torch.from_numpy(rng.integers(0, 1 << 20, rows).astype(np.int32))
        q = torch.from_numpy(np.linspace(0, toks, rows + 1).astype(np.int32))
        kw = _engine_kw(i, seq, seq // 2, q)
        if i % 4:
            kw.update(positions=torch.from_numpy(rng.integers(0, 1 << 20, toks)),
                      slot_mapping=torch.from_numpy(rng.integers(-1, 1 << 30, (groups, toks))))
            if groups == 1 and i % 3 == 0:
                kw["slot_mapping"] = kw["slot_mapping"][0]  # (1-D: group 0)
        if i % 4 >= 2:
            kw.update(dcp_query_start_loc=q.long(), dcp_tot_seq_lens=(seq + 7).long())
        if i % 4 == 3:
            kw["kv_pages"] = seq // 16 + 1
        assert a.observe(**kw) == b.observe(**kw) == i
    fa, fb = a.close(), b.close()
    assert calls == ["attn_metadata"] and not copies and a.dropped == b.dropped == 0
    ca, cb = _columns(fa), _columns(fb)
    assert sorted(ca) == sorted(cb) and all(np.array_equal(ca[k], cb[k]) for k in ca)
    assert ca["rows.slot_mapping"].size and set(ca["rows.slot_group"].tolist()) == set(range(groups))


@hostring
@pytest.mark.kernel
def test_the_fast_path_drops_bad_device_values_at_harvest(tmp_path):
    """Values only the kernel sees (a negative position or dcp_tot_seq_len, a slot mapping value int32 cannot
    hold, in the first or a later program) drop the observation at harvest, counted; a -1 slot is kept."""
    rec = Recorder(tmp_path / "v.safetensors", dcp_size=2)
    rec._device.use_host_ring()
    seq = torch.arange(1, 9, dtype=torch.int32)
    kw = _engine_kw(0, seq, seq // 2, torch.arange(9, dtype=torch.int32))
    pos = torch.arange(2000, dtype=torch.int64)
    slot = torch.arange(2000, dtype=torch.int64)
    good = dict(positions=pos, slot_mapping=slot - 1)
    bad = [dict(positions=pos - 1, slot_mapping=slot), dict(positions=pos, slot_mapping=slot + 2**40),
           dict(dcp_tot_seq_lens=seq - 2)]
    with pytest.warns(RuntimeWarning, match="dropped"):  # (at a harvest: inside a later observe(), or at close())
        assert [rec.observe(**{**kw, **x}) for x in (good, *bad, good)] == [0, 1, 2, 3, 4]
        rec.close()
    d = read_dump(tmp_path / "v.safetensors")
    assert rec.dropped == 3 and d.n == 2
    assert np.array_equal(d["rows.positions"], np.tile(np.arange(2000), 2))  # the two good ones
    assert np.array_equal(d["rows.slot_mapping"], np.tile(np.arange(-1, 1999), 2))


@hostring
@pytest.mark.kernel
def test_the_fast_path_drops_and_skips_what_the_general_path_does(tmp_path):
    rec = Recorder(tmp_path / "d.safetensors", dcp_size=2)
    rec._device.use_host_ring()
    seq = torch.arange(1, 9, dtype=torch.int32)
    kw = _engine_kw(0, seq, seq // 2, torch.arange(9, dtype=torch.int32))
    assert rec.observe(**kw) == 0
    with pytest.warns(RuntimeWarning, match="dropped"):
        got = [rec.observe(**{**kw, **bad}) for bad in (dict(rank=2), dict(parent=1), dict(num_reqs=9),
                                                          dict(num_reqs_padded=2**31), dict(step=2**63),
                                                          dict(tok_start=-2), dict(graph=4))]
    assert got == [-1] * 7 and rec.dropped == 7
    rec._device.capturing = lambda: True
    assert rec.observe(**kw) == -1 and rec.skipped_capture == 1
    rec._device.capturing = lambda: False
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
    general = DevicePath.observe_device
    monkeypatch.setattr(DevicePath, "observe_device", lambda self, *a: calls.append(a[1]) or general(self, *a))
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
    ring = b._device.ring
    assert ring.go3 is not None and ring.how3 in ("the launcher's C entry", "Triton's compiled launcher")
    fa, fb = a.close(), b.close()
    assert calls == ["attn_metadata"] and a.dropped == b.dropped == 0
    ca, cb = _columns(fa), _columns(fb)
    assert sorted(ca) == sorted(cb) and all(np.array_equal(ca[k], cb[k]) for k in ca)
