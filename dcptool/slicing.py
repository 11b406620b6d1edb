"""Micro-batch (DBO) slicing and the PCP partition, by DESIGN §1 and vLLM model runner V2."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class UbatchSlice:
    """Requests [req_start, req_stop) and tokens [tok_start, tok_stop) of one micro-batch (padded)."""

    req_start: int
    req_stop: int
    tok_start: int
    tok_stop: int


@dataclass(frozen=True)
class Ubatch:
    """One micro-batch as the runner builds it: its slice and its own (truncated) tensors."""

    slice: UbatchSlice
    num_reqs: int  # real requests
    num_reqs_padded: int  # req_stop - req_start
    query_start_loc: np.ndarray  # [num_reqs_padded + 1] int32
    seq_lens: np.ndarray  # [num_reqs_padded] int32


def ubatch_slices(query_start_loc: np.ndarray, num_reqs: int, num_reqs_padded: int, num_tokens_padded: int,
                  num_ubatches: int) -> list[UbatchSlice]:
    """Split points and request ranges (vLLM's maybe_create_ubatch_slices + create_ubatch_slices).

    split s = num_tokens_padded // K; micro-batch i owns tokens [s*i, s*(i+1)), the last one ends
    at the real token count and is then padded to num_tokens_padded / num_reqs_padded. Request
    ranges are the requests overlapping the token range, then clamped so a micro-batch lying
    entirely in token padding keeps the last real request (0 query tokens, full seq_len).
    """
    if num_ubatches < 1:
        raise ValueError(f"num_ubatches must be >= 1, got {num_ubatches}")
    if num_reqs < 1:
        raise ValueError("cannot split a batch without requests")
    cu = np.asarray(query_start_loc[: num_reqs + 1], dtype=np.int64)
    s = num_tokens_padded // num_ubatches
    ends = [s * i for i in range(1, num_ubatches)] + [int(cu[-1])]
    out = []
    start = 0
    for i, end in enumerate(ends):
        req_start = int(np.searchsorted(cu, start, side="right")) - 1
        req_stop = int(np.searchsorted(cu, end, side="left"))
        tok_stop = end
        if i == num_ubatches - 1:  # the last micro-batch absorbs the padding
            req_stop, tok_stop = num_reqs_padded, num_tokens_padded
        req_start = max(min(req_start, num_reqs - 1), 0)
        # Only a recorded query_start_loc that does not start at 0, or has zero-token requests (vLLM
        # schedules none), could put req_start below 0 or req_stop below req_start: clamp, so such a
        # batch gives empty micro-batches rather than negative ones.
        out.append(UbatchSlice(req_start, max(min(req_stop, num_reqs_padded), req_start), start, tok_stop))
        start = end
    return out


def slice_ubatch(query_start_loc: np.ndarray, seq_lens: np.ndarray, num_reqs: int, sl: UbatchSlice) -> Ubatch:
    """One micro-batch's query_start_loc and seq_lens from its parent's (vLLM's _slice_input_batch).

    qsl = clamp(qsl[req_start:req_stop+1] - tok_start, 0, tok_stop - tok_start); seq_lens are the
    parent's rows with only the last reduced by the tokens of that request after tok_stop.
    """
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    nrp = sl.req_stop - sl.req_start
    q = np.clip(qsl[sl.req_start : sl.req_stop + 1] - sl.tok_start, 0, sl.tok_stop - sl.tok_start)
    seq = np.array(seq_lens[sl.req_start : sl.req_stop], dtype=np.int64)
    if nrp > 0:
        seq[-1] -= max(0, int(qsl[sl.req_stop]) - sl.tok_stop)
    return Ubatch(slice=sl, num_reqs=max(0, min(sl.req_stop, num_reqs) - sl.req_start), num_reqs_padded=nrp,
                  query_start_loc=q.astype(np.int32), seq_lens=seq.astype(np.int32))


def split_batch(query_start_loc: np.ndarray, seq_lens: np.ndarray, num_reqs: int, num_reqs_padded: int,
                num_tokens_padded: int | None, num_ubatches: int) -> list[Ubatch]:
    """Every micro-batch of a full batch (num_tokens_padded defaults to the real token count)."""
    if num_tokens_padded is None or num_tokens_padded < 0:
        num_tokens_padded = int(query_start_loc[num_reqs])
    return [slice_ubatch(query_start_loc, seq_lens, num_reqs, sl)
            for sl in ubatch_slices(query_start_loc, num_reqs, num_reqs_padded, num_tokens_padded, num_ubatches)]
