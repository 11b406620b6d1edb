"""The Recorder (record.py, docs/recording.md): private copies at once, never raising into the engine, thread-safe;
the decode-path rows and slot keywords through observe() and observe_many()."""

import warnings

import numpy as np
import pytest
import torch
from conftest import hostring, obs

from dcptool.dump import DumpConfig, open_dumps, pack, read_dump
from dcptool.engine.recorder.record import Recorder


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


def test_nothing_is_recorded_inside_cuda_graph_capture(tmp_path):
    rec = Recorder(tmp_path / "c.safetensors", dcp_size=2)
    rec._device.on = "is_cpu"
    rec._device.capturing = lambda: True
    assert rec.observe(step=0, site="capture", rank=0, seq_lens=torch.tensor([3]), num_reqs=1,
                       num_reqs_padded=1) == -1
    assert rec.observe(step=0, site="x", rank=0, seq_lens=np.array([3]), num_reqs=1, num_reqs_padded=1) == 0
    rec.close()
    assert rec.skipped_capture == 1 and rec.dropped == 0 and read_dump(tmp_path / "c.safetensors").n == 1


# dcp_query_start_loc and dcp_tot_seq_lens (host path)


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


# positions= and slot_mapping= (host path, CUDA tensors too for now), kv_groups=

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
    a._device.use_host_ring()
    b = Recorder(tmp_path / "b.safetensors", dcp_size=2, kv_groups=KV)
    for rec in (a, b):
        rec.observe(**{**_base(0), "seq_lens": torch.tensor([17, 25, 0, 0])}, positions=torch.tensor([16, 17]),
                    slot_mapping=torch.tensor([[4, -1], [0, 1]]))
        rec.close()
    da, db = read_dump(tmp_path / "a.safetensors"), read_dump(tmp_path / "b.safetensors")
    for k in ("obs.slots", "rows.positions", "rows.slot_mapping", "rows.slot_group", "rows.seq_lens"):
        assert np.array_equal(da[k], db[k]), k
