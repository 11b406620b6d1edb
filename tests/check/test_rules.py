"""rules.py: the rule table itself (DESIGN §3's order, codes, each check found where it names it, faults)."""

from dcptool.check.rules import RULE_CODES, RULES, TABLE


def test_table_is_design_s3():
    """One row per rule in DESIGN §3's order; codes distinct ignoring case; every check is a function of the
    dcptool.check module its row names; every fault of simulate maps to the rule of the row that lists it."""
    import importlib

    from dcptool.model.config import FAULTS

    assert RULES == ("missing", "stale", "global", "wrong-rank", "wrong-interleave", "mismatch", "padding", "shape",
                     "stray", "ubatch-slice", "alias", "rank-sum", "pages", "empty-mask", "tot-lens", "rank-agree",
                     "slots", "slot-partition")
    assert len({c.lower() for c in RULE_CODES.values()}) == len(RULES)
    def function(name):  # "module.check_x": check_x of dcptool.check.module
        mod, _, f = name.rpartition(".")
        return getattr(importlib.import_module(f"dcptool.check.{mod}"), f)

    assert all(callable(function(r.check)) for r in TABLE)
    assert {f: rule for f, (rule, _) in FAULTS.items()} == {f: r.name for r in TABLE for f in r.faults}
    assert [r.name for r in TABLE if r.severity == "warning"] == ["stray"]


def test_the_table_imports_no_check():
    """findings names and orders findings by the table, and the checks import findings: the table imports nothing
    of dcptool (no findings <-> rules cycle), and the checks are found from their names alone."""
    import ast
    import inspect

    import dcptool.check.rules

    tree = ast.parse(inspect.getsource(dcptool.check.rules))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m.startswith("dcptool")}
    assert all("." in r.check for r in TABLE)
