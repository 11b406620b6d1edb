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


# --------------------------------------------------------------------------------------------
# What the plugin records (one file per rank, rolled over): read end to end, replayed as the run's order


def _step_order(d):
    """d's observations gathered into the run's order (by step, then file, then order in the file), every column
    with them: the reference a read of the files end to end must replay like (what the read was before)."""
    from dcptool.dump import COLUMNS, RAGGED, Dump

    order = np.lexsort((d.file_obs, d.file_index, d["obs.step"]))
    inv = np.empty_like(order)
    inv[order] = np.arange(order.size)
    cols = {}
    for key, v in d.columns.items():
        if COLUMNS[key][1] == "n":
            v = np.asarray(v)[order]
            cols[key] = np.where(v >= 0, inv[np.maximum(v, 0)], -1) if key == "obs.parent" else v
    for offs, keys in RAGGED.items():
        if offs in d.columns:
            o = d[offs]
            lens = np.diff(o)[order]
            cols[offs] = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
            src = np.repeat(o[:-1][order] - cols[offs][:-1], lens) + np.arange(cols[offs][-1])
            cols.update({k: np.asarray(d[k])[src] for k in keys if k in d.columns})
    return Dump(files=d.files, config=d.config, columns=cols, file_index=d.file_index[order],
                file_obs=d.file_obs[order], injected=d.injected, sizes=d.sizes, recordings=d.recordings)


def _roll(path, parts: int) -> list[str]:
    """A rank's file rolled over into `parts` files (NAME.0000k.safetensors beside it, cut at step boundaries so
    parents stay in their file), as the plugin's writer rolls a recording; the file itself removed."""
    from dcptool.dump import COLUMNS, RAGGED, read_dump, write_dump

    d = read_dump(path)
    step = d["obs.step"]
    starts = np.flatnonzero(np.r_[True, step[1:] != step[:-1]])
    cuts = [0, *starts[np.linspace(0, starts.size, parts + 1).astype(int)[1:-1]].tolist(), d.n]
    out = []
    for k, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        cols = {key: v[a:b] for key, v in d.columns.items() if COLUMNS[key][1] == "n"}
        if "obs.parent" in cols:
            p = cols["obs.parent"]
            assert ((p == -1) | ((p >= a) & (p < b))).all()
            cols["obs.parent"] = np.where(p >= 0, p - a, -1)
        for offs, keys in RAGGED.items():
            if offs in d.columns:
                o = d[offs]
                cols[offs] = o[a : b + 1] - o[a]
                cols.update({key: d[key][o[a] : o[b]] for key in keys if key in d.columns})
        q = str(path).removesuffix(".safetensors") + f".{k:05d}.safetensors"
        write_dump(q, d.config, cols)
        out.append(q)
    os.remove(path)
    return out


def _findings(res) -> list[dict]:
    return [f.to_json() for f in res.findings]


LAYOUT_RUNS = [
    ("--dcp", "4", "--pcp", "2", "--steps", "24", "--pipeline", "legacy", "--seed", "2"),
    ("--dcp", "8", "--interleave", "16", "--steps", "16", "--pipeline", "fixed", "--inject",
     "flashinfer-global-pages,slot-wrong-group,ubatch-parent-rows,rank-disagree,graph-stale,capture-wrong-buffer,"
     "sentinel,dcp-qsl-local,tot-local,slot-all-ranks,dummy-none", "--seed", "3"),
    ("--dcp", "2", "--steps", "30", "--ubatches", "2", "--spec-method", "dflash", "--pipeline", "legacy",
     "--seed", "4"),
]


@pytest.mark.parametrize("args", LAYOUT_RUNS, ids=["dcp4-pcp2-legacy", "dcp8-fixed-faults", "dcp2-dflash-legacy"])
def test_rank_files_replay_as_the_run_in_step_order(tmp_path, args):
    """The plugin's layout (a file per rank, each rolled in three, given in any order) read end to end replays
    exactly as its observations gathered into step order: the same findings in the same order, the same problems,
    the same --split; in memory, streamed, and bounded."""
    from conftest import cli

    from dcptool.check.replay import replay, splits

    r = cli("simulate", *args, "--per-rank", "-o", tmp_path / "sim.safetensors")
    assert r.returncode == 0, r.stderr
    ranks = sorted(str(p) for p in tmp_path.iterdir())
    rolled = [q for p in ranks for q in _roll(p, 3)]
    for paths in (rolled, rolled[::-1], rolled[1:] + rolled[:1]):  # (a rank's files out of step order too)
        d = open_dumps(paths)
        assert not d.in_order
        want = replay(_step_order(d), "torch")
        assert want.errors > 0 or "fixed" in args
        for got in (replay(d, "torch"), replay(open_dumps(paths, stream=True), "torch"),
                    replay(open_dumps(paths, bounded=True), "torch", bounded=True)):
            assert _findings(got) == _findings(want)
            assert [p.to_json() for p in got.problems] == [p.to_json() for p in want.problems]
        assert [s.to_json() for s in splits(d, 2)] == [s.to_json() for s in splits(_step_order(d), 2)]


