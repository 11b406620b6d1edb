"""Bounded cost on small hostile files (docs/limits.md).

Each file here is kilobytes to a few megabytes and once cost gigabytes or minutes. Where the old
code blew up in memory or time, the command runs in a subprocess under a resource guard
(RLIMIT_AS / RLIMIT_CPU), so a regression fails fast instead of eating the machine; the
assertions are on exit codes, output sizes and the shapes of what was built, never on timings.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT
from typer.testing import CliRunner

from dcptool.check.replay import MAX_SPLIT
from dcptool.cli import app
from dcptool.dump import MAX_DCP_SIZE, DumpConfig, write_dump

runner = CliRunner()
MEM = 1 << 29  # address space a guarded run may add once torch is imported: a replay of these files fits in 512 MiB

# The guard counts from after `import torch`: a CUDA build of torch maps gigabytes of libraries (the
# accelerator image's would not even load under an absolute 1 GiB), and that is not dcptool's to count.
GUARD = """
import resource, numpy, torch
_vm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (_vm + {mem}, _vm + {mem}))
resource.setrlimit(resource.RLIMIT_CPU, ({cpu_s}, {cpu_s}))
"""


def guarded(script: str, *, mem: int = MEM, cpu_s: int = 60) -> dict:
    """Run `script` (Python) with the address space it may add and its CPU time capped; it prints one JSON
    line last. The CPU path always (CUDA_VISIBLE_DEVICES empty): the guard is about host memory."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, "-c", GUARD.format(mem=mem, cpu_s=cpu_s) + script], capture_output=True,
                       text=True, env=env, timeout=10 * cpu_s)
    assert p.returncode == 0, f"guarded run failed (rc {p.returncode}): {p.stderr[-3000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


CLI = """
import json, sys
from typer.testing import CliRunner
from dcptool.cli import app
out = {}
for name, args in ARGS:
    r = CliRunner().invoke(app, args)
    out[name] = {"code": r.exit_code, "out": len(r.stdout), "err": r.stderr.strip(), "exc": repr(r.exception)
                 if r.exception and not isinstance(r.exception, SystemExit) else None}
print(json.dumps(out))
"""


def cli_guarded(args: dict[str, list[str]], **kw) -> dict:
    return guarded(f"ARGS = {list(args.items())!r}\n" + CLI, **kw)


def columns(n: int, rows: int = 1, *, wrong: bool = True, seed: int = 0) -> dict[str, np.ndarray]:
    """n observations of `rows` real rows each, rank 0, step 0, site 0; views all wrong (or all None)."""
    rng = np.random.default_rng(seed)
    offs = np.arange(n + 1, dtype=np.int64) * rows
    seq = rng.integers(1, 100, n * rows).astype(np.int32)
    return {"obs.step": np.zeros(n, np.int64), "obs.site": np.zeros(n, np.int32), "obs.rank": np.zeros(n, np.int32),
            "obs.ubatch": np.full(n, -1, np.int32), "obs.num_reqs": np.full(n, rows, np.int32),
            "obs.num_reqs_padded": np.full(n, rows, np.int32), "obs.rows": offs, "rows.seq_lens": seq,
            "obs.has_dcp": np.full(n, int(wrong), np.uint8), "obs.dcp_rows": offs * int(wrong),
            "rows.dcp_local_seq_lens": (seq + 1000 if wrong else np.zeros(0)).astype(np.int32)}


# --------------------------------------------------------------------------------------------
# Absurd values: one line, exit 2


def test_dcp_size_past_the_limit_is_refused_in_one_line(tmp_path):
    p = tmp_path / "wide.safetensors"
    c = columns(3)
    write_dump(p, DumpConfig(dcp_size=MAX_DCP_SIZE, sites=("a",)), c)  # the limit itself is fine
    assert runner.invoke(app, ["replay", str(p)]).exit_code == 1
    raw = p.read_bytes()  # the same file claiming dcp_size 60,000 (the header is patched: writers refuse it)
    patched = raw.replace(b'dcp_size\\": 4096', b'dcp_size\\": 60000')  # inside the JSON string of the config
    assert patched != raw and len(patched) == len(raw) + 1
    n = int.from_bytes(raw[:8], "little") + 1
    q = tmp_path / "hostile.safetensors"
    q.write_bytes(n.to_bytes(8, "little") + patched[8:])
    for cmd in (["replay", str(q)], ["replay", str(q), "--html", str(tmp_path / "r.html")], ["inspect", str(q)],
                ["diff", str(q), str(p)]):
        r = runner.invoke(app, cmd)
        assert r.exit_code == 2, (cmd, r.stdout)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "dcp_size = 60000" in lines[0] and "limits.md" in lines[0], lines
    assert not (tmp_path / "r.html").exists()


