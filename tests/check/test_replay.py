"""replay.py, the pipeline: a clean dump, skipped checks named, --split, --obs row views, bounded replay, provenance
cost on clean dumps, `auto` replaying on the CPU when the GPU fails before its scan reported anything."""

import numpy as np
import pytest
from conftest import ROOT, obs, run, worked_example, write

from dcptool.check.replay import replay
from dcptool.dump import open_dumps
from dcptool.gpu.cuda import CudaError, CudaStartError

BACKENDS = ["torch", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_clean_dump_has_no_findings(tmp_path, backend, rng):
    o = []
    for step in range(6):
        nr = int(rng.integers(0, 9))  # one batch per step, seen by every rank (else: rank-agree)
        seq = np.zeros(nr + 3, np.int32)
        seq[:nr] = rng.integers(1, 5000, nr)
        for rank in range(4):
            o.append(obs(step=step, rank=rank, seq=seq, num_reqs=nr, num_reqs_padded=nr + 3, dcp=4, il=16))
    res = run(tmp_path, o, backend, dcp=4, il=16)
    assert res.findings == [] and res.errors == 0


def test_skipped_checks_are_named(tmp_path):
    res = run(tmp_path, [obs()])
    assert {"ubatch-slice", "alias", "pages", "stale/parent-rows"} <= set(res.skipped)


def test_split_reproduces_vllm_micro_batches(tmp_path):
    from dcptool.check.replay import splits

    d = open_dumps([write(tmp_path / "d.safetensors", worked_example(False)[:1])])
    s = splits(d, 2)
    assert [(x.ub.slice.req_start, x.ub.slice.req_stop, x.ub.slice.tok_start, x.ub.slice.tok_stop) for x in s] == [
        (0, 3, 0, 7), (2, 5, 7, 14)]
    assert s[0].ub.query_start_loc.tolist() == [0, 1, 2, 7] and s[1].ub.query_start_loc.tolist() == [0, 5, 6, 7]
    assert s[0].ub.seq_lens.tolist() == [64, 96, 507] and s[1].ub.seq_lens.tolist() == [512, 32, 48]
    assert s[0].dcp_local_seq_lens.tolist() == [32, 48, 254] and s[1].dcp_local_seq_lens.tolist() == [256, 16, 24]


def test_split_checks_recorded_micro_batches(tmp_path):
    o = worked_example(False)
    d = open_dumps([write(tmp_path / "d.safetensors", o)])
    assert [f.rule for f in replay(d, "torch", split=2).findings] == []
    res = replay(d, "torch", split=3)  # recorded with K=2: disagrees with a 3-way split
    assert {f.rule for f in res.findings} == {"ubatch-slice"} and res.findings[0].detail["split"]


def test_rows_view(tmp_path):
    o = worked_example(True)
    d = open_dumps([write(tmp_path / "d.safetensors", o)])
    v = replay(d, "torch", obs=1).rows_view
    assert v.seq_lens == [64, 96, 507] and v.expected == [32, 48, 254] and v.recorded == [32, 48, 256]
    assert v.expected_all_ranks[2] == [254, 253]
    assert v.verdict == ["ok", "ok", "WRONG"] and [f.rule for f in v.findings] == ["stale"]


def test_provenance_costs_nothing_on_clean_dumps(tmp_path, monkeypatch):
    from dcptool.check.provenance import Provenance

    def boom(self, *a):
        raise AssertionError("provenance index built for a clean dump")

    monkeypatch.setattr(Provenance, "prepare", boom)
    monkeypatch.setattr(Provenance, "lead", boom)  # (on the CPU path; the GPU path computes it while the device scans)
    assert run(tmp_path, worked_example(False)).findings == []


def test_bounded_replay_gives_the_same_findings(tmp_path):
    """Bounded mode (dumps larger than RAM) drops pages as it goes; the answer must not change."""
    sample = str(ROOT / "samples" / "legacy.safetensors")
    a = replay(open_dumps([sample], bounded=False), "torch")
    b = replay(open_dumps([sample], bounded=True), "torch", bounded=True)
    assert [f.to_json() for f in a.findings] == [f.to_json() for f in b.findings] and a.findings


def test_checks_on_other_threads_give_the_findings_of_one_thread(tmp_path, monkeypatch):
    """The checks that do not need the scan run beside it; every rule of a recording with every fault comes out
    identical (order, texts, details, skipped) to the one-thread run."""
    import json
    import warnings

    from dcptool.check import later
    from dcptool.model.config import FAULTS
    from dcptool.model.simulate import SimConfig, simulate

    p = tmp_path / "s.safetensors"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (every observation recorded: none dropped)
        simulate(SimConfig(dcp=4, interleave=2, steps=60, pipeline="fixed", inject=tuple(sorted(FAULTS)), seed=3), p)
    out = {}
    for threads in (1, 4):
        monkeypatch.setattr(later, "CHECK_THREADS", threads)
        monkeypatch.setattr("os.cpu_count", lambda: 4)
        res = replay(open_dumps([str(p)]), "torch")
        out[threads] = ([json.dumps(f.to_json(), sort_keys=True) for f in res.findings], res.skipped, res.grid.count)
    assert out[1][0] == out[4][0] and out[1][1] == out[4][1] and (out[1][2] == out[4][2]).all()
    assert len({json.loads(x)["rule"] for x in out[1][0]}) >= 10  # many checks contributed


def test_a_failing_background_check_fails_the_replay(tmp_path, monkeypatch):
    """An exception in a check on another thread reaches the caller (never a silently missing rule)."""
    import pytest

    from dcptool.check import later, values

    d = open_dumps([write(tmp_path / "d.safetensors", worked_example(False))])

    def boom(_d):
        raise RuntimeError("check failed")

    monkeypatch.setattr(values, "check_shape", boom)  # (replay finds it by the name the rule table gives)
    monkeypatch.setattr(later, "CHECK_THREADS", 4)
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    with pytest.raises(RuntimeError, match="check failed"):
        replay(d, "torch")


@pytest.mark.parametrize("capped", [False, True])
def test_replay_says_when_the_recording_stopped_at_its_size_cap(tmp_path, capped):
    """A recording that stopped at its size cap (dcptool.capped in its last file) is replayed as usual, and the
    result, the text report and the JSON summary say it stopped (later observations are missing); one that did not
    stop says nothing of it."""
    import json
    import warnings
    from io import StringIO

    from rich.console import Console

    from dcptool.engine.recorder.record import Recorder
    from dcptool.report.text import render_replay, replay_json_text

    rec = Recorder(tmp_path / "run.safetensors", dcp_size=2, rollover=10, max_bytes=2500 if capped else None)
    seq = np.arange(1, 65, dtype=np.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(20):
            rec.observe(step=i, site="attn", rank=0, seq_lens=seq, num_reqs=64, num_reqs_padded=64)
    res = replay(open_dumps([str(f) for f in rec.close()]))
    out = StringIO()
    render_replay(res, Console(file=out, width=200))
    summary = json.loads("".join(replay_json_text(res)).splitlines()[-1])
    assert res.capped == (2500 if capped else None) and summary.get("capped") == res.capped
    assert ("stopped at its size cap of 2,500 bytes" in out.getvalue()) == capped


# --------------------------------------------------------------------------------------------
# --backend auto on a GPU that fails: the CPU replays instead, once nothing was reported yet

_OOM = "CUDA cuMemAllocHost failed: CUDA_ERROR_OUT_OF_MEMORY: out of memory"


class _FailingScan:
    """gpu.scan_cuda.CudaScan's stand-in whose chunk `at` fails on the device (a kernel that cannot launch)."""

    def __init__(self, chunks, *const, at):
        self.c, self.at = chunks, at

    def load(self, k):
        pass

    def check(self, k):
        if k == self.at:
            raise CudaError("CUDA cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE: invalid argument")
        n = self.c.chunks[k][1] - self.c.chunks[k][0]
        return np.array([[0] * n, [-1] * n] * 3, np.int64), np.zeros(0, np.int64)

    def close(self):
        self.c.close()


def _gpu_fails(monkeypatch, where):
    """A GPU said to be there (auto takes it for any dump), failing `where`: in the driver's first answer
    (resolve), in its start-up (start), in the first chunk or in the second (chunk 0, 1)."""
    from dcptool.check import scan as scan_mod
    from dcptool.gpu import cuda, scan_cuda

    def oom():
        raise CudaError(_OOM)

    monkeypatch.setattr(scan_mod, "GPU_MIN_OBS", 1)
    monkeypatch.setattr(scan_cuda, "GPU_CHUNK_ROWS", 64)
    monkeypatch.setattr(scan_cuda, "interpreted", lambda: False)
    monkeypatch.setattr(cuda, "available", oom if where == "resolve" else lambda: True)
    monkeypatch.setattr(cuda, "gpu", oom)
    if isinstance(where, int):
        monkeypatch.setattr(scan_cuda, "CudaScan", lambda c, *k: _FailingScan(c, *k, at=where))


@pytest.mark.parametrize("where", ["resolve", "start", 0])
def test_auto_replays_on_the_cpu_when_the_gpu_fails_before_reporting_anything(tmp_path, monkeypatch, where):
    """A GPU that fails before the scan reported anything (a broken install or driver, an allocation at start-up,
    the first chunk's kernels): `auto` replays on the CPU, with the CPU's findings, and says what failed (the CLI
    warns with it); `triton` (the GPU asked for by name) fails with that failure."""
    import json

    from conftest import random_dump

    d = random_dump(tmp_path / "d.safetensors", np.random.default_rng(9), 120, 4, 2)
    want = replay(d, "torch")
    _gpu_fails(monkeypatch, where)
    got = replay(open_dumps([str(tmp_path / "d.safetensors")]), "auto")
    assert [f.to_json() for f in got.findings] == [f.to_json() for f in want.findings] and want.findings
    assert (got.backend, got.device) == ("torch", "cpu") and want.gpu_failed is None
    what = _OOM if where != 0 else "CUDA cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE: invalid argument"
    assert got.gpu_failed == what and got.summary_json()["gpu_failed"] == what
    assert "gpu_failed" not in want.summary_json()
    with pytest.raises(CudaError) as e:
        replay(open_dumps([str(tmp_path / "d.safetensors")]), "triton")
    assert str(e.value) == f"{what}; use --backend torch to replay on the CPU"
    assert json.dumps(got.summary_json())  # (the summary stays JSON)


def test_a_gpu_failing_after_its_first_result_fails_auto_too(tmp_path, monkeypatch):
    """A failure after the scan reported a chunk (its progress shown, its rows perhaps released) is not replaced:
    `auto` fails as `triton` does, in one line."""
    from conftest import random_dump

    random_dump(tmp_path / "d.safetensors", np.random.default_rng(9), 120, 4, 2)
    _gpu_fails(monkeypatch, 1)
    for backend in ("auto", "triton"):
        with pytest.raises(CudaError, match="cuLaunchKernel failed") as e:
            replay(open_dumps([str(tmp_path / "d.safetensors")]), backend)
        assert not isinstance(e.value, CudaStartError)


def test_auto_below_the_crossover_never_meets_the_gpu(tmp_path, monkeypatch):
    """A dump under scan.GPU_MIN_OBS replays on the CPU without asking the driver: no failure to report."""
    from conftest import random_dump

    from dcptool.check import scan as scan_mod
    from dcptool.gpu import cuda

    def asked():
        raise AssertionError("the driver was asked")

    monkeypatch.setattr(cuda, "available", asked)
    d = random_dump(tmp_path / "d.safetensors", np.random.default_rng(9), 30, 4, 2)
    assert d.n < scan_mod.GPU_MIN_OBS
    res = replay(d, "auto")
    assert (res.backend, res.device, res.gpu_failed) == ("torch", "cpu", None)
