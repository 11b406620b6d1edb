"""The rule table (docs/replay.md#the-rules): every rule replay, the Guard, the GPU scan, the reports and `--help`
know of, one row each.

A row names the rule's severity, its timeline code, the function that finds it ("module.function" of
dcptool.check: replay imports it by that name, so this table imports nothing of the checks and the engine side may
read it), the columns it needs beyond the required ones, the inputs its check takes besides the dump, where it
applies (dcp_size), what it spans (one observation, a rank's run of observations, the ranks of a batch), whether
the Guard decides it on the device as each observation is made, and the faults of `simulate` that must produce
it. Checks are vectorised over the dump; several rules may share one check (one pass finds them all).
"""

from __future__ import annotations

from typing import NamedTuple

# Rule.dcp: at which dcp_size a rule applies
ANY = "any"  # every dcp_size
SHARDED = "sharded"  # dcp_size > 1 only; at dcp_size 1 replay lists it as skipped
VIEW = "view"  # a DCP view's own rules: dcp_size > 1 only; at dcp_size 1 `stray` stands for them (no view)
UNSHARDED = "unsharded"  # dcp_size 1 only: `stray`; at dcp_size > 1 the view rules stand for it

# Rule.scope: what one finding's check looks at
OBSERVATION = "observation"  # the observation's own columns (the Guard can check it as the observation is made)
RUN = "run"  # observations of one rank together: a micro-batch and its parent, a graph's capture and its replays
RANKS = "ranks"  # the DCP ranks' recordings of one batch

# Rule.inputs: what a check takes after the dump, in this order of its parameters
VERSION = "version"  # the engine version micro-batches are split by
PROVENANCE = "provenance"  # the provenance search, prepared for the wrong views
SCAN = "scan"  # the row scan's result (check.scan.ScanResult)
WRONG = "wrong"  # the observations whose view has a wrong real row (from the scan)
PAIRS = "pairs"  # each observation's rank set and the member before it (check.ranks.RankSets)
DIFFER = "differ"  # the observations whose seq_lens rows differ from their pair's (the scan compares them)


class Part(NamedTuple):
    """A part of a rule that needs more columns than the rule: replay names it `rule/part` when they are absent."""

    name: str
    needs: tuple[str, ...]
    unrecorded: str  # why it is skipped


class Rule(NamedTuple):
    name: str
    severity: str  # error or warning
    code: str  # one character in the timeline, distinct even ignoring case (initials collide: stale/stray/shape,
    #            missing/mismatch, padding/pages); the legend under the timeline spells them out
    check: str  # the function that finds it: "module.function", the module of dcptool.check
    what: str  # what it catches (README's rule table, --help)
    needs: tuple[str, ...] = ()  # columns it needs beyond the required ones (docs/format.md)
    unrecorded: str = ""  # why replay skips it when one of `needs` is not recorded
    inputs: tuple[str, ...] = ()  # what its check takes after the dump (VERSION ... DIFFER)
    dcp: str = ANY  # ANY, SHARDED, VIEW or UNSHARDED
    scope: str = OBSERVATION  # OBSERVATION, RUN or RANKS
    device: bool = False  # the Guard decides it per observation as it is made (errors only): its check kernel on
    #                       the device, or (the rules of host values: addresses, block sizes, capacities) its host
    faults: tuple[str, ...] = ()  # simulate's faults (docs/faults.md) that must produce it
    parts: tuple[Part, ...] = ()
    # its columns belong to a feature most engines do not have (MLA's chunked prefill context, KV transfers): a dump
    # without them does not have the feature, so replay does not list the check as skipped there
    quiet: bool = False


_UBATCH = ("obs.parent", "obs.req_start", "obs.tok_start", "obs.tok_stop", "obs.qsl")
_SLOTS = ("obs.slots", "rows.positions", "rows.slot_mapping", "rows.slot_group")
_VALUES = dict(check="values.check_values", inputs=(PROVENANCE, SCAN), dcp=VIEW, device=True)

