"""Rendering: rich text reports and JSON Lines; the only module that prints."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

TEXT_MAX_FINDINGS = 100  # text default; JSON lists every finding unless --max-findings says otherwise
BY_SITE_ROWS = 50  # rows of the text summary's by-site table (docs/limits.md)

# One character per rule, distinct even ignoring case (initials collide: stale/stray/shape, missing/mismatch,
# padding/pages); the legend under the timeline spells them out.
RULE_CODES = {"missing": "M", "stale": "S", "global": "G", "wrong-rank": "R", "wrong-interleave": "I",
              "mismatch": "X", "padding": "P", "shape": "L", "stray": "Y", "ubatch-slice": "U", "alias": "A",
              "rank-sum": "K", "pages": "B"}
CLEAN, EMPTY = "·", " "
CELL_STYLE = {"clean": "green", "warning": "black on yellow", "error": "bold white on red"}


def _style(severity: str) -> str:
    return "bold red" if severity == "error" else "yellow"


def findings_table(findings, title: str | None = None, width: int = 200) -> Table:
    """One line per finding; below 120 columns the row values fold into the message so it stays readable."""
    wide = width >= 120
    t = Table(title=title, box=box.SIMPLE_HEAD, expand=False, title_justify="left", pad_edge=False)
    t.add_column("obs", justify="right", no_wrap=True)
    t.add_column("step", justify="right", no_wrap=True)
    t.add_column("where", no_wrap=True)
    t.add_column("rule", no_wrap=True)
    if wide:
        for name in ("row", "rec", "exp"):
            t.add_column(name, justify="right", no_wrap=True)
    t.add_column("message", ratio=1, min_width=30, overflow="fold")
    for f in findings:
        where = f"{f.site} r{f.rank}" + ("" if f.ubatch < 0 else f" ub{f.ubatch}")
        rule = f.rule + (f"/{f.source.relation}" if f.source is not None and wide else "")
        msg = f.message.split(": ", 1)[-1]  # the row already says where
        cells = [str(f.obs), str(f.step), where, Text(rule, style=_style(f.severity))]
        if wide:
            cells += ["" if v is None else str(v) for v in (f.row, f.recorded, f.expected)]
        t.add_row(*cells, msg)
    return t


def render_replay(res, console: Console, max_findings: int | None = None) -> None:
    """Findings table, split and row views when asked, summary by rule and site, the first finding last."""
    limit = TEXT_MAX_FINDINGS if max_findings is None else max_findings
    if res.splits:
        render_splits(res.splits, console)
    if res.rows_view is not None:
        render_rows_view(res.rows_view, console)
    render_timeline(res, console)
    shown = res.findings[:limit]
    if shown:
        console.print(findings_table(shown, title=f"Findings ({len(res.findings)})", width=console.width))
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
        by_site = res.by_site()
        for site, counts in list(by_site.items())[:BY_SITE_ROWS]:  # a dump may name 10**5 sites: cap the table
            st.add_row(site, *[str(counts.get(r, "")) for r in rules])
        console.print(st)
        if len(by_site) > BY_SITE_ROWS:
            console.print(f"... {len(by_site) - BY_SITE_ROWS} more sites with findings not shown (--json)")
    else:
        console.print("[green]clean[/green]: every observation's DCP metadata is what it must be")
    for check, why in res.skipped.items():
        console.print(f"skipped {check}: {why}", style="dim")
    console.print(f"backend {res.backend} on {res.device}, {res.seconds:.2f} s", style="dim")
    if res.findings:
        f = res.findings[0]
        console.print(Text.assemble(("first finding: ", "bold"), (f"{f.file} obs {f.obs} ", ""),
                                    (f.rule, _style(f.severity)), f" {f.message}"))


@dataclass(frozen=True)
class Timeline:
    """The replay as a picture: one row per (site, rank), one column per `width` consecutive steps (from the first)."""

    sites: list[str]  # per row
    ranks: list[int]  # per row
    first_step: int
    last_step: int
    width: int  # steps per column
    obs: np.ndarray  # [rows, cols] observations
    ub_obs: np.ndarray  # [rows, cols, U] observations by micro-batch: index u is micro-batch ubatches[u]
    rules: np.ndarray  # [rows, cols, len(RULES)] findings by rule
    ub_find: np.ndarray  # [rows, cols, U] findings by micro-batch
    first: np.ndarray  # [rows, cols] position in res.findings of the cell's first finding, -1 if none
    ubatches: list[int] | None = None  # the micro-batch of each ub_* index (-1 = full batch); None: u - 1
    hidden_rows: int = 0  # (site, rank) rows past TIMELINE_ROWS, not drawn (their findings are in the table)
    ub_folded: bool = False  # the last ub_* index also counts every higher micro-batch (past TIMELINE_UBATCHES)

    @property
    def columns(self) -> int:
        return int(self.obs.shape[1])

    def steps_of(self, col: int) -> tuple[int, int]:
        lo = self.first_step + col * self.width
        return lo, min(lo + self.width - 1, self.last_step)

    def ticks(self, gap: float) -> list[tuple[int, int]]:
        """(column, step) axis labels: multiples of a round number of steps, at least `gap` columns apart."""
        every = round_up(gap * self.width, (1, 2, 5))
        first = -(-self.first_step // every) * every
        out = [((s - self.first_step) // self.width, s) for s in range(first, self.last_step + 1, every)]
        if not out or out[0][0] >= gap:
            out.insert(0, (0, self.first_step))
        return out

    def worst(self) -> np.ndarray:
        """[rows, cols] index into RULES of each cell's worst finding (errors first, then table order), -1 if none."""
        from dcptool.replay import RULES, SEVERITY

        prio = np.array([i + (len(RULES) if SEVERITY[r] == "warning" else 0) for i, r in enumerate(RULES)])
        masked = np.where(self.rules > 0, prio, 10 * len(RULES))
        return np.where(self.rules.any(axis=2), masked.argmin(axis=2), -1)


