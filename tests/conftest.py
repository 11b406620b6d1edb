"""Shared test helpers: hand-built observations and dumps, and the CLI as a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dcptool.dump import DumpConfig, Observation, write_observations
from dcptool.replay import local_np

ROOT = Path(__file__).resolve().parents[1]


def expected_view(seq, num_reqs: int, num_reqs_padded: int, dcp: int, rank: int, il: int = 1) -> np.ndarray:
    out = np.zeros(num_reqs_padded, np.int32)
    out[:num_reqs] = local_np(np.asarray(seq[:num_reqs]), dcp, rank, il)
    return out


def obs(step=0, site="attn_metadata", rank=0, seq=(17, 25, 0, 0), num_reqs=2, num_reqs_padded=4, dcp=2, il=1,
        view="auto", **kw) -> Observation:
    """A correct observation unless `view` says otherwise ("auto" = the right view, None = missing)."""
    seq = np.asarray(seq, np.int32)
    if isinstance(view, str) and view == "auto":
        view = expected_view(seq, num_reqs, num_reqs_padded, dcp, rank, il)
    return Observation(step=step, site=site, rank=rank, num_reqs=num_reqs, num_reqs_padded=num_reqs_padded,
                       seq_lens=seq, dcp_local_seq_lens=None if view is None else np.asarray(view, np.int32), **kw)


def write(path, observations, dcp=2, il=1, **cfg) -> str:
    write_observations(path, observations, DumpConfig(dcp_size=dcp, cp_interleave=il, **cfg))
    return str(path)


def cli(*args, env=None, cwd=None) -> subprocess.CompletedProcess:
    """Run `python -m dcptool ARGS` as a user would; returns the finished process."""
    e = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", **(env or {})}
    return subprocess.run([sys.executable, "-m", "dcptool", *map(str, args)], capture_output=True, text=True,
                          env=e, cwd=cwd, timeout=300)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# Fuzz cases run this session, by kind; printed as `fuzz: N cases` in the terminal summary (CI log).
FUZZ_CASES: dict[str, int] = {}


def count_fuzz(kind: str, n: int = 1) -> None:
    FUZZ_CASES[kind] = FUZZ_CASES.get(kind, 0) + n


def pytest_terminal_summary(terminalreporter) -> None:
    if FUZZ_CASES:
        detail = ", ".join(f"{k} {v}" for k, v in sorted(FUZZ_CASES.items()))
        terminalreporter.write_line(f"fuzz: {sum(FUZZ_CASES.values())} cases ({detail})")
