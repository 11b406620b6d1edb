"""Dump format v1: round trips, safetensors compatibility, multi-file order, every validation error of §2."""

import json
import os
import struct

import numpy as np
import pytest
from conftest import obs, write

from dcptool.dump import DumpConfig, DumpError, encode, files, lazy, open_dumps, pack, read_dump, stream, write_dump


def _cols(n=3, **over):
    cfg, cols = pack([obs(step=i, rank=i % 2) for i in range(n)], DumpConfig(dcp_size=2))
    cols.update(over)
    return cfg, cols


def _raw(path, header: dict, data: bytes = b"") -> str:
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


def _header_and_data(cfg, cols, injected=None):
    head, tensors = encode(cfg, cols, injected)
    hlen = struct.unpack("<Q", head[:8])[0]
    return json.loads(head[8 : 8 + hlen]), b"".join(a.tobytes() for _, a in tensors)


def test_round_trip_one_read_or_one_mapping(tmp_path):
    """Read: every column is a view of one in-memory copy of the file (no mapping a truncation could
    fault). Bounded (a dump larger than RAM): views of one mapping of the whole file."""
    import mmap

    p = write(tmp_path / "a.safetensors", [obs(step=s, rank=r) for s in range(4) for r in range(2)])
    d = read_dump(p)
    assert d.n == 8 and d.config.dcp_size == 2 and d.config.sites == ("attn_metadata",)
    assert not d.maps and not d.bounded
    assert len({id(d[k].base) for k in d.columns if d[k].size}) == 1
    copy = d["rows.seq_lens"].base
    assert isinstance(copy, np.ndarray) and copy.base is None and copy.dtype == np.uint8  # our own copy
    b = read_dump(p, bounded=True)
    assert b.bounded and set(b.maps) == {k for k in b.columns if b[k].size}
    assert {id(m[0]) for m in b.maps.values()} == {id(b[k].base.obj) for k in b.maps}
    assert isinstance(b["obs.step"].base.obj, mmap.mmap)
    assert all(np.array_equal(b[k], d[k]) for k in d.columns)
    assert d.seq_lens_of(3).tolist() == [17, 25, 0, 0]
    assert d.dcp_of(3).tolist() == [9, 13, 0, 0] if d["obs.rank"][3] == 0 else [8, 12, 0, 0]


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


def test_several_files_ordered_by_step_then_file(tmp_path):
    a = write(tmp_path / "r0.safetensors", [obs(step=s, rank=0, site="x") for s in (0, 1, 2)])
    b = write(tmp_path / "r1.safetensors",
              [obs(step=s, rank=1, site=site) for s, site in ((0, "y"), (1, "x"), (1, "x"), (3, "y"))])
    d = open_dumps([a, b])
    assert d["obs.step"].tolist() == [0, 0, 1, 1, 1, 2, 3]
    assert d.file_index.tolist() == [0, 1, 0, 1, 1, 0, 1]
    assert d.file_obs.tolist() == [0, 0, 1, 1, 2, 2, 3]
    assert [d.site_name(i) for i in range(7)] == ["x", "y", "x", "x", "x", "x", "y"]
    assert d.dcp_of(1).tolist() == [8, 12, 0, 0]  # rank 1's rows followed their observation


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


def _bad(tmp_path, mutate) -> str:
    cfg, cols = _cols()
    header, data = _header_and_data(cfg, cols)
    out = mutate(header, data)
    if isinstance(out, tuple):
        header, data = out
    return _raw(tmp_path / "bad.safetensors", header, data)


def _set(col, values):
    def m(header, data):
        arr = np.asarray(values)
        e = header[col]
        a, b = e["data_offsets"]
        raw = arr.astype({"I64": "<i8", "I32": "<i4", "U8": "u1", "I8": "i1"}[e["dtype"]]).tobytes()
        assert len(raw) == b - a
        return header, data[:a] + raw + data[b:]
    return m


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


