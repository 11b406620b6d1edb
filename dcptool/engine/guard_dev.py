"""The Guard's device path: one check kernel per observe, a device ring of the last `keep`, a host-mapped flag."""

from __future__ import annotations

import numpy as np

from dcptool.dcp.backend import load

# Ring slot layout (int32 words): HEAD header words, then six sections of `cap` rows each (seq_lens, the DCP
# view, query_start_loc, kv_pages, dcp_query_start_loc, dcp_tot_seq_lens) and `tcap` words of slot entries
# (positions, then slot_mapping [groups, tokens]). Header: 0 index + 1 (0: never written), 1 rule bits, 2 step,
# 3 site id, 4 rank, 5 ubatch, 6 num_reqs, 7 num_reqs_padded, 8 parent, 9 req_start, 10 tok_start, 11 tok_stop,
# 12 num_tokens_padded, 13 graph, 14-15 buffer (low, high), 16-23 counts (the six sections, tokens, groups;
# -1 absent), 24 kept (0: larger than the slot, checked but not kept).
HEAD = 32
W_COUNTS = 16
W_KEPT = 24
SECTIONS = 6
GUARD_BLOCK = 256
BIT_VALUES, BIT_PADDING, BIT_SHAPE, BIT_MISSING, BIT_PAGES, BIT_EMPTY, BIT_TOT, BIT_SLOTS = (1 << k for k in range(8))
# a bit -> the rule replay names (the values bit: stale, global, wrong-rank ... mismatch, replay says which)
RULE_OF_BIT = ((BIT_MISSING, "missing"), (BIT_VALUES, "values"), (BIT_PADDING, "padding"), (BIT_SHAPE, "shape"),
               (BIT_PAGES, "pages"), (BIT_EMPTY, "empty-mask"), (BIT_TOT, "tot-lens"), (BIT_SLOTS, "slots"))
_TL = "dcptool.engine.guard_tl"
_NONE = -1  # a scalar not given


def rule_of(bits: int) -> str:
    """The first rule (table order) of a slot's rule bits."""
    return next(r for b, r in RULE_OF_BIT if bits & b)


def _opt(v) -> int:
    return _NONE if v is None else v


