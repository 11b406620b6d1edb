"""Rendering: rich text reports and JSON Lines; the only module that prints."""

from __future__ import annotations

import json
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
    t.add_row("steps", "none" if info.steps is None else f"{info.steps[0]} .. {info.steps[1]} ({info.distinct_steps} distinct)")
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
# simulate


def _rules(counts: dict[str, int]) -> Text:
    if not counts:
        return Text("clean", style="green")
    from dcptool.replay import RULES

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
        t.add_row(s.site, str(s.observations), _rules(s.fixed), _rules(s.other))
    console.print(t)
    ft = Table(title=f"Faults ({cmp.label}): observations each touched, and what replay reported there",
               title_justify="left")
    for name, kw in (("fault", {"no_wrap": True}), ("rule", {}), ("touched", {"justify": "right"}),
                     ("found", {"justify": "right"}), ("at sites", {"overflow": "fold"}),
                     ("side findings there", {"overflow": "fold"})):
        ft.add_column(name, **kw)
    for f in cmp.faults:
        if not f.applicable:
            ft.add_row(f.name, f.rule, "-", "-", Text(f"not applicable: {f.why}", style="dim"), "")
            continue
        ok = f.found == f.touched
        found = str(f.found) + (f" ({f.shape_only} as shape)" if f.shape_only else "")
        ft.add_row(f.name, f.rule, str(f.touched), Text(found, style="green" if ok else "bold red"),
                   ", ".join(f"{s} {n}" for s, n in f.sites.items()) or "-",
                   _rules(f.side) if f.side else "-")
    console.print(ft)
    fx, ot = cmp.fixed, cmp.other
    console.print(f"fixed: {len(fx.findings)} findings in {fx.observations} observations; {cmp.label}: "
                  f"{len(ot.findings)} findings" + (f" ({', '.join(f'{r} {n}' for r, n in ot.by_rule().items())})"
                                                    if ot.findings else ""))
    if ot.by_rule().get("rank-sum"):
        console.print("(rank-sum is about a group of ranks: it is reported at the rank that completes a group whose "
                      "views do not add up, which may be a rank the fault left alone)", style="dim")
    if any(f.shape_only for f in cmp.faults):
        console.print("(as shape: a stale view whose surviving rows happen to be right but whose length is wrong; "
                      "replay can only see the length)", style="dim")
    console.print(f"replay backend {ot.backend} on {ot.device}, {cmp.seconds:.2f} s in all; write a dump with -o "
                  "and replay it with `dcptool replay`", style="dim")


def simulate_json_lines(cmp) -> Iterator[str]:
    for s in cmp.sites:
        yield json.dumps({"type": "site", "site": s.site, "observations": s.observations, "fixed": s.fixed,
                          "other": s.other})
    for f in cmp.faults:
        yield json.dumps(f.to_json())
    yield json.dumps(cmp.summary_json())


def render_simulated(res, console: Console) -> None:
    """What `simulate -o` wrote."""
    c = res.config
    console.print(f"[bold]wrote[/bold] {', '.join(res.files)}: {res.observations} observations "
                  f"({c.pipeline if not c.inject else 'inject ' + ','.join(c.faults)}, dcp {c.dcp}, pcp {c.pcp}, "
                  f"{c.steps} steps, seed {c.seed}) in {res.seconds:.2f} s")
    console.print("by site: " + ", ".join(f"{s} {n}" for s, n in res.by_site.items()))
    for f in res.faults.values():
        if f.applicable:
            console.print(f"  {f.name}: touched {f.count} observation(s), replay must report {f.rule}")
        else:
            console.print(f"  {f.name}: not applicable ({f.why})", style="dim")
    console.print(f"replay it: dcptool replay {' '.join(res.files)}", style="dim")
