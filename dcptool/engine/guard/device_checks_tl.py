"""Triton: the Guard's check kernel (device_checks.py says what it does). Imported only through dcp.backend.load."""

import triton
import triton.language as tl

from dcptool.dcp.backend import interpreted
from dcptool.dcp.kernel_tl import local_of
from dcptool.engine.guard.device_checks import (
    BIT,
    DEVICE_HALVES,
    GUARD_BLOCK,
    GUARD_BLOCK_INTERPRETED,
    GUARD_GROUPS,
    GUARD_TOKEN_BLOCK,
    HEAD,
    KERNEL_ARGS,
    SECTIONS,
    W_COUNTS,
    W_HOST,
    W_KEPT,
)

_ARGS = list(KERNEL_ARGS)

# (the GPU's time grows with the loops' trips, one round trip to memory each: 1,024 rows in one; the interpreter's
# with the block's size too, past a few hundred lanes: the CPU tests' blocks are smaller)
_BLOCK = tl.constexpr(GUARD_BLOCK_INTERPRETED if interpreted() else GUARD_BLOCK)
_TBLOCK = tl.constexpr(GUARD_BLOCK_INTERPRETED if interpreted() else GUARD_TOKEN_BLOCK)
_GROUPS = tl.constexpr(GUARD_GROUPS)
# each check's bit, by the name the rule table gives it (device_checks.KERNEL_CHECKS)
_MISSING, _VALUES, _PADDING, _SHAPE = (tl.constexpr(BIT[n]) for n in ("missing", "values", "padding", "shape"))
_PAGES, _EMPTY, _TOT, _SLOTS = (tl.constexpr(BIT[n]) for n in ("pages", "empty-mask", "tot-lens", "slots"))
_HOST_COPY, _PLAN = (tl.constexpr(BIT[n]) for n in DEVICE_HALVES)
_NBITS = tl.constexpr(triton.next_power_of_2(len(BIT)))
_HEAD = tl.constexpr(HEAD)
_SECTIONS = tl.constexpr(SECTIONS)
_W_COUNTS = tl.constexpr(W_COUNTS)
_W_KEPT = tl.constexpr(W_KEPT)
_W_HOST = tl.constexpr(W_HOST)


