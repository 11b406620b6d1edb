"""workload.py: a realistic serving workload, the same for the same seed."""

from pathlib import Path

import numpy as np
from simulate_cases import SMALL

from dcptool.dump import read_dump
from dcptool.model.simulate import SimConfig, simulate


def test_workload_is_realistic(tmp_path):
    """Arrivals, chunked prefill under the budget, decodes with drafts, graph padding: on the default sizes."""
    res = simulate(SimConfig(dcp=2, steps=40), tmp_path / "w.safetensors")
    d = read_dump(res.files[0])
    final = d["obs.site"] == d.config.sites.index("attn_metadata")
    nr, nrp = d["obs.num_reqs"][final], d["obs.num_reqs_padded"][final]
    q = np.diff(d["rows.query_start_loc"][d["obs.qsl"][:-1][final][:, None] + np.arange(2)], axis=1)
    assert nr.max() >= 30 and (nrp > nr).any()  # tens of requests, some graph padding
    assert d["obs.num_tokens_padded"][final].max() > 512  # prefill chunks big enough to micro-batch
    assert (q == 3).any()  # decodes: 1 + 2 draft tokens
    assert len(set(d["obs.graph"][final].tolist())) >= 2  # replays and eager/piecewise steps


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    cfg = SimConfig(dcp=4, pcp=2, pipeline="legacy", **SMALL)
    a = simulate(cfg, tmp_path / "a.safetensors").files[0]
    b = simulate(cfg, tmp_path / "b.safetensors").files[0]
    c = simulate(SimConfig(**{**cfg.__dict__, "seed": 1}), tmp_path / "c.safetensors").files[0]
    assert Path(a).read_bytes() == Path(b).read_bytes()
    assert Path(a).read_bytes() != Path(c).read_bytes()
