"""device_checks.py: the Guard's device ring through the check kernel on CPU tensors under Triton's interpreter (or on a
GPU): slots sized from the first observation and grown for a larger one, the flag, the ring frozen at the wrong one,
a larger observation once a graph holds the ring, a captured observation before the ring exists."""

import contextlib
import warnings

import numpy as np
import pytest
import torch
from conftest import hostring

from dcptool.dcp.reference import local_np
from dcptool.dump import addr_words, read_dump
from dcptool.engine.guard.guard import Guard

pytestmark = pytest.mark.kernel


def _dev() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _obs(step, rows, wrong=False, rank=1, il=1):
    seq = torch.arange(1, rows + 1, dtype=torch.int32) * 7
    dcp = torch.from_numpy(local_np(seq.numpy().astype(np.int64), 2, rank, il).astype(np.int32))
    if wrong:
        dcp[-1] += 1
    return dict(step=step, site="attn", rank=rank, seq_lens=seq.to(_dev()), num_reqs=rows, num_reqs_padded=rows,
                dcp_local_seq_lens=dcp.to(_dev()))


def _settle() -> None:
    """On a GPU, wait for the stream: the kernel writes the flag asynchronously (observe() never waits for it)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def test_ring_grows_for_a_larger_observation_and_is_frozen_at_the_wrong_one(tmp_path):
    """Slots sized from the first observation (64 rows at least); a larger one grows the ring (what it held kept);
    the flag and the frozen index are set by the wrong one, and later observations leave the ring as it was."""
    g = Guard(tmp_path / "g", 2, 1, keep=4, kernel=True)
    g.observe(**_obs(0, 3))
    assert g._dev.cap == 64
    g.observe(**_obs(1, 100))
    assert g._dev.cap == 200 and not g._dev.wrong_seen()
    g.observe(**_obs(2, 5, wrong=True))
    _settle()
    assert g._dev.flag_np[0] == 1 and g._dev.state[1].item() == 3
    with pytest.warns(RuntimeWarning, match=r"\(values\) at step 2"):
        g.observe(**_obs(3, 6))
    for k in range(4, 9):
        g.observe(**_obs(k, 2))
    assert g.close() == g.dumped and (g.count, g.wrong, g.first_index) == (9, 1, 2)
    d = read_dump(g.dumped)
    assert d["obs.step"].tolist() == [0, 1, 2] and [d.seq_lens_of(i).size for i in range(3)] == [3, 100, 5]
    assert d.seq_lens_of(1).tolist() == list(range(7, 701, 7))


def test_a_larger_observation_after_capture_is_checked_not_kept(tmp_path):
    """Once a launch was captured the ring keeps its address: a larger observation is checked (the flag) but not
    kept, so the dump holds what came before it."""
    g = Guard(tmp_path / "g", 2, 1, keep=4, kernel=True, on_wrong="count")
    g.observe(**_obs(0, 3))
    g._dev.frozen = True  # (what a captured launch does)
    g.observe(**_obs(1, 500, wrong=True))
    _settle()
    assert g._dev.cap == 64 and g._dev.wrong_seen()
    kept, count, wrong = g._dev.kept()
    assert [(k[0], k[2] is None) for k in kept] == [(0, False), (1, True)] and (count, wrong) == (2, 1)
    assert g.close() is None and (g.first_rule, g.first_index) == ("values", 1)
    g = Guard(tmp_path / "g", 2, 1, keep=4, kernel=True)
    g.observe(**_obs(0, 3))
    g._dev.frozen = True
    g.observe(**_obs(1, 500, wrong=True))
    with pytest.warns(RuntimeWarning, match=r"after step 0 \(the wrong one was larger than the ring's slots\)"):
        path = g.close()
    assert read_dump(path)["obs.step"].tolist() == [0]


def test_a_first_observation_inside_capture_is_skipped(tmp_path):
    """The ring is allocated outside capture (its zeroing would be captured): before the first eager observation,
    a captured one is counted in skipped_capture, not checked; after it, captured launches are checked."""
    g = Guard(tmp_path / "g", 2, 1, keep=4, kernel=True, on_wrong="count")
    g.observe(**_obs(0, 3))  # makes the device path
    g._dev.ring = None
    g._dev.capturing = lambda: True
    assert g.observe(**_obs(1, 3, wrong=True)) == -1 and (g.skipped_capture, g.dropped) == (1, 0)
    g._dev.capturing = lambda: False
    g.observe(**_obs(2, 3))
    g._dev.capturing = lambda: True
    assert g.observe(**_obs(3, 3, wrong=True)) >= 0 and g._dev.frozen
    g._dev.capturing = lambda: False
    assert g.close() is None and (g.count, g.wrong, g.first_index) == (3, 1, 2)


class _Capture:
    """Stands in for the kernel while a 'capture' is on: the launch is kept, not run, as a CUDA graph keeps it;
    replay() runs the kept launches again with the same arguments, as a graph replay does."""

    def __init__(self, kernel):
        self.kernel, self.kept, self.on = kernel, [], False

    def __getitem__(self, grid):
        def launch(*args, **kw):
            if self.on:
                self.kept.append((grid, args, kw))
            else:
                self.kernel[grid](*args, **kw)
        return launch

    def replay(self):
        for grid, args, kw in self.kept:
            self.kernel[grid](*args, **kw)


def test_every_replay_of_a_captured_launch_gets_its_own_index_and_slot(tmp_path):
    """The device counter (not the host) numbers observations: a captured launch replayed 5 times is 5
    observations in 5 slots; a replay that sees a wrong view is flagged with its own index and dumped last."""
    g = Guard(tmp_path / "g", 2, 1, keep=8, kernel=True)
    o = _obs(0, 6)
    g.observe(**o)  # eager: the ring
    cap = g._dev.kernel = _Capture(g._dev.kernel)
    g._dev.go = g._dev.dispatch  # (on a GPU the launch is the launcher's C entry: the stand-in takes the dispatch)
    g._dev.capturing = lambda: True
    cap.on = True
    assert g.observe(**dict(o, step=1)) == 1  # captured: not run
    cap.on = False
    g._dev.capturing = lambda: False
    assert g._dev.frozen and g._dev.state[0].item() == 1
    for _ in range(5):
        cap.replay()
    ring = g._dev.ring.cpu().numpy()
    assert g._dev.state[0].item() == 6 and sorted(ring[:6, 0].tolist()) == [1, 2, 3, 4, 5, 6]
    assert not g._dev.wrong_seen()
    o["dcp_local_seq_lens"][2] += 1  # the buffer the graph reads goes wrong between replays
    cap.replay()
    cap.replay()
    assert g._dev.wrong_seen() and g._dev.state[1].item() == 7 and g._dev.state[2].item() == 2
    with pytest.warns(RuntimeWarning, match=r"\(values\) at step 1"):
        path = g.close()
    d = read_dump(path)
    assert d.n == 7 and d["obs.step"].tolist() == [0] + [1] * 6 and g.count == 8 and g.wrong == 2


@pytest.mark.parametrize("per_build", [False, True])
def test_a_replayed_launch_is_dumped_with_the_host_values_of_its_graph_not_of_the_capture_s_build(tmp_path,
                                                                                                  per_build):
    """A captured launch keeps the host values every replay shares (the addresses the graph reads, the buffers'
    capacities, the block sizes), not those of the build that was captured (the host copy of seq_lens it read, its
    FlashInfer plans): the replays run on later lengths, and a dump pairing them with the capture's copies would
    have replay report host-copy and plan-pages on builds that were right. A graph whose buffer goes wrong at a
    replay dumps the replays with its addresses and capacities, and replay names the wrong view alone."""
    names = ["dcp_context_kv_lens", "seq_lens"]
    g = Guard(tmp_path / "g", 2, 1, keep=8, kernel=True, page_size=4, attn_tensors=names)
    o = _obs(0, 6)
    g.observe(**o)  # eager: the ring
    cap = g._dev.kernel = _Capture(g._dev.kernel)
    g._dev.go = g._dev.dispatch
    host = o["seq_lens"].cpu().numpy()
    local = local_np(host.astype(np.int64), 2, 1, 1)
    shared = dict(attn_addrs=_words(0x7F0000001000, 0x7F0000002000), attn_caps=np.array([64, 64], np.int32),
                  kv_block_sizes=np.array([4, 4, 4], np.int32))
    build = dict(host_seq_lens=host.copy(), host_seq_lens_after=host.copy(),
                 kv_prefill_pages=np.full(6, -1, np.int32), kv_last_page=np.where(local % 4, local % 4, 4))
    g._dev.capturing, cap.on = (lambda: True), True
    g.observe(**dict(o, step=1, graph=2, query_start_loc=torch.arange(7, dtype=torch.int32).to(_dev()), **shared,
                     **(build if per_build else {})))
    g._dev.capturing, cap.on = (lambda: False), False
    for k in range(4):
        o["seq_lens"] += 3  # the engine's lengths move on: the replays read them, and a view made from them
        o["dcp_local_seq_lens"].copy_(torch.from_numpy(local_np(o["seq_lens"].cpu().numpy().astype(np.int64), 2, 1,
                                                                1).astype(np.int32)).to(_dev()))
        if k == 3:
            o["dcp_local_seq_lens"][2] += 1
        cap.replay()
    with pytest.warns(RuntimeWarning, match=r"\(values\) at step 1"):
        path = g.close()
    d = read_dump(path)
    assert d.n == 5 and d["obs.step"].tolist() == [0, 1, 1, 1, 1]
    from dcptool.check.replay import replay

    assert {f.rule for f in replay(d, "torch").findings} == {"mismatch"}
    c = d.columns
    for f, want in shared.items():  # every replay carries the graph's own
        rows = c[f"rows.{f}"].reshape(-1, want.size)
        assert rows.shape[0] == 4 and (rows == want).all()
    for f in build:
        assert f"rows.{f}" not in c or c[f"rows.{f}"].size == 0


def _words(*ptrs) -> np.ndarray:
    return addr_words(list(ptrs))


@pytest.mark.parametrize("moved_at", [None, 0, 3])
def test_an_address_that_moved_is_caught_at_the_replay_that_reads_it(tmp_path, moved_at):
    """A graph captures a build's metadata tensors at their addresses (the capture's launch is kept, with its host
    values); each later step builds eagerly, then replays the graph: the step whose build hands attention another
    address than the graph captured is flagged (graph-addr) at its own observation, as replay flags it, and
    nothing before it; a run whose addresses never move stays silent. (The capture stands in on the CPU.)"""
    g = Guard(tmp_path / "g", 2, 1, keep=8, kernel=True, attn_tensors=["dcp_context_kv_lens", "seq_lens"])
    o = _obs(0, 6)
    g.observe(**o)  # eager: the ring
    cap = g._dev.kernel = _Capture(g._dev.kernel)
    g._dev.go = g._dev.dispatch
    g._dev.capturing, cap.on = (lambda: True), True
    captured = _words(0x7F0000001000, 0x7F0000002000)
    assert g.observe(**dict(o, step=1, graph=2, attn_addrs=captured)) == 1  # the graph's capture
    g._dev.capturing, cap.on = (lambda: False), False
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step in range(2, 8):
            built = (captured if moved_at is None or step - 2 < moved_at else
                     _words(0x7F0000009000 + step, 0x7F0000002000))
            g.observe(**dict(o, step=step, graph=3, attn_addrs=built, graph_addrs=captured))  # the step's build
            cap.replay()  # the graph reads what it captured
            _settle()
            assert g._dev.wrong_seen() == (moved_at is not None and step - 2 >= moved_at)
        path = g.close()
    if moved_at is None:
        assert path is None and g.wrong == 0 and not said
        return
    assert len(said) == 1 and f"(graph-addr) at step {2 + moved_at}" in str(said[0].message)
    d = read_dump(path)
    last = d.n - 1
    assert d["obs.step"][last] == 2 + moved_at and d["obs.graph"][last] == 3
    from dcptool.check.replay import replay

    got = [f for f in replay(d, "torch").findings if f.rule == "graph-addr"]
    assert [f.obs for f in got] == [last] and "dcp_context_kv_lens" in got[0].message


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (to verify on the H200)")
def test_a_moved_address_in_a_real_cuda_graph_is_caught_at_its_replay(tmp_path):
    """vLLM's FULL graphs: a builder that allocates its per-request tensor anew at each build (the pre-fix
    FlashAttention) hands the step's build another address than the graph captured; the Guard flags the first such
    step, eagerly, before its replay, and the captured launch's replays stay checked in their own slots."""
    g = Guard(tmp_path / "g", 2, 1, keep=16, attn_tensors=["dcp_context_kv_lens"])
    o = _obs(0, 6)
    g.observe(**o)
    torch.cuda.synchronize()
    held = [torch.zeros(6, dtype=torch.int32, device="cuda")]
    cg = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cg):
        g.observe(**dict(o, step=1, graph=2, attn_addrs=_words(held[0].data_ptr())))
    captured = _words(held[0].data_ptr())
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for step in range(2, 6):
            if step == 4:
                held.append(torch.zeros(6, dtype=torch.int32, device="cuda"))  # (the old one alive: a new address)
            g.observe(**dict(o, step=step, graph=3, attn_addrs=_words(held[-1].data_ptr()), graph_addrs=captured))
            cg.replay()
            torch.cuda.synchronize()
            assert g._dev.wrong_seen() == (step >= 4)
        path = g.close()
    assert len(said) == 1 and "(graph-addr) at step 4" in str(said[0].message)
    d = read_dump(path)
    assert d["obs.step"][d.n - 1] == 4


