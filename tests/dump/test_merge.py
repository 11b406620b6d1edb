"""dump/merge.py: several files as one run (end to end, the run ordered by step, then file; parents remapped; one
layout), each file read once whatever it is named, and the choice of a lazy read when the files exceed half the
memory."""

import json
import os

import numpy as np
import pytest
from conftest import obs, rollover_files, write

from dcptool.dump import DumpError, files, open_dumps


def test_several_files_end_to_end_in_the_run_order_by_step_then_file(tmp_path):
    """The files end to end (each row column too: no gather), and order_of the run's order: by step, then file."""
    a = write(tmp_path / "r0.safetensors", [obs(step=s, rank=0, site="x") for s in (0, 1, 2)])
    b = write(tmp_path / "r1.safetensors",
              [obs(step=s, rank=1, site=site) for s, site in ((0, "y"), (1, "x"), (1, "x"), (3, "y"))])
    for stream in (False, True):
        d = open_dumps([a, b], stream=stream)
        d.finish()
        assert d["obs.step"].tolist() == [0, 1, 2, 0, 1, 1, 3]
        assert d.file_index.tolist() == [0, 0, 0, 1, 1, 1, 1]
        assert d.file_obs.tolist() == [0, 1, 2, 0, 1, 2, 3]
        assert not d.in_order and np.argsort(d.order_of(np.arange(7))).tolist() == [0, 3, 1, 4, 5, 2, 6]
        assert [d.site_name(i) for i in range(7)] == ["x", "x", "x", "y", "x", "x", "y"]
        assert d.dcp_of(3).tolist() == [8, 12, 0, 0]  # rank 1's rows followed their observation
        assert d["rows.seq_lens"].size == 7 * 4 and d["obs.rows"].tolist() == list(range(0, 29, 4))


def test_rolled_files_in_step_order_are_in_the_run_order(tmp_path):
    a = write(tmp_path / "run.00000.safetensors", [obs(step=s) for s in (0, 1, 1)])
    b = write(tmp_path / "run.00001.safetensors", [obs(step=s) for s in (1, 2)])
    d = open_dumps([a, b])
    assert d.in_order and d.order_of(np.arange(5)).tolist() == list(range(5))
    assert not open_dumps([b, a]).in_order


def test_several_files_parent_links_are_remapped(tmp_path):
    a = write(tmp_path / "a.safetensors", [obs(step=5), obs(step=5, ubatch=0, parent=0)])
    b = write(tmp_path / "b.safetensors", [obs(step=1), obs(step=1, ubatch=0, parent=0)])
    d = open_dumps([a, b])
    assert d["obs.parent"].tolist() == [-1, 0, -1, 2]


def test_several_files_must_share_the_layout(tmp_path):
    a = write(tmp_path / "a.safetensors", [obs()])
    b = write(tmp_path / "b.safetensors", [obs(dcp=4)], dcp=4)
    with pytest.raises(DumpError, match="dcp_size"):
        open_dumps([a, b])


def test_a_file_named_twice_is_read_once(tmp_path):
    """The same path twice, a symlink, a hard link, or the directory plus a file in it: one file, read
    once (at its first name), never double-counted."""
    from typer.testing import CliRunner

    from dcptool.cli import app

    d = tmp_path / "rec"
    d.mkdir()
    a = write(d / "a.safetensors", [obs(step=0, view=None), obs(step=1)])
    b = write(d / "b.safetensors", [obs(step=2, view=None)])
    (tmp_path / "link.safetensors").symlink_to(a)
    os.link(a, tmp_path / "hard.safetensors")
    runner = CliRunner()
    for args in ([a, a], [a, str(tmp_path / "link.safetensors")], [str(tmp_path / "hard.safetensors"), a],
                 [str(d), a], [a, str(d)], [a, os.path.join(str(d), ".", "a.safetensors")]):
        r = runner.invoke(app, ["replay", *args, "--json"])
        s = json.loads(r.stdout.splitlines()[-1])
        want = 3 if str(d) in args else 2
        assert r.exit_code == 1 and s["observations"] == want and s["by_rule"] == {"missing": want - 1}, args
        assert len(s["files"]) == len(set(s["files"])) == want - 1
        r = runner.invoke(app, ["inspect", *args, "--json"])
        assert json.loads(r.stdout)["observations"] == want
    assert open_dumps([b, b, a]).n == 3


def test_lazy_merge_is_chosen_when_the_files_exceed_half_the_memory(tmp_path, monkeypatch):

    paths = rollover_files(tmp_path, np.random.default_rng(3), files=3)
    total = sum(os.path.getsize(p) for p in paths)
    monkeypatch.setattr(files, "available_memory", lambda: 2 * total + 2)  # they fit: merged in memory
    assert not open_dumps(paths).bounded
    monkeypatch.setattr(files, "available_memory", lambda: 2 * total - 2)  # together over half: lazy
    d = open_dumps(paths)
    assert d.bounded and type(d["rows.seq_lens"]).__name__ == "ConcatRows"
    assert not open_dumps(paths[:1]).bounded  # one file alone is under the bound: read as before