# The table's order is the order findings of one observation are reported in. A wrong S is reported first as what
# it holds (stale ... padding), empty-mask then says what the LSE merge does with it; tot-lens is a
# per-observation companion check beside pages; rank-agree, a group rule like rank-sum, comes after them; the
# slot rules (which rank writes each KV slot) last.
TABLE = (
    Rule("missing", "error", "M", "values.check_missing", "a `None` view with dcp_size > 1", dcp=VIEW, device=True,
         faults=("dummy-none", "dflash-capture-none", "ubatch-none")),
    Rule("stale", "error", "S", what="a view that holds another observation's rows, named with its relation: "
         "`parent-rows`, `earlier-in-step` or `earlier-step`", faults=("ubatch-parent-rows", "pcp-stale"),
         parts=(Part("parent-rows", ("obs.parent", "obs.req_start"), "needs obs.parent and obs.req_start"),),
         **_VALUES),
    Rule("global", "error", "G", what="a view that holds the global seq_lens", **_VALUES),
    Rule("wrong-rank", "error", "R", what="a view computed for another rank", **_VALUES),
    Rule("wrong-interleave", "error", "I", what="a view computed with another interleave", **_VALUES),
    Rule("mismatch", "error", "X", what="wrong rows with no explanation found", **_VALUES),
    Rule("padding", "error", "P", "values.check_padding", "a padded row that is not 0", inputs=(SCAN,), dcp=VIEW,
         device=True, faults=("sentinel",)),
    Rule("shape", "error", "L", "values.check_shape", "a view whose length is not num_reqs_padded", dcp=VIEW,
         device=True, faults=("pcp-unpadded",)),
    Rule("stray", "warning", "Y", "values.check_stray", "a view present with dcp_size 1", dcp=UNSHARDED),
    Rule("ubatch-slice", "error", "U", "ubatch.check_ubatch_slice", "a micro-batch that disagrees with slicing its "
         "parent", needs=_UBATCH, inputs=(VERSION,), scope=RUN,
         unrecorded="needs obs.parent, obs.req_start, obs.tok_start, obs.tok_stop and query_start_loc"),
    Rule("alias", "error", "A", "alias.check_alias", "micro-batches sharing a buffer, or a graph replay reading "
         "another buffer than its capture", needs=("obs.buffer",), unrecorded="needs obs.buffer", scope=RUN,
         faults=("capture-wrong-buffer", "graph-stale"),
         parts=(Part("graph", ("obs.graph",), "needs obs.graph for capture/replay pairs"),)),
    Rule("rank-sum", "error", "K", "ranks.check_rank_sum", "ranks whose local lengths do not add up to seq_len",
         inputs=(WRONG,), dcp=SHARDED, scope=RANKS),
    Rule("pages", "error", "B", "values.check_pages", "page counts that are not `cdiv(local, page_size)`",
         needs=("rows.kv_pages",), unrecorded="needs rows.kv_pages and page_size", inputs=(SCAN,), device=True,
         faults=("flashinfer-global-pages",)),
    Rule("empty-mask", "error", "E", "decode.check_empty_mask", "the empty-shard mask's inputs on the DCP decode "
         "path (vLLM 0.30+ FlashInfer): `dcp_query_start_loc` not `query_start_loc[:num_decodes+1]` (rank-local, "
         "wrong num_decodes, not starting at 0, decreasing), the view too short for it, or LSE rows masked "
         "differently from the batch's local lengths; names rows masked on every rank (NaN after the merge)",
         needs=("obs.dqsl",), unrecorded="needs obs.dqsl (not recorded in this dump)", dcp=SHARDED, device=True,
         faults=("dcp-qsl-local",)),
    Rule("tot-lens", "error", "T", "decode.check_tot_lens", "a global companion (`dcp_tot_seq_lens`, "
         "FlashAttention/FlashMLA's total seq lens) that is not the global seq_lens on a real row (says when it "
         "holds the local lengths)", needs=("obs.tot",), unrecorded="needs obs.tot (not recorded in this dump)",
         dcp=SHARDED, device=True, faults=("tot-local",)),
    Rule("rank-agree", "error", "N", "ranks.check_rank_agree", "DCP ranks of one batch (the k-th recording of each "
         "rank in a step, site and micro-batch) disagreeing on num_reqs, num_reqs_padded, seq_lens, query_start_loc, "
         "num_tokens_padded or graph mode; once per batch, at the first differing rank, naming every differing rank",
         inputs=(PAIRS, DIFFER), dcp=SHARDED, scope=RANKS, faults=("rank-disagree",)),
    Rule("slots", "error", "W", "slots.check_slot_rules", "a KV slot written by the wrong rank: in a DCP-sharded "
         "group a position `p` written by another rank than `(p // I) % N` (or not by that one), a replicated group "
         "(Mamba/GDN state) not written by every rank, a padded token writing, a slot at another block offset than "
         "vLLM's, two tokens of one build on one slot (needs the slot columns; builds that write nothing at all, "
         "dummy runs and capture, are not asked to)", needs=_SLOTS, device=True, faults=("slot-wrong-group",),
         unrecorded="needs the slot columns (obs.slots, rows.positions, rows.slot_mapping, rows.slot_group)"),
    # (at dcp_size 1 one rank writes every position it owns, which `slots` checks: the partition holds)
    Rule("slot-partition", "error", "O", "slots.check_slot_rules", "across the N ranks of one (step, site, "
         "micro-batch, group): a position of a DCP-sharded group written by several ranks (reported at the ranks "
         "that do not own it) or by none (at its owner), naming the positions", needs=_SLOTS, scope=RANKS,
         faults=("slot-all-ranks",)),
    # MLA's chunked prefill context (dcp.chunks): each request's context in chunks, each chunk one DCP KV gather
    Rule("ctx-chunks", "error", "H", "context.check_ctx_chunks", "a chunked-context schedule (MLA prefill) that is "
         "malformed, whose `max_context_chunk` or split starts are not multiples of dcp_size x interleave (a rank's "
         "local chunk then starts off its interleave block), or whose chunks do not cover a request's computed "
         "context (seq_len - query_len, not its KV length)", needs=("obs.ctx",),
         unrecorded="needs obs.ctx (not recorded in this dump)", faults=("ctx-chunk-unaligned", "ctx-draft-lens"),
         quiet=True),
    Rule("ctx-agree", "error", "J", "ranks.check_ctx_agree", "DCP ranks of one batch (as rank-agree forms them) "
         "whose chunked-context schedules differ, so they call different DCP KV gathers (one may call none: a "
         "collective timeout); once per batch, at the first differing rank, naming every differing rank and the "
         "gathers it calls", needs=("obs.ctx",), unrecorded="needs obs.ctx (not recorded in this dump)",
         inputs=(PAIRS,), dcp=SHARDED, scope=RANKS, faults=("ctx-rank-local",), quiet=True),
    # per KV-cache group and per query token (run where the dump records them: its check reads what is there)
    Rule("group-lens", "error", "V", "groups.check_group_lens", "a KV-cache group's lengths that do not match its "
         "sharding (a replicated group, a sliding-window one under per-group DCP, handed this rank's DCP-local "
         "lengths), or a query token's rank-local causal bound that is not local(position + 1) (speculative "
         "verification: local(seq_len - k), not local(seq_len) - k)", faults=("swa-sharded", "spec-causal-offset")),
    # sparse MLA's top-k (dcp.topk): per query token, the set every rank selects and each rank's partial result
    Rule("topk-agree", "error", "Q", "ranks.check_topk_agree", "DCP ranks of one batch (as rank-agree forms them) "
         "whose sparse-attention top-k sets differ on a query token (a tie at the k-th score broken differently per "
         "rank: the ranks' shares no longer partition the set); once per batch, at the first differing rank, naming "
         "every differing rank and its first differing token", needs=("obs.topk",),
         unrecorded="needs obs.topk (not recorded in this dump)", inputs=(PAIRS,), dcp=SHARDED, scope=RANKS,
         faults=("topk-tie-split",), quiet=True),
    Rule("topk-empty", "error", "Z", "sparse.check_topk_empty", "a sparse-attention row of which this rank owns no "
         "top-k entry (all -1 after the DCP filter) whose partial result is not output 0 and LSE -inf (0 x NaN "
         "poisons the merge on every rank), or a row with entries whose LSE is -inf or not finite",
         needs=("obs.topk",), unrecorded="needs obs.topk (not recorded in this dump)", faults=("topk-empty-nan",),
         quiet=True),
    # what else a build hands attention: the metadata tensors' addresses (a full graph reads the captured ones)
    Rule("graph-addr", "error", "F", "buffers.check_graph_addr", "a full-graph replay whose build handed attention a "
         "metadata tensor at another address than the graph captured (the graph reads the captured buffer, which "
         "the build did not write: stale values)", needs=("obs.addrs", "obs.gaddrs"), device=True,
         unrecorded="needs obs.addrs and obs.gaddrs (the metadata tensors' addresses at the build and at capture)",
         faults=("graph-addr-moved",), quiet=True),
    Rule("capacity", "error", "C", "buffers.check_capacity", "a build that needs more request rows "
         "(num_reqs_padded) than the buffer behind a metadata tensor it hands attention holds (a view cut short, "
         "writes past the buffer's end)", needs=("obs.caps",), device=True, faults=("buffer-undersized",),
         quiet=True, unrecorded="needs obs.caps (the metadata tensors' buffer capacities)"),
    Rule("host-copy", "error", "1", "copies.check_host_copy", "a build whose metadata builder read a host copy of "
         "seq_lens (seq_lens_cpu) that differs from the device's on a real row (left behind by async scheduling, or "
         "written in place by an earlier build), or that wrote the shared host copy in place",
         needs=("obs.hseq",), device=True, faults=("host-seq-stale", "host-seq-written"), quiet=True,
         unrecorded="needs obs.hseq (the host copy of seq_lens the build read)"),
    Rule("plan-pages", "error", "2", "plans.check_plan_pages", "a FlashInfer native plan claiming other pages than "
         "the rank's local length: a prefill row's page count not `cdiv(local(seq_len - query_len), page_size)` (its "
         "local context), or a row's last-page length not that of the local length its plan covers",
         needs=("rows.kv_prefill_pages",), device=True, faults=("flashinfer-prefill-pages",), quiet=True,
         unrecorded="needs rows.kv_prefill_pages or rows.kv_last_page, query_start_loc and page_size"),
    # the block sizes the slot mapping worked with (per KV-cache group: the manager's, the kernel's, the dealing one)
    Rule("kernel-block", "error", "3", "blocks.check_kernel_block", "a DCP-sharded KV-cache group whose slot mapping "
         "deals positions to the ranks by another block than the KV-cache manager's (the attention kernel's, which "
         "the interleave need not divide) where that sends a position to another rank or local position",
         needs=("obs.kvbs",), device=True, faults=("slot-kernel-block",), quiet=True,
         unrecorded="needs obs.kvbs (the block sizes the slot mapping worked with)"),
    # a KV transfer plan (prefill/decode disaggregation): only recorded where a connector moves KV (quiet)
    Rule("transfer", "error", "D", "transfers.check_transfer", "a KV transfer plan (prefill/decode disaggregation, "
         "a keyed store) that does not move every position a destination rank must hold exactly once from a source "
         "worker that holds it, named by its first kind: `partial-store` (a shard stored as the whole request), "
         "`wrong-source`, `past-sequence` (reads past the sequence), `not-owner`, `block-ids` (ids scaled or grouped "
         "wrongly), `twice`, `never`",
         needs=("obs.xfer",), faults=("nixl-pcp-stride", "nixl-single-source", "mooncake-group-scale",
                                      "mooncake-unsharded-prefill", "lmcache-partial-store"), quiet=True),
)
RULE = {r.name: r for r in TABLE}
RULES = tuple(RULE)
SEVERITY = {r.name: r.severity for r in TABLE}
RULE_CODES = {r.name: r.code for r in TABLE}
RULE_OF_FAULT = {f: r.name for r in TABLE for f in r.faults}
RULE_ORDER = {r: i for i, r in enumerate(RULES)}
# The order replay lists skipped checks in (the text and HTML reports' lines, the JSON summary's keys): rank-sum,
# which dcp_size rules out, first; then the micro-batch columns' checks; then the rest in table order.
SKIPPED_ORDER = ("rank-sum", "ubatch-slice", "stale/parent-rows", "alias", "alias/graph", "pages", "empty-mask",
                 "tot-lens", "rank-agree", "slots", "slot-partition", "ctx-agree", "topk-agree")


