"""simulate's disaggregated pair: a prefill instance with its own PCP/DCP/TP, interleave and block size hands each
arriving request's KV to the decode instance (today's workload) through a KV connector, and (LMCache) the decode
instance stores each finished request's KV under its key. Every plan is the reference (dcp.kv_transfer.plan_transfer)
for both sides' layouts and block tables, except where an injected fault makes it as the connector's pre-fix code did;
a fault touched a transfer where its plan moves other slots than the reference for what the record declares
(compared slot by slot over what the destination must hold, so a plan written another way but moving the same slots
touches nothing). Its random draws (prefix-cache hits, block ids) come from a stream of their own, so the decode
instance's workload is the same with or without the pair."""

from __future__ import annotations

import numpy as np

from dcptool.dcp.kv_transfer import needed_range, plan_transfer, shard_of, side_of
from dcptool.dump.transfer import GROUP_KINDS, MAMBA, GroupPlan, Side, TransferRecord
from dcptool.model.config import KV_GROUPS, SimConfig
from dcptool.model.sink import Sink

SFA_SCALE = 8  # the sparse indexer's kernel block scale vllm-ascend #13965 applied to MLA block ids
HIT_RATE = 0.3  # requests with a prefix-cache hit on the decode side


def sides(cfg: SimConfig) -> tuple[Side, Side]:
    """(prefill, decode) layouts: the decode side is the simulated engine (KV sharded over its DCP ranks, each PCP rank
    a replica: model runner V2)."""
    pd = cfg.prefill_dcp or cfg.dcp
    src = Side(tp=cfg.prefill_tp or pd, pcp=cfg.prefill_pcp, dcp=pd,
               interleave=cfg.prefill_interleave or cfg.interleave, cp_shards=cfg.prefill_kv_shards == "cp")
    return src, Side(tp=cfg.dcp, pcp=cfg.pcp, dcp=cfg.dcp, interleave=cfg.interleave)


def world(s: Side) -> int:
    return s.pcp * s.dcp if s.cp_shards else s.dcp


