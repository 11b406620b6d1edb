"""The slot rules' screen: cheap whole-chunk passes that pick the runs of a chunk that can have a finding."""

from __future__ import annotations

import sys
from typing import NamedTuple

import numpy as np


def merged(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The sorted union of two int arrays as int64 (np.union1d's hashing costs more on these small arrays)."""
    c = np.concatenate((a, b)).astype(np.int64)
    c.sort()
    return c[np.r_[True, c[1:] != c[:-1]]] if c.size else c


def _pow2(x) -> bool:
    return bool(np.all((x > 0) & (x & (x - 1) == 0)))


def _log2(x: int) -> int:
    return int(x).bit_length() - 1


_BYTE_SUM = np.uint64(0x0101010101010101)  # (x * this) >> 56: the sum of x's 8 bytes where each is 0 or 1


def _true_before(w: np.ndarray, start: np.ndarray) -> np.ndarray:
    """For each k (start sorted, start[0] == 0, each < w.size // 8 * 8): how many of w[:start[k]] are True. `w`
    is a bool array of whole 8-byte words (its padding False). Summed 8 entries per word (little-endian):
    np.add.reduceat with a cast pays about a microsecond per run, np.flatnonzero a pass of its own."""
    if sys.byteorder != "little":
        return np.searchsorted(np.flatnonzero(w), start)
    words = w.view(np.uint64)
    per = ((words * _BYTE_SUM) >> np.uint64(56)).view(np.int64)
    q = start >> 3
    new = np.ones(q.size, bool)
    np.not_equal(q[1:], q[:-1], out=new[1:])
    qu = q[new]
    cum = np.cumsum(np.add.reduceat(per, qu)) - np.add.reduceat(per, qu)  # per[qu[0]:qu[i]] (qu[0] == 0)
    part = words[q] & ((np.uint64(1) << (start & 7).astype(np.uint64) * np.uint64(8)) - np.uint64(1))
    return cum[np.cumsum(new) - 1] + ((part * _BYTE_SUM) >> np.uint64(56)).view(np.int64)


class SlotScreen(NamedTuple):
    """Per run of a chunk, from the screen (one pass of cheap whole-chunk operations)."""
    clean: np.ndarray  # exact: no value below -1, no padded write, and its real tokens' writes are exactly the
    #                    positions it owns (every one in a replicated group) or none at all: slot-partition's fact
    suspect: np.ndarray  # may have a slots finding (not clean, or a written slot off its offset or written twice)
    writes: np.ndarray  # some real token writes a slot


def slot_screen(pos: np.ndarray, slot: np.ndarray, start: np.ndarray, run_len: np.ndarray, r_rank: np.ndarray,
                r_sh: np.ndarray, r_bs: np.ndarray, nr: np.ndarray, N: int, I_: int) -> SlotScreen:
    """Which runs of a chunk (Recorder's layout: each run's entries consecutive) can have a finding. Most
    entries of a correct build are fine, so the exact kind/offset/duplicate work (slot_pass.slot_findings) is left to
    the observations this flags; the screen only has to never miss one. A few whole-chunk passes on int32/bool
    (shifts and masks where N, I and B are powers of two: numpy's % costs several times a mask); the per-run
    facts are counts of the passes' True entries before each run's start, real/padding boundary and end
    (_true_before), not per-entry spreads of them."""
    n = slot.size
    wpad = np.empty((n // 8 + 1) * 8, bool)  # (whole words, one past the end, for _true_before)
    wpad[n:] = False
    w = wpad[:n]
    np.greater_equal(slot, 0, out=w)
    pts = np.append(np.stack([start, start + nr], 1).ravel(), n)  # sorted: start <= real end <= next start
    cw = _true_before(wpad, pts)
    w_real, w_pad = cw[1::2] - cw[:-1:2], cw[2::2] - cw[1::2]
    writes = w_real > 0
    # a run that writes must write every real token it owns (all of them in a replicated group) and nothing else;
    # one that does not must write nothing at all (padding included)
    clean = w_pad == 0
    known = (r_bs > 0) & (~r_sh | (r_bs % I_ == 0)) & writes  # offsets: where vLLM's precondition holds
    sh = r_sh & writes
    # where N, I and the block sizes are powers of two with B N <= 2**16, ownership and offsets depend on the
    # low 16 bits of position and slot only: work on those (uint16, a quarter of the memory traffic)
    lo16 = (sys.byteorder == "little" and _pow2(N) and _pow2(I_) and _pow2(r_bs[known])
            and int(r_bs[known].max(initial=1)) * N * I_ <= 1 << 16)
    if lo16:
        pos, slot = np.ascontiguousarray(pos), np.ascontiguousarray(slot)  # (views of int32 as uint16 pairs)
    p = pos.view(np.uint16)[::2].copy() if lo16 else pos.astype(np.int64)
    if sh.any():
        own = np.bitwise_and(p >> _log2(I_) if I_ > 1 else p, N - 1) if lo16 else p // I_ % N
        xpad = np.empty_like(wpad)
        xpad[n:] = False
        x = xpad[:n]
        np.equal(own, np.repeat(r_rank.astype(own.dtype), run_len), out=x)
        np.not_equal(x, w, out=x)  # owned but not written, or written but not owned
        cx = _true_before(xpad, pts)
        clean &= ~writes | np.where(r_sh, cx[1::2] == cx[:-1:2], w_real == nr)
    else:
        clean &= ~writes | (w_real == nr)
    if n and int(np.minimum.reduce(slot)) < -1:
        clean &= ~np.logical_or.reduceat(slot < -1, start)
    suspect = ~clean | (r_rank < 0) | (r_rank >= N)  # (a rank out of range: compared on its low bits below)
    # vLLM's offset of position p in a block of B is congruent mod B to f(p) = p in a replicated group and to
    # (p // (I N)) * I + p % I in a sharded one, so a slot at the right offset has (slot - f(p)) % B == 0
    # (uint16 arithmetic wraps modulo 2**16, which keeps residues modulo a power of two <= 2**16)
    if known.any():
        if not r_sh.any():
            f = p.copy()
        else:
            if not lo16:
                f = p // (I_ * N) * I_ + p % I_
            elif I_ == 1:
                f = p >> _log2(N)
            else:
                f = ((p >> _log2(I_ * N)) << _log2(I_)) | (p & (I_ - 1))
            if not r_sh.all():
                np.copyto(f, p, where=np.repeat(~r_sh, run_len))
        np.subtract(slot.view(np.uint16)[::2] if lo16 else slot, f, out=f)
        b = r_bs[known]
        if not lo16:
            f %= np.repeat(np.where(known, r_bs, 1), run_len)
        elif known.all() and b.min() == b.max():
            f &= int(b[0]) - 1
        else:
            f &= np.repeat(np.where(known, r_bs - 1, 0).astype(np.uint16), run_len)
        off = f != 0
        off &= w
        suspect |= np.logical_or.reduceat(off, start)
    # duplicates (in the runs not suspect already): the written slots of a run split into strictly increasing
    # segments (one per request in a typical build); segments whose value ranges do not overlap share no slot
    if suspect.all():
        return SlotScreen(clean, suspect, writes)
    if suspect.any():
        np.logical_and(w, np.repeat(~suspect, run_len), out=w)
        cw = _true_before(wpad, pts)
    sc = slot[w]
    if sc.size > 1:
        cut = np.flatnonzero(sc[1:] <= sc[:-1]) + 1
        if cut.size:
            rs = cw[:-1:2]  # each run's first written entry in sc
            seg = merged(rs[rs < sc.size], cut)  # (the runs' starts and the cuts)
            suspect[_overlapping(sc, seg, np.searchsorted(rs, seg, "right") - 1)] = True
    return SlotScreen(clean, suspect, writes)


def _overlapping(sc: np.ndarray, seg: np.ndarray, s_run: np.ndarray) -> np.ndarray:
    """Written slots `sc` (0 <= slot < 2**31) in strictly increasing segments starting at `seg`, of runs `s_run`:
    the runs two of whose segments' value ranges overlap (the others cannot write a slot twice)."""
    s_lo, s_hi = sc[seg], sc[np.append(seg[1:], sc.size) - 1]
    o = np.lexsort((s_lo, s_run))
    s_run, s_lo = s_run[o], s_lo[o]
    top = np.maximum.accumulate(s_run.astype(np.int64) << 32 | s_hi[o])  # highest slot so far in the run
    return s_run[1:][(s_run[1:] == s_run[:-1]) & (s_lo[1:] <= (top[:-1] & 0xFFFFFFFF))]
