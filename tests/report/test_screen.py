"""report/screen.py: on a terminal (a real pseudo-terminal of 80x24 here) the default report fits one screen: at most
60 lines, none wider than the terminal, each problem on one line, the summary and the first problem last; --full, a
pipe and --json keep the whole report."""

from __future__ import annotations

import json
import re

import pytest
from conftest import ROOT, cli, cli_pty, screen_lines
from rich.cells import cell_len

SAMPLES = ROOT / "samples"
MAX_LINES = 60
OPEN_IT = "open it: --obs "


def _check_screen(lines: list[str], cols: int) -> None:
    """At most MAX_LINES rows of the terminal; no line wider than it but the reference to paste (the terminal folds
    it: its rows are counted)."""
    rows = sum(-(-max(cell_len(x), 1) // cols) for x in lines)
    assert rows <= MAX_LINES, "\n".join(lines)
    wide = [x for x in lines if cell_len(x) > cols and not x.startswith(OPEN_IT)]
    assert not wide, wide


@pytest.mark.parametrize("cols,rows", [(80, 24), (120, 40)])
def test_replay_fits_a_screen(cols, rows):
    code, out = cli_pty("replay", SAMPLES / "legacy.safetensors", cols=cols, rows=rows)
    lines = screen_lines(out)
    assert code == 1
    _check_screen(lines, cols)
    text = "\n".join(lines)
    # every problem on a line of its own, cut to the width
    problems = [x for x in lines if x.startswith("problem ") and ":" in x[:12]]
    assert len(problems) == 8 and all(cell_len(x) <= cols for x in problems)
    # the summary, then the first problem (whole, wrapped) and the observation to open, last
    assert text.index("dcptool replay ") < text.index("findings: 1116 (1116 errors") < text.index("problem 1 of 8:")
    assert lines[-1] == f"open it: --obs {SAMPLES / 'legacy.safetensors'}:0"
    assert "(step 0 dummy rank 0)" in " ".join(lines[-8:]) and "--full" in text
    assert "Findings (" not in text and "By site" not in text  # the rest: --full, --html


def test_a_long_reference_is_printed_whole(tmp_path):
    """The observation to open, however long its file's path, is one line to paste into --obs: never cut."""
    deep = tmp_path / ("d" * 70) / ("e" * 70)
    deep.mkdir(parents=True)
    dump = deep / "legacy.safetensors"
    dump.write_bytes((SAMPLES / "legacy.safetensors").read_bytes())
    code, out = cli_pty("replay", dump)
    lines = screen_lines(out)
    assert code == 1 and lines[-1] == f"{OPEN_IT}{dump}:0" and cell_len(lines[-1]) > 80
    _check_screen(lines, 80)
    shown = cli("replay", dump, "--obs", lines[-1][len(OPEN_IT):], "--json")
    assert shown.returncode == 1 and '"obs": 0' in shown.stdout


def test_the_whole_report_behind_full_and_in_a_pipe():
    code, out = cli_pty("replay", SAMPLES / "legacy.safetensors", "--full")
    full = "\n".join(screen_lines(out))
    assert code == 1 and "Findings (1116)" in full and "By site" in full and len(screen_lines(out)) > 150
    piped = cli("replay", SAMPLES / "legacy.safetensors")  # not a terminal: complete and unwrapped
    assert "Findings (1116)" in piped.stdout and "By site" in piped.stdout
    assert all(len(x) < 1000 for x in piped.stdout.splitlines())
    problem = next(x for x in piped.stdout.splitlines() if x.startswith("problem 1: "))
    assert problem.endswith("not checked against known vLLM bugs")  # whole, not cut
    code, out = cli_pty("replay", SAMPLES / "legacy.safetensors", "--json")  # JSON Lines whatever the terminal
    lines = [x for x in screen_lines(out) if x]
    assert [json.loads(x)["type"] for x in lines][-1] == "summary" and len(lines) == 1116 + 8 + 1


def test_a_clean_replay_and_max_findings_on_a_screen(tmp_path):
    code, out = cli_pty("replay", SAMPLES / "fixed.safetensors")
    lines = screen_lines(out)
    assert code == 0 and lines[-1].startswith("backend ")
    assert any(x.startswith("clean: every observation") for x in lines)
    _check_screen(lines, 80)
    code, out = cli_pty("replay", SAMPLES / "legacy.safetensors", "--max-findings", "5")
    lines = screen_lines(out)
    assert code == 1 and "Findings (1116)" in lines and len(lines) <= MAX_LINES + 5 * 3
    _check_screen([x for x in lines if not x.endswith("safetensors:0")], 80)  # (finding lines soft-wrap)


def test_obs_on_a_screen_ends_with_its_findings():
    ref = f"{SAMPLES / 'legacy.safetensors'}:297"
    code, out = cli_pty("replay", SAMPLES / "legacy.safetensors", "--obs", ref)
    lines = screen_lines(out)
    assert code == 1 and lines[0].startswith(f"{ref}: step 0 ubatch rank 1 ubatch 0")
    text = "\n".join(lines)
    # its findings last (once), after the summary; no timeline, no problems
    assert text.count("stale step 0 ubatch rank 1 ubatch 0:") == 1
    assert text.index("findings: 1116") < text.index("stale step 0 ubatch rank 1 ubatch 0:")
    assert "Problems" not in text and "Timeline" not in text and " ".join(lines[-3:]).endswith("(1 wrong row)")
    _check_screen(lines[1:], 80)  # (the first: the observation's reference, soft-wrapped where long)


def test_diff_fits_a_screen():
    code, out = cli_pty("diff", SAMPLES / "legacy.safetensors", SAMPLES / "fixed.safetensors")
    lines = screen_lines(out)
    assert code == 1
    _check_screen(lines, 80)
    assert lines[0] == "Differences (1448)" and "first divergence at step 0 dummy rank 0" in "\n".join(lines[-4:])
    assert f"A: {SAMPLES / 'legacy.safetensors'}:0" in " ".join(lines[-4:]).replace("\n", "")
    code, out = cli_pty("diff", SAMPLES / "legacy.safetensors", SAMPLES / "fixed.safetensors", "--full")
    assert len(screen_lines(out)) > 100


def test_simulate_fits_80_columns_and_a_pipe_gets_it_whole():
    """simulate's side-by-side and faults tables and its lines fit an 80-column terminal (the sites fold, the faults
    this configuration lacks are lines after the table, paragraphs wrap); a pipe gets each line whole."""
    code, out = cli_pty("simulate")
    lines = screen_lines(out)
    assert code == 0 and not [x for x in lines if cell_len(x) > 80], [x for x in lines if cell_len(x) > 80]
    piped = cli("simulate").stdout.splitlines()
    faults = [x.split()[0] for x in piped[piped.index(next(x for x in piped if x.startswith("Faults"))) + 3:]
              if x and x[0].isalpha() and not x.startswith(("fixed:", "replay backend"))]
    assert len(faults) == 10 and all(any(x.startswith(f + " ") for x in lines) for f in faults)
    assert "pcp-stale [main only]: not applicable here, needs --pcp > 1" in piped
    sites = next(x for x in piped if x.startswith("flashinfer-global-pages "))
    assert sites.endswith("dummy 6, ubatch 132, capture 21, attn_metadata 64, draft 64") and "287 of 287" in sites
    assert any(x.startswith("fixed: 0 findings in 538 observations; legacy: 444 findings (") for x in piped)
    assert lines[-1].endswith("`dcptool replay`") and piped[-1].startswith("replay backend torch")


def test_reduce_on_a_screen_cuts_its_other_findings(tmp_path):
    """reduce as replay and diff on a terminal: the summary and the kept problem's finding wrapped, any other finding
    one line cut to the width; a pipe gets every line whole."""
    assert cli("simulate", "--dcp", "4", "--steps", "8", "--pipeline", "legacy", "-o", "l.safetensors",
               cwd=tmp_path).returncode == 0
    args = ("reduce", "l.safetensors", "--finding", "rank-sum", "--max-seconds", "2")
    code, out = cli_pty(*args, "-o", "a.safetensors", cwd=tmp_path)
    lines = screen_lines(out)
    assert code == 0 and lines[-1] == "replay it: dcptool replay a.safetensors"
    assert not [x for x in lines if cell_len(x) > 80], lines
    cut = [x for x in lines if x.endswith("…")]
    start = lines.index(next(x for x in lines if x.startswith("rank-sum ")))
    kept = " ".join(lines[start:-1])
    assert cut and all(not x.startswith("rank-sum ") for x in cut) and "add up to" in kept
    piped = cli(*args, "-o", "b.safetensors", cwd=tmp_path).stdout.splitlines()  # (stopped by time: its own size)
    assert piped[0].startswith("dcptool reduce kept rank-sum at ubatch: ") and piped[-1].startswith("replay it: ")
    assert all(x.endswith(("wrong row)", "wrong rows)")) for x in piped[1:-1] if x.startswith("stale "))
    assert re.search(r"add up to \d+, not its seq_len \d+$", next(x for x in piped if x.startswith("rank-sum ")))