# The host-value rules, each as (Guard arguments, the view's interleave, host values that pass, ones that break):
# vLLM #51031's block sizes (manager 16, kernel 8, interleave 16: dealt by the manager's block / by the kernel's),
# vllm-ascend #16168's capacity (a buffer holding the 6 padded requests / one row short)
HOST_RULES = {
    "kernel-block": (dict(cp_interleave=16, kv_groups=[{"name": "attn", "dcp": True}]), 16,
                     dict(kv_block_sizes=np.array([16, 8, 16], np.int32)),
                     dict(kv_block_sizes=np.array([16, 8, 8], np.int32))),
    "capacity": (dict(attn_tensors=["dcp_context_kv_lens"]), 1,
                 dict(attn_addrs=addr_words([0x7F0000001000]), attn_caps=np.array([6], np.int32)),
                 dict(attn_addrs=addr_words([0x7F0000001000]), attn_caps=np.array([5], np.int32))),
}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (to verify on the H200)")
@pytest.mark.parametrize("in_graph", [False, True])
@pytest.mark.parametrize("rule", sorted(HOST_RULES))
def test_a_host_value_rule_is_caught_eager_and_in_a_real_cuda_graph(tmp_path, rule, in_graph):
    """Each rule of host values, broken in one build, is flagged under its name eagerly and, captured in a FULL
    graph, at the replay that runs it (the verdict rides in the captured launch); the same build right stays
    silent; the Guard's dump replays to the rule."""
    kw, il, right, broken = HOST_RULES[rule]
    for host, wrong in ((right, False), (broken, True)):
        g = Guard(tmp_path / f"g{wrong}{in_graph}", 2, kw.get("cp_interleave", 1), keep=16,
                  **{k: v for k, v in kw.items() if k != "cp_interleave"})
        o = _obs(0, 6, il=il)
        g.observe(**o)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            if in_graph:
                cg = torch.cuda.CUDAGraph()
                with torch.cuda.graph(cg):
                    g.observe(**dict(o, step=1, graph=2, **host))
                cg.replay()
            else:
                g.observe(**dict(o, step=1, **host))
            torch.cuda.synchronize()
            assert g._dev.wrong_seen() == wrong
            path = g.close()
        assert (path is not None) == wrong and (len(said) == 1) == wrong
        if wrong:
            assert f"({rule})" in str(said[0].message)
            from dcptool.check.replay import replay

            assert rule in {f.rule for f in replay(read_dump(path), "torch").findings}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (to verify on the H200)")
