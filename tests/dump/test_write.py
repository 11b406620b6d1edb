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
