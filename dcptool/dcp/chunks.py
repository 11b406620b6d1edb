"""MLA's chunked prefill context under DCP: how vLLM plans it, and the schedule an observation records.

A prefill whose request already has KV in the cache (its context: seq_len - query_len) attends to that context
chunk by chunk: each chunk's KV is gathered into a workspace, under DCP by one all-gather of every rank's local
rows across the DCP group (the DCP KV gather). vLLM 0.29-0.34 plan the chunks in `build_mla_chunked_context_metadata`
(`plan_mla_context_chunks`): requests are packed into chunks in order, each chunk's local rows within
`workspace // N`, a request that does not fit split at a multiple of the DCP virtual block (N * I) so that every
rank's local start stays interleave-aligned; `max_context_chunk` is the workspace rounded down to
lcm(page, N * I). Every rank must plan the same chunks: each chunk is one collective.

The schedule a dump records (`rows.ctx_chunks`): `max_context_chunk`, then 4 values per entry (a request's piece
of one chunk): the chunk's index, the request's row in the batch, the piece's start in the request's context and
its length (global context rows). `[0]`: the build has no chunked context (the rank calls no DCP KV gather).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

NO_CONTEXT = (0,)  # the schedule of a build without chunked context: max_context_chunk 0, no entry
ENTRY = 4  # values per entry: chunk, row, start, length


def padded_rows(rows: int, dcp_size: int, interleave: int) -> int:
    """A request's local rows for `rows` context rows on every rank (vLLM's padded_rows: rounded up to the
    interleave block, so every rank gathers the same count)."""
    if dcp_size == 1:
        return rows
    return -(-rows // (dcp_size * interleave)) * interleave


def workspace_size(max_model_len: int, max_num_seqs: int, page_size: int, dcp_size: int, interleave: int) -> int:
    """vLLM's chunked-prefill workspace rows (determine_chunked_prefill_workspace_size, then
    align_mla_chunked_context_workspace_size)."""
    size = min(max(8 * max_model_len, 4 * max_num_seqs * page_size), 64 * 1024)
    align = page_size if dcp_size == 1 else math.lcm(page_size, dcp_size * interleave)
    return -(-max(size, align) // align) * align


class Plan(NamedTuple):
    """One chunk: its first request, and per request its context start and length."""

    request_start: int
    starts: list[int]
    lens: list[int]


def plan_chunks(context_lens: list[int], workspace: int, page_size: int, dcp_size: int,
                interleave: int) -> tuple[int, list[Plan]]:
    """(max_context_chunk, the chunks) as vLLM 0.29-0.34's build_mla_chunked_context_metadata plans them
    (align_chunk_to_block=True), for the prefill requests' context lengths in batch order."""
    align = page_size
    budget = workspace
    if dcp_size > 1:
        budget = workspace // dcp_size
        align = math.lcm(align, dcp_size * interleave)
    max_chunk = workspace // align * align
    if max(context_lens, default=0) <= 0:
        return 0, []

    def rows(n: int) -> int:
        return padded_rows(n, dcp_size, interleave)

    def split_len(start: int, remaining: int, available: int) -> int:
        lo, hi = 0, min(max_chunk, (remaining - 1) // align * align) // align
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if rows(start + mid * align) - rows(start) <= available:
                lo = mid
            else:
                hi = mid - 1
        return lo * align

    plans: list[Plan] = []
    req, start, n = 0, 0, len(context_lens)
    while req < n:
        if context_lens[req] == 0:
            req += 1
            continue
        first, starts, lens, used = req, [], [], 0
        while req < n and context_lens[req] > 0:
            remaining = context_lens[req] - start
            need = rows(start + remaining) - rows(start)
            if used + need > budget:
                k = split_len(start, remaining, budget - used)
                if k > 0:
                    starts.append(start)
                    lens.append(k)
                    used += rows(start + k) - rows(start)
                    start += k
                break
            used += need
            starts.append(start)
            lens.append(remaining)
            req += 1
            start = 0
        if not lens:
            raise ValueError(f"no context chunk fits a workspace of {workspace} rows")
        plans.append(Plan(first, starts, lens))
    return max_chunk, plans


def legacy_plan(context_lens: list[int], workspace: int) -> tuple[int, list[Plan]]:
    """The plan before vLLM aligned chunks to the DCP virtual block (vLLM PR #41229; ROCm, where `aot_schedule` is
    off, never rounded it to the page either): max_context_chunk = workspace // the prefills with context, and chunk
    c covers [c * max_context_chunk, (c + 1) * max_context_chunk) of every request's context."""
    with_ctx = [i for i, c in enumerate(context_lens) if c > 0]
    if not with_ctx:
        return 0, []
    max_chunk = workspace // len(with_ctx)
    plans = []
    for c in range(-(-max(context_lens) // max_chunk)):
        lo = c * max_chunk
        reqs = [i for i in with_ctx if context_lens[i] > lo]
        plans.append(Plan(reqs[0], [lo] * len(reqs), [min(max_chunk, context_lens[i] - lo) for i in reqs]))
    return max_chunk, plans


def encode(max_chunk: int, plans: list[Plan], rows_of: list[int] | np.ndarray) -> np.ndarray:
    """The recorded schedule: max_context_chunk, then (chunk, row, start, length) per entry; `rows_of[k]`: the batch
    row of the k-th prefill request (the plan's request index)."""
    out = [max_chunk]
    for c, p in enumerate(plans):
        for k, (s, n) in enumerate(zip(p.starts, p.lens)):
            out += (c, int(rows_of[p.request_start + k]), s, n)
    return np.asarray(out, np.int64)


def legacy_encode(max_chunk: int, plans: list[Plan], context_lens: list[int], rows_of) -> np.ndarray:
    """encode() for legacy_plan's chunks, whose requests are the ones whose context reaches the chunk (not a run)."""
    out = [max_chunk]
    for c, p in enumerate(plans):
        reqs = [i for i, n in enumerate(context_lens) if n > p.starts[0]]
        for i, n in zip(reqs, p.lens):
            out += (c, int(rows_of[i]), p.starts[0], n)
    return np.asarray(out, np.int64)


def gathers(schedule, dcp_size: int, interleave: int) -> list[int]:
    """The DCP KV gathers a schedule calls: per chunk, the local rows every rank contributes (empty: none)."""
    s = np.asarray(schedule, np.int64)
    if s.size < 1 + ENTRY or (s.size - 1) % ENTRY:
        return []
    e = s[1:].reshape(-1, ENTRY)
    out: dict[int, int] = {}
    for c, _, start, n in e.tolist():
        out[c] = out.get(c, 0) + padded_rows(start + n, dcp_size, interleave) - padded_rows(start, dcp_size, interleave)
    return [out[c] for c in sorted(out)]


def first_problem(schedule, seq_lens, query_start_loc, num_reqs: int, dcp_size: int,
                  interleave: int) -> str | None:
    """The rule ctx-chunks on one observation, written plainly (the spec check.context is tested against): the kind
    of its first problem, in the rule's order, or None. `query_start_loc` None: the coverage is not checked."""
    s = [int(x) for x in schedule]
    if not s:
        return None
    if (len(s) - 1) % ENTRY:
        return "length"
    mx, e = s[0], [s[k:k + ENTRY] for k in range(1, len(s), ENTRY)]
    if not e:
        return None
    V = dcp_size * interleave
    checks = [("max0", mx == 0 and bool(e)),
              ("chunk", e[0][0] != 0 or any(b[0] - a[0] not in (0, 1) for a, b in zip(e, e[1:]))),
              ("row", any(x[1] >= num_reqs for x in e)), ("empty", any(x[3] == 0 for x in e)),
              ("max", V > 1 and mx % V != 0), ("start", V > 1 and any(x[2] % V for x in e))]
    for kind, bad in checks:
        if bad:
            return kind
    done: dict[int, int] = {}
    for _, r, start, n in e:
        if start != done.get(r, 0):
            return "gap"
        done[r] = start + n
    if query_start_loc is not None:
        q = [int(x) for x in query_start_loc]
        if any(n != int(seq_lens[r]) - (q[r + 1] - q[r]) for r, n in done.items() if r + 1 < len(q)):
            return "coverage"
    return None
