"""The CLI as a user runs it: real subprocesses, exit codes 0/1/2, JSON Lines, one-line errors."""

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, cli, expected_view, obs, write


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
    r = cli("replay", p, "--json")
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
    assert "obs 3 missing" in tail and "padding" not in tail


def test_clean_dump_exits_0(tmp_path):
    r = cli("replay", write(tmp_path / "c.safetensors", [obs(step=i) for i in range(3)]))
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
    (["replay", "GOOD", "--split", "0"], "--split", False),  # usage errors: click's usage line + error
    (["replay"], "Missing argument", False),
    (["nonsense"], "No such command", False),
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
        assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("dcptool: ")


def test_obs_and_split_views(tmp_path):
    from test_replay import worked_example

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
    assert len(lines) == 4 and lines[-1]["findings"] == 10


def test_triton_backend_without_gpu_says_interpreter(tmp_path):
    import torch

    p = write(tmp_path / "t.safetensors", [obs(step=i) for i in range(3)] + [obs(step=3, view=[9, 14, 0, 0])])
    r = cli("replay", p, "--backend", "triton", "--json")
    summary = json.loads(r.stdout.splitlines()[-1])
    assert r.returncode == 1 and summary["backend"] == "triton" and summary["by_rule"] == {"mismatch": 1}
    if not torch.cuda.is_available():
        assert summary["device"] == "cpu (Triton interpreter)"


def test_inspect(tmp_path):
    p = write(tmp_path / "i.safetensors", [obs(step=i, rank=i % 2, view=None if i == 2 else "auto") for i in range(6)],
              page_size=16)
    r = cli("inspect", p, "--json")
    info = json.loads(r.stdout)
    assert r.returncode == 0 and info["observations"] == 6 and info["without_view"] == 1
    assert info["config"]["page_size"] == 16 and info["ranks"] == {"0": 3, "1": 3}
    t = cli("inspect", p)
    assert "dcp_size 2" in t.stdout and "6 (5 with a DCP view, 1 None)" in t.stdout


def test_help_and_module_entry():
    r = cli("--help")
    assert r.returncode == 0 and "replay" in r.stdout and "inspect" in r.stdout
    assert (ROOT / "dcptool" / "__main__.py").exists()


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
        found = [json.loads(x) for x in r.stdout.splitlines()][:-1]
        assert r.returncode == 1 and [(f["obs"], f["rule"]) for f in found] == [(1, "missing")]