@pytest.mark.parametrize("seed", range(4))
def test_rollover_files_in_any_order_replay_as_the_run_in_step_order(tmp_path, seed):
    """Seeded random rollover sets whose steps are in no order (every file interleaves with every other; parents;
    sites listed in another order per file): the read end to end replays as the step-order gather does."""
    from dcptool.check.replay import replay

    paths = rollover_files(tmp_path, np.random.default_rng(seed), n=300, files=[3, 6][seed % 2], sorted_steps=False)
    d = open_dumps(paths)
    want = _findings(replay(_step_order(d), "torch"))
    assert want and _findings(replay(d, "torch")) == want
    assert _findings(replay(open_dumps(paths, bounded=True), "torch", bounded=True)) == want


def _canonical(d, lines: list[dict]) -> list[str]:
    """Each finding with every observation it names (`FILE:I`) replaced by what the observation is in any layout:
    (step, site, rank, micro-batch, its occurrence among those in its file's order); a detail's bare in-file
    indices (`obs`, `parent_obs`, ...) left out."""
    import re

    key, seen = {}, {}
    for i in range(d.n):  # (the files end to end: each file's order)
        k = (int(d["obs.step"][i]), d.site_name(i), int(d["obs.rank"][i]), int(d["obs.ubatch"][i]))
        seen[k] = seen.get(k, -1) + 1
        key[d.ref(i)] = str((*k, seen[k]))
    refs = re.compile("|".join(re.escape(r) for r in sorted(key, key=len, reverse=True)))
    out = []
    for x in lines:
        assert x["ref"] in key and x["file"] in d.files
        x = {k: v for k, v in x.items() if k not in ("obs", "file")}  # (the ref says both)
        x["detail"] = {k: v for k, v in x["detail"].items() if not k.endswith("obs")}  # (in-file indices: refs say)
        if x["source"] is not None:
            x["source"] = {k: v for k, v in x["source"].items() if k not in ("obs", "file")}
        out.append(refs.sub(lambda m: key[m.group(0)], json.dumps(x)))
    return out


@pytest.mark.parametrize("args", LAYOUT_RUNS[1:], ids=["dcp8-fixed-faults", "dcp2-dflash-legacy"])
def test_one_file_and_the_plugins_layouts_find_the_same(tmp_path, args):
    """One file and the same run as rank files, rolled files, a directory and a glob: the same findings (rule, row,
    values, text), each naming its layout's files; the rank-file layouts in the same order. (One DCP rank's PCP ranks
    share one file in the one-file layout, a file each in the others: that changes which buffers a rank's file holds,
    so PCP > 1 is compared between the rank-file layouts only, above.)"""
    from conftest import cli

    one = tmp_path / "one.safetensors"
    assert cli("simulate", *args, "-o", one).returncode == 0
    (tmp_path / "ranks").mkdir()
    assert cli("simulate", *args, "--per-rank", "-o", tmp_path / "ranks" / "run.safetensors").returncode == 0
    ranks = sorted(str(p) for p in (tmp_path / "ranks").iterdir())
    (tmp_path / "rolled").mkdir()
    rolled = []
    for p in ranks:
        q = tmp_path / "rolled" / os.path.basename(p)
        q.write_bytes(open(p, "rb").read())
        rolled += _roll(q, 2)

    def run(*spec) -> tuple[list[str], int]:
        r = cli("replay", *spec, "--json")
        lines = [json.loads(x) for x in r.stdout.splitlines()]
        files = lines[-1]["files"]
        return _canonical(open_dumps(files), [x for x in lines if x["type"] == "finding"]), r.returncode

    want, code = run(str(one))
    assert code == 1 and len(want) > 100
    by_ranks = run(*ranks)
    assert sorted(by_ranks[0]) == sorted(want) and by_ranks[1] == code
    glob = str(tmp_path / "ranks" / "*.safetensors")
    for spec in ([str(tmp_path / "ranks")], [glob], rolled, [str(tmp_path / "rolled")]):
        assert run(*spec) == by_ranks, spec


