"""`dcptool export-test`: a pytest file an engine team can commit.

It embeds the wrong observations of a (reduced) recording as literal lists and asserts that the engine's
function computes what the rule expects: the DCP-local lengths of each observation's seq_lens (vLLM's
`get_dcp_local_seq_lens` when vLLM is importable, else dcptool's reference `local_of`, else the formula
written out) equal the expected view, padded rows 0; page counts equal cdiv(local, page_size); and the
recorded value differs from the expected one (the bug the recording caught). The expected values are
computed here by dcptool's reference, so the file passes against it and fails if one is changed.
"""

from __future__ import annotations

import pprint
import textwrap

from dcptool.check.findings import Finding, FindingTable
from dcptool.check.provenance import expected_of
from dcptool.dcp.reference import local_np
from dcptool.dump import Dump
from dcptool.errors import DcptoolError

# rules about the view's values or presence: a case checks the local lengths; `pages`: the page counts
VIEW_RULES = ("missing", "stale", "global", "wrong-rank", "wrong-interleave", "mismatch", "padding", "shape")
PAGE_RULES = ("pages",)
MAX_ROWS = 4096  # rows embedded per observation: a reproducer is small (reduce it first)


class ExportError(DcptoolError, ValueError):
    """Nothing to export (no finding a value test can check): exit 2."""


