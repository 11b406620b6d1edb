"""diff as text and JSON Lines: the differences table, the summary, the first divergence last (cmp-style), each
observation as `FILE:I`."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from rich import box
from rich.console import Console
from rich.table import Table

from dcptool.report.text import TEXT_MAX_FINDINGS, layout_width, lit, literal, say, show_table


def _v(x) -> str:
    return "" if x is None else str(x)


def differences_table(diffs, title: str | None = None, width: int = 200) -> Table:
    """One line per difference; below 120 columns where and the values fold into two columns and the message
    (which names the values) so the message keeps room to read."""
    wide = width >= 120
    t = Table(title=title, show_lines=False, expand=False, title_justify="left",
              box=box.HEAVY_HEAD if wide else box.SIMPLE_HEAD, pad_edge=wide)
    if wide:
        cols = (("step", {"justify": "right"}), ("site", {"overflow": "fold"}), ("rank", {"justify": "right"}),
                ("ub", {"justify": "right"}), ("#", {"justify": "right"}), ("field", {"no_wrap": True}),
                ("row", {"justify": "right"}), ("A", {"justify": "right"}), ("B", {"justify": "right"}),
                ("obs in A", {"overflow": "fold"}), ("obs in B", {"overflow": "fold"}))
    else:
        cols = (("step", {"justify": "right", "no_wrap": True}), ("where", {"overflow": "fold"}),
                ("field", {"no_wrap": True}))
    for name, kw in cols:
        t.add_column(name, **kw)
    t.add_column("message", overflow="fold", ratio=1, min_width=20)
    for x in diffs:
        k = x.key
        msg = lit(x.text)  # the row already says where and which field
        field = lit(x.field, style="bold red")
        if not wide:
            where = "" if k is None else (f"{k.site} r{k.rank}" + ("" if k.ubatch < 0 else f" ub{k.ubatch}") +
                                          (f" #{k.occurrence}" if k.occurrence else ""))
            t.add_row("" if k is None else str(k.step), lit(where), field, msg)
            continue
        where = ["", "", "", "", ""] if k is None else [str(k.step), lit(k.site), str(k.rank),
                                                        "-" if k.ubatch < 0 else str(k.ubatch), str(k.occurrence)]
        t.add_row(*where, field, _v(x.row), _v(x.a), _v(x.b), lit(x.a_ref or "-"), lit(x.b_ref or "-"), msg)
    return t


def side_name(files: list[str]) -> str:
    """One file's name, or the directory several files share (`fixed/`), as a person typed it."""
    if len(files) == 1:
        return files[0]
    common = os.path.commonpath(files) if len({os.path.isabs(f) for f in files}) == 1 else ""
    return f"{common or '.'}/" if common not in files else f"{files[0]}+{len(files) - 1}"


def _side_desc(files: list[str], n: int) -> str:
    many = f"{len(files)} files, " if len(files) > 1 else ""
    return f"{side_name(files)} ({many}{n} observations)"


def render_diff(res, console: Console, max_findings: int | None = None) -> None:
    """The whole report (a pipe, a file, --full): differences in run order, the summary, then the first divergence
    last (cmp-style). (One screen of it: report.screen.)"""
    shown = res.differences[: TEXT_MAX_FINDINGS if max_findings is None else max_findings]
    if shown:
        show_table(console, differences_table(shown, title=f"Differences ({res.total})", width=layout_width(console)))
    if res.total > len(shown):
        say(console, f"... {res.total - len(shown)} more differences not shown (--max-findings, --json)")
    diff_summary(res, console)


def diff_summary(res, console: Console, line=say, dim=say, cmp: bool = True) -> None:
    """diff's summary, one text for both reports, the first divergence last: the whole one's (`say`: lines never
    wrapped; cmp: its last line starts `A B differ:`, as cmp's does) and one screen's (report.screen: `line` wraps,
    `dim` cuts to the width)."""
    a, b = literal(side_name(res.a_files)), literal(side_name(res.b_files))
    line(console, ("dcptool diff", "bold"), literal(f" A = {_side_desc(res.a_files, res.a_observations)}, "
                                                    f"B = {_side_desc(res.b_files, res.b_observations)}")
         + f": {res.compared} aligned, {res.only_in_a} only in A, {res.only_in_b} only in B")
    if res.total:
        line(console, literal(f"differences: {res.total}: " + ", ".join(f"{f} {n}" for f, n in res.by_field.items())))
    for col, why in res.skipped.items():
        dim(console, literal(f"skipped {col}: {why}"), style="dim")
    dim(console, f"{res.seconds:.2f} s", style="dim")
    if res.first is None:
        line(console, ("same", "green"), f": {a} and {b} record the same {res.compared} observations")
    else:
        f = res.first
        line(console, f"{a} {b} differ: " if cmp else "", ("first divergence", "bold"), literal(f" at {f.where}: "),
             (literal(f.field), "bold red"), literal(f": {f.text}{diff_refs(f)}"))


def diff_refs(x) -> str:
    """` (A: FILE:I, B: FILE:I)`: the observations of a difference as `replay --obs` takes them ("" for none)."""
    refs = [f"{side}: {r}" for side, r in (("A", x.a_ref), ("B", x.b_ref)) if r is not None]
    return f" ({', '.join(refs)})" if refs else ""


def diff_json_lines(res, max_findings: int | None = None) -> Iterator[str]:
    for x in res.differences[:max_findings]:
        yield json.dumps(x.to_json())
    yield json.dumps(res.summary_json())