def test_a_real_cuda_graph_replay_is_checked_each_time(tmp_path):
    g = Guard(tmp_path / "g", 2, 1, keep=16)
    o = _obs(0, 6)
    g.observe(**o)
    torch.cuda.synchronize()
    cg = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cg):
        g.observe(**dict(o, step=1))
    for _ in range(10):
        cg.replay()
    o["dcp_local_seq_lens"][2] += 1
    cg.replay()
    torch.cuda.synchronize()
    assert g._dev.wrong_seen() and g._dev.state[0].item() == 12 and g._dev.state[1].item() == 12
    with pytest.warns(RuntimeWarning, match="dcptool Guard"):
        path = g.close()
    assert read_dump(path).n == 12


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (to verify on the H200)")
def test_on_a_gpu_the_launch_is_the_checked_launcher(tmp_path):
    """The first eager observe checks the cheap launch on known values (once per process and device); observe()
    then calls it, not Triton's dispatch, and it catches and keeps as the dispatch does."""
    g = Guard(tmp_path / "g", 2, 1, keep=4)
    g.observe(**_obs(0, 6))
    how = g._dev.how
    assert g._dev.go != g._dev.dispatch and how.startswith(("the launcher's C entry", "Triton's compiled")), how
    g.observe(**_obs(1, 6, wrong=True))
    torch.cuda.synchronize()
    with pytest.warns(RuntimeWarning, match=r"\(values\) at step 1"):
        g.observe(**_obs(2, 6))
    d = read_dump(g.close())
    assert d.n == 2 and d.dcp_of(1).tolist() != d.dcp_of(0).tolist()


