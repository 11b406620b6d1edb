"""The CLI as a user runs it: exit codes 0/1/2, JSON Lines, one-line errors. In this process through typer's
CliRunner (conftest.cli); real processes (conftest.cli_subprocess) for a smoke test per command and where a
process is what is tested: pipes, signals, /dev/full, what `--help` imports."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import HOSTILE, ROOT, cli, cli_subprocess, expected_view, hostile_dump, obs, write


def handwritten_dump(path) -> str:
    """A dump written with the safetensors library alone, from docs/format.md: None at observation 3,
    a -1 in a padded row at observation 5, everything else right."""
    from safetensors.numpy import save_file

    n, N = 8, 2
    seq = np.tile(np.array([17, 25, 0, 0], np.int32), n)
    views = [None if i == 3 else expected_view([17, 25], 2, 4, N, i % N) for i in range(n)]
    views[5][3] = -1
    dcp = [v for v in views if v is not None]
    tensors = {
        "obs.step": np.arange(n, dtype=np.int64),
        "obs.site": np.zeros(n, np.int32),
        "obs.rank": (np.arange(n) % N).astype(np.int32),
        "obs.ubatch": np.full(n, -1, np.int32),
        "obs.num_reqs": np.full(n, 2, np.int32),
        "obs.num_reqs_padded": np.full(n, 4, np.int32),
        "obs.rows": np.arange(0, 4 * n + 1, 4, dtype=np.int64),
        "obs.has_dcp": np.array([v is not None for v in views], np.uint8),
        "obs.dcp_rows": np.concatenate([[0], np.cumsum([0 if v is None else 4 for v in views])]).astype(np.int64),
        "rows.seq_lens": seq,
        "rows.dcp_local_seq_lens": np.concatenate(dcp).astype(np.int32),
    }
    meta = {"dcptool.format": "1",
            "dcptool.config": json.dumps({"dcp_size": N, "cp_interleave": 1, "sites": ["attn_metadata"]})}
    save_file(tensors, str(path), metadata=meta)
    return str(path)


def test_done_criterion_missing_then_padding(tmp_path):
    p = handwritten_dump(tmp_path / "hand.safetensors")
    r = cli_subprocess("replay", p, "--json")  # smoke: replay with findings, a real process
    assert r.returncode == 1, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [(x["obs"], x["rule"]) for x in lines if x["type"] == "finding"] == [(3, "missing"), (5, "padding")]
    summary = lines[-1]
    assert summary["type"] == "summary" and summary["first"]["rule"] == "missing" and summary["first"]["obs"] == 3
    assert summary["findings"] == 2 and summary["by_rule"] == {"missing": 1, "padding": 1}
    assert lines[0]["row"] is None and lines[0]["source"] is None and lines[1]["row"] == 3
    text = cli("replay", p)
    assert text.returncode == 1 and "missing" in text.stdout and "padding" in text.stdout
    tail = text.stdout[text.stdout.rindex("first finding:"):]  # the first finding comes last
    assert f"{p}:3 missing" in tail and "padding" not in tail


def test_clean_dump_exits_0(tmp_path):
    r = cli_subprocess("replay", write(tmp_path / "c.safetensors", [obs(step=i) for i in range(3)]))  # smoke
    assert r.returncode == 0 and "clean" in r.stdout and r.stderr == ""


def test_warnings_exit_0_unless_strict(tmp_path):
    p = write(tmp_path / "s.safetensors", [obs(dcp=1, view=[17, 25, 0, 0])], dcp=1)
    assert cli("replay", p).returncode == 0
    assert cli("replay", p, "--strict").returncode == 1


@pytest.mark.parametrize("args,needle,one_line", [
    (["replay", "MISSING.safetensors"], "MISSING.safetensors: cannot read", True),
    (["replay", "DIR"], "directory holds no *.safetensors dump", True),  # a directory is its dumps
    (["replay", "GARBAGE"], "GARBAGE: not a safetensors file", True),
    (["inspect", "GARBAGE"], "GARBAGE: not a safetensors file", True),
    (["replay", "GOOD", "--obs", "99"], "has no observation 99", True),
    (["replay", "GOOD", "--obs", "x"], "--obs", True),
    (["replay", "GOOD", "--backend", "cuda"], "--backend", True),
    (["replay", "GOOD", "--split", "0"], "--split", True),  # usage errors: one line too (Hardening III item 2)
    (["replay"], "DUMP: missing", True),
    (["nonsense"], "no such command", True),
])
def test_bad_input_exit_2_one_line_no_traceback(tmp_path, args, needle, one_line):
    garbage = tmp_path / "GARBAGE"
    garbage.write_bytes(b"\x00" * 7)
    good = write(tmp_path / "GOOD", [obs()])
    sub = {"DIR": str(tmp_path), "GARBAGE": str(garbage), "GOOD": good,
           "MISSING.safetensors": str(tmp_path / "MISSING.safetensors")}
    r = cli(*[sub.get(a, a) for a in args])
    assert r.returncode == 2 and r.stdout == ""
    assert "Traceback" not in r.stderr and needle in r.stderr
    if one_line:
        assert len(r.stderr.strip().splitlines()) == 1 and re.match(r"dcptool( [a-z-]+)?: ", r.stderr)


def test_obs_and_split_views(tmp_path):
    from conftest import worked_example

    p = write(tmp_path / "w.safetensors", worked_example(True))
    r = cli("replay", p, "--obs", "1", "--json")
    rows = [json.loads(x) for x in r.stdout.splitlines() if '"type": "rows"' in x]
    assert rows and rows[0]["verdict"] == ["ok", "ok", "WRONG"] and rows[0]["expected_all_ranks"][2] == [254, 253]
    r = cli("replay", p, "--split", "2", "--json")
    splits = [json.loads(x) for x in r.stdout.splitlines() if '"type": "split"' in x]
    assert [(s["parent_obs"], s["ubatch"], s["seq_lens"], s["dcp_local_seq_lens"]) for s in splits] == [
        (0, 0, [64, 96, 507], [32, 48, 254]), (0, 1, [512, 32, 48], [256, 16, 24])]
    t = cli("replay", p, "--split", "2", "--obs", f"{p}:1")
    assert t.returncode == 1 and "507" in t.stdout and "WRONG" in t.stdout


def test_max_findings_limits_output_not_counts(tmp_path):
    p = write(tmp_path / "m.safetensors", [obs(step=i, view=None) for i in range(10)])
    r = cli("replay", p, "--json", "--max-findings", "3")
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    lines = [x for x in lines if x["type"] != "problem"]  # (problem objects reference all 10)
    assert len(lines) == 4 and lines[-1]["findings"] == 10


def _interpreter_broken() -> bool:
    """The triton and numpy pair whose interpreter cannot run a loop bounded by a loaded value (seen on the GPU
    machine's image: triton 3.6, numpy 2.5). (Versions from the metadata: importing triton here would decide the
    interpreter for this process.)"""
    from importlib.metadata import version

    return version("triton").startswith("3.6.") and np.__version__.startswith("2.5.")


def test_a_failing_interpreter_is_one_line_naming_what_to_use(tmp_path):
    """Triton's interpreter failing inside a kernel (some triton and numpy pairs) is said in one line with the
    versions and --backend torch, exit 2, never "internal error": the real InterpreterError, raised where the scan
    runs, in a process of its own (TRITON_INTERPRET=1 before triton is imported)."""
    p = write(tmp_path / "t.safetensors", [obs(step=i) for i in range(3)])
    code = ("import sys\nfrom triton.runtime.interpreter import InterpreterError\nfrom dcptool.check import scan\n"
            "def broken(*a, **k):\n"
            "    raise InterpreterError(\"TypeError('only 0-dimensional arrays can be converted')\")\n"
            "scan.scan = broken\nsys.argv = ['dcptool', 'replay', sys.argv[1], '--backend', 'triton']\n"
            "from dcptool.cli import main\nmain()")
    r = subprocess.run([sys.executable, "-c", code, p], capture_output=True, text=True,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert (r.returncode, r.stdout, r.stderr.count("\n")) == (2, "", 1), r.stderr
    assert r.stderr.startswith("dcptool replay: --backend triton: Triton's interpreter failed here (triton ") and \
        r.stderr.rstrip().endswith("use --backend torch (the same checks on the CPU)"), r.stderr


@pytest.mark.parametrize("interpret", ["", "0", "1"])
def test_triton_backend_without_gpu_is_refused_unless_the_interpreter_is_asked_for(tmp_path, interpret):
    """--backend triton without a GPU would run Triton's interpreter, ~100x slower than torch: one line saying what to
    use instead, exit 2; TRITON_INTERPRET=1 (the interpreter asked for by name) runs it. On a GPU it just runs."""
    from dcptool.gpu import cuda

    p = write(tmp_path / "t.safetensors", [obs(step=i) for i in range(3)] + [obs(step=3, view=[9, 14, 0, 0])])
    # (the interpreter asked for: a fresh process, as a user's; Triton decides it once per process, and a test before
    # this one in the same worker may have imported triton without it)
    run = cli_subprocess if interpret == "1" else cli
    r = run("replay", p, "--backend", "triton", "--json", env={"TRITON_INTERPRET": interpret})
    if not cuda.available() and interpret != "1":
        assert (r.returncode, r.stdout) == (2, "") and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith("dcptool replay: --backend: triton: no GPU here") and "--backend torch" in r.stderr
        return
    if interpret == "1" and _interpreter_broken():
        # triton 3.6's interpreter under numpy 2.5 (the GPU machine's image) cannot run the kernels: one line, exit 2
        assert (r.returncode, r.stdout, r.stderr.count("\n")) == (2, "", 1), r.stderr
        assert r.stderr.startswith("dcptool replay: --backend triton: Triton's interpreter failed here"), r.stderr
        return
    summary = json.loads(r.stdout.splitlines()[-1])
    assert r.returncode == 1 and summary["backend"] == "triton" and summary["by_rule"] == {"mismatch": 1}
    assert summary["device"] == ("cuda" if cuda.available() else "cpu (Triton interpreter)")
    for other in ("torch", "auto"):  # never refused
        assert cli("replay", p, "--backend", other, env={"TRITON_INTERPRET": interpret}).returncode == 1


def test_inspect(tmp_path):
    p = write(tmp_path / "i.safetensors", [obs(step=i, rank=i % 2, view=None if i == 2 else "auto") for i in range(6)],
              page_size=16)
    r = cli("inspect", p, "--json")
    info = json.loads(r.stdout)
    assert r.returncode == 0 and info["observations"] == 6 and info["without_view"] == 1
    assert info["config"]["page_size"] == 16 and info["ranks"] == {"0": 3, "1": 3}
    t = cli_subprocess("inspect", p)  # smoke: inspect, a real process
    assert t.returncode == 0 and t.stderr == ""
    assert "dcp_size 2" in t.stdout and "6 (5 with a DCP view, 1 None)" in t.stdout


def test_library_error_is_one_line_exit_2(tmp_path, monkeypatch):
    """cli.py catches DcptoolError in one place: one line on stderr, exit 2, whatever raised it."""
    import dcptool.check.replay
    from dcptool.check.replay import LimitError

    def boom(*a, **k):
        raise LimitError("somewhere deep: past a documented limit")

    monkeypatch.setattr(dcptool.check.replay, "replay", boom)
    r = cli("replay", write(tmp_path / "d.safetensors", [obs()]))
    assert r.returncode == 2 and r.stderr == "dcptool: somewhere deep: past a documented limit\n" and r.stdout == ""


def test_replay_and_inspect_take_a_directory(tmp_path):
    import os

    from typer.testing import CliRunner

    from dcptool.cli import app

    d = tmp_path / "rec"
    d.mkdir()
    for k in (10, 9, 2):  # natural order: 2, 9, 10 (a plain sort would put 10 first)
        write(d / f"rank0.{k}.safetensors", [obs(step=k, view=None if k == 9 else "auto")])
    (d / "notes.txt").write_text("not a dump")
    runner = CliRunner()
    r = runner.invoke(app, ["replay", str(d), "--json"])
    s = json.loads(r.stdout.splitlines()[-1])
    assert r.exit_code == 1 and s["observations"] == 3 and s["by_rule"] == {"missing": 1}
    assert [os.path.basename(f) for f in s["files"]] == ["rank0.2.safetensors", "rank0.9.safetensors",
                                                         "rank0.10.safetensors"]
    r = runner.invoke(app, ["inspect", str(d), "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["observations"] == 3
    empty = tmp_path / "empty"
    empty.mkdir()
    for cmd in ("replay", "inspect"):
        r = runner.invoke(app, [cmd, str(empty)])
        assert r.exit_code == 2 and r.stderr == f"dcptool: {empty}: directory holds no *.safetensors dump\n"


def test_help_and_module_entry():
    """`python -m dcptool --help` (a real process) lists the commands and imports neither numpy nor torch."""
    r = cli_subprocess("--help", env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert r.returncode == 0 and "replay" in r.stdout and "inspect" in r.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "dcptool.cli" in imported  # the import log is there: it would name numpy and torch
    assert not {m for m in imported if m.split(".")[0] in ("numpy", "torch", "triton", "safetensors")}, imported
    r = cli("--help")  # in-process: the same page (under the name `dcptool`)
    assert r.returncode == 0 and "Usage: dcptool" in r.stdout and "replay" in r.stdout and "simulate" in r.stdout


@pytest.mark.parametrize("args", [["replay", "legacy.safetensors"], ["replay", "legacy.safetensors", "--json"],
                                  ["inspect", "legacy.safetensors"],
                                  ["diff", "legacy.safetensors", "fixed.safetensors"]])
def test_cpu_commands_never_import_torch(args):
    """A replay of a dump under scan.GPU_MIN_OBS observations (auto: the numpy path, shape findings included),
    inspect and diff run without importing torch (1.5 s of start-up here): a real process, the import log read."""
    r = cli_subprocess(*[str(SAMPLES / a) if a.endswith(".safetensors") else a for a in args],
                       env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert r.returncode in (0, 1) and r.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "numpy" in imported  # the log is there
    assert not {m for m in imported if m.split(".")[0] in ("torch", "triton")}, args


# --------------------------------------------------------------------------------------------
# conftest.cli itself: in-process runs see what a process of their own would


def test_in_process_cli_shows_warnings_crashes_and_restores_the_process(tmp_path, monkeypatch):
    import os
    import warnings

    dump = write(tmp_path / "d.safetensors", [obs()])

    def warns(*a, **k):
        warnings.warn("overflow encountered", RuntimeWarning, stacklevel=1)
        raise RuntimeError("after the warning")

    monkeypatch.setattr("dcptool.dump.describe", warns)
    here = os.getcwd()
    r = cli("inspect", "d.safetensors", env={"DCPTOOL_PROBE": "1"}, cwd=tmp_path)
    # the warning reaches stderr (not pytest's record), then the guard's one line
    assert r.returncode == 2 and "RuntimeWarning: overflow encountered" in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1].startswith("dcptool: internal error: RuntimeError: after the warning")
    assert os.getcwd() == here and "DCPTOOL_PROBE" not in os.environ and dump

    import dcptool.cli as dcli
    from dcptool.exits import Guarded

    monkeypatch.setattr(Guarded, "main", lambda *a, **k: 1 / 0)  # past the guard: what a process shows
    r = cli("--help")
    assert r.returncode == 1 and "Traceback" in r.stderr and "ZeroDivisionError" in r.stderr
    assert sys.stdout is not None and dcli.app.__class__.__name__ == "Typer"


def test_reading_never_modifies_the_dump(tmp_path):
    p = handwritten_dump(tmp_path / "hand.safetensors")
    before = open(p, "rb").read()
    cli("replay", p)
    cli("inspect", p)
    assert open(p, "rb").read() == before


def test_docs_format_examples_write_dumps_replay_reads(tmp_path):
    """docs/format.md's two examples, run as written, give the dump the text promises."""
    import re

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "format.md").read_text(), re.S)
    assert len(blocks) == 2
    for k, code in enumerate(blocks):
        d = tmp_path / str(k)
        d.mkdir()
        subprocess.run([sys.executable, "-c", code], cwd=d, check=True, env={"PYTHONPATH": str(ROOT)})
        r = cli("replay", d / "run.safetensors", "--json")
        found = [o for o in map(json.loads, r.stdout.splitlines()) if o["type"] == "finding"]
        assert r.returncode == 1 and [(f["obs"], f["rule"]) for f in found] == [(1, "missing")]


