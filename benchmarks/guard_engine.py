"""The engine-like loop bench_guard.py and soak_guard.py drive: a batch shape, every keyword the vLLM plugin hands the
Guard for one build of it, the floor's stand-in (an empty launch per build) and the host-sync count.

What the plugin passes for one build (dcptool/engine/vllm: state.observe builds the Record, hooks._read_build /
_slot_kwargs / _group_kwargs and builders.builder_kwargs fill it), by where it comes from:
- every backend: seq_lens, dcp_local_seq_lens, query_start_loc (the device buffer under the Guard:
  state.query_start_loc), num_tokens_padded, graph; positions and the [groups, tokens] int64 slot mappings of
  build_attn_metadata, the BlockTables' kv_block_sizes (numpy, read once); a hybrid model's group_seq_lens (a device
  tensor: per KV-cache group the lengths its builder reads).
- FlashInfer under DCP: its trtllm-gen decode's dcp_query_start_loc (device), the page counts of its native plans
  (kv_pages on decode rows, kv_prefill_pages on prefill rows, kv_last_page: numpy, -1 where none is read), the host
  copy of seq_lens it read, as read and as the build left it (host_seq_lens, host_seq_lens_after: numpy).
- FlashAttention under DCP: the addresses of dcp_context_kv_lens and seq_lens (attn_addrs, int32 words), their
  buffers' capacities (attn_caps), at a full-graph replay the addresses the capture baked in (graph_addrs).
- MLA: its decode's global dcp_tot_seq_lens (device), its chunked prefill context (ctx_chunks, numpy int64).
No backend hands all of them: `--fields all` passes the union (every check of the Guard runs on every build), one
backend's name that backend's set, `device` the device tensors alone (every check of the kernel, no host value),
`fast` the three row keywords of the fast path alone. Every value is right (a clean
run writes nothing, replay of its dump finds nothing): the loop keeps the device buffers and their host mirror in step.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from bench_record_sets import SYNC_WARNING

from dcptool.dcp.reference import dcp_local_seq_lens, last_page, local_np, slot_deal
from dcptool.dump import Record
from dcptool.dump.schema import GraphMode, addr_words
from dcptool.engine.vllm.builders import FLASH_ATTN_TENSORS

N, RANK, INTERLEAVE, PAGE = 2, 0, 1, 16  # DCP 2, this rank 0, interleave 1, FlashInfer's page of 16 tokens
KV_GROUPS = ({"name": "FullAttentionSpec", "dcp": True, "block_size": PAGE, "cp_size": N},
             {"name": "MambaSpec", "dcp": False, "block_size": PAGE, "cp_size": 1})  # a hybrid: one group replicated
SPAN = 1 << 19  # slots a request's blocks span (its length stays below: 2**17 at most, + 1 a step)
CAPACITY = 4096  # request rows the engine's persistent metadata buffers hold (attn_caps)


class Shape(NamedTuple):
    """A batch: `decodes` decode rows first (as vLLM orders them; `decode_q` query tokens each: more than one are
    speculative decoding's verify tokens), then prefill rows with these query lengths over these contexts (chunked
    prefill and prefix-cache hits)."""

    decodes: int
    prefill_q: tuple[int, ...] = ()
    prefill_ctx: tuple[int, ...] = ()
    decode_q: int = 1


# 8 prompts whose query lengths sum to 8,192 tokens (one max_num_batched_tokens step), half of them behind a context
_Q = (2048, 1536, 1024, 1024, 896, 768, 512, 384)
_CTX = (0, 4096, 0, 16384, 2048, 0, 8192, 1024)
SHAPES = {"decode256": Shape(256), "decode1024": Shape(1024), "prefill8192": Shape(0, _Q, _CTX)}
# --smoke: the same structure, sizes the Triton interpreter gets through in seconds
SMOKE = {"decode256": Shape(8), "decode1024": Shape(16), "prefill8192": Shape(0, tuple(q // 128 for q in _Q),
                                                                           tuple(c // 128 for c in _CTX))}

COMMON = ("seq_lens", "dcp_local_seq_lens", "query_start_loc", "num_tokens_padded", "graph", "positions",
          "slot_mapping", "kv_block_sizes", "group_seq_lens")
BACKENDS = {"flashinfer": ("dcp_query_start_loc", "kv_pages", "kv_prefill_pages", "kv_last_page", "host_seq_lens",
                           "host_seq_lens_after"),
            "flash_attn": ("attn_addrs", "graph_addrs", "attn_caps"),
            "mla": ("dcp_tot_seq_lens", "ctx_chunks")}
FIELDS = {"all": COMMON + sum(BACKENDS.values(), ()), **{k: COMMON + v for k, v in BACKENDS.items()},
          # the device tensors alone (every check of the kernel, none of the host values'; a hybrid's per-group lengths
          # left out: the Guard drops them)
          "device": ("seq_lens", "dcp_local_seq_lens", "query_start_loc", "num_tokens_padded", "graph", "positions",
                     "slot_mapping", "dcp_query_start_loc", "dcp_tot_seq_lens"),
          "fast": ("seq_lens", "dcp_local_seq_lens", "query_start_loc")}


def guard_config() -> dict:
    """The run's settings the plugin gives its Guard (state._guard, set_page_size, set_attn_tensors, set_kv_groups)."""
    return dict(page_size=PAGE, kv_groups=KV_GROUPS, attn_tensors=FLASH_ATTN_TENSORS)