def split_dump(path) -> str:
    """Two full batches of 3 requests (3 and 5 tokens) with query_start_loc: something to re-split."""
    c = columns(2, rows=3, wrong=False)
    c["obs.qsl"] = np.array([0, 4, 8], np.int64)
    c["rows.query_start_loc"] = np.array([0, 1, 2, 3, 0, 2, 4, 5], np.int32)
    write_dump(path, DumpConfig(dcp_size=1, sites=("a",)), c)
    return str(path)


def test_absurd_split_is_refused_before_any_work(tmp_path):
    """--split 10**9 ran out of memory after 2.5 GB; --split 100000 built 10**5 micro-batches per batch."""
    p = split_dump(tmp_path / "d.safetensors")
    res = cli_guarded({k: ["replay", p, "--split", str(v), "--backend", "torch"]
                       for k, v in [("1e9", 10**9), ("1e5", 100_000), ("cap+1", MAX_SPLIT + 1)]})
    for k in ("1e9", "1e5", "cap+1"):
        assert res[k]["code"] == 2 and res[k]["exc"] is None, res[k]
        assert len(res[k]["err"].splitlines()) == 1 and f"at most {MAX_SPLIT}" in res[k]["err"]


def test_split_past_the_largest_batch_is_refused(tmp_path):
    """Within the cap, K above every batch's token count splits nothing real: exit 2, naming the largest."""
    p = split_dump(tmp_path / "d.safetensors")
    r = runner.invoke(app, ["replay", p, "--split", "6", "--backend", "torch"])
    assert r.exit_code == 2 and r.stderr.strip() == ("dcptool replay: --split: 6: more micro-batches than tokens; the "
                                                     "largest batch to split has 5")
    r = runner.invoke(app, ["replay", p, "--split", "5", "--backend", "torch", "--json"])
    assert r.exit_code == 0 and sum('"type": "split"' in line for line in r.stdout.splitlines()) == 10


# --------------------------------------------------------------------------------------------
# Correct output at bounded cost


