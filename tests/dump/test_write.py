"""dump/write.py: what the writer puts in a file (safetensors the library reads, the same bytes for the same input),
written atomically."""

import json
import os

import numpy as np
import pytest
from conftest import obs, write
from dump_cases import _cols

from dcptool.dump import DumpError, write_dump


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
