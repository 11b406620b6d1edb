"""simulate's workload: Poisson arrivals, skewed lengths, chunked prefill under a token budget, spec decode; each
step's Batch is what the runner model is handed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dcptool.model.config import SimConfig


@dataclass
class Batch:
    """One scheduled step in batch order (decodes first, then prefills by query length)."""

    query_lens: np.ndarray
    num_computed: np.ndarray
    is_prefilling: np.ndarray
    slots: np.ndarray  # request slot of each row

    @property
    def num_reqs(self) -> int:
        return int(self.query_lens.size)

    @property
    def seq_lens(self) -> np.ndarray:
        return self.num_computed + self.query_lens


class Workload:
    """Requests arrive, prefill in chunks under the token budget, decode with K draft tokens each step
    (accepted drafts advance seq_lens by accepted + 1), and leave when their output is done."""

    def __init__(self, cfg: SimConfig, rng: np.random.Generator):
        self.cfg, self.rng = cfg, rng
        cap = cfg.max_num_reqs
        self.prompt = np.zeros(cap, np.int64)
        self.output = np.zeros(cap, np.int64)
        self.computed = np.zeros(cap, np.int64)
        self.generated = np.zeros(cap, np.int64)
        self.active = np.zeros(cap, bool)
        self.arrived = np.zeros(cap, np.int64)  # arrival order, for FCFS prefill
        self.waiting: list[tuple[int, int]] = []
        self.count = 0
        # Start in steady state: half the slots already decoding.
        for _ in range(cap // 2):
            p, o = self._lengths()
            s = self._admit(p, o)
            self.generated[s] = int(rng.integers(1, max(2, o)))
            self.computed[s] = p + self.generated[s] - 1

    def _lengths(self) -> tuple[int, int]:
        c, rng = self.cfg, self.rng
        p = int(np.clip(rng.lognormal(np.log(1024), 1.0), 8, min(16384, c.max_model_len // 2)))
        o = int(np.clip(rng.lognormal(np.log(256), 0.9), 4, min(4096, c.max_model_len - p - c.decode_query_len)))
        return p, max(o, 1)

    def _admit(self, prompt: int, output: int) -> int:
        s = int(np.flatnonzero(~self.active)[0])
        self.prompt[s], self.output[s], self.computed[s], self.generated[s] = prompt, output, 0, 0
        self.active[s] = True
        self.arrived[s] = self.count
        self.count += 1
        return s

    def schedule(self) -> Batch:
        c = self.cfg
        for _ in range(int(self.rng.poisson(c.arrival_rate))):
            self.waiting.append(self._lengths())
        budget = c.token_budget
        dec = np.flatnonzero(self.active & (self.computed >= self.prompt))
        dec = dec[: budget // c.decode_query_len]
        budget -= dec.size * c.decode_query_len
        pre = np.flatnonzero(self.active & (self.computed < self.prompt))
        pre = pre[np.argsort(self.arrived[pre], kind="stable")]
        chunks = []
        for s in pre:
            if budget == 0:
                break
            n = int(min(self.prompt[s] - self.computed[s], budget))
            chunks.append((int(s), n))
            budget -= n
        while budget > 0 and self.waiting and self.active.sum() < c.max_num_reqs:
            s = self._admit(*self.waiting.pop(0))
            n = int(min(self.prompt[s], budget))
            chunks.append((s, n))
            budget -= n
        slots = np.concatenate([dec, np.array([s for s, _ in chunks], np.int64)]).astype(np.int64)
        q = np.concatenate([np.full(dec.size, c.decode_query_len, np.int64),
                            np.array([n for _, n in chunks], np.int64)])
        # vLLM's sort_batch_req_ids: decodes with drafts first, then by query length.
        order = np.lexsort((q, q != c.decode_query_len, np.arange(q.size) >= dec.size))
        slots, q = slots[order], q[order]
        return Batch(query_lens=q, num_computed=self.computed[slots].copy(),
                     is_prefilling=self.computed[slots] < self.prompt[slots], slots=slots)

    def advance(self, b: Batch) -> np.ndarray:
        """Apply one step's results; returns num_computed after it, per row (what the drafter starts from)."""
        c = self.cfg
        s = b.slots
        dec = ~b.is_prefilling
        k = c.spec_tokens
        # accepted = leading run of accepted drafts (each with probability accept_rate)
        accepted = (self.rng.random((s.size, max(k, 1))) < c.accept_rate)[:, :k].cumprod(axis=1).sum(axis=1)
        step = np.where(dec, accepted + 1, b.query_lens)
        self.computed[s] += step
        done_prefill = b.is_prefilling & (self.computed[s] >= self.prompt[s])
        self.generated[s] += np.where(dec, accepted + 1, done_prefill.astype(np.int64))
        after = self.computed[s].copy()
        fin = (self.generated[s] >= self.output[s]) | (self.computed[s] + c.decode_query_len >= c.max_model_len)
        self.active[s[fin]] = False
        return after
