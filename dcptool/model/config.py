"""simulate's configuration: SimConfig, the fault table it injects from (docs/faults.md), and which faults a
configuration exercises."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, fields

from dcptool.choices import CudaGraph, KVConnector, KVShards, Pipeline, SpecMethod, spoken, values
from dcptool.dcp.reference import misdealt
from dcptool.dcp.rules import RULE_OF_FAULT
from dcptool.dcp.slicing import parse_engine_version
from dcptool.errors import DcptoolError

# The fault table (docs/faults.md): fault -> (the rule replay must report (rules.TABLE says which), what the
# engine did).
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
    # what else DCP attention consumes (opt-in with --inject; not part of --pipeline legacy)
    "dcp-qsl-local": "the empty-shard mask's dcp_query_start_loc counts only the query tokens of this rank's "
                     "non-empty shards (rank-local) instead of query_start_loc[:num_decodes+1]",
    "tot-local": "the global companion (dcp_tot_seq_lens) is passed this rank's local lengths",
    "rank-disagree": "one DCP rank sees a request's seq_len off by one (ranks disagree on what must be replicated)",
}
# Opt-in faults: real failure classes, but not the pre-fix ordering `--pipeline legacy` models.
# The slot faults too: slot-all-ranks is in no release, and whether 0.29-0.30's replicated groups (Mamba/GDN)
# ever read the slots slot-wrong-group localises is not established (a legacy run must model known faults only).
OPT_IN = frozenset({"dcp-qsl-local", "tot-local", "rank-disagree", "slot-wrong-group", "slot-all-ranks"})
# which rank writes each KV slot
_FAULT_WHAT.update({
    "slot-wrong-group": "the slot mapping localises a replicated KV-cache group (Mamba/GDN state) as DCP-sharded",
    "slot-all-ranks": "every rank writes every token of a DCP-sharded group (the non-owner mask dropped)",
})
# MLA's chunked prefill context (--features chunked-context): the schedule each rank plans (dcp.chunks)
_FAULT_WHAT.update({
    "ctx-rank-local": "the last DCP rank plans its chunked context from the context it holds itself (its share of "
                      "each prefill's context), not the batch's: it calls other DCP KV gathers than its peers, or none",
    "ctx-chunk-unaligned": "max_context_chunk is the workspace over the prefills with context, not rounded to the "
                           "DCP virtual block (dcp_size x interleave): chunks split contexts inside an interleave "
                           "block (vLLM asserted max_context_chunk % dcp_world_size == 0)",
    "ctx-draft-lens": "the chunked context's lengths are the requests' KV lengths (seq_len, as speculative metadata "
                      "carries them), not their computed context (seq_len - query_len)",
})
# a hybrid model's sliding-window KV-cache group beside the full-attention one (--features swa)
_FAULT_WHAT.update({
    "swa-sharded": "the sliding-window KV-cache group's attention gets this rank's DCP-local lengths, as if DCP "
                   "sharded it: it must stay replicated (per-group DCP)",
    "spec-causal-offset": "a speculative verify token k from its row's end attends to local(seq_len) - k of the "
                          "rank's KV positions, not local(seq_len - k)",
})
# sparse MLA's top-k under DCP (--features sparse): each query token's top-k set and each rank's partial result
_FAULT_WHAT.update({
    "topk-tie-split": "the last DCP rank breaks the tie at the k-th top-k score another way (highest ids first), so "
                      "it selects another set than its peers for every token whose context is longer than k",
    "topk-empty-nan": "on the last DCP rank a sparse row of which it owns no top-k entry gives a NaN output (LSE "
                      "-inf), not output 0",
})
OPT_IN |= {"ctx-rank-local", "ctx-chunk-unaligned", "ctx-draft-lens", "swa-sharded", "spec-causal-offset",
           "topk-tie-split", "topk-empty-nan"}
# What else a build hands attention (opt-in: --pipeline legacy models the pre-fix ordering its own faults show; these
# are bugs of other code paths and releases).
_HANDED = {
    "graph-addr-moved": "a per-request metadata tensor (FlashAttention's dcp_context_kv_lens) allocated anew at each "
                        "build: a full-graph replay's build hands attention another address than the graph captured",
    "buffer-undersized": "the attention builder's per-request buffer (dcp_context_kv_lens) holds one request row "
                         "fewer than the largest padded batch (sized by max_num_seqs below the graph-mode maximum)",
    "host-seq-stale": "under async scheduling with drafts, the metadata builder reads a host copy of seq_lens that "
                      "counts every draft of the last verify as accepted (the device's lengths do not)",
    "host-seq-written": "the metadata builder subtracts its prefill rows' query lengths from the shared host copy of "
                        "seq_lens in place",
    "flashinfer-prefill-pages": "FlashInfer's native prefill plans count pages from the global seq_lens and every "
                                "plan's last page from the global length it covers, for a local (shorter) context",
    "slot-kernel-block": "the slot mapping deals a DCP-sharded group's positions to the ranks by the attention "
                         "kernel's block (half the KV-cache manager's, as FlashInfer MLA splits 128 into 64) instead "
                         "of the manager's",
}
_FAULT_WHAT.update(_HANDED)
OPT_IN = OPT_IN | set(_HANDED)
HANDED = frozenset(_HANDED)  # (simulate records the columns they need only where one of them is injected)
# what a KV connector moves between a prefill and a decode instance (--kv-connector): the pair model, model.pair
_FAULT_WHAT.update({
    "nixl-pcp-stride": "NIXL matches the prefill side's KV shards by DCP rank alone (stride dcp_size) while its PCP "
                       "ranks hold distinct shards (CP world pcp_size x dcp_size)",
    "nixl-single-source": "NIXL's region-mapped pull reads every block from one source rank, its list end-trimmed "
                          "(allocation padding included), where a DCP prefill supplies several",
    "mooncake-group-scale": "Mooncake with MTP indexes KV-cache groups by transfer group: the sparse indexer's "
                            "kernel scale (8) expands the MLA group's block ids",
    "mooncake-unsharded-prefill": "Mooncake reads an unsharded prefill's blocks at each decode DCP rank's own local "
                                  "block index, as if the prefill were sharded like the decode side",
    "lmcache-partial-store": "LMCache's multi-process connector stores rank 0's DCP shard alone under the whole "
                             "request's key, as if rank 0 held the full MLA KV",
})
TRANSFER_FAULTS = ("nixl-pcp-stride", "nixl-single-source", "mooncake-group-scale", "mooncake-unsharded-prefill",
                   "lmcache-partial-store")
OPT_IN = OPT_IN | set(TRANSFER_FAULTS)
FAULTS: dict[str, tuple[str, str]] = {f: (RULE_OF_FAULT[f], what) for f, what in _FAULT_WHAT.items()}
# What simulate models beyond its default engine (--features), and the faults that need each (injecting one models
# its feature): MLA's chunked prefill context; a sliding-window KV-cache group (and the per-token causal bounds of
# speculative verification); sparse MLA's top-k selection (dcp.topk).
FEATURES = ("chunked-context", "swa", "sparse")
FEATURE_OF: dict[str, str] = {"ctx-rank-local": "chunked-context", "ctx-chunk-unaligned": "chunked-context",
                              "ctx-draft-lens": "chunked-context", "swa-sharded": "swa", "spec-causal-offset": "swa",
                              "topk-tie-split": "sparse", "topk-empty-nan": "sparse"}
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
    "ctx-rank-local": "0.27–0.29 (PCP + DCP MLA)",
    "ctx-chunk-unaligned": "0.22–0.27",
    "ctx-draft-lens": "no release (vllm-ascend)",
    # 0.29-0.34 assert that DCP does not support sliding window (SlidingWindowSpec, SlidingWindowManager)
    "swa-sharded": "no release (PR #47541)",
    "spec-causal-offset": "no release (PR #46076 review)",
    # vLLM 0.29-0.34 merge the ranks' candidates with a stable selector (score, then lowest id) and zero a row the
    # merge weighs 0; ROCm/ATOM's DCP sparse path had neither before its PR #1832
    "topk-tie-split": "no release (ROCm/ATOM before PR #1832)",
    "topk-empty-nan": "no release (ROCm/ATOM before PR #1832)",
    # FlashAttention's build returned a fresh dcp_context_kv_lens up to 0.19 (vLLM #36070); 0.20 keeps a buffer
    "graph-addr-moved": "before 0.20",
    # vllm-ascend's per-request metadata buffers (vllm-ascend #16168), not vLLM's: no vLLM release
    "buffer-undersized": "vllm-ascend only",
    # FlashAttention's DCP path read seq_lens_cpu up to 0.11 (vLLM #29449, 0.11.2 the oldest read); 0.12 the device's
    "host-seq-stale": "before 0.12",
    # FlashInfer's DCP path wrote common_attn_metadata.seq_lens_cpu in place, 0.11.2 (oldest read)-0.29 (vLLM #48003)
    "host-seq-written": "0.11–0.29",
    # the prefill half of vLLM #48003: 0.29's plans (0.27-0.29, as flashinfer-global-pages)
    "flashinfer-prefill-pages": "0.27–0.29",
    # model runner V2's slot mapping dealt by kernel_block_sizes up to 0.28 (vLLM #51031); 0.29 by the manager's
    "slot-kernel-block": "before 0.29",
    # the connectors' releases (docs/faults.md, "KV transfers")
    "nixl-pcp-stride": "no release (vLLM PR #38433 in review)",
    "nixl-single-source": "0.30 (NIXL)",
    "mooncake-group-scale": "vllm-ascend before #13965",
    "mooncake-unsharded-prefill": "vllm-ascend before #16492",
    "lmcache-partial-store": "LMCache ≤ 0.5.4; vLLM 0.29–0.34's builtin fallback",
}
# The KV-cache groups simulate's engine has (rows.slot_group indexes it): the attention KV cache, DCP-sharded, and
# a replicated one (Mamba/GDN state as vLLM 0.31+ keeps it under DCP); both in page_size blocks.
KV_GROUPS = (("attn", True), ("mamba", False))
SWA_WINDOW = 4096  # --features swa: a sliding-window group of this window, replicated on every DCP rank


def kv_groups_of(cfg: SimConfig) -> list[dict]:
    """The KV-cache groups a run's engine has (dcptool.config's kv_groups): KV_GROUPS, and with --features swa a
    sliding-window group, replicated (cp_size 1), as vLLM PR #47541's per-group DCP keeps it."""
    out = [{"name": n, "dcp": dcp, "block_size": cfg.page_size} for n, dcp in KV_GROUPS]
    if "swa" in cfg.modelled:
        out.append({"name": "swa", "dcp": False, "block_size": cfg.page_size, "sliding_window": SWA_WINDOW,
                    "cp_size": 1})
    return out
