"""The executable spec of docs/dcp.md: DCP-local sequence lengths, the one body of the formula.

local(L, r) = rounds*I + min(max(rem - r*I, 0), I), rounds = L // (N*I), rem = L % (N*I).
`local_of` is that body, written once against operators numpy arrays and torch tensors share; the
numpy form (`local_np`), the torch form (`dcp_local_seq_lens`), the scan, provenance and the
simulator call it. The Triton kernels (kernel_tl.py's `local_of`) restate it in Triton, which
cannot call Python; tests hold the two equal. torch is imported by the torch forms only: the numpy
form serves the CPU replay, which never pays for importing torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:
    import torch


def rounds_rem(L, dcp_size: int, cp_interleave):
    """(rounds, rem) with L = rounds * (N*I) + rem, 0 <= rem < N*I, in L's dtype (numpy or torch).

    A power-of-two N*I on a numpy array is a shift and a mask (the scan's hot path; same floor
    semantics as // and %)."""
    span = dcp_size * cp_interleave
    if isinstance(L, np.ndarray) and np.ndim(span) == 0:
        span = int(span)  # (an int, a numpy scalar or a 0-d array alike: one shift path for all of them)
        if span & (span - 1) == 0:
            return L >> (span.bit_length() - 1), L & (span - 1)
    rounds = L // span
    return rounds, L - rounds * span


def _clip_np(x, lo, hi):
    # np.minimum(np.maximum()) rather than np.clip (slow on small arrays, measured in the simulator), in place
    # on a fresh array (the scan's chunks: one allocation less per pass)
    if isinstance(x, np.ndarray):
        np.maximum(x, lo, out=x)
        return np.minimum(x, hi, out=x)
    if isinstance(x, int):  # one value (a finding's row): Python ints, not a numpy call
        return min(max(x, lo), hi)
    return np.minimum(np.maximum(x, lo), hi)


def local_of(L, rank, dcp_size: int, cp_interleave, clip: Callable = _clip_np):
    """The formula's one body, computed in L's dtype (the caller picks int32 or int64): numpy arrays with
    the default clip, torch tensors with clip=`_clip_torch`. rank and cp_interleave broadcast against L."""
    rounds, rem = rounds_rem(L, dcp_size, cp_interleave)
    out = clip(rem - rank * cp_interleave, 0, cp_interleave)  # fresh, of the full broadcast shape
    out += rounds * cp_interleave
    return out


def slot_deal(pos, block, dcp_size: int, cp_interleave):
    """How vLLM's slot-mapping kernel deals a KV-cache group's positions to the DCP ranks
    (_compute_slot_mappings_kernel): by virtual blocks of `block * dcp_size` positions, I-position runs in turn
    within each. Returns (the rank that writes each position, its position in that rank's cache), in pos's dtype
    (numpy arrays or torch tensors). Dealt by the KV-cache manager's block (a multiple of I, which vLLM asserts)
    this is (p // I) % N, the owner docs/dcp.md gives; by a block I does not divide, positions go elsewhere."""
    vb = block * dcp_size
    vo = pos % vb
    owner = vo // cp_interleave % dcp_size
    local = pos // vb * block + vo // (cp_interleave * dcp_size) * cp_interleave + vo % cp_interleave
    return owner, local


_DEAL_PERIOD_CAP = 1 << 20  # positions compared per block pair (a deal that differs does so within two virtual blocks)


def misdealt(dealt: int, manager: int, dcp_size: int, cp_interleave: int) -> int:
    """The first position that dealing by `dealt`-position blocks (slot_deal) sends to another rank or another
    place in its cache than dealing by the KV-cache manager's `manager`-position blocks, or -1: none (one period
    of both)."""
    if dealt == manager:
        return -1
    p = np.arange(min(math.lcm(dealt, manager) * dcp_size, _DEAL_PERIOD_CAP), dtype=np.int64)
    got, want = slot_deal(p, dealt, dcp_size, cp_interleave), slot_deal(p, manager, dcp_size, cp_interleave)
    bad = np.flatnonzero((got[0] != want[0]) | (got[1] != want[1]))
    return int(bad[0]) if bad.size else -1


def last_page(length, page: int):
    """FlashInfer's last-page length of a plan covering `length` tokens (_compute_flashinfer_kv_metadata): the
    length modulo the page, a full page where the page divides a non-zero length."""
    r = length % page
    return np.where((r == 0) & (length != 0), page, r)


def local_np(seq: np.ndarray, dcp_size: int, rank, cp_interleave) -> np.ndarray:
    """The formula in numpy (int64), for the rows provenance, row views and the simulator look at."""
    il = np.asarray(cp_interleave, np.int64)  # an int, or an array broadcasting against seq
    return local_of(np.asarray(seq, dtype=np.int64), np.asarray(rank, np.int64), dcp_size, il)


def group_lens_np(seq: np.ndarray, num_reqs: int, rank, dcp_size: int, cp_interleave: int,
                  sharded: list[bool]) -> np.ndarray:
    """What each KV-cache group's attention reads for one batch (rows.group_seq_lens' layout): per group in order,
    one value per seq_lens row, a DCP-sharded group the rank's local lengths, a replicated one the global ones;
    padded rows 0. `rank` may be an [N, 1] array: every rank's at once ([N, groups * rows])."""
    seq = np.where(np.arange(np.shape(seq)[-1]) < num_reqs, np.asarray(seq, np.int64), 0)
    loc = local_np(seq, dcp_size, rank, cp_interleave)
    glob = np.broadcast_to(seq, loc.shape)
    return np.concatenate([loc if s else glob for s in sharded], axis=-1) if sharded else loc[..., :0]


def verify_lens_np(seq: np.ndarray, qsl: np.ndarray, tokens: int, rank, dcp_size: int, cp_interleave) -> np.ndarray:
    """Per query token of the batch's first `tokens` (rows.verify_row_lens' layout): the rank's KV positions the
    token attends to, local(position + 1), token t of row r at position seq_len - (query_start_loc[r + 1] - t)
    (the causal offset in global positions, then the shard mapping). `rank` may be [N, 1] ([N, tokens])."""
    q = np.asarray(qsl, np.int64) - int(qsl[0])
    t = np.arange(tokens, dtype=np.int64)
    row = np.searchsorted(q[1:], t, "right")
    return local_np(np.asarray(seq, np.int64)[..., row] - (q[row + 1] - t) + 1, dcp_size, rank, cp_interleave)


def ranks_giving(L: np.ndarray, v: np.ndarray, dcp_size: int, cp_interleave: int):
    """The formula inverted row by row (int64 arrays): the ranks r with local(L, r) == v are [lo, hi) where ok.

    local(L, r) is rounds*I + I for r < rem // I, rounds*I + rem % I at r = rem // I, and rounds*I
    from cdiv(rem, I) on: the ranks giving a value form one interval."""
    il = cp_interleave
    rounds, rem = rounds_rem(L, dcp_size, il)
    base = rounds * il
    full, empty = v == base + il, v == base
    part = (v == base + rem % il) & (rem % il != 0)
    lo = np.where(full, 0, np.where(empty, -(-rem // il), rem // il))
    hi = np.where(full, rem // il, np.where(empty, dcp_size, rem // il + 1))
    return lo, hi, full | empty | part


def _clip_torch(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return x.clamp(lo, hi)


def dcp_local_seq_lens(seq_lens: torch.Tensor, dcp_size: int, dcp_rank: int | torch.Tensor,
                       cp_interleave: int = 1) -> torch.Tensor:
    """local(L, r) = rounds*I + min(max(rem - r*I, 0), I), rounds = L // (N*I), rem = L % (N*I).

    seq_lens: [n] any integer dtype; dcp_rank: an int or a tensor broadcastable to seq_lens.
    Returns [n] int32 on seq_lens' device. int64 inside, so no intermediate can overflow.
    """
    import torch

    if dcp_size < 1 or cp_interleave < 1:
        raise ValueError(f"dcp_size and cp_interleave must be >= 1, got {dcp_size} and {cp_interleave}")
    r = dcp_rank.to(torch.int64) if isinstance(dcp_rank, torch.Tensor) else dcp_rank
    return local_of(seq_lens.to(torch.int64), r, dcp_size, cp_interleave, _clip_torch).to(torch.int32)


def dcp_local_seq_lens_all_ranks(seq_lens: torch.Tensor, dcp_size: int, cp_interleave: int = 1) -> torch.Tensor:
    """[n] -> [n, dcp_size]: every rank's local length (vLLM's get_dcp_local_seq_lens with rank=None)."""
    import torch

    ranks = torch.arange(dcp_size, device=seq_lens.device)
    return dcp_local_seq_lens(seq_lens.reshape(-1, 1), dcp_size, ranks.reshape(1, -1), cp_interleave)


def prepare_dcp_local_seq_lens(buf: torch.Tensor, seq_lens: torch.Tensor, num_reqs: int, dcp_size: int,
                               dcp_rank: int, cp_interleave: int = 1, *,
                               num_reqs_padded: int | None = None) -> torch.Tensor:
    """The engine's helper, by the formula: rows < num_reqs get local(L, r), every other row of the
    persistent buffer is written 0; returns the view buf[:num_reqs_padded] (the whole buffer if None)."""
    buf[:num_reqs] = dcp_local_seq_lens(seq_lens[:num_reqs], dcp_size, dcp_rank, cp_interleave).to(buf.dtype)
    buf[num_reqs:] = 0
    return buf[:num_reqs_padded]


def expected_rows(seq_lens: torch.Tensor, offsets: torch.Tensor, num_reqs: torch.Tensor, ranks: torch.Tensor,
                  dcp_size: int, cp_interleave: int = 1) -> torch.Tensor:
    """Expected DCP rows of every observation at once, aligned with seq_lens' layout.

    seq_lens: [R] rows of all observations; offsets: [n+1]; num_reqs, ranks: [n].
    Row j of observation i is local(seq_lens[offsets[i]+j], ranks[i]) when j < num_reqs[i], else 0.
    """
    import torch

    lens = offsets[1:] - offsets[:-1]
    obs = torch.repeat_interleave(torch.arange(lens.numel(), device=seq_lens.device), lens)
    j = torch.arange(seq_lens.numel(), device=seq_lens.device) - offsets[:-1][obs]
    local = dcp_local_seq_lens(seq_lens, dcp_size, ranks[obs], cp_interleave)
    return torch.where(j < num_reqs[obs], local, torch.zeros_like(local))


@dataclass
class RowStats:
    """The row check's answer, one column per observation: how many of its rows are wrong of each kind and the
    first (-1: none). `obs` names the observations of the columns (None: every observation in order, as check_rows
    and the fused kernels give them; the scan keeps only those with something wrong: `sparse`). The columns are
    torch tensors or numpy arrays alike. `differ`: the observations whose seq_lens rows differ from their pair's
    (the scan's, when asked for)."""

    n_wrong: Any  # real view rows != local(L, rank)
    first_wrong: Any  # the first such row
    n_pad: Any  # padded view rows [num_reqs, num_reqs_padded) that are not 0
    first_pad: Any
    n_pages: Any  # real rows whose kv_pages != cdiv(local, page_size) (kv_pages -1 = unknown)
    first_pages: Any
    obs: np.ndarray | None = None
    differ: np.ndarray | None = field(default=None, compare=False)

    KINDS: ClassVar[tuple[str, ...]] = ("wrong", "pad", "pages")

    def columns(self) -> tuple:
        return self.n_wrong, self.first_wrong, self.n_pad, self.first_pad, self.n_pages, self.first_pages

    def stacked(self):
        """[6, n] in field order (a tensor of tensors, an array of arrays)."""
        cols = self.columns()
        if isinstance(self.n_wrong, np.ndarray):
            return np.stack(cols)
        import torch

        return torch.stack(cols)

    def sparse(self, first: int = 0) -> RowStats:
        """The observations with something wrong (numpy; every observation's columns, the first at `first`)."""
        cols = [np.asarray(c) for c in self.columns()]
        hit = np.flatnonzero((cols[0] > 0) | (cols[2] > 0) | (cols[4] > 0))
        return RowStats(*(c[hit] for c in cols), obs=hit + first)

    @staticmethod
    def empty() -> RowStats:
        z = np.zeros(0, np.int64)
        return RowStats(z, z, z, z, z, z, obs=z)

    @staticmethod
    def concat(parts: list[RowStats]) -> RowStats:
        """Sparse parts of disjoint, ascending observations as one."""
        parts = [p for p in parts if p.obs.size]
        if not parts:
            return RowStats.empty()
        cols = [np.concatenate(x) for x in zip(*(p.columns() for p in parts))]
        return RowStats(*cols, obs=np.concatenate([p.obs for p in parts]))


def check_rows(seq_lens: torch.Tensor, rows: torch.Tensor, dcp: torch.Tensor, dcp_rows: torch.Tensor,
               num_reqs: torch.Tensor, num_reqs_padded: torch.Tensor, ranks: torch.Tensor, dcp_size: int,
               cp_interleave: int = 1, *, kv_pages: torch.Tensor | None = None, page_size: int = 1) -> RowStats:
    """Compare every recorded DCP view (and page count) with what it must hold: RowStats of every observation.

    Only view rows [0, min(view length, num_reqs_padded)) are compared: a short or long view is a
    `shape` finding, not a value one. seq_lens/rows/kv_pages: [R]/[n+1]/[R]; dcp/dcp_rows: [D]/[n+1].
    """
    import torch

    n = num_reqs.shape[0]
    dev = dcp.device
    out = torch.full((6, n), -1, dtype=torch.int32, device=dev)
    zero = torch.zeros((), dtype=torch.int32, device=dev)

    def per_row(offsets: torch.Tensor, total: int):
        lens = offsets[1:] - offsets[:-1]
        obs = torch.repeat_interleave(torch.arange(n, device=dev), lens)
        return obs, torch.arange(total, device=dev) - offsets[:-1][obs]

    def reduce(k: int, obs: torch.Tensor, j: torch.Tensor, sel: torch.Tensor) -> None:
        o = obs[sel]
        out[k] = torch.bincount(o, minlength=n).to(torch.int32)
        first = torch.full((n,), torch.iinfo(torch.int64).max, dtype=torch.int64, device=dev)
        first.scatter_reduce_(0, o, j[sel], reduce="amin")
        out[k + 1] = torch.where(out[k] > 0, first, -1).to(torch.int32)

    obs, j = per_row(dcp_rows, dcp.shape[0])
    real = j < num_reqs.to(torch.int64)[obs]
    checked = j < num_reqs_padded.to(torch.int64)[obs]
    seq_idx = torch.where(real, rows[:-1][obs] + j, torch.zeros_like(j))
    seq = seq_lens[seq_idx] if seq_lens.numel() else torch.zeros_like(j)
    exp = torch.where(real, dcp_local_seq_lens(seq, dcp_size, ranks[obs], cp_interleave), zero)
    bad = checked & (dcp.to(torch.int32) != exp)
    reduce(0, obs, j, bad & real)
    reduce(2, obs, j, bad & ~real)
    if kv_pages is None:
        out[4] = 0
    else:
        obs, j = per_row(rows, seq_lens.shape[0])
        real = j < num_reqs.to(torch.int64)[obs]
        allowed = -torch.div(-dcp_local_seq_lens(seq_lens, dcp_size, ranks[obs], cp_interleave).to(torch.int64),
                             page_size, rounding_mode="floor")
        reduce(4, obs, j, real & (kv_pages >= 0) & (kv_pages.to(torch.int64) != allowed))
    return RowStats(*out)
