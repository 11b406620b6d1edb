"""slot_screen.py: the screen misses no wrong entry and sends only suspect observations to the exact work."""

import numpy as np
import pytest
from conftest import write
from test_slots import KV2, KV3, random_slot_dump, run_slots, slot_batch

from dcptool.dump import open_dumps
from dcptool.dump.schema import KVGroup

# A screen of cheap whole-chunk passes picks the runs that can have a finding; only
# their observations get the exact work, only sets with such a member slot-partition's second read

KV_ODD = (KVGroup("attn", True, 24), KVGroup("mamba", False, 12), KVGroup("big", True, 1 << 14))  # (no lo16)


@pytest.mark.parametrize("seed,N,I_,kv", [(10, 4, 1, KV3), (11, 8, 4, KV3), (12, 3, 2, KV3), (13, 2, 1, None),
                                          (14, 8, 1, KV_ODD), (15, 4, 2, KV_ODD), (16, 1, 1, KV3)])
def test_slot_screen_misses_no_rare_fault_equal_to_both_references(tmp_path, monkeypatch, seed, N, I_, kv):
    """Mostly clean builds with a rare wrong entry of each kind (so most runs pass the screen and a missed one
    would show): the findings of the whole-column and the chunked reference, at several chunk sizes; block
    sizes that are no power of two or too big for the uint16 fast path (KV_ODD) take the int64 path."""
    from slot_reference import (
        chunked_check_slot_partition,
        chunked_check_slots,
        old_check_slot_partition,
        old_check_slots,
    )

    import dcptool.check.slot_pass as P
    import dcptool.check.slots as R

    rng = np.random.default_rng(seed)
    d = random_slot_dump(tmp_path / "s.safetensors", rng, 160, N, I_, kv, faulty=0.04, dup=0.03, reorder=0.02,
                         noqsl=0.01)
    want = old_check_slots(d), old_check_slot_partition(d)
    assert (chunked_check_slots(d), chunked_check_slot_partition(d)) == want
    assert 0 < len(want[0]) < d.n // 2  # most observations clean, some not
    for chunk in (1, 64, 1000, 1 << 18):
        monkeypatch.setattr(P, "SLOT_CHUNK", chunk)
        assert R.check_slots(d) == want[0], chunk
        assert R.check_slot_partition(d) == want[1], chunk


def test_slot_screen_duplicates_across_requests(tmp_path):
    """A duplicate between two requests of one build (each request's slots increasing: two segments whose
    ranges overlap) is found; overlapping ranges without a shared slot are not a finding."""
    def edit(r, g, pos, slot):
        if g == 1:  # (replicated, blocks of 16)
            if r == 0:
                slot[35] = slot[3]  # request 1's position 3 takes request 0's position 3's slot
            if r == 1:
                slot[16:32] += 16  # request 0 in blocks 0 and 2, request 1 in block 1: ranges overlap, slots differ
                slot[32:] = 16 + np.arange(10)
    q, comp = [32, 10], [0, 0]
    o = slot_batch(0, q, comp, 2, 1, edit=edit)
    res = run_slots(tmp_path, o, 2, 1)
    assert [(f.rank, f.rule, f.detail.get("kind")) for f in res.findings] == [(0, "slots", "duplicate")]


def test_slot_screen_sends_only_suspect_observations_to_the_exact_work(tmp_path, monkeypatch):
    """A clean recording gets no exact work at all; one wrong entry sends its observation only."""
    import dcptool.check.slot_pass as P
    import dcptool.check.slots as R

    calls = []
    real = P.slot_findings
    monkeypatch.setattr(P, "slot_findings", lambda d, found, oid, *a: calls.append(oid.tolist()) or real(d, found, oid,
                                                                                                       *a))

    def one(r, g, pos, slot):
        if r == 2 and g == 0:
            slot[5] = -1 if slot[5] >= 0 else 77

    for bad in (None, 4):
        o = []
        for step in range(6):
            o += slot_batch(step, [40, 1, 90], [step * 7, 300, 1000], 4, 1, ntp=135, edit=one if step == bad else None)
        write(tmp_path / f"c{bad}.safetensors", o, dcp=4, il=1, kv_groups=tuple(KVGroup.of(g) for g in KV2))
        d = open_dumps([str(tmp_path / f"c{bad}.safetensors")])
        got = R.check_slots(d)
        if bad is None:
            assert got == [] and calls == []
        else:
            assert [i.index for i in got] == [4 * 4 + 2] and calls == [[18]]


@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 1000, 4099])
def test_true_before_counts_like_a_cumsum(rng, n):
    """The screen's per-run counts (8 bools summed per 64-bit word): runs of every length, starts in any
    byte of a word, repeated starts, the padding past n."""
    from dcptool.check.slot_screen import _true_before

    for density in (0.0, 0.3, 1.0):
        wpad = np.zeros((n // 8 + 1) * 8, bool)
        wpad[:n] = rng.random(n) < density
        start = np.unique(np.r_[0, rng.integers(0, n + 1, 40), n])
        start = np.sort(np.r_[start, start[: 3]])  # (repeats)
        assert (_true_before(wpad, start) == np.r_[0, np.cumsum(wpad[:n])][start]).all()
