"""One screen of a report, for a terminal: what to look at, the summary and the first problem last where the cursor is
(as pytest and cargo end); each problem on one line cut to the terminal's width. The whole report (report.text) is
behind --full, --json and --html, and is what a pipe or a file gets."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from dcptool.report.differences import diff_summary, side_name
from dcptool.report.text import (
    TEXT_MAX_FINDINGS,
    layout_width,
    literal,
    render_rows_view,
    render_splits,
    render_timeline,
    replay_summary,
    say,
    severity_style,
    wrap,
)
from dcptool.report.text import (
    render_reduction as whole_reduction,
)

SCREEN_TIMELINE_ROWS = 12  # one row per site (ranks folded in), rows with findings first
SCREEN_PROBLEMS = 10  # problems listed, one line each
SCREEN_DIFFERENCES = 10  # differences listed, one line each
MORE = "more: --full (every finding, by site), --html PATH (all, with row views)"


def cut(console: Console, *parts, style: str = "") -> None:
    """One line, cut to the console's width (an ellipsis marks the cut)."""
    t = Text.assemble(*parts, style=style)
    t.truncate(max(layout_width(console), 8), overflow="ellipsis")
    console.print(t, no_wrap=True, overflow="ellipsis", crop=True)


def _files(files: list[str]) -> str:
    return literal(files[0] if len(files) == 1 else f"{side_name(files)} ({len(files)} files)")


def render_replay(res, console: Console, max_findings: int | None = None) -> None:
    """replay on a terminal: the timeline (by site), the problems one line each, the summary, the first problem last;
    --obs / --split: what was asked for, the summary, that observation's findings last. A --max-findings given adds
    that many findings."""
    focus = res.rows_view is not None or bool(res.splits)
    if res.splits:
        render_splits(res.splits, console)
    if res.rows_view is not None:
        render_rows_view(res.rows_view, console, findings=False)  # (they come last)
    if not focus:
        render_timeline(res, console, max_rows=SCREEN_TIMELINE_ROWS, by_site=True)
    if max_findings is not None and res.findings:
        say(console, (f"Findings ({len(res.findings)})", "bold"))
        for f in res.findings[:max_findings]:
            wrap(console, literal(f"{f.ref} "), (f.rule, severity_style(f.severity)), literal(f" {f.message}"))
    problems = getattr(res, "problems", [])
    if problems and not focus:
        say(console, (f"Problems ({len(problems)})", "bold"))
        for p in problems[:SCREEN_PROBLEMS]:
            cut(console, (literal(p.line), "bold red" if p.known is not None and p.known.named else ""))
        if len(problems) > SCREEN_PROBLEMS:
            cut(console, f"... {len(problems) - SCREEN_PROBLEMS} more problems (--full)", style="dim")
    _summary(res, console)
    if focus:
        v = res.rows_view
        for f in ([] if v is None else v.findings):
            wrap(console, (f.rule, severity_style(f.severity)), literal(f" {f.message}"))
        return
    if problems:
        p = problems[0]
        head = f"problem {p.number}"  # (the line starts with it)
        wrap(console, (f"{head} of {len(problems)}", "bold"),
             (literal(p.line[len(head):] if p.line.startswith(head) else ": " + p.line),
              "bold red" if p.known is not None and p.known.named else ""))
        # whole, never cut: it is pasted into --obs as printed (a terminal folds a long path, a pipe keeps one line)
        console.print(Text(literal(f"open it: --obs {p.first.ref}"), style="dim"), soft_wrap=True)
    elif res.findings:
        f = res.findings[0]
        wrap(console, ("first finding: ", "bold"), literal(f"{f.ref} "), (f.rule, severity_style(f.severity)),
             literal(f" {f.message}"))


def _summary(res, console: Console) -> None:
    replay_summary(res, console, _files(res.files), line=wrap, dim=cut)
    if res.findings:
        cut(console, MORE, style="dim")


def render_diff(res, console: Console, max_findings: int | None = None) -> None:
    """diff on a terminal: the first differences one line each, the summary, the first divergence last."""
    limit = SCREEN_DIFFERENCES if max_findings is None else min(max_findings, TEXT_MAX_FINDINGS)
    shown = res.differences[:limit]
    if shown:
        say(console, (f"Differences ({res.total})", "bold"))
        for x in shown:
            cut(console, literal(f"{x.where}: "), (literal(x.field), "bold red"), literal(f": {x.text}"))
        if res.total > len(shown):
            cut(console, f"... {res.total - len(shown)} more (--full, --json, --html PATH)", style="dim")
    diff_summary(res, console, line=wrap, dim=cut, cmp=False)


def render_reduction(red, output: str, console: Console) -> None:
    """reduce on a terminal: its summary and first finding wrapped, each other finding one line cut to the width (as
    replay's problems and diff's differences)."""
    whole_reduction(red, output, console, line=wrap, more=cut)
