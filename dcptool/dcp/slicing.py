"""Micro-batch (DBO) slicing and the PCP partition, by docs/dcp.md and vLLM model runner V2."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dcptool.dcp.segments import ragged

if TYPE_CHECKING:
    from dcptool.dump import Dump

# --------------------------------------------------------------------------------------------
# Which engine's split rule: vLLM changed it in 0.34.0 (create_ubatch_slices' uniform_token_count)

REQUEST_BOUNDARY_SINCE = (0, 34)  # first vLLM release that splits a uniform multi-token batch on a request boundary
DEFAULT_ENGINE_VERSION = "0.33"  # dumps that name no engine version: the rule dcptool always used
# The vLLM release lines dcptool models (their split rules here; the plugin's hook tables, engine.vllm.tables, cover the
# same lines: tests/dcp/test_slicing.py keeps them equal)
RELEASES = ((0, 29), (0, 30), (0, 31), (0, 32), (0, 33), (0, 34))


def parse_engine_version(text: str | None) -> tuple[int, int] | None:
    """(major, minor) of the first `X.Y` in a recorded engine_version ("0.34.0", "0.34.1.dev3+g1a2b",
    "vLLM 0.33.0"), or None when it names none (free text such as simulate's default)."""
    m = re.search(r"(?<![\d.])(\d+)\.(\d+)(?![\d])", text or "")
    return None if m is None else (int(m.group(1)), int(m.group(2)))


def unmodelled(engine_version: str) -> str | None:
    """Why dcptool has no model of this vLLM version (None: it has one): the releases it knows, and the rule it
    splits micro-batches by instead."""
    v = parse_engine_version(engine_version)
    if v is None or v in RELEASES:
        return None
    known = ", ".join(f"{a}.{b}" for a, b in RELEASES)
    rule = "0.34 does (a uniform decode batch on a request boundary)" if v >= REQUEST_BOUNDARY_SINCE else \
        "0.33 does (at the token midpoint)"
    return f"no model of this release; dcptool knows vLLM {known}, and splits micro-batches as {rule}"


def splits_on_request_boundary(engine_version: str | None) -> bool:
    """Does this engine split a uniform multi-token batch on a request boundary (vLLM >= 0.34)?
    Unknown versions get the default rule (0.33's token midpoint)."""
    v = parse_engine_version(engine_version) or parse_engine_version(DEFAULT_ENGINE_VERSION)
    return v >= REQUEST_BOUNDARY_SINCE


def uniform_query_len(query_start_loc: np.ndarray, num_reqs: int) -> int | None:
    """q when every real request has the same query length q (vLLM's is_uniform_query_len), else None.

    vLLM 0.34 also needs the batch to be decode-graph eligible (no prefill) and every DP rank to agree
    on q; neither is recorded, so a dump's batch counts as uniform on its shape alone."""
    if num_reqs < 1:
        return None
    q = np.diff(np.asarray(query_start_loc[: num_reqs + 1], dtype=np.int64))
    if q.size != num_reqs or not (q == q[0]).all():
        return None
    return int(q[0])


def request_boundary_split(num_tokens_padded: int, num_ubatches: int, uniform_token_count: int | None) -> int | None:
    """vLLM 0.34's split point for a uniform batch of `uniform_token_count`-token queries: as many whole
    requests per micro-batch as fit in num_tokens_padded / K, i.e. (T // (q*K)) * q; None (the token
    midpoint applies) when q <= 1 or not even one whole request fits per micro-batch."""
    if uniform_token_count is None:
        return None
    s = int(request_boundary_splits(num_tokens_padded, num_ubatches, uniform_token_count))
    return s if s > 0 else None


def request_boundary_splits(num_tokens_padded, num_ubatches, uniform_token_count):
    """request_boundary_split over arrays (or ints): 0 where the token midpoint applies (q <= 1 or not
    one whole request per micro-batch)."""
    q = uniform_token_count
    per = np.where(q > 1, num_tokens_padded // np.maximum(q * num_ubatches, 1), 0)
    return per * q


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
                  num_ubatches: int, uniform_token_count: int | None = None) -> list[UbatchSlice]:
    """Split points and request ranges (vLLM's maybe_create_ubatch_slices + create_ubatch_slices).

    split s = num_tokens_padded // K; micro-batch i owns tokens [s*i, s*(i+1)), the last one ends
    at the real token count and is then padded to num_tokens_padded / num_reqs_padded. Request
    ranges are the requests overlapping the token range, then clamped so a micro-batch lying
    entirely in token padding keeps the last real request (0 query tokens, full seq_len).
    vLLM >= 0.34 passes `uniform_token_count` q for a uniform decode batch: then s =
    (num_tokens_padded // (q*K)) * q when that is > 0 and q > 1, a request boundary.
    """
    if num_ubatches < 1:
        raise ValueError(f"num_ubatches must be >= 1, got {num_ubatches}")
    if num_reqs < 1:
        raise ValueError("cannot split a batch without requests")
    cu = np.asarray(query_start_loc[: num_reqs + 1], dtype=np.int64)
    s = request_boundary_split(num_tokens_padded, num_ubatches, uniform_token_count)
    if s is None:
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


# The slicing rule (vLLM's _slice_input_batch), on scalars or on arrays of micro-batches at once:
# slice_ubatch below and the recorded micro-batch checks (structure.check_ubatch_slice) both use these.

def sliced_num_reqs(req_start, num_reqs_padded, parent_num_reqs):
    """Real requests of micro-batch [req_start, req_start + num_reqs_padded) of a parent with parent_num_reqs."""
    return np.maximum(0, np.minimum(req_start + num_reqs_padded, parent_num_reqs) - req_start)


def sliced_query_start_loc(parent_qsl, tok_start, tok_stop):
    """A micro-batch's query_start_loc from its parent's values qsl[req_start : req_stop + 1]."""
    return np.clip(parent_qsl - tok_start, 0, tok_stop - tok_start)


def sliced_last_cut(parent_qsl_at_stop, tok_stop):
    """How much a micro-batch's last seq_len is reduced: the tokens of that request after tok_stop."""
    return np.maximum(0, parent_qsl_at_stop - tok_stop)


def slice_ubatch(query_start_loc: np.ndarray, seq_lens: np.ndarray, num_reqs: int, sl: UbatchSlice) -> Ubatch:
    """One micro-batch's query_start_loc and seq_lens from its parent's (vLLM's _slice_input_batch).

    qsl = clamp(qsl[req_start:req_stop+1] - tok_start, 0, tok_stop - tok_start); seq_lens are the
    parent's rows with only the last reduced by the tokens of that request after tok_stop.
    """
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    nrp = sl.req_stop - sl.req_start
    q = sliced_query_start_loc(qsl[sl.req_start : sl.req_stop + 1], sl.tok_start, sl.tok_stop)
    seq = np.array(seq_lens[sl.req_start : sl.req_stop], dtype=np.int64)
    if nrp > 0:
        seq[-1] -= int(sliced_last_cut(int(qsl[sl.req_stop]), sl.tok_stop))
    return Ubatch(slice=sl, num_reqs=int(sliced_num_reqs(sl.req_start, nrp, num_reqs)), num_reqs_padded=nrp,
                  query_start_loc=q.astype(np.int32), seq_lens=seq.astype(np.int32))


def first_disagreement(recorded: dict[str, int], seq_lens: np.ndarray, ub: Ubatch) -> tuple[str, object, object] | None:
    """The first way a recorded micro-batch differs from slice `ub`: (field, recorded, sliced), or None.

    recorded: num_reqs_padded, num_reqs and whichever of req_start, tok_start, tok_stop the dump holds, in
    that order; seq_lens: its first num_reqs_padded rows (compared only when every number agrees)."""
    sliced = {"num_reqs_padded": ub.num_reqs_padded, "num_reqs": ub.num_reqs, "req_start": ub.slice.req_start,
              "tok_start": ub.slice.tok_start, "tok_stop": ub.slice.tok_stop}
    for f, v in recorded.items():
        if v != sliced[f]:
            return f, v, sliced[f]
    if not np.array_equal(seq_lens, ub.seq_lens):
        return "seq_lens", seq_lens.tolist(), ub.seq_lens.tolist()
    return None


def split_batch(query_start_loc: np.ndarray, seq_lens: np.ndarray, num_reqs: int, num_reqs_padded: int,
                num_tokens_padded: int | None, num_ubatches: int,
                uniform_token_count: int | None = None) -> list[Ubatch]:
    """Every micro-batch of a full batch (num_tokens_padded defaults to the real token count);
    `uniform_token_count` as vLLM 0.34's create_ubatch_slices takes it (see engine_split)."""
    if num_tokens_padded is None or num_tokens_padded < 0:
        num_tokens_padded = int(query_start_loc[num_reqs])
    return [slice_ubatch(query_start_loc, seq_lens, num_reqs, sl)
            for sl in ubatch_slices(query_start_loc, num_reqs, num_reqs_padded, num_tokens_padded, num_ubatches,
                                    uniform_token_count)]


def engine_split(query_start_loc: np.ndarray, seq_lens: np.ndarray, num_reqs: int, num_reqs_padded: int,
                 num_tokens_padded: int | None, num_ubatches: int, engine_version: str | None) -> list[Ubatch]:
    """A recorded full batch split the way the engine version that recorded it splits (replay --split):
    vLLM >= 0.34 on a request boundary when the batch is uniform (its DP ranks assumed to agree), else
    (and before 0.34) at the token midpoint."""
    q = uniform_query_len(query_start_loc, num_reqs) if splits_on_request_boundary(engine_version) else None
    return split_batch(query_start_loc, seq_lens, num_reqs, num_reqs_padded, num_tokens_padded, num_ubatches, q)


def _ragged_searchsorted(d: Dump, parents: np.ndarray, x: np.ndarray, side: str) -> np.ndarray:
    """searchsorted(cu, x[k], side) where cu = parents[k]'s real query_start_loc[:num_reqs+1], for all k
    at once: the unique parents' cu arrays laid end to end, each lifted above the one before."""
    up, inv = np.unique(parents, return_inverse=True)
    inv = inv.ravel()
    n = d["obs.num_reqs"][up].astype(np.int64) + 1
    seg, j, idx = ragged(d["obs.qsl"][up].astype(np.int64), n)
    lift = np.int64(1) << 34  # recorded values are int32: every segment gets its own range
    keys = d["rows.query_start_loc"][idx].astype(np.int64) + seg * lift
    start = np.cumsum(n) - n
    return np.searchsorted(keys, x + inv * lift, side=side) - start[inv]


def ubatch_bounds(d: Dump, p: np.ndarray, u: np.ndarray, k: np.ndarray, ntp: np.ndarray, s: np.ndarray):
    """(req_start, req_stop, tok_start, tok_stop) of micro-batch u of k with split point s (ubatch_slices,
    vectorised): tokens [s*u, s*(u+1)), the last micro-batch to the real end, padded to ntp / num_reqs_padded."""
    nr = d["obs.num_reqs"][p].astype(np.int64)
    nrp = d["obs.num_reqs_padded"][p].astype(np.int64)
    last = u == k - 1
    ts = s * u
    end = np.where(last, d["rows.query_start_loc"][d["obs.qsl"][p] + nr].astype(np.int64), s * (u + 1))
    rs = np.clip(_ragged_searchsorted(d, p, ts, "right") - 1, 0, np.maximum(nr - 1, 0))
    re_ = np.maximum(np.minimum(_ragged_searchsorted(d, p, end, "left"), nrp), rs)
    return rs, np.where(last, nrp, re_), ts, np.where(last, ntp, end)


# --------------------------------------------------------------------------------------------
# PCP (prefill context parallelism): vLLM 0.33's PCPManager.partition_batch, one rank at a time


@dataclass(frozen=True)
class PcpLocal:
    """One PCP rank's rows of a partitioned batch: decodes first, then prefill chunks."""

    req: np.ndarray  # [num_reqs] global batch row each local row comes from (requests may repeat)
    offset: np.ndarray  # [num_reqs] where the row's chunk starts inside that request's query
    query_lens: np.ndarray  # [num_reqs] int32
    seq_lens: np.ndarray  # [num_reqs] int32: computed tokens + end of the chunk in the query

    @property
    def num_reqs(self) -> int:
        return int(self.req.size)

    @property
    def num_tokens(self) -> int:
        return int(self.query_lens.sum())


def pcp_replicated(query_lens: np.ndarray, is_prefilling: np.ndarray, pcp_size: int, dcp_size: int) -> np.ndarray:
    """Per request: does every PCP rank get the whole query? Decodes always; with DCP > 1 also a
    prefill too short to fill all 2P chunks ((2P-1) * ceil(q/2P) >= q), as vLLM's
    `replicated_requests` decides."""
    q = np.asarray(query_lens, dtype=np.int64)
    rep = ~np.asarray(is_prefilling, dtype=bool)
    if dcp_size > 1:
        chunks = 2 * pcp_size
        rep = rep | ((chunks - 1) * (-(-q // chunks)) >= q)
    return rep


def _pcp_rows(q: np.ndarray, is_prefilling: np.ndarray, pcp_size: int, rank: int, dcp_size: int,
              shard_decodes: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(request, offset, length) of every chunk rank `rank` gets, in vLLM's local row order."""
    chunks = 2 * pcp_size
    rep = pcp_replicated(q, is_prefilling, pcp_size, dcp_size)
    live = q > 0
    cs = -(-q // chunks)
    off_a = np.where(rep, 0, rank * cs)
    len_a = np.where(rep, q, np.minimum(np.maximum(q - rank * cs, 0), cs))
    if shard_decodes:  # PCP without DCP: each replicated request has one owner, round robin
        ordinal = np.cumsum(rep & live) - 1
        len_a = np.where(rep & (ordinal % pcp_size != rank), 0, len_a)
    off_b = (chunks - 1 - rank) * cs
    len_b = np.where(rep, 0, np.minimum(np.maximum(q - off_b, 0), cs))
    idx = np.arange(q.size)
    req = np.concatenate([idx, idx])
    off = np.concatenate([off_a, off_b])
    ln = np.concatenate([len_a, len_b])
    keep = np.concatenate([live, live]) & (ln > 0)
    req, off, ln = req[keep], off[keep], ln[keep]
    order = np.lexsort((off, req, np.asarray(is_prefilling, dtype=bool)[req]))  # decodes first
    return req[order], off[order], ln[order]


def pcp_partition(query_lens: np.ndarray, num_computed: np.ndarray, is_prefilling: np.ndarray, pcp_size: int,
                  pcp_rank: int, dcp_size: int = 1, shard_decodes: bool | None = None) -> PcpLocal:
    """The rows PCP rank `pcp_rank` runs (vLLM's `PCPManager.partition_batch`, before padding).

    A prefill of q tokens is cut into 2P chunks of ceil(q/2P); rank p gets chunks p and 2P-1-p as
    two local rows, empty chunks dropped. Decodes (and, with DCP > 1, prefills too short to fill
    every chunk) are replicated whole to every rank; without DCP each decode has one owner
    (`pcp_shard_decode_requests`, the default when dcp_size == 1). Rows are ordered decodes first,
    then by request and chunk. A rank with nothing to run gets one empty row (seq_len 0), as vLLM
    does. local seq_len = computed tokens + end of the chunk. With pcp_size 1 vLLM has no PCP
    manager and the batch is unchanged.
    """
    q = np.asarray(query_lens, dtype=np.int64)
    comp = np.asarray(num_computed, dtype=np.int64)
    if pcp_size < 1 or not 0 <= pcp_rank < pcp_size:
        raise ValueError(f"pcp_rank {pcp_rank} out of range for pcp_size {pcp_size}")
    if pcp_size == 1:
        req = np.arange(q.size)
        return PcpLocal(req, np.zeros(q.size, np.int32), q.astype(np.int32), (comp + q).astype(np.int32))
    if shard_decodes is None:
        shard_decodes = dcp_size == 1
    req, off, ln = _pcp_rows(q, is_prefilling, pcp_size, pcp_rank, dcp_size, shard_decodes)
    if req.size == 0:
        z = np.zeros(1, np.int32)
        return PcpLocal(np.zeros(1, np.intp), z, z, z)
    return PcpLocal(req, off.astype(np.int32), ln.astype(np.int32), (comp[req] + off + ln).astype(np.int32))


def pcp_rank_tokens(query_lens: np.ndarray, is_prefilling: np.ndarray, pcp_size: int, dcp_size: int = 1,
                    shard_decodes: bool | None = None) -> np.ndarray:
    """Tokens each PCP rank runs; the runner dispatches CUDA graphs on the largest
    (`get_num_tokens_for_dispatch`)."""
    q = np.asarray(query_lens, dtype=np.int64)
    if pcp_size == 1:
        return np.array([int(q.sum())])
    if shard_decodes is None:
        shard_decodes = dcp_size == 1
    return np.array([int(_pcp_rows(q, is_prefilling, pcp_size, p, dcp_size, shard_decodes)[2].sum())
                     for p in range(pcp_size)])