def test_host_arrays_inside_capture_are_left_out(tmp_path):
    """On a GPU, host arrays (the vLLM plugin's numpy query_start_loc, page counts, slot entries) are not read inside
    capture: a replay could only re-read their capture values (and copying them there would break the graph). The
    device tensors are checked; a build whose DCP view itself is on the host is skipped. (A CPU run stands in for
    the GPU: the device path is told it runs on one, and that it captures.)"""
    g = Guard(tmp_path / "g", 2, 1, keep=4, kernel=True, on_wrong="count", page_size=4)
    o = _obs(0, 4)
    g.observe(**o)
    g._dev.cuda, g._dev.capturing = True, lambda: True
    qsl = np.array([0, 1, 2, 3, 9], np.int32)  # its last row is wrong for dcp_query_start_loc below
    host = dict(query_start_loc=qsl, kv_pages=np.array([9, 9, 9, 9], np.int32),  # page counts all wrong
                dcp_query_start_loc=torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32), positions=np.arange(4),
                slot_mapping=np.array([[5, 5, 5, 5]]))  # rank 1 writes positions it does not own
    assert g.observe(**dict(o, step=1, **host)) == 1  # checked, the host arrays left out: nothing wrong
    assert g.observe(**dict(o, step=2, dcp_local_seq_lens=o["dcp_local_seq_lens"].cpu().numpy())) == -1
    assert g.skipped_capture == 1
    assert g.observe(**_obs(3, 4, wrong=True)) == 2  # the device tensors still checked inside capture
    g._dev.cuda, g._dev.capturing = False, lambda: False
    assert g.close() is None and (g.count, g.wrong, g.first_rule, g.first_index) == (3, 1, "values", 2)
    read = Guard(tmp_path / "h", 2, 1, on_wrong="count", page_size=4)  # (the same build, its host arrays read)
    read.observe(**dict(o, step=1, **host))
    _settle()
    read.close()  # (the flag seen: its rule named)
    assert read.first_rule == "pages"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (to verify on the H200)")
