"""The replay as a picture: the terminal timeline (exact text), the HTML report (structure, links, caps) and the
HTML in headless Chromium (skipped when Chromium is absent)."""

from __future__ import annotations

import io
import json
import re
import shutil
import struct
import subprocess
import zlib
from collections import Counter
from html.parser import HTMLParser

import numpy as np
import pytest
from conftest import cli, expected_view, obs, write
from rich.console import Console

from dcptool.check.replay import obs_grid, replay
from dcptool.dcp.slicing import split_batch
from dcptool.dump import open_dumps
from dcptool.report import text as report
from dcptool.report import timeline
from dcptool.report.html import VIEW_FINDINGS, VIEW_ROWS, render_html

SEQ = np.array([64, 96, 512, 32, 48, 0], np.int32)  # DESIGN §1's worked example, one padded row
QSL = np.array([0, 1, 2, 12, 13, 14, 14], np.int32)


def timeline_run(steps: int = 12) -> list:
    """Two DCP ranks; sites attn_metadata (every step), ubatch (2 micro-batches from step 2 on) and dummy (steps 4
    and 8). Faults: a -1 in a padded row (step 3, rank 0), a view one row short (step 10, rank 1), micro-batch 0
    copying its parent's rows on rank 1 from step 6 on, None in the dummy run of step 8 (both ranks)."""
    out = []
    for step in range(steps):
        seq = SEQ + np.array([step] * 5 + [0], np.int32)
        for rank in (0, 1):
            view = expected_view(seq, 5, 6, 2, rank)
            if (step, rank) == (3, 0):
                view[5] = -1
            if (step, rank) == (10, 1):
                view = view[:5]
            parent = len(out)
            out.append(obs(step, "attn_metadata", rank, seq, 5, 6, view=view, query_start_loc=QSL))
            if step < 2:
                continue
            for u, ub in enumerate(split_batch(QSL, seq, 5, 6, None, 2)):
                sl = ub.slice
                v = expected_view(ub.seq_lens, ub.num_reqs, ub.num_reqs_padded, 2, rank)
                if (u, rank) == (0, 1) and step >= 6:
                    v = expected_view(seq, 5, 6, 2, rank)[sl.req_start : sl.req_stop]  # the parent's rows
                out.append(obs(step, "ubatch", rank, ub.seq_lens, ub.num_reqs, ub.num_reqs_padded, view=v, ubatch=u,
                               parent=parent, req_start=sl.req_start, tok_start=sl.tok_start, tok_stop=sl.tok_stop,
                               query_start_loc=ub.query_start_loc))
        if step in (4, 8):
            out += [obs(step, "dummy", rank, view=None if step == 8 else "auto") for rank in (0, 1)]
    return out


def expected_findings(steps: int = 12) -> list[tuple]:
    """(step, site, rank, ubatch, rule) of every fault timeline_run plants, in observation order."""
    out = [(3, "attn_metadata", 0, -1, "padding")]
    for s in range(6, steps):
        if s == 8:
            out += [(8, "dummy", r, -1, "missing") for r in (0, 1)]
        if s == 10:
            out.append((10, "attn_metadata", 1, -1, "shape"))
        out += [(s, "ubatch", 1, 0, "stale"), (s, "ubatch", 1, 0, "rank-sum")]
    return sorted(out, key=lambda t: (t[0], t[1] == "dummy"))


@pytest.fixture(scope="module")
def run12(tmp_path_factory):
    p = write(tmp_path_factory.mktemp("tl") / "run.safetensors", timeline_run())
    return p, replay(open_dumps([p]), "torch", views=VIEW_FINDINGS)


def text_of(res, width: int, **kw) -> str:
    buf = io.StringIO()
    report.render_timeline(res, Console(file=buf, width=width, color_system=None, **kw))
    return buf.getvalue()


def test_the_run_holds_the_planted_faults(run12):
    _, res = run12
    got = [(f.step, f.site, f.rank, f.ubatch, f.rule) for f in res.findings]
    assert got == expected_findings()
    assert all(f.source.relation == "parent-rows" for f in res.findings if f.rule == "stale")