# --------------------------------------------------------------------------------------------
# Exit codes never lie: one guard around every command (in-process through CliRunner, as the fuzz suite runs it)

SAMPLES = ROOT / "samples"


def run_cli(*args, env=None):
    """`dcptool ARGS` in this process (conftest.cli), DCPTOOL_DEBUG unset; (exit code, stdout, stderr)."""
    r = cli(*args, env={"DCPTOOL_DEBUG": "", **(env or {})})
    return r.returncode, r.stdout, r.stderr


def _boom(*a, **k):
    raise RuntimeError("something\nunexpected")


@pytest.mark.parametrize("args,target", [
    (["replay", "DUMP"], "dcptool.check.replay.replay"),
    (["replay", "DUMP", "--json"], "dcptool.report.text.replay_json_text"),
    (["diff", "DUMP", "DUMP"], "dcptool.diagnose.diff.diff"),
    (["inspect", "DUMP"], "dcptool.dump.describe"),
    (["inspect", "DUMP"], "dcptool.report.text.render_inspect"),
    (["simulate", "--steps", "2", "-o", "OUT"], "dcptool.model.simulate.simulate"),
    (["simulate", "--steps", "2"], "dcptool.model.simulate.compare"),
])
def test_an_unexpected_exception_is_exit_2_and_one_line(tmp_path, monkeypatch, args, target):
    dump = write(tmp_path / "d.safetensors", [obs(step=i) for i in range(3)])
    module, name = target.rsplit(".", 1)
    monkeypatch.setattr(__import__(module, fromlist=[name]), name, _boom)
    args = [{"DUMP": dump, "OUT": tmp_path / "o.safetensors"}.get(a, a) for a in args]
    code, out, err = run_cli(*args)
    assert code == 2, (code, out, err)  # never 1: CI reads 1 as "findings"
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("dcptool: internal error: RuntimeError: something unexpected (please report this at ")
    assert err.endswith("; rerun with --debug or DCPTOOL_DEBUG=1 for the traceback)\n")
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("how", ["--debug", "DCPTOOL_DEBUG=1"])
def test_debug_shows_the_traceback(tmp_path, monkeypatch, how):
    dump = write(tmp_path / "d.safetensors", [obs()])
    monkeypatch.setattr("dcptool.dump.describe", _boom)
    args, env = (["--debug"], {}) if how == "--debug" else ([], {"DCPTOOL_DEBUG": "1"})
    code, out, err = run_cli(*args, "inspect", dump, env=env)
    assert code == 2 and "Traceback (most recent call last)" in err and "_boom" in err
    assert err.splitlines()[-1].startswith("dcptool: internal error: RuntimeError: something unexpected")


