"""MLA's chunked prefill context, per observation (ctx-chunks): the recorded schedule (dcp.chunks) is well formed,
aligned to the DCP virtual block, and covers each request's computed context."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dcptool.check.findings import FindingTable, Written
from dcptool.dcp.chunks import ENTRY
from dcptool.dcp.segments import first_per_segment, group_ids, ragged
from dcptool.dump import Dump


class _First:
    """Each observation's first problem: position in cand -> (kind, text, row, recorded, expected, detail)."""

    def __init__(self, eseg: np.ndarray):
        self.got: dict[int, tuple] = {}
        self.eseg = eseg  # each entry's observation (position in cand)

    def obs(self, pos: np.ndarray, kind: str, make: Callable[[int], tuple]) -> None:
        """Observations `pos` have problem `kind`; make(k) -> (text, row, recorded, expected) for observation k."""
        for k in np.unique(pos).tolist():
            if k not in self.got:
                self.got[k] = (kind, *make(k))

    def entries(self, hits: np.ndarray, kind: str, make: Callable[[int], tuple]) -> None:
        """Entries `hits` have problem `kind`; make(e) -> (text, row, recorded, expected) for the observation's first
        such entry e."""
        firsts, _ = first_per_segment(self.eseg, np.sort(hits), int(self.eseg.max(initial=-1)) + 1)
        for e in firsts.tolist():
            k = int(self.eseg[e])
            if k not in self.got:
                self.got[k] = (kind, *make(e))


