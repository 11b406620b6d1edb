"""Which checks replay runs on a dump, read from the rule table (dcp.rules): each check once, for the rules of the
table that apply at the dump's dcp_size and whose columns it records, with the inputs those rules name; and why
the others are skipped."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dcptool.check.findings import FindingTable
from dcptool.check.later import value
from dcptool.dcp.rules import RANKS, RULE, SHARDED, SKIPPED_ORDER, TABLE, Rule, applies
from dcptool.dump import Dump


def check_function(rule: Rule) -> Callable:
    """The function of dcptool.check that the rule's row names."""
    module, _, name = rule.check.rpartition(".")
    return getattr(importlib.import_module(f"dcptool.check.{module}"), name)


def checks() -> dict[str, tuple[Rule, ...]]:
    """Every check of the table with its rules, in table order (several rules may share one check)."""
    out: dict[str, list[Rule]] = {}
    for r in TABLE:
        out.setdefault(r.check, []).append(r)
    return {c: tuple(rules) for c, rules in out.items()}


@dataclass(frozen=True)
class Plan:
    """The checks to run on one dump and the skipped ones.

    `run` maps each check to run to its rules (table order); `skipped` maps what is not checked to why: a check,
    named by its first rule, whose rules do not apply at this dcp_size (said for SHARDED rules only: the view rules
    and `stray` stand for each other) or whose columns are not recorded, and a rule's part (`rule/part`) whose own
    columns are not recorded while the rule's are; not a quiet check whose columns the dump does not have (a feature
    it does not have); a cross-rank rule (scope RANKS) when the dump holds one rank's observations alone (one file
    of the plugin's one-file-per-rank layout: its batches have no other rank to compare with). In SKIPPED_ORDER."""

    run: dict[str, tuple[Rule, ...]]
    skipped: dict[str, str]

    def runs(self, rule: str) -> bool:
        return RULE[rule].check in self.run

    def first(self, check: str) -> Rule:
        return self.run[check][0]


def plan(d: Dump) -> Plan:
    """The plan of replay for dump `d` (its dcp_size and the columns it records)."""
    N = d.config.dcp_size
    run: dict[str, tuple[Rule, ...]] = {}
    skipped: dict[str, str] = {}
    for check, rules in checks().items():
        first = rules[0]
        recorded = d.has(*first.needs)
        for r in rules:
            if recorded:
                skipped.update({f"{r.name}/{p.name}": p.unrecorded for p in r.parts if not d.has(*p.needs)})
        live = tuple(r for r in rules if applies(r, N))
        if first.quiet and not recorded:
            continue  # (a feature the dump does not have: nothing was left unchecked)
        if not live:
            if first.dcp == SHARDED:
                skipped[first.name] = "dcp_size is 1"
        elif not recorded:
            skipped[first.name] = first.unrecorded
        else:
            run[check] = live
    alone = _lone_rank(d, N)
    if alone is not None:
        for check, rules in tuple(run.items()):
            across = [r for r in rules if r.scope == RANKS]
            skipped.update({r.name: alone for r in across})
            if len(across) == len(rules):
                del run[check]
    return Plan(run, dict(sorted(skipped.items(), key=lambda kv: SKIPPED_ORDER.index(kv[0]))))


def _lone_rank(d: Dump, N: int) -> str | None:
    """Why the cross-rank rules are not checked, when the dump (dcp_size N > 1) holds one rank's observations alone."""
    if N <= 1 or d.n == 0:
        return None
    held = np.flatnonzero(np.bincount(d["obs.rank"].astype(np.int64), minlength=N))
    if len(held) > 1:
        return None
    return f"only rank {held[0]} of {N} is recorded here: replay the ranks' files together (a directory or a glob)"


def run_check(d: Dump, rule: Rule, inputs: dict) -> FindingTable:
    """Rule's check on `d`, called with the inputs its row names (taken from `inputs`; a check run by later() is
    waited for)."""
    return check_function(rule)(d, *(value(inputs[k]) for k in rule.inputs))
