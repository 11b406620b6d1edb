"""dump/transfer.py: a KV transfer plan's record and its columns: recorded, read back whole, merged, refused where a
file holds what no plan can (one line naming the key), and absent from every older dump."""

import json
import re
import struct

import numpy as np
import pytest
from conftest import ROOT
from transfer_cases import random_transfer

from dcptool import Recorder
from dcptool.dump import DumpError, open_dumps, read_dump
from dcptool.dump.schema import COLUMNS, OPTIONAL
from dcptool.dump.transfer import (
    COLUMNS_OF,
    LEVELS,
    OFFSETS,
    TABLE,
    XCOPY,
    GroupPlan,
    Side,
    TransferRecord,
    dump_columns,
    ident,
    levels_of,
)

MLA = GroupPlan("mla", [5, 6], [7, 8], 16, 16)


def record(path, transfers, dcp=2, **kw):
    """A recording of attention builds and transfers (each a dict of Recorder.transfer's keywords but step/rank)."""
    with Recorder(path, dcp_size=dcp, **kw) as rec:
        for k, t in enumerate(transfers):
            rec.observe(step=k, site="attn_metadata", rank=0, num_reqs=1, num_reqs_padded=1, seq_lens=[9],
                        dcp_local_seq_lens=[5] if dcp > 1 else None)
            assert rec.transfer(step=k, rank=k % dcp, **t) == 2 * k + 1
        assert rec.dropped == 0
    return str(path)


def test_the_table_derives_the_optional_columns_and_docs_format_lists_them():
    cols = dump_columns()
    assert [k for k in cols if k.startswith("obs.")] == [OFFSETS[lv] for lv in LEVELS]
    assert all(cols[c.key] == (c.dtype, OFFSETS[c.level]) for c in TABLE)
    assert set(cols) <= set(OPTIONAL) and all(COLUMNS[k] == v for k, v in cols.items())
    text = (ROOT / "docs" / "format.md").read_text()
    listed = re.findall(r"^\| `((?:xfer|xgrp|xsrc|xdst|xcopy)\.\w+)` \| (int\d+) \|", text, re.M)
    assert listed == [(c.key, c.dtype.lower().replace("i", "int")) for c in TABLE]


def test_a_recorded_plan_reads_back_row_for_row(tmp_path, rng):
    ts = [random_transfer(rng) for _ in range(12)]
    d = read_dump(record(tmp_path / "r.safetensors", ts, dcp=8))
    assert d.n == 24 and d.config.sites == ("attn_metadata", "transfer")
    assert np.diff(d[OFFSETS["xfer"]]).tolist() == [0, 1] * 12
    for k, t in enumerate(ts):
        i = 2 * k + 1
        rows = levels_of(TransferRecord(step=k, rank=k % 8, **t))
        for lv in LEVELS:
            a, b = d[OFFSETS[lv]][i], d[OFFSETS[lv]][i + 1]
            got = np.stack([d[c.key][a:b] for c in COLUMNS_OF[lv]], axis=1)
            assert np.array_equal(got, rows[lv]), (k, lv)
    # the transfer's observation holds no rows: every observation rule holds for it
    assert d["obs.num_reqs"][1::2].tolist() == [0] * 12 and np.diff(d["obs.rows"])[1::2].tolist() == [0] * 12


def test_reads_are_whole_kernel_blocks_and_ids_may_be_strings(tmp_path):
    rows = levels_of(TransferRecord(step=0, rank=1, request="req-7", source="prefill-0", src=dict(dcp=2),
                                    dst=Side(dcp=2), groups=[MLA], seq_len=40, reads=[(1, [[5, 6]], [[7, 8]])]))
    assert rows["xcopy"].tolist() == [[0, 1, 5, 0, 7, 0, 16], [0, 1, 6, 0, 8, 0, 16]]
    assert rows["xfer"][0, 0] == ident("req-7", "request") != ident("req-8", "request")
    assert rows["xfer"][0, 4] == 1  # (dst_rank defaults to the recording rank)
    assert rows["xsrc"].tolist() == [[0, 5], [0, 6]] and rows["xgrp"][0].tolist()[:3] == [1, 1, 1]


