"""report/html.py: the HTML report: structure, links, caps, row views, escaping, the sample's findings, --html on
the command line, and the page in headless Chromium (skipped when Chromium is absent)."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import zlib
from collections import Counter
from html import escape
from html.parser import HTMLParser

import numpy as np
import pytest
from conftest import ROOT, cli, expected_view, hostile_dump, obs, write
from report_runs import replay_run12, timeline_run

from dcptool.check.replay import replay
from dcptool.dump import open_dumps
from dcptool.report import timeline
from dcptool.report.html import HTML_MAX_FINDINGS, VIEW_FINDINGS, VIEW_ROWS, render_html

LEGACY = ROOT / "samples" / "legacy.safetensors"


@pytest.fixture(scope="module")
def run12(tmp_path_factory):
    return replay_run12(tmp_path_factory)


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
                     f"first: {f.file}:{f.obs} {f.message}"]
    # a row view for every observation with findings, and for each stale finding's source (the parent batch)
    with_findings = {f.index for f in res.findings}
    sources = {f.source.index for f in res.findings if f.source is not None}
    assert set(res.views) == with_findings | sources and {f"obs{i}" for i in res.views} <= set(t.ids)
    for f in res.findings:
        if f.source is not None:
            assert f'source: <a href="#obs{f.source.index}">{f.source.file}:{f.source.obs}</a>' in html
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
    assert len(t.rows) == len(res.findings) == 4  # padding, missing x2, shape
    for f in res.findings:  # each observation as FILE:I, as --obs takes it (the file of each rank's own)
        assert f">{f.ref}<" in html and f.ref == f"{files[f.rank]}:{f.obs}"
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


def test_hostile_names_are_escaped_in_html(tmp_path):
    from dcptool.check.replay import replay
    from dcptool.dump import open_dumps
    from dcptool.report.html import render_html

    html = render_html(replay(open_dumps([hostile_dump(tmp_path / "h.safetensors")]), "torch", views=5))
    assert "[/bold][link=https://example.invalid]L[/link]" in html and "<a href=\"https://example" not in html



def test_html_of_the_legacy_sample_has_every_finding_with_its_rule_and_step():
    """The bundled sample: one table row per finding, in order, with its step, rule, site and rank, its message
    escaped; a filter option per rule; the summary's counts; --max-findings 100 shows the first 100 rows."""
    res = replay(open_dumps([LEGACY]), "torch", views=VIEW_FINDINGS)
    assert res.by_rule()["missing"] == 48 and len(res.by_rule()) == 7 and len(res.findings) < HTML_MAX_FINDINGS
    html = render_html(res)
    t = Tree(html)
    no_network(html, t)
    want = [(f.step, f.rule, f.site, f.rank) for f in res.findings]
    assert [(int(r["data-step"]), r["data-rule"], r["data-site"], int(r["data-rank"])) for r in t.rows.values()] == want
    assert all(f'<option value="{rule}">{rule}</option>' in html for rule in res.by_rule())
    assert f"{len(res.findings):,} findings ({res.errors:,} errors, {res.warnings:,} warnings)" in html
    for k in np.random.default_rng(3).choice(len(res.findings), 60, replace=False):
        f = res.findings[int(k)]
        assert f'<td class="l msg">{escape(f.text)}</td>' in html, f.text
    assert "'NoneType' object" not in html and "&#x27;NoneType&#x27; object" in html  # the messages' quotes too
    capped = render_html(res, max_findings=100)
    assert [(int(r["data-step"]), r["data-rule"]) for r in Tree(capped).rows.values()] == [w[:2] for w in want[:100]]
    assert f"The first 100 of {len(res.findings):,} findings" in capped


def test_html_escapes_every_string_from_the_dump(tmp_path):
    """Site, engine, note and the file's name reach the page escaped (text and attributes alike): the page keeps
    its structure, and the parsed page gives the strings back exactly."""
    site, note, engine = "a<b>&\"c'", "</script><script>alert(1)</script>", "<b>bold</b> & co"
    p = write(tmp_path / "r&<i>\"q'.safetensors", [obs(site=site, view=None), obs(step=1, site=site)], note=note,
              engine=engine)
    res = replay(open_dumps([p]), "torch", views=5)
    html = render_html(res)
    t = Tree(html)
    no_network(html, t)
    for s in (site, note, engine, p):
        assert escape(s, quote=True) in html, s
    for raw in ("a<b>", "<script>alert", "<b>bold", "<i>"):
        assert raw not in html, raw
    assert [(r["data-site"], r["data-rule"]) for r in t.rows.values()] == [(site, "missing")]
    assert t.titles and all(x.startswith(f"step {i} · {site} rank 0") for i, x in enumerate(t.titles))