def test_timeline_over_many_ranks_and_micro_batch_values(tmp_path):
    """2,000 distinct (rank, micro-batch) pairs in a 100 kB file: the timeline was rows x columns x micro-batch
    values (2,000 x 240 x 2,000 cells: gigabytes). Rows with findings are drawn first, at most 256."""
    p = tmp_path / "t.safetensors"
    n = 2000
    c = columns(n)
    c["obs.rank"] = (np.arange(n) % MAX_DCP_SIZE).astype(np.int32)
    c["obs.ubatch"] = np.arange(n, dtype=np.int32)
    c["obs.step"] = np.arange(n, dtype=np.int64)
    c["obs.has_dcp"][: n // 2] = 0  # half `missing`, half wrong: every row has findings
    c["obs.dcp_rows"] = np.concatenate([np.zeros(n // 2, np.int64), np.arange(n // 2 + 1, dtype=np.int64)])
    c["rows.dcp_local_seq_lens"] = c["rows.dcp_local_seq_lens"][: n // 2]
    write_dump(p, DumpConfig(dcp_size=MAX_DCP_SIZE, sites=("a",)), c)
    assert p.stat().st_size < 150_000
    html = tmp_path / "t.html"
    res = guarded(f"""
import json, io
from rich.console import Console
from dcptool.dump import open_dumps
from dcptool.check.replay import replay
from dcptool.report.text import render_replay
from dcptool.report.timeline import timeline
from dcptool.report.html import render_html
res = replay(open_dumps([{str(p)!r}]), "torch", views=200)
tl = timeline(res, 240)
buf = io.StringIO()
render_replay(res, Console(file=buf, width=200))
page = render_html(res)
open({str(html)!r}, "w").write(page)
print(json.dumps({{"cells": int(tl.ub_obs.size), "rows": len(tl.ranks), "hidden": tl.hidden_rows,
                  "ubatches": len(tl.ubatches), "folded": tl.ub_folded, "findings": len(res.findings),
                  "ranks": tl.ranks[:3], "text": buf.getvalue()}}))
""")
    assert res["findings"] == n and res["rows"] == 256 and res["hidden"] == n - 256
    assert res["ubatches"] == 16 and res["folded"] and res["ranks"] == [0, 1, 2]
    assert res["cells"] <= 256 * 240 * 16
    assert f"{n - 256} more (site, rank) rows not drawn" in res["text"]
    page = html.read_text()
    assert len(page) < 5_000_000 and f"{n - 256:,} more (site, rank) rows not drawn" in page


def test_row_views_stay_within_a_budget(tmp_path):
    """dcp_size 4,096 and 400-row views: each view is 1.6 million expected-per-rank cells, and the HTML report
    built 200 of them (gigabytes; a 393 MB page at dcp_size 60,000). Views share one budget; a view shows 32
    rank columns around its own rank."""
    p = tmp_path / "v.safetensors"
    c = columns(300, rows=400)
    c["obs.rank"] = (np.arange(300) * 13 % MAX_DCP_SIZE).astype(np.int32)
    write_dump(p, DumpConfig(dcp_size=MAX_DCP_SIZE, sites=("a",)), c)
    html = tmp_path / "v.html"
    res = cli_guarded({"html": ["replay", str(p), "--backend", "torch", "--html", str(html)]})
    assert res["html"]["code"] == 1 and res["html"]["exc"] is None
    page = html.read_text()
    assert len(page) < 3_000_000
    assert page.count('<table class="rows">') == 1  # 1.6 M cells each: one fits the budget of 2 M
    assert "ranks 0..31 of 4096" in page and "<th>r31</th>" in page and "<th>r32</th>" not in page


def test_html_findings_table_is_capped_and_says_so(tmp_path):
    """10**6 findings made a 507 MB page; the table now holds the first 5,000 unless --max-findings says."""
    from dcptool.check.replay import replay
    from dcptool.dump import open_dumps
    from dcptool.report.html import HTML_MAX_FINDINGS, render_html

    p = tmp_path / "m.safetensors"
    n = 6000
    c = columns(n, wrong=False)
    c["obs.step"] = np.arange(n, dtype=np.int64)
    write_dump(p, DumpConfig(dcp_size=2, sites=("a",)), c)  # dcp_size 2 and no views: n `missing`
    html = tmp_path / "m.html"
    r = runner.invoke(app, ["replay", str(p), "--backend", "torch", "--html", str(html)])
    assert r.exit_code == 1
    page = html.read_text()
    assert page.count('<tr id="f') == HTML_MAX_FINDINGS == 5000 and len(page) < 5_000_000
    assert f"The first 5,000 of {n:,} findings" in page and f"Findings ({n:,})" in page
    res = replay(open_dumps([str(p)]), "torch")
    assert render_html(res, 5500).count('<tr id="f') == 5500  # --max-findings still decides when given


@pytest.mark.parametrize("cmd", ["diff", "replay"])
def test_tens_of_thousands_of_site_names(tmp_path, cmd):
    """50,000 site names, listed in opposite orders by two files: merging the lists was quadratic (over 60 s of
    CPU). The CPU guard is far above the linear cost and far below the quadratic one."""
    n = 50_000
    names = tuple(f"site{k}" for k in range(n))
    c = columns(n, wrong=False)
    c["obs.site"] = np.arange(n, dtype=np.int32)
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    write_dump(a, DumpConfig(dcp_size=1, sites=names), c)
    c["obs.site"] = c["obs.site"][::-1].copy()
    write_dump(b, DumpConfig(dcp_size=1, sites=names[::-1]), c)  # the same observations, sites renumbered
    args = ["diff", str(a), str(b)] if cmd == "diff" else ["replay", str(a), str(b), "--backend", "torch"]
    res = cli_guarded({cmd: args}, cpu_s=25)
    assert res[cmd]["code"] == 0 and res[cmd]["exc"] is None, res[cmd]


def test_obs_row_view_of_a_wide_layout_shows_a_window_of_ranks(tmp_path):
    """`--obs` on 1,000 rows at dcp_size 4,096 (4.1 million cells, inside the --obs limit): the text table laid
    out 4,096 rank columns with rich (gigabytes, minutes). It shows 32 around the observation's rank."""
    p = tmp_path / "w.safetensors"
    c = columns(1, rows=1000)
    c["obs.rank"][:] = 2000
    write_dump(p, DumpConfig(dcp_size=MAX_DCP_SIZE, sites=("a",)), c)
    res = guarded(f"""
import json
from typer.testing import CliRunner
from dcptool.cli import app
from rich.console import Console
import io
from dcptool.dump import open_dumps
from dcptool.check.replay import replay
from dcptool.report.text import render_rows_view
r = CliRunner().invoke(app, ["replay", {str(p)!r}, "--obs", "0", "--backend", "torch"])
buf = io.StringIO()
render_rows_view(replay(open_dumps([{str(p)!r}]), "torch", obs=0).rows_view, Console(file=buf, width=400))
print(json.dumps({{"code": r.exit_code, "out": r.stdout, "wide": buf.getvalue()}}))
""")
    assert res["code"] == 1 and "of 4096 shown; --json has every rank" in res["out"]
    assert len(res["out"]) < 1_000_000
    wide = res["wide"]  # 400 columns: the full window of 32
    assert "ranks 1984..2015 of 4096 shown" in wide and "r2000*" in wide and "r2016" not in wide
