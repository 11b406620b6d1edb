"""Rendering: rich text reports and JSON Lines; the only module that prints (over 450 lines: the text and JSON
renderers of replay, inspect, simulate and reduce, which share its literal-text and no-hard-wrap helpers with diff's,
report.differences)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import numpy as np
from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.measure import Measurement
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from dcptool.dump.ref import obs_ref
from dcptool.report.timeline import CLEAN, TIMELINE_ROWS, Timeline, cells, timeline

TEXT_MAX_FINDINGS = 100  # text default; JSON lists every finding unless --max-findings says otherwise
BY_SITE_ROWS = 50  # rows of the text summary's by-site table (docs/limits.md)

CELL_STYLE = {"clean": "green", "warning": "black on yellow", "error": "bold white on red"}


def severity_style(severity: str) -> str:
    return "bold red" if severity == "error" else "yellow"


# --------------------------------------------------------------------------------------------
# Literal text and layouts that never hard-wrap what tools read


def literal(s: object) -> str:
    """A string from a file or a path as it must be shown: control characters (ESC, BEL, CR, OSC...) and
    other unprintable code points written as `\\x1b`-style escapes, so nothing from a file reaches the
    terminal as a command. Markup is not interpreted because every such string is shown as a Text."""
    s = str(s)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() or "\udca0" <= c <= "\udcff" else _escape(c) for c in s)


def _escape(c: str) -> str:
    o = ord(c)
    if 0xDC80 <= o < 0xDCA0:  # a non-UTF-8 byte of a file name that is a C1 control (0x9b is CSI): show the byte
        return f"\\x{o - 0xDC00:02x}"
    # (bytes 0xa0-0xff of a non-UTF-8 name stay surrogate-escaped: main() writes the name's own bytes back)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def lit(s: object, style: str = "") -> Text:
    """A string from a file, as a Text: shown literally, never parsed as rich markup."""
    return Text(literal(s), style=style)


def layout_width(console: Console) -> int:
    """The width layouts are planned for: the console's, or a fixed one where output goes to a pipe or file
    (ReportConsole there is as wide as any line, so nothing wraps, but a timeline still needs a size)."""
    return getattr(console, "layout_width", None) or console.width


class ReportConsole(Console):
    """The CLI's console. On a terminal it is rich's, sized to the terminal. Into a pipe or a file it is
    as wide as any line (tools grep whole findings; nothing is hard-wrapped) and lays out timelines for
    PIPE_LAYOUT columns whatever $COLUMNS says, so a saved report does not depend on the environment.
    Lines never end in padding, and a reader that went away raises BrokenPipeError (rich would exit 1,
    which reads as "findings") for the caller to handle."""

    PIPE_WIDTH = 100_000
    PIPE_LAYOUT = 120

    def __init__(self, **kw):
        super().__init__(highlight=False, emoji=False, **kw)
        self.layout_width = None
        if not self.is_terminal:
            self.layout_width = self.PIPE_LAYOUT
            self.width = self.PIPE_WIDTH

    def _render_buffer(self, buffer) -> str:
        return _TRAILING.sub(r"\1", super()._render_buffer(buffer))

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError(32, "Broken pipe")


_TRAILING = re.compile(r"[ \t]+((?:\x1b\[[0-9;]*m)*)(?=\n|$)")


def _plain_lines(table: Table) -> list[Text]:
    """A table as aligned lines that never wrap: cells padded to their column, the last one not padded."""
    cols = table.columns
    cells = [[c if isinstance(c, Text) else Text(str(c)) for c in col.cells] for col in cols]
    rows = len(cells[0]) if cells else 0
    head = [Text(str(c.header)) for c in cols]
    widths = [max([h.cell_len] + [x.cell_len for x in col]) for h, col in zip(head, cells)]

    def line(parts: list[Text]) -> Text:
        out = Text()
        for k, (p, w, c) in enumerate(zip(parts, widths, cols)):
            last = k == len(parts) - 1
            pad = " " * (w - p.cell_len)
            if c.justify == "right":
                out.append(pad)
                out.append_text(p)
            else:
                out.append_text(p)
                if not last:
                    out.append(pad)
            if not last:
                out.append("  ")
        out.rstrip()
        return out

    out = [line(head)] if table.show_header else []
    out += [line([col[r] for col in cells]) for r in range(rows)]
    return out


def show_table(console: Console, table: Table, fold: bool = True) -> None:
    """Print a table so that it degrades gracefully: as is where it fits; folded where a terminal of 80
    columns or more is too narrow (fold=True: its long cells fold); else as aligned lines that never wrap
    (a terminal soft-wraps them; a pipe or a narrow StringIO keeps each row on one line)."""
    if table.row_count == 0:
        return
    natural = Measurement.get(console, console.options.update_width(1 << 20), table).maximum  # unclamped
    if natural <= console.width or (fold and console.is_terminal and console.width >= 80):
        console.print(table)
        return
    if table.title is not None:
        t = table.title
        console.print(t if isinstance(t, Text) else Text(str(t)), soft_wrap=True)
    for line in _plain_lines(table):
        console.print(line, soft_wrap=True)


def say(console: Console, *parts, style: str = "") -> None:
    """One line of the report (summary, first finding...): parts are (text, style) pairs or plain
    strings made by dcptool; never wrapped by rich (a terminal soft-wraps it), never parsed as markup."""
    console.print(Text.assemble(*parts, style=style), soft_wrap=True)


def wrap(console: Console, *parts, style: str = "") -> None:
    """A paragraph, wrapped between words at a terminal's width; in a pipe or a file one line, as `say` writes it."""
    if console.is_terminal:
        console.print(Text.assemble(*parts, style=style), overflow="fold")
    else:
        say(console, *parts, style=style)


