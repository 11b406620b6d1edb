"""runner: the model of vLLM's GPU model runner that simulate drives (over 450 lines: one model, its configs,
CUDA-graph capture sizes and dispatch, code paths and the faults injected on them, read together).

SimConfig and the fault table (DESIGN §4), capture sizes and dispatch (FULL_AND_PIECEWISE for --cudagraph
full), and Runner: every batch on every DCP rank of every PCP rank, through the paths vLLM takes
(dummy runs, capture, PCP partition, micro-batches, drafter), with the pre-fix faults where they occurred.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np

from dcptool.check.rules import RULE_OF_FAULT
from dcptool.choices import CudaGraph, Pipeline, SpecMethod, spoken, values
from dcptool.dcp.reference import local_of
from dcptool.dcp.slicing import (
    UbatchSlice,
    parse_engine_version,
    pcp_partition,
    pcp_rank_tokens,
    split_batch,
    splits_on_request_boundary,
    uniform_query_len,
)
from dcptool.dump.schema import INT32_MAX, DcptoolError, GraphMode

if TYPE_CHECKING:
    from dcptool.model.simulate import Batch, _Sink

# DESIGN §4's fault table: fault -> (the rule replay must report (rules.TABLE says which), what the engine did).
_FAULT_WHAT = {
    "dummy-none": "dummy/profile runs build attention metadata with None",
    "dflash-capture-none": "DFlash CUDA-graph capture gets None",
    "ubatch-none": "micro-batches drop the field",
    "ubatch-parent-rows": "micro-batches copy the parent's rows",
    "pcp-stale": "derived from the global batch before the PCP partition",
    "pcp-unpadded": "PCP-local view sliced to num_reqs, not num_reqs_padded",
    "capture-wrong-buffer": "capture fills the runner's buffer; PCP replays read the PCP manager's",
    "graph-stale": "a per-step buffer baked into a full graph",
    "sentinel": "padded rows keep a -1 left in the buffer",
    "flashinfer-global-pages": "page counts from the global length",
    # issue 15: what else DCP attention consumes (opt-in with --inject; not part of --pipeline legacy)
    "dcp-qsl-local": "the empty-shard mask's dcp_query_start_loc counts only the query tokens of this rank's "
                     "non-empty shards (rank-local) instead of query_start_loc[:num_decodes+1]",
    "tot-local": "the global companion (dcp_tot_seq_lens) is passed this rank's local lengths",
    "rank-disagree": "one DCP rank sees a request's seq_len off by one (ranks disagree on what must be replicated)",
}
# Faults of issue 15: real failure classes, but not the pre-fix ordering `--pipeline legacy` models.
# The slot faults too: slot-all-ranks is in no release, and whether 0.29-0.30's replicated groups (Mamba/GDN)
# ever read the slots slot-wrong-group localises is not established (a legacy run must model known faults only).
OPT_IN = frozenset({"dcp-qsl-local", "tot-local", "rank-disagree", "slot-wrong-group", "slot-all-ranks"})
# issue 15 item 3: which rank writes each KV slot
_FAULT_WHAT.update({
    "slot-wrong-group": "the slot mapping localises a replicated KV-cache group (Mamba/GDN state) as DCP-sharded",
    "slot-all-ranks": "every rank writes every token of a DCP-sharded group (the non-owner mask dropped)",
})
FAULTS: dict[str, tuple[str, str]] = {f: (RULE_OF_FAULT[f], what) for f, what in _FAULT_WHAT.items()}
# Where each fault really occurred, read from vLLM's released code (0.27.0-0.34.0; docs/faults.md has
# the code paths): a release range, "main only" (on vLLM main between releases, never released), or
# "no release" (a failure class dcptool models that no release 0.27-0.34 has).
FAULT_WHERE: dict[str, str] = {
    "dummy-none": "0.27–0.29",
    "dflash-capture-none": "0.27–0.28",
    "ubatch-none": "0.27–0.33 (V1 runner)",
    "ubatch-parent-rows": "main only",
    "pcp-stale": "main only",
    "pcp-unpadded": "no release",
    "capture-wrong-buffer": "no release",
    "graph-stale": "no release",
    "sentinel": "no release",
    "flashinfer-global-pages": "0.27–0.29",
    "dcp-qsl-local": "no release",
    "tot-local": "no release",
    "rank-disagree": "no release",
    # 0.29-0.30's kernel localises every group (no dcp_sharded flag); vLLM #57260 reports it on a later main
    "slot-wrong-group": "0.29–0.30",
    "slot-all-ranks": "no release",
}
# The KV-cache groups simulate's engine has (rows.slot_group indexes it): the attention KV cache, DCP-sharded, and
# a replicated one (Mamba/GDN state as vLLM 0.31+ keeps it under DCP); both in page_size blocks.
KV_GROUPS = (("attn", True), ("mamba", False))
SITES = ("prepare_inputs", "pcp_partition", "attn_metadata", "ubatch", "dummy", "capture", "dflash_capture", "draft")
PIPELINES = values(Pipeline)
CUDAGRAPH_CHOICES = values(CudaGraph)
SPEC_METHODS = values(SpecMethod)

# vLLM defaults the model follows (ParallelConfig.dbo_*_token_threshold, CompilationConfig's ceiling).
DBO_DECODE_TOKENS = 32
DBO_PREFILL_TOKENS = 512
MAX_GRAPH_TOKENS = 512
# Buffer identities: one address space per recording process, fixed slots for persistent buffers.
RUNNER, PCP_BUF, DRAFTER, DFLASH, UBATCH = 1, 2, 3, 4, 8


class SimError(DcptoolError, ValueError):
    """A configuration simulate cannot run (the CLI prints it and exits 2)."""


@dataclass(frozen=True)
class SimConfig:
    dcp: int = 2
    interleave: int = 1
    pcp: int = 1
    steps: int = 32
    spec_tokens: int = 2
    spec_method: str = "mtp"
    ubatches: int = 2
    cudagraph: str = "full"
    dummy_every: int = 16
    page_size: int = 16
    pipeline: str = "fixed"
    inject: tuple[str, ...] = ()
    seed: int = 0
    # The workload: realistic serving sizes (vLLM's max_num_seqs / max_num_batched_tokens / max_model_len).
    max_num_reqs: int = 64
    token_budget: int = 2048
    max_model_len: int = 32768
    arrival_rate: float = 0.6  # new requests per step (Poisson)
    accept_rate: float = 0.7  # chance each draft token is accepted, given the ones before were
    # The vLLM release modelled: sets the micro-batch split rule (0.34 splits a uniform decode batch on a
    # request boundary) and is recorded as the dump's engine_version; "" keeps the default (0.33's rule).
    engine_version: str = ""

    @property
    def faults(self) -> tuple[str, ...]:
        """The faults this run injects, in the fault table's order."""
        chosen = set(FAULTS) - OPT_IN if self.pipeline == "legacy" else set(self.inject)
        return tuple(f for f in FAULTS if f in chosen)

    @property
    def decode_query_len(self) -> int:
        return 1 + self.spec_tokens

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise SimError(msg)

        for name in ("dcp", "interleave", "pcp", "ubatches", "page_size", "max_num_reqs", "token_budget"):
            need(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        need(self.steps >= 0, f"--steps must be >= 0, got {self.steps}")
        need(self.spec_tokens >= 0, f"--spec-tokens must be >= 0, got {self.spec_tokens}")
        need(self.dummy_every >= 0, f"--dummy-every must be >= 0 (0: only the start-up profile run), got "
                                    f"{self.dummy_every}")
        need(self.pipeline in PIPELINES, f"--pipeline {self.pipeline!r}: choose {spoken(Pipeline)}")
        need(self.cudagraph in CUDAGRAPH_CHOICES, f"--cudagraph {self.cudagraph!r}: choose {spoken(CudaGraph)}")
        need(self.spec_method in SPEC_METHODS, f"--spec-method {self.spec_method!r}: choose {spoken(SpecMethod)}")
        unknown = [f for f in self.inject if f not in FAULTS]
        need(not unknown, f"--inject: unknown fault {', '.join(unknown)} (known: "
                          f"{', '.join(f'{f} [{FAULT_WHERE[f]}]' for f in FAULTS)})")
        need(not self.engine_version or parse_engine_version(self.engine_version) is not None,
             f"--engine-version {self.engine_version!r}: expected a vLLM version such as 0.34.0")
        need(not (self.inject and self.pipeline == "legacy"),
             "--inject picks faults on top of the fixed pipeline; --pipeline legacy already injects all of them")
        # vLLM: the KV block size must be a multiple of cp_kv_cache_interleave_size.
        need(self.page_size % self.interleave == 0,
             f"--page-size {self.page_size} must be a multiple of --interleave {self.interleave} (as vLLM's block "
             "size must be)")
        need(self.dcp * self.interleave <= self.max_model_len, "--dcp x --interleave exceeds the model length")
        need(self.token_budget >= self.decode_query_len, "--token-budget must fit one decode with its drafts")
        # vLLM's PCPManager.validate_config: PCP speculates with (single-module) MTP only.
        need(not (self.pcp > 1 and self.spec_tokens > 0 and self.spec_method == "dflash"),
             "--spec-method dflash with --pcp > 1: vLLM's PCP supports only MTP speculative decoding")

    def command(self) -> str:
        """The `dcptool simulate` command line that reproduces this configuration."""
        out = ["dcptool", "simulate"]
        for f in fields(self):
            v, d = getattr(self, f.name), f.default
            if f.name == "inject":
                if v:
                    out += ["--inject", ",".join(v)]
            elif v != d:
                out += [f"--{f.name.replace('_', '-')}", str(v)]
        return shlex.join(out)


def applicability(cfg: SimConfig) -> dict[str, str | None]:
    """fault -> None when the configuration exercises the path it breaks, else why it cannot apply."""
    graphs = cfg.cudagraph == "full"
    why = {
        "dummy-none": None,
        "dflash-capture-none": None if cfg.spec_method == "dflash" and cfg.spec_tokens > 0 and graphs else
        "needs --spec-method dflash, --spec-tokens > 0 and --cudagraph full",
        "ubatch-none": None if cfg.ubatches > 1 else "needs --ubatches > 1",
        "ubatch-parent-rows": None if cfg.ubatches > 1 else "needs --ubatches > 1",
        "pcp-stale": None if cfg.pcp > 1 else "needs --pcp > 1",
        "pcp-unpadded": None if cfg.pcp > 1 and graphs else "needs --pcp > 1 and --cudagraph full (request padding)",
        "capture-wrong-buffer": None if cfg.pcp > 1 and graphs else "needs --pcp > 1 and --cudagraph full",
        "graph-stale": None if graphs else "needs --cudagraph full",
        "sentinel": None if graphs else "needs --cudagraph full (only full graphs pad requests)",
        "flashinfer-global-pages": None,
        # empty shards among decode rows (query length 1, the FlashInfer threshold under DCP): capture batches
        # of 1-token requests without context
        "dcp-qsl-local": None if cfg.cudagraph != "none" else "needs --cudagraph piecewise or full (capture "
                         "batches of 1-token requests have empty shards)",
        "tot-local": None,
        "rank-disagree": None,
    }
    slots = None if cfg.pcp == 1 else "needs --pcp 1 (simulate records slot mappings without PCP only)"
    why.update({"slot-wrong-group": slots, "slot-all-ranks": slots})
    if cfg.dcp == 1:  # vLLM passes None everywhere: nothing DCP-specific can go wrong
        why = {f: "needs --dcp > 1" for f in why}
    return why


# --------------------------------------------------------------------------------------------
# CUDA graphs: vLLM's capture sizes and dispatch (FULL_AND_PIECEWISE for --cudagraph full)


@dataclass(frozen=True)
class Desc:
    """A batch execution descriptor: graph mode, padded tokens, padded requests (None: no request padding)."""

    mode: GraphMode  # as dispatched: EAGER, PIECEWISE or FULL_REPLAY (a full graph; recorded() says capture or replay)
    num_tokens: int
    num_reqs: int | None
    ubatches: int = 1


def capture_sizes(max_num_reqs: int, max_num_tokens: int, decode_query_len: int) -> list[int]:
    """vLLM's default cudagraph_capture_sizes (VllmConfig): 1, 2, 4, then every 8 to 256, every 16
    above, up to min(2 * max_num_seqs * decode_query_len, 512), plus the uniform decode sizes."""
    mx = min(max_num_reqs * decode_query_len * 2, MAX_GRAPH_TOKENS)
    if decode_query_len > 1:
        n = min(max_num_reqs, MAX_GRAPH_TOKENS)
        counts = {c for c in (1, 2, 4) if c <= n} | set(range(8, min(n + 1, 256), 8)) | set(range(256, n + 1, 16))
        decode = {c * decode_query_len for c in counts | {n} if c * decode_query_len <= mx}
    else:
        decode = {max_num_reqs} if max_num_reqs <= mx else set()
    mx = min(max_num_tokens, mx)
    sizes = {s for s in (1, 2, 4) if s <= mx} | set(range(8, min(mx + 1, 256), 8)) | set(range(256, mx + 1, 16))
    if max_num_tokens <= mx:
        sizes.add(max_num_tokens)
    sizes |= {s for s in decode if s <= max_num_tokens}
    return sorted(sizes)


class Graphs:
    """The descriptors vLLM's CudaGraphManager captures, and its dispatch (smallest compatible graph)."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        dql, R = cfg.decode_query_len, cfg.max_num_reqs
        self.full: list[Desc] = []  # uniform-decode FULL graphs (and their micro-batched twins)
        self.piecewise: list[Desc] = []
        if cfg.cudagraph == "none":
            return
        sizes = capture_sizes(R, cfg.token_budget, dql)
        self.max_size = sizes[-1]
        if cfg.cudagraph == "full":
            for s in sizes:
                tok = -(-s // dql) * dql
                if tok > R * dql or tok > self.max_size or tok // dql > R:
                    continue
                d = Desc(GraphMode.FULL_REPLAY, tok, tok // dql)
                if d not in self.full:
                    self.full.append(d)
                    if cfg.ubatches > 1 and tok >= max(DBO_DECODE_TOKENS, cfg.ubatches):
                        self.full.append(Desc(GraphMode.FULL_REPLAY, tok, tok // dql, cfg.ubatches))
        self.piecewise = [Desc(GraphMode.PIECEWISE, s, None) for s in sizes]

    def captures(self) -> list[Desc]:
        """In vLLM's capture order: PIECEWISE first, then FULL, each largest first (twin after its base)."""
        by_size = sorted(self.piecewise, key=lambda d: -d.num_tokens)
        return by_size + sorted(self.full, key=lambda d: -d.num_tokens)

    def dispatch(self, num_reqs: int, num_tokens: int, uniform_decode: bool, ubatch: bool) -> Desc:
        cfg = self.cfg
        base = self._smallest_full(num_tokens) if uniform_decode else None
        if base is not None and base.num_reqs < num_reqs:
            base = None
        if ubatch and cfg.ubatches > 1 and num_tokens >= (DBO_DECODE_TOKENS if uniform_decode else DBO_PREFILL_TOKENS):
            # a micro-batched FULL graph when one was captured, unless its second half would be empty
            twin = None if base is None else Desc(GraphMode.FULL_REPLAY, base.num_tokens, base.num_reqs, cfg.ubatches)
            if twin is not None and twin in self.full and 2 * num_tokens >= twin.num_tokens:
                return twin
            return Desc(GraphMode.EAGER, num_tokens, None, cfg.ubatches)
        if base is not None:
            return base
        for d in self.piecewise:
            if d.num_tokens >= num_tokens:
                return d
        return Desc(GraphMode.EAGER, num_tokens, None)

    def _smallest_full(self, num_tokens: int) -> Desc | None:
        return next((d for d in self.full if d.ubatches == 1 and d.num_tokens >= num_tokens), None)


# --------------------------------------------------------------------------------------------
# The runner model


@dataclass
class _Rows:
    """A batch as attention metadata sees it: padded seq_lens and query_start_loc."""

    seq: np.ndarray  # [num_reqs_padded] int64, padded rows 0
    qsl: np.ndarray  # [num_reqs_padded + 1] int64, padded entries repeat the real token count
    nr: int
    ntp: int  # tokens after padding

    @property
    def nrp(self) -> int:
        return int(self.seq.size)


def _rows(query_lens: np.ndarray, seq_lens: np.ndarray, nrp: int, ntp: int) -> _Rows:
    nr = int(query_lens.size)
    seq = np.zeros(nrp, np.int64)
    seq[:nr] = seq_lens
    qsl = np.empty(nrp + 1, np.int64)
    qsl[0] = 0
    np.cumsum(query_lens, out=qsl[1 : nr + 1])
    qsl[nr + 1 :] = qsl[nr]
    return _Rows(seq, qsl, nr, max(ntp, int(qsl[nr])))


def _dummy(num_reqs: int, num_tokens: int, context: int, max_model_len: int) -> _Rows:
    """InputBatch.make_dummy (tokens spread evenly, the last ones get one more), then set_dummy_context."""
    q = np.full(num_reqs, num_tokens // num_reqs, np.int64)
    q[num_reqs - num_tokens % num_reqs :] += 1
    seq = q + np.minimum(context, max_model_len - q)
    return _rows(q, seq, num_reqs, num_tokens)


class Runner:
    """vLLM's model runner for all P x N recording processes (PCP rank p, DCP rank r).

    Every attention-metadata build is recorded: the fixed pipeline computes DCP metadata once from
    the final batch (after the PCP partition, padding and set_dummy_context) into the buffer that
    batch lives in; each injected fault replaces that at the sites where pre-fix vLLM went wrong, and
    what it changed there (compared with the fixed value of the same observation) is its ground truth.
    """

    def __init__(self, cfg: SimConfig, sink: _Sink):
        self.cfg, self.sink = cfg, sink
        self.N, self.P, self.I, self.G = cfg.dcp, cfg.pcp, cfg.interleave, cfg.page_size
        self.F = frozenset(cfg.faults) - {f for f, why in applicability(cfg).items() if why is not None}
        self.graphs = Graphs(cfg)
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
        """DESIGN §1's local length on every rank at once, [N, rows]."""
        return local_of(seq.reshape(1, -1), self.ranks, self.N, self.I)

    # ---- buffers

    def _buf(self, proc: int, slot: int) -> int:
        return (0x7F << 40) | (proc << 24) | (slot << 12)

    def _per_step_buf(self, proc: int) -> int:
        self._fresh += 1
        return (0x7E << 40) | (proc << 32) | self._fresh

    # ---- one batch on every DCP rank of PCP rank p

    def emit(self, p: int, b: _Rows, *, step: int, site: str, role: str, graph: GraphMode, slot: int, ubatch: int = -1,
             parents: list[int] | None = None, sl: UbatchSlice | None = None, parent_views: np.ndarray | None = None,
             global_views: np.ndarray | None = None, kind: str = "step", pages: bool = True, disagree: bool = False):
        """Record batch `b` on DCP ranks 0..N-1 of PCP rank p.

        Every rank's view is computed at once ([N, rows]); returns (indices per rank, recorded views
        [N, length] or None) so that children (micro-batches, the PCP-local batch) can derive from them.
        """
        N, F, nr, nrp = self.N, self.F, b.nr, b.nrp
        loc = self._local(b.seq[:nr])  # [N, nr]
        marks: list[tuple[str, np.ndarray]] = []  # (fault, [N] bool: ranks it touched)
        odd_seq = None  # rank-disagree: the last rank's seq_lens (its local lengths and pages follow them)
        if disagree and "rank-disagree" in F and N > 1 and nr >= 1:
            odd_seq = b.seq.copy()
            odd_seq[0] += 1
            loc = loc.copy()
            loc[N - 1] = local_of(odd_seq[:nr], N - 1, N, self.I)
            marks.append(("rank-disagree", np.arange(N) == N - 1))
        view = None
        if N > 1:
            fixed = np.zeros((N, nrp), np.int64)
            fixed[:, :nr] = loc
            view = self._faults(role, kind, b, fixed, parent_views, global_views, sl, marks)
        kv = None
        if pages:
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
        fresh = view is not None and graph == GraphMode.FULL_REPLAY and "graph-stale" in F
        home = slot
        if view is not None and role == "capture" and self.P > 1 and ubatch < 0 and "capture-wrong-buffer" in F:
            home = RUNNER
        sink = self.sink
        sink.by_site[site] = sink.by_site.get(site, 0) + N
        procs = range(p * N, p * N + N)
        if view is None:
            bufs = [0] * N
        elif fresh:
            bufs = [self._per_step_buf(proc) for proc in procs]
        else:
            bufs = [self._buf(proc, home) for proc in procs]
        dq, tot = self._decode_path(b, view, odd_seq, marks) if pages and view is not None else (None, None)
        kw = dict(step=step, site=site, seq_lens=b.seq, num_reqs=nr, num_reqs_padded=nrp, ubatch=ubatch,
                  query_start_loc=b.qsl, num_tokens_padded=b.ntp, graph=int(graph))
        slots = self._slots(b, role, kind, 0 if sl is None else sl.req_start, marks)
        if sl is not None:
            kw.update(req_start=sl.req_start, tok_start=sl.tok_start, tok_stop=sl.tok_stop)
        if odd_seq is not None:  # the last rank records other seq_lens: one call per rank
            idxs = [sink.recorders[sink.file_of[proc]].observe(
                rank=r, dcp_local_seq_lens=None if view is None else view[r],
                parent=None if parents is None else parents[r], buffer=bufs[r],
                kv_pages=None if kv is None else kv if kv.ndim == 1 else kv[r],
                dcp_query_start_loc=None if dq is None else dq[r], dcp_tot_seq_lens=None if tot is None else tot[r],
                **({} if slots is None else dict(positions=slots[0], slot_mapping=slots[1][r])),
                **{**kw, "seq_lens": odd_seq if r == N - 1 else b.seq}) for r, proc in enumerate(procs)]
        elif sink.shared:  # every rank in one file: one call records the batch on all N ranks
            if slots is not None:
                kw.update(positions=slots[0], slot_mapping={g: slots[1][:, g] for g in range(len(KV_GROUPS))})
            idxs = sink.recorders[0].observe_many(ranks=range(N), dcp_local_seq_lens=view, parents=parents,
                                                  buffers=bufs, kv_pages=kv, dcp_query_start_loc=dq,
                                                  dcp_tot_seq_lens=tot, **kw)
        else:
            idxs = [sink.recorders[proc].observe(rank=r, dcp_local_seq_lens=None if view is None else view[r],
                                                 parent=None if parents is None else parents[r], buffer=bufs[r],
                                                 kv_pages=None if kv is None else kv if kv.ndim == 1 else kv[r],
                                                 dcp_query_start_loc=None if dq is None else dq[r],
                                                 dcp_tot_seq_lens=None if tot is None else tot[r], **kw,
                                                 **({} if slots is None else dict(
                                                     positions=slots[0], slot_mapping=slots[1][r])))
                    for r, proc in enumerate(procs)]
        for r, proc in enumerate(procs):
            idx, buf = idxs[r], bufs[r]
            if graph.full and buf:
                key = (sink.file_of[proc], r, nrp, ubatch)
                if graph == GraphMode.FULL_CAPTURE:
                    self._captured.setdefault(key, set()).add(buf)
                elif key in self._captured and buf not in self._captured[key]:
                    # the replay reads another buffer than its capture: DESIGN's alias, reported at the replay
                    if fresh:
                        sink.mark(proc, idx, "graph-stale")
                    if "capture-wrong-buffer" in F and self.P > 1 and ubatch < 0:
                        sink.mark(proc, idx, "capture-wrong-buffer")
            for fault, hit in marks:
                if hit[r]:
                    sink.mark(proc, idx, fault)
        return idxs, view

    def _decode_path(self, b: _Rows, view: np.ndarray, odd_seq: np.ndarray | None, marks: list):
        """What vLLM's FlashInfer decode path (0.30+) receives beside the local lengths, per rank ([N, ...]):
        dcp_query_start_loc = query_start_loc[:num_decodes+1] and the global companion seq_lens[:num_decodes]
        (as MLA's dcp_tot_seq_lens); num_decodes as split_decodes_and_prefills at threshold 1 (padded rows
        count). (None, None) when the batch has no decode rows: no decode path. Applies issue 15's faults."""
        N, F = self.N, self.F
        ql = np.diff(b.qsl)
        nd = int(np.argmax(ql > 1)) if (ql > 1).any() else b.nrp
        if nd == 0:
            return None, None
        q = b.qsl[: nd + 1]
        dq = np.broadcast_to(q, (N, nd + 1))
        seqs = np.broadcast_to(b.seq[:nd], (N, nd)).copy()
        if odd_seq is not None:
            seqs[N - 1] = odd_seq[:nd]
        tot = seqs
        if "dcp-qsl-local" in F:
            s = np.zeros((N, nd), np.int64)
            k = min(nd, view.shape[1])
            s[:, :k] = view[:, :k]
            dq = np.zeros((N, nd + 1), np.int64)
            np.cumsum(ql[:nd] * (s > 0), axis=1, out=dq[:, 1:])  # empty shards' query tokens dropped
            marks.append(("dcp-qsl-local", (dq != q).any(axis=1)))
        if "tot-local" in F:
            # the real rows only: a padded row of the view may hold another fault's sentinel (-1), which no
            # global length can be (the Recorder would drop the whole observation, and the fault with it)
            real = min(nd, b.nr)
            k = min(real, view.shape[1])
            tot = seqs.copy()
            tot[:, :k] = view[:, :k]
            marks.append(("tot-local", (tot[:, :real] != seqs[:, :real]).any(axis=1)))
        return dq, tot
    def _slots(self, b: _Rows, role: str, kind: str, req0: int, marks: list) -> tuple | None:
        """(positions [ntp], slot mappings [N, groups, ntp]) as vLLM's _compute_slot_mappings_kernel writes them
        on every rank (issue 15), or None where simulate records none (PCP, drafts, the pre-partition batch).

        Request k of the batch (k + req0 in a micro-batch's parent) owns blocks k * blocks_per_request + j, so
        slots are distinct as vLLM's allocator makes them. Dummy runs and graph capture write nothing
        (get_dummy_slot_mappings). Faults append (fault, [N] ranks) to `marks` where replay's `slots` /
        `slot-partition` can see the change."""
        if self.P > 1 or role in ("draft", "global"):
            return None
        N, I_, B = self.N, self.I, self.G
        nr, ntp = b.nr, b.ntp
        per_req = -(-self.cfg.max_model_len // B) + 1
        if (req0 + b.nrp + 1) * per_req * B > INT32_MAX:
            return None  # slot ids past int32: an engine this large records no slots here
        q = np.diff(b.qsl[: nr + 1])
        real = int(b.qsl[nr])
        req = np.repeat(np.arange(nr), q)
        pos = np.zeros(ntp, np.int64)
        pos[:real] = b.seq[req] - q[req] + (np.arange(real) - b.qsl[req])
        p = pos[:real]
        ranks = self.ranks  # [N, 1]
        vo = p % (B * N)
        local = p // (B * N) * B + vo // (I_ * N) * I_ + vo % I_
        owner = (p // I_) % N
        base = (req + req0) * per_req
        sharded = np.where(owner == ranks, (base + local // B) * B + local % B, -1)  # [N, real]
        replicated = np.broadcast_to((base + p // B) * B + p % B, (N, real))
        out = np.full((N, len(KV_GROUPS), ntp), -1, np.int64)
        if kind in ("dummy", "capture") or role in ("dummy", "dflash"):
            return pos, out
        F = self.F
        out[:, 0, :real] = sharded
        out[:, 1, :real] = replicated
        if "slot-wrong-group" in F:
            out[:, 1, :real] = sharded
            # what the `slots` rule can see on a rank: a token it does not own left unwritten while it writes
            # others, or a slot at another block offset than p % B (a rank owning none of the tokens writes
            # nothing at all in the group, which is what a dummy build looks like)
            own = owner == ranks
            moved = (own & (local % B != p % B)).any(axis=1)
            marks.append(("slot-wrong-group", (own.any(axis=1) & (~own).any(axis=1)) | moved))
        if "slot-all-ranks" in F:
            out[:, 0, :real] = (base + local // B) * B + local % B  # no is_local mask: every rank writes
            marks.append(("slot-all-ranks", (owner != ranks).any(axis=1)))
        return pos, out

    def _faults(self, role, kind, b: _Rows, fixed, parent_views, global_views, sl, marks):
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
            top.append(self.emit(p, rows_of[p], step=step, site=site, role=role, graph=g, slot=slot,
                                 parents=parents_of[p], kind=kind, disagree=not split and kind == "step",
                                 global_views=None if global_views_of is None else global_views_of[p]))
        if not split:
            return
        ub_graph = desc.mode.recorded(capturing=kind == "capture") if desc.mode.full else GraphMode.EAGER
        boundary = splits_on_request_boundary(cfg.engine_version) and uniform is not False
        per_p = [split_batch(rows_of[p].qsl, rows_of[p].seq, rows_of[p].nr, rows_of[p].nrp, rows_of[p].ntp,
                             cfg.ubatches, uniform_query_len(rows_of[p].qsl, rows_of[p].nr) if boundary else None)
                 for p in range(self.P)]
        for u in range(cfg.ubatches):
            for p in range(self.P):
                ub = per_p[p][u]
                rows = _Rows(ub.seq_lens.astype(np.int64), ub.query_start_loc.astype(np.int64), ub.num_reqs,
                             ub.slice.tok_stop - ub.slice.tok_start)
                self.emit(p, rows, step=step, site="ubatch", role="ubatch", graph=ub_graph, slot=UBATCH + u,
                          ubatch=u, parents=top[p][0], sl=ub.slice, parent_views=top[p][1], kind=kind)

    def startup(self) -> None:
        """Step 0: the profile run, then CUDA-graph capture (generic, then DFlash's)."""
        cfg = self.cfg
        home = PCP_BUF if self.P > 1 else RUNNER
        tokens = cfg.token_budget
        prof = _dummy(min(tokens, cfg.max_num_reqs), tokens, 0, cfg.max_model_len)
        desc = Desc(GraphMode.EAGER, tokens, None,
                    cfg.ubatches if cfg.ubatches > 1 and tokens >= DBO_PREFILL_TOKENS else 1)
        self.run_batch(0, [None] * self.P, [prof] * self.P, desc, "dummy", "dummy", "dummy", home)
        for d in self.graphs.captures():
            reqs = d.num_reqs or min(d.num_tokens, cfg.max_num_reqs)
            # set_dcp_capture_context: FULL graphs capture with N*I tokens of KV context under DCP
            ctx = self.N * self.I if d.mode.full and self.N > 1 else 0
            rows = _dummy(reqs, d.num_tokens, ctx, cfg.max_model_len)
            self.run_batch(0, [None] * self.P, [rows] * self.P, d, "capture", "capture", "capture", home)
        if cfg.spec_method == "dflash" and cfg.spec_tokens > 0:
            for d in self.graphs.captures():
                if d.mode.full and d.ubatches == 1:  # PIECEWISE DFlash captures skip attention
                    rows = _dummy(d.num_reqs, d.num_tokens, 0, cfg.max_model_len)
                    for p in range(self.P):
                        self.emit(p, rows, step=0, site="dflash_capture", role="dflash",
                                  graph=GraphMode.FULL_CAPTURE, slot=DFLASH, kind="capture")

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
        rows = _dummy(reqs, max(desc.num_tokens, tokens), int(rng.integers(512, 8193)), cfg.max_model_len)
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
        g = _rows(q, b.seq_lens, desc.num_reqs or b.num_reqs, max(int(q.sum()), ntp))
        if P == 1:
            self.run_batch(step, [None], [g], desc, "attn_metadata", "final", "step", RUNNER, uniform=uniform)
            return desc
        # the view each process derived from the global batch (before the fix)
        glob = [self.emit(p, g, step=step, site="prepare_inputs", role="global", graph=GraphMode.EAGER, slot=RUNNER,
                          pages=False) for p in range(P)]
        local = []
        for p in range(P):
            lb = pcp_partition(q, comp, isp, P, p, self.N)
            local.append(_rows(lb.query_lens, lb.seq_lens, desc.num_reqs or lb.num_reqs, ntp))
        self.run_batch(step, [gi for gi, _ in glob], local, desc, "pcp_partition", "final", "step", PCP_BUF,
                       global_views_of=[gv for _, gv in glob], uniform=uniform)
        return desc

    def drafts(self, step: int, desc: Desc, computed_after: np.ndarray) -> None:
        """MTP/DFlash draft steps 1..K-1 build their own metadata from the drafter's seq_lens."""
        cfg = self.cfg
        n = computed_after.size
        for k in range(1, cfg.spec_tokens):
            seq = np.minimum(computed_after + k, cfg.max_model_len)
            rows = _rows(np.ones(n, np.int64), seq, desc.num_reqs or n, n)
            for p in range(self.P):
                self.emit(p, rows, step=step, site="draft", role="draft", graph=GraphMode.EAGER, slot=DRAFTER,
                          disagree=True)
