"""dump/write.py: what the writer puts in a file (safetensors the library reads, the same bytes for the same input),
written atomically."""

import json
import os

import numpy as np
import pytest
from conftest import obs, write
from dump_cases import _cols

from dcptool.dump import DumpConfig, DumpError, write_dump


def test_safetensors_library_reads_our_files(tmp_path):
    from safetensors import safe_open

    p = write(tmp_path / "a.safetensors", [obs(view=None), obs(step=1)], note="x")
    with safe_open(p, "np") as f:
        assert json.loads(f.metadata()["dcptool.config"])["note"] == "x"
        assert f.get_tensor("obs.has_dcp").tolist() == [0, 1]
        assert f.get_tensor("rows.seq_lens").dtype == np.int32


def test_write_is_atomic_and_respects_force(tmp_path):
    p = tmp_path / "a.safetensors"
    cfg, cols = _cols()
    write_dump(p, cfg, cols)
    before = p.read_bytes()
    with pytest.raises(FileExistsError):
        write_dump(p, cfg, cols, force=False)
    bad = dict(cols, **{"obs.rank": np.array([0, 5, 0], np.int32)})
    with pytest.raises(DumpError, match="rank out of range"):
        write_dump(p, cfg, bad)
    assert p.read_bytes() == before  # the good file survives a failed write
    assert os.listdir(tmp_path) == ["a.safetensors"]  # no temporaries left behind


def test_same_input_same_bytes(tmp_path):
    a = write(tmp_path / "a.safetensors", [obs(step=i) for i in range(5)])
    b = write(tmp_path / "b.safetensors", [obs(step=i) for i in range(5)])
    assert open(a, "rb").read() == open(b, "rb").read()


def test_atomic_write_replaces_a_link_never_its_target(tmp_path):
    """Hardening III item 4: with force, a symbolic link to a regular file is replaced by the new file; the file
    it points to (here in another directory) keeps its bytes. Without force it is an existing output."""
    from dcptool.dump import OutputExistsError, atomic_write, write_target

    (tmp_path / "other").mkdir()
    target = tmp_path / "other" / "theirs.safetensors"
    target.write_bytes(b"theirs")
    link = tmp_path / "out.safetensors"
    link.symlink_to(target)
    assert write_target(link) == link  # the path itself is what a write replaces
    with pytest.raises(OutputExistsError):
        atomic_write(link, [b"ours"], force=False)
    atomic_write(link, [b"ours"], force=True)
    assert not link.is_symlink() and link.read_bytes() == b"ours" and target.read_bytes() == b"theirs"
    assert sorted(os.listdir(tmp_path)) == ["other", "out.safetensors"]  # no temporaries left behind


@pytest.mark.parametrize("seed", range(3))
def test_columns_concatenated_in_pieces_equal_one_concatenation(monkeypatch, seed):
    """cat() a piece at a time (a Recorder's packing on its thread leaves the GIL free between pieces): the same
    columns, mixed dtypes included, and the same error for a value int32 cannot hold."""
    import dcptool.dump.write as W
    from dcptool.dump import FIELDS, ROW_FIELDS

    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, 1 << 20, int(rng.integers(0, 50))).astype(rng.choice(["<i4", "<i8", "<u2"]))
            for _ in range(200)]
    n = len(rows)
    vals = {f: [0] * n for f in FIELDS[:5]} | {f: [None] * n for f in FIELDS[5:]}
    rws = {k: [None] * n for k in ROW_FIELDS} | {"seq": rows, "dcp": rows}
    whole = W.columns(DumpConfig(dcp_size=2), ["a"] * n, vals, rws)[1]
    monkeypatch.setattr(W, "CAT_PIECE", 37)
    pieces = W.columns(DumpConfig(dcp_size=2), ["a"] * n, vals, rws)[1]
    assert sorted(whole) == sorted(pieces)
    for k in whole:
        assert whole[k].dtype == pieces[k].dtype and np.array_equal(whole[k], pieces[k]), k
    rws["seq"] = rows[:-1] + [np.array([1 << 40])]
    with pytest.raises(W.DumpError, match=f"rows.seq_lens: value {1 << 40} does not fit"):
        W.columns(DumpConfig(dcp_size=2), ["a"] * n, vals, rws)