class Engine:
    """One batch's persistent buffers (device) and their host mirror, one step's work (an in-place refresh of the
    metadata, `matmuls` queued matmuls of dim x dim) and the builds' keywords as the plugin passes them."""

    def __init__(self, dev: torch.device, shape: Shape, dim: int, dtype, fields: str = "all", matmuls: int = 3):
        torch.manual_seed(0)
        rng = np.random.default_rng(0)
        self.dev, self.fields, self.matmuls = dev, FIELDS[fields], matmuls
        self.a = torch.randn(dim, dim, dtype=dtype, device=dev)
        self.b = torch.randn(dim, dim, dtype=dtype, device=dev)
        self.c = torch.empty_like(self.a)
        self.nd = shape.decodes
        q = np.array([shape.decode_q] * shape.decodes + list(shape.prefill_q), np.int64)
        # FlashInfer's decode rows under DCP: the leading rows of one query token (split_decodes_and_prefills at
        # threshold 1); MLA's are the decode rows at the spec-decode threshold 1 + K (self.nd)
        # (model.rows.num_decodes' rule, written out: bench_guard --python --before runs this module against older
        # dcptool packages, which lack it)
        self.fi_nd = int(np.argmax(q > 1)) if (q > 1).any() else int(q.size)
        ctx = np.concatenate([rng.integers(1, 1 << 17, shape.decodes), np.array(shape.prefill_ctx, np.int64)])
        self.rows, self.tokens = int(q.size), int(q.sum())
        self.q = q
        self.base_np = (ctx + q).astype(np.int32)  # seq_lens: the context and this step's query tokens

        def d(a, dtype=torch.int32):
            return torch.from_numpy(np.asarray(a)).to(dtype).to(dev)

        self.base = d(self.base_np)
        self.seq = self.base.clone()
        self.seq_np = self.base_np.copy()  # seq_lens_cpu: the host copy the builders read
        self.dcp = torch.empty_like(self.seq)
        self.qsl = d(np.concatenate([[0], np.cumsum(q)]))
        self.qlen = d(q, torch.int64)
        self.tok_req = d(np.repeat(np.arange(self.rows), q), torch.int64)
        self.tok_off = d(np.arange(self.tokens) - np.repeat(np.cumsum(q) - q, q), torch.int64)
        self.span = d(np.repeat(np.arange(self.rows) * SPAN, q), torch.int64)  # each token's request's first slot
        self.positions = torch.empty(self.tokens, dtype=torch.int64, device=dev)
        self.slots = torch.empty((len(KV_GROUPS), self.tokens), dtype=torch.int64, device=dev)
        self.gsl = torch.empty(len(KV_GROUPS) * self.rows, dtype=torch.int32, device=dev)
        self.ctx_kv = torch.zeros(CAPACITY, dtype=torch.int32, device=dev)  # FlashAttention's dcp_context_kv_lens
        self.seq_buf = torch.zeros(CAPACITY, dtype=torch.int32, device=dev)  # ... and its seq_lens buffer
        self.fault = torch.zeros(1, dtype=torch.int32, device=dev)  # added to one row of the view (soak_guard)
        self.faultable = False
        self.kv = {}
        self.spent = 0.0

    def reset(self) -> None:
        self.seq.copy_(self.base)
        self.seq_np[:] = self.base_np
        self.spent = 0.0

    def update(self) -> None:
        """The step's refresh of the metadata buffers (on the stream), its host mirror and the builders' host arrays:
        the same work with the Guard off, on, or at the floor."""
        self.seq.add_(1)  # the engine refreshes its metadata on the stream every step
        self.dcp.copy_(dcp_local_seq_lens(self.seq, N, RANK, INTERLEAVE))
        if self.faultable:
            self.dcp[3:4].add_(self.fault)
        self.seq_np += 1
        if "positions" in self.fields or "group_seq_lens" in self.fields:
            start = self.seq.to(torch.int64) - self.qlen
            torch.add(start[self.tok_req], self.tok_off, out=self.positions)
            # the sharded group: the positions vLLM's slot-mapping kernel deals to this rank, at their place in its
            # cache; the replicated group: every rank writes every token. Request r's blocks start at slot r * SPAN.
            owner, local = slot_deal(self.positions, PAGE, N, INTERLEAVE)
            self.slots[0].copy_((local + self.span).masked_fill_(owner != RANK, -1))
            torch.add(self.positions, self.span, out=self.slots[1])
            self.gsl[:self.rows].copy_(self.dcp)
            self.gsl[self.rows:].copy_(self.seq)
        self.kv = self._kwargs()

    def _kwargs(self) -> dict:
        """The build's keywords (this step's values), those of the chosen fields."""
        nd, fi = self.nd, self.fi_nd
        every = dict(
            seq_lens=self.seq, dcp_local_seq_lens=self.dcp, query_start_loc=self.qsl, num_tokens_padded=self.tokens,
            graph=int(GraphMode.FULL_REPLAY), positions=self.positions, slot_mapping=self.slots,
            group_seq_lens=self.gsl, dcp_query_start_loc=self.qsl[:fi + 1] if fi else None,
            dcp_tot_seq_lens=self.seq[:nd] if nd else None)
        if len(self.fields) > len(set(self.fields) & set(every)):
            every.update(self._host_values())
        return {k: every[k] for k in self.fields}

    def _host_values(self) -> dict:
        """The builders' host arrays of this step: FlashInfer's plans and host copies, FlashAttention's addresses
        and capacities, MLA's chunked context, the block sizes."""
        seq, nd, r, fi = self.seq_np, self.nd, self.rows, self.fi_nd
        covered = (seq - self.q).astype(np.int64)  # (MLA's computed context: its rows past the decode rows are read)
        flash = (seq - self.q).astype(np.int64)  # (FlashInfer's plans: its decode rows' whole length)
        flash[:fi] = seq[:fi]
        local = local_np(flash, N, RANK, INTERLEAVE)
        decode = np.arange(r) < fi
        pages = -(-local // PAGE)
        words = addr_words((self.ctx_kv.data_ptr(), self.seq_buf.data_ptr()))
        ctx = [0]
        if r > nd:  # MLA's chunked context: one chunk (a multiple of N * I), each prefill row's whole context
            v = N * INTERLEAVE
            ctx = [-(-int(covered[nd:].max()) // v) * v] + [x for k in range(nd, r) if covered[k]
                                                             for x in (0, k, 0, int(covered[k]))]
        return dict(
            kv_block_sizes=np.full(3 * len(KV_GROUPS), PAGE, np.int32),
            kv_pages=np.where(decode, pages, -1).astype(np.int32),
            kv_prefill_pages=np.where(decode, -1, pages).astype(np.int32),
            kv_last_page=last_page(local, PAGE).astype(np.int32), host_seq_lens=seq.copy(),
            host_seq_lens_after=seq.copy(), attn_addrs=words, graph_addrs=words.copy(),
            attn_caps=np.full(2, CAPACITY, np.int32), ctx_chunks=np.asarray(ctx, np.int64))

    def captured(self) -> None:
        """The keywords of a build inside CUDA-graph capture: graph FULL_CAPTURE, no captured addresses to compare."""
        if "graph" in self.kv:
            self.kv["graph"] = int(GraphMode.FULL_CAPTURE)
            self.kv.pop("graph_addrs", None)

    def step(self, s: int, guard, builds: int = 4, capture: bool = False) -> None:
        """One step: the refresh, then `builds` builds, the first `matmuls` of them behind a matmul each."""
        self.update()
        if capture:
            self.captured()
        for k in range(builds):
            if k < self.matmuls:
                torch.mm(self.a, self.b, out=self.c)
            if guard is not None:
                t = time.perf_counter()
                self.observe(guard, s)
                self.spent += time.perf_counter() - t

    def observe(self, guard, s: int) -> int:
        """One build as the plugin hands it over: state.observe's Record, Guard.record."""
        return guard.record(Record(step=s, site="attn_metadata", rank=RANK, num_reqs=self.rows,
                                   num_reqs_padded=self.rows, **self.kv))


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


class SyncCount:
    """Host synchronisations torch reports (set_sync_debug_mode "warn") while it is entered, counted as they are
    warned (none kept: a soak's millions would fill memory, only where the first came from); 0 off CUDA."""

    def __init__(self, dev: torch.device):
        self.on = dev.type == "cuda"
        self.n = 0
        self.first = ""  # the file:line of the first synchronisation ("" while none)

    def _count(self, message, category=None, filename="", lineno=0, *a, **k) -> None:
        if SYNC_WARNING in str(message):
            self.n += 1
            self.first = self.first or f"{filename}:{lineno}"

    def __enter__(self):
        if self.on:
            self._w = warnings.catch_warnings()
            self._w.__enter__()
            warnings.simplefilter("always")
            warnings.showwarning = self._count
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self.on:
            torch.cuda.set_sync_debug_mode("default")
            self._w.__exit__(*exc)


class Floor:
    """The floor of one launch per build, in place of a Guard: each build launches the snapshot kernel with no rows
    (bench_record_sets._empty_launch, through launch.py's launcher), nothing else; its ring is started by the first
    build (outside any capture: the loops' warm step)."""

    def __init__(self, path: Path):
        self.path, self.go = path, None

    def record(self, r: Record) -> None:
        if self.go is None:
            from bench_record_sets import _empty_launch

            from dcptool.engine.recorder.record import Recorder

            self.rec = Recorder(self.path, dcp_size=N, cuda_mode="async", force=True, **guard_config())
            if not r.seq_lens.is_cuda:
                self.rec._device.use_host_ring(1 << 16)  # (--smoke: host tensors through the interpreted kernel)
            self.rec.record(r)
            self.go = _empty_launch(self.rec, r.seq_lens)
        self.go()

    def close(self) -> None:
        if self.go is not None:
            self.rec.discard()
