"""Rows: a batch as attention metadata sees it, from a batch's query and sequence lengths or as vLLM's dummy batch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Rows:
    """A batch as attention metadata sees it: padded seq_lens and query_start_loc."""

    seq: np.ndarray  # [num_reqs_padded] int64, padded rows 0
    qsl: np.ndarray  # [num_reqs_padded + 1] int64, padded entries repeat the real token count
    nr: int
    ntp: int  # tokens after padding
    # the global batch row of each real row where rows are not requests (a PCP rank's local rows: a prefill's two
    # chunks are two rows of one request); None: row k is request k
    req: np.ndarray | None = None

    @property
    def nrp(self) -> int:
        return int(self.seq.size)


def num_decodes(query_lens: np.ndarray, threshold: int, n: int) -> int:
    """The rows before the first whose query is longer than `threshold` (vLLM's split_decodes_and_prefills: decodes
    first), or `n` where no row is."""
    long = np.flatnonzero(np.asarray(query_lens) > threshold)
    return int(long[0]) if long.size else n


def make_rows(query_lens: np.ndarray, seq_lens: np.ndarray, nrp: int, ntp: int, req: np.ndarray | None = None) -> Rows:
    """The rows of a batch padded to `nrp` requests (padded seq_lens 0) and at least `ntp` tokens; `req`: the global
    batch row of each real row (Rows.req)."""
    nr = int(query_lens.size)
    seq = np.zeros(nrp, np.int64)
    seq[:nr] = seq_lens
    qsl = np.empty(nrp + 1, np.int64)
    qsl[0] = 0
    np.cumsum(query_lens, out=qsl[1 : nr + 1])
    qsl[nr + 1 :] = qsl[nr]
    return Rows(seq, qsl, nr, max(ntp, int(qsl[nr])), req)


def dummy_rows(num_reqs: int, num_tokens: int, context: int, max_model_len: int) -> Rows:
    """InputBatch.make_dummy (tokens spread evenly, the last ones get one more), then set_dummy_context."""
    q = np.full(num_reqs, num_tokens // num_reqs, np.int64)
    q[num_reqs - num_tokens % num_reqs :] += 1
    seq = q + np.minimum(context, max_model_len - q)
    return make_rows(q, seq, num_reqs, num_tokens)
