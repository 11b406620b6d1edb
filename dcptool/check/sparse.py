"""Sparse MLA's rows (topk-empty): each query token's partial result on a rank matches its share of the token's top-k
set (dcp.topk): a row of which the rank owns no entry gives output 0 and LSE -inf, a row with entries a finite LSE."""

from __future__ import annotations

import numpy as np

from dcptool.check.findings import FindingTable, Written
from dcptool.dcp.segments import first_per_segment, ragged
from dcptool.dcp.topk import EMPTY_STATE, state_problem
from dcptool.dump import Dump

_WHY = {
    "empty": "this rank owns none of its top-k entries (all -1 after the DCP filter), so its partial output must be "
             "0 and its LSE -inf: the merge weighs it 0, and 0 x NaN is NaN on every rank",
    "lse": "this rank owns entries of its top-k set, so its LSE must be finite (it holds KV the merge must weigh)",
    "state": "the state has bits topk_state does not define (bits 0-2)",
}


def _state_text(s: int) -> str:
    parts = [name for bit, name in ((1, "LSE -inf"), (2, "output 0"), (4, "a NaN or infinite value")) if s & bit]
    return ", ".join(parts) or "a finite LSE and a nonzero output"


def check_topk_empty(d: Dump) -> FindingTable:
    """rows.sparse_topk (per query token: fingerprint, owned, state) where recorded: a length that is not a multiple
    of 3 is malformed; else every token's (owned, state) against dcp.topk.state_problem. One finding per
    observation, its first wrong token, with how many are wrong."""
    found = Written(d)
    if not d.has("obs.topk") or d.n == 0:
        return found.table()
    off = d["obs.topk"]
    lens = np.diff(off)
    odd = np.flatnonzero(lens % 3 != 0)
    for i in odd.tolist():
        found.add(i, "topk-empty", f"sparse_topk holds {int(lens[i])} values: not three per query token "
                                   f"(fingerprint, owned, state)", recorded=int(lens[i]), detail={"problem": "length"})
    ok = np.flatnonzero((lens > 0) & (lens % 3 == 0))
    seg, t, at = ragged(off[ok], lens[ok] // 3)
    if seg.size == 0:
        return found.table()
    owned = d.take("rows.sparse_topk", at + 2 * t + 1).astype(np.int64)
    state = d.take("rows.sparse_topk", at + 2 * t + 2).astype(np.int64)
    prob = state_problem(owned, state)
    wrong = np.flatnonzero(prob != "")
    if wrong.size == 0:
        return found.table()
    firsts, nbad = first_per_segment(seg, wrong, ok.size)
    for w in firsts.tolist():
        i, p, s = int(ok[seg[w]]), str(prob[w]), int(state[w])
        n = int(nbad[seg[w]])
        exp = f", expected {_state_text(EMPTY_STATE)}" if p == "empty" else ""
        found.add(i, "topk-empty", f"query token {int(t[w])} ({int(owned[w])} top-k entries on this rank) gives "
                                   f"{_state_text(s)}{exp}: {_WHY[p]} ({n} wrong token{'s' if n > 1 else ''})",
                  recorded=s, expected=EMPTY_STATE if p == "empty" else None,
                  detail={"problem": p, "token": int(t[w]), "owned": int(owned[w])})
    return found.table()
