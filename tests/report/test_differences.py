"""report/differences.py: diff as text and JSON Lines: the differences table at any width, the summary, the first
divergence last with both observations as FILE:I, and JSON's a_ref/b_ref."""

from __future__ import annotations

import io
import json

import pytest
from conftest import write
from report_runs import timeline_run
from rich.console import Console

from dcptool.diagnose.diff import diff
from dcptool.dump import open_dumps
from dcptool.report.differences import diff_json_lines, render_diff


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    d = tmp_path_factory.mktemp("diff")
    a = write(d / "a.safetensors", timeline_run())
    b = timeline_run()
    b[3].seq_lens = b[3].seq_lens.copy()
    b[3].seq_lens[0] += 1
    b[9].seq_lens = b[9].seq_lens.copy()
    b[9].seq_lens[1] += 2
    pb = write(d / "b.safetensors", b)
    return diff(open_dumps([a]), open_dumps([pb]))


def _text(res, width: int, terminal: bool = True, **kw) -> str:
    buf = io.StringIO()
    render_diff(res, Console(file=buf, width=width, force_terminal=terminal, color_system=None), **kw)
    return buf.getvalue()


def test_table_at_80_columns_keeps_the_message_readable(res):
    x = res.differences[0]
    rows = [line for line in _text(res, 80).splitlines() if line.strip().startswith(str(x.key.step))]
    assert rows and len(rows[0].rstrip()) > 60  # the message column has room (was 1 character wide)


def test_wide_table_names_both_observations_and_the_first_divergence_comes_last(res):
    out = _text(res, 400, terminal=False)
    x = res.first
    assert x.a_ref == f"{x.a_file}:{x.a_obs}" and x.b_ref == f"{x.b_file}:{x.b_obs}"
    assert f" {x.a_ref} " in out and f" {x.b_ref} " in out and "obs in A" in out
    assert out.splitlines()[-1].endswith(f"(A: {x.a_ref}, B: {x.b_ref})")


def test_max_findings_cuts_the_table_and_json_not_the_counts(res):
    assert res.total > 1
    out = _text(res, 400, terminal=False, max_findings=1)
    assert f"... {res.total - 1} more differences not shown" in out
    lines = [json.loads(x) for x in diff_json_lines(res, 1)]
    assert [x["type"] for x in lines] == ["difference", "summary"] and lines[-1]["differences"] == res.total
    assert lines[0]["a_ref"] == res.differences[0].a_ref and lines[0]["b_ref"] == res.differences[0].b_ref
    assert len(list(diff_json_lines(res))) == len(res.differences) + 1