def check_ctx_chunks(d: Dump) -> FindingTable:
    """Each recorded chunked-context schedule, vectorised over the observations that recorded one: its length (1 +
    4 per entry); max_context_chunk set where there are entries; chunk indices from 0 in steps of 0 or 1; rows of
    real requests; no empty piece; under DCP max_context_chunk and every piece's start a multiple of the virtual
    block N * I (so each rank's local chunk starts on an interleave block: what vLLM asserted as `max_context_chunk
    % dcp_world_size == 0`, vLLM PR #41229); each request's pieces back to back from 0 and, where query_start_loc is
    recorded whole, covering its computed context seq_len - query_len (not its KV length seq_len: vllm-ascend
    #15600). One finding per observation, its first problem in that order (dcp.chunks.first_problem's)."""
    found = Written(d)
    off = d["obs.ctx"]
    lens = np.diff(off)
    cand = np.flatnonzero(lens > 0)
    if cand.size == 0:
        return found.table()
    vals = d["rows.ctx_chunks"]
    V = d.config.dcp_size * d.config.cp_interleave
    mx = vals[off[cand]].astype(np.int64)
    ne = lens[cand] - 1
    shaped = ne % ENTRY == 0
    ok = np.flatnonzero(shaped & (ne > 0))
    seg, _, at = ragged(off[cand[ok]] + 1, ne[ok])
    e = vals[at].astype(np.int64).reshape(-1, ENTRY)
    eseg = ok[seg[::ENTRY]]
    chunk, row, start, n = e.T
    first = _First(eseg)
    first.obs(np.flatnonzero(~shaped), "length", lambda k: (
        f"chunked-context schedule holds {int(lens[cand[k]])} values, not max_context_chunk and {ENTRY} per entry "
        "(chunk, row, start, length)", None, int(lens[cand[k]]), None))
    first.obs(eseg[mx[eseg] == 0], "max0", lambda k: ("chunked-context entries, but max_context_chunk is 0", None, 0,
                                                       None))
    head = np.r_[True, eseg[1:] != eseg[:-1]]
    step = chunk - np.r_[0, chunk[:-1]]
    first.entries(np.flatnonzero(np.where(head, chunk != 0, (step < 0) | (step > 1))), "chunk", lambda x: (
        f"chunk indices do not run 0, 1, ... (a piece of row {int(row[x])} is in chunk {int(chunk[x])})",
        int(row[x]), int(chunk[x]), None))
    nr = d["obs.num_reqs"][cand].astype(np.int64)
    first.entries(np.flatnonzero(row >= nr[eseg]), "row", lambda x: (
        f"a chunked-context entry names row {int(row[x])}, past num_reqs {int(nr[eseg[x]])}", int(row[x]), None,
        None))
    first.entries(np.flatnonzero(n == 0), "empty", lambda x: (
        f"a chunked-context entry of row {int(row[x])} covers no context", int(row[x]), 0, None))
    if V > 1:
        first.obs(np.flatnonzero(mx % V != 0), "max", lambda k: (
            f"max_context_chunk {int(mx[k])} is not a multiple of dcp_size x interleave ({V}): chunk boundaries fall "
            "inside an interleave block, so a rank's local chunk starts off its block (vLLM asserts "
            "max_context_chunk % dcp_world_size == 0)", None, int(mx[k]), int(mx[k]) // V * V))
        first.entries(np.flatnonzero(start % V != 0), "start", lambda x: (
            f"row {int(row[x])}'s context is split at {int(start[x])}, not a multiple of dcp_size x interleave ({V}): "
            "that rank's local chunk starts off its interleave block", int(row[x]), int(start[x]), None))
    _coverage(d, cand, row, start, n, first)
    for k in sorted(first.got):
        kind, text, r, rec, exp, *detail = first.got[k]
        found.add(int(cand[k]), "ctx-chunks", text, row=r, recorded=rec, expected=exp,
                  detail={"problem": kind, **(detail[0] if detail else {})})
    return found.table()


def _coverage(d: Dump, cand: np.ndarray, row: np.ndarray, start: np.ndarray, n: np.ndarray, first: _First) -> None:
    """Each request's pieces back to back from 0, and (where query_start_loc is recorded whole) their sum its
    computed context: seq_len - query_len."""
    eseg = first.eseg
    if eseg.size == 0:
        return
    key = group_ids([eseg, row])
    order = np.argsort(key, kind="stable")  # a request's pieces in schedule order
    ks, ns = key[order], n[order]
    new = np.r_[True, ks[1:] != ks[:-1]]
    run = np.cumsum(ns) - ns
    want_start = run - np.maximum.accumulate(np.where(new, run, 0))
    first.entries(np.sort(order[start[order] != want_start]), "gap", lambda x: (
        f"row {int(row[x])}'s context pieces are not back to back (a piece starts at {int(start[x])})", int(row[x]),
        int(start[x]), None))
    if not d.has("obs.qsl"):
        return
    total = np.bincount(key, weights=n, minlength=int(key.max()) + 1).astype(np.int64)
    lead = order[new]  # one entry per (observation, request)
    obs, r = cand[eseg[lead]], row[lead]
    qoff = d["obs.qsl"]
    rows = np.diff(d["obs.rows"])[obs]
    known = (np.diff(qoff)[obs] == rows + 1) & (r < rows)
    obs, r, lead = obs[known], r[known], lead[known]
    q = d["rows.query_start_loc"]
    ql = q[qoff[obs] + r + 1].astype(np.int64) - q[qoff[obs] + r].astype(np.int64)
    seq = d.take("rows.seq_lens", d["obs.rows"][obs] + r).astype(np.int64)
    got = total[key[lead]]
    bad = np.flatnonzero(got != seq - ql)
    at = dict(zip(lead[bad].tolist(), bad.tolist()))  # (an entry of the request -> its position here)

    def text(x: int) -> tuple:
        b = at[x]
        kv = bool(got[b] == seq[b])
        why = " = its KV length seq_len: the schedule was planned from the KV length, not the computed context"
        return (f"row {int(r[b])}'s chunks cover {int(got[b])} context rows, but its computed context is seq_len "
                f"{int(seq[b])} - query_len {int(ql[b])} = {int(seq[b] - ql[b])}{why if kv else ''}", int(r[b]),
                int(got[b]), int(seq[b] - ql[b]), {"kv_length": kv})

    first.entries(np.sort(lead[bad]), "coverage", text)