def findings_table(findings, title: str | None = None) -> Table:
    """One line per finding: where (FILE:I, as --obs takes it), the rule, the row's values, the message."""
    t = Table(title=title, box=box.SIMPLE_HEAD, expand=False, title_justify="left", pad_edge=False)
    t.add_column("obs", no_wrap=True)
    t.add_column("step", justify="right", no_wrap=True)
    t.add_column("where", overflow="fold")
    t.add_column("rule", no_wrap=True)
    for name in ("row", "rec", "exp"):
        t.add_column(name, justify="right", no_wrap=True)
    t.add_column("message", ratio=1, min_width=20, overflow="fold")
    for f in findings:
        where = lit(f"{f.site} r{f.rank}" + ("" if f.ubatch < 0 else f" ub{f.ubatch}"))
        rule = f.rule + (f"/{f.source.relation}" if f.source is not None else "")
        cells = [lit(f.ref), str(f.step), where, Text(rule, style=severity_style(f.severity))]
        cells += ["" if v is None else str(v) for v in (f.row, f.recorded, f.expected)]
        t.add_row(*cells, lit(f.text))  # (the row already says where)
    return t


def show_findings(console: Console, findings, total: int) -> None:
    """The findings given (of `total`): a table where the layout is 120 columns or more (a pipe's is), else one line
    each, `FILE:I RULE WHERE: MESSAGE`, which a terminal soft-wraps (a table's folded cells would not stay readable)."""
    if not findings:
        return
    if layout_width(console) >= 120:
        show_table(console, findings_table(findings, title=f"Findings ({total})"))
        return
    say(console, (f"Findings ({total})", "bold"))
    for f in findings:
        say(console, literal(f"{f.ref} "), (f.rule, severity_style(f.severity)), literal(f" {f.message}"))


