"""dump/lazy.py: rollover files read lazily (row columns left in the files, read on demand) give what the
in-memory read gives, hold few files open, notice a replaced file, and replay in bounded memory."""

import json
import os

import numpy as np
import pytest
from conftest import obs, rollover_files, write

from dcptool.dump import DumpConfig, DumpError, files, lazy, open_dumps, read_dump, write_dump


def _same_dump(a, b):
    assert a.files == b.files and a.config == b.config and a.n == b.n
    assert np.array_equal(a.file_index, b.file_index) and np.array_equal(a.file_obs, b.file_obs)
    assert sorted(a.columns) == sorted(b.columns)
    for k in a.columns:
        assert np.array_equal(np.asarray(a[k]), np.asarray(b[k])), k


@pytest.mark.parametrize("seed", range(6))
def test_lazy_merge_equals_the_in_memory_merge(tmp_path, monkeypatch, seed):
    from dcptool.check import scan as scan_mod
    from dcptool.check.replay import replay
    from dcptool.dump.lazy import ConcatRows

    rng = np.random.default_rng(seed)
    paths = rollover_files(tmp_path, rng, files=[2, 4, 7][seed % 3], sorted_steps=seed < 3)
    mem, lazy = open_dumps(paths, bounded=False), open_dumps(paths, bounded=True)
    assert not mem.bounded and lazy.bounded and isinstance(lazy["rows.seq_lens"], ConcatRows)
    _same_dump(mem, lazy)
    # against each file read alone: observation i is observation file_obs[i] of file file_index[i], the files end
    # to end; order_of sorts them by step, then file, then order in the file
    alone = [read_dump(p) for p in paths]
    assert mem.file_index.tolist() == sorted(mem.file_index.tolist())
    assert mem.file_obs.tolist() == [k for f in alone for k in range(f.n)]
    order = sorted(range(mem.n), key=lambda i: (mem["obs.step"][i], mem.file_index[i], mem.file_obs[i]))
    assert np.argsort(mem.order_of(np.arange(mem.n))).tolist() == order
    assert mem.in_order == (order == list(range(mem.n)))
    for i in range(mem.n):
        f, k = alone[mem.file_index[i]], int(mem.file_obs[i])
        assert mem["obs.step"][i] == f["obs.step"][k] and mem.site_name(i) == f.site_name(k)
        for rows in ("seq_lens_of", "dcp_of", "kv_pages_of"):
            x, y = getattr(f, rows)(k), getattr(lazy, rows)(i)
            assert (x is None and y is None) or np.array_equal(x, y)
    # reads the pipeline makes: slices at any bounds (empty, one row, across files), gathers, scalars
    for key in ("rows.seq_lens", "rows.dcp_local_seq_lens", "rows.kv_pages"):
        full, col = mem[key], lazy[key]
        for _ in range(50):
            a, b = np.sort(rng.integers(0, full.size + 1, 2))
            assert np.array_equal(col[a:b], full[a:b]) and np.array_equal(col[b:a], full[b:a])
        idx = rng.integers(-full.size, full.size, 500)
        assert np.array_equal(col[idx], full[idx]) and np.array_equal(lazy.take(key, idx % full.size),
                                                                      full[idx % full.size])
        assert col[full.size - 1] == full[-1] and col[-1] == full[-1] and len(col) == full.size
    monkeypatch.setattr(scan_mod, "CHUNK_ROWS", 500)  # chunks that straddle file boundaries
    want, got = replay(mem, "torch"), replay(lazy, "torch", bounded=True)
    assert [f.to_json() for f in got.findings] == [f.to_json() for f in want.findings]
    assert len(want.findings) > 0


def test_lazy_merge_keeps_the_order_rule_and_parents(tmp_path):
    """The files end to end, each in its own order; the run's order (order_of) by step, then file order, then order
    within the file (docs/format.md); parents stay within their file."""
    a = write(tmp_path / "r0.safetensors", [obs(step=0, site="x"), obs(step=1, site="x"),
                                            obs(step=2, site="x", ubatch=0, parent=1)])
    b = write(tmp_path / "r1.safetensors",
              [obs(step=s, rank=1, site=site) for s, site in ((0, "y"), (1, "x"), (1, "x"))]
              + [obs(step=3, rank=1, site="y", ubatch=0, parent=0)])
    c = write(tmp_path / "r2.safetensors", [obs(step=2), obs(step=2, ubatch=0, parent=0), obs(step=0)])
    d = open_dumps([a, b, c], bounded=True)
    assert d.bounded and d["obs.step"].tolist() == [0, 1, 2, 0, 1, 1, 3, 2, 2, 0]
    assert d.file_index.tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert d.file_obs.tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 2]
    assert d["obs.parent"].tolist() == [-1, -1, 1, -1, -1, -1, 3, -1, 7, -1]
    assert [d.site_name(i) for i in (0, 3, 6)] == ["x", "y", "y"]
    assert not d.in_order and np.argsort(d.order_of(np.arange(d.n))).tolist() == [0, 3, 9, 1, 4, 5, 2, 7, 8, 6]
    _same_dump(open_dumps([a, b, c], bounded=False), d)
    assert d.dcp_of(3).tolist() == [8, 12, 0, 0]  # rank 1's rows followed their observation, from file 1