class GuardDevice:
    """The ring (device int32 [keep, words]), the device state (observation counter, frozen-at index + 1, wrong
    count) and the flag (pinned host memory the kernel writes through its device address; the host reads it
    without a sync). Slots are sized from `max_rows` / `max_tokens` or from the first observation (twice its rows,
    at least 64; twice its slot words, at least 256); a larger observation grows the ring (device copies on the
    stream, no sync) except once a launch was captured in a CUDA graph (the graph holds the ring's address): it is
    then checked in full but not kept (its slot says so, and the dump leaves it out). The ring is allocated
    outside capture: observations captured before the first eager one are skipped (vLLM runs eager profile and
    warm-up builds before it captures)."""

    def __init__(self, torch, device, keep: int, spec, max_rows: int | None, max_tokens: int | None):
        self.torch = torch
        self.device = device
        self.keep = keep
        self.spec = spec
        self.cap = max_rows
        self.tcap = max_tokens
        self.ring = None
        self.state = torch.zeros(4, dtype=torch.int32, device=device)
        pinned = device.type == "cuda"
        self.flag = torch.zeros(2, dtype=torch.int32, pin_memory=pinned)
        self.flag_np = self.flag.numpy()  # a view: reading it is no sync
        self.frozen = False  # a launch was captured: the ring keeps its address
        self.sites: dict[str, int] = {}
        self.site_names: list[str] = []
        self.kernel = load(_TL).guard_kernel
        self.capturing = (torch.cuda.is_current_stream_capturing if pinned else (lambda: False))

    def _words(self) -> int:
        return HEAD + SECTIONS * self.cap + self.tcap

    def _fit(self, rows: int, tokens: int) -> bool:
        """Allocate the ring, or grow it for a larger observation (not once a graph holds its address); False:
        there is no ring and this is inside capture (its allocation and zeroing would be captured)."""
        if self.ring is not None and rows <= self.cap and tokens <= self.tcap:
            return True
        if self.capturing():
            if self.ring is None:
                return False
            return True
        if self.ring is not None and self.frozen:
            return True
        t = self.torch
        cap = max(self.cap or 0, 64, 2 * rows)
        tcap = max(self.tcap or 0, 256, 2 * tokens)
        old, oc, ot = self.ring, self.cap, self.tcap
        self.cap, self.tcap = cap, tcap
        self.ring = t.zeros((self.keep, self._words()), dtype=t.int32, device=self.device)
        if old is not None:  # (device copies, queued on the stream)
            self.ring[:, :HEAD] = old[:, :HEAD]
            for k in range(SECTIONS):
                self.ring[:, HEAD + k * cap:HEAD + k * cap + oc] = old[:, HEAD + k * oc:HEAD + (k + 1) * oc]
            self.ring[:, HEAD + SECTIONS * cap:HEAD + SECTIONS * cap + ot] = old[:, HEAD + SECTIONS * oc:]
        return True

    def _i32(self, x):
        """A contiguous int32 tensor on the device (engine tensors already are: no copy)."""
        t = self.torch
        if x is None:
            return None
        if not isinstance(x, t.Tensor):
            x = t.as_tensor(np.asarray(x))
        if x.dtype != t.int32 or not x.is_contiguous() or x.device != self.device:
            x = x.to(device=self.device, dtype=t.int32).contiguous()
        return x

    def launch(self, vals, site: str, seq_lens, dcp, qsl, kv, dqsl, tot, positions, slot_mapping) -> bool:
        """One check-and-keep launch on the current stream; nothing read back. False: skipped (_fit)."""
        s = self.spec
        sid = self.sites.get(site)
        if sid is None:
            sid = self.sites[site] = len(self.site_names)
            self.site_names.append(site)
        secs = [self._i32(x) for x in (seq_lens, dcp, qsl, kv, dqsl, tot, positions)]
        groups, mask, maps = 0, 0, None
        if slot_mapping is not None:
            if isinstance(slot_mapping, dict):
                keys = sorted(slot_mapping)
                if keys != list(range(len(keys))):
                    raise ValueError("slot_mapping's groups must be 0..G-1 on the device path")
                slot_mapping = self.torch.stack([self._i32(slot_mapping[g]).reshape(-1) for g in keys])
            maps = self._i32(slot_mapping).reshape(-1, secs[6].numel())
            groups = maps.shape[0]
            sh = s.sharded
            mask = sum(1 << g for g in range(groups) if sh is None or g >= len(sh) or sh[g])
        n = [-1 if x is None else x.numel() for x in secs]
        rows = max(n[:6])
        tokens = max(n[6], 0) * (groups + 1)
        if not self._fit(rows, tokens):
            return False
        if self.capturing():
            self.frozen = True
        any_t = secs[0]
        ptr = [any_t.data_ptr() if x is None or x.numel() == 0 else x.data_ptr() for x in (*secs, maps)]
        buf = _opt(vals.buffer)
        buf_lo, buf_hi = (buf & 0xFFFFFFFF) - ((buf & 0x80000000) << 1), buf >> 32
        self.kernel[(1,)](self.ring, self.state, self.flag.data_ptr(), self.keep, self._words(), self.cap,
                          self.tcap, s.dcp_size, s.cp_interleave, s.page_size or 0, vals.step, sid, vals.rank,
                          vals.ubatch, vals.num_reqs, vals.num_reqs_padded, _opt(vals.parent), _opt(vals.req_start),
                          _opt(vals.tok_start), _opt(vals.tok_stop), _opt(vals.num_tokens_padded), _opt(vals.graph),
                          buf_lo, buf_hi, ptr[0], n[0], ptr[1], n[1], ptr[2], n[2], ptr[3], n[3], ptr[4], n[4],
                          ptr[5], n[5], ptr[6], max(n[6], 0), ptr[7], groups, mask, num_warps=4)
        return True

    def wrong_seen(self) -> bool:
        """The flag, read from host memory without a sync (the kernel's write lands there)."""
        return bool(self.flag_np[0])

    def kept(self) -> tuple[list[tuple[int, int, dict]], int, int]:
        """Wait for the stream; the ring's observations up to the first wrong one, oldest first, as (index, rule
        bits, observe keywords or None for one larger than its slot); the number seen, the number wrong."""
        t = self.torch
        if self.device.type == "cuda":
            t.cuda.synchronize(self.device)
        count, stop, wrong = (int(v) for v in self.state[:3].cpu().tolist())
        if self.ring is None:
            return [], count, wrong
        last = (stop or count) - 1
        ring = self.ring.cpu().numpy()
        out = []
        for i in range(max(0, last - self.keep + 1), last + 1):
            w = ring[i % self.keep]
            if w[0] == i + 1:
                out.append((i, int(w[1]), self._decode(w) if w[W_KEPT] else None))
        return out, count, wrong

    def counts(self) -> tuple[int, int]:
        """Wait for the stream; (observations seen, wrong ones) by the kernel's counters."""
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)
        count, _, wrong = (int(v) for v in self.state[:3].cpu().tolist())
        return count, wrong

    def _decode(self, w: np.ndarray) -> dict:
        """A slot back to observe()'s keywords (host arrays)."""
        cap = self.cap
        cnt = w[W_COUNTS:W_COUNTS + 8].tolist()

        def sec(k):
            return None if cnt[k] < 0 else w[HEAD + k * cap:HEAD + k * cap + cnt[k]].copy()

        def opt(v):
            return None if v == _NONE else int(v)

        kw = dict(step=int(w[2]), site=self.site_names[int(w[3])], rank=int(w[4]), ubatch=int(w[5]),
                  num_reqs=int(w[6]), num_reqs_padded=int(w[7]), parent=opt(w[8]), req_start=opt(w[9]),
                  tok_start=opt(w[10]), tok_stop=opt(w[11]), num_tokens_padded=opt(w[12]), graph=opt(w[13]),
                  buffer=opt((int(w[15]) << 32) | (int(w[14]) & 0xFFFFFFFF)),
                  seq_lens=sec(0), dcp_local_seq_lens=sec(1), query_start_loc=sec(2), kv_pages=sec(3),
                  dcp_query_start_loc=sec(4), dcp_tot_seq_lens=sec(5))
        tok, groups = cnt[6], cnt[7]
        if groups > 0:
            base = HEAD + SECTIONS * cap
            kw["positions"] = w[base:base + tok].copy()
            kw["slot_mapping"] = w[base + tok:base + tok * (groups + 1)].reshape(groups, tok).copy()
        return kw