def _case(d: Dump, i: int, rules: list[str], msg: str) -> dict:
    c = d.config
    nr, nrp = int(d["obs.num_reqs"][i]), int(d["obs.num_reqs_padded"][i])
    seq = d.seq_lens_of(i)
    view = d.dcp_of(i)
    case = {"id": f"obs{int(d.file_obs[i])}-step{int(d['obs.step'][i])}-{d.site_name(i)}-rank{int(d['obs.rank'][i])}"
                  + (f"-ubatch{int(d['obs.ubatch'][i])}" if int(d["obs.ubatch"][i]) >= 0 else ""),
            "finding": msg, "rules": rules, "rank": int(d["obs.rank"][i]), "num_reqs": nr, "num_reqs_padded": nrp,
            "seq_lens": [int(x) for x in seq[:nrp]]}
    if any(r in VIEW_RULES for r in rules):
        case["recorded"] = None if view is None else [int(x) for x in view]
        case["expected"] = [int(x) for x in expected_of(d, i)]
    if any(r in PAGE_RULES for r in rules):
        pages = d.kv_pages_of(i)
        local = local_np(seq[:nr], c.dcp_size, int(d["obs.rank"][i]), c.cp_interleave)
        case["recorded_pages"] = [int(x) for x in pages[:nr]]
        case["expected_pages"] = [int(x) for x in -(-local // int(c.page_size))]
    return case


def cases_of(d: Dump, findings: FindingTable, max_cases: int) -> list[dict]:
    """One case per observation with a view or page finding, the first observation of each rule first."""
    by_obs: dict[int, list[Finding]] = {}
    for f in findings:
        if f.rule in VIEW_RULES + PAGE_RULES:
            by_obs.setdefault(f.index, []).append(f)
    firsts: dict[str, int] = {}
    for i, fs in by_obs.items():
        for f in fs:
            firsts.setdefault(f.rule, i)
    pick = list(dict.fromkeys(list(firsts.values()) + list(by_obs)))
    pick = [i for i in pick if int(d["obs.num_reqs_padded"][i]) <= MAX_ROWS][:max_cases]
    return [_case(d, i, [f.rule for f in by_obs[i]], by_obs[i][0].message) for i in sorted(pick)]


_HEAD = '''"""{about}
"""

import pytest

DCP_SIZE = {N}
CP_INTERLEAVE = {I}
PAGE_SIZE = {page}


def _formula(seq_len, rank):
    rounds, rem = divmod(seq_len, DCP_SIZE * CP_INTERLEAVE)
    return rounds * CP_INTERLEAVE + min(max(rem - rank * CP_INTERLEAVE, 0), CP_INTERLEAVE)


def local_seq_lens(seq_lens, rank):
    """The DCP-local lengths of seq_lens on `rank`, computed by the engine's function."""
    try:
        import torch
        from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens
    except Exception:
        pass
    else:
        out = get_dcp_local_seq_lens(torch.tensor(seq_lens, dtype=torch.int32), DCP_SIZE, rank, CP_INTERLEAVE)
        return [int(x) for x in out.reshape(-1).tolist()]
    try:
        import numpy as np
        from dcptool.dcp.reference import local_of
    except Exception:
        return [_formula(int(s), rank) for s in seq_lens]
    return [int(x) for x in local_of(np.asarray(seq_lens, np.int64), rank, DCP_SIZE, CP_INTERLEAVE)]


'''

_PAGE_TEST = '''

PAGE_CASES = [c for c in CASES if "expected_pages" in c]


@pytest.mark.parametrize("case", PAGE_CASES, ids=_ids(PAGE_CASES))
def test_attention_page_counts(case):
    local = local_seq_lens(case["seq_lens"][: case["num_reqs"]], case["rank"])
    assert [-(-n // PAGE_SIZE) for n in local] == case["expected_pages"], case["finding"]
    assert case["recorded_pages"] != case["expected_pages"], case["finding"]
'''

_TESTS = '''

def _ids(cases):
    return [c["id"] for c in cases]


VIEW_CASES = [c for c in CASES if "expected" in c]


@pytest.mark.parametrize("case", VIEW_CASES, ids=_ids(VIEW_CASES))
def test_dcp_local_seq_lens(case):
    real = case["seq_lens"][: case["num_reqs"]]
    computed = local_seq_lens(real, case["rank"]) + [0] * (case["num_reqs_padded"] - case["num_reqs"])
    assert computed == case["expected"], case["finding"]
    # the recording caught a bug: what attention received was not this (None, stale, short, ...)
    assert case["recorded"] != case["expected"], case["finding"]
'''


def _plain(s: str) -> str:
    """A file name as docstring text: printable, no quote or backslash that could end or bend the string."""
    return "".join(ch if ch.isprintable() and ch not in '"\\' else "?" for ch in s)


def export_test(d: Dump, findings: FindingTable, max_cases: int = 8) -> tuple[str, int]:
    """The pytest file's text and its number of cases."""
    cases = cases_of(d, findings, max_cases)
    if not cases:
        rules = sorted({f.rule for f in findings})
        why = f"its findings ({', '.join(rules)}) are not about values a test can recompute" if rules else \
            "replay finds nothing wrong in it"
        raise ExportError(f"nothing to export: {why}")
    c = d.config
    counts: dict[str, int] = {}
    for case in cases:
        for r in case["rules"]:
            counts[r] = counts.get(r, 0) + 1
    about = (f"DCP regression test generated by `dcptool export-test` from {_plain(', '.join(d.files))}.\n\n"
             + textwrap.fill(
                 f"Recorded by {_plain(c.engine or 'an engine')}, engine version "
                 f"{_plain(c.engine_version or '(none recorded)')}, with dcp_size {c.dcp_size}, "
                 f"cp_kv_cache_interleave_size {c.cp_interleave}"
                 + (f", page_size {c.page_size}" if c.page_size else "") + ". Each case is one observation whose "
                 f"DCP metadata was wrong ({', '.join(f'{r} {n}' for r, n in counts.items())}). The test checks "
                 "that the local-length function computes the expected values (real rows: the DCP-local length "
                 "of seq_len on this rank; padded rows: 0) and that what was recorded differs from them: the bug "
                 "this recording caught. The function under test is vLLM's get_dcp_local_seq_lens when vLLM is "
                 "importable, else dcptool's reference, else the formula below (dcptool's docs/dcp.md).", width=112))
    head = _HEAD.format(about=about, N=c.dcp_size, I=c.cp_interleave, page=c.page_size or 0)
    body = "CASES = " + pprint.pformat(cases, width=116, sort_dicts=False) + "\n"
    pages = any("expected_pages" in case for case in cases)
    views = any("expected" in case for case in cases)
    tests = (_TESTS if views else _TESTS.split("\n\n\nVIEW_CASES")[0] + "\n") + (_PAGE_TEST if pages else "")
    return head + body + tests, len(cases)
