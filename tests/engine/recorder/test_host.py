"""host.py: an observation's rows as private host copies, checked against what a dump cannot hold; one batch seen by
several ranks copied once."""

import numpy as np
import pytest
import torch

from dcptool.dump import ROW_FIELDS, Record, read_dump
from dcptool.engine.arguments import scalars
from dcptool.engine.recorder.host import of_rank
from dcptool.engine.recorder.record import Recorder


def _record(rng, n: int, **kw) -> Record:
    seq = rng.integers(0, 1 << 20, n)
    return Record(step=0, site="s", rank=0, num_reqs=n, num_reqs_padded=n, seq_lens=seq,
                  dcp_local_seq_lens=seq // 2, query_start_loc=np.arange(n + 1), **kw)


@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 1000])
def test_rows_are_private_int32_copies_in_row_field_order(tmp_path, n):
    rng = np.random.default_rng(n)
    rec = Recorder(tmp_path / "h.safetensors", dcp_size=2, page_size=16)
    src = _record(rng, n, kv_pages=torch.arange(n), dcp_query_start_loc=np.arange(n + 1),
                  dcp_tot_seq_lens=list(range(n)) or np.zeros(0, int), ctx_chunks=torch.arange(1 + 4 * n),
                  group_seq_lens=np.arange(2 * n), verify_row_lens=np.arange(n) - 1,
                  sparse_topk=torch.arange(3 * n).reshape(n, 3))
    row = rec._host.row(src, scalars(src), None)
    assert [a.dtype for a in row[:6] + row[9:13]] == [np.int32] * 10 and row[6:9] == (None, None, None)
    assert row[13:] == (None,) * (len(ROW_FIELDS) - 13)  # (the host values: none given)
    for got, want in zip(row[:6] + row[9:13], (src.seq_lens, src.dcp_local_seq_lens, src.query_start_loc,
                                               np.arange(n), np.arange(n + 1), np.arange(n), np.arange(1 + 4 * n),
                                               np.arange(2 * n), np.arange(n) - 1, np.arange(3 * n))):
        assert np.array_equal(got, want)
    src.seq_lens[:] = 7  # (the engine reuses its buffers: the copy is the observation's)
    assert n == 0 or not np.array_equal(row[0], src.seq_lens)
    rec.discard()


@pytest.mark.parametrize("bad, match", [
    (dict(seq_lens=np.array([3, -1])), "seq_lens rows"),  # a negative length
    (dict(num_reqs=3), "seq_lens rows"),  # more real requests than rows
    (dict(kv_pages=np.array([1])), "one value per seq_lens row"),
    (dict(dcp_tot_seq_lens=np.array([1, -2])), "negative dcp_tot_seq_lens"),
    (dict(ctx_chunks=np.array([16, 0, 0, -1, 4])), "negative ctx_chunks"),
    (dict(group_seq_lens=np.array([3, -1])), "negative group_seq_lens"),
    (dict(seq_lens=np.array([2**31, 1])), "fit int32"),
])
def test_what_a_dump_cannot_hold_raises(tmp_path, bad, match):
    rec = Recorder(tmp_path / "h.safetensors", dcp_size=2, page_size=16)
    r = Record(step=0, site="s", rank=0, num_reqs=2, num_reqs_padded=2, seq_lens=np.array([3, 4]))._replace(**bad)
    with pytest.raises(ValueError, match=match):
        rec._host.row(r, scalars(r), None)
    ok = Record(step=0, site="s", rank=0, num_reqs=2, num_reqs_padded=2, seq_lens=np.array([3, 4]),
                query_start_loc=np.arange(5))  # (a query_start_loc that does not cover the rows: not recorded)
    assert rec._host.row(ok, scalars(ok), None)[2] is None
    rec.discard()


def test_kv_pages_need_a_page_size(tmp_path):
    rec = Recorder(tmp_path / "h.safetensors", dcp_size=2)
    r = Record(step=0, site="s", rank=0, num_reqs=1, num_reqs_padded=1, seq_lens=[3], kv_pages=[1])
    with pytest.raises(ValueError, match="page_size"):
        rec._host.row(r, scalars(r), None)
    rec.discard()


@pytest.mark.parametrize("k", [1, 2, 5])
def test_one_batch_of_k_ranks_equals_k_observations(tmp_path, k):
    """many(): seq_lens and query_start_loc copied once for every rank, the per-rank rows split, a shared kv row
    broadcast; the file equals one observe() per rank."""
    rng = np.random.default_rng(k)
    n = 129
    seq = rng.integers(0, 1 << 16, n)
    view = rng.integers(0, 1 << 15, (k, n))
    kv = rng.integers(0, 9, n)
    pos = np.arange(7)
    maps = rng.integers(-1, 100, (k, 7))
    a = Recorder(tmp_path / "a.safetensors", dcp_size=k, page_size=16)
    b = Recorder(tmp_path / "b.safetensors", dcp_size=k, page_size=16)
    common = dict(step=3, site="s", num_reqs=n, num_reqs_padded=n, seq_lens=seq, query_start_loc=np.arange(n + 1),
                  kv_pages=kv, positions=pos)
    assert a.observe_many(ranks=range(k), dcp_local_seq_lens=view, slot_mapping=maps, **common) == list(range(k))
    for r in range(k):
        assert b.observe(rank=r, dcp_local_seq_lens=view[r], slot_mapping=maps[r], **common) == r
    common_vals, rows = a._host.many(Record(rank=range(k), dcp_local_seq_lens=view, slot_mapping=maps, **common), k)
    assert rows[0] is of_rank(rows, k - 1)[0]  # (one copy shared)
    a.close(), b.close()
    da, db = read_dump(tmp_path / "a.safetensors"), read_dump(tmp_path / "b.safetensors")
    assert sorted(da.columns) == sorted(db.columns)
    for key in da.columns:
        assert np.array_equal(da[key], db[key]), key


def test_slot_entries_note_the_highest_group(tmp_path):
    rec = Recorder(tmp_path / "h.safetensors", dcp_size=2)
    assert rec._host.slots(None, None) == (None, None, None)
    pos, grp = rec._host.slots(np.arange(3), {0: [1, 2, 3], 2: [4, 5, 6]})[::2]
    assert pos.tolist() == [0, 1, 2] * 2 and grp.tolist() == [0] * 3 + [2] * 3 and rec._writer.max_group == 2
    with pytest.raises(ValueError, match="group 2 was recorded"):
        rec.set_kv_groups([{"name": "a", "dcp": True}, {"name": "b", "dcp": False}])
    rec.set_kv_groups([{"name": n, "dcp": True} for n in "abc"])
    rec.discard()
