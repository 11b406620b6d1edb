"""Triton: the Guard's check kernel (guard_dev.py says what it does). Imported only through dcp.backend.load."""

import triton
import triton.language as tl

from dcptool.dcp.kernel_tl import _local
from dcptool.engine.guard_dev import (
    BIT_EMPTY,
    BIT_MISSING,
    BIT_PADDING,
    BIT_PAGES,
    BIT_SHAPE,
    BIT_SLOTS,
    BIT_TOT,
    BIT_VALUES,
    GUARD_BLOCK,
    HEAD,
    SECTIONS,
    W_COUNTS,
    W_KEPT,
)

_ARGS = ["keep", "words", "cap", "tcap", "N", "I", "page", "step", "site", "rank", "ubatch", "nr", "nrp", "parent",
         "req_start", "tok_start", "tok_stop", "ntp", "graph", "buf_lo", "buf_hi", "seq_p", "n_seq", "dcp_p", "n_dcp",
         "qsl_p", "n_qsl", "kv_p", "n_kv", "dq_p", "n_dq", "tot_p", "n_tot", "pos_p", "n_pos", "map_p", "n_groups",
         "shard_mask"]

_BLOCK = tl.constexpr(GUARD_BLOCK)
_VALUES, _PADDING, _SHAPE, _MISSING = (tl.constexpr(b) for b in (BIT_VALUES, BIT_PADDING, BIT_SHAPE, BIT_MISSING))
_PAGES, _EMPTY, _TOT, _SLOTS = (tl.constexpr(b) for b in (BIT_PAGES, BIT_EMPTY, BIT_TOT, BIT_SLOTS))
_HEAD = tl.constexpr(HEAD)
_SECTIONS = tl.constexpr(SECTIONS)
_W_COUNTS = tl.constexpr(W_COUNTS)
_W_KEPT = tl.constexpr(W_KEPT)


@triton.jit
def _keep_rows(out, src, n, kept):
    # copy n int32 values (n < 0: absent) from src into the slot section at out when the slot keeps rows
    for off in range(0, n * kept, _BLOCK):
        idx = off + tl.arange(0, _BLOCK)
        m = idx < n
        tl.store(out + idx, tl.load(src + idx, mask=m, other=0), mask=m)


@triton.jit
def _put(hv, hl, k, v):
    return tl.where(hl == k, v, hv)


