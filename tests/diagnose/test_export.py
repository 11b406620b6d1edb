"""`dcptool export-test`: the generated pytest file passes against dcptool's reference and
fails when an expected value is changed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, cli

SAMPLES = ROOT / "samples"


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"gen_{abs(hash(str(path)))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run_all(mod) -> int:
    """Every generated test, called as pytest would with each case; returns how many ran."""
    n = 0
    for c in getattr(mod, "VIEW_CASES", []):
        mod.test_dcp_local_seq_lens(c)
        n += 1
    for c in getattr(mod, "PAGE_CASES", []):
        mod.test_attention_page_counts(c)
        n += 1
    return n


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("red") / "small.safetensors"
    r = cli("reduce", SAMPLES / "legacy.safetensors", "--finding", "stale/parent-rows", "-o", out)
    assert r.returncode == 0, r.stderr
    return out


def test_exported_test_passes_and_fails_when_expected_changes(tmp_path, small):
    test = tmp_path / "test_dcp_regression.py"
    r = cli("export-test", small, "-o", test)
    assert r.returncode == 0, r.stderr
    text = test.read_text()
    mod = _load(test)
    assert _run_all(mod) == 1
    case = mod.VIEW_CASES[0]
    assert case["recorded"] != case["expected"] and case["rules"] == ["stale"]
    # change one expected value in the file: the test must fail
    exp = repr(case["expected"])
    bumped = repr(case["expected"][:-1] + [case["expected"][-1] + 1])
    assert text.count(f"'expected': {exp}") == 1
    broken = tmp_path / "test_broken.py"
    broken.write_text(text.replace(f"'expected': {exp}", f"'expected': {bumped}"))
    with pytest.raises(AssertionError):
        _run_all(_load(broken))
    # and a recorded value fixed to the expected one (the bug gone from the recording) fails too
    healed = tmp_path / "test_healed.py"
    healed.write_text(text.replace(f"'recorded': {repr(case['recorded'])}", f"'recorded': {exp}"))
    with pytest.raises(AssertionError):
        _run_all(_load(healed))


def test_exported_file_runs_under_pytest(tmp_path, small):
    test = tmp_path / "test_dcp_regression.py"
    assert cli("export-test", small, "-o", test).returncode == 0
    env_path = str(ROOT)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr


def test_export_missing_and_pages_from_the_sample(tmp_path):
    test = tmp_path / "t.py"
    assert cli("export-test", SAMPLES / "legacy.safetensors", "-o", test, "--max-cases", "20").returncode == 0
    mod = _load(test)
    rules = {r for c in mod.CASES for r in c["rules"]}
    assert {"missing", "stale", "padding", "shape", "pages"} <= rules
    assert any(c["recorded"] is None for c in mod.VIEW_CASES)  # missing: None was recorded
    assert _run_all(mod) == len(mod.VIEW_CASES) + len(mod.PAGE_CASES) >= 5


def test_export_falls_back_to_the_formula_without_dcptool(tmp_path, small):
    test = tmp_path / "t.py"
    assert cli("export-test", small, "-o", test).returncode == 0
    mod = _load(test)
    seq = list(range(0, 200, 7))
    for rank in range(mod.DCP_SIZE):
        assert [mod._formula(s, rank) for s in seq] == mod.local_seq_lens(seq, rank)


def test_export_nothing_to_export_exits_2(tmp_path):
    r = cli("export-test", SAMPLES / "fixed.safetensors", "-o", tmp_path / "t.py")
    assert r.returncode == 2 and "nothing to export" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "t.py").exists()


def test_export_refuses_to_clobber(tmp_path, small):
    test = tmp_path / "t.py"
    test.write_text("keep")
    r = cli("export-test", small, "-o", test)
    assert r.returncode == 2 and "exists" in r.stderr and test.read_text() == "keep"