def test_timeline_text_exact(run12):
    # 1 step per column; cells: · clean, blank = no observations, else the worst finding's code
    assert text_of(run12[1], 80) == (
        "Timeline of steps 0..11 (1 step per column, micro-batches folded in)\n"
        "step             0    5    10\n"
        "attn_metadata r0 ···P········\n"
        "              r1 ··········L·\n"
        "ubatch        r0   ··········\n"
        "              r1   ····SSSSSS\n"  # stale outranks rank-sum on the same observations
        "dummy         r0     ·   M   \n"
        "              r1     ·   M   \n"
        "· clean  (blank) no observations  M missing  S stale  P padding  L shape\n")


def test_timeline_bins_steps_to_the_width(tmp_path):
    res = replay(open_dumps([write(tmp_path / "r40.safetensors", timeline_run(40))]), "torch")
    # 40 - 17 label columns = 23 columns for 40 steps: 2 steps per column, 20 columns
    assert text_of(res, 40) == (
        "Timeline of steps 0..39\n"  # header and legend wrap between their parts, never inside one
        "(2 steps per column,\n"
        "micro-batches folded in)\n"
        "step             0    10   20   30   \n"
        "attn_metadata r0 ·P··················\n"
        "              r1 ·····L··············\n"
        "ubatch        r0  ···················\n"
        "              r1  ··SSSSSSSSSSSSSSSSS\n"
        "dummy         r0   · M               \n"
        "              r1   · M               \n"
        "· clean  (blank) no observations\n"
        "M missing  S stale  P padding  L shape\n")
    tl = timeline.timeline(res, 23)
    assert (tl.width, tl.columns) == (2, 20) and tl.steps_of(19) == (38, 39)
    # every observation and every finding lands in exactly one cell
    assert tl.obs.sum() == res.observations and tl.rules.sum() == len(res.findings)


def test_obs_grid_counts(rng, tmp_path):
    o = [obs(int(s), ["x", "y"][int(k)], int(r), ubatch=int(u)) for s, k, r, u in
         zip(np.sort(rng.integers(0, 9, 500)), rng.integers(0, 2, 500), rng.integers(0, 2, 500),
             rng.integers(-1, 3, 500))]
    d = open_dumps([write(tmp_path / "g.safetensors", o)])
    g = obs_grid(d)
    got = {(d.config.sites[s], int(r), int(t), int(u)): int(n) for s, r, t, u, n in
           zip(g.site, g.rank, g.step, g.ubatch, g.count)}
    assert got == dict(Counter((x.site, x.rank, x.step, x.ubatch) for x in o))


def test_warnings_are_lowercase_severity_in_the_legend(tmp_path):
    p = write(tmp_path / "w.safetensors", [obs(step=s, dcp=1, view=[17, 25, 0, 0] if s == 1 else None)
                                            for s in range(3)], dcp=1)
    text = text_of(replay(open_dumps([p]), "torch"), 60)
    assert text.splitlines()[-2:] == ["attn_metadata r0 ·Y·", "· clean  (blank) no observations  Y stray (warning)"]


def test_timeline_colours_only_on_a_colour_console(run12):
    buf = io.StringIO()
    report.render_timeline(run12[1], Console(file=buf, width=80, force_terminal=True, color_system="standard"))
    colour = buf.getvalue()
    assert "\x1b[1;37;41mP" in colour and "\x1b[32m···" in colour  # error cells white on red, clean cells green
    assert re.sub(r"\x1b\[[0-9;]*m", "", colour) == text_of(run12[1], 80)
    assert "\x1b" not in text_of(run12[1], 80, force_terminal=True, no_color=True)


def test_empty_dump_has_no_timeline(tmp_path):
    res = replay(open_dumps([write(tmp_path / "e.safetensors", [], sites=("attn_metadata",))]), "torch")
    assert timeline.timeline(res, 80) is None and text_of(res, 80) == ""
    assert "No observations" in render_html(res)


# --------------------------------------------------------------------------------------------
# HTML


