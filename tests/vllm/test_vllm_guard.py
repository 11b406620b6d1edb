"""The Guard through the plugin (DCPTOOL_GUARD) on the installed vLLM's own code (`make test-vllm`): silent on post-fix
releases (0.30+), one dump per rank on 0.29's real faults, whose replay names the rule replaying a full recording of
the same run names for that build.

The same engine run as test_vllm_recording.py's (capture, DFlash capture, dummy runs, real steps; vLLM's builders),
once recorded in full (DCPTOOL_RECORD) and once guarded; the Guard on CPU tensors takes its host path (the numpy
reference) or, `kernel`, its check kernel under Triton's interpreter (every column launched as vLLM hands it:
the device query_start_loc, int64 positions, strided int64 slot mappings; no conversion per build).
"""

import functools
import warnings

import engine as E
import pytest
from test_vllm_recording import drive_engine, drive_ubatches, messages, replayed

from dcptool.engine import vllm as plugin
from dcptool.engine.guard import guard as guard_mod
from dcptool.engine.guard.device_checks import GuardDevice

pytestmark = pytest.mark.vllm


def guarded(dcp: int, drive, out, monkeypatch, kernel: bool) -> tuple[list, list]:
    """Drive one engine per DCP rank with DCPTOOL_GUARD set (and DCPTOOL_RECORD not): the Guard's dumps and, per
    rank, (builds checked, wrong, the Guard's first rule)."""
    monkeypatch.delenv(plugin.ENV_DIR, raising=False)
    monkeypatch.setenv(plugin.ENV_GUARD, str(out))
    monkeypatch.setattr(plugin.STATE, "guarding", True)  # (what register() sets when only DCPTOOL_GUARD is)
    copies = []
    if kernel:
        monkeypatch.setattr(guard_mod, "Guard", functools.partial(guard_mod.Guard, kernel=True))
        real = GuardDevice._i32
        monkeypatch.setattr(GuardDevice, "_i32", lambda self, x: copies.append(x) or real(self, x))
    dumps, seen = [], []
    for rank in range(dcp):
        E.set_dcp(dcp, rank)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            drive(rank)
            g = plugin.STATE.recorder
            dumps += plugin.close()
        said = [str(x.message) for x in w if "dcptool Guard" in str(x.message)]
        assert len(said) == (g.dumped is not None), said  # one warning a dump, naming it
        seen.append((g.count, g.wrong, g.first_rule, g.dropped + g.skipped_capture))
    E.set_dcp(1, 0)
    monkeypatch.undo()
    assert copies == []  # every column of vLLM's builds launched as it is (no conversion per build)
    return dumps, seen


@pytest.mark.parametrize("kernel", [False, True], ids=["host", "kernel"])
@pytest.mark.parametrize("dcp,il", [(2, 1), (4, 16)])
def test_the_guard_is_silent_after_the_fix_and_dumps_the_pre_fix_faults(tmp_path, monkeypatch, dcp, il, kernel):
    drive = functools.partial(drive_engine, dcp, il)
    full, res = replayed(E.run_ranks(dcp, drive, tmp_path / "rec", monkeypatch))
    dumps, seen = guarded(dcp, drive, tmp_path / "guard", monkeypatch, kernel)
    per_rank = full.n // dcp
    assert [s[0] for s in seen] == [per_rank] * dcp and all(s[3] == 0 for s in seen)  # every build checked
    if not E.PRE_FIX:
        assert res.findings == [], messages(res)
        assert dumps == [] and not (tmp_path / "guard").exists() and seen == [(per_rank, 0, None, 0)] * dcp
        return
    # 0.29: the dummy runs hand attention None; the Guard dumps each rank's first, and replaying the dump names
    # the rule replaying the full recording names for that build (same step, site and rank)
    assert len(dumps) == dcp and all(s[1] > 0 for s in seen)
    for rank, path in enumerate(dumps):
        d, r = replayed([path])
        last = d.n - 1
        got = {(f.step, f.site, f.rank, f.rule) for f in r.findings if f.index == last}
        first = min((f for f in res.findings if f.rank == rank), key=lambda f: f.index)
        assert got == {(first.step, first.site, rank, first.rule)} == {(first.step, "dummy", rank, "missing")}
        assert seen[rank][2] == first.rule
        assert d.config.engine == "vllm" and d.config.dcp_size == dcp and d.config.cp_interleave == il


@pytest.mark.skipif(not E.HAS_UBATCH, reason=f"vLLM {E.VERSION} has no model-runner-V2 micro-batching")
def test_the_guard_checks_micro_batches_silently(tmp_path, monkeypatch):
    """Micro-batches (0.30+: DBO) and their parent, as UBatchRunner.prepare cuts them: all right, nothing written."""
    dumps, seen = guarded(2, drive_ubatches([1, 1, 10, 1, 1], [64, 96, 512, 32, 48], 2, 1), tmp_path / "guard",
                          monkeypatch, kernel=False)
    assert dumps == [] and seen == [(3, 0, None, 0)] * 2