@pytest.mark.parametrize("bad, why", [
    (dict(reads=None), "one of them"),
    (dict(copies=np.zeros((1, 7), np.int64)), "one of them"),
    (dict(groups=[GroupPlan("paged", [1], [1], 16, 16)]), "kind"),
    (dict(groups=[GroupPlan("mla", [1], [1], 16, 16, 5, 5)]), "does not divide"),
    (dict(groups=[GroupPlan("mla", [1], [1], 16, 32)]), "differ in size"),
    (dict(src=dict(dcp=0)), "xfer.src_dcp"),
    (dict(dst_rank=2), "outside its layout"),
    (dict(request=1.5), "request must be"),
    (dict(seq_len=-2), "xfer.seq_len"),
    (dict(reads=[(0, [[5]], [[7, 8]])]), "pairs 1 source blocks with 2"),
])
def test_a_plan_no_dump_can_hold_is_dropped_never_raised(tmp_path, bad, why):
    kw = dict(request=1, src=dict(dcp=2), dst=dict(dcp=2), groups=[MLA], seq_len=40, reads=[(1, [[5, 6]], [[7, 8]])])
    kw.update(bad)
    with pytest.raises(ValueError, match=re.escape(why)):
        levels_of(TransferRecord(step=0, rank=1, **kw))
    with Recorder(tmp_path / "d.safetensors", dcp_size=2) as rec, pytest.warns(RuntimeWarning, match="dropped"):
        assert rec.transfer(step=0, rank=1, **kw) == -1
        assert rec.dropped == 1
    assert read_dump(tmp_path / "d.safetensors").n == 0


def test_rolled_files_keep_each_transfer_with_its_observation(tmp_path, rng):
    ts = [random_transfer(rng) for _ in range(7)]
    record(tmp_path / "r.safetensors", ts, dcp=8, rollover=3)
    files = sorted(tmp_path.glob("r.*.safetensors"))
    assert len(files) == 5
    d = open_dumps(files)
    one = read_dump(record(tmp_path / "one.safetensors", ts, dcp=8))
    for key in dump_columns():
        assert np.array_equal(d[key], one[key]), key


