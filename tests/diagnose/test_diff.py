"""diff: alignment by (step, site, rank, ubatch, occurrence), every column, run order, CLI and JSON (docs/cli.md)."""

import json
import os

import numpy as np
import pytest
from conftest import cli, cli_subprocess, obs, write

from dcptool.diagnose import diff as diffmod
from dcptool.diagnose.diff import diff
from dcptool.dump import DumpConfig, Observation, open_dumps, read_dump, write_observations

FULL = dict(parent=None, req_start=-1, tok_start=-1, tok_stop=-1, num_tokens_padded=8, buffer=0x1000, graph=0)


def run(n_steps=4, ranks=(0, 1), **kw) -> list[Observation]:
    """A small run: a full batch and two micro-batches per step and rank, every optional column set."""
    out = []
    for step in range(n_steps):
        for r in ranks:
            seq = np.array([17 + step, 25, 0, 0], np.int32)
            parent = len(out)
            out.append(obs(step=step, rank=r, seq=seq, query_start_loc=[0, 1, 2, 2, 2], kv_pages=[2, 1, 0, 0],
                           **{**FULL, "buffer": 0x1000 + r}))
            for u in range(2):
                out.append(obs(step=step, site="ubatch", rank=r, seq=seq[u:u + 1].copy(), num_reqs=1, num_reqs_padded=1,
                               ubatch=u, parent=parent, req_start=u, tok_start=u, tok_stop=u + 1,
                               query_start_loc=[0, 1], kv_pages=[1], num_tokens_padded=1, buffer=0x2000 + 2 * r + u,
                               graph=0))
    return out


def page_cfg(**kw):
    return {"page_size": 16, **kw}


def both(tmp_path, a, b, **cfg):
    pa = write(tmp_path / "a.safetensors", a, **page_cfg(**cfg))
    pb = write(tmp_path / "b.safetensors", b, **page_cfg(**cfg))
    return pa, pb


def diff_of(tmp_path, a, b):
    return diff(*(read_dump(write(tmp_path / f"{n}.st", x, **page_cfg())) for n, x in (("a", a), ("b", b))))


def fields(res):
    return [(d.field, None if d.key is None else (d.key.step, d.key.site, d.key.rank, d.key.ubatch,
                                                  d.key.occurrence)) for d in res.differences]


def test_identical_runs_are_same(tmp_path):
    pa, pb = both(tmp_path, run(), run())
    res = diff(read_dump(pa), read_dump(pb))
    assert res.same and res.total == 0 and res.first is None and res.compared == len(run())
    assert res.skipped == {}
    p = cli_subprocess("diff", pa, pb)  # smoke: diff, a real process
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert "same" in p.stdout.splitlines()[-1]


# (field, how to break B's observation `i` of run(), expected row, A value, B value)
MUTATIONS = [
    ("has_dcp", 0, lambda o: setattr(o, "dcp_local_seq_lens", None), None, 1, 0),
    ("num_reqs", 0, lambda o: setattr(o, "num_reqs", 1), None, 2, 1),
    ("num_reqs_padded", 0, lambda o: setattr(o, "num_reqs_padded", 3), None, 4, 3),
    ("seq_lens", 3, lambda o: o.seq_lens.__setitem__(1, 99), 1, 25, 99),
    ("dcp_local_seq_lens", 0, lambda o: o.dcp_local_seq_lens.__setitem__(1, 7), 1, 13, 7),
    ("query_start_loc", 0, lambda o: o.query_start_loc.__setitem__(2, 3), 2, 2, 3),
    ("kv_pages", 0, lambda o: o.kv_pages.__setitem__(0, 3), 0, 2, 3),
    ("req_start", 2, lambda o: setattr(o, "req_start", 0), None, 1, 0),
    ("tok_start", 2, lambda o: setattr(o, "tok_start", 0), None, 1, 0),
    ("tok_stop", 1, lambda o: setattr(o, "tok_stop", 2), None, 1, 2),
    ("num_tokens_padded", 0, lambda o: setattr(o, "num_tokens_padded", 16), None, 8, 16),
    ("graph", 0, lambda o: setattr(o, "graph", 3), None, 0, 3),
]