def test_on_a_gpu_host_arrays_are_copied_without_a_sync(tmp_path):
    """The vLLM plugin's numpy query_start_loc and page counts: through pinned memory, no host synchronisation."""
    g = Guard(tmp_path / "g", 2, 1, keep=4, page_size=4)
    o = _obs(0, 4)
    g.observe(**o)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        g.observe(**dict(o, step=1, query_start_loc=np.arange(5, dtype=np.int32),
                         kv_pages=np.array([9, 9, 9, 9], np.int32)))  # page counts all wrong
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert g._dev.wrong_seen() and g.dropped == 0
    with pytest.warns(RuntimeWarning, match=r"\(pages\) at step 1"):
        g.close()


class _NoGpu:
    """torch for _launcher's probe on the CPU: no pinned memory, no streams, nothing to wait for."""

    def __init__(self):
        self._C = type("C", (), {"_cuda_getCurrentRawStream": staticmethod(lambda i: 0)})
        self.cuda = type("Cuda", (), {"synchronize": staticmethod(lambda d=None: None),
                                      "device": staticmethod(lambda d: contextlib.nullcontext())})

    def __getattr__(self, k):
        return getattr(torch, k)

    def zeros(self, *a, pin_memory=False, **k):
        return torch.zeros(*a, **k)