@pytest.mark.parametrize("debug", ["", "1"])
def test_internal_error_in_a_real_process(tmp_path, debug):
    """Smoke: the guard in a process of its own (DCPTOOL_DEBUG from its environment): exit 2, one line, and
    the traceback only with DCPTOOL_DEBUG=1; nothing printed at exit."""
    dump = write(tmp_path / "d.safetensors", [obs()])
    code = ("import sys, dcptool.dump\n"
            "def boom(*a, **k):\n    raise RuntimeError('something unexpected')\n"
            "dcptool.dump.describe = boom\n"
            "from dcptool.cli import main\n"
            "sys.argv = ['dcptool', 'inspect', sys.argv[1]]\n"
            "main()\n")
    import os

    p = subprocess.run([sys.executable, "-c", code, dump], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "DCPTOOL_DEBUG": debug})
    assert p.returncode == 2 and p.stdout == "", p.stderr
    assert p.stderr.splitlines()[-1].startswith("dcptool: internal error: RuntimeError: something unexpected")
    assert ("Traceback (most recent call last)" in p.stderr) == bool(debug), p.stderr
    if not debug:
        assert p.stderr.count("\n") == 1


def test_the_guard_keeps_real_exit_codes(tmp_path, monkeypatch):
    clean = write(tmp_path / "c.safetensors", [obs(step=i) for i in range(3)])
    bad = write(tmp_path / "b.safetensors", [obs(view=None)])
    assert run_cli("replay", clean)[0] == 0 and run_cli("replay", bad)[0] == 1 and run_cli("inspect", bad)[0] == 0
    assert run_cli("diff", clean, clean)[0] == 0 and run_cli("diff", clean, bad)[0] == 1
    code, _, err = run_cli("replay", clean, "--split", "0")  # usage errors: still click's, exit 2
    assert code == 2 and "--split" in err and "internal error" not in err
    assert run_cli("replay")[0] == 2 and run_cli("nonsense")[0] == 2
    code, _, err = run_cli("replay", tmp_path / "missing.safetensors")  # bad input: our one line
    assert code == 2 and err.startswith("dcptool: ") and "internal error" not in err

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("dcptool.check.replay.replay", interrupted)
    code, _, err = run_cli("replay", clean)
    assert code == 130 and err == "dcptool: interrupted\n"  # click would say "Aborted!" and exit 1