class Pair:
    """The pair's transfers, recorded through the sink; `faults`: the applicable transfer faults injected."""

    def __init__(self, cfg: SimConfig, faults: frozenset[str], sink: Sink):
        self.cfg, self.F, self.sink = cfg, faults, sink
        self.rng = np.random.default_rng([cfg.seed, 1])
        self.src, self.dst = sides(cfg)
        self.src_block = cfg.prefill_block_size or cfg.page_size
        self._next = {"src": 1, "dst": 1}  # each instance's block allocator (ids only grow: none is reused here)

    def _alloc(self, side: str, n: int, group: int) -> np.ndarray:
        """n fresh block ids of one instance's group (groups apart, so an id names one group's block)."""
        start = self._next[side]
        ids = start + np.cumsum(self.rng.integers(1, 4, size=n))
        self._next[side] = int(ids[-1]) if n else start
        return ids + (group << 26)

    def _groups(self, L: int, hit: bool) -> list[GroupPlan]:
        """The request's KV-cache groups (simulate's: an MLA group DCP-sharded, a replicated state group) with both
        sides' block tables: the prefill side's for L tokens and its lookahead slots (allocation padding past the
        sequence), the decode side's from a prefix-cache hit on."""
        out = []
        for g, (_, sharded) in enumerate(KV_GROUPS):
            if not sharded:  # one state block each
                out.append(GroupPlan("mamba", self._alloc("src", 1, g), self._alloc("dst", 1, g), self.src_block,
                                     self.cfg.page_size))
                continue
            n_src = -(-(L + self.cfg.spec_tokens) // (self.src_block * world(self.src)))
            n_dst = -(-L // (self.cfg.page_size * world(self.dst)))
            first = int(self.rng.integers(1, n_dst)) if hit and n_dst > 1 else 0
            out.append(GroupPlan("mla", self._alloc("src", n_src, g), self._alloc("dst", n_dst, g)[first:],
                                 self.src_block, self.cfg.page_size, dst_first=first))
        return out

    def step(self, step: int, work, arrived: int | None, active: np.ndarray | None) -> None:
        """After the workload scheduled a step (`arrived`: its request count before): the requests it admitted pull
        their KV (NIXL, Mooncake); after it ran the step (`active`: who was active before): the finished ones are
        stored (LMCache)."""
        if arrived is not None and self.cfg.kv_connector in ("nixl", "mooncake"):
            new = np.flatnonzero(work.active & (work.arrived >= arrived))
            self.arrive(step, [(int(work.arrived[s]), int(work.prompt[s])) for s in new])
        if active is not None and self.cfg.kv_connector == "lmcache":
            done = np.flatnonzero(active & ~work.active)
            self.finish(step, [(int(work.arrived[s]), int(work.computed[s])) for s in done])

    def arrive(self, step: int, requests: list[tuple[int, int]]) -> None:
        """Requests (id, prompt length) the decode instance admits this step: their KV pulled from the prefill
        instance into every decode worker."""
        c = self.cfg
        for rid, L in requests:
            groups = self._groups(L, self.rng.random() < HIT_RATE)
            for p in range(c.pcp):
                for r in range(c.dcp):
                    worker = p * c.dcp + r
                    copies, touched = self._pull(L, worker, groups)
                    t = TransferRecord(step=step, rank=r, request=rid, src=self.src, dst=self.dst, groups=groups,
                                       seq_len=L, dst_rank=worker, copies=copies, source="prefill")
                    self._record(worker, t, touched)

    def _pull(self, L: int, worker: int, groups: list[GroupPlan]) -> tuple[np.ndarray, list[str]]:
        """A decode worker's pull: the reference plan, or what the faults make of it, and the faults that changed it."""
        plan = plan_transfer(L, worker, self.src, self.dst, groups)
        steps = []
        if "nixl-pcp-stride" in self.F:  # the source shards matched by DCP rank alone
            steps.append(("nixl-pcp-stride", plan_transfer(L, worker, self.src._replace(cp_shards=False), self.dst,
                                                           groups)))
        if "nixl-single-source" in self.F:
            steps.append(("nixl-single-source", self._single_source(groups, steps[-1][1] if steps else plan)))
        if "mooncake-group-scale" in self.F:
            scaled = plan.copy()
            mla = np.array([g.kind == "mla" for g in groups])[scaled[:, 0]] if scaled.size else np.zeros(0, bool)
            scaled[mla, 2] *= SFA_SCALE
            steps.append(("mooncake-group-scale", scaled))
        if "mooncake-unsharded-prefill" in self.F:  # the unsharded prefill read as if sharded like the decode side
            wrong = plan_transfer(L, worker, self.dst, self.dst, groups)
            wrong[:, 1] %= self.src.pcp * self.src.dcp  # (its ports: the prefill's workers)
            steps.append(("mooncake-unsharded-prefill", wrong))
        return self._changed(plan, steps, L, worker, self.src, self.dst, groups)

    def _single_source(self, groups: list[GroupPlan], plan: np.ndarray) -> np.ndarray:
        """vLLM #57389's region-mapped pull: every MLA block read from the plan's first source worker, the
        destination's blocks paired with the source's list end-trimmed to their count (allocation padding included)."""
        mla = np.array([g.kind == "mla" for g in groups])
        out = [plan[~mla[plan[:, 0]]]] if plan.size else []
        for g in np.flatnonzero(mla).tolist():
            grp = groups[g]
            mine = plan[plan[:, 0] == g]
            first = int(mine[:, 1].min()) if mine.size else 0
            n = min(len(grp.dst_blocks), len(grp.src_blocks))
            src_ids, dst_ids = np.asarray(grp.src_blocks)[len(grp.src_blocks) - n:], np.asarray(grp.dst_blocks)[:n]
            out.append(np.stack([np.full(n, g), np.full(n, first), src_ids, np.zeros(n, np.int64), dst_ids,
                                 np.zeros(n, np.int64), np.full(n, min(grp.src_block_size, grp.dst_block_size))],
                                axis=1).astype(np.int64))
        return np.concatenate(out) if out else plan

    def finish(self, step: int, requests: list[tuple[int, int]]) -> None:
        """Requests (id, tokens computed) the decode instance finished this step: each DCP shard's KV stored in
        LMCache under its own key (the multi-process connector's one writer per shard), or (lmcache-partial-store)
        rank 0's shard alone under the whole request's key."""
        d = self.dst
        for rid, L in requests:
            groups = []
            for g, (_, sharded) in enumerate(KV_GROUPS):
                n = 1 if not sharded else -(-L // (self.cfg.page_size * world(d)))
                ids = self._alloc("dst", n, g)
                groups.append(GroupPlan("mla" if sharded else "mamba", ids, ids, self.cfg.page_size,
                                        self.cfg.page_size))
            if "lmcache-partial-store" in self.F:
                right = plan_transfer(L, 0, d, Side(tp=d.tp), groups)
                mine = plan_transfer(L, 0, d, d, groups)
                touched = [] if self._same(right, mine, L, 0, d, Side(tp=d.tp), groups) else ["lmcache-partial-store"]
                t = TransferRecord(step=step, rank=0, request=rid, src=d, dst=Side(tp=d.tp), groups=groups,
                                   seq_len=L, dst_rank=0, copies=mine, source="decode", store=True)
                self._record(0, t, touched)
                continue
            for r in range(d.dcp):
                t = TransferRecord(step=step, rank=r, request=rid, src=d, dst=d, groups=groups, seq_len=L,
                                   dst_rank=r, copies=plan_transfer(L, r, d, d, groups), source="decode", store=True)
                self._record(r, t, [])

    def _record(self, worker: int, t: TransferRecord, touched: list[str]) -> None:
        idx = self.sink.record_transfer(worker, t)
        for f in touched:
            self.sink.mark(worker, idx, f)

    def _changed(self, plan, steps, L, worker, src, dst, groups) -> tuple[np.ndarray, list[str]]:
        """The last plan of `steps` (each a fault's, built on the one before) and the faults whose plan moves other
        slots than the one before it."""
        touched, before = [], plan
        for fault, after in steps:
            if not self._same(before, after, L, worker, src, dst, groups):
                touched.append(fault)
            before = after
        return before, touched

    @staticmethod
    def _same(a: np.ndarray, b: np.ndarray, L: int, worker: int, src: Side, dst: Side, groups: list[GroupPlan]) -> bool:
        return np.array_equal(slot_map(a, L, worker, src, dst, groups), slot_map(b, L, worker, src, dst, groups))


def slot_map(copies: np.ndarray, L: int, worker: int, src: Side, dst: Side, groups: list[GroupPlan]) -> np.ndarray:
    """What a plan moves into the destination slots it must fill: rows (group, destination local index, source shard
    (-1: a replicated source group), source kernel block id, source offset), sorted, duplicates kept; a copy whose
    destination block the table does not hold as (group, -1, ...). Mamba groups by block."""
    rows = []
    d_shard = int(shard_of(worker, dst.dcp, dst.cp_shards))
    for g, grp in enumerate(groups):
        c = copies[copies[:, 0] == g] if copies.size else copies.reshape(0, 7)
        s, d = side_of(src, grp, True), side_of(dst, grp, False)
        ratio = d.block // d.kernel
        where = {int(b): k + d.first for k, b in enumerate(d.table)}
        idx = np.array([where.get(int(i) // ratio, -1) for i in c[:, 4]], np.int64).reshape(-1)
        sub = c[:, 4] % ratio
        shard = shard_of(c[:, 1], src.dcp, src.cp_shards) if s.layout.sharded else np.full(c.shape[0], -1)
        if GROUP_KINDS.index(grp.kind) == MAMBA:
            rows.append(np.stack([np.full(idx.size, g), idx, shard, c[:, 2], c[:, 3]], axis=1))
            continue
        n = c[:, 6]
        k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        e = np.repeat(np.arange(c.shape[0]), n)
        local = np.where(idx[e] >= 0, idx[e] * d.block + sub[e] * d.kernel + c[e, 5] + k, -1)
        lo, hi = needed_range(L, d_shard, d, grp.window)
        keep = (local < 0) | ((local >= lo) & (local < hi))
        rows.append(np.stack([np.full(local.size, g), local, shard[e], c[e, 2], c[e, 3] + k], axis=1)[keep])
    out = np.concatenate(rows) if rows else np.zeros((0, 5), np.int64)
    return out[np.lexsort(out.T[::-1])] if out.size else out.reshape(0, 5)