@hostring
def test_the_launcher_check_takes_the_first_way_that_writes_what_the_dispatch_does(tmp_path, monkeypatch):
    """_launcher on the CPU (the interpreted dispatch stands in for the GPU's): the probe's known words hold, a
    launch that writes one word otherwise is refused (and said why), the next way is taken, once per device."""
    from dcptool.engine.guard import device_checks as D
    from dcptool.engine.snapshot import launch as L

    g = Guard(tmp_path / "g", 2, 1, kernel=True)
    g.observe(**_obs(0, 3))
    dev = g._dev
    dev.torch, dev.did = _NoGpu(), 0
    real = D._Probe.__init__

    def probe(self, d):
        real(self, d)
        self.device = torch.device("cuda", 0)  # (its index names the stream: none here)

    monkeypatch.setattr(D._Probe, "__init__", probe)
    monkeypatch.setattr(D, "_CHECKED", {})
    monkeypatch.setitem(L.WAYS, "c-entry", ("the launcher's C entry", lambda ck, variadic: lambda raw, n, *a:
                                            dev.dispatch(raw, n, *a[:10], 999, *a[11:])))  # (the step argument wrong)
    monkeypatch.setitem(L.WAYS, "cuda-core", ("cuda.core", lambda ck, variadic: None))  # (not installed)
    monkeypatch.setitem(L.WAYS, "compiled", ("Triton's compiled launcher", lambda ck, variadic: dev.dispatch))
    go, how = D._launcher(dev)
    assert go == dev.dispatch and how.startswith("Triton's compiled launcher (the launcher's C entry: RuntimeError")
    assert "cuda.core: RuntimeError('not available here')" in how
    assert D._CHECKED[0] == (go, how)


def _engine(dev: str, fields: str = "all"):
    """benchmarks/guard_engine's batch (decode256's 256 rows) with the keywords the vLLM plugin passes (`all`: every
    field, the host values included) and the plugin's Guard settings."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    import guard_engine as ge

    e = ge.Engine(torch.device(dev), ge.SHAPES["decode256"], 8, torch.float32, fields, matmuls=0)
    e.update()
    return e, ge


class _HostReads(torch.overrides.TorchFunctionMode):
    """Records each call that brings one of `watched`'s tensors (a view of one counts) to the host: .cpu(), .item(),
    .tolist(), .numpy(), np.asarray's __array__, a conversion to a Python number, .to() the CPU, a copy_ out of it."""

    READS = {torch.Tensor.cpu, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__,
             torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.__bool__, torch.Tensor.__float__}

    def __init__(self, watched):
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in watched}
        self.seen: list[str] = []

    def _watched(self, x) -> bool:
        return isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() in self.storages

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to_cpu = func is torch.Tensor.to and any(
            (isinstance(a, torch.device) and a.type == "cpu") or a == "cpu" for a in (*args[1:], kwargs.get("device"))
            if isinstance(a, (str, torch.device)))
        out_of = func is torch.Tensor.copy_ and len(args) > 1 and self._watched(args[1]) and not self._watched(args[0])
        if (func in self.READS or to_cpu) and args and self._watched(args[0]) or out_of:
            self.seen.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