@triton.jit(do_not_specialize=_ARGS)
def guard_kernel(ring: tl.int64, state: tl.int64, flag: tl.int64, keep: tl.int32, words: tl.int32, cap: tl.int32,
                 tcap: tl.int32, N: tl.int32, I: tl.int32, page: tl.int32, step: tl.int32, site: tl.int32,
                 rank: tl.int32, ubatch: tl.int32, nr: tl.int32, nrp: tl.int32, parent: tl.int32,
                 req_start: tl.int32, tok_start: tl.int32, tok_stop: tl.int32, ntp: tl.int32, graph: tl.int32,
                 buf_lo: tl.int32, buf_hi: tl.int32, seq_p: tl.int64, n_seq: tl.int32, dcp_p: tl.int64,
                 n_dcp: tl.int32, qsl_p: tl.int64, n_qsl: tl.int32, kv_p: tl.int64, n_kv: tl.int32, dq_p: tl.int64,
                 n_dq: tl.int32, tot_p: tl.int64, n_tot: tl.int32, pos_p: tl.int64, n_pos: tl.int32,
                 map_p: tl.int64, n_groups: tl.int32, shard_mask: tl.int32, wide: tl.int32, map_stride: tl.int32,
                 hv_p: tl.int64, n_hs: tl.int32, n_pre: tl.int32, n_last: tl.int32, hbits: tl.int32, hidx: tl.int32):
    # One program: the observation's index from the device counter (state[0], so every replay of a captured
    # launch gets its own), the checks of engine.guard.host_checks on the rows as attention was handed them, the
    # observation into ring slot index % keep (its header, then each section's rows) unless the ring is frozen at
    # an earlier wrong observation (state[1] = its index + 1); on a wrong one: state[1], state[2] += 1 (the wrong
    # count) and the host-mapped flag (written through its device address: no copy, no sync). The slot's header
    # is written even when its rows do not fit (kept = 0), so the host still learns what was wrong. Every address
    # is an integer argument (the launcher's C entry takes the arguments as they are: launch.py); the rows are
    # checked and kept in one pass (each block of every section loaded once: one round trip to memory per block,
    # not one per section). wide: bit 0 positions int64, bit 1 the slot mapping int64 (vLLM's, narrowed here:
    # no conversion launched on the host); map_stride: the slot mapping's row stride in elements. hbits: the rule
    # bits of the observation's host values, decided on the host (ORed in); hidx: its host index (header word 25).
    # hv_p: int64 host values in host memory (device_checks.HostValues), n_hs of the host copy of seq_lens, then
    # n_pre prefill page counts and n_last last pages (each -1: not given; a row past them: not recorded), compared
    # here with seq_lens and query_start_loc as host_checks compares them (host-copy's stale half, plan-pages).
    st = state.to(tl.pointer_type(tl.int32))
    idx = tl.atomic_add(st, 1, sem="relaxed")  # (an index only: no fence before the loads)
    stop = tl.load(st + 1, volatile=True)
    seqp = seq_p.to(tl.pointer_type(tl.int32))
    dcpp = dcp_p.to(tl.pointer_type(tl.int32))
    qslp = qsl_p.to(tl.pointer_type(tl.int32))
    kvp = kv_p.to(tl.pointer_type(tl.int32))
    dqp = dq_p.to(tl.pointer_type(tl.int32))
    totp = tot_p.to(tl.pointer_type(tl.int32))
    hsp = hv_p.to(tl.pointer_type(tl.int64))
    prep = hsp + tl.maximum(n_hs, 0)
    lastp = prep + tl.maximum(n_pre, 0)
    # plan-pages on the real rows where a plan is given, a page size set and query_start_loc holds num_reqs + 1 rows
    plan = (page > 0) & (nr > 0) & (n_qsl >= nr + 1) & ((n_pre >= 0) | (n_last >= 0))
    pg = tl.maximum(page, 1)
    bits = hbits
    bits = bits | tl.where((n_dcp < 0) & (N > 1), _MISSING, 0)
    bits = bits | tl.where((n_dcp >= 0) & (n_dcp != nrp), _SHAPE, 0)
    bits = bits | tl.where((n_dq > 0) & (N > 1) & (n_qsl > 0) & (n_dq > n_qsl), _EMPTY, 0)
    aligned = n_dcp == n_seq  # the view's values are compared where it is aligned with seq_lens
    # the ring: frozen at the first wrong observation (stop != 0), so the wrong one stays last
    live = stop == 0
    fits = (n_seq <= cap) & (n_dcp <= cap) & (n_qsl <= cap) & (n_kv <= cap) & (n_dq <= cap) & (n_tot <= cap) & (
        n_pos * (n_groups + 1) <= tcap)
    keepit = live & fits
    slot = ring.to(tl.pointer_type(tl.int32)) + (idx % keep).to(tl.int64) * words
    rows = tl.maximum(tl.maximum(tl.maximum(n_seq, n_dcp), tl.maximum(n_qsl, n_kv)), tl.maximum(n_dq, n_tot))
    rows = tl.maximum(rows, tl.maximum(n_hs, tl.maximum(n_pre, n_last)))
    # the real tokens' count (qsl[nr]) for the slots: loaded now, so its round trip overlaps the rows'
    q = tl.load(qslp + nr + tl.arange(0, 2), mask=tl.arange(0, 2) < tl.where((n_groups > 0) & (nr < n_qsl), 1, 0),
                other=0)
    acc = tl.zeros([_BLOCK], tl.int32)
    for off in range(0, rows, _BLOCK):
        j = off + tl.arange(0, _BLOCK)
        real = j < nr
        ms = j < n_seq
        md = j < n_dcp
        mq = j < n_qsl
        mk = j < n_kv
        mdq = j < n_dq
        mt = j < n_tot
        seq = tl.load(seqp + j, mask=ms, other=0)
        dv = tl.load(dcpp + j, mask=md, other=0)
        qv = tl.load(qslp + j, mask=mq, other=0)
        kv = tl.load(kvp + j, mask=mk, other=-1)
        dq = tl.load(dqp + j, mask=mdq, other=0)
        tv = tl.load(totp + j, mask=mt, other=0)
        # the formula in int32 (seq_lens are int32 and every term is at most seq: no overflow; int32 divisions are a
        # fraction of int64's on a GPU); the plans' in int64 (what they cover is computed from int64 host values)
        zero = tl.zeros_like(seq)
        local = local_of(seq, zero + rank, (zero + N) * I, I)
        acc = acc | tl.where(aligned & real & ms & (dv != local), _VALUES, 0)
        acc = acc | tl.where(aligned & (j >= nr) & (j < nrp) & md & (dv != 0), _PADDING, 0)
        # (divisions are long instruction sequences on a GPU: the pages' and the plans' run only where given)
        if (page > 0) & (n_kv > 0):
            acc = acc | tl.where(real & (kv >= 0) & (kv != (local + page - 1) // tl.maximum(page, 1)), _PAGES, 0)
        acc = acc | tl.where((N > 1) & (n_qsl > 0) & mdq & mq & (dq != qv), _EMPTY, 0)
        acc = acc | tl.where((N > 1) & real & mt & (tv != seq), _TOT, 0)
        hm = j < tl.minimum(nr, n_hs)  # (load masks as index bounds: the interpreter's masks must be bool)
        hs = tl.load(hsp + j, mask=hm, other=0)
        acc = acc | tl.where(hm & ms & (hs != seq.to(tl.int64)), _HOST_COPY, 0)
        if plan:  # (on the real rows)
            pm = j < nr
            pre = tl.load(prep + j, mask=j < tl.minimum(nr, n_pre), other=-1)
            last = tl.load(lastp + j, mask=j < tl.minimum(nr, n_last), other=-1)
            # (the row's query: qsl[j+1] - qsl[j])
            qn = tl.load(qslp + j + 1, mask=j < tl.minimum(nr, n_qsl - 1), other=0)
            seq64 = seq.to(tl.int64)
            cov = tl.maximum(tl.where(pre >= 0, seq64 - (qn - qv).to(tl.int64), seq64), 0)  # what the plan covers
            wide64 = zero.to(tl.int64)
            lc = local_of(cov, wide64 + rank, (wide64 + N) * I, I)
            lp = lc % pg
            lp = tl.where((lp == 0) & (lc != 0), pg, lp)  # (FlashInfer's last page: reference.last_page)
            acc = acc | tl.where(pm & (((pre >= 0) & (pre != (lc + pg - 1) // pg)) | ((last >= 0) & (last != lp))),
                                 _PLAN, 0)
        tl.store(slot + _HEAD + j, seq, mask=j < tl.where(keepit, n_seq, 0))
        tl.store(slot + _HEAD + cap + j, dv, mask=j < tl.where(keepit, n_dcp, 0))
        tl.store(slot + _HEAD + 2 * cap + j, qv, mask=j < tl.where(keepit, n_qsl, 0))
        tl.store(slot + _HEAD + 3 * cap + j, kv, mask=j < tl.where(keepit, n_kv, 0))
        tl.store(slot + _HEAD + 4 * cap + j, dq, mask=j < tl.where(keepit, n_dq, 0))
        tl.store(slot + _HEAD + 5 * cap + j, tv, mask=j < tl.where(keepit, n_tot, 0))
    if n_groups > 0:
        # slots: n_pos tokens, n_groups rows of slot_mapping ([groups, tokens], rows map_stride apart); the real
        # tokens are qsl[nr] (q: loaded before the rows' loop); kept as positions then the groups' rows back to back.
        # One pass over the tokens for _GROUPS groups at once ([groups, tokens] tiles: one round trip to memory a
        # block for all of them); a missing entry of this rank's is wrong only in a group the rank writes in, so
        # both are gathered per group and met after the pass.
        real_t = tl.where(n_qsl > nr, tl.sum(q, axis=0), n_pos)
        out = slot + _HEAD + _SECTIONS * cap
        kept_t = tl.where(keepit, n_pos, 0)  # (store masks as index bounds: the interpreter's masks must be bool)
        pos_wide = (wide & 1) != 0  # (int64 sources narrowed as they are read)
        map_wide = (wide & 2) != 0
        gl = tl.arange(0, _GROUPS)
        for g0 in range(0, n_groups, _GROUPS):
            g = g0 + gl
            gm = g < n_groups
            sharded = ((shard_mask >> g) & 1)[:, None] != 0
            row = (map_stride.to(tl.int64) * g)[:, None]
            writes = tl.zeros([_GROUPS], tl.int32)
            missing = tl.zeros([_GROUPS], tl.int32)
            for off in range(0, n_pos, _TBLOCK):
                t = off + tl.arange(0, _TBLOCK)
                m = t < n_pos
                if pos_wide:
                    p = tl.load(pos_p.to(tl.pointer_type(tl.int64)) + t, mask=m, other=0).to(tl.int32)
                else:
                    p = tl.load(pos_p.to(tl.pointer_type(tl.int32)) + t, mask=m, other=0)
                m2 = gm[:, None] & m[None, :]
                if map_wide:
                    s = tl.load(map_p.to(tl.pointer_type(tl.int64)) + row + t[None, :], mask=m2, other=-1)
                    s = s.to(tl.int32)
                else:
                    s = tl.load(map_p.to(tl.pointer_type(tl.int32)) + row + t[None, :], mask=m2, other=-1)
                mine = (((p // I) % N == rank)[None, :]) | ~sharded
                rt = (t < real_t)[None, :]
                bad = (~rt & (s != -1)) | (s < -1) | (rt & (s >= 0) & ~mine)
                acc = acc | tl.where(tl.max(tl.max((m2 & bad).to(tl.int32), axis=1), axis=0) != 0, _SLOTS, 0)
                writes = writes | tl.max((m2 & rt & (s >= 0)).to(tl.int32), axis=1)
                missing = missing | tl.max((m2 & rt & (s == -1) & mine).to(tl.int32), axis=1)
                tl.store(out + t, p, mask=t < tl.where(g0 == 0, kept_t, 0))
                tl.store(out + (n_pos * (g + 1))[:, None] + t[None, :], s, mask=gm[:, None] & (t < kept_t)[None, :])
            acc = acc | tl.where(tl.max(writes & missing, axis=0) != 0, _SLOTS, 0)
    # the rows' rule bits ORed (a max would keep only the highest of bits set in different rows): which of the
    # bits any row set (one max over [rows, bits]), then summed back (two reductions the interpreter does in numpy)
    k8 = tl.arange(0, _NBITS)
    bits = bits | tl.sum(tl.max((acc[:, None] >> k8[None, :]) & 1, axis=0) << k8, axis=0)
    # the header, one vector (each word a select: no nested jit call, which the interpreter pays dearly for)
    hl = tl.arange(0, _HEAD)
    hv = tl.where(hl == 0, idx + 1, tl.where(hl == 1, bits, tl.where(hl == 2, step, tl.where(hl == 3, site, 0))))
    hv = tl.where(hl == 4, rank, tl.where(hl == 5, ubatch, tl.where(hl == 6, nr, tl.where(hl == 7, nrp, hv))))
    hv = tl.where(hl == 8, parent, tl.where(hl == 9, req_start, tl.where(hl == 10, tok_start, hv)))
    hv = tl.where(hl == 11, tok_stop, tl.where(hl == 12, ntp, tl.where(hl == 13, graph, hv)))
    hv = tl.where(hl == 14, buf_lo, tl.where(hl == 15, buf_hi, hv))
    c = hl - _W_COUNTS
    hv = tl.where(c == 0, n_seq, tl.where(c == 1, n_dcp, tl.where(c == 2, n_qsl, tl.where(c == 3, n_kv, hv))))
    hv = tl.where(c == 4, n_dq, tl.where(c == 5, n_tot, tl.where(c == 6, n_pos, tl.where(c == 7, n_groups, hv))))
    hv = tl.where(hl == _W_KEPT, fits.to(tl.int32), tl.where(hl == _W_HOST, hidx, hv))
    tl.store(slot + hl, hv, mask=hl < tl.where(live, _HEAD, 0))
    if bits != 0:
        if live:
            tl.store(st + 1, idx + 1)
        tl.atomic_add(st + 2, 1)
        tl.store(flag.to(tl.pointer_type(tl.int32)), 1)


if tuple(guard_kernel.arg_names) != KERNEL_ARGS:
    raise ImportError(f"guard_kernel's parameters {guard_kernel.arg_names} are not device_checks.KERNEL_ARGS")
