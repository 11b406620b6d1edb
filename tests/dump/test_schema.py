"""dump/schema.py: the encoding of obs.graph (docs/format.md), and every check of a hostile file: config, entries,
columns, offsets, row values, the issue-15 and slot columns (one line naming file, key and problem)."""

import json

import numpy as np
import pytest
from conftest import obs, write
from dump_cases import _bad, _cols, _set

from dcptool.dump import DumpConfig, DumpError, pack, read_dump, write_dump
from dcptool.dump.schema import GraphMode, KVGroup


def test_graph_mode_values_are_design_s2():
    assert [int(m) for m in GraphMode] == [0, 1, 2, 3]
    assert [m.name for m in GraphMode] == ["EAGER", "PIECEWISE", "FULL_CAPTURE", "FULL_REPLAY"]


def test_recorder_names_parse_as_before():
    old = {"eager": 0, "piecewise": 1, "capture": 2, "full-capture": 2, "replay": 3, "full-replay": 3}
    assert {k: int(GraphMode.parse(k)) for k in old} == old
    with pytest.raises(KeyError):
        GraphMode.parse("full")


def test_vllm_runtime_modes_and_dispatch_as_recorded():
    assert [GraphMode.of_vllm(n) for n in ("NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE", None)] == [0, 1, 3, 0, 0]
    assert GraphMode.FULL_REPLAY.recorded(capturing=True) is GraphMode.FULL_CAPTURE
    assert GraphMode.FULL_CAPTURE.recorded(capturing=False) is GraphMode.FULL_REPLAY
    assert GraphMode.PIECEWISE.recorded(capturing=True) is GraphMode.PIECEWISE
    assert not GraphMode.PIECEWISE.full and GraphMode.FULL_REPLAY.full


# --------------------------------------------------------------------------------------------
# A hostile file: every validation error of docs/format.md


def _meta(**kv):
    def m(header, data):
        header["__metadata__"].update(kv)
        return header, data
    return m


def _cfg(**kv):
    def m(header, data):
        c = json.loads(header["__metadata__"]["dcptool.config"])
        c.update(kv)
        for k, v in list(c.items()):
            if v is None:
                del c[k]
        header["__metadata__"]["dcptool.config"] = json.dumps(c)
        return header, data
    return m


def _drop(key):
    def m(header, data):
        del header[key]
        return header, data
    return m


def _retype(key, dtype):
    def m(header, data):
        header[key]["dtype"] = dtype
        return header, data
    return m