SITES = ("prepare_inputs", "pcp_partition", "attn_metadata", "ubatch", "dummy", "capture", "dflash_capture", "draft")
PAIR_SITES = (*SITES, "transfer")  # with a KV connector (--kv-connector)
PIPELINES = values(Pipeline)
CUDAGRAPH_CHOICES = values(CudaGraph)
SPEC_METHODS = values(SpecMethod)


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
    features: tuple[str, ...] = ()  # FEATURES simulate models beyond its default engine
    # The disaggregated pair (model.pair): the KV connector that moves KV into this (decode) instance, and the
    # prefill instance's layout; 0: as the decode side's (--dcp, --interleave, --page-size; TP: its DCP size).
    kv_connector: str = "none"
    prefill_dcp: int = 0
    prefill_pcp: int = 1
    prefill_tp: int = 0
    prefill_interleave: int = 0
    prefill_block_size: int = 0
    prefill_kv_shards: str = "dcp"

    @property
    def faults(self) -> tuple[str, ...]:
        """The faults this run injects, in the fault table's order."""
        chosen = set(FAULTS) - OPT_IN if self.pipeline == "legacy" else set(self.inject)
        return tuple(f for f in FAULTS if f in chosen)

    @property
    def modelled(self) -> frozenset[str]:
        """The features this run models: those asked for and those its faults need."""
        return frozenset(self.features) | {FEATURE_OF[f] for f in self.faults if f in FEATURE_OF}

    @property
    def decode_query_len(self) -> int:
        return 1 + self.spec_tokens

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise SimError(msg)

        for name in ("dcp", "interleave", "pcp", "ubatches", "page_size", "max_num_reqs", "token_budget"):
            need(getattr(self, name) >= 1, f"--{name.replace('_', '-')}: must be >= 1, got {getattr(self, name)}")
        need(self.steps >= 0, f"--steps: must be >= 0, got {self.steps}")
        need(self.seed >= 0, f"--seed: must be >= 0, got {self.seed}")
        need(self.spec_tokens >= 0, f"--spec-tokens: must be >= 0, got {self.spec_tokens}")
        need(self.dummy_every >= 0, f"--dummy-every: must be >= 0 (0: only the start-up profile run), got "
                                    f"{self.dummy_every}")
        need(self.pipeline in PIPELINES, f"--pipeline: {self.pipeline!r}: choose {spoken(Pipeline)}")
        need(self.cudagraph in CUDAGRAPH_CHOICES, f"--cudagraph: {self.cudagraph!r}: choose {spoken(CudaGraph)}")
        need(self.spec_method in SPEC_METHODS, f"--spec-method: {self.spec_method!r}: choose {spoken(SpecMethod)}")
        unknown = [f for f in self.inject if f not in FAULTS]
        need(not unknown, f"--inject: unknown fault {', '.join(unknown)} (known: "
                          f"{', '.join(f'{f} [{FAULT_WHERE[f]}]' for f in FAULTS)})")
        odd = [f for f in self.features if f not in FEATURES]
        need(not odd, f"--features: unknown feature {', '.join(odd)} (known: {', '.join(FEATURES)})")
        need(not self.engine_version or parse_engine_version(self.engine_version) is not None,
             f"--engine-version: {self.engine_version!r}: expected a vLLM version such as 0.34.0")
        need(not (self.inject and self.pipeline == "legacy"),
             "--inject: picks faults on top of the fixed pipeline; --pipeline legacy already injects all of them")
        # vLLM: the KV block size must be a multiple of cp_kv_cache_interleave_size.
        need(self.page_size % self.interleave == 0,
             f"--page-size: {self.page_size} must be a multiple of --interleave {self.interleave} (as vLLM's block "
             "size must be)")
        need(self.dcp * self.interleave <= self.max_model_len, "--dcp: --dcp x --interleave exceeds the model length")
        need(self.token_budget >= self.decode_query_len, "--token-budget: must fit one decode with its drafts")
        # vLLM's PCPManager.validate_config: PCP speculates with (single-module) MTP only.
        need(not (self.pcp > 1 and self.spec_tokens > 0 and self.spec_method == "dflash"),
             "--spec-method: dflash with --pcp > 1: vLLM's PCP supports only MTP speculative decoding")
        self._validate_pair(need)

    def _validate_pair(self, need) -> None:
        need(self.kv_connector in values(KVConnector),
             f"--kv-connector: {self.kv_connector!r}: choose {spoken(KVConnector)}")
        need(self.prefill_kv_shards in values(KVShards),
             f"--prefill-kv-shards: {self.prefill_kv_shards!r}: choose {spoken(KVShards)}")
        for name in ("prefill_dcp", "prefill_tp", "prefill_interleave", "prefill_block_size"):
            need(getattr(self, name) >= 0, f"--{name.replace('_', '-')}: must be >= 0 (0: as the decode side's), "
                                           f"got {getattr(self, name)}")
        need(self.prefill_pcp >= 1, f"--prefill-pcp: must be >= 1, got {self.prefill_pcp}")
        pulls = self.kv_connector in ("nixl", "mooncake")
        for name, default in (("prefill_dcp", 0), ("prefill_pcp", 1), ("prefill_tp", 0), ("prefill_interleave", 0),
                              ("prefill_block_size", 0), ("prefill_kv_shards", "dcp")):
            need(pulls or getattr(self, name) == default, f"--{name.replace('_', '-')}: a prefill instance needs "
                                                          "--kv-connector nixl or mooncake")
        block, il = self.prefill_block_size or self.page_size, self.prefill_interleave or self.interleave
        need(block % il == 0, f"--prefill-block-size: {block} must be a multiple of the prefill interleave {il} (as "
                              "vLLM's block size must be)")

    def command(self) -> str:
        """The `dcptool simulate` command line that reproduces this configuration."""
        out = ["dcptool", "simulate"]
        for f in fields(self):
            v, d = getattr(self, f.name), f.default
            if f.name in ("inject", "features"):
                if v:
                    out += [f"--{f.name}", ",".join(v)]
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
        "slot-wrong-group": None,  # (PCP too: each PCP rank records its local tokens' slots)
        "slot-all-ranks": None,
        "ctx-rank-local": None,
        "ctx-chunk-unaligned": None,
        "ctx-draft-lens": None if cfg.spec_tokens > 0 else "needs --spec-tokens > 0 (speculative metadata)",
        "swa-sharded": None,
        "spec-causal-offset": None if cfg.spec_tokens > 0 else "needs --spec-tokens > 0 (verify tokens)",
        "topk-tie-split": None,
        "topk-empty-nan": None,
        "graph-addr-moved": None if graphs else "needs --cudagraph full (a full graph replays captured addresses)",
        "buffer-undersized": None,
        "host-seq-stale": None if cfg.spec_tokens > 0 else "needs --spec-tokens > 0 (verify rows with drafts)",
        "host-seq-written": None,
        "flashinfer-prefill-pages": None,
        "slot-kernel-block": None if cfg.page_size % 2 == 0 and misdealt(cfg.page_size // 2, cfg.page_size, cfg.dcp,
                                                                          cfg.interleave) >= 0 else
        "needs an even --page-size whose half (the attention kernel's block) --interleave does not divide (e.g. "
        "--interleave equal to --page-size)",
    }
    why.update(pair_applicability(cfg))
    if cfg.dcp == 1:  # vLLM passes None everywhere: nothing DCP-specific can go wrong
        why = {f: "needs --dcp > 1" for f in why}
    return why