def test_not_safetensors_and_truncation(tmp_path):
    p = tmp_path / "x"
    p.write_bytes(b"")
    with pytest.raises(DumpError, match="not a safetensors file"):
        read_dump(p)
    p.write_bytes(b"hello world, not a dump at all")
    with pytest.raises(DumpError, match=r"not a safetensors file \(it is text: 'hello world"):
        read_dump(p)
    p.write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 12\n")
    with pytest.raises(DumpError, match="Git LFS pointer"):
        read_dump(p)
    with pytest.raises(DumpError, match="is a directory"):
        read_dump(tmp_path)
    with pytest.raises(DumpError, match="cannot read"):
        read_dump(tmp_path / "nope.safetensors")
    good = write(tmp_path / "g.safetensors", [obs(), obs(step=1)])
    raw = open(good, "rb").read()
    for cut in (4, 12, len(raw) // 2, len(raw) - 1):
        t = tmp_path / f"cut{cut}.safetensors"
        t.write_bytes(raw[:cut])
        with pytest.raises(DumpError, match="truncated|not a safetensors|size mismatch"):
            read_dump(t)
    t = tmp_path / "long.safetensors"
    t.write_bytes(raw + b"\0" * 8)
    with pytest.raises(DumpError, match="size mismatch"):
        read_dump(t)


def test_header_too_large_is_refused_before_reading(tmp_path):
    p = tmp_path / "h.safetensors"
    p.write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(DumpError, match="header too large"):
        read_dump(p)


def test_overlapping_tensor_data(tmp_path):
    def m(header, data):
        header["obs.ubatch"]["data_offsets"] = list(header["obs.site"]["data_offsets"])
        return header, data
    with pytest.raises(DumpError, match="overlaps|size mismatch"):
        read_dump(_bad(tmp_path, m))


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
# Many files, files named twice, files that change while read (issue 12, items 4 and 10)


def _rollover_dir(tmp_path, n: int):
    """n rollover files of 2 observations each (copies of one small dump: the reader sees n files)."""
    import shutil

    d = tmp_path / "rec"
    d.mkdir()
    first = write(d / "run.00000.safetensors", [obs(step=0, rank=0), obs(step=0, rank=1, view=None)])
    for k in range(1, n):
        shutil.copyfile(first, d / f"run.{k:05d}.safetensors")
    return d


def test_2000_rollover_files_under_ulimit_256(tmp_path):
    """Each file's descriptor is closed once it is read: 2,000 files replay, inspect and diff with 256
    descriptors (a numpy memmap per column kept 11 per file: EMFILE after ~20 files)."""
    import resource
    import subprocess
    import sys

    from conftest import ROOT

    d = _rollover_dir(tmp_path, 2000)

    def run(*args):
        return subprocess.run([sys.executable, "-m", "dcptool", *args], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300,
                              preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)))

    r = run("replay", str(d), "--json")
    assert r.returncode == 1 and r.stderr == "", r.stderr[-2000:]
    s = json.loads(r.stdout.splitlines()[-1])
    assert s["observations"] == 4000 and s["by_rule"] == {"missing": 2000} and len(s["files"]) == 2000
    r = run("inspect", str(d), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["observations"] == 4000, r.stderr[-2000:]
    r = run("diff", str(d), str(d), "--json")
    assert r.returncode == 0 and json.loads(r.stdout.splitlines()[-1])["compared"] == 4000, r.stderr[-2000:]


def test_replay_and_inspect_take_a_directory(tmp_path):
    from typer.testing import CliRunner

    from dcptool.cli import app

    d = tmp_path / "rec"
    d.mkdir()
    for k in (10, 9, 2):  # natural order: 2, 9, 10 (a plain sort would put 10 first)
        write(d / f"rank0.{k}.safetensors", [obs(step=k, view=None if k == 9 else "auto")])
    (d / "notes.txt").write_text("not a dump")
    runner = CliRunner()
    r = runner.invoke(app, ["replay", str(d), "--json"])
    s = json.loads(r.stdout.splitlines()[-1])
    assert r.exit_code == 1 and s["observations"] == 3 and s["by_rule"] == {"missing": 1}
    assert [os.path.basename(f) for f in s["files"]] == ["rank0.2.safetensors", "rank0.9.safetensors",
                                                         "rank0.10.safetensors"]
    r = runner.invoke(app, ["inspect", str(d), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["observations"] == 3
    empty = tmp_path / "empty"
    empty.mkdir()
    for cmd in ("replay", "inspect"):
        r = runner.invoke(app, [cmd, str(empty)])
        assert r.exit_code == 2 and r.stderr == f"dcptool: {empty}: directory holds no *.safetensors dump\n"


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


@pytest.mark.parametrize("change", ["truncate", "rewrite", "replace", "append"])
def test_file_changing_while_read_is_one_line(tmp_path, monkeypatch, change):
    """A file truncated, rewritten in place, replaced (rename) or appended to between its header and its
    data: exit 2 and one line naming it, never an IndexError, a ValueError or a SIGBUS."""
    from typer.testing import CliRunner

    from dcptool.cli import app

    p = write(tmp_path / "run.safetensors", [obs(step=s, rank=s % 2) for s in range(50)])
    raw = open(p, "rb").read()
    real = files.header_of

    def header_then_change(path, f):
        out = real(path, f)
        if change == "truncate":
            os.truncate(p, len(raw) - 100)
        elif change == "rewrite":  # same size, other bytes, a later mtime
            with open(p, "r+b") as g:
                g.seek(len(raw) - 8)
                g.write(b"\xff" * 8)
            st = os.stat(p)
            os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        elif change == "replace":  # the path now names another file; the open one is the old: consistent
            q = tmp_path / "new.safetensors"
            write(q, [obs(step=99)])
            os.replace(q, p)
        else:
            with open(p, "ab") as g:
                g.write(b"\0" * 64)
        return out

    monkeypatch.setattr(files, "header_of", header_then_change)
    r = CliRunner().invoke(app, ["replay", p, "--json"])
    if change == "replace":  # read from the descriptor opened first: the old file, whole and unchanged
        assert r.exit_code == 0 and json.loads(r.stdout.splitlines()[-1])["observations"] == 50
        return
    assert r.exit_code == 2 and r.stdout == "" and r.stderr.count("\n") == 1, (r.stdout, r.stderr)
    assert r.stderr.startswith(f"dcptool: {p}: changed while being read"), r.stderr


def test_file_truncated_after_it_was_read_cannot_crash_the_replay(tmp_path):
    """Once read, a dump no longer depends on its file: truncated to 0 bytes (or rewritten) before the
    replay, the report is the one of what was read. A mapping would fault (SIGBUS) here: a subprocess."""
    import subprocess
    import sys

    from conftest import ROOT

    p = write(tmp_path / "run.safetensors", [obs(step=s, rank=s % 2, view=None if s == 7 else "auto")
                                             for s in range(5000)])
    script = f"""
import os, json
from dcptool.dump import open_dumps
from dcptool.check.replay import replay
d = open_dumps([{p!r}])
os.truncate({p!r}, 0)
res = replay(d, "torch")
print(json.dumps(res.by_rule()), d.n, int(d["rows.seq_lens"].sum()))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.split() == ['{"missing":', "1}", "5000", str(5000 * 42)]


def test_index_of_finds_an_observation_of_a_file_in_the_merged_run(tmp_path):
    from conftest import obs, write

    a = write(tmp_path / "a.safetensors", [obs(step=1), obs(step=3)])
    b = write(tmp_path / "b.safetensors", [obs(step=2, rank=1)])
    d = open_dumps([a, b])  # merged by step: a0, b0, a1
    assert [d.index_of(0, 0), d.index_of(1, 0), d.index_of(0, 1)] == [0, 1, 2]
    assert d.index_of(1, 1) is None and d.index_of(2, 0) is None


# --------------------------------------------------------------------------------------------
# Several files in bounded memory (issue 16 item 5): rows stay in the files, read on demand


def _rollover(tmp_path, rng, n=240, files=4, sorted_steps=True, N=4, I=2):
    """Seeded random observations cut into `files` rollover files at random observation boundaries (an
    empty file among them when `files` > 4), steps repeated so that one step spans several files; with
    sorted_steps=False the steps are in no order at all (every file interleaves with every other)."""
    from conftest import random_columns

    cols = random_columns(rng, n, N, I)
    cols["obs.step"] = (np.sort(rng.integers(0, n // 3, n)) if sorted_steps else rng.integers(0, 9, n)).astype(np.int64)
    cols["obs.site"] = rng.integers(0, 2, n).astype(np.int32)
    cols["obs.parent"] = np.full(n, -1, np.int64)
    cuts = np.concatenate([[0], np.sort(rng.integers(0, n + 1, files - 1)), [n]])
    if files > 4:
        cuts[2] = cuts[1]  # an empty file (a rollover with nothing recorded since)
    paths = []
    for f, (a, b) in enumerate(zip(cuts[:-1].tolist(), cuts[1:].tolist())):
        c = {}
        for k, v in cols.items():
            if k.startswith("obs.") and k not in ("obs.rows", "obs.dcp_rows"):
                c[k] = v[a:b].copy()
        if b - a > 1:  # parents within a file: a random earlier observation of the same file
            kids = np.flatnonzero(rng.random(b - a) < 0.3)
            kids = kids[kids > 0]
            c["obs.parent"][kids] = (rng.random(kids.size) * kids).astype(np.int64)
        for offs, keys in (("obs.rows", ["rows.seq_lens", "rows.kv_pages"]), ("obs.dcp_rows",
                                                                             ["rows.dcp_local_seq_lens"])):
            o = cols[offs]
            c[offs] = o[a : b + 1] - o[a]
            for k in keys:
                c[k] = cols[k][o[a] : o[b]]
        p = tmp_path / f"run.{f:05d}.safetensors"
        # each file names its sites in its own order: the merge must remap them
        sites = ("a", "b") if f % 2 == 0 else ("b", "a")
        if f % 2:
            c["obs.site"] = 1 - c["obs.site"]
        write_dump(p, DumpConfig(dcp_size=N, cp_interleave=I, sites=sites, page_size=16), c)
        paths.append(str(p))
    return paths


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
    from dcptool.dump.lazy import MergedRows

    rng = np.random.default_rng(seed)
    paths = _rollover(tmp_path, rng, files=[2, 4, 7][seed % 3], sorted_steps=seed < 3)
    mem, lazy = open_dumps(paths, bounded=False), open_dumps(paths, bounded=True)
    assert not mem.bounded and lazy.bounded and isinstance(lazy["rows.seq_lens"], MergedRows)
    _same_dump(mem, lazy)
    # against each file read alone: merged observation i is observation file_obs[i] of file file_index[i]
    alone = [read_dump(p) for p in paths]
    order = sorted(range(mem.n), key=lambda i: (mem["obs.step"][i], mem.file_index[i], mem.file_obs[i]))
    assert order == list(range(mem.n))
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
    """DESIGN §2: by step, then file order, then order within the file; parents stay within their file."""
    a = write(tmp_path / "r0.safetensors", [obs(step=0, site="x"), obs(step=1, site="x"),
                                            obs(step=2, site="x", ubatch=0, parent=1)])
    b = write(tmp_path / "r1.safetensors",
              [obs(step=s, rank=1, site=site) for s, site in ((0, "y"), (1, "x"), (1, "x"))]
              + [obs(step=3, rank=1, site="y", ubatch=0, parent=0)])
    c = write(tmp_path / "r2.safetensors", [obs(step=2), obs(step=2, ubatch=0, parent=0), obs(step=0)])
    d = open_dumps([a, b, c], bounded=True)
    assert d.bounded and d["obs.step"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert d.file_index.tolist() == [0, 1, 2, 0, 1, 1, 0, 2, 2, 1]
    assert d.file_obs.tolist() == [0, 0, 2, 1, 1, 2, 2, 0, 1, 3]
    assert d["obs.parent"].tolist() == [-1, -1, -1, -1, -1, -1, 3, -1, 7, 1]
    assert [d.site_name(i) for i in (0, 1, 9)] == ["x", "y", "y"]
    _same_dump(open_dumps([a, b, c], bounded=False), d)
    assert d.dcp_of(1).tolist() == [8, 12, 0, 0]  # rank 1's rows followed their observation, from file 1


def test_lazy_merge_is_chosen_when_the_files_exceed_half_the_memory(tmp_path, monkeypatch):

    paths = _rollover(tmp_path, np.random.default_rng(3), files=3)
    total = sum(os.path.getsize(p) for p in paths)
    monkeypatch.setattr(files, "available_memory", lambda: 2 * total + 2)  # they fit: merged in memory
    assert not open_dumps(paths).bounded
    monkeypatch.setattr(files, "available_memory", lambda: 2 * total - 2)  # together over half: lazy
    d = open_dumps(paths)
    assert d.bounded and type(d["rows.seq_lens"]).__name__ == "MergedRows"
    assert not open_dumps(paths[:1]).bounded  # one file alone is under the bound: read as before


def test_lazy_merge_holds_few_files_open(tmp_path, monkeypatch):
    """Each mapping keeps a descriptor: only a few files are mapped at a time (least recently used closed)."""
    from dcptool.check.replay import replay

    monkeypatch.setattr(lazy, "_max_open_files", lambda: 4)
    paths = _rollover(tmp_path, np.random.default_rng(5), n=300, files=12, sorted_steps=False)
    merged = open_dumps(paths, bounded=True)
    got = replay(merged, "torch", bounded=True)
    mapped = merged["rows.seq_lens"].files
    assert len(mapped.open) <= 4
    want = replay(open_dumps(paths, bounded=False), "torch")
    assert [f.to_json() for f in got.findings] == [f.to_json() for f in want.findings]


def test_lazy_merge_notices_a_file_replaced_after_it_was_read(tmp_path):
    import shutil

    paths = _rollover(tmp_path, np.random.default_rng(1), files=2)
    d = open_dumps(paths, bounded=True)
    shutil.copyfile(paths[0], tmp_path / "copy")
    os.replace(tmp_path / "copy", paths[0])  # same bytes, another inode: not the file that was validated
    with pytest.raises(DumpError, match=r"run\.00000\.safetensors: changed while being read"):
        np.asarray(d["rows.seq_lens"])


RSS_SCRIPT = """
import json, sys
import numpy, torch
import dcptool.dump as dump_mod
from dcptool.check.replay import replay
def hwm():
    return next(int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith("VmHWM:"))
paths = sys.argv[1:]
import dcptool.dump.files
dcptool.dump.files.available_memory = lambda: AVAIL
base = hwm()
d = dump_mod.open_dumps(paths)
res = replay(d, "torch", bounded=d.bounded)
print(json.dumps({"bounded": d.bounded, "peak": hwm() - base, "findings": len(res.findings),
                  "by_rule": res.by_rule(), "n": d.n}))
"""


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

    paths = _rollover(tmp_path, np.random.default_rng(9), files=5)
    d = str(tmp_path)
    runs = {}

    def parsed(out: str) -> list:
        rows = [json.loads(line) for line in out.splitlines()]
        for row in rows:
            if isinstance(row, dict):
                row.pop("seconds", None)
        return rows

    for avail in (1 << 40, 64):  # plenty of memory, then none: lazy
        monkeypatch.setattr(files, "available_memory", lambda avail=avail: avail)
        r = [CliRunner().invoke(app, args) for args in (["replay", d, "--json"], ["inspect", d, "--json"],
                                                         ["diff", d, ",".join(paths), "--json"])]
        runs[avail] = [(x.exit_code, parsed(x.stdout)) for x in r]
    assert [c for c, _ in runs[64]] == [1, 0, 0] and len(runs[64][0][1]) > 10
    assert runs[64] == runs[1 << 40]


def test_a_lazily_merged_file_replaced_before_its_rows_are_read_is_one_line(tmp_path, monkeypatch):
    import shutil

    from typer.testing import CliRunner

    import dcptool.check.replay as replay_mod
    from dcptool.cli import app

    paths = _rollover(tmp_path, np.random.default_rng(4), files=3)
    monkeypatch.setattr(files, "available_memory", lambda: 64)
    real = replay_mod.replay

    def replaced_then_replay(*a, **k):
        shutil.copyfile(paths[1], tmp_path / "copy")
        os.replace(tmp_path / "copy", paths[1])
        return real(*a, **k)

    monkeypatch.setattr(replay_mod, "replay", replaced_then_replay)
    r = CliRunner().invoke(app, ["replay", str(tmp_path), "--json"])
    assert r.exit_code == 2 and r.stdout == "" and r.stderr.count("\n") == 1, (r.stdout, r.stderr)
    assert r.stderr.startswith(f"dcptool: {paths[1]}: changed while being read"), r.stderr


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


# --- streamed reads (replay's): the scan follows the read ------------------------------------------------

def _replay_lines(d, backend="torch", **kw) -> list[str]:
    from dcptool.check.replay import replay

    return list(replay(d, backend, **kw).findings.json_lines())


@pytest.mark.parametrize("piece", [64, 4096, 1 << 20])
@pytest.mark.parametrize("seed", range(2))
def test_streamed_read_gives_the_one_reads_columns_and_findings(tmp_path, monkeypatch, piece, seed):
    """Pieces of any size (the scan's columns interleaved, the rest after them): every column as one read
    gives it, and the same findings from a replay on one thread and on background threads."""
    from conftest import random_dump

    import dcptool.check.scan as scan_mod

    monkeypatch.setattr(stream, "STREAM_PIECE", piece)
    monkeypatch.setattr(scan_mod, "CHUNK_ROWS", 1000)
    path = tmp_path / "r.safetensors"
    want = random_dump(path, np.random.default_rng(seed), 300, 4, 16)
    got = read_dump(path, stream=True)
    assert got.reader is not None and got.n == want.n
    for key in want.columns:
        assert np.array_equal(got[key], want[key]), key
    got.finish()
    assert got.reader is None and type(got.columns) is dict  # (plain columns once all is in)
    lines = _replay_lines(want)
    assert lines and _replay_lines(read_dump(path, stream=True)) == lines
    assert _replay_lines(read_dump(path, stream=True), bounded=True) == lines  # (one thread)


def test_the_scan_follows_a_slow_read(tmp_path, monkeypatch):
    """With a slow read the scan's chunks go on while later rows are still being read (Dump.upto waits for its
    chunk alone), and the findings are those of one read."""
    import time

    from conftest import random_dump

    import dcptool.check.scan as scan_mod
    import dcptool.dump as dump_mod

    monkeypatch.setattr(stream, "STREAM_PIECE", 2048)
    monkeypatch.setattr(scan_mod, "CHUNK_ROWS", 500)
    monkeypatch.setattr(scan_mod, "CHUNK_ROWS_THREADED", 500)  # (a many-core host scans on several threads)
    path = tmp_path / "r.safetensors"
    want = _replay_lines(random_dump(path, np.random.default_rng(7), 400, 4, 16))
    real_pread, real_upto = files.pread, dump_mod.Dump.upto
    ahead = []

    def slow(*a):
        time.sleep(0.002)
        return real_pread(*a)

    def upto(self, key, n):
        out = real_upto(self, key, n)
        if self.reader is not None:
            ahead.append(key in self.reader.pending)  # the column was still being read when a chunk got its rows
        return out

    monkeypatch.setattr(files, "pread", slow)
    monkeypatch.setattr(dump_mod.Dump, "upto", upto)
    assert _replay_lines(read_dump(path, stream=True)) == want
    assert ahead and any(ahead)


def test_a_streamed_bad_file_is_its_dump_error_not_a_checks_exception(tmp_path, monkeypatch):
    """A row value the read finds bad only once it is in (a negative seq_len): replay raises the file's
    DumpError, also when a check has meanwhile raised on those rows; the command line: exit 2, one line."""
    from typer.testing import CliRunner

    import dcptool.check.replay as replay_mod
    from dcptool.cli import app

    p = _bad(tmp_path, _set("rows.seq_lens", [17, 25, 0, 0, 17, -25, 0, 0, 17, 25, 0, 0]))
    with pytest.raises(DumpError, match="rows.seq_lens: negative length -25 at row 5"):
        _replay_lines(read_dump(p, stream=True))

    def broken(d):
        raise IndexError("a check tripped over the unchecked rows")

    monkeypatch.setattr(replay_mod, "check_shape", broken)
    with pytest.raises(DumpError, match="negative length"):
        _replay_lines(read_dump(p, stream=True))
    r = CliRunner().invoke(app, ["replay", p, "--json"])
    assert r.exit_code == 2 and r.stdout == "" and r.stderr.count("\n") == 1, (r.stdout, r.stderr)
    assert r.stderr.startswith(f"dcptool: {p}: rows.seq_lens: negative length -25 at row 5"), r.stderr


def test_a_file_truncated_while_streamed_is_one_dump_error(tmp_path, monkeypatch):
    """Truncated after its per-observation columns were read, while its rows are: DumpError naming the file
    (from the read's thread, raised by whoever waits and by finish()), never a partly read replay."""

    p = write(tmp_path / "run.safetensors", [obs(step=s, rank=s % 2) for s in range(50)])
    size = os.path.getsize(p)
    real = stream._Reader._run

    def cut_then_read(self):
        os.truncate(p, size - 40)
        real(self)

    monkeypatch.setattr(stream._Reader, "_run", cut_then_read)
    d = read_dump(p, stream=True)
    with pytest.raises(DumpError, match=f"^{p}: changed while being read"):
        d["rows.dcp_local_seq_lens"]
    with pytest.raises(DumpError, match="changed while being read"):
        _replay_lines(d)


def test_streamed_read_without_preadv(tmp_path, monkeypatch):
    """Where os.preadv is missing (older macOS), the streamed read copies what os.pread returns: the same columns."""

    monkeypatch.setattr(stream, "STREAM_PIECE", 100)
    p = write(tmp_path / "run.safetensors", [obs(step=s, rank=s % 2) for s in range(30)])
    want = read_dump(p)
    monkeypatch.delattr(os, "preadv")
    got = read_dump(p, stream=True)
    got.finish()
    assert all(np.array_equal(got[k], want[k]) for k in want.columns)


def test_a_streamed_read_never_hands_out_unread_values(tmp_path, monkeypatch):
    """A read plan that missed some values (a bug, not a file error) raises when they are asked for, instead of
    handing out the buffer's unread bytes."""

    p = write(tmp_path / "run.safetensors", [obs(step=s, rank=s % 2) for s in range(30)])
    real = stream._Reader._plan
    monkeypatch.setattr(stream._Reader, "_plan", lambda self, rows: real(self, rows)[:-1])  # (the last piece lost)
    d = read_dump(p, stream=True)
    d.reader.thread.join()
    lost = [k for k, n in d.reader.need.items() if d.reader.got[k] < n]
    assert lost
    with pytest.raises(RuntimeError, match="the streamed read ended at value"):
        d[lost[0]]


def test_take_on_a_streamed_dump_waits_for_what_it_gathers_only(tmp_path, monkeypatch):
    """Dump.take on a dump still being read returns once the values up to its largest index are in (provenance's
    lead follows the read so), while the rest of the column is still held back."""
    import threading


    monkeypatch.setattr(stream, "STREAM_PIECE", 64)
    p = write(tmp_path / "run.safetensors", [obs(step=s, rank=s % 2) for s in range(60)])
    want = read_dump(p)
    go, real, calls = threading.Event(), files.pread, []

    def held(*a):
        if threading.current_thread().name == "dcptool-read":  # (the per-observation columns come first, here)
            calls.append(a)
            if len(calls) > 2:  # the reader's first pieces only, then it waits
                assert go.wait(10)
        return real(*a)

    monkeypatch.setattr(files, "pread", held)
    d = read_dump(p, stream=True)
    got = d.take("rows.seq_lens", np.array([0, 1, 2]))
    assert got.tolist() == want["rows.seq_lens"][:3].tolist()
    assert "rows.seq_lens" in d.reader.pending  # (the column is not read whole yet)
    go.set()
    d.finish()
    assert np.array_equal(d["rows.seq_lens"], want["rows.seq_lens"])