def test_lazy_merge_holds_few_files_open(tmp_path, monkeypatch):
    """Each mapping keeps a descriptor: only a few files are mapped at a time (least recently used closed)."""
    from dcptool.check.replay import replay

    monkeypatch.setattr(lazy, "max_open_files", lambda: 4)
    paths = rollover_files(tmp_path, np.random.default_rng(5), n=300, files=12, sorted_steps=False)
    merged = open_dumps(paths, bounded=True)
    got = replay(merged, "torch", bounded=True)
    mapped = merged["rows.seq_lens"].files
    assert len(mapped.open) <= 4
    want = replay(open_dumps(paths, bounded=False), "torch")
    assert [f.to_json() for f in got.findings] == [f.to_json() for f in want.findings]


def test_lazy_merge_notices_a_file_replaced_after_it_was_read(tmp_path):
    import shutil

    paths = rollover_files(tmp_path, np.random.default_rng(1), files=2)
    d = open_dumps(paths, bounded=True)
    shutil.copyfile(paths[0], tmp_path / "copy")
    os.replace(tmp_path / "copy", paths[0])  # same bytes, another inode: not the file that was validated
    with pytest.raises(DumpError, match=r"run\.00000\.safetensors: changed while being read"):
        np.asarray(d["rows.seq_lens"])


