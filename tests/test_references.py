"""Every observation reference a report prints (text, one screen, JSON, HTML, problems, provenance, diff, the first
finding) is `FILE:I`, and `replay --obs` takes it as printed and shows that observation: on one file, on per-rank files
(`simulate --per-rank`) read as a list, a quoted glob or a directory, and on a Recorder's rolled files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, cli, cli_pty, screen_lines

from dcptool.dump import open_dumps, read_dump
from dcptool.engine.record import Recorder
from dcptool.model.simulate import SimConfig, simulate

REF = re.compile(r"(/[\w./-]+?\.safetensors):(\d+)\b")
SAMPLE = 40  # references pasted back per run (the first, the last, and a seeded sample between)


def _rolled(src: str, out: Path, every: int) -> list[str]:
    """src re-recorded observation by observation through a Recorder that rolls over every `every` observations."""
    d = open_dumps([src])
    c = d.config
    out.mkdir()

    def opt(key: str, i: int, unknown: int = -1):
        v = int(d[key][i]) if d.has(key) else unknown
        return None if v == unknown else v

    with Recorder(out / "run.safetensors", c.dcp_size, c.cp_interleave, sites=c.sites, pcp_size=c.pcp_size,
                  page_size=c.page_size, engine=c.engine, engine_version=c.engine_version, note="rolled",
                  rollover=every) as rec:
        for i in range(d.n):
            rec.observe(step=int(d["obs.step"][i]), site=d.site_name(i), rank=int(d["obs.rank"][i]),
                        seq_lens=d.seq_lens_of(i), num_reqs=int(d["obs.num_reqs"][i]),
                        num_reqs_padded=int(d["obs.num_reqs_padded"][i]), dcp_local_seq_lens=d.dcp_of(i),
                        ubatch=int(d["obs.ubatch"][i]), parent=opt("obs.parent", i), req_start=opt("obs.req_start", i),
                        tok_start=opt("obs.tok_start", i), tok_stop=opt("obs.tok_stop", i),
                        query_start_loc=d.qsl_of(i), num_tokens_padded=opt("obs.num_tokens_padded", i),
                        buffer=opt("obs.buffer", i, 0), graph=int(d["obs.graph"][i]), kv_pages=d.kv_pages_of(i))
    files = sorted(str(p) for p in out.glob("run.*.safetensors"))
    assert len(files) > 3
    return files


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (the arguments naming the run, its files): one file, per-rank files three ways, rolled files."""
    t = tmp_path_factory.mktemp("refs")
    (t / "pr").mkdir()
    (t / "fx").mkdir()
    legacy = simulate(SimConfig(dcp=4, steps=20, pipeline="legacy", seed=3), t / "pr" / "run.safetensors",
                      per_rank=True)
    fixed = simulate(SimConfig(dcp=4, steps=20, seed=3), t / "fx" / "run.safetensors", per_rank=True)
    one = str(ROOT / "samples" / "legacy.safetensors")
    rolled = _rolled(one, t / "rolled", 97)
    return {"one file": ([one], [one]),
            "per-rank list": (legacy.files, legacy.files),
            "per-rank glob": ([str(t / "pr" / "run.rank*.safetensors")], legacy.files),
            "per-rank directory": ([str(t / "pr")], legacy.files),
            "rolled directory": ([str(t / "rolled")], rolled),
            "fixed per-rank": ([str(t / "fx")], fixed.files)}


def _refs(text: str) -> list[tuple[str, int]]:
    return [(f, int(i)) for f, i in REF.findall(text)]


def _shown(args: list[str], ref: str) -> dict:
    r = cli("replay", *args, "--obs", ref, "--json")
    assert r.returncode in (0, 1), (ref, r.stderr)
    return next(json.loads(x) for x in r.stdout.splitlines() if '"type": "rows"' in x)


def _paste_back(args: list[str], files: list[str], refs: list[tuple[str, int]]) -> None:
    """Each reference, pasted into --obs as printed, shows observation I of FILE: its step, site and rank as the file
    itself holds them."""
    assert refs
    uniq = sorted(set(refs), key=refs.index)
    pick = np.random.default_rng(0).permutation(len(uniq))[:SAMPLE].tolist() + [0, len(uniq) - 1]
    held = {}
    for k in sorted(set(pick)):
        f, i = uniq[k]
        assert f in files, (f, files)
        d = held.setdefault(f, read_dump(f))
        v = _shown(args, f"{f}:{i}")
        assert (v["file"], v["obs"], v["ref"]) == (f, i, f"{f}:{i}")
        assert (v["step"], v["site"], v["rank"]) == (int(d["obs.step"][i]), d.site_name(i), int(d["obs.rank"][i]))