def pair_applicability(cfg: SimConfig) -> dict[str, str | None]:
    """The transfer faults: fault -> None when the pair (connector and prefill layout) exercises it, else why not."""
    pd = cfg.prefill_dcp or cfg.dcp
    world = pd * (cfg.prefill_pcp if cfg.prefill_kv_shards == "cp" else 1)
    nixl, mooncake = cfg.kv_connector == "nixl", cfg.kv_connector == "mooncake"
    return {
        "nixl-pcp-stride": None if nixl and cfg.prefill_pcp > 1 and cfg.prefill_kv_shards == "cp" else
        "needs --kv-connector nixl, --prefill-pcp > 1 and --prefill-kv-shards cp",
        "nixl-single-source": None if nixl and world > cfg.dcp else "needs --kv-connector nixl and a prefill side "
        "sharded over more ranks than --dcp (--prefill-dcp, or PCP ranks with --prefill-kv-shards cp)",
        "mooncake-group-scale": None if mooncake and cfg.spec_method == "mtp" and cfg.spec_tokens > 0 else
        "needs --kv-connector mooncake and MTP (--spec-method mtp, --spec-tokens > 0)",
        "mooncake-unsharded-prefill": None if mooncake and world == 1 else
        "needs --kv-connector mooncake and an unsharded prefill side (--prefill-dcp 1)",
        "lmcache-partial-store": None if cfg.kv_connector == "lmcache" else "needs --kv-connector lmcache",
    }