@pytest.mark.parametrize("fields", ["all", "flashinfer"])
def test_observe_never_brings_a_device_tensor_to_the_host(tmp_path, monkeypatch, fields):
    """Every field the plugin passes, host values included: observe() on the device path reads none of the engine's
    device tensors on the host (on a GPU each such read waits for the stream). The host-value checks that compare
    with the device's seq_lens and query_start_loc are the kernel's. (CPU tensors stand in for the device's; the
    launch is a stand-in: what the Python does is the question, so they take the device path on a GPU machine too.)
    The recorder of reads is itself checked on a read."""
    import dcptool.engine.guard.guard as guard
    from dcptool.engine.guard.device_checks import KERNEL_ARGS, GuardDevice

    monkeypatch.setattr(guard, "_compiled_on_a_gpu", lambda: False)
    e, ge = _engine("cpu", fields)
    watched = [v for v in e.kv.values() if isinstance(v, torch.Tensor)]
    assert {"seq_lens", "query_start_loc", "host_seq_lens", "kv_prefill_pages", "kv_last_page"} <= set(e.kv)
    g = Guard(tmp_path, ge.N, ge.INTERLEAVE, kernel=True, on_wrong="count", **ge.guard_config())
    g._dev = dev = GuardDevice(torch, e.seq.device, g.keep, g._spec, None, None)
    launched = []
    dev.go = lambda *a: launched.append(a)
    with _HostReads(watched) as reads:
        for s in range(3):
            assert e.observe(g, s) == s
    assert reads.seen == [] and len(launched) == 3 and g.dropped == 0
    args = dict(zip(("raw", "grid", *KERNEL_ARGS), launched[-1]))
    assert (args["n_hs"], args["n_pre"], args["n_last"]) == (256, 256, 256)  # (the host values handed over)
    with _HostReads(watched) as reads:
        np.asarray(e.kv["seq_lens"])  # (what the host path of these checks did)
        e.kv["query_start_loc"][:3].tolist()
    assert reads.seen == ["__array__", "tolist"]


@hostring  # (its fences are the host ring's stand-ins, held by the test; a GPU's are CUDA events)
def test_a_full_host_values_ring_is_never_waited_for_and_no_slot_is_overwritten_before_its_launch_ran(tmp_path,
                                                                                                      monkeypatch):
    """The host-values ring (the snapshot ring's host stand-in, its fences held as a GPU that lags holds them): slots
    are handed out until it is full; a build that finds it full is checked without its host values (a wrong host
    copy there is not decided, and counted in host_undecided), nothing waits, and the slots of launches not known to
    have run keep their words. Once the fences complete, the next build collects their slots and is decided."""
    from dcptool.engine.guard.device_checks import HostValues
    from dcptool.engine.snapshot.ring import HostEvent

    g = Guard(tmp_path / "g", 2, 1, keep=8, kernel=True, on_wrong="count", page_size=4)
    o = _obs(0, 10)
    host = o["seq_lens"].cpu().numpy()
    g.observe(**o)
    g._dev.host_values = hv = HostValues(None, 63)  # (21 words a build of 10 rows' host copy: three fit)
    monkeypatch.setattr(HostEvent, "hold", True)
    waits = HostEvent.waits
    for s in (1, 2, 3):
        g.observe(**dict(o, step=s, host_seq_lens=host + 0))
    held = hv.ring.np[:63].copy()
    wrong = host.copy()
    wrong[4] += 1
    assert g.observe(**dict(o, step=4, host_seq_lens=wrong)) == 4  # (the ring full: checked, its host copy not)
    _settle()
    assert (g.host_undecided, g._dev.wrong_seen(), len(hv.ring.pending)) == (1, False, 3)
    assert np.array_equal(hv.ring.np[:63], held) and HostEvent.waits == waits
    monkeypatch.setattr(HostEvent, "hold", False)  # (the launches ran)
    assert g.observe(**dict(o, step=5, host_seq_lens=wrong)) == 5
    g.close()
    assert (g.first_rule, g.first_index, g.host_undecided, HostEvent.waits) == ("host-copy", 5, 1, waits)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (to verify on the H200)")