def _big_rollover(tmp_path, files=4, rows=1 << 20, per_obs=1024, seed=0):
    """`files` files of `rows` rows each (seq_lens, views and page counts: 12 bytes a row), views right but
    for one wrong value in every 97th observation; steps continue across files, the last step of a file
    is also the first of the next (a rollover mid-step)."""
    from dcptool.dcp.reference import local_np

    rng = np.random.default_rng(seed)
    n = rows // per_obs
    paths = []
    for f in range(files):
        seq = rng.integers(1, 1 << 16, rows).astype(np.int32)
        rank = rng.integers(0, 4, n).astype(np.int32)
        local = local_np(seq, 4, np.repeat(rank, per_obs), 1)
        exp = local.astype(np.int32)
        exp[np.arange(0, n, 97) * per_obs + 5] += 1
        offs = np.arange(n + 1, dtype=np.int64) * per_obs
        cols = {"obs.step": (np.arange(n) // 4 + f * (n // 4 - 1)).astype(np.int64), "obs.site": np.zeros(n, np.int32),
                "obs.rank": rank, "obs.ubatch": np.full(n, -1, np.int32),
                "obs.num_reqs": np.full(n, per_obs, np.int32), "obs.num_reqs_padded": np.full(n, per_obs, np.int32),
                "obs.rows": offs, "rows.seq_lens": seq, "obs.has_dcp": np.ones(n, np.uint8), "obs.dcp_rows": offs,
                "rows.dcp_local_seq_lens": exp, "rows.kv_pages": -(-local // 16)}
        p = tmp_path / f"run.{f:05d}.safetensors"
        write_dump(p, DumpConfig(dcp_size=4, sites=("x",), page_size=16), cols)
        paths.append(str(p))
    return paths


RSS_SCRIPT = """
import json, sys
import numpy, torch
import dcptool.dump as dump_mod
from dcptool.check.replay import replay
def hwm():
    return next(int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith("VmHWM:"))
paths = sys.argv[2:]
import dcptool.dump.files
dcptool.dump.files.available_memory = lambda: int(sys.argv[1])
base = hwm()
d = dump_mod.open_dumps(paths)
res = replay(d, "torch", bounded=d.bounded)
print(json.dumps({"bounded": d.bounded, "peak": hwm() - base, "findings": [f.to_json() for f in res.findings]}))
"""


def test_rollover_files_larger_than_the_bound_replay_in_bounded_memory(tmp_path):
    """Eight files of 12 MB whose sum (96 MB) is over the bound (half of a pretended 40 MB available): the
    replay's peak resident memory grows by less than 32 MB (the scan's chunk buffers and gathers, whatever
    the files add up to), where merging them in memory (the old way, and the control run here, told there
    is plenty of memory) costs more than all of them together."""
    import subprocess
    import sys

    from conftest import ROOT

    paths = _big_rollover(tmp_path, files=8)
    total = sum(os.path.getsize(p) for p in paths)

    def run(avail: int) -> dict:
        r = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(avail), *paths], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.splitlines()[-1])

    lazy, mem = run(40 << 20), run(1 << 40)
    assert lazy["bounded"] and not mem["bounded"]
    assert lazy["findings"] == mem["findings"]
    # the copies record unrelated batches per rank, which rank-agree reports too; the rest is 11 per file
    assert len([f for f in mem["findings"] if f["rule"] != "rank-agree"]) == 8 * 11
    assert mem["peak"] > total, (mem["peak"], total)
    assert lazy["peak"] < 32 << 20 < total // 3, (lazy["peak"], total)


def test_commands_read_rollover_files_over_the_bound_lazily(tmp_path, monkeypatch):
    """replay, inspect and diff of a rollover directory: the same output whether merged in memory or lazily."""
    from typer.testing import CliRunner

    from dcptool.cli import app

    paths = rollover_files(tmp_path, np.random.default_rng(9), files=5)
    d = str(tmp_path)
    runs, said = {}, []

    def parsed(out: str) -> list:
        rows = [json.loads(line) for line in out.splitlines()]
        for row in rows:
            if isinstance(row, dict):
                row.pop("seconds", None)
                said.append(row.pop("memory", None))
        return rows

    for avail in (1 << 40, 64):  # plenty of memory, then none: lazy
        monkeypatch.setattr(files, "available_memory", lambda avail=avail: avail)
        r = [CliRunner().invoke(app, args) for args in (["replay", d, "--json"], ["inspect", d, "--json"],
                                                         ["diff", d, ",".join(paths), "--json"])]
        runs[avail] = [(x.exit_code, parsed(x.stdout)) for x in r]
    assert [c for c, _ in runs[64]] == [1, 0, 0] and len(runs[64][0][1]) > 10
    assert runs[64] == runs[1 << 40]
    # replay's summary says the bounded read (and nothing in memory); inspect and diff say nothing of it
    bounded = {"read": "bounded", "dump_bytes": sum(os.path.getsize(p) for p in paths), "available_bytes": 64,
               "forced": False}
    assert [m for m in said if m is not None] == [bounded]


def test_a_lazily_merged_file_replaced_before_its_rows_are_read_is_one_line(tmp_path, monkeypatch):
    import shutil

    from typer.testing import CliRunner

    import dcptool.check.replay as replay_mod
    from dcptool.cli import app

    paths = rollover_files(tmp_path, np.random.default_rng(4), files=3)
    monkeypatch.setattr(files, "available_memory", lambda: 64)
    real = replay_mod.replay

    def replaced_then_replay(*a, **k):
        shutil.copyfile(paths[1], tmp_path / "copy")
        os.replace(tmp_path / "copy", paths[1])
        return real(*a, **k)

    monkeypatch.setattr(replay_mod, "replay", replaced_then_replay)
    r = CliRunner().invoke(app, ["replay", str(tmp_path), "--json"])
    # the bounded read is said before the work starts; the error is then one line
    note, error = r.stderr.splitlines(keepends=True)
    assert r.exit_code == 2 and r.stdout == "" and note.startswith("dcptool replay: ") and "bounded memory" in note
    assert error.startswith(f"dcptool: {paths[1]}: changed while being read") and error.endswith("\n"), r.stderr


@pytest.mark.parametrize("pipeline", ["legacy", "fixed"])
def test_per_rank_simulation_replays_the_same_lazily(tmp_path, monkeypatch, pipeline):
    """Per-rank files of a simulated run (every step in every file: the files interleave completely;
    micro-batches with parents, query_start_loc, page counts): lazily merged, replay --json and
    --split 2 give what the in-memory merge gives."""
    from typer.testing import CliRunner

    from dcptool.cli import app

    r = CliRunner().invoke(app, ["simulate", "--dcp", "4", "--steps", "40", "--pipeline", pipeline, "--per-rank",
                                 "-o", str(tmp_path / "sim.safetensors")])
    assert r.exit_code == 0, r.stderr
    paths = sorted(str(p) for p in tmp_path.iterdir())
    assert len(paths) == 4
    out = {}
    for avail in (1 << 40, 64):
        monkeypatch.setattr(files, "available_memory", lambda avail=avail: avail)
        assert open_dumps(paths).bounded == (avail == 64)
        runs = [CliRunner().invoke(app, ["replay", *paths, "--json", *extra]) for extra in ([], ["--split", "2"])]
        out[avail] = [(x.exit_code, [json.loads(line) for line in x.stdout.splitlines()][:-1]) for x in runs]
    assert out[64] == out[1 << 40]
    assert out[64][0][0] == (1 if pipeline == "legacy" else 0)