@pytest.mark.parametrize("bounded", [False, True])
def test_files_merged_by_step_keep_their_transfers(tmp_path, rng, bounded):
    """Two ranks' files interleaved by step, read together in memory or bounded (rows left in the files): each
    transfer's rows follow its observation."""
    a = [random_transfer(rng) for _ in range(5)]
    b = [random_transfer(rng) for _ in range(5)]
    fa, fb = record(tmp_path / "a.safetensors", a, dcp=8), record(tmp_path / "b.safetensors", b, dcp=8)
    d = open_dumps([fa, fb], bounded=bounded)
    run = np.argsort(d.order_of(np.arange(d.n)))  # the observations in the run's order (by step, then file)
    for k in range(10):
        t = (a, b)[k % 2][k // 2]
        i = run[4 * (k // 2) + 2 * (k % 2) + 1]  # (step k//2: a's two observations, then b's)
        x = d[OFFSETS["xcopy"]]
        got = np.stack([np.asarray(d[c.key][x[i]:x[i + 1]]) for c in COLUMNS_OF["xcopy"]], axis=1)
        assert np.array_equal(got, np.asarray(t["copies"]).reshape(-1, 7)), k


def test_every_older_dump_reads_without_them():
    d = read_dump(ROOT / "samples" / "legacy.safetensors")
    assert not any(k in d.columns for k in dump_columns())


def _rewrite(src, dst, key, values=None, drop=False, meta=None):
    """A copy of a dump with column `key` replaced (or dropped), the header's other tensors kept."""
    raw = open(src, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    tensors = {k: np.frombuffer(data[e["data_offsets"][0] : e["data_offsets"][1]],
                                {"I64": "<i8", "I32": "<i4", "U8": "u1", "I8": "i1"}[e["dtype"]])
               for k, e in head.items() if k != "__metadata__"}
    if drop:
        del tensors[key]
    elif key is not None:
        tensors[key] = np.asarray(values, tensors[key].dtype)
    from safetensors.numpy import save_file

    save_file(tensors, dst, metadata=head["__metadata__"])
    return str(dst)


@pytest.mark.parametrize("key, values, why", [
    ("xfer.store", [2], "xfer.store: value 2 at row 0 outside [0, 1]"),
    ("xfer.dst_dcp", [0], "xfer.dst_dcp: value 0"),
    ("xfer.dst_rank", [9], "xfer.dst_rank: rank 9 at row 0 is outside its layout (2 workers)"),
    ("xgrp.kind", [7], "xgrp.kind: value 7"),
    ("xgrp.src_kernel", [5], "xgrp.src_kernel: kernel block size 5 does not divide the block size 16 at row 0"),
    ("xsrc.group", [0, 3], "xsrc.group: group 3 at row 1: its transfer has 1 groups"),
    ("xcopy.count", [16, 0], "xcopy.count: value 0 at row 1"),
    ("xcopy.count", [16, 2**30], "xcopy.count: the copies stand for 1073741840 slots, past dcptool's limit"),
    ("obs.xfer", [0, 0, 2], "obs.xfer: offsets end at 2 but the rows hold 1 values"),
    ("obs.xgrp", [0, 1, 1], "obs.xgrp: rows at observation 0, which holds no transfer"),
])
def test_a_file_holding_what_no_plan_can_is_refused_in_one_line(tmp_path, key, values, why):
    src = record(tmp_path / "ok.safetensors", [dict(request=1, src=dict(dcp=2), dst=dict(dcp=2), groups=[MLA],
                                                    seq_len=40, reads=[(0, [[5, 6]], [[7, 8]])])])
    bad = _rewrite(src, tmp_path / "bad.safetensors", key, values)
    with pytest.raises(DumpError) as e:
        read_dump(bad)
    assert why in str(e.value) and "\n" not in str(e.value)


def test_a_file_with_some_transfer_columns_and_not_all_is_refused(tmp_path):
    src = record(tmp_path / "ok.safetensors", [dict(request=1, src=dict(dcp=2), dst=dict(dcp=2), groups=[MLA],
                                                    seq_len=40, reads=[(0, [[5, 6]], [[7, 8]])])])
    for key in ("obs.xcopy", "xgrp.window"):
        with pytest.raises(DumpError, match="missing"):
            read_dump(_rewrite(src, tmp_path / "bad.safetensors", key, drop=True))


@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 1000])
def test_levels_of_names_the_value_the_reader_s_check_names(n):
    """A seeded plan of n copies with one value out of range in a column (or none): levels_of's error is first_bad's
    over the record's columns, as a reader checks them."""
    from dcptool.dump.transfer import first_bad

    rng = np.random.default_rng(n)
    ok = np.stack([np.zeros(n), np.ones(n), rng.integers(0, 99, n), np.zeros(n), rng.integers(0, 99, n), np.zeros(n),
                   np.full(n, 16)], axis=1).astype(np.int64)
    cases = [None] + [(k, v) for k, v in ((1, -1), (2, -3), (4, 2**31), (6, 0))] if n else [None]
    for case in cases:
        copies = ok.copy()
        if case is not None:
            copies[rng.integers(0, n), case[0]] = case[1]
        t = TransferRecord(step=0, rank=1, request="r", src=dict(dcp=2), dst=dict(dcp=2), seq_len=40,
                           groups=[MLA], copies=copies)
        rows = {**levels_of(t._replace(copies=ok)), XCOPY: copies}
        want = first_bad({c.key: rows[lv][:, k] for lv in LEVELS for k, c in enumerate(COLUMNS_OF[lv])},
                         {OFFSETS[lv]: np.array([0, len(rows[lv])]) for lv in LEVELS})
        if case is None:
            assert levels_of(t)[XCOPY].tolist() == copies.tolist() and want is None
            continue
        assert want is not None and want[0] == COLUMNS_OF[XCOPY][case[0]].key
        with pytest.raises(ValueError, match=re.escape(f"{want[0]}: {want[1]}")):
            levels_of(t)