# --------------------------------------------------------------------------------------------
# CLI: --html and --force


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
    assert r.stderr == f"dcptool replay: --html: {out}: exists (use --force to overwrite)\n"
    assert out.read_bytes() == first
    r = cli("replay", dump, "--html", out, "--force", "--max-findings", "3")
    assert r.returncode == 1 and "Timeline of steps 0..11" in r.stdout and len(Tree(out.read_text()).rows) == 3


@pytest.mark.parametrize("target,needle", [("DUMP", "is one of the dumps read"),
                                           ("nodir/r.html", "does not exist"), (".", "is a directory")])
def test_cli_html_bad_targets(tmp_path, target, needle):
    dump = write(tmp_path / "run.safetensors", [obs()])
    before = open(dump, "rb").read()
    r = cli("replay", dump, "--html", dump if target == "DUMP" else tmp_path / target, "--force")
    assert r.returncode == 2 and needle in r.stderr and len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr
    assert open(dump, "rb").read() == before


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


def test_html_leads_with_the_problems_like_the_text_report(tmp_path):
    """Hardening III item 8b: the problems (one line per root cause, the text report's lines) come first, before
    the summary, each linking its first finding when the table holds it; a clean replay has no such section."""
    from dcptool.report.text import ReportConsole, render_problems

    res = replay(open_dumps([LEGACY]), "torch", views=VIEW_FINDINGS)
    assert len(res.problems) > 1
    html = render_html(res)
    no_network(html, Tree(html))
    start = html.index('<section id="problems">')
    assert start < html.index('<section id="summary">') < html.index('id="timeline"')
    assert f"<h2>Problems ({len(res.problems)})</h2>" in html
    lines = re.findall(r'<p class="problem(?: known)?">(.*?)(?: <a href="#f(\d+)">first finding</a>)?</p>', html)
    assert [x for x, _ in lines] == [escape(p.line) for p in res.problems]
    assert [int(k) for _, k in lines] == [int(p.findings[0]) for p in res.problems]
    con = ReportConsole(file=__import__("io").StringIO(), width=10_000)  # the text report: the same lines, in order
    render_problems(res.problems, con)
    assert con.file.getvalue().splitlines()[1:] == [p.line for p in res.problems]
    capped = render_html(res, max_findings=1)  # a first finding beyond the table: the line, no link
    assert capped.count("first finding</a>") == sum(int(p.findings[0]) < 1 for p in res.problems)
    clean = replay(open_dumps([write(tmp_path / "c.safetensors", [obs(step=s) for s in range(3)])]), "torch")
    assert not clean.problems and 'id="problems"' not in render_html(clean)


# --------------------------------------------------------------------------------------------
# diff --html


def test_diff_html_page(tmp_path):
    """diff --html: one self-contained page with the summary, the first divergence and every difference as a row,
    each observation as FILE:I; the text and JSON reports are the same as without it."""
    from dcptool.diagnose.diff import diff

    legacy, fixed = str(ROOT / "samples" / "legacy.safetensors"), str(ROOT / "samples" / "fixed.safetensors")
    out = tmp_path / "d.html"
    r = cli("diff", legacy, fixed, "--json", "--html", out)
    assert r.returncode == 1 and r.stderr == f"dcptool: wrote {out}\n"

    def timeless(text: str) -> str:
        return re.sub(r'"seconds": [0-9.e-]+', "", text)

    assert timeless(r.stdout) == timeless(cli("diff", legacy, fixed, "--json").stdout)
    html = out.read_text()
    t = Tree(html)
    no_network(html, t)
    res = diff(open_dumps([legacy]), open_dumps([fixed]))
    rows = re.findall(r'<tr id="d(\d+)">', html)
    assert len(rows) == res.total == 1448 and rows == [str(k) for k in range(res.total)]
    first = res.first
    assert f"First divergence at {first.where}: <b>{first.field}</b>" in html and f"<code>{first.a_ref}</code>" in html
    for x in res.differences[:50]:
        assert f"<td>{x.a_ref}</td><td>{x.b_ref}</td>" in html
    capped = cli("diff", legacy, fixed, "--html", tmp_path / "c.html", "--max-findings", "7")
    assert capped.returncode == 1 and len(re.findall(r'<tr id="d', (tmp_path / "c.html").read_text())) == 7
    assert "The first 7 of 1,448 differences" in (tmp_path / "c.html").read_text()
    same = cli("diff", fixed, fixed, "--html", tmp_path / "s.html")
    assert same.returncode == 0 and "Same: A and B record the same" in (tmp_path / "s.html").read_text()
    assert cli("diff", legacy, fixed, "--html", out).returncode == 2 and out.read_text() == html  # no --force