def render_replay(res, console: Console, max_findings: int | None = None) -> None:
    """The whole report (a pipe, a file, --full): problems, split and row views when asked, the timeline, the findings
    table, the summary by rule and site, the first finding last. (One screen of it: report.screen.)"""
    limit = TEXT_MAX_FINDINGS if max_findings is None else max_findings
    render_problems(getattr(res, "problems", []), console)
    if res.splits:
        render_splits(res.splits, console)
    if res.rows_view is not None:
        render_rows_view(res.rows_view, console)
    render_timeline(res, console)
    shown = res.findings[:limit]
    if shown:
        show_findings(console, shown, len(res.findings))
        if len(res.findings) > len(shown):
            say(console, f"... {len(res.findings) - len(shown)} more findings not shown (--max-findings, --json)")
    replay_summary(res, console, literal(", ".join(res.files)), by_site=True)
    if res.findings:
        # cmp-style, the first finding last; its message only when the table above does not show it (each
        # finding's message is on exactly one line: `grep -c` counts findings)
        f = res.findings[0]
        where = f.where
        say(console, ("first finding: ", "bold"), literal(f"{f.ref} "), (f.rule, severity_style(f.severity)),
            literal(f" {f.message}" if not shown else f" {where} (the first row of the findings above)"))


def replay_summary(res, console: Console, files: str, line=say, dim=say, by_site: bool = False) -> None:
    """replay's summary, one text for both reports: the whole one's (`say`: lines never wrapped; by_site: the
    table by site under the counts) and one screen's (report.screen: `line` wraps, `dim` cuts to the width)."""
    cfg = res.config
    line(console, ("dcptool replay", "bold"), f" {files}: {res.observations} observations, dcp_size "
         f"{cfg.dcp_size}, interleave {cfg.cp_interleave}" + (f", pcp_size {cfg.pcp_size}" if cfg.pcp_size > 1 else ""))
    if res.findings:
        by_rule = ", ".join(f"{r} {n}" for r, n in res.by_rule().items())
        line(console, f"findings: {len(res.findings)} ({res.errors} errors, {res.warnings} warnings): {by_rule}")
        if by_site:
            _by_site(res, console)
    else:
        line(console, ("clean", "green"), ": every observation's DCP metadata is what it must be")
    for check, why in res.skipped.items():
        dim(console, literal(f"skipped {check}: {why}"), style="dim")
    if getattr(res, "capped", None) is not None:
        line(console, ("size cap", "yellow"), f": the recording stopped at its size cap of {res.capped:,} bytes; "
             "later observations were not recorded (DCPTOOL_RECORD_MAX_GB, Recorder(max_bytes=))")
    dim(console, f"backend {res.backend} on {res.device}, {res.seconds:.2f} s", style="dim")


def _by_site(res, console: Console) -> None:
    """The findings by site and rule (the first BY_SITE_ROWS sites)."""
    st = Table(title="By site", title_justify="left")
    st.add_column("site", overflow="fold")
    rules = list(res.by_rule())
    for r in rules:
        st.add_column(r, justify="right")
    by_site = res.by_site()
    for site, counts in list(by_site.items())[:BY_SITE_ROWS]:  # a dump may name 10**5 sites: cap the table
        st.add_row(lit(site), *[str(counts.get(r, "")) for r in rules])
    show_table(console, st, fold=False)
    if len(by_site) > BY_SITE_ROWS:
        say(console, f"... {len(by_site) - BY_SITE_ROWS} more sites with findings not shown (--json)")


def _axis(tl: Timeline) -> str:
    out = [" "] * tl.columns
    gap = max(len(str(tl.first_step)), len(str(tl.last_step))) + 1
    for c, step in tl.ticks(gap):
        label = str(step)
        if c + len(label) <= tl.columns:
            out[c : c + len(label)] = label
    return "".join(out)


