"""The model of vLLM's GPU model runner that simulate drives: every batch on every DCP rank of every PCP rank,
through the paths vLLM takes (dummy runs, capture, PCP partition, micro-batches, drafter), with the pre-fix faults
where they occurred."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from dcptool.dcp.reference import local_of
from dcptool.dcp.slicing import (
    UbatchSlice,
    pcp_partition,
    pcp_rank_tokens,
    split_batch,
    splits_on_request_boundary,
    uniform_query_len,
)
from dcptool.dump import Record
from dcptool.dump.schema import GraphMode
from dcptool.model.columns import Columns
from dcptool.model.config import SimConfig, applicability
from dcptool.model.graphs import DBO_PREFILL_TOKENS, Desc, Graphs
from dcptool.model.handed import Handed
from dcptool.model.rows import Rows, dummy_rows, make_rows
from dcptool.model.sink import Sink
from dcptool.model.workload import Batch

# Buffer identities: one address space per recording process, fixed slots for persistent buffers.
RUNNER, PCP_BUF, DRAFTER, DFLASH, UBATCH = 1, 2, 3, 4, 8


class Build(NamedTuple):
    """What one attention-metadata build is, beside its rows: where and how vLLM made it."""

    step: int
    site: str
    role: str  # the runner path that built it: final, global, ubatch, dummy, capture, dflash, draft
    graph: GraphMode
    slot: int  # the persistent buffer its view lives in (RUNNER, PCP_BUF, ...)
    kind: str = "step"  # step, dummy or capture: the run it belongs to
    ubatch: int = -1
    pages: bool = True  # its plan's page counts (and the decode path's columns) are recorded
    disagree: bool = False  # rank-disagree may touch it


class Lineage(NamedTuple):
    """Where a build comes from: its parents per rank, the micro-batch slice, the views it derives from."""

    parents: list[int] | None = None
    sl: UbatchSlice | None = None
    parent_views: np.ndarray | None = None
    global_views: np.ndarray | None = None


NO_LINEAGE = Lineage()


class Runner:
    """vLLM's model runner for all P x N recording processes (PCP rank p, DCP rank r).

    Every attention-metadata build is recorded: the fixed pipeline computes DCP metadata once from
    the final batch (after the PCP partition, padding and set_dummy_context) into the buffer that
    batch lives in; each injected fault replaces that at the sites where pre-fix vLLM went wrong, and
    what it changed there (compared with the fixed value of the same observation) is its ground truth.
    """

    def __init__(self, cfg: SimConfig, sink: Sink):
        self.cfg, self.sink = cfg, sink
        self.N, self.P, self.I, self.G = cfg.dcp, cfg.pcp, cfg.interleave, cfg.page_size
        self.F = frozenset(cfg.faults) - {f for f, why in applicability(cfg).items() if why is not None}
        self.graphs = Graphs(cfg)
        self.columns = Columns(cfg, self.F)  # the decode path's companions, the slot mappings, the context chunks
        self.chunked = "chunked-context" in cfg.modelled
        self.swa = "swa" in cfg.modelled
        self.sparse = "sparse" in cfg.modelled
        self.handed = Handed(cfg, self.F)  # the metadata tensors' addresses, capacities, the host copies
        self.ranks = np.arange(self.N).reshape(-1, 1)
        self._fresh = 0
        self._captured: dict[tuple, set[int]] = {}
        # In the legacy pipeline both micro-batch faults come from one pre-fix behaviour: a micro-batch
        # takes its parent's field, which is a value on real steps and captures (the capture path's DCP
        # hack filled it) and None on dummy runs (nothing filled it).
        both = {"ubatch-none", "ubatch-parent-rows"} <= self.F
        self.ub_fault = {kind: ("ubatch-none" if kind == "dummy" else "ubatch-parent-rows") if both else
                         next((f for f in ("ubatch-none", "ubatch-parent-rows") if f in self.F), None)
                         for kind in ("step", "dummy", "capture")}

    def _local(self, seq: np.ndarray) -> np.ndarray:
        """The local length (docs/dcp.md) on every rank at once, [N, rows]."""
        return local_of(seq.reshape(1, -1), self.ranks, self.N, self.I)

    # ---- buffers

    def _buf(self, proc: int, slot: int) -> int:
        return (0x7F << 40) | (proc << 24) | (slot << 12)

    def _per_step_buf(self, proc: int) -> int:
        self._fresh += 1
        return (0x7E << 40) | (proc << 32) | self._fresh

    # ---- one batch on every DCP rank of PCP rank p

    def emit(self, p: int, b: Rows, build: Build, lineage: Lineage = NO_LINEAGE):
        """Record batch `b` on DCP ranks 0..N-1 of PCP rank p, as `build` says it was built, derived as `lineage`
        says.

        Every rank's view is computed at once ([N, rows]); returns (indices per rank, recorded views
        [N, length] or None) so that children (micro-batches, the PCP-local batch) can derive from them.
        """
        N, F, nr, nrp = self.N, self.F, b.nr, b.nrp
        loc = self._local(b.seq[:nr])  # [N, nr]
        marks: list[tuple[str, np.ndarray]] = []  # (fault, [N] bool: ranks it touched)
        odd_seq = None  # rank-disagree: the last rank's seq_lens (its local lengths and pages follow them)
        if build.disagree and "rank-disagree" in F and N > 1 and nr >= 1:
            odd_seq = b.seq.copy()
            odd_seq[0] += 1
            loc = loc.copy()
            loc[N - 1] = local_of(odd_seq[:nr], N - 1, N, self.I)
            marks.append(("rank-disagree", np.arange(N) == N - 1))
        view = None
        if N > 1:
            fixed = np.zeros((N, nrp), np.int64)
            fixed[:, :nr] = loc
            view = self._faults(build.role, build.kind, b, fixed, lineage.parent_views, lineage.global_views,
                                lineage.sl, marks)
        kv = self._pages(b, loc, odd_seq, marks) if build.pages else None
        fresh = view is not None and build.graph == GraphMode.FULL_REPLAY and "graph-stale" in F
        sink = self.sink
        sink.by_site[build.site] = sink.by_site.get(build.site, 0) + N
        procs = range(p * N, p * N + N)
        bufs = self._buffers(procs, build, view, fresh)
        dq, tot = (None, None) if not build.pages or view is None else self.columns.decode_path(b, view, odd_seq, marks)
        sl = lineage.sl
        slots = self.columns.slots(b, build.role, build.kind, 0 if sl is None else sl.req_start, marks)
        ctx = self.columns.chunked_context(b, odd_seq, marks) if build.pages and self.chunked else None
        gl, vl = self.columns.group_lens(b, odd_seq, marks) if build.pages and self.swa else (None, None)
        tk = self.columns.sparse_topk(b, marks) if build.pages and self.sparse else None
        addrs, gaddrs = self.handed.addrs(procs, build.role, build.slot, build.graph, (b.ntp, nrp, build.ubatch), marks)
        r = Record(step=build.step, site=build.site, rank=range(N), num_reqs=nr, num_reqs_padded=nrp, seq_lens=b.seq,
                   dcp_local_seq_lens=view, ubatch=build.ubatch, parent=lineage.parents, query_start_loc=b.qsl,
                   num_tokens_padded=b.ntp, buffer=bufs, graph=int(build.graph), kv_pages=kv, dcp_query_start_loc=dq,
                   dcp_tot_seq_lens=tot, ctx_chunks=ctx, group_seq_lens=gl, verify_row_lens=vl, sparse_topk=tk,
                   attn_addrs=addrs, graph_addrs=gaddrs, attn_caps=self.handed.caps(procs, build.role, nrp, marks),
                   **dict(zip(("host_seq_lens", "host_seq_lens_after"),
                              self.handed.host_copies(b, build.role, build.kind, build.pages, marks))),
                   kv_block_sizes=self.columns.block_sizes(build.role, build.kind),
                   **dict(zip(("kv_prefill_pages", "kv_last_page"), self.columns.plans(b, build.pages, marks))),
                   **({} if sl is None else dict(req_start=sl.req_start, tok_start=sl.tok_start, tok_stop=sl.tok_stop)))
        idxs = sink.record(p, r, slots, odd_seq)
        self._mark(procs, idxs, bufs, build, nrp, fresh, marks)
        return idxs, view

    def _pages(self, b: Rows, loc: np.ndarray, odd_seq: np.ndarray | None, marks: list) -> np.ndarray:
        """The page counts each rank's plan claims ([N, nrp]; one row shared by every rank under
        flashinfer-global-pages, from the global lengths)."""
        N, F, nr, nrp = self.N, self.F, b.nr, b.nrp
        glob = -(-b.seq // self.G)
        glob[nr:] = 0
        kv = np.zeros((N, nrp), np.int64)
        kv[:, :nr] = -(-loc // self.G) if N > 1 else glob[:nr]
        if "flashinfer-global-pages" in F and odd_seq is not None:
            glob = np.broadcast_to(glob, (N, nrp)).copy()
            glob[N - 1] = -(-odd_seq // self.G)
            glob[:, nr:] = 0
        if "flashinfer-global-pages" in F:
            marks.append(("flashinfer-global-pages", (kv[:, :nr] != glob[..., :nr]).any(axis=-1)
                          if glob.ndim == 2 else (kv[:, :nr] != glob[:nr]).any(axis=1)))
            kv = glob  # one row shared by every rank
        return kv

    def _buffers(self, procs: range, build: Build, view: np.ndarray | None, fresh: bool) -> list[int]:
        """The buffer each process's view lives in (0: no view; graph-stale: a fresh one per step)."""
        home = build.slot
        if (view is not None and build.role == "capture" and self.P > 1 and build.ubatch < 0
                and "capture-wrong-buffer" in self.F):
            home = RUNNER
        if view is None:
            return [0] * len(procs)
        if fresh:
            return [self._per_step_buf(proc) for proc in procs]
        return [self._buf(proc, home) for proc in procs]

    def _mark(self, procs: range, idxs: list[int], bufs: list[int], build: Build, nrp: int, fresh: bool,
              marks: list) -> None:
        """Each recorded observation's ground truth: the faults that touched it, and a replay that reads another
        buffer than its capture (graph-stale, capture-wrong-buffer)."""
        sink, graph, ubatch = self.sink, build.graph, build.ubatch
        for r, proc in enumerate(procs):
            idx, buf = idxs[r], bufs[r]
            if graph.full and buf:
                key = (sink.file_of[proc], r, nrp, ubatch)
                if graph == GraphMode.FULL_CAPTURE:
                    self._captured.setdefault(key, set()).add(buf)
                elif key in self._captured and buf not in self._captured[key]:
                    # the replay reads another buffer than its capture: the rule `alias`, reported at the replay
                    if fresh:
                        sink.mark(proc, idx, "graph-stale")
                    if "capture-wrong-buffer" in self.F and self.P > 1 and ubatch < 0:
                        sink.mark(proc, idx, "capture-wrong-buffer")
            for fault, hit in marks:
                if hit[r]:
                    sink.mark(proc, idx, fault)

    def _faults(self, role, kind, b: Rows, fixed, parent_views, global_views, sl, marks):
        """Every rank's view as the faulty engine records it instead of `fixed` ([N, nrp]), or None;
        appends (fault, ranks it changed) to `marks`."""
        F, nr, nrp = self.F, b.nr, b.nrp
        N = fixed.shape[0]
        view = fixed
        every = np.ones(N, bool)

        def changed(fault: str, v: np.ndarray, length_wrong: bool) -> None:
            # rows_wrong ranks are the fault's own finding; length-only ranks can only be `shape`
            k = min(v.shape[1], nr)
            rows_wrong = (v[:, :k] != fixed[:, :k]).any(axis=1)
            marks.append((fault, rows_wrong))
            if length_wrong:
                marks.append((fault + ":shape", ~rows_wrong))

        if role == "final" and global_views is not None and ({"pcp-stale", "pcp-unpadded"} & F):
            stale, unpadded = "pcp-stale" in F, "pcp-unpadded" in F
            src = global_views if stale else fixed
            length = nr if unpadded else src.shape[1]
            view = np.zeros((N, length), np.int64)  # the runner's buffer is 0 past the global rows
            n = min(length, src.shape[1])
            view[:, :n] = src[:, :n]
            if stale:
                changed("pcp-stale", view, not unpadded and length != nrp)
            if unpadded and length != nrp:
                marks.append(("pcp-unpadded", every))
        elif role == "ubatch" and self.ub_fault[kind] is not None:
            fault = self.ub_fault[kind]
            if fault == "ubatch-none" or parent_views is None:
                # a micro-batch of a parent whose field was None takes the None along
                marks.append((fault if fault == "ubatch-none" or kind != "dummy" else "dummy-none", every))
                return None
            n = max(0, min(nr, parent_views.shape[1] - sl.req_start))
            view = fixed.copy() if n == nr else np.zeros((N, n), np.int64)
            view[:, :n] = parent_views[:, sl.req_start : sl.req_start + n]
            changed(fault, view, view.shape[1] != nrp)
        if "sentinel" in F and view.shape[1] > nr:
            view = view.copy()
            view[:, nr:] = -1
            marks.append(("sentinel", every))
        if (role == "dummy" and "dummy-none" in F) or (role == "dflash" and "dflash-capture-none" in F):
            marks.clear()
            marks.append(("dummy-none" if role == "dummy" else "dflash-capture-none", every))
            return None
        return view

    # ---- paths

    def run_batch(self, step: int, parents_of: list, rows_of: list, desc: Desc, site: str, role: str, kind: str,
                  slot: int, global_views_of=None, uniform: bool | None = None) -> None:
        """The final batch of every PCP rank, then its micro-batches when the step is split.

        `uniform`: whether vLLM >= 0.34 splits this batch as a uniform decode (its DP ranks agree on
        the query length); None: dummy batches, uniform by construction when their tokens divide evenly.
        """
        cfg = self.cfg
        split = desc.ubatches > 1
        graph = desc.mode.recorded(capturing=kind == "capture")
        top = []
        for p in range(self.P):
            g = GraphMode.EAGER if split and kind != "capture" else graph
            top.append(self.emit(p, rows_of[p], Build(step, site, role, g, slot, kind,
                                                      disagree=not split and kind == "step"),
                                 Lineage(parents_of[p], global_views=None if global_views_of is None
                                         else global_views_of[p])))
        if not split:
            return
        ub_graph = desc.mode.recorded(capturing=kind == "capture") if desc.mode.full else GraphMode.EAGER
        boundary = splits_on_request_boundary(cfg.engine_version) and uniform is not False
        per_p = [split_batch(rows_of[p].qsl, rows_of[p].seq, rows_of[p].nr, rows_of[p].nrp, rows_of[p].ntp,
                             cfg.ubatches, uniform_query_len(rows_of[p].qsl, rows_of[p].nr) if boundary else None)
                 for p in range(self.P)]
        for u in range(cfg.ubatches):
            for p in range(self.P):
                ub, req = per_p[p][u], rows_of[p].req
                rows = Rows(ub.seq_lens.astype(np.int64), ub.query_start_loc.astype(np.int64), ub.num_reqs,
                            ub.slice.tok_stop - ub.slice.tok_start,
                            None if req is None else req[ub.slice.req_start : ub.slice.req_stop])
                self.emit(p, rows, Build(step, "ubatch", "ubatch", ub_graph, UBATCH + u, kind, ubatch=u),
                          Lineage(top[p][0], ub.slice, parent_views=top[p][1]))

    def startup(self) -> None:
        """Step 0: the profile run, then CUDA-graph capture (generic, then DFlash's)."""
        cfg = self.cfg
        home = PCP_BUF if self.P > 1 else RUNNER
        tokens = cfg.token_budget
        prof = dummy_rows(min(tokens, cfg.max_num_reqs), tokens, 0, cfg.max_model_len)
        desc = Desc(GraphMode.EAGER, tokens, None,
                    cfg.ubatches if cfg.ubatches > 1 and tokens >= DBO_PREFILL_TOKENS else 1)
        self.run_batch(0, [None] * self.P, [prof] * self.P, desc, "dummy", "dummy", "dummy", home)
        for d in self.graphs.captures():
            reqs = d.num_reqs or min(d.num_tokens, cfg.max_num_reqs)
            # set_dcp_capture_context: FULL graphs capture with N*I tokens of KV context under DCP
            ctx = self.N * self.I if d.mode.full and self.N > 1 else 0
            rows = dummy_rows(reqs, d.num_tokens, ctx, cfg.max_model_len)
            self.run_batch(0, [None] * self.P, [rows] * self.P, d, "capture", "capture", "capture", home)
        if cfg.spec_method == "dflash" and cfg.spec_tokens > 0:
            for d in self.graphs.captures():
                if d.mode.full and d.ubatches == 1:  # PIECEWISE DFlash captures skip attention
                    rows = dummy_rows(d.num_reqs, d.num_tokens, 0, cfg.max_model_len)
                    for p in range(self.P):
                        self.emit(p, rows, Build(0, "dflash_capture", "dflash", GraphMode.FULL_CAPTURE, DFLASH,
                                                 "capture"))

    def dummy_run(self, step: int, k: int, rng: np.random.Generator) -> None:
        """A DP-idle dummy batch (a peer's shape, alternating uniform decode and mixed), with context."""
        cfg = self.cfg
        dql = cfg.decode_query_len
        uniform = k % 2 == 0
        if uniform:
            reqs = int(rng.integers(1, cfg.max_num_reqs + 1))
            tokens = reqs * dql
        else:
            tokens = int(rng.integers(64, cfg.token_budget + 1))
            reqs = min(tokens, cfg.max_num_reqs)
        desc = self.graphs.dispatch(reqs, tokens, uniform, True)
        reqs = desc.num_reqs or reqs
        rows = dummy_rows(reqs, max(desc.num_tokens, tokens), int(rng.integers(512, 8193)), cfg.max_model_len)
        # the split follows the peer's shape: a mixed peer batch has no uniform query length to agree on
        self.run_batch(step, [None] * self.P, [rows] * self.P, desc, "dummy", "dummy", "dummy",
                       PCP_BUF if self.P > 1 else RUNNER, uniform=uniform)

    def real_step(self, step: int, b: Batch) -> Desc:
        cfg, P = self.cfg, self.P
        q, comp, isp = b.query_lens, b.num_computed, b.is_prefilling
        uniform = not isp.any() and bool((q == cfg.decode_query_len).all())
        tokens = int(q.sum()) if P == 1 else int(pcp_rank_tokens(q, isp, P, self.N).max())
        desc = self.graphs.dispatch(b.num_reqs, tokens, uniform, True)
        ntp = desc.num_tokens if desc.mode != GraphMode.EAGER else tokens
        g = make_rows(q, b.seq_lens, desc.num_reqs or b.num_reqs, max(int(q.sum()), ntp))
        if P == 1:
            self.run_batch(step, [None], [g], desc, "attn_metadata", "final", "step", RUNNER, uniform=uniform)
            return desc
        # the view each process derived from the global batch (before the fix)
        glob = [self.emit(p, g, Build(step, "prepare_inputs", "global", GraphMode.EAGER, RUNNER, pages=False))
                for p in range(P)]
        local = []
        for p in range(P):
            lb = pcp_partition(q, comp, isp, P, p, self.N)
            local.append(make_rows(lb.query_lens, lb.seq_lens, desc.num_reqs or lb.num_reqs, ntp, lb.req))
        self.run_batch(step, [gi for gi, _ in glob], local, desc, "pcp_partition", "final", "step", PCP_BUF,
                       global_views_of=[gv for _, gv in glob], uniform=uniform)
        return desc

    def drafts(self, step: int, desc: Desc, computed_after: np.ndarray) -> None:
        """MTP/DFlash draft steps 1..K-1 build their own metadata from the drafter's seq_lens."""
        cfg = self.cfg
        n = computed_after.size
        for k in range(1, cfg.spec_tokens):
            seq = np.minimum(computed_after + k, cfg.max_model_len)
            rows = make_rows(np.ones(n, np.int64), seq, desc.num_reqs or n, n)
            for p in range(self.P):
                self.emit(p, rows, Build(step, "draft", "draft", GraphMode.EAGER, DRAFTER, disagree=True))