CASES = [
    ("unknown format", _meta(**{"dcptool.format": "2"}), "dcptool.format: unknown format version '2'"),
    ("no format", lambda h, d: ({**h, "__metadata__": {}}, d), "not a dcptool dump"),
    ("config not json", _meta(**{"dcptool.config": "{"}), "dcptool.config: not valid JSON"),
    ("dcp_size 0", _cfg(dcp_size=0), "dcp_size must be >= 1"),
    ("interleave 0", _cfg(cp_interleave=0), "cp_interleave must be >= 1"),
    ("dcp_size str", _cfg(dcp_size="2"), "dcp_size must be an integer"),
    ("overflow", _cfg(dcp_size=2**20, cp_interleave=2**12), "overflows int32"),
    ("no sites", _cfg(sites=[]), "sites must be a non-empty list"),
    ("missing key", _drop("obs.num_reqs"), "obs.num_reqs: missing"),
    ("wrong dtype", _retype("obs.rank", "I64"), None),  # size mismatch or dtype: both name obs.rank
    ("2-D", lambda h, d: ({**h, "obs.rank": {**h["obs.rank"], "shape": [3, 1]}}, d), "obs.rank: must be 1-D"),
    ("rank >= dcp_size", _set("obs.rank", [0, 2, 0]), "obs.rank: rank out of range for dcp_size 2"),
    ("site out of range", _set("obs.site", [0, 3, 0]), "obs.site: site index out of range"),
    ("num_reqs > padded", _set("obs.num_reqs", [2, 5, 2]), "num_reqs > num_reqs_padded"),
    ("negative num_reqs", _set("obs.num_reqs", [2, -1, 2]), "obs.num_reqs: negative length"),
    ("offsets not monotone", _set("obs.rows", [0, 8, 4, 12]), "obs.rows: offsets not monotone"),
    ("offsets past rows", _set("obs.rows", [0, 4, 8, 11]), "obs.rows: offsets end at 11"),
    ("offsets start", _set("obs.dcp_rows", [1, 4, 8, 12]), "obs.dcp_rows: offsets must start at 0"),
    ("negative seq_len", _set("rows.seq_lens", [17, 25, 0, 0, 17, -25, 0, 0, 17, 25, 0, 0]),
     "rows.seq_lens: negative length -25 at row 5"),
    ("has_dcp 2", _set("obs.has_dcp", [1, 2, 1]), "obs.has_dcp: must be 0 or 1"),
    ("rows for None", _set("obs.has_dcp", [1, 0, 1]), "obs.dcp_rows: rows recorded for a None DCP view"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["one-read", "streamed"])
@pytest.mark.parametrize("name,mutate,message", CASES, ids=[c[0] for c in CASES])
def test_validation_errors_name_file_key_and_problem(tmp_path, name, mutate, message, stream):
    """Read at once or streamed (the rows' values checked once they are in: at finish()), the same error."""
    p = _bad(tmp_path, mutate)
    with pytest.raises(DumpError) as e:
        read_dump(p, stream=stream).finish()
    text = str(e.value)
    assert text.startswith(p + ": ")
    assert "\n" not in text
    if message:
        assert message in text
    else:
        assert "obs.rank" in text


def test_overlapping_tensor_data(tmp_path):
    def m(header, data):
        header["obs.ubatch"]["data_offsets"] = list(header["obs.site"]["data_offsets"])
        return header, data
    with pytest.raises(DumpError, match="overlaps|size mismatch"):
        read_dump(_bad(tmp_path, m))


@pytest.mark.parametrize("before,gap,message", [
    ("rows.seq_lens", 8, "rows.seq_lens: data starts at byte {at}, but rows.dcp_local_seq_lens ends at byte {end}: "
                         "no tensor holds the 8 bytes between them"),
    ("obs.rank", 1, "obs.rank: data starts at byte {at}, but obs.num_reqs_padded ends at byte {end}: no tensor holds "
                    "the 1 byte between them"),
    ("obs.dcp_rows", 4, "obs.dcp_rows: data starts at byte 4, not 0: no tensor holds the 4 bytes before it"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_gap_in_the_data_section_is_refused(tmp_path, before, gap, message, stream):
    """safetensors packs tensors back to back from byte 0 of the data: bytes no tensor holds are a broken file
    (Hardening III item 6: inspect and replay read alike and refuse it alike), whichever read finds it."""
    from conftest import with_gap

    from dcptool.dump import read_header

    good = write(tmp_path / "good.safetensors", [obs(step=s, rank=s % 2) for s in range(3)])
    p = with_gap(good, tmp_path / "gap.safetensors", before, gap)
    header = read_header(p)[0]
    at = header[before]["data_offsets"][0]
    with pytest.raises(DumpError) as e:
        read_dump(p, stream=stream)
    assert str(e.value) == f"{p}: " + message.format(at=at, end=at - gap)
    assert read_dump(good).n == 3  # (packed: read as ever)


def test_optional_columns_are_validated(tmp_path):
    o = [obs(), obs(step=1, ubatch=0, parent=0, req_start=0, tok_start=0, tok_stop=2,
                    query_start_loc=[0, 1, 2, 2, 2])]
    p = write(tmp_path / "a.safetensors", o)
    d = read_dump(p)
    assert d["obs.parent"].tolist() == [-1, 0]
    assert d.qsl_of(0).size == 0 and d.qsl_of(1).tolist() == [0, 1, 2, 2, 2]
    cfg, cols = pack(o, DumpConfig(dcp_size=2))
    with pytest.raises(DumpError, match="obs.parent: parent index out of range"):
        write_dump(tmp_path / "b.safetensors", cfg, dict(cols, **{"obs.parent": np.array([-1, 1])}))
    with pytest.raises(DumpError, match="rows.kv_pages: present but dcptool.config has no page_size"):
        write_dump(tmp_path / "b.safetensors", cfg, dict(cols, **{"rows.kv_pages": np.zeros(8, np.int32)}))


def test_injected_metadata(tmp_path):
    cfg, cols = _cols()
    write_dump(tmp_path / "a.safetensors", cfg, cols, {"dummy-none": [2, 0]})
    assert read_dump(tmp_path / "a.safetensors").injected == [{"dummy-none": [0, 2]}]
    with pytest.raises(DumpError, match="dcptool.injected"):
        write_dump(tmp_path / "b.safetensors", cfg, cols, {"dummy-none": [7]})


# --------------------------------------------------------------------------------------------
# obs.dqsl / obs.tot (optional, with their row columns)


def _issue15_dump(path, cols_change):
    """A dump of two observations with both issue-15 columns, then `cols_change` applied, written unvalidated."""
    import numpy as np
    from conftest import obs

    from dcptool.dump import DumpConfig, encode, pack

    o = [obs(rank=r, dcp_query_start_loc=np.array([0, 1, 2]), dcp_tot_seq_lens=np.array([17, 25])) for r in (0, 1)]
    cfg, cols = pack(o, DumpConfig(dcp_size=2))
    cols_change(cols)
    header, tensors = encode(cfg, cols)
    path.write_bytes(header + b"".join(a.tobytes() for _, a in tensors))
    return str(path)


@pytest.mark.parametrize("change,key,what", [
    (lambda c: c.__setitem__("obs.dqsl", c["obs.dqsl"][[0, 2, 1]]), "obs.dqsl", "not monotone"),
    (lambda c: c.__setitem__("obs.tot", c["obs.tot"] + 1), "obs.tot", "must start at 0"),
    (lambda c: c.__setitem__("obs.tot", c["obs.tot"][:2]), "obs.tot", "offsets, expected n+1"),
    (lambda c: c.pop("rows.dcp_query_start_loc"), "rows.dcp_query_start_loc", "goes with obs.dqsl"),
    (lambda c: c.pop("obs.tot"), "obs.tot", "goes with rows.dcp_tot_seq_lens"),
    (lambda c: c["rows.dcp_tot_seq_lens"].__setitem__(1, -3), "rows.dcp_tot_seq_lens", "negative length -3"),
    (lambda c: c["obs.dqsl"].__setitem__(-1, 7), "obs.dqsl", "offsets end at 7 but the rows hold 6"),
])
def test_issue15_columns_bad_offsets_and_partners_exit_2_one_line(tmp_path, change, key, what):
    from conftest import cli

    p = _issue15_dump(tmp_path / "bad.safetensors", change)
    r = cli("replay", p)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.count("\n") == 1 and p in r.stderr and key in r.stderr and what in r.stderr, r.stderr


def test_issue15_columns_good_file_reads_and_inspect_lists_them(tmp_path):
    from conftest import cli

    from dcptool.dump import read_dump

    p = _issue15_dump(tmp_path / "ok.safetensors", lambda c: None)
    d = read_dump(p)
    assert d.dqsl_of(1).tolist() == [0, 1, 2] and d.tot_of(0).tolist() == [17, 25]
    r = cli("inspect", p, "--json")
    assert r.returncode == 0 and {"obs.dqsl", "rows.dcp_query_start_loc", "obs.tot",
                                  "rows.dcp_tot_seq_lens"} <= set(__import__("json").loads(r.stdout)["optional"])


# --------------------------------------------------------------------------------------------
# the slot columns and kv_groups (a bad one: exit 2, one line naming file and key)


def _slot_dump(tmp_path, name="s.safetensors", config=None, **over):
    """A two-rank dump with slot columns written by the safetensors library itself (no dcptool validation),
    with `over` replacing columns and `config` keys."""
    import json

    from conftest import obs
    from safetensors.numpy import save_file

    from dcptool.dump import DumpConfig, pack

    o = [obs(rank=r, query_start_loc=[0, 1, 2, 2, 2], positions=[16, 24], slot_mapping={0: [-1, 5], 1: [9, 2]})
         for r in range(2)]
    cfg, cols = pack(o, DumpConfig(dcp_size=2, kv_groups=(KVGroup("attn", True), KVGroup("mamba", False))))
    cols.update(over)
    c = cfg.to_json()
    c.update(config or {})
    path = tmp_path / name
    save_file({k: np.ascontiguousarray(v) for k, v in cols.items()}, str(path),
              metadata={"dcptool.format": "1", "dcptool.config": json.dumps(c)})
    return str(path)


def test_a_sliding_window_group_and_its_cp_size_read_back(tmp_path):
    """kv_groups' optional sliding_window and cp_size (per-group DCP: 1 for a replicated group, dcp_size for a
    sharded one) read back; without them a group's DCP size is still what `dcp` says."""
    from dcptool.dump import read_dump

    groups = [{"name": "attn", "dcp": True, "cp_size": 2}, {"name": "swa", "dcp": False, "block_size": 16,
                                                               "sliding_window": 4096, "cp_size": 1},
              {"name": "mamba", "dcp": False}]
    d = read_dump(_slot_dump(tmp_path, config={"kv_groups": groups}))
    assert [g.to_json() for g in d.config.kv_groups] == groups
    assert d.config.group_cp(4).tolist() == [2, 1, 1, 2]  # (a group past the list: sharded, as vLLM's default)


def test_slot_columns_read_back(tmp_path):
    from dcptool.dump import read_dump

    d = read_dump(_slot_dump(tmp_path))
    assert d["obs.slots"].tolist() == [0, 4, 8]
    assert d["rows.slot_group"].tolist() == [0, 0, 1, 1] * 2 and d["rows.positions"].tolist() == [16, 24] * 4
    assert d.config.kv_groups == (KVGroup("attn", True), KVGroup("mamba", False))


@pytest.mark.parametrize("over,config,message", [
    ({"rows.slot_group": np.array([0, 0, 2, 1, 0, 0, 1, 1], "<i4")}, None,
     "rows.slot_group: KV-cache group 2 at entry 2 is out of range (config lists 2 kv_groups)"),
    ({"rows.slot_group": np.array([0, 0, -1, 1, 0, 0, 1, 1], "<i4")}, None,
     "rows.slot_group: KV-cache group -1 at entry 2 is negative"),
    ({"rows.positions": np.array([16, -24, 16, 24, 16, 24, 16, 24], "<i4")}, None,
     "rows.positions: negative position -24 at entry 1"),
    ({"obs.slots": np.array([0, 4, 7], "<i8")}, None, "obs.slots: offsets end at 7"),
    ({"rows.slot_mapping": np.array([1, 2, 3], "<i4")}, None, "obs.slots: offsets end at 8"),
    ({"rows.slot_mapping": np.zeros(8, "<i8")}, None, "rows.slot_mapping: dtype must be I32"),
    ({}, {"kv_groups": [{"name": "attn", "dcp": 1}]}, "kv_groups[0]: dcp must be true or false, got 1"),
    ({}, {"kv_groups": ["attn"]}, "kv_groups[0] must be an object"),
    ({}, {"kv_groups": {"attn": True}}, "kv_groups must be a list"),
    ({}, {"kv_groups": [{"name": "a", "dcp": True, "block_size": 0}]}, "block_size must be an integer >= 1"),
    ({}, {"kv_groups": [{"name": "a", "dcp": True, "page": 16}]}, "kv_groups[0]: unknown key 'page'"),
    ({}, {"kv_groups": [{"name": "a", "dcp": True, "sliding_window": 0}]}, "sliding_window must be an integer >= 1"),
    ({}, {"kv_groups": [{"name": "swa", "dcp": False, "cp_size": 2}]},
     "kv_groups[0]: cp_size 2 for a group DCP does not shard (dcp false: 1)"),
    ({}, {"kv_groups": [{"name": "a", "dcp": True, "cp_size": 4}]},
     "kv_groups[0]: cp_size 4 of a DCP-sharded group is not dcp_size 2"),
    ({"rows.group_seq_lens": np.array([3, -1], "<i4"), "obs.gsl": np.array([0, 2, 2], "<i8")}, None,
     "rows.group_seq_lens: negative value -1 at row 1"),
    ({"rows.sparse_topk": np.array([3, 0, 3, 7, -2, 0], "<i4"), "obs.topk": np.array([0, 6, 6], "<i8")}, None,
     "rows.sparse_topk: negative value -2 at row 4"),
], ids=["group-range", "group-negative", "position", "offsets", "short", "dtype", "dcp-int", "not-object",
        "not-list", "block-size", "unknown-key", "window", "cp-replicated", "cp-sharded", "negative-group-lens",
        "negative-topk"])
def test_bad_slot_columns_exit_2_with_one_line(tmp_path, over, config, message):
    from conftest import cli

    p = _slot_dump(tmp_path, config=config, **over)
    r = cli("replay", p)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    assert r.stderr.count("\n") == 1 and p in r.stderr and message in r.stderr, r.stderr


def test_slot_columns_go_together(tmp_path):
    from conftest import cli
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    p = _slot_dump(tmp_path)
    with safe_open(p, "np") as f:
        meta = f.metadata()
    cols = load_file(p)
    del cols["rows.slot_group"]
    save_file(cols, p, metadata=meta)
    r = cli("replay", p)
    assert r.returncode == 2 and "rows.slot_group: missing (it goes with obs.slots)" in r.stderr


@pytest.mark.parametrize("value, ok", [('{"max_bytes": 4000000000}', True), ('{"max_bytes": 0}', False),
                                       ('{"max_bytes": 1.5}', False), ('[1]', False), ("{", False),
                                       ('{"max_bytes": true}', False)])
def test_dcptool_capped_is_validated(tmp_path, value, ok):
    """`dcptool.capped` (a Recorder that stopped at its size cap): {"max_bytes": an integer >= 1}, else refused."""
    cfg, cols = pack([obs()], DumpConfig(dcp_size=2, sites=("attn_metadata",)))
    write_dump(tmp_path / "c.safetensors", cfg, cols, extra_metadata={"dcptool.capped": value})
    if ok:
        assert read_dump(tmp_path / "c.safetensors").capped == [4000000000]
    else:
        with pytest.raises(DumpError, match="dcptool.capped"):
            read_dump(tmp_path / "c.safetensors")
    write_dump(tmp_path / "d.safetensors", cfg, cols)
    assert read_dump(tmp_path / "d.safetensors").capped == [None]
