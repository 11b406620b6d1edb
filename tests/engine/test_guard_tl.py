"""The Guard's check kernel (guard_tl.py through guard_dev.py) on CPU tensors under Triton's interpreter (or on a GPU):
silent on a clean run, the same dump as the host path on each per-observation fault, the ring frozen at the wrong one,
the flag, and slots sized from the first observation growing for a larger one."""

import numpy as np
import pytest
import torch
from test_guard import PER_OBS_FAULTS, guard_of, observations, run_sim

from dcptool.dcp.reference import local_np
from dcptool.dump import read_dump
from dcptool.engine.guard import Guard

pytestmark = pytest.mark.kernel


def _on(dev, kw):
    return {k: (v.to(dev) if isinstance(v, torch.Tensor) else
                {g: m.to(dev) for g, m in v.items()} if isinstance(v, dict) else v) for k, v in kw.items()}


def _dev() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def test_clean_run_writes_nothing_and_counts(tmp_path):
    d = run_sim(tmp_path, None)
    obs = list(observations(d, True))[:40]
    g = guard_of(d, tmp_path, kernel=True, keep=8)
    for kw in obs:
        assert g.observe(**_on(_dev(), kw)) >= 0
    assert not g._dev.wrong_seen()
    assert g.close() is None and g.count == len(obs) and g.wrong == 0
    assert not (tmp_path / "guard").exists()


@pytest.mark.parametrize("fault", PER_OBS_FAULTS)
def test_same_dump_as_the_host_path(tmp_path, fault):
    d = run_sim(tmp_path, fault)
    host = guard_of(d, tmp_path / "host", keep=6)
    obs = []
    with pytest.warns(RuntimeWarning):
        for kw in observations(d, True):
            obs.append(kw)
            host.observe(**kw)
            if host.dumped is not None:
                break
    dev = guard_of(d, tmp_path / "dev", kernel=True, keep=6, on_wrong="dump")
    with pytest.warns(RuntimeWarning, match="dcptool Guard: wrong DCP metadata"):
        for kw in obs + obs[-1:] * 3:  # (the ring is frozen at the wrong one: what follows is checked, not kept)
            dev.observe(**_on(_dev(), kw))
        dev.close()
    assert dev.first_index == host.first_index and dev.first_rule == host.first_rule
    assert dev.wrong >= 1 and dev.count == len(obs) + 3
    a, b = read_dump(host.dumped), read_dump(dev.dumped)
    assert a.columns.keys() == b.columns.keys()
    for k in a.columns:
        if k != "obs.buffer":  # (the engine's storage: the host path's CPU tensors and the device's differ)
            assert np.array_equal(a[k], b[k]), k


def _obs(step, rows, wrong=False, rank=1):
    seq = torch.arange(1, rows + 1, dtype=torch.int32) * 7
    dcp = torch.from_numpy(local_np(seq.numpy().astype(np.int64), 2, rank, 1).astype(np.int32))
    if wrong:
        dcp[-1] += 1
    return dict(step=step, site="attn", rank=rank, seq_lens=seq.to(_dev()), num_reqs=rows, num_reqs_padded=rows,
                dcp_local_seq_lens=dcp.to(_dev()))


def test_ring_grows_for_a_larger_observation_and_is_frozen_at_the_wrong_one(tmp_path):
    """Slots sized from the first observation (64 rows at least); a larger one grows the ring (what it held kept);
    the flag and the frozen index are set by the wrong one, and later observations leave the ring as it was."""
    g = Guard(tmp_path / "g", 2, 1, keep=4, kernel=True)
    g.observe(**_obs(0, 3))
    assert g._dev.cap == 64
    g.observe(**_obs(1, 100))
    assert g._dev.cap == 200 and not g._dev.wrong_seen()
    g.observe(**_obs(2, 5, wrong=True))
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