def _closed_reader(args) -> subprocess.CompletedProcess:
    """Run dcptool with a stdout pipe whose reader is already gone (`| head` that has had its line)."""
    import os

    r, w = os.pipe()
    os.close(r)
    p = subprocess.run([sys.executable, "-m", "dcptool", *map(str, args)], stdout=w, stderr=subprocess.PIPE,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    os.close(w)
    return p


@pytest.mark.parametrize("args,code", [
    (["replay", SAMPLES / "fixed.safetensors"], 0),
    (["replay", SAMPLES / "fixed.safetensors", "--json"], 0),
    (["replay", SAMPLES / "legacy.safetensors", "--max-findings", "5"], 1),
    (["diff", SAMPLES / "fixed.safetensors", SAMPLES / "fixed.safetensors"], 0),
    (["inspect", SAMPLES / "legacy.safetensors"], 0),
])
def test_broken_pipe_keeps_the_exit_code_of_what_was_found(args, code):
    p = _closed_reader(args)
    assert p.returncode == code, p.stderr
    assert p.stderr == ""  # no traceback, no "Exception ignored ... BrokenPipeError"


def test_head_reads_one_line_and_the_exit_code_is_the_verdict():
    p = subprocess.run(f"{sys.executable} -m dcptool replay {SAMPLES / 'legacy.safetensors'} --max-findings 2000 "
                       "| head -1; exit ${PIPESTATUS[0]}", shell=True, executable="/bin/bash", capture_output=True,
                       text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert p.returncode == 1 and p.stdout.startswith("Problems") and p.stderr == ""


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["replay", SAMPLES / "fixed.safetensors"],
                                  ["replay", SAMPLES / "legacy.safetensors", "--json"],
                                  ["inspect", SAMPLES / "legacy.safetensors", "--json"]])
def test_a_failing_stdout_is_exit_2_one_line(args):
    import os

    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-m", "dcptool", *map(str, args)], stdout=full, stderr=subprocess.PIPE,
                           text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert p.returncode == 2
    assert p.stderr == "dcptool: cannot write to standard output: No space left on device\n"


def test_text_output_to_a_pipe_does_not_depend_on_columns():
    # the sample has 48 `missing` findings: each on one line, whatever $COLUMNS says (was: 0 at 80 columns)
    outs = []
    for columns in ("20", "80", "400"):
        code, out, _ = run_cli("replay", SAMPLES / "legacy.safetensors", "--max-findings", "2000",
                               env={"COLUMNS": columns})
        assert code == 1
        assert sum("NoneType" in line for line in out.splitlines()) == 48
        assert not [line for line in out.splitlines() if line != line.rstrip()]  # no trailing padding
        outs.append(re.sub(r"\d+\.\d\d s", "T s", out))
    assert outs[0] == outs[1] == outs[2]


# --------------------------------------------------------------------------------------------
# Strings from files render literally: no rich markup, no terminal escapes

RAW = ("\x1b[2J", "\x1b]", "\x07", "\r")  # what must never reach a terminal from a file


def assert_literal(text: str, names: bool = True) -> None:
    for raw in RAW:
        assert raw not in text, (raw, text)
    if not names:
        return
    assert "[/bold][link=https://example.invalid]L[/link][red]R[/]" in text  # markup shown, not applied
    assert "\\x1b[2J\\x1b]8;;https://example.invalid\\x07X" in text and "\\x0dCR" in text


def test_hostile_names_render_literally_in_every_text_report(tmp_path):
    name = "run [red]x[bold] \x1b]0;t\x07.safetensors"  # and a hostile file name (no slash: one file)
    p = hostile_dump(tmp_path / name)
    q = hostile_dump(tmp_path / "other.safetensors", none_step=2)
    for args, code in ((["inspect", p], 0), (["replay", p], 1), (["replay", p, "--obs", "2"], 1),
                       (["replay", p, "--max-findings", "0"], 1), (["diff", p, q], 1), (["diff", p, p], 0)):
        rc, out, err = run_cli(*args)
        assert rc == code, (args, rc, out, err)
        assert_literal(out, names=args[1:] != [p, p])  # diff of a file with itself names no site
        assert "run [red]x[bold] \\x1b]0;t\\x07.safetensors" in out
    rc, out, err = run_cli("inspect", p, "--json")  # JSON keeps the strings exactly (json escapes them)
    assert rc == 0 and json.loads(out)["config"]["note"] == HOSTILE


