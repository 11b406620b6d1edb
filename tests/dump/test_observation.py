"""observation.py: the one table of an observation's fields, and what is derived from it (the record types, the
dump's columns, the writer's rows)."""

import dataclasses
import inspect

import numpy as np
import pytest

from dcptool.dump import DumpConfig, Observation, Record, Scalars, observation, pack, read_dump, write_dump
from dcptool.dump.observation import (
    ANY,
    FIELDS,
    FIELDS_TABLE,
    OPTIONAL_FIELDS,
    REQUIRED,
    ROW_FIELDS,
    ROWS,
    Field,
    dump_columns,
)

# The format's columns as docs/format.md lists them (key -> dtype, length kind): what the table must derive.
FORMAT_REQUIRED = {
    "obs.step": ("I64", "n"), "obs.site": ("I32", "n"), "obs.rank": ("I32", "n"), "obs.ubatch": ("I32", "n"),
    "obs.num_reqs": ("I32", "n"), "obs.num_reqs_padded": ("I32", "n"), "obs.rows": ("I64", "n+1"),
    "obs.has_dcp": ("U8", "n"), "obs.dcp_rows": ("I64", "n+1"), "rows.seq_lens": ("I32", "obs.rows"),
    "rows.dcp_local_seq_lens": ("I32", "obs.dcp_rows")}
FORMAT_OPTIONAL = {
    "obs.parent": ("I64", "n"), "obs.req_start": ("I32", "n"), "obs.tok_start": ("I32", "n"),
    "obs.tok_stop": ("I32", "n"), "obs.qsl": ("I64", "n+1"), "rows.query_start_loc": ("I32", "obs.qsl"),
    "obs.num_tokens_padded": ("I32", "n"), "obs.buffer": ("I64", "n"), "obs.graph": ("I8", "n"),
    "rows.kv_pages": ("I32", "obs.rows"), "obs.dqsl": ("I64", "n+1"),
    "rows.dcp_query_start_loc": ("I32", "obs.dqsl"), "obs.tot": ("I64", "n+1"),
    "rows.dcp_tot_seq_lens": ("I32", "obs.tot"), "obs.slots": ("I64", "n+1"), "rows.positions": ("I32", "obs.slots"),
    "rows.slot_mapping": ("I32", "obs.slots"), "rows.slot_group": ("I32", "obs.slots"),
    "obs.ctx": ("I64", "n+1"), "rows.ctx_chunks": ("I32", "obs.ctx"), "obs.gsl": ("I64", "n+1"),
    "rows.group_seq_lens": ("I32", "obs.gsl"), "obs.vrl": ("I64", "n+1"), "rows.verify_row_lens": ("I32", "obs.vrl"),
    "obs.topk": ("I64", "n+1"), "rows.sparse_topk": ("I32", "obs.topk"),
    "obs.addrs": ("I64", "n+1"), "rows.attn_addrs": ("I32", "obs.addrs"), "obs.gaddrs": ("I64", "n+1"),
    "rows.graph_addrs": ("I32", "obs.gaddrs"), "obs.caps": ("I64", "n+1"), "rows.attn_caps": ("I32", "obs.caps"),
    "obs.hseq": ("I64", "n+1"), "rows.host_seq_lens": ("I32", "obs.hseq"), "obs.hseq_after": ("I64", "n+1"),
    "rows.host_seq_lens_after": ("I32", "obs.hseq_after"), "rows.kv_prefill_pages": ("I32", "obs.rows"),
    "rows.kv_last_page": ("I32", "obs.rows"), "obs.kvbs": ("I64", "n+1"),
    "rows.kv_block_sizes": ("I32", "obs.kvbs")}


def test_the_table_derives_the_format_columns():
    req, opt = dump_columns()
    assert req == FORMAT_REQUIRED and opt == FORMAT_OPTIONAL
    # (each row column right after its offsets: a reader that checks them in this order names the offsets first)
    assert list(opt) == list(FORMAT_OPTIONAL)


def test_the_record_types_follow_the_table():
    names = [f.name for f in FIELDS_TABLE if f.argument]
    assert list(Record._fields) == names and [f.name for f in dataclasses.fields(Observation)] == names
    required = [f.name for f in FIELDS_TABLE if f.default is REQUIRED]
    assert required == ["step", "site", "rank", "num_reqs", "num_reqs_padded", "seq_lens"]
    with pytest.raises(TypeError):
        Record(0, "a", 0, 1, 1)  # (seq_lens is required)
    r = Record(0, "a", 0, 1, 1, [5])
    assert r.ubatch == -1 and r.parent is None and r.slot_mapping is None
    assert FIELDS == Scalars._fields == ("step", "rank", "num_reqs", "num_reqs_padded", "ubatch", "parent",
                                         "req_start", "tok_start", "tok_stop", "num_tokens_padded", "buffer", "graph")
    assert ROW_FIELDS == ("seq", "dcp", "qsl", "kv", "dqsl", "tot", "pos", "slot", "sgrp", "ctx", "gsl", "vrl", "topk",
                          "addr", "gaddr", "caps", "hseq", "hseqa", "kvpre", "klast", "kvbs")
    assert OPTIONAL_FIELDS["buffer"] == ("obs.buffer", "<i8", 0) and OPTIONAL_FIELDS["graph"] == ("obs.graph", "i1", 0)
    assert "ubatch" not in OPTIONAL_FIELDS and "step" not in OPTIONAL_FIELDS