class Tree(HTMLParser):
    """Checks that every element is closed in order, and collects ids, links, rows and external references."""

    VOID = {"meta", "link", "br", "hr", "img", "input", "col", "wbr", "source", "area", "base", "rect", "line"}

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.stack, self.ids, self.hrefs, self.external, self.tags = [], Counter(), [], [], Counter()
        self.rows: dict[str, dict] = {}
        self.scripts: list[str] = []
        self.titles: list[str] = []
        self._text: list[str] | None = None
        self.feed(text)
        self.close()
        assert not self.stack, f"unclosed: {self.stack}"

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags[tag] += 1
        if "id" in a:
            self.ids[a["id"]] += 1
        if "href" in a:
            self.hrefs.append(a["href"])
        self.external += [v for k, v in attrs if k in ("src", "href", "action", "data", "poster") and v
                          and not v.startswith("#")]
        if tag == "tr" and a.get("id", "").startswith("f"):
            self.rows[a["id"]] = a
        if tag == "script" and "src" in a:
            self.external.append(a["src"])
        if tag == "title" and self.stack and self.stack[-1] == "g":
            self._text = []
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in self.VOID:
            self.stack.pop()

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack[-1:]}"
        self.stack.pop()
        if tag == "title" and self._text is not None:
            self.titles.append("".join(self._text))
            self._text = None

    def handle_data(self, data):
        if self._text is not None:
            self._text.append(data)
        if self.stack and self.stack[-1] == "script":
            self.scripts.append(data)


def no_network(html: str, tree: Tree) -> None:
    assert tree.external == [] and tree.tags["link"] == 0 and tree.tags["iframe"] == 0
    assert not re.search(r"https?:|//[a-z]|url\(|@import|@font-face|fetch\(|XMLHttpRequest", html, re.I)


def test_html_structure(run12):
    _, res = run12
    html = render_html(res)
    t = Tree(html)
    no_network(html, t)
    assert t.tags["svg"] == 1 and t.tags["table"] >= 2 and len(t.scripts) == 1
    assert all(n == 1 for n in t.ids.values()), [k for k, n in t.ids.items() if n > 1]
    assert all(h.startswith("#") and h[1:] in t.ids for h in t.hrefs)  # every link lands somewhere on the page
    # the findings table holds every finding, in order, with its rule, site, rank and step
    assert [(int(r["data-step"]), r["data-site"], int(r["data-rank"]), r["data-rule"]) for r in t.rows.values()] == \
        [(f.step, f.site, f.rank, f.rule) for f in res.findings]
    # one timeline cell with a tooltip per (site, rank, step) that has observations (1 step per column here)
    tl = timeline.timeline(res, 240)
    assert tl.width == 1 and len(t.titles) == int((tl.obs > 0).sum()) == 2 * 12 + 2 * 10 + 2 * 2
    stale = [x for x in t.titles if x.startswith("step 6 · ubatch rank 1")]
    f = next(f for f in res.findings if f.step == 6 and f.rule == "stale")
    assert stale == ["step 6 · ubatch rank 1\n2 observations (ub0 1, ub1 1)\nfindings: stale 1, rank-sum 1 (ub0 2)\n"
                     f"first: obs {f.obs} ({f.file}) {f.message}"]
    # a row view for every observation with findings, and for each stale finding's source (the parent batch)
    with_findings = {f.index for f in res.findings}
    sources = {f.source.index for f in res.findings if f.source is not None}
    assert set(res.views) == with_findings | sources and {f"obs{i}" for i in res.views} <= set(t.ids)
    for f in res.findings:
        if f.source is not None:
            assert f'source: <a href="#obs{f.source.index}">obs {f.source.obs}</a>' in html
    assert "Configuration and summary" in html and "16 findings (16 errors, 0 warnings)" in html
    assert html.count('<select id="f-') == 3 and '<option value="stale">' in html and '<option value="dummy">' in html