@pytest.mark.parametrize("name,i,mutate,row,va,vb", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_each_column_is_compared(tmp_path, name, i, mutate, row, va, vb):
    b = run()
    mutate(b[i])
    pa, pb = both(tmp_path, run(), b)
    res = diff(read_dump(pa), read_dump(pb))
    assert [d.field for d in res.differences] == [name], res.differences
    d = res.differences[0]
    assert (d.row, d.a, d.b, d.a_obs, d.b_obs) == (row, va, vb, i, i)
    assert res.first == d and res.by_field == {name: 1} and res.compared == len(b)


def test_row_length_difference_counts_missing_rows(tmp_path):
    a, b = run(), run()
    b[0].dcp_local_seq_lens = b[0].dcp_local_seq_lens[:2]  # a short view
    res = diff_of(tmp_path, a, b)
    (d,) = res.differences
    assert (d.field, d.row, d.a, d.b, d.count) == ("dcp_local_seq_lens", 2, 0, None, 2)
    assert "4 rows in A, 2 in B" in d.message


def test_parent_compared_by_what_it_is_not_where(tmp_path):
    # B holds an extra observation at the front: every index shifts, parents still point at the same batches.
    a = run(2)
    b = [obs(step=-1, site="dummy")] + run(2)
    for o in b[1:]:
        if o.parent is not None:
            o.parent += 1
    res = diff_of(tmp_path, a, b)
    assert fields(res) == [("only-in-b", (-1, "dummy", 0, -1, 0))]
    b[2].parent = 4  # micro-batch 0 of step 0 rank 0 now claims rank 1's batch as its parent
    res = diff_of(tmp_path, a, b)
    assert fields(res)[1] == ("parent", (0, "ubatch", 0, 0, 0))
    assert "rank 1" in res.differences[1].message


def test_buffers_compared_by_sharing_not_address(tmp_path):
    a, b = run(), run()
    for o in b:
        o.buffer += 0x7F000000  # another process, other addresses, same sharing pattern
    res = diff_of(tmp_path, a, b)
    assert res.same
    b[8].buffer = b[7].buffer  # step 1 rank 0: micro-batch 1 reads micro-batch 0's buffer
    res = diff_of(tmp_path, a, b)
    (d,) = res.differences  # only there: later users of both buffers still name the same first user
    assert (d.field, d.key.step, d.key.ubatch, d.a, d.b) == ("buffer", 1, 1, 2, 1)
    assert f"obs {res.a_files[0]}:2 (step 0 ubatch rank 0 ubatch 1) in A" in d.message  # FILE:I, as --obs takes it
    assert f"obs {res.b_files[0]}:1 (step 0 ubatch rank 0 ubatch 0) in B" in d.message
    b[8].buffer = 0  # unknown on one side is a difference as well
    res = diff_of(tmp_path, a, b)
    assert "is unknown in B" in res.differences[0].message
    b[8].dcp_local_seq_lens = None  # ... but a missing view has no buffer to compare: has_dcp says it all
    res = diff_of(tmp_path, a, b)
    assert fields(res)[0] == ("has_dcp", (1, "ubatch", 0, 1, 0)) and "buffer" not in res.by_field


def test_different_lengths_and_occurrence(tmp_path):
    a = run(4)
    b = run(3)  # B stopped a step early
    b.append(obs(step=1, rank=0))  # and saw a second full batch of step 1 on rank 0
    res = diff_of(tmp_path, a, b)
    assert res.only_in_a == 6 and res.only_in_b == 1 and res.compared == len(run(3))
    got = fields(res)
    assert got[0] == ("only-in-b", (1, "attn_metadata", 0, -1, 1))  # run order: step 1 before step 3
    assert {k for f, k in got[1:]} == {(3, s, r, u, 0) for r in (0, 1) for s, u in
                                       (("attn_metadata", -1), ("ubatch", 0), ("ubatch", 1))}
    assert all(f == "only-in-a" for f, _ in got[1:])


def test_per_rank_files_and_site_order(tmp_path):
    a = run()
    pa = write(tmp_path / "a.safetensors", a, **page_cfg())
    d = tmp_path / "b"
    d.mkdir()
    for r in (0, 1):
        mine = [o for o in run() if o.rank == r]
        base = [i for i, o in enumerate(run()) if o.rank == r]
        for o in mine:
            if o.parent is not None:
                o.parent = base.index(o.parent)
        # B's files list the sites in the other order: names are compared, not indices
        write_observations(d / f"rank{r}.safetensors", mine,
                           DumpConfig(dcp_size=2, sites=("ubatch", "attn_metadata"), page_size=16))
    res = diff(read_dump(pa), open_dumps([d / "rank0.safetensors", d / "rank1.safetensors"]))
    assert res.same, res.differences
    p = cli("diff", pa, d)
    assert p.returncode == 0, p.stdout + p.stderr
    p = cli("diff", pa, f"{d}/rank*.safetensors")
    assert p.returncode == 0, p.stdout + p.stderr
    p = cli("diff", pa, f"{d}/rank1.safetensors,{d}/rank0.safetensors", "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    # a change in rank 1's file is found and named by that file
    mine = [o for o in run() if o.rank == 1]
    for j, o in enumerate(mine):
        o.parent = None if o.parent is None else j - o.ubatch - 1
    mine[3].seq_lens[0] += 1
    write_observations(d / "rank1.safetensors", mine, DumpConfig(dcp_size=2, page_size=16))
    p = cli("diff", pa, d, "--json")
    assert p.returncode == 1
    first = json.loads(p.stdout.splitlines()[0])
    assert first["field"] == "seq_lens" and first["b_file"].endswith("rank1.safetensors") and first["b_obs"] == 3
    assert first["key"] == {"step": 1, "site": "attn_metadata", "rank": 1, "ubatch": -1, "occurrence": 0}


def test_optional_columns_only_on_one_side_are_skipped(tmp_path):
    a = run()
    b = run()
    for o in b:
        o.kv_pages = o.query_start_loc = None
        o.buffer = o.graph = None
    pa = write(tmp_path / "a.st", a, **page_cfg())
    pb = write(tmp_path / "b.st", b, page_size=16)
    res = diff(read_dump(pa), read_dump(pb))
    assert res.same
    assert set(res.skipped) == {"query_start_loc", "kv_pages", "buffer", "graph"}
    assert res.skipped["kv_pages"] == "only A records rows.kv_pages"
    p = cli("diff", pb, pa)
    assert p.returncode == 0 and "skipped kv_pages: only B records rows.kv_pages" in p.stdout


def test_config_difference_comes_first(tmp_path):
    pa = write(tmp_path / "a.st", run(), **page_cfg())
    pb = write(tmp_path / "b.st", run(), **page_cfg(il=16))
    res = diff(read_dump(pa), read_dump(pb))
    assert fields(res) == [("config.cp_interleave", None)]
    assert (res.first.a, res.first.b) == (1, 16)


@pytest.mark.parametrize("depth", [1, 12])
def test_text_report_prints_first_divergence_last(tmp_path, depth):
    # whatever the temp path's length (depth 12: file names over 200 characters) and $COLUMNS, the last line
    # is the whole first divergence: output to a pipe is never wrapped
    b = run(6)
    b[30].dcp_local_seq_lens[0] = 0  # step 5
    b[7].seq_lens[0] = 3  # step 1, micro-batch 0 of rank 0
    d = tmp_path.joinpath(*["a-rather-long-directory-name"] * depth)
    d.mkdir(parents=True)
    pa, pb = both(d, run(6), b)
    for columns in ("40", "200"):
        p = cli("diff", pa, pb, env={"COLUMNS": columns})
        assert p.returncode == 1, p.stderr
        last = p.stdout.strip().splitlines()[-1]
        assert last.startswith(f"{pa} {pb} differ: first divergence at step 1 ubatch rank 0 ubatch 0: seq_lens:")
        table = p.stdout.split("dcptool diff")[0]
        assert table.index("seq_lens") < table.index("dcp_local_seq_lens")


def test_json_lines_match_design(tmp_path):
    b = run()
    b[0].dcp_local_seq_lens = None
    del b[4]  # step 0 rank 1 micro-batch 0
    b[6].parent -= 1  # keep parents pointing at the same batches
    b[7].parent -= 1
    for o in b[8:]:
        if o.parent is not None:
            o.parent -= 1
    pa, pb = both(tmp_path, run(), b)
    p = cli("diff", pa, pb, "--json")
    assert p.returncode == 1, p.stderr
    objs = [json.loads(line) for line in p.stdout.splitlines()]
    diffs, summary = objs[:-1], objs[-1]
    for d in diffs:
        assert d["type"] == "difference"
        assert {"key", "field", "a_obs", "b_obs", "row", "a", "b", "message"} <= set(d)
        assert set(d["key"]) == {"step", "site", "rank", "ubatch", "occurrence"}
    assert [(d["field"], d["a_obs"], d["b_obs"]) for d in diffs] == [("has_dcp", 0, 0), ("only-in-a", 4, None)]
    assert summary["type"] == "summary" and summary["compared"] == len(b) and summary["differences"] == 2
    assert summary["first"] == diffs[0]
    assert summary["by_field"] == {"only-in-a": 1, "has_dcp": 1}


@pytest.mark.parametrize("m", [0, 1, 3])
def test_max_findings_caps_the_list_not_the_count(tmp_path, m):
    b = run(6)
    for o in b[::3]:
        o.seq_lens[1] += 1
    pa, pb = both(tmp_path, run(6), b)
    p = cli("diff", pa, pb, "--json", "--max-findings", m)
    objs = [json.loads(line) for line in p.stdout.splitlines()]
    assert len(objs) == m + 1 and objs[-1]["differences"] == 12
    assert objs[-1]["first"]["key"]["step"] == 0  # the first divergence is known even when nothing is listed
    res = diff(read_dump(pa), read_dump(pb), m)
    assert len(res.differences) == m and res.total == 12


@pytest.mark.parametrize("args,what", [
    (("missing.safetensors", "{a}"), "missing.safetensors"),
    (("{tmp}", "{a}"), "no *.safetensors"),
    (("{tmp}/nothing*.safetensors", "{a}"), "no file matches"),
    (("{a}", "{bad}"), "bad.safetensors"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, args, what):
    a = write(tmp_path / "a.safetensors", run(1), page_size=16)
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    p = cli("diff", *[s.format(a=a, tmp=empty, bad=bad) for s in args])
    assert p.returncode == 2 and p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1 and what in p.stderr and "Traceback" not in p.stderr


# --------------------------------------------------------------------------------------------
# Seeded random runs against a straightforward per-observation reference


def _naive(a, b):
    """Dict-based alignment and field-by-field comparison: the definition, one observation at a time."""
    def keyed(d):
        seen, out = {}, {}
        for i in range(d.n):
            k = (int(d["obs.step"][i]), d.site_name(i), int(d["obs.rank"][i]), int(d["obs.ubatch"][i]))
            occ = seen.get(k, 0)
            seen[k] = occ + 1
            out[k + (occ,)] = i
        return out

    ka, kb = keyed(a), keyed(b)
    got = {("only-in-a", k) for k in ka.keys() - kb.keys()} | {("only-in-b", k) for k in kb.keys() - ka.keys()}
    for k in ka.keys() & kb.keys():
        i, j = ka[k], kb[k]
        for f in ("has_dcp", "num_reqs", "num_reqs_padded"):
            if a[f"obs.{f}"][i] != b[f"obs.{f}"][j]:
                got.add((f, k))
        if not np.array_equal(a.seq_lens_of(i), b.seq_lens_of(j)):
            got.add(("seq_lens", k))
        va, vb = a.dcp_of(i), b.dcp_of(j)
        if va is not None and vb is not None and not np.array_equal(va, vb):
            got.add(("dcp_local_seq_lens", k))
    return got


@pytest.mark.parametrize("seed", range(6))
def test_random_runs_match_reference(tmp_path, seed, monkeypatch):
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(diffmod, "ROW_CHUNK", int(rng.choice([1, 7, 128, 1 << 22])))  # chunk edges
    a = []
    for step in range(int(rng.integers(1, 30))):
        for _ in range(int(rng.integers(0, 5))):
            nrp = int(rng.choice([0, 1, 2, 127, 128, 129, 1000]))
            nr = int(rng.integers(0, nrp + 1))
            seq = rng.integers(0, 5000, nrp).astype(np.int32)
            seq[nr:] = 0
            a.append(obs(step=step, site=str(rng.choice(["attn_metadata", "dummy", "ubatch"])),
                         rank=int(rng.integers(0, 2)), seq=seq, num_reqs=nr, num_reqs_padded=nrp,
                         ubatch=int(rng.integers(-1, 2)), view=None if rng.random() < 0.1 else "auto"))
    b = []
    for o in a:
        r = rng.random()
        if r < 0.05:
            continue  # dropped
        view = o.dcp_local_seq_lens
        o2 = Observation(**{**o.__dict__, "seq_lens": o.seq_lens.copy(),
                            "dcp_local_seq_lens": None if view is None else view.copy()})
        if r < 0.1 and o2.seq_lens.size:
            o2.seq_lens[int(rng.integers(0, o2.seq_lens.size))] += 1
        elif r < 0.15 and o2.dcp_local_seq_lens is not None and o2.dcp_local_seq_lens.size:
            o2.dcp_local_seq_lens = o2.dcp_local_seq_lens[: int(rng.integers(0, o2.dcp_local_seq_lens.size))]
        elif r < 0.2:
            o2.dcp_local_seq_lens = None if o2.dcp_local_seq_lens is not None else np.zeros(o2.num_reqs_padded)
        b.append(o2)
        if rng.random() < 0.05:
            b.append(o2)  # a repeat: a second occurrence only B has
    rng.shuffle(b)  # file order within a step must not matter for the key, only for occurrence numbering
    b.sort(key=lambda o: o.step)
    da = read_dump(write(tmp_path / "a.st", a))
    db = read_dump(write(tmp_path / "b.st", b))
    res = diff(da, db)
    got = {(f, k) for f, k in fields(res)}
    # occurrences of repeated keys follow file order; the reference numbers them the same way
    assert got == _naive(da, db)
    assert res.total == len(got)
    # run order: steps never go backwards in the list
    steps = [d.key.step for d in res.differences]
    assert steps == sorted(steps)
    if res.differences:
        assert res.first == res.differences[0]


def test_many_observations_vectorised(tmp_path):
    """100k observations with rows: the whole diff runs without a Python loop per observation."""
    n = 100_000
    rng = np.random.default_rng(7)
    lens = rng.integers(0, 9, n)
    rows = np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=rows[1:])
    seq = rng.integers(1, 10_000, rows[-1]).astype(np.int32)
    cols = {"obs.step": np.arange(n) // 4, "obs.site": np.zeros(n), "obs.rank": np.arange(n) % 2,
            "obs.ubatch": np.full(n, -1), "obs.num_reqs": lens, "obs.num_reqs_padded": lens, "obs.rows": rows,
            "obs.has_dcp": np.ones(n), "obs.dcp_rows": rows, "rows.seq_lens": seq,
            "rows.dcp_local_seq_lens": (seq + 1) // 2}
    from dcptool.dump import write_dump

    cfg = DumpConfig(dcp_size=2, sites=("attn_metadata",))
    write_dump(tmp_path / "a.st", cfg, cols)
    wrong = rng.choice(rows[-1], 50, replace=False)
    seq2 = seq.copy()
    seq2[wrong] += 1
    write_dump(tmp_path / "b.st", cfg, {**cols, "rows.seq_lens": seq2})
    res = diff(read_dump(tmp_path / "a.st"), read_dump(tmp_path / "b.st"), 10)
    bad_obs = np.unique(np.searchsorted(rows, wrong, side="right") - 1)
    assert res.total == bad_obs.size and res.by_field == {"seq_lens": bad_obs.size}
    assert len(res.differences) == 10 and res.first.a_obs == bad_obs[0]
    assert os.path.getsize(tmp_path / "a.st") > 0


# --------------------------------------------------------------------------------------------
# Hardening III item 8a: every column the format has (dump.schema.COLUMNS) is compared


def _resized(cols: dict, offs: str, k: int, more: bool) -> dict:
    """Observation k's rows of every column `offs` sizes: one more (its last repeated), or none."""
    from dcptool.dump import RAGGED

    o = cols[offs]
    lo, hi = int(o[k]), int(o[k + 1])
    out = {offs: np.concatenate([o[: k + 1], o[k + 1 :] + (1 if more else lo - hi)])}
    for key in RAGGED[offs]:
        v = cols[key]
        out[key] = np.insert(v, hi, v[hi - 1]) if more else np.delete(v, np.s_[lo:hi])
    return out


def _edited(cols: dict, key: str, cfg) -> dict:
    """cols with one change that concerns `key` and leaves a valid file (validate_columns): a value of a
    per-observation or row column, a boundary of an offsets column moved by one row, a view turned None."""
    from dcptool.dump import COLUMNS, RAGGED
    from dcptool.dump.schema import validate_columns

    kind = COLUMNS[key][1]
    tries = []
    if key == "obs.has_dcp":  # a view turned None takes its rows along
        k = int(np.flatnonzero((cols["obs.has_dcp"] == 1) & (np.diff(cols["obs.dcp_rows"]) > 0))[0])
        o = cols["obs.dcp_rows"]
        lo, hi = int(o[k]), int(o[k + 1])
        tries.append({"obs.has_dcp": np.where(np.arange(o.size - 1) == k, 0, cols["obs.has_dcp"]).astype(np.uint8),
                      "obs.dcp_rows": np.concatenate([o[: k + 1], o[k + 1 :] - (hi - lo)]),
                      "rows.dcp_local_seq_lens": np.delete(cols["rows.dcp_local_seq_lens"], np.s_[lo:hi])})
    elif key == "obs.buffer":  # a view moved to a buffer of its own (buffers are compared by sharing)
        v = cols[key]
        _, first, count = np.unique(v, return_index=True, return_counts=True)
        k = int(first[np.flatnonzero(count > 1)[0]])
        tries.append({key: np.where(np.arange(v.size) == k, v.max() + 4096, v)})
    elif kind == "n+1":  # an observation's rows: one more (its last repeated), or none (not recorded)
        for k in np.flatnonzero(np.diff(cols[key]) > 0)[:: max(1, cols[key].size // 30)]:
            for more in (True, False):
                change = _resized(cols, key, int(k), more)
                if key == "obs.rows" and "obs.qsl" in cols and np.diff(cols["obs.qsl"])[k]:
                    change.update(_resized(cols, "obs.qsl", int(k), more))  # (query_start_loc: rows + 1 values)
                tries.append(change)
    else:
        v = cols[key]
        for k in (list(range(0, v.size, max(1, v.size // 20))) + [v.size - 1])[:40]:
            # (doubled or halved: a block size stays a multiple of its kernel block size; a hash may wrap: still an
            # edit)
            with np.errstate(over="ignore"):
                edits = (v[k] + 1, v[k] - 1, 1 - v[k] if v.dtype.kind in "iu" else v[k], v[k] * 2, v[k] // 2)
            for new in edits:
                if new != v[k]:
                    tries.append({key: np.where(np.arange(v.size) == k, new, v).astype(v.dtype)})
    for change in tries:
        out = {**cols, **change}
        try:
            validate_columns("edited", cfg, out)
        except Exception:
            continue
        assert any(k in RAGGED.get(key, ()) or k == key for k in change) or key == "obs.has_dcp"
        return out
    raise AssertionError(f"no valid one-value edit of {key}")


def test_diff_compares_every_column_the_format_has(tmp_path):
    """simulate's recording (with its features) has every column of dump.schema.COLUMNS; an edit in any one of them
    (dcp_query_start_loc and dcp_tot_seq_lens, the slot columns and the chunked context included) is a
    difference. Derived from the
    format's table: a column added to the format without diff comparing it fails here."""
    from dcptool.dump import COLUMNS, write_dump
    from dcptool.dump.transfer import OFFSETS, XFER
    from dcptool.model.simulate import SimConfig, simulate

    a = tmp_path / "a.safetensors"
    # (transfers too, the features, and the columns only some engines record: simulate records them where a fault
    # on them is on)
    simulate(SimConfig(steps=8, max_num_reqs=64, features=("chunked-context", "swa", "sparse"), kv_connector="nixl",
                       prefill_dcp=4, interleave=16,
                       inject=("graph-addr-moved", "buffer-undersized", "host-seq-written", "flashinfer-prefill-pages",
                               "slot-kernel-block")), a)
    d = read_dump(a)
    assert set(d.columns) == set(COLUMNS)  # the recording covers the whole format
    cols = {k: np.array(v) for k, v in d.columns.items()}
    assert diff(d, read_dump(a)).same
    for key in set(COLUMNS) - {OFFSETS[XFER]}:  # (a transfer observation has exactly one xfer row: its site says so)
        b = tmp_path / f"{key}.safetensors"
        write_dump(b, d.config, _edited(cols, key, d.config), d.injected[0])
        res = diff(d, read_dump(b))
        assert not res.same, f"an edit of {key} is not a difference"


@pytest.mark.parametrize("column,field", [("rows.dcp_query_start_loc", "dcp_query_start_loc"),
                                          ("rows.dcp_tot_seq_lens", "dcp_tot_seq_lens"),
                                          ("rows.positions", "positions"), ("rows.slot_mapping", "slot_mapping"),
                                          ("rows.slot_group", "slot_group")])
def test_issue15_columns_are_row_fields(tmp_path, column, field):
    """An edited value of row columns is named by its field, its row and both values, in text and JSON."""
    from dcptool.dump import write_dump
    from dcptool.model.simulate import SimConfig, simulate

    a = tmp_path / "a.safetensors"
    simulate(SimConfig(steps=4, max_num_reqs=32), a)
    d = read_dump(a)
    cols = {k: np.array(v) for k, v in d.columns.items()}
    v = cols[column]
    j = int(np.flatnonzero(v >= 0)[-1])  # (a slot_group stays in kv_groups: 1 - g)
    v[j] = 1 - v[j] if field == "slot_group" else v[j] + 7
    b = tmp_path / "b.safetensors"
    write_dump(b, d.config, cols, d.injected[0])
    res = diff(d, read_dump(b))
    assert res.by_field == {field: 1}, res.by_field
    f = res.first
    offs = {"dcp_query_start_loc": "obs.dqsl", "dcp_tot_seq_lens": "obs.tot"}.get(field, "obs.slots")
    i = int(np.searchsorted(cols[offs], j, side="right")) - 1  # the observation holding entry j
    assert (f.a_obs, f.row, f.b) == (i, j - int(cols[offs][i]), int(v[j])), f
    assert f.message.endswith(f"1 row(s) differ, first row {f.row}: {f.a} in A, {f.b} in B")
    r = cli("diff", a, b, "--json")
    assert r.returncode == 1 and json.loads(r.stdout.splitlines()[-1])["by_field"] == {field: 1}
