"""Torch reference for DCP-local sequence lengths: the executable spec of DESIGN §1."""

from __future__ import annotations

import torch


def dcp_local_seq_lens(seq_lens: torch.Tensor, dcp_size: int, dcp_rank: int | torch.Tensor,
                       cp_interleave: int = 1) -> torch.Tensor:
    """local(L, r) = rounds*I + min(max(rem - r*I, 0), I), rounds = L // (N*I), rem = L % (N*I).

    seq_lens: [n] any integer dtype; dcp_rank: an int or a tensor broadcastable to seq_lens.
    Returns [n] int32 on seq_lens' device. int64 inside, so no intermediate can overflow.
    """
    if dcp_size < 1 or cp_interleave < 1:
        raise ValueError(f"dcp_size and cp_interleave must be >= 1, got {dcp_size} and {cp_interleave}")
    L = seq_lens.to(torch.int64)
    span = dcp_size * cp_interleave
    rounds = torch.div(L, span, rounding_mode="floor")
    rem = L - rounds * span
    r = dcp_rank.to(torch.int64) if isinstance(dcp_rank, torch.Tensor) else dcp_rank
    return (rounds * cp_interleave + (rem - r * cp_interleave).clamp(0, cp_interleave)).to(torch.int32)


def dcp_local_seq_lens_all_ranks(seq_lens: torch.Tensor, dcp_size: int, cp_interleave: int = 1) -> torch.Tensor:
    """[n] -> [n, dcp_size]: every rank's local length (vLLM's get_dcp_local_seq_lens with rank=None)."""
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
    lens = offsets[1:] - offsets[:-1]
    obs = torch.repeat_interleave(torch.arange(lens.numel(), device=seq_lens.device), lens)
    j = torch.arange(seq_lens.numel(), device=seq_lens.device) - offsets[:-1][obs]
    local = dcp_local_seq_lens(seq_lens, dcp_size, ranks[obs], cp_interleave)
    return torch.where(j < num_reqs[obs], local, torch.zeros_like(local))


def check_rows(seq_lens: torch.Tensor, rows: torch.Tensor, dcp: torch.Tensor, dcp_rows: torch.Tensor,
               num_reqs: torch.Tensor, num_reqs_padded: torch.Tensor, ranks: torch.Tensor, dcp_size: int,
               cp_interleave: int = 1, *, kv_pages: torch.Tensor | None = None, page_size: int = 1) -> torch.Tensor:
    """Compare every recorded DCP view (and page count) with what it must hold; [6, n] int32 per
    observation: wrong real rows, first wrong real row, bad padded rows, first bad padded row, real
    rows whose kv_pages != cdiv(local, page_size), first such row (-1 where none; kv_pages -1 = unknown).

    Only view rows [0, min(view length, num_reqs_padded)) are compared: a short or long view is a
    `shape` finding, not a value one. seq_lens/rows/kv_pages: [R]/[n+1]/[R]; dcp/dcp_rows: [D]/[n+1].
    """
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
    return out
