"""guard_tl.py: the Guard's check kernel (through guard_dev.py) on CPU tensors under Triton's interpreter (or on a GPU):
silent on a clean run, and on each per-observation fault the same first wrong observation, rule and dump as the host
path."""

import numpy as np
import pytest
import torch
from test_guard import PER_OBS_FAULTS, guard_of, observations, run_sim

from dcptool.dump import read_dump

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
