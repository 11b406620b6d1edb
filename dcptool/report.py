"""Rendering: rich text reports and JSON Lines; the only module that prints."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from rich.console import Console
from rich.table import Table
from rich.text import Text

TEXT_MAX_FINDINGS = 100  # text default; JSON lists every finding unless --max-findings says otherwise


def _style(severity: str) -> str:
    return "bold red" if severity == "error" else "yellow"


def findings_table(findings, title: str | None = None) -> Table:
    t = Table(title=title, show_lines=False, expand=False, title_justify="left")
    for name, kw in (("obs", {"justify": "right"}), ("step", {"justify": "right"}), ("site", {"no_wrap": True}),
                     ("rank", {"justify": "right"}), ("ub", {"justify": "right"}), ("rule", {"no_wrap": True}),
                     ("row", {"justify": "right"}), ("rec", {"justify": "right"}), ("exp", {"justify": "right"}),
                     ("message", {"overflow": "fold", "ratio": 1})):
        t.add_column(name, **kw)
    for f in findings:
        rule = f.rule + (f"/{f.source.relation}" if f.source is not None else "")
        t.add_row(str(f.obs), str(f.step), f.site, str(f.rank), "-" if f.ubatch < 0 else str(f.ubatch),
                  Text(rule, style=_style(f.severity)), "" if f.row is None else str(f.row),
                  "" if f.recorded is None else str(f.recorded), "" if f.expected is None else str(f.expected),
                  f.message.split(": ", 1)[-1])  # the row already says where
    return t


def render_replay(res, console: Console, max_findings: int | None = None) -> None:
    """Findings table, split and row views when asked, summary by rule and site, the first finding last."""
    limit = TEXT_MAX_FINDINGS if max_findings is None else max_findings
    if res.splits:
        render_splits(res.splits, console)
    if res.rows_view is not None:
        render_rows_view(res.rows_view, console)
    shown = res.findings[:limit]
    if shown:
        console.print(findings_table(shown, title=f"Findings ({len(res.findings)})"))
        if len(res.findings) > len(shown):
            console.print(f"... {len(res.findings) - len(shown)} more findings not shown (--max-findings, --json)")
    files = ", ".join(res.files)
    cfg = res.config
    console.print(f"[bold]dcptool replay[/bold] {files}: {res.observations} observations, dcp_size {cfg.dcp_size}, "
                  f"interleave {cfg.cp_interleave}" + (f", pcp_size {cfg.pcp_size}" if cfg.pcp_size > 1 else ""))
    if res.findings:
        by_rule = ", ".join(f"{r} {n}" for r, n in res.by_rule().items())
        console.print(f"findings: {len(res.findings)} ({res.errors} errors, {res.warnings} warnings): {by_rule}")
        st = Table(title="By site", title_justify="left")
        st.add_column("site")
        rules = list(res.by_rule())
        for r in rules:
            st.add_column(r, justify="right")
        for site, counts in res.by_site().items():
            st.add_row(site, *[str(counts.get(r, "")) for r in rules])
        console.print(st)
    else:
        console.print("[green]clean[/green]: every observation's DCP metadata is what it must be")
    for check, why in res.skipped.items():
        console.print(f"skipped {check}: {why}", style="dim")
    console.print(f"backend {res.backend} on {res.device}, {res.seconds:.2f} s", style="dim")
    if res.findings:
        f = res.findings[0]
        console.print(Text.assemble(("first finding: ", "bold"), (f"{f.file} obs {f.obs} ", ""),
                                    (f.rule, _style(f.severity)), f" {f.message}"))


def render_splits(splits, console: Console) -> None:
    t = Table(title=f"--split: {len(splits)} micro-batches", title_justify="left")
    for name in ("parent", "ub", "requests", "tokens", "num_reqs", "query_start_loc", "seq_lens", "dcp local"):
        t.add_column(name, overflow="fold")
    for s in splits:
        sl = s.ub.slice
        t.add_row(str(s.parent_obs), str(s.ubatch), f"[{sl.req_start}, {sl.req_stop})",
                  f"[{sl.tok_start}, {sl.tok_stop})", f"{s.ub.num_reqs}/{s.ub.num_reqs_padded}",
                  _short(s.ub.query_start_loc.tolist()), _short(s.ub.seq_lens.tolist()),
                  _short(s.dcp_local_seq_lens.tolist()))
    console.print(t)


def _short(v: list, n: int = 12) -> str:
    return str(v) if len(v) <= n else str(v[:n])[:-1] + f", ... ({len(v)} values)]"


def render_rows_view(v, console: Console) -> None:
    ub = f" ubatch {v.ubatch}" if v.ubatch >= 0 else ""
    t = Table(title=f"{v.file} obs {v.obs}: step {v.step} {v.site} rank {v.rank}{ub}, num_reqs {v.num_reqs}, "
                    f"num_reqs_padded {v.num_reqs_padded}", title_justify="left")
    n_ranks = len(v.expected_all_ranks[0]) if v.expected_all_ranks else 0
    t.add_column("row", justify="right")
    t.add_column("seq_len", justify="right")
    for r in range(n_ranks):
        t.add_column(f"r{r}" + ("*" if r == v.rank else ""), justify="right")
    t.add_column("expected", justify="right")
    t.add_column("recorded", justify="right")
    t.add_column("verdict")
    for j, verdict in enumerate(v.verdict):
        allr = v.expected_all_ranks[j] if j < len(v.expected_all_ranks) else [""] * n_ranks
        style = "bold red" if verdict.startswith(("WRONG", "missing", "absent", "extra")) else ""
        t.add_row(str(j), str(v.seq_lens[j]) if j < len(v.seq_lens) else "", *[str(x) for x in allr],
                  str(v.expected[j]) if j < len(v.expected) else "",
                  "None" if v.recorded is None else (str(v.recorded[j]) if j < len(v.recorded) else ""),
                  Text(verdict, style=style))
    console.print(t)
    if not v.verdict:
        console.print("(no rows)")
    for f in v.findings:
        console.print(Text.assemble((f.rule, _style(f.severity)), f" {f.message}"))


def replay_json_lines(res, max_findings: int | None = None) -> Iterator[str]:
    for s in res.splits:
        yield json.dumps(s.to_json())
    if res.rows_view is not None:
        yield json.dumps(res.rows_view.to_json())
    shown = res.findings if max_findings is None else res.findings[:max_findings]
    for f in shown:
        yield json.dumps(f.to_json())
    yield json.dumps(res.summary_json())


def render_inspect(info, console: Console) -> None:
    c = info.config
    console.print(f"[bold]{', '.join(info.files)}[/bold]  ({info.bytes:,} bytes, format {info.format})")
    t = Table(show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    t.add_row("config", f"dcp_size {c.dcp_size}, cp_interleave {c.cp_interleave}, pcp_size {c.pcp_size}, "
                        f"page_size {c.page_size}")
    for k in ("engine", "engine_version", "note"):
        if getattr(c, k):
            t.add_row(k, str(getattr(c, k)))
    t.add_row("observations", f"{info.observations:,} ({info.with_view:,} with a DCP view, {info.without_view:,} None)")
    steps = "none" if info.steps is None else f"{info.steps[0]} .. {info.steps[1]} ({info.distinct_steps} distinct)"
    t.add_row("steps", steps)
    t.add_row("sites", ", ".join(f"{s} {n}" for s, n in info.sites.items()))
    t.add_row("ranks", ", ".join(f"{r}: {n}" for r, n in info.ranks.items()))
    t.add_row("micro-batches", ", ".join(("full" if u < 0 else f"ub{u}") + f": {n}" for u, n in info.ubatches.items()))
    t.add_row("rows", f"{info.seq_rows:,} seq_lens rows, {info.dcp_rows:,} DCP rows, num_reqs max {info.max_num_reqs}, "
                      f"num_reqs_padded max {info.max_num_reqs_padded}")
    t.add_row("optional columns", ", ".join(info.optional) or "none")
    if info.injected:
        t.add_row("injected", ", ".join(f"{k} ({len(v)} obs)" for k, v in info.injected.items()))
    console.print(t)


def inspect_json(info) -> str:
    return json.dumps({"type": "inspect", **info.to_json()})


# --------------------------------------------------------------------------------------------
# diff


def _v(x) -> str:
    return "" if x is None else str(x)


def differences_table(diffs, title: str | None = None) -> Table:
    t = Table(title=title, show_lines=False, expand=False, title_justify="left")
    for name, kw in (("step", {"justify": "right"}), ("site", {"no_wrap": True}), ("rank", {"justify": "right"}),
                     ("ub", {"justify": "right"}), ("#", {"justify": "right"}), ("field", {"no_wrap": True}),
                     ("row", {"justify": "right"}), ("A", {"justify": "right"}), ("B", {"justify": "right"}),
                     ("obs A/B", {"justify": "right", "no_wrap": True}), ("message", {"overflow": "fold", "ratio": 1})):
        t.add_column(name, **kw)
    for x in diffs:
        k = x.key
        where = ["", "", "", "", ""] if k is None else [str(k.step), k.site, str(k.rank),
                                                        "-" if k.ubatch < 0 else str(k.ubatch), str(k.occurrence)]
        obs = f"{'-' if x.a_obs is None else x.a_obs}/{'-' if x.b_obs is None else x.b_obs}"
        t.add_row(*where, Text(x.field, style="bold red"), _v(x.row), _v(x.a), _v(x.b), "" if k is None else obs,
                  x.message.split(": ", 2)[-1])  # the row already says where and which field
    return t


def _side_name(files: list[str]) -> str:
    """One file's name, or the directory several files share (`fixed/`), as a person typed it."""
    if len(files) == 1:
        return files[0]
    common = os.path.commonpath(files) if len({os.path.isabs(f) for f in files}) == 1 else ""
    return f"{common or '.'}/" if common not in files else f"{files[0]}+{len(files) - 1}"


