"""report/text.py: the replay as text: the terminal timeline (exact text, binned, coloured only on a colour
console), every renderer at 60, 80 and 200 columns, the report console, literal strings."""

from __future__ import annotations

import io
import re

import pytest
from conftest import cli, obs, write
from report_runs import expected_findings, replay_run12, timeline_run
from rich.console import Console

from dcptool.check.replay import replay
from dcptool.dump import open_dumps
from dcptool.report import text as report
from dcptool.report import timeline
from dcptool.report.differences import render_diff
from dcptool.report.html import render_html


@pytest.fixture(scope="module")
def run12(tmp_path_factory):
    return replay_run12(tmp_path_factory)


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


def test_cli_text_report_has_the_timeline_above_the_findings(tmp_path):
    r = cli("replay", write(tmp_path / "run.safetensors", timeline_run()), env={"COLUMNS": "100", "NO_COLOR": "1"})
    assert r.returncode == 1 and "\x1b" not in r.stdout
    assert r.stdout.index("Timeline of steps 0..11") < r.stdout.index("Findings (16)")
    assert "              r1   ····SSSSSS\n" in r.stdout


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
     "diff": render_diff, "simulate": report.render_simulate, "simulated": report.render_simulated}[kind](
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
    return ["by site: " + ", ".join(f"{s} {n}" for s, n in res.by_site.items())]


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
