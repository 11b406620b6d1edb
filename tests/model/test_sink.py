"""sink.py: one file per rank records what one file records; the batched observe_many the shared file uses."""

from pathlib import Path

import numpy as np
import pytest
from simulate_cases import SMALL, run, verify

from dcptool.dump import read_dump
from dcptool.engine.recorder.record import Recorder
from dcptool.model.simulate import SimConfig


def test_per_rank_files_replay_like_one_file(tmp_path):
    cfg = SimConfig(dcp=2, pcp=2, pipeline="legacy", **SMALL)
    one, d1, r1 = run(cfg, tmp_path, "one.safetensors")
    many, dn, rn = run(cfg, tmp_path, "many.safetensors", per_rank=True)
    assert [Path(f).name for f in many.files] == [f"many.pcp{p}.rank{r}.safetensors" for p in (0, 1) for r in (0, 1)]
    assert dn.n == d1.n and sum(r.count for r in many.faults.values()) == sum(r.count for r in one.faults.values())
    verify(many, dn, rn)
    assert rn.by_rule().keys() == r1.by_rule().keys()
    for f in many.files:  # each file is one process: one DCP rank, and it reads on its own
        assert np.unique(read_dump(f)["obs.rank"]).size == 1


def test_observe_many_records_what_observe_records(tmp_path):
    """The batched call simulate uses writes the same bytes as one observe() per rank."""
    rng = np.random.default_rng(0)
    a = Recorder(tmp_path / "a.safetensors", dcp_size=4, page_size=16)
    b = Recorder(tmp_path / "b.safetensors", dcp_size=4, page_size=16)
    for step in range(20):
        n = int(rng.integers(1, 9))
        seq = rng.integers(0, 9000, n)
        qsl = np.concatenate([[0], np.cumsum(rng.integers(1, 5, n))])
        views = None if step % 5 == 0 else rng.integers(0, 3000, (4, n))
        kv = rng.integers(0, 99, (4, n))
        parents = [None] * 4 if step == 0 else [step * 4 - 4 + r for r in range(4)]
        for r in range(4):
            a.observe(step=step, site="s", rank=r, seq_lens=seq, num_reqs=n, num_reqs_padded=n,
                      dcp_local_seq_lens=None if views is None else views[r], parent=parents[r],
                      query_start_loc=qsl, buffer=r + 1, graph=3, kv_pages=kv[r])
        b.observe_many(step=step, site="s", ranks=range(4), seq_lens=seq, num_reqs=n, num_reqs_padded=n,
                       dcp_local_seq_lens=views, parents=parents, query_start_loc=qsl, buffers=[1, 2, 3, 4],
                       graph=3, kv_pages=kv)
    with pytest.warns(RuntimeWarning):
        assert b.observe_many(step=0, site="s", ranks=[0, 1], seq_lens=[-1], num_reqs=1, num_reqs_padded=1) == [-1] * 2
    assert b.dropped == 2
    a.close(), b.close()
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