def render_timeline(res, console: Console, max_rows: int = TIMELINE_ROWS, by_site: bool = False) -> None:
    """Timeline strip: rows (site, rank), or with `by_site` one per site (ranks folded in), at most `max_rows` of
    them; columns step buckets sized to the console, worst finding per cell."""
    from dcptool.dcp.rules import RULE_CODES, RULES, SEVERITY

    g = res.grid
    if g is None or g.count.size == 0:
        return
    site_w = min(max(cell_len(literal(res.config.sites[int(s)])) for s in np.unique(g.site)), 24)
    rank_w = 0 if by_site else 1 + len(str(int(g.rank.max())))
    label_w = site_w + 1 + rank_w + (0 if by_site else 1)
    tl = timeline(res, max(layout_width(console) - label_w, 8), max_rows, by_site)
    per = "1 step" if tl.width == 1 else f"{tl.width} steps"
    _print_items(console, [Text.assemble(("Timeline", "bold"), f" of steps {tl.first_step}..{tl.last_step}"),
                           Text(f"({per} per column,"),
                           Text("ranks and micro-batches folded in)" if by_site else "micro-batches folded in)")], " ")
    console.print(Text("step".ljust(label_w) + _axis(tl), style="dim"), no_wrap=True, overflow="crop")
    chars, kinds = cells(tl)
    for r, (site, rank) in enumerate(zip(tl.sites, tl.ranks)):
        shown = Text(literal(site) if r == 0 or tl.sites[r - 1] != site else "")
        shown.truncate(site_w, overflow="ellipsis", pad=True)
        line = Text.assemble(shown, " " if by_site else " " + f"r{rank}".ljust(rank_w) + " ")
        c = 0
        while c < tl.columns:  # runs of one kind share a style span
            e = c
            while e < tl.columns and kinds[r, e] == kinds[r, c]:
                e += 1
            line.append("".join(chars[r, c:e]), style=CELL_STYLE.get(str(kinds[r, c]), ""))
            c = e
        console.print(line, no_wrap=True, overflow="crop")
    if tl.hidden_rows:
        console.print(f"... {tl.hidden_rows} more {'site' if by_site else '(site, rank)'} rows not drawn (at most "
                      f"{max_rows}, rows with findings first)", style="dim", no_wrap=True, overflow="ellipsis")
    items = [Text.assemble((CLEAN, CELL_STYLE["clean"]), " clean"),
             Text.assemble(("(blank)", "dim"), " no observations")]
    for i in np.unique(tl.worst()):
        if i >= 0:
            rule = RULES[i]
            items.append(Text.assemble((RULE_CODES[rule], CELL_STYLE[SEVERITY[rule]]),
                                       f" {rule}" + (" (warning)" if SEVERITY[rule] == "warning" else "")))
    _print_items(console, items, "  ")


def _print_items(console: Console, items: list[Text], sep: str) -> None:
    """Print items joined by sep, wrapping between items and never inside one."""
    line = items[0]
    for item in items[1:]:
        if line.cell_len + len(sep) + item.cell_len > layout_width(console):
            console.print(line, no_wrap=True, overflow="crop")
            line = item
        else:
            line = Text.assemble(line, sep, item)
    console.print(line, no_wrap=True, overflow="crop")


def render_splits(splits, console: Console) -> None:
    t = Table(title=f"--split: {len(splits)} micro-batches", title_justify="left")
    for name in ("parent", "ub", "requests", "tokens", "num_reqs", "query_start_loc", "seq_lens", "dcp local"):
        t.add_column(name, overflow="fold")
    for s in splits:
        sl = s.ub.slice
        t.add_row(lit(obs_ref(s.file, s.parent_obs)), str(s.ubatch), f"[{sl.req_start}, {sl.req_stop})",
                  f"[{sl.tok_start}, {sl.tok_stop})", f"{s.ub.num_reqs}/{s.ub.num_reqs_padded}",
                  _short(s.ub.query_start_loc.tolist()), _short(s.ub.seq_lens.tolist()),
                  _short(s.dcp_local_seq_lens.tolist()))
    show_table(console, t, fold=False)  # (the parent, FILE:I, would fold into a column of letters)


def _short(v: list, n: int = 12) -> str:
    return str(v) if len(v) <= n else str(v[:n])[:-1] + f", ... ({len(v)} values)]"


VIEW_RANKS = 32  # rank columns of a row view (text and HTML), around the observation's own rank


