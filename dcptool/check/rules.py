"""DESIGN §3's rule table: per rule its severity, timeline code, needed columns, check and simulated faults."""

# A rule's check lives in the dcptool.check module of its concept (`check` names it, relative to dcptool.check);
# this table imports none of them, so findings (which orders and names findings by it) imports it freely. Checks
# are vectorised over the dump with numpy (sorts, gathers, segment reductions); Python runs only per problem found.
# The checks that find many hand back a findings.FindingTable of columns whose messages are rendered only when
# read; the others return Issue lists (findings.findings_of turns them into a table). A finding's message says
# what is wrong; where (step, site, rank, micro-batch) is a field that renderers compose (Finding.where,
# Finding.message).

from __future__ import annotations

from typing import NamedTuple


class Rule(NamedTuple):
    name: str
    severity: str  # error or warning
    code: str  # one character in the timeline, distinct even ignoring case (initials collide: stale/stray/shape,
    #            missing/mismatch, padding/pages); the legend under the timeline spells them out
    needs: tuple[str, ...]  # columns it needs beyond the required ones (DESIGN §2)
    check: str  # the function that detects it: "module.function", the module of dcptool.check
    faults: tuple[str, ...]  # simulate's faults (DESIGN §4) that must produce it


# DESIGN §3, in table order: findings of one observation are reported in this order.
TABLE = (
    Rule("missing", "error", "M", (), "values.check_missing", ("dummy-none", "dflash-capture-none", "ubatch-none")),
    Rule("stale", "error", "S", (), "values.check_values", ("ubatch-parent-rows", "pcp-stale")),
    Rule("global", "error", "G", (), "values.check_values", ()),
    Rule("wrong-rank", "error", "R", (), "values.check_values", ()),
    Rule("wrong-interleave", "error", "I", (), "values.check_values", ()),
    Rule("mismatch", "error", "X", (), "values.check_values", ()),
    Rule("padding", "error", "P", (), "values.check_padding", ("sentinel",)),
    Rule("shape", "error", "L", (), "values.check_shape", ("pcp-unpadded",)),
    Rule("stray", "warning", "Y", (), "values.check_stray", ()),
    Rule("ubatch-slice", "error", "U", ("obs.parent", "obs.req_start", "obs.tok_start", "obs.tok_stop", "obs.qsl"),
         "ubatch.check_ubatch_slice", ()),
    Rule("alias", "error", "A", ("obs.buffer",), "alias.check_alias", ("capture-wrong-buffer", "graph-stale")),
    Rule("rank-sum", "error", "K", (), "ranks.check_rank_sum", ()),
    Rule("pages", "error", "B", ("rows.kv_pages",), "values.check_pages", ("flashinfer-global-pages",)),
    # issue 15 (coverage of the rest of what DCP attention consumes). After the view's own rules: a wrong
    # S is reported first as what it holds (stale/global/.../padding), empty-mask then says what the LSE
    # merge does with it; tot-lens is a per-observation companion check beside pages; rank-agree, a
    # group rule like rank-sum, comes last.
    Rule("empty-mask", "error", "E", ("obs.dqsl",), "decode.check_empty_mask", ("dcp-qsl-local",)),
    Rule("tot-lens", "error", "T", ("obs.tot",), "decode.check_tot_lens", ("tot-local",)),
    Rule("rank-agree", "error", "N", (), "ranks.check_rank_agree", ("rank-disagree",)),
)
# issue 15 item 3: which rank writes each KV slot
TABLE += (
    Rule("slots", "error", "W", ("obs.slots", "rows.positions", "rows.slot_mapping", "rows.slot_group"),
         "slots.check_slots", ("slot-wrong-group",)),
    Rule("slot-partition", "error", "O", ("obs.slots", "rows.positions", "rows.slot_mapping", "rows.slot_group"),
         "slots.check_slot_partition", ("slot-all-ranks",)),
)
RULE = {r.name: r for r in TABLE}
RULES = tuple(RULE)
SEVERITY = {r.name: r.severity for r in TABLE}
RULE_CODES = {r.name: r.code for r in TABLE}
RULE_OF_FAULT = {f: r.name for r in TABLE for f in r.faults}
RULE_ORDER = {r: i for i, r in enumerate(RULES)}
PARENT_ROWS_NEEDS = ("obs.parent", "obs.req_start")  # stale/parent-rows: the slice of the parent to compare


class Issue(NamedTuple):
    """What a vectorised check found at one observation; `fields` are Finding's keyword arguments."""

    index: int
    rule: str
    text: str
    fields: dict