def test_html_row_view_shows_every_rank_and_the_wrong_row(run12):
    _, res = run12
    f = next(f for f in res.findings if f.rule == "stale")
    html = render_html(res)
    view = html[html.index(f'id="obs{f.index}"'):]
    view = view[: view.index("</table>")]
    exp = f.expected
    # micro-batch 0 of step 6: seq_len 507+6 on row 2, rank 0 owns 257, rank 1 owns 256; the parent's 259 recorded
    assert (f.step, f.row, exp, f.recorded) == (6, 2, 256, 259)
    assert '<tr class="bad"><td>2</td><td>513</td><td>257</td><td>256</td><td>256</td><td>259</td>' in view
    assert '<th>r1*</th>' in view and "WRONG" in view


def test_html_caps_row_views_and_says_so(tmp_path):
    big = np.arange(1, 301, dtype=np.int32)  # 300 real rows, the wrong one at row 250
    o = []
    for s in range(VIEW_FINDINGS + 30):
        v = expected_view(big, 300, 300, 2, 0)
        v[250] += 1
        o.append(obs(s, seq=big, num_reqs=300, num_reqs_padded=300, view=v))
    res = replay(open_dumps([write(tmp_path / "big.safetensors", o)]), "torch", views=VIEW_FINDINGS)
    assert len(res.findings) == VIEW_FINDINGS + 30 and len(res.views) == VIEW_FINDINGS
    html = render_html(res, max_findings=50)
    t = Tree(html)
    assert len(t.rows) == 50 and "The first 50 of 230 findings" in html
    assert f"first {VIEW_FINDINGS} observations with findings (of 230)" in html and f"at most {VIEW_ROWS} rows" in html
    assert html.count('class="view"') == VIEW_FINDINGS and html.count("rows 242..305 of 300") == 0
    assert html.count("rows 242..299 of 300") == VIEW_FINDINGS  # the window starts 8 rows before the wrong row
    assert all(h[1:] in t.ids for h in t.hrefs)  # links to findings beyond --max-findings are plain text


def test_html_per_rank_files_clean_runs_and_obs(tmp_path):
    run = timeline_run()
    files = [write(tmp_path / f"rank{r}.safetensors", [o for o in run if o.rank == r and o.site != "ubatch"])
             for r in (0, 1)]
    res = replay(open_dumps(files), "torch", obs=0, views=VIEW_FINDINGS)
    html = render_html(res)
    t = Tree(html)
    assert len(t.rows) == len(res.findings) == 4 and '<th class="l">file</th>' in html  # padding, missing x2, shape
    assert all(h[1:] in t.ids for h in t.hrefs) and all(n == 1 for n in t.ids.values())
    assert "obs0" in t.ids and res.rows_view.index == 0 and 0 not in res.views  # --obs adds its own row view
    clean = replay(open_dumps([write(tmp_path / "clean.safetensors", [obs(step=s) for s in range(5)])]), "torch")
    html = render_html(clean)
    t = Tree(html)
    no_network(html, t)
    assert "Clean: every observation" in html and len(t.titles) == 5 and t.tags["table"] == 0
    assert t.titles[0] == "step 0 · attn_metadata rank 0\n1 observation (full 1)\nclean"
    assert html.count('<rect class="ok"') == 5 and html.count('<rect class="err"') == 0


def test_html_escapes_what_it_shows(tmp_path):
    p = write(tmp_path / "x.safetensors", [obs(site="<script>alert(1)</script>", view=None)],
              note='"><img src=x>')
    html = render_html(replay(open_dumps([p]), "torch", views=5))
    assert "<script>alert" not in html and "<img" not in html
    no_network(html, Tree(html))


# --------------------------------------------------------------------------------------------
# CLI: --html and --force (real subprocesses)