def rank_window(rank: int, n_ranks: int, width: int = VIEW_RANKS) -> tuple[int, int]:
    """[lo, hi) of the rank columns a row view shows: all of them, or `width` around `rank` (dcp_size may be
    4,096: a table that wide is neither readable nor cheap to lay out)."""
    lo = max(0, min(rank - width // 2, n_ranks - width))
    return lo, min(n_ranks, lo + width)


def render_rows_view(v, console: Console, findings: bool = True) -> None:
    """`--obs`: the observation row by row, then (`findings`) its findings."""
    ub = f" ubatch {v.ubatch}" if v.ubatch >= 0 else ""
    say(console, literal(f"{obs_ref(v.file, v.obs)}: step {v.step} {v.site} rank {v.rank}{ub}, num_reqs {v.num_reqs}, "
                         f"num_reqs_padded {v.num_reqs_padded}"))  # a line of its own: never wrapped to the table
    t = Table()
    n_ranks = len(v.expected_all_ranks[0]) if v.expected_all_ranks else 0
    # as many rank columns as fit beside row, seq_len, expected, recorded and verdict (~7 cells each)
    r_lo, r_hi = rank_window(v.rank, n_ranks, max(4, min(VIEW_RANKS, (console.width - 48) // 7)))
    t.add_column("row", justify="right")
    t.add_column("seq_len", justify="right")
    for r in range(r_lo, r_hi):
        t.add_column(f"r{r}" + ("*" if r == v.rank else ""), justify="right")
    t.add_column("expected", justify="right")
    t.add_column("recorded", justify="right")
    t.add_column("verdict")
    for j, verdict in enumerate(v.verdict):
        allr = v.expected_all_ranks[j][r_lo:r_hi] if j < len(v.expected_all_ranks) else [""] * (r_hi - r_lo)
        style = "bold red" if verdict.startswith(("WRONG", "missing", "absent", "extra")) else ""
        t.add_row(str(j), str(v.seq_lens[j]) if j < len(v.seq_lens) else "", *[str(x) for x in allr],
                  str(v.expected[j]) if j < len(v.expected) else "",
                  "None" if v.recorded is None else (str(v.recorded[j]) if j < len(v.recorded) else ""),
                  Text(verdict, style=style))
    if v.verdict:
        show_table(console, t)
        if (r_lo, r_hi) != (0, n_ranks):
            say(console, f"(ranks {r_lo}..{r_hi - 1} of {n_ranks} shown; --json has every rank)", style="dim")
    else:
        say(console, "(no rows)")
    for f in v.findings if findings else ():
        say(console, (f.rule, severity_style(f.severity)), literal(f" {f.message}"))


def replay_json_text(res, max_findings: int | None = None) -> Iterator[str]:
    """`replay --json`: its JSON Lines in chunks, each whole lines ending in a newline (a block of findings a chunk,
    streamed from the table's columns with no Finding objects: one write each, not one a finding)."""
    head = [json.dumps(s.to_json()) for s in res.splits]
    if res.rows_view is not None:
        head.append(json.dumps(res.rows_view.to_json()))
    if head:
        yield "\n".join(head) + "\n"
    shown = res.findings if max_findings is None else res.findings[:max_findings]
    for lines in shown.json_blocks():
        yield "\n".join(lines) + "\n"
    yield "\n".join([*problem_json_lines(getattr(res, "problems", [])), json.dumps(res.summary_json())]) + "\n"


def render_inspect(info, console: Console) -> None:
    c = info.config
    say(console, (literal(", ".join(info.files)), "bold"), f"  ({info.bytes:,} bytes, format {info.format})")
    t = Table(show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    t.add_row("config", f"dcp_size {c.dcp_size}, cp_interleave {c.cp_interleave}, pcp_size {c.pcp_size}, "
                        f"page_size {c.page_size}")
    for k in ("engine", "engine_version", "note"):
        if getattr(c, k):
            t.add_row(k, lit(getattr(c, k)))
    t.add_row("observations", f"{info.observations:,} ({info.with_view:,} with a DCP view, {info.without_view:,} None)")
    steps = "none" if info.steps is None else f"{info.steps[0]} .. {info.steps[1]} ({info.distinct_steps} distinct)"
    t.add_row("steps", steps)
    t.add_row("sites", lit(", ".join(f"{s} {n}" for s, n in info.sites.items())))
    t.add_row("ranks", ", ".join(f"{r}: {n}" for r, n in info.ranks.items()))
    t.add_row("micro-batches", ", ".join(("full" if u < 0 else f"ub{u}") + f": {n}" for u, n in info.ubatches.items()))
    t.add_row("rows", f"{info.seq_rows:,} seq_lens rows, {info.dcp_rows:,} DCP rows, num_reqs max {info.max_num_reqs}, "
                      f"num_reqs_padded max {info.max_num_reqs_padded}")
    shown = [k for k in info.optional if not k.startswith(TRANSFER_PREFIXES)]  # (a transfer's 40 columns: one row)
    t.add_row("optional columns", ", ".join(shown) + (", the transfer columns" if len(shown) < len(info.optional)
                                                      else "") or "none")
    if info.transfers:
        t.add_row("transfers", f"{info.transfers:,} KV transfer plans (replay's `transfer` rule)")
    if info.capped is not None:
        t.add_row("size cap", lit(f"the recording stopped at its size cap of {info.capped:,} bytes: later "
                                  "observations were not recorded"))
    if info.injected:
        t.add_row("injected", lit(", ".join(f"{k} ({len(v)} obs)" for k, v in info.injected.items())))
    show_table(console, t)


TRANSFER_PREFIXES = ("obs.xfer", "obs.xgrp", "obs.xsrc", "obs.xdst", "obs.xcopy", "xfer.", "xgrp.", "xsrc.", "xdst.",
                     "xcopy.")


def inspect_json(info) -> str:
    return json.dumps({"type": "inspect", **info.to_json()})


# --------------------------------------------------------------------------------------------
# simulate


def _rules(counts: dict[str, int]) -> Text:
    if not counts:
        return Text("clean", style="green")
    from dcptool.dcp.rules import RULES

    return Text(", ".join(f"{r} {counts[r]}" for r in RULES if r in counts), style="bold red")


def render_simulate(cmp, console: Console) -> None:
    """The side-by-side table per site, then each injected fault: where it touched and what replay said."""
    c = cmp.config
    t = Table(title=f"dcptool simulate: dcp {c.dcp}, interleave {c.interleave}, pcp {c.pcp}, {c.steps} steps, "
                    f"spec {c.spec_method} x{c.spec_tokens}, ubatches {c.ubatches}, cudagraph {c.cudagraph}, "
                    f"seed {c.seed}", title_justify="left")
    t.add_column("site", no_wrap=True)
    t.add_column("observations", justify="right")
    t.add_column("fixed: replay finds", overflow="fold")
    t.add_column(f"{cmp.label}: replay finds", overflow="fold")
    for s in cmp.sites:
        t.add_row(lit(s.site), str(s.observations), _rules(s.fixed), _rules(s.other))
    show_table(console, t)
    _faults(cmp, console)
    fx, ot = cmp.fixed, cmp.other
    wrap(console, f"fixed: {len(fx.findings)} findings in {fx.observations} observations; {cmp.label}: "
        f"{len(ot.findings)} findings" + (f" ({', '.join(f'{r} {n}' for r, n in ot.by_rule().items())})"
                                          if ot.findings else ""))
    if ot.by_rule().get("rank-sum"):
        wrap(console, "(rank-sum is about a group of ranks: it is reported at the rank that completes a group whose "
            "views do not add up, which may be a rank the fault left alone)", style="dim")
    if any(f.shape_only for f in cmp.faults):
        wrap(console, "(as shape: a stale view whose surviving rows happen to be right but whose length is wrong; "
            "replay can only see the length)", style="dim")
    wrap(console, f"replay backend {ot.backend} on {ot.device}, {cmp.seconds:.2f} s in all; write a dump with -o "
        "and replay it with `dcptool replay`", style="dim")


def _faults(cmp, console: Console) -> None:
    """simulate's faults: a table of those this configuration has (what each touched, how many of those replay
    found it at, where, and what else replay said there), then one line for each it does not have, and why."""
    ft = Table(title=f"Faults ({cmp.label}): observations each touched, and what replay reported there",
               title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    ft.add_column("fault", no_wrap=True)
    ft.add_column("in vLLM")
    ft.add_column("rule", no_wrap=True)
    ft.add_column("found", no_wrap=True)
    ft.add_column("at sites")
    for f in cmp.faults:
        if f.applicable:
            found = f"{f.found} of {f.touched}" + (f" ({f.shape_only} as shape)" if f.shape_only else "")
            where = ", ".join(f"{s} {n}" for s, n in f.sites.items()) or "-"
            ft.add_row(f.name, f.where, f.rule, Text(found, style="green" if f.found == f.touched else "bold red"),
                       Text.assemble(lit(where), *(("; side findings ", _rules(f.side)) if f.side else ())))
    show_table(console, ft)
    for f in cmp.faults:
        if not f.applicable:
            wrap(console, f"{f.name} [{f.where}]: not applicable here, {f.why}", style="dim")


def simulate_json_lines(cmp) -> Iterator[str]:
    for s in cmp.sites:
        yield json.dumps({"type": "site", "site": s.site, "observations": s.observations, "fixed": s.fixed,
                          "other": s.other})
    for f in cmp.faults:
        yield json.dumps(f.to_json())
    yield json.dumps(cmp.summary_json())


def simulated_line(res) -> str:
    """The status line of `simulate -o` (stderr): what it wrote."""
    c = res.config
    return (f"wrote {', '.join(res.files)}: {res.observations} observations "
            f"({c.pipeline if not c.inject else 'inject ' + ','.join(c.faults)}, dcp {c.dcp}, pcp {c.pcp}, "
            f"{c.steps} steps, seed {c.seed}) in {res.seconds:.2f} s")


def render_simulated(res, console: Console) -> None:
    """What `simulate -o` wrote: its observations by site, and each fault (the status line is simulated_line); each
    line wrapped at a terminal's width."""
    wrap(console, "by site: " + ", ".join(f"{s} {n}" for s, n in res.by_site.items()))
    for f in res.faults.values():
        line = (Text(f"{f.name} [{f.where}]: touched {f.count} observation(s), replay must report {f.rule}")
                if f.applicable else Text(f"{f.name} [{f.where}]: not applicable ({f.why})", style="dim"))
        if console.is_terminal:  # (indented, wrapped alike)
            console.print(Padding(line, (0, 0, 0, 2), expand=False), overflow="fold")
        else:
            say(console, "  ", line)
    wrap(console, literal(f"replay it: dcptool replay {' '.join(res.files)}"), style="dim")


# --------------------------------------------------------------------------------------------
# Problems: replay's report leads with one line per root cause


def render_problems(problems, console: Console) -> None:
    """One line per problem (problems.Problem.line), before the details; nothing when there are none."""
    if not problems:
        return
    say(console, (f"Problems ({len(problems)})", "bold"))
    for p in problems:
        style = "bold red" if p.known is not None and p.known.named else ""
        say(console, (literal(p.line), style))


def problem_json_lines(problems) -> Iterator[str]:
    """`{"type": "problem", ...}` objects: each lists its findings by position in the finding stream."""
    for p in problems:
        yield json.dumps(p.to_json())


def render_reduction(red, output: str, console: Console, line=say, more=say) -> None:
    """What `dcptool reduce` kept: sizes before and after, the problem, the reduced recording's findings (the first
    of the kept problem's rule and site as a `line`, the others as `more`); the whole lines (a pipe, a file), or on
    a terminal (report.screen) `line` wraps and `more` cuts to the width."""
    b, a = red.before, red.after
    line(console, ("dcptool reduce", "bold"), literal(f" kept {red.target.label} at {red.target.site}: "
         f"{b['observations']} -> {a['observations']} observations, {b['steps']} -> {a['steps']} steps, "
         f"{b['rows']} -> {a['rows']} rows ({red.candidates} replays, {red.seconds:.2f} s"
         + (", stopped at --max-seconds" if red.stopped else "") + ")"))
    t = red.target
    kept = next((k for k, f in enumerate(red.findings) if (f.rule, f.site) == (t.rule, t.site)), 0)
    for k, f in enumerate(red.findings):
        (line if k == kept else more)(console, (f.rule, severity_style(f.severity)), literal(f" {f.ref} {f.message}"))
    line(console, literal(f"replay it: dcptool replay {output}"), style="dim")