def test_hostile_output_name_renders_literally_in_simulate(tmp_path):
    out = tmp_path / "o [bold]x \x1b[2J\x07.safetensors"
    rc, text, err = run_cli("simulate", "--steps", "2", "-o", out)
    assert rc == 0 and out.exists(), err
    assert "o [bold]x \\x1b[2J\\x07.safetensors" in text and "\x1b" not in text and "\x07" not in text


# --------------------------------------------------------------------------------------------
# Writes that cannot destroy: only a regular file (or an absent path) is ever replaced


def _targets(tmp_path):
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "dir").mkdir()
    (tmp_path / "to-fifo").symlink_to(fifo)
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    r, w = os.pipe()
    return {"fifo": fifo, "dir": tmp_path / "dir", "to-fifo": tmp_path / "to-fifo",
            "dangling": tmp_path / "dangling", "proc-fd": Path(f"/proc/self/fd/{w}")}, (r, w)


def _kind(p: Path) -> str:
    import stat

    st = p.lstat()
    return "link" if stat.S_ISLNK(st.st_mode) else "fifo" if stat.S_ISFIFO(st.st_mode) else \
        "dir" if stat.S_ISDIR(st.st_mode) else "file"


@pytest.mark.parametrize("which", ["fifo", "dir", "to-fifo", "dangling", "proc-fd"])
@pytest.mark.parametrize("command", ["html", "simulate"])
def test_writes_refuse_anything_but_a_regular_file(tmp_path, which, command):
    import os

    targets, fds = _targets(tmp_path)
    target = targets[which]
    dump = write(tmp_path / "d.safetensors", [obs()])
    before = _kind(target) if which != "proc-fd" else None
    try:
        if command == "html":
            rc, out, err = run_cli("replay", dump, "--html", target, "--force")
        else:
            rc, out, err = run_cli("simulate", "--steps", "2", "-o", target, "--force")
        if which == "proc-fd":
            assert os.fstat(fds[1]) and not os.path.exists(f"/proc/self/fd/{fds[1]}.html")
    finally:
        os.close(fds[0])
        os.close(fds[1])
    option = "--html" if command == "html" else "-o"
    assert rc == 2 and out == "" and err.count("\n") == 1, (rc, out, err)
    assert err.startswith(f"dcptool {'replay' if command == 'html' else 'simulate'}: {option}: "), err
    assert "not a regular file" in err or "symbolic link to nothing" in err
    if before is not None:
        assert _kind(target) == before  # still a FIFO, a directory, a link
    assert not [x for x in tmp_path.rglob(".*.tmp")]


def test_a_link_to_a_regular_file_is_replaced_itself_and_its_target_never_written(tmp_path):
    """Hardening III item 4 (was: the file it points to was replaced and the link kept)."""
    dump = write(tmp_path / "d.safetensors", [obs(view=None)])
    real = tmp_path / "real.html"
    real.write_text("old")
    link = tmp_path / "link.html"
    link.symlink_to(real)
    rc, _, err = run_cli("replay", dump, "--html", link)
    assert rc == 2 and "exists (use --force" in err
    rc, _, err = run_cli("replay", dump, "--html", link, "--force")
    assert rc == 1 and err == f"dcptool: wrote {link}\n"
    assert not link.is_symlink() and link.read_text().startswith("<!DOCTYPE html>") and real.read_text() == "old"