def _side_desc(files: list[str], n: int) -> str:
    many = f"{len(files)} files, " if len(files) > 1 else ""
    return f"{_side_name(files)} ({many}{n} observations)"


def render_diff(res, console: Console) -> None:
    """Differences in run order, the summary, then the first divergence last (cmp-style)."""
    a, b = _side_name(res.a_files), _side_name(res.b_files)
    if res.differences:
        console.print(differences_table(res.differences, title=f"Differences ({res.total})"))
        if res.total > len(res.differences):
            console.print(f"... {res.total - len(res.differences)} more differences not shown (--max-findings, --json)")
    console.print(f"[bold]dcptool diff[/bold] A = {_side_desc(res.a_files, res.a_observations)}, "
                  f"B = {_side_desc(res.b_files, res.b_observations)}: {res.compared} aligned, "
                  f"{res.only_in_a} only in A, {res.only_in_b} only in B")
    if res.total:
        console.print(f"differences: {res.total}: " + ", ".join(f"{f} {n}" for f, n in res.by_field.items()))
    for col, why in res.skipped.items():
        console.print(f"skipped {col}: {why}", style="dim")
    console.print(f"{res.seconds:.2f} s", style="dim")
    if res.first is None:
        console.print(f"[green]same[/green]: {a} and {b} record the same {res.compared} observations")
    else:
        f = res.first
        where, _, detail = f.message.split(": ", 2)
        console.print(Text.assemble(f"{a} {b} differ: ", ("first divergence", "bold"), f" at {where}: ",
                                    (f.field, "bold red"), f": {detail}"))


def diff_json_lines(res) -> Iterator[str]:
    for x in res.differences:
        yield json.dumps(x.to_json())
    yield json.dumps(res.summary_json())