@pytest.mark.parametrize("fields", ["all", "flashinfer"])
def test_on_a_gpu_every_field_is_checked_with_no_host_sync(tmp_path, fields):
    """Eager builds with every field the plugin passes (the host copy of seq_lens and FlashInfer's plans included):
    no host synchronisation in observe() (torch.cuda.set_sync_debug_mode("error") raises on one), every build
    checked, none wrong, none dropped (a sync raising inside observe() would be dropped); then a host copy one row
    ahead and a last page one off, each caught by the kernel under its own name, with no sync either."""
    e, ge = _engine("cuda", fields)
    g = Guard(tmp_path / "g", ge.N, ge.INTERLEAVE, on_wrong="count", **ge.guard_config())
    e.observe(g, 0)  # (the first: the ring allocated, the launch checked once: it waits)
    torch.cuda.synchronize()
    for s in range(1, 200):
        if s % 4 == 0:
            e.update()  # (the engine's step: not the Guard's to answer for)
        torch.cuda.set_sync_debug_mode("error")
        try:
            assert e.observe(g, s) == s
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert not g._dev.wrong_seen() and (g.dropped, g.host_undecided) == (0, 0)
    assert g.close() is None and (g.count, g.wrong) == (200, 0)
    # (the host copy stale, as read and as left: the kernel's half of host-copy, not the host's in-place half)
    for moved, row, rule in ((("host_seq_lens", "host_seq_lens_after"), 7, "host-copy"),
                             (("kv_last_page",), 3, "plan-pages")):
        g = Guard(tmp_path / rule, ge.N, ge.INTERLEAVE, on_wrong="count", **ge.guard_config())
        e.observe(g, 0)
        torch.cuda.synchronize()
        for field in moved:
            e.kv[field] = e.kv[field].copy()
            e.kv[field][row] += 1
        torch.cuda.set_sync_debug_mode("error")
        try:
            e.observe(g, 1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        e.update()
        g.close()
        assert (g.first_rule, g.first_index, g.dropped) == (rule, 1, 0)


@pytest.mark.parametrize("moved, rule", [((), None), (("host_seq_lens", "host_seq_lens_after"), "host-copy"),
                                         (("host_seq_lens_after",), "host-copy"), (("kv_last_page",), "plan-pages"),
                                         (("kv_prefill_pages",), "plan-pages")])
def test_every_field_through_the_kernel_catches_a_stale_host_copy_and_a_wrong_plan(tmp_path, moved, rule):
    """The plugin's every field through the kernel (interpreted on CPU tensors; on a GPU compiled, on its tensors),
    row 5 of the fields `moved` one up: clean as given; the host copy stale as read and as left (the kernel's half of
    host-copy) or written in place (the host's half), a last page one off, a decode row's prefill count (-1: not
    recorded) made 0 (a count its context does not have) are caught under their names."""
    e, ge = _engine(_dev(), "all")
    g = Guard(tmp_path, ge.N, ge.INTERLEAVE, kernel=True, on_wrong="count", **ge.guard_config())
    for field in moved:
        e.kv[field] = e.kv[field].copy()
        e.kv[field][5] += 1
    e.observe(g, 0)
    g.close()
    assert (g.first_rule, g.dropped, g.host_undecided) == (rule, 0, 0)
@pytest.mark.parametrize("room", [True, False])
@pytest.mark.parametrize("moved", [None, "query_start_loc", "kv_pages"])
def test_host_row_sections_go_through_the_host_values_slot_and_are_checked(tmp_path, monkeypatch, room, moved):
    """Row sections handed as numpy (FlashInfer's page counts, as the plugin passes them; query_start_loc, as
    another engine might) are written into the build's host-values slot, which the kernel reads through its device
    address: no copy of them made (on a GPU, a pinned copy and a copy launched per array), the host path's verdict
    (right; the real tokens one short; a page count one off). A full ring: copied as before, the same verdict."""
    from dcptool.engine.guard.device_checks import GuardDevice, HostValues

    e, ge = _engine(_dev(), "all")
    e.kv["query_start_loc"] = e.kv["query_start_loc"].cpu().numpy().copy()
    if moved is not None:
        e.kv[moved] = np.array(e.kv[moved])
        e.kv[moved][-1 if moved == "query_start_loc" else 5] -= 1
    assert isinstance(e.kv["kv_pages"], np.ndarray)
    seen, copies = [], []
    real = GuardDevice._i32
    monkeypatch.setattr(GuardDevice, "_i32", lambda self, x: copies.append(type(x)) or real(self, x))
    for kernel in (False, True):
        g = Guard(tmp_path / str(kernel), ge.N, ge.INTERLEAVE, kernel=kernel, on_wrong="count", **ge.guard_config())
        e.observe(g, 0)  # (the ring made)
        if kernel and not room:
            g._dev.host_values = HostValues(g._dev.host_values.device, 16)  # (too small for this build's values)
        copies.clear()
        e.observe(g, 1)
        g.close()
        seen.append((g.first_rule, g.dropped))
    assert [c for c in copies if c is np.ndarray] == ([] if room else [np.ndarray, np.ndarray])
    assert seen[0] == seen[1] and (seen[0][0] is None) == (moved is None) and seen[0][1] == 0, seen