def test_the_read_in_bounded_memory_is_chosen_from_the_memory_available_and_said(tmp_path, monkeypatch):
    """Files over half the memory available are read in bounded memory: replay says so in one line on stderr and
    in --json's summary (`memory`), with the same findings; DCPTOOL_BOUNDED=1 or 0 forces either way."""
    from conftest import cli

    paths = rollover_files(tmp_path, np.random.default_rng(7), files=4)
    total = sum(os.path.getsize(p) for p in paths)
    runs = {}
    for avail, env in ((2 * total + 2, {}), (2 * total - 2, {}), (1 << 40, {"DCPTOOL_BOUNDED": "1"}),
                       (64, {"DCPTOOL_BOUNDED": "0"})):
        monkeypatch.setattr(files, "available_memory", lambda avail=avail: avail)
        r = cli("replay", *paths, "--json", env=env)
        lines = [json.loads(x) for x in r.stdout.splitlines()]
        runs[(avail, tuple(env.items()))] = (r, lines[:-1], lines[-1].get("memory"))
    (fit, lines, mem), (over, over_lines, over_mem), (forced, f_lines, f_mem), (no, n_lines, n_mem) = runs.values()
    assert fit.stderr == "" and mem is None and no.stderr == "" and n_mem is None
    assert over_mem == {"read": "bounded", "dump_bytes": total, "available_bytes": 2 * total - 2, "forced": False}
    assert over.stderr == (f"dcptool replay: {total / 1e9:.1f} GB read in bounded memory: over half the memory "
                           f"available ({(2 * total - 2) / 1e9:.1f} GB); DCPTOOL_BOUNDED=0 reads it into memory\n")
    assert f_mem == {"read": "bounded", "dump_bytes": total, "available_bytes": None, "forced": True}
    assert forced.stderr == f"dcptool replay: {total / 1e9:.1f} GB read in bounded memory, as asked\n"
    assert lines == over_lines == f_lines == n_lines and fit.returncode == over.returncode == 1
    r = cli("replay", *paths, env={"DCPTOOL_BOUNDED": "yes"})
    assert r.returncode == 2 and r.stderr.startswith("dcptool: DCPTOOL_BOUNDED='yes': expected 1") and not r.stdout


def _rank_files(tmp_path, n: int, ranks: int = 4, rows: int = 256) -> list[str]:
    """n observations of `rows` rows, each step one batch on `ranks` DCP ranks, a file per rank; views right but for
    a wrong value in every 1009th observation of a rank."""
    from dcptool.dcp.reference import local_np
    from dcptool.dump import DumpConfig, write_dump

    rng = np.random.default_rng(0)
    paths = []
    m = n // ranks
    seq = rng.integers(1, 1 << 16, m * rows).astype(np.int32)  # one batch, the same on every rank
    for r in range(ranks):
        view = local_np(seq, ranks, r, 16).astype(np.int32)
        view[np.arange(r, m, 1009) * rows + 3] += 1
        offs = np.arange(m + 1, dtype=np.int64) * rows
        cols = {"obs.step": np.arange(m, dtype=np.int64), "obs.site": np.zeros(m, np.int32),
                "obs.rank": np.full(m, r, np.int32), "obs.ubatch": np.full(m, -1, np.int32),
                "obs.num_reqs": np.full(m, rows, np.int32), "obs.num_reqs_padded": np.full(m, rows, np.int32),
                "obs.rows": offs, "rows.seq_lens": seq, "obs.has_dcp": np.ones(m, np.uint8), "obs.dcp_rows": offs,
                "rows.dcp_local_seq_lens": view}
        paths.append(str(tmp_path / f"rank{r}.00000.safetensors"))
        write_dump(paths[-1], DumpConfig(dcp_size=ranks, cp_interleave=16, sites=("x",)), cols)
    return paths


# `dcptool replay ARGS` in a fresh process that says its peak resident memory (VmHWM) on stderr as it exits
# (ru_maxrss would count the forking test process's pages too)
PEAK = ("import atexit, runpy, sys; atexit.register(lambda: sys.stderr.write(next(x for x in open('/proc/self/status') "
        "if x.startswith('VmHWM')))); sys.argv = ['dcptool', *sys.argv[1:]]; runpy.run_module('dcptool', "
        "run_name='__main__')")


def test_a_fresh_replay_of_rank_files_peaks_under_one_and_a_half_times_the_dump(tmp_path):
    """A memory check, not a timing: `dcptool replay` of four rank files (about 650 MB together, 320,000
    observations, a few wrong) in a fresh process peaks under 1.5x the files, the interpreter's memory included:
    each row column is read once, into its place, and nothing gathers the rows again (the merge into step order
    peaked at 4.5x). (What the checks hold for wrong views is bounded apart: BULK_ROWS.)"""
    import subprocess
    import sys

    from conftest import ROOT

    paths = _rank_files(tmp_path, 320_000)
    total = sum(os.path.getsize(p) for p in paths)
    r = subprocess.run([sys.executable, "-c", PEAK, "replay", *paths, "--json", "--backend", "torch"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 1 and r.stderr.startswith("VmHWM:"), r.stderr[-2000:]
    peak = int(r.stderr.split()[1]) * 1024
    assert total > 600e6 and peak < 1.5 * total, (peak / 1e6, total / 1e6)
