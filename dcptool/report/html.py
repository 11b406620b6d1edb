"""HTML renderer for replay: one self-contained page (inline CSS, SVG, script; nothing fetched) for a bug report."""

from __future__ import annotations

from html import escape

import numpy as np

from dcptool import __version__
from dcptool.dump.ref import obs_ref
from dcptool.report.differences import side_name
from dcptool.report.text import rank_window
from dcptool.report.timeline import Timeline, cells, timeline

HTML_COLUMNS = 240  # step buckets of the SVG timeline
VIEW_FINDINGS = 200  # row views: the observations of the first 200 findings (and their stale sources) ...
VIEW_ROWS = 64  # ... 64 rows each
HTML_MAX_FINDINGS = 5000  # table rows without --max-findings: a page of 10**6 rows is unusable (docs/limits.md)
_SEV_CLASS = {"error": "err", "warning": "warn", "clean": "ok", "empty": "none"}

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;padding:0 24px 48px;max-width:1400px;
color:#1f2328;background:#fff}
h1{font-size:22px;margin:20px 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d0d7de}
h3{font-size:14px;margin:18px 0 4px}code,td,.mono,svg text{font-family:ui-monospace,"DejaVu Sans Mono",monospace}
.files{color:#57606a;margin:0}.kv{display:grid;grid-template-columns:repeat(3,max-content minmax(10em,max-content));
gap:2px 14px;margin:8px 0}
.kv dt{font-weight:600}.kv dd{margin:0}.verdict{font-size:16px;font-weight:600}.verdict.err{color:#b42318}
.verdict.ok{color:#1a7f37}.chip{display:inline-block;border-radius:4px;padding:1px 7px;margin:2px 4px 2px 0;
background:#f6f8fa;border:1px solid #d0d7de}.code{display:inline-block;min-width:1.2em;text-align:center;
font-weight:700;border-radius:3px;margin-right:4px;font-family:ui-monospace,monospace}
.code.err,rect.err{background:#d62828;fill:#d62828;color:#fff}.code.warn,rect.warn{background:#f0b429;fill:#f0b429}
.code.ok,rect.ok{background:#8fd19e;fill:#8fd19e}.code.none,rect.none{background:#eef0f2;fill:#eef0f2}
table{border-collapse:collapse;margin:6px 0}th,td{border:1px solid #d0d7de;padding:2px 6px;text-align:right;
vertical-align:top}th{background:#f6f8fa;position:sticky;top:0}td.l,th.l{text-align:left}
#ftable{width:100%}#ftable th{cursor:pointer;user-select:none}td.rule{white-space:nowrap}
#ftable th[data-dir=asc]::after{content:" \\25B2"}
#ftable th[data-dir=desc]::after{content:" \\25BC"}#ftable{font-size:13px}
#ftable td,#ftable th{width:1%;white-space:nowrap}
#ftable td.msg,#ftable th.msg{width:auto;white-space:normal;min-width:14em;font-family:inherit}
#ftable td.src{white-space:normal;min-width:6em}
tr.bad td{background:#ffebe9}td.rule.err{color:#b42318;font-weight:600}td.rule.warn{color:#9a6700;font-weight:600}
:target{outline:2px solid #0969da;outline-offset:1px}.filters{display:flex;gap:14px;align-items:center;
flex-wrap:wrap;margin:8px 0}.note{color:#57606a}.view{border-left:3px solid #d0d7de;padding-left:12px;margin:14px 0}
svg .c{cursor:pointer}svg .c:hover rect{stroke:#0969da;stroke-width:2}svg text{font-size:11px}
svg text.cc{fill:#fff;font-weight:700;text-anchor:middle;pointer-events:none}svg text.cc.warn{fill:#1f2328}
svg text.lab{fill:#1f2328}svg text.axis{fill:#57606a}svg line{stroke:#d0d7de}
.problem{margin:4px 0}.problem.known{color:#b42318;font-weight:600}
"""

_JS = """
(function(){
var tb=document.querySelector('#ftable tbody');if(!tb)return;
var rows=Array.prototype.slice.call(tb.rows),cell=null;
var f={rule:document.getElementById('f-rule'),site:document.getElementById('f-site'),
rank:document.getElementById('f-rank')};
var count=document.getElementById('f-count'),cellNote=document.getElementById('f-cell');
function apply(){var n=0;rows.forEach(function(tr){var d=tr.dataset,ok=true;
for(var k in f){if(f[k].value!==''&&d[k]!==f[k].value)ok=false;}
if(ok&&cell){var s=+d.step;ok=d.site===cell.site&&d.rank===cell.rank&&s>=cell.lo&&s<=cell.hi;}
tr.hidden=!ok;if(ok)n++;});count.textContent=n+' of '+rows.length+' findings shown';
cellNote.textContent=cell?('cell: '+cell.site+' rank '+cell.rank+', steps '+cell.lo+'..'+cell.hi+' ')
:'';document.getElementById('f-reset').hidden=!(cell||f.rule.value||f.site.value||f.rank.value);}
function reset(){cell=null;for(var k in f)f[k].value='';apply();}
for(var k in f)f[k].addEventListener('change',apply);
document.getElementById('f-reset').addEventListener('click',reset);
var svg=document.getElementById('timeline-svg');
if(svg)svg.addEventListener('click',function(e){var g=e.target.closest('g.c');if(!g||!g.dataset.first)return;
cell={site:g.dataset.site,rank:g.dataset.rank,lo:+g.dataset.lo,hi:+g.dataset.hi};
for(var k in f)f[k].value='';apply();document.getElementById('findings').scrollIntoView();});
function reveal(){var t=location.hash&&document.getElementById(location.hash.slice(1));
if(t&&t.hidden){reset();t.scrollIntoView();}}
window.addEventListener('hashchange',reveal);reveal();
Array.prototype.forEach.call(document.querySelectorAll('#ftable th'),function(th,i){
th.addEventListener('click',function(){var dir=th.dataset.dir==='asc'?'desc':'asc';
Array.prototype.forEach.call(th.parentNode.cells,function(o){delete o.dataset.dir;});th.dataset.dir=dir;
function key(tr){var c=tr.cells[i];return c.dataset.k!==undefined?c.dataset.k:c.textContent;}
rows.sort(function(a,b){var x=key(a),y=key(b),nx=parseFloat(x),ny=parseFloat(y),
r=(!isNaN(nx)&&!isNaN(ny))?nx-ny:x.localeCompare(y);return dir==='asc'?r:-r;});
var frag=document.createDocumentFragment();rows.forEach(function(r){frag.appendChild(r);});tb.appendChild(frag);});});
apply();})();
"""


def _e(x) -> str:
    return escape(str(x), quote=True)


def render_html(res, max_findings: int | None = None) -> str:
    """The whole page as one string: problems (as the text report, first), configuration and summary, timeline,
    findings table, row views."""
    shown = res.findings[: HTML_MAX_FINDINGS if max_findings is None else max_findings]
    pos = _positions(res.findings)
    parts = _head("dcptool replay", ", ".join(res.files))
    parts += _problems(res, len(shown))
    parts += _summary(res, len(shown))
    tl = timeline(res, HTML_COLUMNS)
    parts.append('<section id="timeline"><h2>Timeline</h2>')
    if tl is None:
        parts.append('<p class="note">No observations.</p>')
    else:
        per = "step" if tl.width == 1 else f"{tl.width} steps"
        parts.append(f'<p class="note">One row per site and DCP rank (micro-batches folded in), one column per {per} '
                     f"(steps {tl.first_step}..{tl.last_step}); each cell shows its worst finding. Hover a cell for "
                     "details; click it to list its findings below.</p>")
        parts.append(_svg(res, tl))
        if tl.hidden_rows:
            parts.append(f'<p class="note">{tl.hidden_rows:,} more (site, rank) rows not drawn: at most '
                         f"{len(tl.sites):,} rows, those with findings first.</p>")
        parts.append(_legend(tl))
    parts.append("</section>")
    parts += _table(res, shown)
    parts += _views(res, pos, len(shown))
    parts.append(f"<script>{_JS}</script></body></html>\n")
    return "\n".join(parts)


def html_units(res, max_findings: int | None = None) -> int:
    """The progress bar's estimate of render_html's work (replay.W_REPORT per table row and row view)."""
    from dcptool.check.replay import W_REPORT

    rows = min(len(res.findings), HTML_MAX_FINDINGS if max_findings is None else max_findings)
    return round(W_REPORT * (rows + 4 * len(res.views)))


def _positions(findings) -> dict[int, int]:
    """id(Finding) -> its position in the findings, for the Finding objects the row views hold (a FindingTable
    hands out the same object for a position each time: only those already made are looked at)."""
    return {id(f): k for k, f in findings.made().items()}


def _finding_ref(k: int | None, text: str, shown: int) -> str:
    """A link to row k of the findings table, or plain text when the table does not hold it (--max-findings)."""
    return f'<a href="#f{k}">{text}</a>' if k is not None and k < shown else text


def _problems(res, shown: int) -> list[str]:
    """The root causes, one line each (problems.Problem.line, as the text report leads with them), each with a link
    to its first finding when the table holds it; nothing when there are none."""
    problems = getattr(res, "problems", [])
    if not problems:
        return []
    out = [f'<section id="problems"><h2>Problems ({len(problems)})</h2>']
    for p in problems:
        known = " known" if p.known is not None and p.known.named else ""
        k = int(p.findings[0])
        first = f' <a href="#f{k}">first finding</a>' if k < shown else ""
        out.append(f'<p class="problem{known}">{_e(p.line)}{first}</p>')
    out.append("</section>")
    return out


def _summary(res, shown: int) -> list[str]:
    c = res.config
    kv = [("observations", f"{res.observations:,}"),
          ("dcp_size", c.dcp_size), ("cp_interleave", c.cp_interleave), ("pcp_size", c.pcp_size),
          ("page_size", c.page_size if c.page_size is not None else "not recorded"), ("sites", ", ".join(c.sites))]
    kv += [(k, getattr(c, k)) for k in ("engine", "engine_version", "note") if getattr(c, k)]
    kv += [("backend", f"{res.backend} on {res.device}, {res.seconds:.2f} s"), ("dcptool", __version__)]
    out = ['<section id="summary"><h2>Configuration and summary</h2><dl class="kv">']
    out += [f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in kv]
    out.append("</dl>")
    if not res.findings:
        out.append('<p class="verdict ok">Clean: every observation\'s DCP metadata is what it must be.</p>')
    else:
        out.append(f'<p class="verdict err">{len(res.findings):,} findings ({res.errors:,} errors, '
                   f"{res.warnings:,} warnings) in {res.observations:,} observations</p><p>")
        for rule, n in res.by_rule().items():
            out.append(f'<span class="chip">{_code(rule)}{_e(rule)} {n:,}</span>')
        out.append("</p>")
        rules = list(res.by_rule())
        out.append('<table id="by-site"><thead><tr><th class="l">site</th>'
                   + "".join(f"<th>{_e(r)}</th>" for r in rules) + "</tr></thead><tbody>")
        for site, counts in res.by_site().items():
            out.append(f'<tr><td class="l">{_e(site)}</td>' + "".join(f"<td>{counts.get(r, '')}</td>" for r in rules)
                       + "</tr>")
        out.append("</tbody></table>")
        f = res.findings[0]
        out.append(f"<p>First finding: {_finding_ref(0, _e(f.ref), shown)} {_code(f.rule)}"
                   f"{_e(f.message)}</p>")
    if res.skipped:
        out.append('<p class="note">Skipped checks: '
                   + "; ".join(f"{_e(k)} ({_e(v)})" for k, v in res.skipped.items()) + "</p>")
    out.append("</section>")
    return out


def _code(rule: str) -> str:
    from dcptool.dcp.rules import RULE_CODES, SEVERITY

    return f'<span class="code {_SEV_CLASS[SEVERITY[rule]]}">{RULE_CODES[rule]}</span>'


def _svg(res, tl: Timeline) -> str:
    """The timeline as inline SVG: a <title> tooltip on every cell that has observations."""
    from dcptool.dcp.rules import RULES

    cw = max(4, min(22, 960 // max(tl.columns, 1)))
    ch, top = 18, 22
    label = max(len(s) for s in tl.sites) + len(str(max(tl.ranks))) + 3
    left = int(label * 7.2) + 12
    width, height = left + tl.columns * cw + 8, top + len(tl.sites) * ch + 4
    chars, kinds = cells(tl)
    out = [f'<svg id="timeline-svg" role="img" aria-label="findings timeline" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}">']
    gap = (max(len(str(tl.first_step)), len(str(tl.last_step))) * 7 + 8) / cw  # label width in columns
    for c, step in tl.ticks(gap):
        out.append(f'<text class="axis" x="{left + c * cw}" y="14">{step}</text>')
    for r, (site, rank) in enumerate(zip(tl.sites, tl.ranks)):
        y = top + r * ch
        if r == 0 or tl.sites[r - 1] != site:
            out.append(f'<text class="lab" x="4" y="{y + 13}">{_e(site)}</text>')
            if r:
                out.append(f'<line x1="0" x2="{width}" y1="{y - 0.5}" y2="{y - 0.5}"/>')
        out.append(f'<text class="lab" x="{left - 8}" y="{y + 13}" text-anchor="end">r{rank}</text>')
        out.append(f'<rect class="none" x="{left}" y="{y + 1}" width="{tl.columns * cw}" height="{ch - 2}"/>')
        for c in np.flatnonzero(tl.obs[r] > 0):
            kind = _SEV_CLASS[str(kinds[r, c])]
            lo, hi = tl.steps_of(int(c))
            first = int(tl.first[r, c])
            attrs = (f'data-site="{_e(site)}" data-rank="{rank}" data-lo="{lo}" data-hi="{hi}"'
                     + (f' data-first="{first}"' if first >= 0 else ""))
            x = left + int(c) * cw
            out.append(f'<g class="c" {attrs}><title>{_e(_tooltip(res, tl, r, int(c), RULES))}</title>'
                       f'<rect class="{kind}" x="{x}" y="{y + 1}" width="{cw - (cw > 5)}" height="{ch - 2}"/>')
            if first >= 0 and cw >= 10:
                out.append(f'<text class="cc {kind}" x="{x + cw / 2:g}" y="{y + 13}">{_e(chars[r, c])}</text>')
            out.append("</g>")
    out.append("</svg>")
    return "".join(out)


def _tooltip(res, tl: Timeline, r: int, c: int, rules) -> str:
    lo, hi = tl.steps_of(c)
    steps = f"step {lo}" if lo == hi else f"steps {lo}..{hi}"

    ubs = tl.ubatches if tl.ubatches is not None else list(range(-1, tl.ub_obs.shape[2] - 1))

    def by_ub(v: np.ndarray) -> str:
        def name(u: int) -> str:
            return ("full" if ubs[u] < 0 else f"ub{ubs[u]}") + ("+" if tl.ub_folded and u == len(ubs) - 1 else "")

        return ", ".join(f"{name(u)} {int(n)}" for u, n in enumerate(v) if n)

    lines = [f"{steps} · {tl.sites[r]} rank {tl.ranks[r]}",
             f"{int(tl.obs[r, c])} observation{'' if tl.obs[r, c] == 1 else 's'} ({by_ub(tl.ub_obs[r, c])})"]
    counts = tl.rules[r, c]
    if counts.any():
        lines.append("findings: " + ", ".join(f"{rules[i]} {int(n)}" for i, n in enumerate(counts) if n)
                     + f" ({by_ub(tl.ub_find[r, c])})")
        f = res.findings[int(tl.first[r, c])]
        lines.append(f"first: {f.ref} {f.message}")
    else:
        lines.append("clean")
    return "\n".join(lines)


def _legend(tl: Timeline) -> str:
    from dcptool.dcp.rules import RULES, SEVERITY

    present = [RULES[i] for i in np.unique(tl.worst()) if i >= 0]
    items = ['<span class="code ok">&nbsp;</span>clean', '<span class="code none">&nbsp;</span>no observations']
    items += [_code(r) + _e(r) + (" (warning)" if SEVERITY[r] == "warning" else "") for r in present]
    return '<p class="legend">' + " &nbsp; ".join(items) + "</p>"


def _table(res, shown) -> list[str]:
    cols = [("#", ""), ("obs", "l"), ("step", ""), ("site", "l"), ("rank", ""),
            ("ub", ""), ("rule", "l"), ("row", ""), ("recorded", ""), ("expected", ""), ("wrong", ""),
            ("source", "l"), ("message", "l msg")]
    out = [f'<section id="findings"><h2>Findings ({len(res.findings):,})</h2>']
    if len(shown) < len(res.findings):
        out.append(f'<p class="note">The first {len(shown):,} of {len(res.findings):,} findings (--max-findings, '
                   f"default {HTML_MAX_FINDINGS:,} here); the summary counts all; replay --json lists every one.</p>")
    if not shown:
        out.append('<p class="note">None.</p></section>')
        return out

    def options(name: str, values) -> str:
        opts = "".join(f'<option value="{_e(v)}">{_e(v)}</option>' for v in values)
        return f'<label>{name} <select id="f-{name}"><option value="">all</option>{opts}</select></label>'

    out.append('<div class="filters">' + options("rule", res.by_rule()) + options("site", res.by_site())
               + options("rank", sorted({f.rank for f in shown}))
               + '<span id="f-cell" class="note"></span><button id="f-reset" type="button" hidden>show all</button>'
               '<span id="f-count" class="note"></span></div>')
    out.append('<table id="ftable"><thead><tr>' + "".join(f'<th class="{c}">{n}</th>' for n, c in cols)
               + "</tr></thead><tbody>")
    for k, f in enumerate(shown):
        src = ""
        if f.source is not None:
            s = f.source
            src = f'<a href="#obs{s.index}" title="step {s.step} {_e(s.site)}">{_e(s.ref)}</a> {_e(s.relation)}'
        obs = f'<a href="#obs{f.index}">{_e(f.ref)}</a>' if f.index in res.views else _e(f.ref)
        sev = "err" if f.severity == "error" else "warn"

        def num(v) -> str:
            return '<td data-k="-1"></td>' if v is None else f"<td>{v}</td>"

        # the message without its "step .. site rank ..:" prefix, which the row's own columns already say
        out.append(f'<tr id="f{k}" data-rule="{_e(f.rule)}" data-site="{_e(f.site)}" data-rank="{f.rank}" '
                   f'data-step="{f.step}"><td>{k}</td><td class="l" data-k="{f.index}">{obs}</td>'
                   f'<td>{f.step}</td><td class="l">{_e(f.site)}</td><td>{f.rank}</td>'
                   f'<td data-k="{f.ubatch}">{"-" if f.ubatch < 0 else f.ubatch}</td>'
                   f'<td class="l rule {sev}">{_e(f.rule)}{"/" + _e(f.source.relation) if f.source else ""}</td>'
                   + num(f.row) + num(f.recorded) + num(f.expected) + f"<td>{f.wrong_rows}</td>"
                   f'<td class="l src">{src}</td><td class="l msg">{_e(f.text)}</td></tr>')
    out.append("</tbody></table></section>")
    return out


def _views(res, pos: dict, shown: int) -> list[str]:
    """Row views (as `--obs` shows them) of the observations whose views replay prepared."""
    out = ['<section id="rows"><h2>Row views</h2>']
    views = dict(res.views)
    if res.rows_view is not None:
        views.setdefault(res.rows_view.index, res.rows_view)
    with_findings = np.unique(res.findings.index).size
    out.append(f'<p class="note">What each observation holds row by row (as <code>--obs</code> shows it), for the '
               f"first {VIEW_FINDINGS} observations with findings (of {with_findings:,}) and the source observations "
               f"of their stale findings; at most {VIEW_ROWS} rows each, starting near the first wrong row. "
               "Columns r0, r1, ...: the expected local length on each DCP rank (* marks the observation's own "
               "rank).</p>")
    cited: dict[int, list[int]] = {}
    source = res.findings.source
    for k in np.flatnonzero(source >= 0).tolist():  # the stale findings only
        cited.setdefault(int(source[k]), []).append(k)
    for i in sorted(views):
        out += _view(views[i], pos, cited.get(i, []), res, shown)
    out.append("</section>")
    return out


def _view(v, pos: dict, cited: list[int], res, shown: int) -> list[str]:
    ub = f" ubatch {v.ubatch}" if v.ubatch >= 0 else ""
    out = [f'<div class="view" id="obs{v.index}"><h3>{_e(obs_ref(v.file, v.obs))}: step '
           f"{v.step} {_e(v.site)} rank {v.rank}{ub}, num_reqs {v.num_reqs}, num_reqs_padded {v.num_reqs_padded}</h3>"]
    if v.findings or cited:
        out.append("<ul>")
        for f in v.findings:
            ref = _finding_ref(pos.get(id(f)), _e(f.rule), shown)
            src = ""
            if f.source is not None:
                s = f.source
                src = (f' &mdash; source: <a href="#obs{s.index}">{_e(s.ref)}</a> ({_e(s.relation)}, step {s.step} '
                       f"{_e(s.site)})" + ("" if s.index in res.views else " (row view not shown)"))
            out.append(f"<li>{_code(f.rule)}{ref}: {_e(f.message)}{src}</li>")
        if cited:
            links = ", ".join(_finding_ref(k, f"{_e(res.findings[k].ref)} ({_e(res.findings[k].site)})", shown)
                              for k in cited[:20])
            more = f" and {len(cited) - 20} more" if len(cited) > 20 else ""
            out.append(f"<li>source of the stale finding(s) at {links}{more}</li>")
        out.append("</ul>")
    n = len(v.verdict)
    bad = next((j for j, s in enumerate(v.verdict) if not s.startswith("ok")), 0)
    start = 0 if bad < VIEW_ROWS - 8 else bad - 8
    stop = min(n, start + VIEW_ROWS)
    if n == 0:
        out.append('<p class="note">(no rows)</p></div>')
        return out
    if (start, stop) != (0, n):
        out.append(f'<p class="note">rows {start}..{stop - 1} of {n}</p>')
    ranks = len(v.expected_all_ranks[0]) if v.expected_all_ranks else 0
    r_lo, r_hi = rank_window(v.rank, ranks)  # a window of ranks around its own
    if (r_lo, r_hi) != (0, ranks):
        out.append(f'<p class="note">ranks {r_lo}..{r_hi - 1} of {ranks}</p>')
    out.append('<table class="rows"><thead><tr><th>row</th><th>seq_len</th>'
               + "".join(f"<th>r{r}{'*' if r == v.rank else ''}</th>" for r in range(r_lo, r_hi))
               + '<th>expected</th><th>recorded</th><th class="l">verdict</th></tr></thead><tbody>')
    for j in range(start, stop):
        allr = v.expected_all_ranks[j][r_lo:r_hi] if j < len(v.expected_all_ranks) else [""] * (r_hi - r_lo)
        rec = "None" if v.recorded is None else (v.recorded[j] if j < len(v.recorded) else "")
        cls = "" if v.verdict[j].startswith("ok") else ' class="bad"'
        out.append(f"<tr{cls}><td>{j}</td><td>{v.seq_lens[j] if j < len(v.seq_lens) else ''}</td>"
                   + "".join(f"<td>{x}</td>" for x in allr)
                   + f"<td>{v.expected[j] if j < len(v.expected) else ''}</td><td>{rec}</td>"
                   f'<td class="l">{_e(v.verdict[j])}</td></tr>')
    out.append("</tbody></table></div>")
    return out


def _head(command: str, files: str) -> list[str]:
    """The page's head and heading: the command and the files it read."""
    return ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>{_e(command + ': ' + files)}</title><style>{_CSS}</style></head><body>",
            f"<h1>{_e(command)}</h1>", f'<p class="files mono">{_e(files)}</p>']


# --------------------------------------------------------------------------------------------
# diff


def render_diff_html(res, max_findings: int | None = None) -> str:
    """`diff --html`: one self-contained page: both runs, the summary, the first divergence, the differences table
    (each observation as FILE:I, as `replay --obs` takes it)."""
    shown = res.differences[: HTML_MAX_FINDINGS if max_findings is None else max_findings]
    a, b = side_name(res.a_files), side_name(res.b_files)
    parts = _head("dcptool diff", f"A = {', '.join(res.a_files)}; B = {', '.join(res.b_files)}")
    kv = [("A", f"{a} ({res.a_observations:,} observations)"), ("B", f"{b} ({res.b_observations:,} observations)"),
          ("aligned", f"{res.compared:,}"), ("only in A", f"{res.only_in_a:,}"), ("only in B", f"{res.only_in_b:,}"),
          ("time", f"{res.seconds:.2f} s"), ("dcptool", __version__)]
    parts.append('<section id="summary"><h2>Summary</h2><dl class="kv">')
    parts += [f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in kv]
    parts.append("</dl>")
    if res.first is None:
        parts.append(f'<p class="verdict ok">Same: A and B record the same {res.compared:,} observations.</p>')
    else:
        f = res.first
        parts.append(f'<p class="verdict err">{res.total:,} differences</p><p>'
                     + "".join(f'<span class="chip">{_e(k)} {n:,}</span>' for k, n in res.by_field.items()) + "</p>")
        parts.append(f"<p>First divergence at {_e(f.where)}: <b>{_e(f.field)}</b>: {_e(f.text)}"
                     + "".join(f" &mdash; {side}: <code>{_e(r)}</code>" for side, r in (("A", f.a_ref), ("B", f.b_ref))
                               if r is not None) + "</p>")
    if res.skipped:
        parts.append('<p class="note">Not compared: '
                     + "; ".join(f"{_e(k)} ({_e(v)})" for k, v in res.skipped.items()) + "</p>")
    parts.append("</section>")
    parts += _differences(res, shown)
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _differences(res, shown) -> list[str]:
    out = [f'<section id="differences"><h2>Differences ({res.total:,})</h2>']
    if len(shown) < res.total:
        out.append(f'<p class="note">The first {len(shown):,} of {res.total:,} differences (--max-findings, default '
                   f"{HTML_MAX_FINDINGS:,} here); diff --json lists every one.</p>")
    if not shown:
        out.append('<p class="note">None.</p></section>')
        return out
    cols = ("#", "step", "site", "rank", "ub", "occurrence", "field", "row", "A", "B", "obs in A", "obs in B",
            "message")
    out.append('<table id="dtable"><thead><tr>' + "".join(f"<th>{n}</th>" for n in cols) + "</tr></thead><tbody>")
    for k, x in enumerate(shown):
        key = x.key
        where = ["", "", "", "", ""] if key is None else [key.step, _e(key.site), key.rank,
                                                          "-" if key.ubatch < 0 else key.ubatch, key.occurrence]
        cells = [k, *where, _e(x.field), *("" if v is None else v for v in (x.row, x.a, x.b)),
                 _e(x.a_ref or "-"), _e(x.b_ref or "-")]
        out.append(f'<tr id="d{k}">' + "".join(f"<td>{c}</td>" for c in cells)
                   + f'<td class="l">{_e(x.text)}</td></tr>')
    out.append("</tbody></table></section>")
    return out
