"""Exact comparisons of a wrong DCP view's recorded rows with another observation's rows: provenance confirms
every hash hit with these (docs/replay.md#the-rules: "Where a wrong value came from")."""

from __future__ import annotations

import numpy as np

from dcptool.dcp.reference import local_np
from dcptool.dcp.segments import ragged
from dcptool.dump import Dump


def recorded_rows(d: Dump, q: np.ndarray, m: np.ndarray, L: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows [0, L) of the recorded views of q, zero past m: (segment, row, values)."""
    seg, j, _ = ragged(np.zeros(q.size, np.int64), L)
    real = j < m[seg]
    v = np.zeros(j.size, np.int64)
    v[real] = d.take("rows.dcp_local_seq_lens", d["obs.dcp_rows"][q][seg[real]] + j[real])
    return seg, j, v


def expected_rows(d: Dump, s: np.ndarray, seg: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Expected row `pos` of observation s[seg] (0 past its num_reqs), per element."""
    c = d.config
    ss = s[seg]
    real = pos < d["obs.num_reqs"][ss]
    out = np.zeros(pos.size, np.int64)
    out[real] = local_np(d.take("rows.seq_lens", d["obs.rows"][ss[real]] + pos[real]), c.dcp_size,
                         d["obs.rank"][ss[real]], c.cp_interleave)
    return out


def zero_ext_equal(d: Dump, q: np.ndarray, m: np.ndarray, s: np.ndarray, L: np.ndarray) -> np.ndarray:
    """Per pair: rows [0, L) of q's recorded view (zero past m) equal s's expected rows (zero past num_reqs)."""
    if q.size == 0:
        return np.zeros(0, bool)
    seg, j, rec = recorded_rows(d, q, m, L)
    bad = rec != expected_rows(d, s, seg, j)
    return np.bincount(seg, weights=bad, minlength=q.size) == 0


def parent_rows(d: Dump, q: np.ndarray, m: np.ndarray, p: np.ndarray, rs: np.ndarray) -> np.ndarray:
    """Rule 1 per pair: q's recorded rows equal the parent's expected rows [rs, rs + m) (zero-extended), or
    the parent's recorded rows there (a copy of a parent that was itself wrong is still a copy)."""
    if q.size == 0:
        return np.zeros(0, bool)
    seg, j, rec = recorded_rows(d, q, m, m)
    ok = np.bincount(seg, weights=rec != expected_rows(d, p, seg, rs[seg] + j), minlength=q.size) == 0
    plen = np.diff(d["obs.dcp_rows"])[p]
    full = (d["obs.has_dcp"][p] == 1) & (plen - rs >= m)  # pv[rs:rs + m] has all m rows
    inb = full[seg]
    pv = np.zeros(j.size, np.int64)
    pv[inb] = d.take("rows.dcp_local_seq_lens", d["obs.dcp_rows"][p[seg[inb]]] + rs[seg[inb]] + j[inb])
    copy = full & (np.bincount(seg, weights=pv != rec, minlength=q.size) == 0)
    return ok | copy
