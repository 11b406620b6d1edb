"""rules.py: the rule table itself (docs/replay.md's order, codes, each check found where it names it and taking the
inputs its row names, faults, docs/replay.md's table (tests/test_docs.py), the skipped lines' order)."""

import inspect
import re

import pytest

from dcptool.dcp import rules as R
from dcptool.dcp.rules import RULE_CODES, RULES, TABLE


def test_table_is_docs_rules():
    """One row per rule in the docs' order; codes distinct ignoring case; every fault of simulate maps to the rule
    of the row that lists it; stray is the one warning."""
    from dcptool.model.config import FAULTS

    assert RULES == ("missing", "stale", "global", "wrong-rank", "wrong-interleave", "mismatch", "padding", "shape",
                     "stray", "ubatch-slice", "alias", "rank-sum", "pages", "empty-mask", "tot-lens", "rank-agree",
                     "slots", "slot-partition", "ctx-chunks", "ctx-agree", "group-lens", "topk-agree",
                     "topk-empty", "graph-addr", "capacity", "host-copy", "plan-pages", "kernel-block", "transfer")
    assert len({c.lower() for c in RULE_CODES.values()}) == len(RULES)
    assert {f: rule for f, (rule, _) in FAULTS.items()} == {f: r.name for r in TABLE for f in r.faults}
    assert [r.name for r in TABLE if r.severity == "warning"] == ["stray"]
    assert all(r.severity in ("error", "warning") and r.what for r in TABLE)


def test_each_check_is_a_function_of_its_module_taking_the_inputs_its_row_names():
    """"values.check_values" is check_values of dcptool.check.values; its parameters after the dump are the row's
    inputs in order; rules sharing a check share its columns, inputs and dcp_size."""
    from dcptool.check.plan import check_function, checks

    vocabulary = {R.VERSION, R.PROVENANCE, R.SCAN, R.WRONG, R.PAIRS, R.DIFFER}
    for check, rules in checks().items():
        fn = check_function(rules[0])
        assert callable(fn) and fn.__module__ == "dcptool.check." + check.rpartition(".")[0], check
        params = list(inspect.signature(fn).parameters.values())[1:]
        required = [p for p in params if p.default is inspect.Parameter.empty]
        assert len(required) <= len(rules[0].inputs) <= len(params), check
        assert set(rules[0].inputs) <= vocabulary
        assert len({(r.needs, r.inputs, r.dcp) for r in rules}) == 1, check


def test_the_table_imports_nothing_of_dcptool():
    """The engine reads the table (the Guard), the checks import findings which orders by it: the table imports
    nothing of dcptool, and the checks are found from their names alone."""
    import ast

    tree = ast.parse(inspect.getsource(R))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m and m.startswith("dcptool")}
    assert all(re.fullmatch(r"[a-z_]+\.check_[a-z_]+", r.check) for r in TABLE)


@pytest.mark.parametrize("N", [1, 2, 8])
def test_applies_by_dcp_size(N):
    """View rules at dcp_size > 1, stray at dcp_size 1, the rest everywhere but the cross-rank and decode rules."""
    on = {r.name for r in TABLE if R.applies(r, N)}
    view = {"missing", "stale", "global", "wrong-rank", "wrong-interleave", "mismatch", "padding", "shape"}
    sharded = {"rank-sum", "empty-mask", "tot-lens", "rank-agree", "ctx-agree", "topk-agree"}
    anywhere = {"ubatch-slice", "alias", "pages", "slots", "slot-partition", "ctx-chunks", "group-lens", "topk-empty",
                "graph-addr", "capacity", "host-copy", "plan-pages", "kernel-block", "transfer"}
    assert on == (anywhere | {"stray"} if N == 1 else anywhere | view | sharded)


def test_what_the_guard_decides_on_the_device():
    """The Guard checks one observation's errors: the view rules, pages, the decode inputs, slots (its kernel), the
    metadata tensors' addresses and buffer capacities, the host copy of seq_lens, the slot mapping's block sizes (its
    host)."""
    dev = [r.name for r in TABLE if r.device]
    assert dev == ["missing", "stale", "global", "wrong-rank", "wrong-interleave", "mismatch", "padding", "shape",
                   "pages", "empty-mask", "tot-lens", "slots", "graph-addr", "capacity", "host-copy",
                   "plan-pages", "kernel-block"]
    assert all(R.RULE[r].scope == R.OBSERVATION and R.RULE[r].severity == "error" for r in dev)
    assert {r.name for r in TABLE if r.scope == R.RANKS} == {"rank-sum", "rank-agree", "slot-partition", "ctx-agree",
                                                            "topk-agree"}


def test_skipped_order_names_every_skip_replay_can_say():
    """Each check replay may skip (named by its first rule: a SHARDED one at dcp_size 1, one needing columns), each
    part, and each cross-rank rule (one rank's file alone) has its place in SKIPPED_ORDER, once."""
    from dcptool.check.plan import checks

    can = {rules[0].name for rules in checks().values()
           if rules[0].dcp == R.SHARDED or (rules[0].needs and not rules[0].quiet)}
    can |= {f"{r.name}/{p.name}" for r in TABLE for p in r.parts}
    can |= {r.name for r in TABLE if r.scope == R.RANKS}
    assert set(R.SKIPPED_ORDER) == can and len(R.SKIPPED_ORDER) == len(can)