def _linked(tmp_path, name: str) -> tuple[Path, Path]:
    """`name` in tmp_path: a symbolic link to a file of another directory (what must never be written)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    target = elsewhere / f"{name}.target"
    target.write_bytes(b"not dcptool's to write")
    link = tmp_path / name
    link.symlink_to(target)
    return link, target


@pytest.mark.parametrize("command", ["replay --html", "simulate -o", "simulate -o --per-rank", "reduce -o",
                                     "export-test -o"])
def test_force_replaces_a_link_on_every_output_path_never_its_target(tmp_path, command):
    dump = str(SAMPLES / "legacy.safetensors")
    if command == "simulate -o --per-rank":  # sim.rank0.safetensors, sim.rank1.safetensors: each output path a link
        out = tmp_path / "sim.safetensors"
        links = [_linked(tmp_path, f"sim.rank{r}.safetensors") for r in range(2)]
        args = ["simulate", "--steps", "2", "-o", out, "--per-rank", "--force"]
    else:
        out, target = _linked(tmp_path, "out")
        links = [(out, target)]
        args = {"replay --html": ["replay", dump, "--html", out, "--json"],
                "simulate -o": ["simulate", "--steps", "2", "-o", out],
                "reduce -o": ["reduce", dump, "--finding", "missing", "-o", out, "--max-seconds", "1"],
                "export-test -o": ["export-test", dump, "-o", out]}[command] + ["--force"]
    r = cli(*args)
    assert r.returncode in (0, 1) and "Traceback" not in r.stderr, r.stderr
    for link, target in links:
        assert target.read_bytes() == b"not dcptool's to write"  # the target is never written
        assert not link.is_symlink() and link.is_file() and link.stat().st_size > 100  # the link replaced by a file
    assert not list(tmp_path.rglob(".*.tmp"))


def test_atomic_write_refuses_special_files(tmp_path):
    import os

    from dcptool.dump import WriteError, atomic_write

    os.mkfifo(tmp_path / "f")
    with pytest.raises(WriteError, match="is a FIFO, not a regular file"):
        atomic_write(tmp_path / "f", [b"x"], force=True)
    atomic_write(tmp_path / "new", [b"x"], force=False)
    atomic_write(tmp_path / "new", [b"y"], force=True)
    assert (tmp_path / "new").read_bytes() == b"y" and _kind(tmp_path / "f") == "fifo"


def test_simulate_write_failure_is_one_line(tmp_path):
    # a name the filesystem cannot hold as a temporary (".NAME.xxxx.tmp" is over 255 bytes): the write fails
    out = tmp_path / ("n" * 250)
    p = cli("simulate", "--steps", "2", "-o", out)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith("dcptool: ") and "File name too long" in p.stderr
    assert "RuntimeWarning" not in p.stderr and "kept in memory" not in p.stderr and not out.exists()


def test_ctrl_c_during_simulate_writes_nothing(tmp_path):
    """SIGINT once simulate is in its loop (its progress bar is on a pseudo-terminal): exit 130, no file at
    the final path (a dump whose note says --steps 10**6 with a fraction of them), no temporary left."""
    import os
    import pty
    import select
    import signal
    import time

    out = tmp_path / "big.safetensors"
    master, slave = pty.openpty()
    # SIGINT as a terminal delivers it: a test run started in the background (`cmd &`, no job control) passes
    # SIGINT on ignored, and a child that ignores it would run all 10**6 steps while this test waited
    p = subprocess.Popen([sys.executable, "-m", "dcptool", "simulate", "--steps", "1000000", "-o", str(out)],
                         stdout=subprocess.PIPE, stderr=slave, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(slave)
    seen, deadline = b"", time.monotonic() + 120
    try:
        while b"simulate" not in seen and time.monotonic() < deadline:  # the bar shows after 1 s of work
            if select.select([master], [], [], 1.0)[0]:
                seen += os.read(master, 4096)
        assert b"simulate" in seen, "simulate never started"
        p.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 60
        while p.poll() is None and time.monotonic() < deadline:  # keep the terminal drained (the child never
            # blocks on stderr); past the deadline, wait() below fails the test instead of hanging it
            if select.select([master], [], [], 0.2)[0]:
                try:
                    seen += os.read(master, 4096)
                except OSError:
                    break
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)
    assert p.returncode == 130
    assert b"dcptool: interrupted" in seen and b"Traceback" not in seen
    assert list(tmp_path.iterdir()) == []  # nothing at the final path, no temporary


def test_error_lines_escape_what_a_path_holds(tmp_path):
    code, out, err = run_cli("replay", tmp_path / "no\x1b]0;title\x07such.safetensors")
    assert code == 2 and err.count("\n") == 1 and "\x1b" not in err and "\x07" not in err
    assert "no\\x1b]0;title\\x07such.safetensors" in err
    code, out, err = run_cli("replay", write(tmp_path / "d.safetensors", [obs()]), "--obs", "x\x1b[2J")
    assert code == 2 and "\x1b" not in err and "x\\x1b[2J" in err


# --------------------------------------------------------------------------------------------
# reduce and export-test (their behaviour: tests/diagnose/test_reduce.py, tests/diagnose/test_export.py)


def test_diagnosis_commands_are_listed_and_need_their_options(tmp_path):
    r = cli("--help")
    assert "reduce" in r.stdout and "export-test" in r.stdout
    h = cli("reduce", "--help")
    assert h.returncode == 0 and "--max-seconds" in h.stdout and "RULE@FILE:I" in h.stdout
    for args in (["reduce", SAMPLES / "legacy.safetensors", "-o", tmp_path / "o.safetensors"],
                 ["reduce", SAMPLES / "legacy.safetensors", "--finding", "missing"],
                 ["export-test", SAMPLES / "legacy.safetensors"],
                 ["reduce", tmp_path / "none.safetensors", "--finding", "missing", "-o", tmp_path / "o.safetensors"]):
        r = cli(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, args
    assert not (tmp_path / "o.safetensors").exists()


def test_reduce_refuses_to_write_over_its_input(tmp_path):
    import shutil

    dump = tmp_path / "legacy.safetensors"
    shutil.copy(SAMPLES / "legacy.safetensors", dump)
    before = dump.read_bytes()
    r = cli("reduce", dump, "--finding", "missing", "-o", dump, "--force")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "input" in r.stderr
    assert dump.read_bytes() == before


# --------------------------------------------------------------------------------------------
# Hardening III: the CLI as a newcomer meets it

COMMANDS = ("replay", "diff", "inspect", "simulate", "reduce", "export-test")


def test_version_names_dcptool_torch_triton_and_the_format():
    from importlib.metadata import version

    import dcptool
    from dcptool.dump import FORMAT_VERSION

    r = cli("--version")
    assert r.returncode == 0 and r.stderr == ""
    assert r.stdout.splitlines() == [f"dcptool {dcptool.__version__}", f"torch {version('torch')}",
                                     f"triton {version('triton')}", f"reads dump format {FORMAT_VERSION}"]
    assert "--version" in cli("--help").stdout


def test_version_in_a_real_process_imports_neither_torch_nor_triton():
    r = cli_subprocess("--version", env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert r.returncode == 0 and r.stdout.startswith("dcptool ") and len(r.stdout.splitlines()) == 4
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "dcptool.cli" in imported and not {m for m in imported if m.split(".")[0] in ("torch", "triton")}
    p = subprocess.run(f"{sys.executable} -m dcptool --version | head -1", shell=True, capture_output=True, text=True,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert p.stdout.startswith("dcptool ") and p.stderr == ""  # a reader that stops early: no traceback


# Per command: a bad option value, a missing argument (or an option's missing value, or a required option), an
# unknown option. GOOD is a dump, OUT a path to write.
USAGE = {
    "replay": [["replay", "GOOD", "--split", "x"], ["replay"], ["replay", "GOOD", "--bogus"],
               ["replay", "GOOD", "--obs"]],
    "diff": [["diff", "GOOD", "GOOD", "--max-findings", "-1"], ["diff", "GOOD"], ["diff", "GOOD", "GOOD", "-z"]],
    "inspect": [["inspect", "GOOD", "--json=yes"], ["inspect"], ["inspect", "GOOD", "--bogus"]],
    "simulate": [["simulate", "--steps", "many"], ["simulate", "--steps"], ["simulate", "--bogus", "1"]],
    "reduce": [["reduce", "GOOD", "--finding", "missing", "-o", "OUT", "--max-seconds", "0"],
               ["reduce", "GOOD", "-o", "OUT"], ["reduce", "--finding", "missing", "-o", "OUT"],
               ["reduce", "GOOD", "--finding", "missing", "-o", "OUT", "--bogus"]],
    "export-test": [["export-test", "GOOD", "-o", "OUT", "--max-cases", "0"], ["export-test", "GOOD"],
                    ["export-test", "GOOD", "-o", "OUT", "--bogus"]],
}


# click's and pydantic's phrasing (typer's conversions), which dcptool's own words replace
FOREIGN = ("Invalid value", "Input should", "Value error", "Usage:", "Try '", "Error", "Missing argument",
           "No such option", "requires an argument")


@pytest.mark.parametrize("args", [a for cmd in COMMANDS for a in USAGE[cmd]], ids=lambda a: " ".join(a))
def test_a_usage_error_is_one_line_naming_the_command_and_the_option(tmp_path, args):
    good = write(tmp_path / "good.safetensors", [obs(view=None)])
    args = [{"GOOD": good, "OUT": str(tmp_path / "out")}.get(a, a) for a in args]
    r = cli(*args)
    cmd = args[0]
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    assert re.fullmatch(rf"dcptool {cmd}: (-[a-z-]+|[A-Z]+): [a-z'].*\n", r.stderr), r.stderr
    assert not [w for w in FOREIGN if w in r.stderr] and not (tmp_path / "out").exists(), r.stderr


@pytest.mark.parametrize("args,line", [
    (["nonsense"], "dcptool: nonsense: no such command (the commands: replay, diff, inspect, simulate, reduce, "
                   "export-test)\n"),
    (["--bogus"], "dcptool: --bogus: no such option (see 'dcptool -h')\n"),
    (["replay", "x", "--backend"], "dcptool replay: --backend: needs a value\n"),
    (["replay", "x", "--backend", "gpu"], "dcptool replay: --backend: 'gpu': choose auto, triton or torch\n"),
    (["replay", "x", "--bogus"], "dcptool replay: --bogus: no such option; did you mean --obs? (see 'dcptool replay "
                                 "-h')\n"),
    (["replay"], "dcptool replay: DUMP: missing (see 'dcptool replay -h')\n"),
    (["replay", "x", "--max-findings", "-1"], "dcptool replay: --max-findings: must be >= 0, got -1\n"),
    (["replay", "x", "--split", "0"], "dcptool replay: --split: must be >= 1, got 0\n"),
    (["replay", "x", "--split", "two"], "dcptool replay: --split: expected an integer >= 1, got 'two'\n"),
    # the escape is never sent raw to the terminal
    (["replay", "x", "--split", "\x1b[31mred"], "dcptool replay: --split: expected an integer >= 1, got "
                                                "'\\x1b[31mred'\n"),
    (["inspect", "x", "--json=yes"], "dcptool inspect: --json: takes no value\n"),
    (["diff", "x", "y", "z"], "dcptool diff: z: unexpected extra argument (see 'dcptool diff -h')\n"),
    (["simulate", "--seed", "-3"], "dcptool simulate: --seed: must be >= 0, got -3\n"),
    (["simulate", "--dcp", "0"], "dcptool simulate: --dcp: must be >= 1, got 0\n"),
    (["simulate", "--per-rank"], "dcptool simulate: --per-rank: needs -o (it is a way of writing the dump)\n"),
    (["reduce", "x", "--finding", "missing", "-o", "y", "--max-seconds", "0"],
     "dcptool reduce: --max-seconds: must be a number >= 0.1, got 0\n"),
    (["export-test", "x"], "dcptool export-test: --output: required (see 'dcptool export-test -h')\n"),
])
def test_usage_error_lines(args, line):
    r = cli(*args)
    assert (r.returncode, r.stdout, r.stderr) == (2, "", line)


def test_a_usage_error_in_a_real_process_is_one_line():
    for args, cmd, line in ((["replay", "--split", "x", "d.safetensors"], "replay", "--split: expected an integer"),
                            (["simulate", "--dcp"], "simulate", "--dcp: needs a value")):
        r = cli_subprocess(*args)
        assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith(f"dcptool {cmd}: {line}"), r.stderr


def test_the_command_list_is_not_cut_on_80_columns():
    """`dcptool` alone lists every command with its whole one-line summary on an 80-column terminal."""
    page = cli("--help", env={"COLUMNS": "80"}).stdout
    listed = page[page.index("Commands:"):].splitlines()[1:]
    assert [x.split()[0] for x in listed if x.strip()] == list(COMMANDS)
    assert all(len(x) <= 80 and not x.endswith("...") for x in listed), listed


@pytest.mark.parametrize("cmd", ("",) + COMMANDS)
def test_h_is_help_everywhere(cmd):
    short, long = (cli(*[c for c in (cmd, flag) if c]) for flag in ("-h", "--help"))
    assert short.returncode == long.returncode == 0 and short.stdout == long.stdout and short.stderr == ""
    assert "-h, --help" in short.stdout


@pytest.mark.parametrize("cmd", ("",) + COMMANDS)
def test_help_is_still_click_s_page(cmd):
    r = cli(*[c for c in (cmd, "--help") if c])
    assert r.returncode == 0 and r.stderr == ""
    assert r.stdout.startswith(f"Usage: dcptool {cmd + ' ' if cmd else ''}[OPTIONS]") and "--help" in r.stdout
    assert "Options:" in r.stdout and "dcptool:" not in r.stdout


def _inject_help() -> str:
    page = cli("simulate", "--help", env={"COLUMNS": "100"}).stdout
    text = page[page.index("--inject") : page.index("--seed")]
    return " ".join(re.sub(r"-\n\s+", "-", text).split())  # click wraps after a hyphen: join the name again


def test_simulate_help_lists_exactly_the_fault_table():
    from dcptool.model.config import FAULT_WHERE, FAULTS

    listed = re.findall(r"([a-z][a-z-]+) \[([^\]]+)\]", _inject_help())
    assert [f for f, _ in listed] == list(FAULTS) and dict(listed) == FAULT_WHERE


def _rules_help() -> list[tuple[str, str]]:
    """replay --help's rule section as (name, its text with the wrapping undone)."""
    page = cli("replay", "--help", env={"COLUMNS": "100"}).stdout
    section = page[page.index("Rules (docs/replay.md#the-rules):"):].splitlines()[1:]
    rows: list[list[str]] = []
    for line in section:
        m = re.match(r"  (\S+)\s+(.*)", line)
        if m and not line.startswith("    "):
            rows.append([m[1], m[2]])
        else:
            rows[-1][1] += ("" if rows[-1][1].endswith("-") else " ") + line.strip()
    return [(name, text) for name, text in rows]


