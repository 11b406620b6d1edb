"""host_checks.py: the Guard's per-observation checks on hand-built host arrays, one check at a time, named and ordered
by the rule table."""

from pathlib import Path

import numpy as np
import pytest

from dcptool.dcp.reference import local_np
from dcptool.dcp.rules import DEVICE_CHECKS, RULE, TABLE
from dcptool.dump import Record, addr_words
from dcptool.engine.guard.host_checks import CHECKS, Spec, first_wrong

SPEC = Spec(dcp_size=2, cp_interleave=1, page_size=4, sharded=(True, False))
NONE = (None, None, None)


def _case(rank=1, nr=3, nrp=4, il=None):
    """(seq, dcp, kv) right at SPEC; with `il`, a dict of them right at that interleave."""
    seq = np.array([5, 9, 2, 0], np.int32)
    dcp = np.append(local_np(seq[:nr].astype(np.int64), 2, rank, il or 1), [0] * (nrp - nr)).astype(np.int32)
    kv = np.append(-(-dcp[:nr] // 4), [0]).astype(np.int32)
    return (seq, dcp, kv) if il is None else dict(seq=seq, dcp=dcp, kv=kv)


def _check(seq, dcp, qsl=None, kv=None, dqsl=None, tot=None, slots=NONE, nr=3, nrp=4, spec=SPEC, rank=1, **host):
    r = Record(step=0, site="s", rank=rank, num_reqs=nr, num_reqs_padded=nrp, seq_lens=seq, dcp_local_seq_lens=dcp,
               query_start_loc=qsl, kv_pages=kv, dcp_query_start_loc=dqsl, dcp_tot_seq_lens=tot, **host)
    return first_wrong(spec, r, slots)


def test_a_right_observation_passes():
    seq, dcp, kv = _case()
    qsl = np.array([0, 1, 2, 3, 3], np.int32)
    assert _check(seq, dcp, qsl, kv, qsl[:3], seq[:2]) is None


# One edit per check of the Guard, each breaking that check alone (the rule table names them: DEVICE_CHECKS)
BREAK = {
    "missing": lambda c: c.update(dcp=None),
    "values": lambda c: c["dcp"].__setitem__(0, 9),
    "padding": lambda c: c["dcp"].__setitem__(3, -1),
    "shape": lambda c: c.update(dcp=c["dcp"][:3]),
    "pages": lambda c: c["kv"].__setitem__(1, 3),
    "empty-mask": lambda c: c.update(dqsl=np.array([0, 1, 1], np.int32)),
    "tot-lens": lambda c: c.update(tot=np.array([2, 4], np.int32)),
    "slots": lambda c: c.update(slots=_slots(1, [[5, 0, -1, 1], [0, 1, 2, 3]])),
    # a full-graph replay whose build hands attention a tensor the graph did not capture (the host values)
    "graph-addr": lambda c: c.update(graph=3, attn_addrs=addr_words([0x7F10, 0x7F20]),
                                     graph_addrs=addr_words([0x7F00, 0x7F20])),
    # a metadata tensor's buffer one request row short of num_reqs_padded (4) (the host values)
    "capacity": lambda c: c.update(attn_caps=np.array([4, 3], np.int32)),
    # the host copy of seq_lens the build read: a real row one ahead of the device's (the host values)
    "host-copy": lambda c: c.update(host_seq_lens=np.array([5, 10, 2, 0], np.int32)),
    # a prefill row's plan (row 1: query 2, context 7, local 3 at rank 1 of 2: one page of 4) claiming the global 3
    "plan-pages": lambda c: c.update(kv_prefill_pages=np.array([-1, 3, -1, -1], np.int32),
                                     qsl=np.array([0, 1, 3, 4, 4], np.int32)),
    # the sharded group's slot mapping deals by a block (2, the kernel's) the interleave (4) does not divide: the
    # host values, under an interleave of 4 (the view and the pages follow it)
    "kernel-block": lambda c: c.update(_case(il=4), spec=SPEC._replace(cp_interleave=4),
                                       kv_block_sizes=np.array([4, 2, 2, 4, 4, 4], np.int32)),
}


def broken(name: str) -> dict:
    """A right observation (rank 1 of 2, page size 4, slots of a sharded and a replicated group) with `name` broken."""
    seq, dcp, kv = _case()
    c = dict(seq=seq, dcp=dcp, qsl=np.array([0, 1, 2, 3, 3], np.int32), kv=kv)
    BREAK[name](c)
    return c


def test_the_guards_checks_are_the_rule_tables_device_rules():
    """The Guard reports the table's device rules under their names (the five value rules, one check, as `values`),
    in table order, and nothing else; a rule the table does not mark `device` is not the Guard's."""
    assert CHECKS == tuple(c.name for c in DEVICE_CHECKS) == tuple(BREAK)
    named = {r for c in DEVICE_CHECKS for r in c.rules}
    assert named == {r.name for r in TABLE if r.device}
    for c in DEVICE_CHECKS:
        assert c.name in c.rules or c.rules == ("stale", "global", "wrong-rank", "wrong-interleave", "mismatch")
        assert {RULE[r].severity for r in c.rules} == {c.severity} == {"error"}


@pytest.mark.parametrize("name", CHECKS)
def test_each_check_is_reported_under_its_tables_name(name):
    assert _check(**broken(name)) == name


@pytest.mark.parametrize("drop", [None, "pages"])
def test_the_host_path_refuses_a_table_it_does_not_decide(monkeypatch, drop):
    """A table whose device rules differ from the checks the host path makes (a rule marked `device` it has no
    check for, or one unmarked that it checks) stops the import: the Guard never reports a name the table lacks."""
    import importlib.util

    from dcptool.dcp import rules

    table = tuple(r._replace(device=r.name != drop and r.device) for r in rules.TABLE)
    if drop is None:  # a rule the table gains
        table += (rules.Rule("new-rule", "error", "Z", "values.check_new", "a new device rule", device=True),)
    monkeypatch.setattr(rules, "DEVICE_CHECKS", rules.device_checks_of(table))
    spec = importlib.util.spec_from_file_location("host_checks_again", Path(first_wrong.__code__.co_filename))
    with pytest.raises(ImportError, match="the rule table's device checks are"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


@pytest.mark.parametrize("graph, moved", [(3, False), (2, True), (0, True), ("replay", True), ("replay", False)])
def test_graph_addr_only_at_a_replay_whose_tensor_moved(graph, moved):
    seq, dcp, _ = _case()
    cap = addr_words([0x7F00, 0x7F20])
    got = _check(seq, dcp, graph=graph, attn_addrs=addr_words([0x7F10 if moved else 0x7F00, 0x7F20]), graph_addrs=cap)
    assert got == ("graph-addr" if moved and graph in (3, "replay") else None)
    assert _check(seq, dcp, graph=3, attn_addrs=cap) is None  # (a replay of no recorded capture: not checked)


def test_values_only_where_the_view_is_aligned_and_missing_only_under_dcp():
    seq, dcp, _ = _case()
    assert _check(seq[:3], dcp, nrp=4) is None  # (a view longer than seq_lens: not compared, right length)
    one = Spec(1, 1, None, None)
    assert _check(seq, None, spec=one) is None
    assert _check(seq, dcp, kv=np.array([-1, -1, -1, 0], np.int32)) is None  # -1: a count not recorded


def _slots(rank, maps, pos=(0, 1, 2, 3)):
    pos = np.array(pos, np.int32)
    return (np.tile(pos, len(maps)), np.concatenate([np.array(m, np.int32) for m in maps]),
            np.repeat(np.arange(len(maps)), pos.size).astype(np.int32))


@pytest.mark.parametrize("rank, maps, wrong", [
    (0, [[0, -1, 1, -1], [0, 1, 2, 3]], False),  # group 0 sharded: rank 0 owns even positions; group 1 replicated
    (1, [[-1, 0, -1, 1], [0, 1, 2, 3]], False),
    (1, [[5, 0, -1, 1], [0, 1, 2, 3]], True),  # a non-owner write (slot-all-ranks)
    (1, [[-1, 0, -1, -1], [0, 1, 2, 3]], True),  # an owner leaves a token unwritten
    (1, [[-1, 0, -1, 1], [-1, 1, -1, 3]], True),  # a replicated group localised (slot-wrong-group)
    (1, [[-1, -1, -1, -1], [-1, -1, -1, -1]], False),  # a rank writing nothing at all (a dummy build)
    (1, [[-1, 0, -1, 1], [0, 1, 2, -7]], True),  # below -1
])
def test_slot_ownership(rank, maps, wrong):
    seq, dcp, _ = _case(rank=rank)
    qsl = np.array([0, 1, 2, 4, 4], np.int32)
    assert (_check(seq, dcp, qsl, slots=_slots(rank, maps), rank=rank) == "slots") is wrong


def test_padded_tokens_write_nothing():
    seq, dcp, _ = _case(rank=1)
    qsl = np.array([0, 1, 2, 3, 3], np.int32)  # 3 real tokens of 4
    assert _check(seq, dcp, qsl, slots=_slots(1, [[-1, 0, -1, -1], [0, 1, 2, -1]])) is None
    assert _check(seq, dcp, qsl, slots=_slots(1, [[-1, 0, -1, 1], [0, 1, 2, -1]])) == "slots"


def test_host_copy_stale_or_written_in_place_and_a_faithful_copy_passes():
    seq, dcp, _ = _case()
    assert _check(seq, dcp, host_seq_lens=seq.copy(), host_seq_lens_after=seq.copy()) is None
    assert _check(seq, dcp, host_seq_lens=np.array([5, 9, 2, 7], np.int32)) is None  # (a padded row)
    assert _check(seq, dcp, host_seq_lens=seq.copy(), host_seq_lens_after=np.array([5, 9, 1, 0], np.int32)) == \
        "host-copy"


def _as(rng, a: np.ndarray):
    """a as the engine may hand it: int32 or int64 numpy, or a list."""
    return [a.astype(np.int32), a.astype(np.int64), a.tolist()][int(rng.integers(3))]


@pytest.mark.parametrize("seed", range(12))
def test_the_host_values_get_the_verdicts_of_array_equal_and_any(seed):
    """graph-addr, capacity and host-copy's written-in-place half on host values of either integer width or lists,
    equal or with one value or the length changed: the verdicts np.array_equal and np.any give (the host-alone
    checks compare them as bytes where they can)."""
    rng = np.random.default_rng(seed)
    seq, dcp, _ = _case()
    for _ in range(20):
        words = rng.integers(0, 1 << 30, int(rng.integers(1, 5)))
        other = words.copy()
        change = int(rng.integers(3))
        if change == 1:
            other[int(rng.integers(other.size))] += 1
        elif change == 2:
            other = np.append(other, 7)
        a, b = _as(rng, words), _as(rng, other)
        want = not np.array_equal(np.asarray(a), np.asarray(b))
        assert (_check(seq, dcp, graph=3, attn_addrs=a, graph_addrs=b) == "graph-addr") is want
        caps = _as(rng, rng.integers(2, 7, int(rng.integers(1, 4))))
        assert (_check(seq, dcp, attn_caps=caps) == "capacity") is bool(np.any(np.asarray(caps) < 4))
        after = seq.copy()
        if change:
            after[int(rng.integers(3))] += 1
        host, after = _as(rng, seq), _as(rng, after)
        want = not np.array_equal(np.asarray(host)[:3], np.asarray(after)[:3])
        assert (_check(seq, dcp, host_seq_lens=host, host_seq_lens_after=after) == "host-copy") is want
