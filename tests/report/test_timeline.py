"""The timeline model (timeline.py), shared by the text and HTML reports: steps per column, axis labels, and
every observation and finding in exactly one cell. Its text rendering is tested in tests/report/test_text.py."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from conftest import obs, write

from dcptool.check.replay import RULES, obs_grid, replay
from dcptool.dump import open_dumps
from dcptool.report import timeline


@pytest.mark.parametrize("x,want", [(0.1, 1), (1, 1), (1.74, 2), (2.1, 3), (6.1, 8), (8.5, 10), (11, 12), (13, 15),
                                    (971.2, 1000), (2.6e6, 3_000_000)])
def test_steps_per_column_are_round(x, want):
    assert timeline.round_up(x) == want


@pytest.mark.parametrize("first,last,width,gap,want", [
    (0, 11, 1, 3, [(0, 0), (5, 5), (10, 10)]),
    (3, 30, 1, 3, [(2, 5), (7, 10), (12, 15), (17, 20), (22, 25), (27, 30)]),  # 3 has no room before 5
    (1, 30, 1, 3, [(0, 1), (4, 5), (9, 10), (14, 15), (19, 20), (24, 25), (29, 30)]),
    (-7, 40, 2, 3, [(0, -7), (3, 0), (8, 10), (13, 20), (18, 30), (23, 40)]),
    (1000, 99999, 1000, 6, [(0, 1000), (9, 10000), (19, 20000), (29, 30000), (39, 40000), (49, 50000),
                            (59, 60000), (69, 70000), (79, 80000), (89, 90000)]),
])
def test_axis_labels_are_round_steps_in_their_columns(first, last, width, gap, want):
    z = np.zeros((1, -(-(last - first + 1) // width)), np.int64)
    tl = timeline.Timeline(["s"], [0], first, last, width, z, z[..., None], z[..., None], z[..., None], z)
    assert tl.ticks(gap) == want
    assert all(tl.steps_of(c)[0] <= s <= tl.steps_of(c)[1] for c, s in want)  # each label sits in its step's column


@pytest.mark.parametrize("columns", [1, 7, 64, 1000])
def test_timeline_cells_agree_with_a_direct_count(rng, tmp_path, columns):
    """Random run: per-cell observation counts, finding counts by rule, micro-batch counts and first findings match
    a count made observation by observation."""
    o = []
    for _ in range(300):
        step, rank, site = int(rng.integers(5, 140)), int(rng.integers(0, 4)), ["a", "b", "c"][int(rng.integers(3))]
        bad = rng.random() < 0.2
        o.append(obs(step, site, rank, dcp=4, ubatch=int(rng.integers(-1, 2)),
                      view=None if bad and rng.random() < 0.5 else ([1, 2, 0, 0] if bad else "auto")))
    o.sort(key=lambda x: x.step)
    d = open_dumps([write(tmp_path / "rnd.safetensors", o, dcp=4)])
    res = replay(d, "torch")
    tl = timeline.timeline(res, columns)
    span = tl.last_step - tl.first_step + 1
    assert tl.columns == -(-span // tl.width) <= columns and tl.width == timeline.round_up(span / columns)
    row = {(s, r): k for k, (s, r) in enumerate(zip(tl.sites, tl.ranks))}
    assert list(row) == sorted(row, key=lambda t: (d.config.sites.index(t[0]), t[1]))  # config's site order
    want_obs, want_ub = Counter(), Counter()
    for x in o:
        cell = (row[(x.site, x.rank)], (x.step - tl.first_step) // tl.width)
        want_obs[cell] += 1
        want_ub[(*cell, x.ubatch + 1)] += 1
    assert {k: int(v) for k, v in zip(map(tuple, np.argwhere(tl.obs)), tl.obs[tl.obs > 0])} == dict(want_obs)
    assert {k: int(tl.ub_obs[k]) for k in want_ub} == dict(want_ub) and tl.ub_obs.sum() == len(o)
    want_rules, first = Counter(), {}
    for k, f in enumerate(res.findings):
        cell = (row[(f.site, f.rank)], (f.step - tl.first_step) // tl.width)
        want_rules[(*cell, RULES.index(f.rule))] += 1
        first.setdefault(cell, k)
    assert {tuple(k): int(tl.rules[tuple(k)]) for k in np.argwhere(tl.rules)} == dict(want_rules)
    assert {tuple(k): int(tl.first[tuple(k)]) for k in np.argwhere(tl.first >= 0)} == first
    worst = tl.worst()
    for r, c in first:  # missing outranks mismatch (table order)
        rules_here = {RULES[i] for i in np.flatnonzero(tl.rules[r, c])}
        assert RULES[worst[r, c]] == ("missing" if "missing" in rules_here else "mismatch")


# replay's grid of observations per (site, rank, step, ubatch): what the timeline counts
def test_obs_grid_counts(rng, tmp_path):
    o = [obs(int(s), ["x", "y"][int(k)], int(r), ubatch=int(u)) for s, k, r, u in
         zip(np.sort(rng.integers(0, 9, 500)), rng.integers(0, 2, 500), rng.integers(0, 2, 500),
             rng.integers(-1, 3, 500))]
    d = open_dumps([write(tmp_path / "g.safetensors", o)])
    g = obs_grid(d)
    got = {(d.config.sites[s], int(r), int(t), int(u)): int(n) for s, r, t, u, n in
           zip(g.site, g.rank, g.step, g.ubatch, g.count)}
    assert got == dict(Counter((x.site, x.rank, x.step, x.ubatch) for x in o))