def test_replay_help_lists_the_rule_table(monkeypatch):
    """Every rule of the table, in its order, with its severity and what it catches; a rule added to the table is
    listed, one removed is not."""
    from dcptool.dcp import rules

    assert _rules_help() == [(r.name, f"{r.severity}: {r.what}") for r in rules.TABLE]
    new = rules.Rule("made-up", "warning", "Q", "values.check_made_up", "a rule only this test has")
    monkeypatch.setattr(rules, "TABLE", rules.TABLE[1:] + (new,))
    listed = _rules_help()
    assert [n for n, _ in listed] == [r.name for r in rules.TABLE] and listed[-1] == ("made-up", "warning: a rule "
                                                                                      "only this test has")


def test_docs_faults_lists_exactly_the_fault_table():
    from dcptool.model.config import FAULT_WHERE, FAULTS

    rows = re.findall(r"^\| `([a-z-]+)` \| ([^|]+?) \|", (ROOT / "docs" / "faults.md").read_text(), re.M)
    assert [f for f, _ in rows] == list(FAULTS) and dict(rows) == FAULT_WHERE


def _refused_alike(tmp_path) -> dict[str, str]:
    """Dumps replay refuses: a gap in the data section, a row value only the streamed read's row check sees."""
    import json
    import struct

    from conftest import with_gap

    good = write(tmp_path / "good.safetensors", [obs(step=s, rank=s % 2) for s in range(6)])
    bad_group = tmp_path / "slots.safetensors"  # simulate's recording (two KV-cache groups), one group index poked
    assert cli("simulate", "--steps", "2", "-o", bad_group).returncode == 0
    raw = bytearray(bad_group.read_bytes())
    (hlen,) = struct.unpack("<Q", raw[:8])
    at = 8 + hlen + json.loads(raw[8 : 8 + hlen])["rows.slot_group"]["data_offsets"][0]
    raw[at : at + 4] = struct.pack("<i", 2)
    bad_group.write_bytes(raw)
    return {"gap": with_gap(good, tmp_path / "gap.safetensors", "rows.seq_lens"),
            "first-gap": with_gap(good, tmp_path / "first-gap.safetensors", "obs.dcp_rows", 16),
            "slot-group": str(bad_group)}