def round_up(x: float, mantissas=(1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8)) -> int:
    """The smallest integer m * 10**e >= x (e >= 0): steps per column and label spacing people read at a glance."""
    scale = 1
    while True:
        for m in mantissas:
            if m * scale >= x and float(m * scale).is_integer():
                return int(m * scale)
        scale *= 10


TIMELINE_ROWS = 256  # (site, rank) rows drawn at most: rows with findings first (docs/limits.md)
TIMELINE_UBATCHES = 16  # distinct micro-batch indices kept apart in cell details; higher ones share the last


def timeline(res, max_columns: int) -> Timeline | None:
    """Bin the replay's observations and findings into at most `max_columns` step buckets (numpy, no loop per row).

    Rows, micro-batch indices and steps are recorded numbers, so none of them may size an array: the
    rows drawn are capped (TIMELINE_ROWS), micro-batch indices are indexed by the values present and
    capped (TIMELINE_UBATCHES), and step offsets are taken modulo 2**64 (steps may span all of int64).
    """
    from dcptool.replay import RULES

    g = res.grid
    if g is None or g.count.size == 0:
        return None
    site_of = {s: i for i, s in enumerate(res.config.sites)}
    rule_of = {r: i for i, r in enumerate(RULES)}
    nf = len(res.findings)
    fa = np.array([(site_of[f.site], f.rank, f.step, f.ubatch, rule_of[f.rule]) for f in res.findings],
                  np.int64).reshape(nf, 5)
    # rows: distinct (site, rank), compared as columns (no packing into one integer)
    site = np.concatenate([g.site.astype(np.int64), fa[:, 0]])
    rank = np.concatenate([g.rank.astype(np.int64), fa[:, 1]])
    order = np.lexsort((rank, site))
    new = np.ones(order.size, bool)
    new[1:] = (site[order][1:] != site[order][:-1]) | (rank[order][1:] != rank[order][:-1])
    row_all = np.empty(order.size, np.int64)
    row_all[order] = np.cumsum(new) - 1
    key_site, key_rank = site[order][new], rank[order][new]
    n_rows = key_site.size
    keep = np.arange(n_rows)
    if n_rows > TIMELINE_ROWS:  # rows with findings first, then the rest, each in (site, rank) order
        flagged = np.zeros(n_rows, bool)
        flagged[row_all[g.site.size:]] = True
        keep = np.sort(np.lexsort((np.arange(n_rows), ~flagged))[:TIMELINE_ROWS])
    remap = np.full(n_rows, -1, np.int64)
    remap[keep] = np.arange(keep.size)
    row_g, row_f = remap[row_all[: g.site.size]], remap[row_all[g.site.size :]]
    lo, hi = int(g.step.min()), int(g.step.max())
    span = hi - lo + 1
    width = round_up(span / max(max_columns, 1))  # a round number of steps per column, for readable labels
    cols = -(-span // width)
    ub_vals = np.unique(np.concatenate([g.ubatch.astype(np.int64), fa[:, 3]]))
    folded = ub_vals.size > TIMELINE_UBATCHES
    ub_vals = ub_vals[:TIMELINE_UBATCHES]

    def column(steps) -> np.ndarray:
        off = np.asarray(steps, np.int64).view(np.uint64) - np.uint64(lo % 2**64)
        return (off // np.uint64(width)).astype(np.int64)

    def ub_index(u) -> np.ndarray:
        return np.minimum(np.searchsorted(ub_vals, u), ub_vals.size - 1)

    sel = row_g >= 0
    ub_obs = np.zeros((keep.size, cols, ub_vals.size), np.int64)
    np.add.at(ub_obs, (row_g[sel], column(g.step[sel]), ub_index(g.ubatch[sel])), g.count[sel])
    rules = np.zeros((keep.size, cols, len(RULES)), np.int64)
    ub_find = np.zeros_like(ub_obs)
    first = np.full((keep.size, cols), -1, np.int64)
    sel = np.flatnonzero(row_f >= 0)
    if sel.size:
        fr, fc = row_f[sel], column(fa[sel, 2])
        np.add.at(rules, (fr, fc, fa[sel, 4]), 1)
        np.add.at(ub_find, (fr, fc, ub_index(fa[sel, 3])), 1)
        # findings are in observation order, so the first one to land in a cell is its earliest
        cell = fr * cols + fc
        uniq, pos = np.unique(cell, return_index=True)
        first.reshape(-1)[uniq] = sel[pos]
    return Timeline(sites=[res.config.sites[int(k)] for k in key_site[keep]], ranks=[int(r) for r in key_rank[keep]],
                    first_step=lo, last_step=hi, width=width, obs=ub_obs.sum(axis=2), ub_obs=ub_obs, rules=rules,
                    ub_find=ub_find, first=first, ubatches=[int(u) for u in ub_vals], hidden_rows=n_rows - keep.size,
                    ub_folded=bool(folded))


def _axis(tl: Timeline) -> str:
    out = [" "] * tl.columns
    gap = max(len(str(tl.first_step)), len(str(tl.last_step))) + 1
    for c, step in tl.ticks(gap):
        label = str(step)
        if c + len(label) <= tl.columns:
            out[c : c + len(label)] = label
    return "".join(out)


def _cells(tl: Timeline) -> tuple[np.ndarray, np.ndarray]:
    """Per cell: its character and its kind (empty, clean, warning, error)."""
    from dcptool.replay import RULES, SEVERITY

    worst = tl.worst()
    codes = np.array([RULE_CODES[r] for r in RULES] + [CLEAN, EMPTY])
    kinds = np.array([SEVERITY[r] for r in RULES] + ["clean", "empty"])
    pick = np.where(worst >= 0, worst, np.where(tl.obs > 0, len(RULES), len(RULES) + 1))
    return codes[pick], kinds[pick]


def render_timeline(res, console: Console) -> None:
    """Timeline strip: rows (site, rank), columns step buckets sized to the console, worst finding per cell."""
    from dcptool.replay import RULES, SEVERITY

    g = res.grid
    if g is None or g.count.size == 0:
        return
    site_w = min(max(len(res.config.sites[int(s)]) for s in np.unique(g.site)), 24)
    rank_w = 1 + len(str(int(g.rank.max())))
    label_w = site_w + 1 + rank_w + 1
    tl = timeline(res, max(console.width - label_w, 8))
    per = "1 step" if tl.width == 1 else f"{tl.width} steps"
    _print_items(console, [Text.assemble(("Timeline", "bold"), f" of steps {tl.first_step}..{tl.last_step}"),
                           Text(f"({per} per column,"), Text("micro-batches folded in)")], " ")
    console.print(Text("step".ljust(label_w) + _axis(tl), style="dim"), no_wrap=True, overflow="crop")
    chars, kinds = _cells(tl)
    for r, (site, rank) in enumerate(zip(tl.sites, tl.ranks)):
        shown = site if r == 0 or tl.sites[r - 1] != site else ""
        if len(shown) > site_w:
            shown = shown[: site_w - 1] + "…"
        line = Text(f"{shown:<{site_w}} " + f"r{rank}".ljust(rank_w) + " ")
        c = 0
        while c < tl.columns:  # runs of one kind share a style span
            e = c
            while e < tl.columns and kinds[r, e] == kinds[r, c]:
                e += 1
            line.append("".join(chars[r, c:e]), style=CELL_STYLE.get(str(kinds[r, c]), ""))
            c = e
        console.print(line, no_wrap=True, overflow="crop")
    if tl.hidden_rows:
        console.print(f"... {tl.hidden_rows} more (site, rank) rows not drawn (at most {TIMELINE_ROWS}, rows with "
                      "findings first)", style="dim")
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
        if len(line) + len(sep) + len(item) > console.width:
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
        t.add_row(str(s.parent_obs), str(s.ubatch), f"[{sl.req_start}, {sl.req_stop})",
                  f"[{sl.tok_start}, {sl.tok_stop})", f"{s.ub.num_reqs}/{s.ub.num_reqs_padded}",
                  _short(s.ub.query_start_loc.tolist()), _short(s.ub.seq_lens.tolist()),
                  _short(s.dcp_local_seq_lens.tolist()))
    console.print(t)


def _short(v: list, n: int = 12) -> str:
    return str(v) if len(v) <= n else str(v[:n])[:-1] + f", ... ({len(v)} values)]"


VIEW_RANKS = 32  # rank columns of a row view (text and HTML), around the observation's own rank


def rank_window(rank: int, n_ranks: int, width: int = VIEW_RANKS) -> tuple[int, int]:
    """[lo, hi) of the rank columns a row view shows: all of them, or `width` around `rank` (dcp_size may be
    4,096: a table that wide is neither readable nor cheap to lay out)."""
    lo = max(0, min(rank - width // 2, n_ranks - width))
    return lo, min(n_ranks, lo + width)


def render_rows_view(v, console: Console) -> None:
    ub = f" ubatch {v.ubatch}" if v.ubatch >= 0 else ""
    t = Table(title=f"{v.file} obs {v.obs}: step {v.step} {v.site} rank {v.rank}{ub}, num_reqs {v.num_reqs}, "
                    f"num_reqs_padded {v.num_reqs_padded}", title_justify="left")
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
    console.print(t)
    if (r_lo, r_hi) != (0, n_ranks):
        console.print(f"(ranks {r_lo}..{r_hi - 1} of {n_ranks} shown; --json has every rank)", style="dim")
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


class Progress:
    """A progress bar on stderr for long work (done / total, rate, time left): shown only once the
    work has run for `delay` seconds, never when disabled (--json, or stderr not a terminal). Call it
    with the units just done; safe from several threads."""

    def __init__(self, total: int, what: str, enabled: bool, unit: str = "obs", delay: float = 1.0):
        import threading
        import time

        self.total, self.what, self.unit, self.delay = total, what, unit, delay
        self.enabled = enabled and total > 0
        self._clock = time.monotonic
        self._t0 = self._clock()
        self._done = 0
        self._bar = None
        self._task = None
        self._lock = threading.Lock()

    def __call__(self, k: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._done += k
            if self._bar is None and self._clock() - self._t0 >= self.delay:
                self._start()
            if self._bar is not None:
                self._bar.update(self._task, completed=min(self._done, self.total))

    def _start(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, ProgressColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar

        unit = self.unit

        class Rate(ProgressColumn):
            def render(self, task) -> Text:
                return Text(f"{task.speed:,.0f} {unit}/s" if task.speed else "", style="progress.data.speed")

        self._bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), Rate(),
                        TimeRemainingColumn(), console=Console(stderr=True), transient=True)
        self._bar.start()
        self._task = self._bar.add_task(self.what, total=self.total, completed=self._done)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
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