def test_cli_html_writes_refuses_and_forces(tmp_path):
    dump = write(tmp_path / "run.safetensors", timeline_run())
    out = tmp_path / "report.html"
    r = cli("replay", dump, "--html", out, "--json")
    assert r.returncode == 1 and r.stderr == f"dcptool: wrote {out}\n"
    assert [json.loads(x)["type"] for x in r.stdout.splitlines()][-1] == "summary"  # stdout stays JSON Lines
    first = out.read_bytes()
    assert len(Tree(first.decode()).rows) == 16
    assert not [x for x in tmp_path.iterdir() if x.name.startswith(".report.html")]  # no temporary left behind
    r = cli("replay", dump, "--html", out)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"dcptool: --html {out}: exists (use --force to overwrite)\n"
    assert out.read_bytes() == first
    r = cli("replay", dump, "--html", out, "--force", "--max-findings", "3")
    assert r.returncode == 1 and "Timeline of steps 0..11" in r.stdout and len(Tree(out.read_text()).rows) == 3


@pytest.mark.parametrize("target,needle", [("DUMP", "is one of the dumps being replayed"),
                                           ("nodir/r.html", "does not exist"), (".", "is a directory")])
def test_cli_html_bad_targets(tmp_path, target, needle):
    dump = write(tmp_path / "run.safetensors", [obs()])
    before = open(dump, "rb").read()
    r = cli("replay", dump, "--html", dump if target == "DUMP" else tmp_path / target, "--force")
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr
    assert open(dump, "rb").read() == before


def test_cli_text_report_has_the_timeline_above_the_findings(tmp_path):
    r = cli("replay", write(tmp_path / "run.safetensors", timeline_run()), env={"COLUMNS": "100", "NO_COLOR": "1"})
    assert r.returncode == 1 and "\x1b" not in r.stdout
    assert r.stdout.index("Timeline of steps 0..11") < r.stdout.index("Findings (16)")
    assert "              r1   ····SSSSSS\n" in r.stdout


# --------------------------------------------------------------------------------------------
# Headless Chromium


PROBE = """
var out=[],count=function(){return document.getElementById('f-count').textContent;};
var shown=function(k){return Array.prototype.filter.call(document.querySelectorAll('#ftable tbody tr'),
  function(r){return !r.hidden;}).map(function(r){return r.dataset[k];});};
out.push(count());
var rule=document.getElementById('f-rule');rule.value='stale';rule.dispatchEvent(new Event('change'));
out.push(count(),shown('rule').join(','));
document.getElementById('f-reset').click();out.push(count());
var th=document.querySelectorAll('#ftable th')[2];th.click();th.click();out.push(shown('step').slice(0,6).join(','));
var g=document.querySelector('g.c[data-site="dummy"][data-rank="1"][data-first]');
g.dispatchEvent(new MouseEvent('click',{bubbles:true}));
var r=shown('step');out.push(count(),[r[0],shown('site')[0],shown('rank')[0],shown('rule')[0]].join(' '));
document.body.setAttribute('data-probe',out.join('|'));
"""


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def headless(tmp_path, *args) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}"]
    return subprocess.run([chromium(), *flags, *map(str, args)], capture_output=True, text=True, timeout=120)


