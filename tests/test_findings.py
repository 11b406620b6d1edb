"""Columnar findings (issue 16 item 2): the FindingTable, lazy messages, and output byte-identical to the
per-finding Finding objects replay built before (golden outputs captured on main da219d5)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "data" / "golden"
sys.path.insert(0, str(GOLDEN))

import make_golden  # noqa: E402

EXPECTED = json.loads((GOLDEN / "golden.json").read_text())


@pytest.mark.parametrize("dump", [p.stem for p in make_golden.dumps()])
def test_output_is_byte_identical_to_the_per_finding_objects(dump, tmp_path):
    """Text, JSON Lines, HTML, --split and --obs outputs of every golden dump hash as before (seconds masked).
    On a failure, `python tests/data/golden/make_golden.py outputs DIR` on the old and new code shows the diff."""
    path = next(p for p in make_golden.dumps() if p.stem == dump)
    bad = []
    for mode, args in make_golden.MODES:
        got = make_golden.digest(make_golden.run_mode(path, mode, args, tmp_path))
        if got != EXPECTED[f"{dump}.{mode}"]:
            bad.append(mode)
    assert not bad, f"{dump}: output differs from the golden in {bad}"
