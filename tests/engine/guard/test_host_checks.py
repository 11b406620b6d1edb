"""host_checks.py: the Guard's per-observation checks on hand-built host arrays, one rule at a time, in table order."""

import numpy as np
import pytest

from dcptool.dcp.reference import local_np
from dcptool.dump import Record
from dcptool.engine.guard.host_checks import Spec, first_wrong

SPEC = Spec(dcp_size=2, cp_interleave=1, page_size=4, sharded=(True, False))
NONE = (None, None, None)


def _case(rank=1, nr=3, nrp=4):
    seq = np.array([5, 9, 2, 0], np.int32)
    dcp = np.append(local_np(seq[:nr].astype(np.int64), 2, rank, 1), [0] * (nrp - nr)).astype(np.int32)
    kv = np.append(-(-dcp[:nr] // 4), [0]).astype(np.int32)
    return seq, dcp, kv


def _check(seq, dcp, qsl=None, kv=None, dqsl=None, tot=None, slots=NONE, nr=3, nrp=4, spec=SPEC, rank=1):
    r = Record(step=0, site="s", rank=rank, num_reqs=nr, num_reqs_padded=nrp, seq_lens=seq, dcp_local_seq_lens=dcp,
               query_start_loc=qsl, kv_pages=kv, dcp_query_start_loc=dqsl, dcp_tot_seq_lens=tot)
    return first_wrong(spec, r, slots)


def test_a_right_observation_passes():
    seq, dcp, kv = _case()
    qsl = np.array([0, 1, 2, 3, 3], np.int32)
    assert _check(seq, dcp, qsl, kv, qsl[:3], seq[:2]) is None


@pytest.mark.parametrize("edit, rule", [
    (lambda c: c.update(dcp=None), "missing"),
    (lambda c: c["dcp"].__setitem__(0, 9), "values"),
    (lambda c: c["dcp"].__setitem__(3, -1), "padding"),
    (lambda c: c.update(dcp=c["dcp"][:3]), "shape"),
    (lambda c: c["kv"].__setitem__(1, 3), "pages"),
    (lambda c: c.update(dqsl=np.array([0, 1, 1], np.int32)), "empty-mask"),
    (lambda c: c.update(tot=np.array([2, 4], np.int32)), "tot-lens"),
])
def test_each_rule(edit, rule):
    seq, dcp, kv = _case()
    c = dict(seq=seq, dcp=dcp, qsl=np.array([0, 1, 2, 3, 3], np.int32), kv=kv)
    edit(c)
    assert _check(**c) == rule


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