def png_pixels(path) -> np.ndarray:
    """Decode an 8-bit RGB/RGBA PNG (all five filter types) into [h, w, channels]."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos : pos + 4]), data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and ctype in (2, 6) and interlace == 0
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    bpp = 3 if ctype == 2 else 4
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 1 + w * bpp)
    out = np.zeros((h, w * bpp), np.uint8)
    prev = np.zeros(w * bpp, np.uint8)
    for y in range(h):
        f, line = raw[y, 0], raw[y, 1:]
        if f == 0:
            cur = line
        elif f == 1:  # each byte adds the byte bpp to its left: a running sum per channel, mod 256
            cur = np.cumsum(line.reshape(w, bpp), axis=0, dtype=np.uint8).reshape(-1)
        elif f == 2:
            cur = line + prev
        else:  # average and Paeth depend on the byte just decoded: plain Python over bytes
            cur, up = bytearray(line.tobytes()), prev.tobytes()
            for i in range(len(cur)):
                a = cur[i - bpp] if i >= bpp else 0
                b = up[i]
                if f == 3:
                    cur[i] = (cur[i] + ((a + b) >> 1)) & 255
                    continue
                c = up[i - bpp] if i >= bpp else 0
                pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                cur[i] = (cur[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
            cur = np.frombuffer(bytes(cur), np.uint8)
        out[y], prev = cur, cur
    return out.reshape(h, w, bpp)[:, :, :3]


@pytest.mark.skipif(chromium() is None, reason="Chromium is not installed (apt-get install chromium)")
def test_html_in_headless_chromium(tmp_path):
    res = replay(open_dumps([write(tmp_path / "run.safetensors", timeline_run())]), "torch", views=VIEW_FINDINGS)
    page, probe = tmp_path / "report.html", tmp_path / "probe.html"
    html = render_html(res)
    page.write_text(html)
    # The same page with a probe that uses the controls as a person would and notes what the table shows.
    probe.write_text(html.replace("</body>", "<script>" + PROBE + "</script></body>"))
    dom = headless(tmp_path, "--dump-dom", probe.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    notes = re.search(r'data-probe="([^"]*)"', dom.stdout).group(1).split("|")
    assert notes == ["16 of 16 findings shown",  # the page's script ran to its end
                     "6 of 16 findings shown", "stale,stale,stale,stale,stale,stale",  # rule filter
                     "16 of 16 findings shown",  # "show all"
                     "11,11,10,10,10,9",  # step column sorted, descending on the second click
                     "1 of 16 findings shown", "8 dummy 1 missing",  # a click on the dummy rank-1 cell of step 8
                     ]
    shot = tmp_path / "report.png"
    r = headless(tmp_path, f"--screenshot={shot}", "--window-size=1000,800", "--hide-scrollbars", page.as_uri())
    assert r.returncode == 0 and shot.exists(), r.stderr[-2000:]
    px = png_pixels(shot)
    assert px.shape == (800, 1000, 3)
    red = (px == (0xD6, 0x28, 0x28)).all(axis=2).sum(axis=1)  # error cells, per pixel row
    green = (px == (0x8F, 0xD1, 0x9E)).all(axis=2).sum(axis=1)  # clean cells
    # the timeline is on screen: rows of clean cells, and the ubatch rank-1 row where 4 clean steps turn stale
    assert green.max() >= 11 * 20 and ((green >= 3 * 20) & (red >= 6 * 20)).any()


# --------------------------------------------------------------------------------------------
# Every renderer at 60, 80 and 200 columns: nothing tools read is hard-wrapped, tables degrade gracefully

WIDTHS = (60, 80, 200)


def squash(s: str) -> str:
    return "".join(s.split())


@pytest.fixture(scope="module")
def reports(tmp_path_factory, run12):
    """One result of each kind a renderer takes, from small real runs."""
    from dcptool.diagnose.diff import diff
    from dcptool.dump import describe
    from dcptool.model.simulate import SimConfig, compare, simulate

    d = tmp_path_factory.mktemp("renderers")
    p, res = run12
    b = timeline_run()
    b[3].seq_lens = b[3].seq_lens.copy()
    b[3].seq_lens[0] += 1
    pb = write(d / "b.safetensors", b)
    dumps = open_dumps([p])
    cfg = SimConfig(dcp=2, steps=4, pipeline="legacy")
    return {"replay": res, "split-obs": replay(dumps, "torch", split=2, obs=7), "inspect": describe(dumps),
            "diff": diff(open_dumps([p]), open_dumps([pb])), "simulate": compare(cfg, "torch"),
            "simulated": simulate(cfg, d / "sim.safetensors")}


def render(kind: str, res, console: Console) -> None:
    {"replay": report.render_replay, "split-obs": report.render_replay, "inspect": report.render_inspect,
     "diff": report.render_diff, "simulate": report.render_simulate, "simulated": report.render_simulated}[kind](
        res, console)


def one_line_items(kind: str, res) -> list[str]:
    """Texts that must each sit whole on one line of the output, whatever the width."""
    if kind in ("replay", "split-obs"):
        return ([f.message.split(": ", 1)[-1] for f in res.findings[: report.TEXT_MAX_FINDINGS]]
                + [f"{res.observations} observations, dcp_size {res.config.dcp_size}",
                   f"findings: {len(res.findings)} ({res.errors} errors"])
    if kind == "diff":
        return [x.message.split(": ", 2)[-1] for x in res.differences] + [f"{res.compared} aligned"]
    if kind == "inspect":
        return [f"{res.observations:,} ({res.with_view:,} with a DCP view"]
    if kind == "simulate":
        return [f"fixed: {len(res.fixed.findings)} findings in {res.fixed.observations} observations"]
    return [f"{res.observations} observations ("]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("kind", ["replay", "split-obs", "inspect", "diff", "simulate", "simulated"])
def test_renderers_never_wrap_into_a_file(reports, kind, width):
    res = reports[kind]
    buf = io.StringIO()
    render(kind, res, Console(file=buf, width=width))  # a file: not a terminal
    lines = buf.getvalue().splitlines()
    for item in one_line_items(kind, res):
        assert any(item in line for line in lines), (item, width, buf.getvalue())


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("kind", ["replay", "split-obs", "inspect", "diff", "simulate", "simulated"])
def test_renderers_fit_a_terminal(reports, kind, width):
    """On a terminal, tables fit its width (folding long cells, or as lines it soft-wraps) and keep every
    message readable: never one character per line."""
    res = reports[kind]
    buf = io.StringIO()
    render(kind, res, Console(file=buf, width=width, force_terminal=True, color_system=None))
    out = buf.getvalue()
    boxed = [line for line in out.splitlines() if any(c in line for c in "│┃━─")]
    assert all(len(line) <= width for line in boxed), [line for line in boxed if len(line) > width]
    for item in one_line_items(kind, res):
        assert squash(item) in squash(out), (item, width)
    rows = {"replay": 16, "split-obs": 16 + len(reports["split-obs"].splits) + 6,
            "diff": len(reports["diff"].differences)}
    assert len(out.splitlines()) <= 3 * rows.get(kind, 0) + 100, out  # the diff table printed a letter per line


def test_diff_table_at_80_columns_keeps_the_message_readable(reports):
    buf = io.StringIO()
    report.render_diff(reports["diff"], Console(file=buf, width=80, force_terminal=True, color_system=None))
    x = reports["diff"].differences[0]
    rows = [line for line in buf.getvalue().splitlines() if line.strip().startswith(str(x.key.step))]
    assert rows and len(rows[0].rstrip()) > 60  # the message column has room (was 1 character wide)


def test_report_console_in_a_pipe_is_wide_fixed_and_unpadded(run12):
    buf = io.StringIO()
    c = report.ReportConsole(file=buf)
    assert not c.is_terminal and c.width >= 10_000 and report.layout_width(c) == report.ReportConsole.PIPE_LAYOUT
    report.render_replay(run12[1], c)
    out = buf.getvalue()
    assert all(line == line.rstrip() for line in out.splitlines())
    assert sum(f.message.split(": ", 1)[-1] in out for f in run12[1].findings) == len(run12[1].findings)
    assert "Timeline of steps 0..11 (1 step per column, micro-batches folded in)\n" in out


def test_report_console_raises_broken_pipe_instead_of_exiting_1():
    class Gone(io.StringIO):
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(BrokenPipeError):  # rich's default raises SystemExit(1): "findings" to a CI job
        report.ReportConsole(file=Gone()).print("x")


@pytest.mark.parametrize("s,want", [("plain [b]x[/b]", "plain [b]x[/b]"), ("a\x1b[2Jb", "a\\x1b[2Jb"),
                                    ("t\x1b]0;title\x07", "t\\x1b]0;title\\x07"), ("cr\r\n", "cr\\x0d\\x0a"),
                                    ("\u202eevil", "\\u202eevil"), ("ok é", "ok é"),
                                    ("r\udcffn\udc9b", "r\udcffn\\x9b")])  # a non-UTF-8 name: C1 bytes escaped
def test_literal_escapes_control_characters_only(s, want):
    assert report.literal(s) == want
    buf = io.StringIO()
    Console(file=buf, force_terminal=True, width=80).print(report.lit(s))
    assert want in buf.getvalue()