@pytest.mark.parametrize("case", ["gap", "first-gap", "slot-group"])
def test_inspect_refuses_what_replay_refuses_with_the_same_line(tmp_path, case):
    p = _refused_alike(tmp_path)[case]
    replayed, inspected = cli("replay", p), cli("inspect", p, "--json")
    assert replayed.returncode == inspected.returncode == 2 and replayed.stdout == inspected.stdout == ""
    assert replayed.stderr == inspected.stderr and replayed.stderr.count("\n") == 1, (replayed.stderr, inspected.stderr)
    want = {"gap": "rows.seq_lens: data starts at byte", "first-gap": "data starts at byte 16, not 0",
            "slot-group": "rows.slot_group: KV-cache group 2 at entry 0 is out of range"}[case]
    assert replayed.stderr.startswith(f"dcptool: {p}: ") and want in replayed.stderr, replayed.stderr


def _out_of_memory(*a, **k):
    return np.empty(1 << 60, np.uint8)  # numpy's own MemoryError, with its size


@pytest.mark.parametrize("args,target,cut", [
    (["replay", "DUMP"], "dcptool.check.scan.scan", "replay fewer files at once"),
    (["replay", "DUMP", "--json"], "dcptool.check.problems.problems", "without --split or --html"),
    (["replay", "DUMP"], "dcptool.check.values.check_missing", "replay fewer files"),  # on a check's thread
    (["diff", "DUMP", "DUMP"], "dcptool.diagnose.diff.diff", "compare fewer files at once"),
    (["reduce", "DUMP", "--finding", "missing", "-o", "OUT"], "dcptool.diagnose.reduce.reduce_dump",
     "reduce fewer files"),
    (["inspect", "DUMP"], "dcptool.dump.describe", "inspect fewer files"),
    (["simulate", "--steps", "2"], "dcptool.model.simulate.compare", "fewer --steps"),
])
def test_out_of_memory_is_one_line_with_the_size_and_what_cuts_it(tmp_path, monkeypatch, args, target, cut):
    dump = write(tmp_path / "d.safetensors", [obs(step=i, rank=i % 2, view=None if i == 2 else "auto")
                                              for i in range(4)])
    module, name = target.rsplit(".", 1)
    monkeypatch.setattr(__import__(module, fromlist=[name]), name, _out_of_memory)
    args = [{"DUMP": dump, "OUT": str(tmp_path / "o.safetensors")}.get(a, a) for a in args]
    code, out, err = run_cli(*args)
    assert code == 2 and out == "" and err.count("\n") == 1, (code, out, err)
    head = f"dcptool: {args[0]}: out of memory: an allocation of 1.0 EiB failed; "
    assert err.startswith(head) and cut in err and "internal error" not in err, err
    if args[0] != "simulate":
        from dcptool.exits import _size

        files = 2 if args[0] == "diff" else 1
        held = f"the {files} file{'s' if files > 1 else ''} read hold{'s' if files == 1 else ''} "
        assert f"{held}{_size(files * Path(dump).stat().st_size)}, read whole into memory" in err, err
    assert not (tmp_path / "o.safetensors").exists()


def test_out_of_memory_under_a_real_limit_is_one_line(tmp_path):
    """RLIMIT_AS a little above what the process holds once dcptool is imported: reading a larger dump fails as
    MemoryError, and the process says so in one line (exit 2), never "internal error"."""
    import os

    from dcptool.dump import DumpConfig, write_dump

    n = 1 << 20  # 64 MiB of rows: more than the limit leaves
    cols = {"obs.step": np.zeros(1, np.int64), "obs.site": np.zeros(1, np.int32), "obs.rank": np.zeros(1, np.int32),
            "obs.ubatch": np.full(1, -1, np.int32), "obs.num_reqs": np.ones(1, np.int32),
            "obs.num_reqs_padded": np.full(1, 16 * n, np.int32), "obs.rows": np.array([0, 16 * n], np.int64),
            "obs.has_dcp": np.zeros(1, np.uint8), "obs.dcp_rows": np.zeros(2, np.int64),
            "rows.seq_lens": np.zeros(16 * n, np.int32), "rows.dcp_local_seq_lens": np.zeros(0, np.int32)}
    p = tmp_path / "big.safetensors"
    write_dump(p, DumpConfig(dcp_size=2, cp_interleave=1, sites=("attn",)), cols)
    script = f"""
import resource, sys, numpy, dcptool.cli, dcptool.check.replay, dcptool.report.text
vm = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + (48 << 20), resource.RLIM_INFINITY))
sys.argv = ["dcptool", sys.argv[1], {str(p)!r}]
dcptool.cli.main()
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "DCPTOOL_DEBUG": ""}
    for cmd in ("replay", "inspect"):
        r = subprocess.run([sys.executable, "-c", script, cmd], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (r.returncode, r.stderr[-2000:])
        assert r.stderr.startswith(f"dcptool: {cmd}: out of memory: an allocation of 64.0 MiB failed; the 1 file "
                                   "read holds 64.0 MiB, read whole into memory; to need less, "), r.stderr