def test_observation_keeps_its_public_form():
    """The row form writers pack: positional order as before (step, site, rank, num_reqs, num_reqs_padded,
    seq_lens, dcp_local_seq_lens, ubatch, ...), a mutable dataclass with a __dict__ (copied with **o.__dict__)."""
    seq = np.array([5, 3])
    o = Observation(1, "s", 0, 2, 2, seq, None, 0)
    assert (o.step, o.site, o.num_reqs_padded, o.ubatch, o.parent) == (1, "s", 2, 0, None)
    o.step = 2
    assert Observation(**{**o.__dict__, "rank": 1}).rank == 1
    params = list(inspect.signature(Observation).parameters)
    assert params[:8] == ["step", "site", "rank", "num_reqs", "num_reqs_padded", "seq_lens", "dcp_local_seq_lens",
                          "ubatch"]


def test_a_field_added_to_the_table_gets_its_columns(monkeypatch):
    """Adding a row field is one row of the table: its offsets and column come along (a shared offsets column
    is written once); a required scalar's column is required."""
    extra = (Field("chunk_lens", ANY, "I32", "rows.chunk_lens", offsets="obs.chunks", section="chunk"),
             Field("block_rows", ROWS, "I32", "rows.block_rows", offsets="obs.rows", section="brow"),
             Field("kernel_block", "scalar", "I32", "obs.kernel_block", unknown=-1))
    monkeypatch.setattr(observation, "FIELDS_TABLE", (*FIELDS_TABLE, *extra))
    req, opt = dump_columns()
    assert req == FORMAT_REQUIRED
    assert list(opt)[len(FORMAT_OPTIONAL):] == ["obs.chunks", "rows.chunk_lens", "rows.block_rows",
                                                "obs.kernel_block"]
    assert opt["rows.block_rows"] == ("I32", "obs.rows") and opt["obs.kernel_block"] == ("I32", "n")


@pytest.mark.parametrize("seed", range(3))
def test_pack_writes_what_the_fields_say(tmp_path, seed):
    """Observations -> columns -> a file that reads back: optional scalars only when known (their unknown value
    elsewhere), kv_pages of an observation without them -1 per row, a None DCP view recorded as has_dcp 0, slot
    entries one per token and group."""
    rng = np.random.default_rng(seed)
    obs = []
    for i in range(int(rng.integers(1, 6))):
        n = int(rng.integers(0, 130))
        seq = rng.integers(0, 1000, n).astype(np.int32)
        with_kv, with_view = bool(rng.integers(0, 2)), bool(rng.integers(0, 2))
        obs.append(Observation(step=i, site="s", rank=0, num_reqs=n, num_reqs_padded=n, seq_lens=seq,
                               dcp_local_seq_lens=seq // 2 if with_view else None,
                               kv_pages=(seq + 15) // 16 if with_kv else None, parent=i - 1 if i else None,
                               positions=np.arange(3), slot_mapping={0: np.arange(3), 1: -np.ones(3, int)}))
    cfg, cols = pack(obs, DumpConfig(dcp_size=1, page_size=16))
    write_dump(tmp_path / "p.safetensors", cfg, cols)
    d = read_dump(tmp_path / "p.safetensors")
    assert d["obs.has_dcp"].tolist() == [int(o.dcp_local_seq_lens is not None) for o in obs]
    assert d["obs.parent"].tolist() == [-1 if o.parent is None else o.parent for o in obs]
    assert "obs.buffer" not in d.columns and "obs.req_start" not in d.columns
    for i, o in enumerate(obs):
        kv = d.kv_pages_of(i) if d.has("rows.kv_pages") else None
        if o.kv_pages is not None:
            assert np.array_equal(kv, o.kv_pages)
        elif kv is not None:
            assert (kv == -1).all() and kv.size == o.seq_lens.size
    assert np.array_equal(np.diff(d["obs.slots"]), [6] * len(obs))
    assert d["rows.slot_group"][:6].tolist() == [0, 0, 0, 1, 1, 1]


def test_the_keyword_door_takes_the_tables_fields_and_builds_one_record():
    """observe()'s signature is generated from the table: every argument keyword-only, in the table's order, with
    its default; a call hands the method one Record of the values given and the defaults (renamed keywords too)."""
    from dcptool.dump.observation import ARGUMENTS, keyword_door

    class Door:
        observe = keyword_door("observe", "take", "the doc")
        many = keyword_door("many", "take", "doc", {"rank": "ranks", "parent": "parents"}, "list[int]")

        def take(self, r):
            return r

    params = inspect.signature(Door.observe).parameters
    assert list(params)[1:] == [f.name for f in ARGUMENTS] and Door.observe.__doc__ == "the doc"
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in list(params.values())[1:])
    assert {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty} == {
        f.name: f.default for f in ARGUMENTS if f.default is not REQUIRED}
    seq = np.arange(3)
    r = Door().observe(step=4, site="s", rank=1, seq_lens=seq, num_reqs=3, num_reqs_padded=3, graph=2)
    assert type(r) is Record and r == Record(4, "s", 1, 3, 3, seq, graph=2)
    r = Door().many(step=4, site="s", ranks=[0, 1], seq_lens=seq, num_reqs=3, num_reqs_padded=3, parents=[None, 0])
    assert r.rank == [0, 1] and r.parent == [None, 0] and inspect.signature(Door.many).return_annotation == "list[int]"
    with pytest.raises(TypeError):
        Door().observe(step=4, site="s", rank=1, seq_lens=seq, num_reqs=3, num_reqs_padded=3, rnak=0)