@triton.jit(do_not_specialize=_ARGS)
def guard_kernel(ring, state, flag, keep, words, cap, tcap, N, I, page, step, site, rank, ubatch, nr, nrp, parent,
                 req_start, tok_start, tok_stop, ntp, graph, buf_lo, buf_hi,
                 seq_p, n_seq, dcp_p, n_dcp, qsl_p, n_qsl, kv_p, n_kv, dq_p, n_dq, tot_p, n_tot,
                 pos_p, n_pos, map_p, n_groups, shard_mask):
    # One program: the observation's index from the device counter (state[0], so every replay of a captured
    # launch gets its own), the checks of engine.guard_ref on the rows as attention was handed them, the
    # observation into ring slot index % keep (its header, then each section's rows) unless the ring is frozen at
    # an earlier wrong observation (state[1] = its index + 1); on a wrong one: state[1], state[2] += 1 (the wrong
    # count) and the host-mapped flag (written through its device address: no copy, no sync). The slot's header
    # is written even when its rows do not fit (kept = 0), so the host still learns what was wrong.
    idx = tl.atomic_add(state, 1)
    stop = tl.load(state + 1, volatile=True)
    seqp = seq_p.to(tl.pointer_type(tl.int32))
    dcpp = dcp_p.to(tl.pointer_type(tl.int32))
    qslp = qsl_p.to(tl.pointer_type(tl.int32))
    kvp = kv_p.to(tl.pointer_type(tl.int32))
    dqp = dq_p.to(tl.pointer_type(tl.int32))
    totp = tot_p.to(tl.pointer_type(tl.int32))
    bits = nr * 0
    bits = bits | tl.where((n_dcp < 0) & (N > 1), _MISSING, 0)
    bits = bits | tl.where((n_dcp >= 0) & (n_dcp != nrp), _SHAPE, 0)
    bits = bits | tl.where((n_dq > 0) & (N > 1) & (n_qsl > 0) & (n_dq > n_qsl), _EMPTY, 0)
    aligned = n_dcp == n_seq
    n_dv = tl.where(aligned, n_dcp, 0)  # the view's values are compared where it is aligned with seq_lens
    rows = tl.maximum(tl.maximum(n_seq, n_dcp), tl.maximum(n_dq, n_tot))
    acc = tl.zeros([_BLOCK], tl.int32)
    for off in range(0, rows, _BLOCK):
        j = off + tl.arange(0, _BLOCK)
        real = j < nr
        seq = tl.load(seqp + j, mask=j < n_seq, other=0).to(tl.int64)
        wide = tl.zeros_like(seq)
        local = _local(seq, wide + rank, (wide + N) * I, I)
        dv = tl.load(dcpp + j, mask=j < n_dv, other=0).to(tl.int64)
        acc = acc | tl.where(aligned & real & (j < n_seq) & (dv != local), _VALUES, 0)
        acc = acc | tl.where(aligned & (j >= nr) & (j < nrp) & (j < n_dcp) & (dv != 0), _PADDING, 0)
        kv = tl.load(kvp + j, mask=real & (j < n_kv), other=-1).to(tl.int64)
        acc = acc | tl.where((page > 0) & (kv >= 0) & (kv != (local + page - 1) // tl.maximum(page, 1)), _PAGES, 0)
        dq = tl.load(dqp + j, mask=j < n_dq, other=0)
        qv = tl.load(qslp + j, mask=(j < n_dq) & (j < n_qsl), other=0)
        acc = acc | tl.where((N > 1) & (n_qsl > 0) & (j < n_dq) & (j < n_qsl) & (dq != qv), _EMPTY, 0)
        tv = tl.load(totp + j, mask=real & (j < n_tot), other=0).to(tl.int64)
        acc = acc | tl.where((N > 1) & real & (j < n_tot) & (tv != seq), _TOT, 0)
    # slots: n_pos tokens, n_groups rows of slot_mapping ([groups, tokens]); the real tokens are qsl[nr]
    posp = pos_p.to(tl.pointer_type(tl.int32))
    mapp = map_p.to(tl.pointer_type(tl.int32))
    q = tl.load(qslp + nr + tl.arange(0, 2), mask=tl.arange(0, 2) < tl.where(nr < n_qsl, 1, 0), other=0)
    real_t = tl.where(n_qsl > nr, tl.sum(q, axis=0), n_pos)
    for g in range(0, n_groups):
        sharded = (shard_mask >> g) & 1
        writes = rank * 0
        for off in range(0, n_pos, _BLOCK):  # does this rank write anything in the group?
            t = off + tl.arange(0, _BLOCK)
            s = tl.load(mapp + g * n_pos + t, mask=t < n_pos, other=-1)
            writes = writes | tl.max(((t < real_t) & (s >= 0)).to(tl.int32), axis=0)
        for off in range(0, n_pos, _BLOCK):
            t = off + tl.arange(0, _BLOCK)
            m = t < n_pos
            p = tl.load(posp + t, mask=m, other=0)
            s = tl.load(mapp + g * n_pos + t, mask=m, other=-1)
            mine = ((p // I) % N == rank) | (sharded == 0)
            rt = t < real_t
            bad = (~rt & (s != -1)) | (s < -1) | (rt & (((s >= 0) & ~mine) | ((s == -1) & mine & (writes != 0))))
            acc = acc | tl.where(m & bad, _SLOTS, 0)
    bits = bits | tl.max(acc, axis=0)
    # the ring: frozen at the first wrong observation (stop != 0), so the wrong one stays last
    live = stop == 0
    fits = (n_seq <= cap) & (n_dcp <= cap) & (n_qsl <= cap) & (n_kv <= cap) & (n_dq <= cap) & (n_tot <= cap) & (
        n_pos * (n_groups + 1) <= tcap)
    slot = ring.to(tl.pointer_type(tl.int32)) + (idx % keep).to(tl.int64) * words
    hl = tl.arange(0, _HEAD)
    hv = tl.zeros([_HEAD], tl.int32)
    hv = _put(hv, hl, 0, idx + 1)
    hv = _put(hv, hl, 1, bits)
    hv = _put(_put(_put(_put(hv, hl, 2, step), hl, 3, site), hl, 4, rank), hl, 5, ubatch)
    hv = _put(_put(_put(_put(hv, hl, 6, nr), hl, 7, nrp), hl, 8, parent), hl, 9, req_start)
    hv = _put(_put(_put(_put(hv, hl, 10, tok_start), hl, 11, tok_stop), hl, 12, ntp), hl, 13, graph)
    hv = _put(_put(hv, hl, 14, buf_lo), hl, 15, buf_hi)
    hv = _put(_put(_put(_put(hv, hl, _W_COUNTS, n_seq), hl, _W_COUNTS + 1, n_dcp), hl, _W_COUNTS + 2, n_qsl),
              hl, _W_COUNTS + 3, n_kv)
    hv = _put(_put(_put(_put(hv, hl, _W_COUNTS + 4, n_dq), hl, _W_COUNTS + 5, n_tot), hl, _W_COUNTS + 6, n_pos),
              hl, _W_COUNTS + 7, n_groups)
    hv = _put(hv, hl, _W_KEPT, fits.to(tl.int32))
    tl.store(slot + hl, hv, mask=hl < tl.where(live, _HEAD, 0))
    k = (live & fits).to(tl.int32)
    _keep_rows(slot + _HEAD, seqp, n_seq, k)
    _keep_rows(slot + _HEAD + cap, dcpp, n_dcp, k)
    _keep_rows(slot + _HEAD + 2 * cap, qslp, n_qsl, k)
    _keep_rows(slot + _HEAD + 3 * cap, kvp, n_kv, k)
    _keep_rows(slot + _HEAD + 4 * cap, dqp, n_dq, k)
    _keep_rows(slot + _HEAD + 5 * cap, totp, n_tot, k)
    _keep_rows(slot + _HEAD + _SECTIONS * cap, posp, n_pos, k)
    _keep_rows(slot + _HEAD + _SECTIONS * cap + n_pos, mapp, n_pos * n_groups, k)
    if bits != 0:
        if live:
            tl.store(state + 1, idx + 1)
        tl.atomic_add(state + 2, 1)
        tl.store(flag.to(tl.pointer_type(tl.int32)), 1)