class DeviceCheck(NamedTuple):
    """One check the Guard makes as each observation is made (its kernel on the device, its numpy form on the host)."""

    name: str  # what the Guard reports: the rule's name, or the shared check's for rules that share one ("values")
    severity: str
    rules: tuple[str, ...]  # the rules of the table it decides


def device_checks_of(table: tuple[Rule, ...]) -> tuple[DeviceCheck, ...]:
    """The rules marked `device`, one check per check function, in table order. Rules sharing a check are one check
    named after its function: the five value rules (stale ... mismatch) are `values`, since telling them apart
    takes the provenance search over the whole recording, which only replay has."""
    by_check: dict[str, list[Rule]] = {}
    for r in table:
        if r.device:
            by_check.setdefault(r.check, []).append(r)
    return tuple(DeviceCheck(rs[0].name if len(rs) == 1 else check.rpartition(".check_")[2], rs[0].severity,
                             tuple(r.name for r in rs)) for check, rs in by_check.items())


# The Guard's checks: the names it reports (Guard.first_rule), their order (the first one an observation breaks is
# the one named) and the set its kernel and its host path decide (each raises ImportError when it differs)
DEVICE_CHECKS = device_checks_of(TABLE)


def applies(rule: Rule, dcp_size: int) -> bool:
    """The rule is checked at this dcp_size."""
    if rule.dcp == ANY:
        return True
    return (rule.dcp == UNSHARDED) == (dcp_size == 1)