@pytest.mark.parametrize("name", ["one file", "per-rank list", "per-rank glob", "per-rank directory",
                                  "rolled directory"])
def test_every_text_json_and_html_reference_pastes_back(runs, tmp_path, name):
    args, files = runs[name]
    text = cli("replay", *args)  # a pipe: the whole report
    assert text.returncode == 1, text.stderr
    js = cli("replay", *args, "--json", "--html", tmp_path / "r.html")
    html = (tmp_path / "r.html").read_text()
    objs = [json.loads(x) for x in js.stdout.splitlines()]
    refs = _refs(text.stdout) + _refs(js.stdout) + _refs(html)
    assert len({f for f, _ in refs}) > 1 or name == "one file"  # several files: each named as itself
    # the forms each report uses: problems and the first finding (text), provenance (messages), JSON's ref keys
    assert re.search(r"first at /\S+\.safetensors:\d+ \(step", text.stdout)
    assert re.search(r"first finding: /\S+\.safetensors:\d+ ", text.stdout)
    stale = [o for o in objs if o.get("rule") == "stale" and o.get("source")]
    if stale:
        assert f"(obs {stale[0]['source']['ref']}, " in stale[0]["message"]
    for o in objs:
        if o["type"] == "finding":
            assert o["ref"] == f"{o['file']}:{o['obs']}"
    _paste_back(args, files, refs)
    # a finding's own step, site and rank are those of the observation its reference shows
    for o in [o for o in objs if o["type"] == "finding"][:: max(1, len(objs) // 15)]:
        v = _shown(args, o["ref"])
        assert (v["step"], v["site"], v["rank"], v["ubatch"]) == (o["step"], o["site"], o["rank"], o["ubatch"])


def test_screen_references_paste_back(runs):
    args, files = runs["per-rank directory"]
    code, out = cli_pty("replay", *args)
    lines = screen_lines(out)
    assert code == 1 and lines[-1].startswith("open it: --obs ")
    _paste_back(args, files, _refs(lines[-1]))
    first = re.search(r"first at (\S+) \(step (\d+) (\w+) rank (\d+)", " ".join(lines[-8:]))
    v = _shown(args, first[1])
    assert (str(v["step"]), v["site"], str(v["rank"])) == first.groups()[1:]


def test_diff_references_paste_back(runs, tmp_path):
    (a, fa), (b, fb) = runs["per-rank directory"], runs["fixed per-rank"]
    text = cli("diff", a[0], b[0])
    js = cli("diff", a[0], b[0], "--json", "--html", tmp_path / "d.html")
    assert text.returncode == js.returncode == 1
    html = (tmp_path / "d.html").read_text()
    out = text.stdout + js.stdout + html
    refs = _refs(out)
    in_a = [(f, i) for f, i in refs if f in fa]
    in_b = [(f, i) for f, i in refs if f in fb]
    assert in_a and in_b and len(in_a) + len(in_b) == len(refs)
    assert re.search(r"\(A: \S+:\d+, B: \S+:\d+\)$", text.stdout.strip())  # the first divergence, last
    _paste_back(a, fa, in_a)
    _paste_back(b, fb, in_b)


def test_an_index_alone_works_for_one_file_and_is_refused_for_several(runs):
    one, _ = runs["one file"]
    assert _shown(one, "297")["obs"] == 297
    args, files = runs["per-rank list"]
    r = cli("replay", *args, "--obs", "3")
    assert r.returncode == 2 and r.stderr == (f"dcptool replay: --obs: 3: 4 files are read; name the file, e.g. "
                                              f"{files[0]}:3\n")
    rel = Path(files[1]).name  # the same file under another name: taken too
    r = cli("replay", *args, "--obs", f"{rel}:3", "--json", cwd=Path(files[1]).parent)
    assert r.returncode == 1 and json.loads(next(x for x in r.stdout.splitlines() if '"rows"' in x))["file"] == files[1]
