"""The Recorder of DESIGN §5: private copies, never raising into the engine, rollover, same columns as pack()."""

import warnings

import numpy as np
import pytest
import torch
from conftest import obs

from dcptool.dump import DumpConfig, open_dumps, pack, read_dump
from dcptool.record import Recorder


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
