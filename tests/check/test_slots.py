"""slots.py: the slots and slot-partition rules on batches modelled on vLLM's slot mapping, and in chunks against
the whole-column implementation they replaced (tests/slot_reference.py)."""

import numpy as np
import pytest
from conftest import obs, run, write

from dcptool.dump import open_dumps
from dcptool.dump.schema import KVGroup

# slots and slot-partition (vLLM's rule: tests/vllm/test_vllm_slots.py checks it against
# vLLM's own kernel; here a numpy model of it builds the dumps)

KV2 = ({"name": "attn", "dcp": True, "block_size": 16}, {"name": "mamba", "dcp": False, "block_size": 16})


def vllm_slot_mapping(q, comp, ntp, rank, N, I_, B=16, sharded=True):
    """The slot this rank writes per token, as vLLM's _compute_slot_mappings_kernel does: request i's block k
    is block i*4096 + k, the owner of position p in a sharded group is (p // I) % N, padding writes -1."""
    pos = np.concatenate([np.arange(c, c + k) for c, k in zip(comp, q)] + [np.zeros(0, np.int64)]).astype(np.int64)
    req = np.repeat(np.arange(len(q)), q)
    if sharded:
        vo = pos % (B * N)
        local = pos // (B * N) * B + vo // (I_ * N) * I_ + vo % I_
        mine = (pos // I_) % N == rank
    else:
        local, mine = pos, np.ones(pos.size, bool)
    slot = np.where(mine, (req * 4096 + local // B) * B + local % B, -1)
    full_pos = np.zeros(ntp, np.int64)
    full_pos[: pos.size] = pos
    full_slot = np.full(ntp, -1, np.int64)
    full_slot[: pos.size] = slot
    return full_pos, full_slot


def slot_batch(step, q, comp, N, I_, ntp=None, site="attn_metadata", dummy=False, edit=None):
    """One batch on every rank with both groups' slot mappings (dummy: all -1, as get_dummy_slot_mappings);
    edit(rank, group, pos, slot) may change a rank's mapping in place."""
    q, comp = np.asarray(q, np.int64), np.asarray(comp, np.int64)
    ntp = int(q.sum()) if ntp is None else ntp
    seq = (q + comp).astype(np.int32)
    qsl = np.r_[0, np.cumsum(q)]
    out = []
    for r in range(N):
        maps = {}
        for g, kv in enumerate(KV2):
            pos, slot = vllm_slot_mapping(q, comp, ntp, r, N, I_, kv["block_size"], kv["dcp"])
            if dummy:
                slot[:] = -1
            if edit is not None:
                edit(r, g, pos, slot)
            maps[g] = slot
        out.append(obs(step=step, site=site, rank=r, seq=seq, num_reqs=q.size, num_reqs_padded=q.size, dcp=N,
                       il=I_, view=None if N == 1 else "auto", query_start_loc=qsl, num_tokens_padded=ntp,
                       positions=pos, slot_mapping=maps))
    return out


def run_slots(tmp_path, observations, N, I_):
    return run(tmp_path, observations, dcp=N, il=I_, kv_groups=tuple(KVGroup.of(g) for g in KV2))


@pytest.mark.parametrize("N,I_", [(1, 1), (2, 1), (4, 16), (3, 2), (8, 4)])
def test_slots_clean_on_random_batches_must_not_trigger(tmp_path, rng, N, I_):
    o = []
    for step, total in enumerate((0, 1, 127, 128, 129, 1031)):
        n = min(total, int(rng.integers(1, 6))) if total else 0
        q = np.diff(np.r_[0, np.sort(rng.choice(np.arange(1, total), n - 1, replace=False)), total]) if n > 1 else (
            np.array([total] * n, np.int64))
        comp = rng.integers(0, 5000, n)
        o += slot_batch(step, q, comp, N, I_, ntp=total + int(rng.integers(0, 9)))
        o += slot_batch(step, q, comp, N, I_, site="dummy", dummy=True)  # dummy runs write nothing: not a finding
    res = run_slots(tmp_path, o, N, I_)
    assert [f.message for f in res.findings] == []
    assert "slots" not in res.skipped


def _kinds(res):
    return {(f.obs, f.rule, f.detail.get("kind")) for f in res.findings}


def test_slots_each_kind_triggers(tmp_path):
    N, I_ = 2, 1
    q, comp = [3, 1, 4], [10, 26, 0]  # positions 10 11 12 | 26 | 0 1 2 3

    def put(rank, group, token, value):
        def edit(r, g, pos, slot):
            if (r, g) == (rank, group):
                slot[token] = value
        return edit

    cases = [
        ("padded", put(0, 0, 9, 5), 0),  # token 9 of 10 padded tokens (8 real)
        ("value", put(1, 1, 0, -7), 1),
        ("non-owner", put(1, 0, 0, 123), 1),  # position 10 belongs to rank 0
        ("owner-missing", put(0, 0, 0, -1), 0),
        ("replicated-missing", put(1, 1, 2, -1), 1),
        ("offset", put(0, 0, 0, 16 * 99 + 3), 0),  # position 10 sits at local offset 5 on rank 0
        # position 26 takes position 10's slot (same block offset): two tokens, one slot
        ("duplicate", put(0, 1, 3, int(vllm_slot_mapping(q, comp, 10, 0, N, I_, 16, False)[1][0])), 0),
    ]
    for step, (kind, edit, rank) in enumerate(cases):
        res = run_slots(tmp_path, slot_batch(step, q, comp, N, I_, ntp=10, edit=edit), N, I_)
        got = [(f.rank, f.rule, f.detail.get("kind")) for f in res.findings if f.rule == "slots"]
        assert got == [(rank, "slots", kind)], (kind, [f.message for f in res.findings])
        f = next(f for f in res.findings if f.rule == "slots")
        assert f.severity == "error" and f.message.startswith(f"step {step} attn_metadata rank {rank}: token ")


def test_slots_message_names_owner_and_counts(tmp_path):
    def all_ranks(r, g, pos, slot):  # rank 1 also writes every token of the sharded group
        if (r, g) == (1, 0):
            slot[:8] = np.arange(8) + 1000
    res = run_slots(tmp_path, slot_batch(0, [3, 1, 4], [10, 40, 0], 2, 1, edit=all_ranks), 2, 1)
    f = next(f for f in res.findings if f.rule == "slots")
    assert f.rank == 1 and f.detail == {"kind": "non-owner", "group": 0, "position": 10, "token": 0, "slot": 1000,
                                        "owner": 0}
    # 4 tokens it does not own, and its own 4 at wrong offsets
    assert "belongs to rank 0 ((p // 1) % 2)" in f.message and "(8 wrong entries)" in f.message
    assert "0 (attn)" in f.message


def test_slot_partition_double_write_at_non_owner_and_unwritten_at_owner(tmp_path):
    N, I_ = 4, 2

    def steal(r, g, pos, slot):  # rank 3 writes positions it does not own (like vLLM #57260's mask missing)
        if (r, g) == (3, 0):
            slot[:4] = np.arange(4) + 7000

    res = run_slots(tmp_path, slot_batch(0, [5, 3], [0, 20], N, I_, edit=steal), N, I_)
    part = [f for f in res.findings if f.rule == "slot-partition"]
    assert [(f.rank, f.obs) for f in part] == [(3, 3)]
    # positions 0..3 of request 0: 0,1 belong to rank 0, 2,3 to rank 1
    assert part[0].detail["written_by_several"] == [0, 1, 2, 3] and part[0].detail["unwritten"] == []
    assert part[0].detail["obs"] == [0, 1, 2, 3] and "written by several ranks" in part[0].message

    def lose(r, g, pos, slot):  # rank 1 writes nothing in the sharded group while the others write
        if (r, g) == (1, 0):
            slot[:] = -1

    res = run_slots(tmp_path, slot_batch(1, [5, 3], [0, 20], N, I_, edit=lose), N, I_)
    part = [f for f in res.findings if f.rule == "slot-partition"]
    assert [f.rank for f in part] == [1]
    # positions 0..4 and 20..22: rank 1 owns 2 and 3
    assert part[0].detail["unwritten"] == [2, 3] and "written by no rank" in part[0].message
    # the rank's own slots rule is quiet: a build that writes nothing in a group is not asked to (dummy runs)
    assert [f.rule for f in res.findings] == ["slot-partition"]


def test_slot_partition_needs_every_rank_and_ignores_replicated_groups(tmp_path):
    N, I_ = 2, 1

    def dup(r, g, pos, slot):
        if (r, g) == (1, 0):
            slot[0] = 555
    o = slot_batch(0, [2], [0], N, I_, edit=dup)
    res = run_slots(tmp_path, o[1:], N, I_)  # rank 0 not recorded: no set to partition
    assert [f.rule for f in res.findings] == ["slots"]
    res = run_slots(tmp_path, slot_batch(1, [6, 2], [3, 9], N, I_), N, I_)  # replicated: N writers each, fine
    assert res.findings == []


def test_slots_skipped_without_columns_and_group_defaults(tmp_path):
    assert "slots" in run(tmp_path, [obs()]).skipped
    # without kv_groups every group is DCP-sharded (vLLM 0.29-0.30 localise every group)
    o = slot_batch(0, [4], [0], 2, 1)
    res = run(tmp_path, o, dcp=2, il=1)
    assert {f.detail["kind"] for f in res.findings if f.rule == "slots"} == {"non-owner"}  # group 1 looks sharded


# the slot checks in chunks (SLOT_CHUNK entries; whole rank-sets for slot-partition) give the same
# findings as the whole-column implementation they replaced (tests/slot_reference.py), on seeded random dumps

KV3 = (KVGroup("attn", True, 16), KVGroup("mamba", False, 16), KVGroup("big", True, 32))


def random_slot_dump(path, rng, batches, N, I_, kv=KV3, bounded=None, faulty=0.6, dup=0.3, reorder=0.1,
                     noqsl=0.2):
    """`batches` batches on (mostly) every rank, observations shuffled so a set's members lie far apart: real
    token counts 0, 1, 127, 128, 129, 1000+, padding, dummy builds, with wrong entries of every kind (padded
    writes, bad values, non-owners, missing owners, wrong offsets, duplicates: in a `faulty` / `dup` share of
    the builds), groups sometimes (`reorder`) out of order or interleaved, query_start_loc sometimes (`noqsl`)
    not recorded."""
    groups = [(True, 0)] if kv is None else [(g.dcp, g.block_size or 0) for g in kv]
    per = []  # (step, rank, nreq, qsl or None, [(group, pos, slot)])
    for b in range(batches):
        T = int(rng.choice([0, 1, 5, 127, 128, 129, 1031]))
        nreq = int(min(T, rng.integers(0, 4))) if T else 0
        cuts = np.sort(rng.choice(np.arange(1, T), nreq - 1, replace=False)) if nreq > 1 else np.zeros(0, int)
        qsl = np.r_[0, cuts, T][: nreq + 1] if nreq else np.zeros(1, np.int64)
        ntp = T + int(rng.integers(0, 9))
        comp = int(rng.integers(0, 3000))
        dummy = rng.random() < 0.1
        ranks = [r for r in range(N) if rng.random() > 0.05]
        ranks += [int(rng.integers(0, N))] if rng.random() < 0.05 else []  # a rank twice
        for r in ranks:
            ents = []
            for g, (sh, B) in enumerate(groups):
                if rng.random() < 0.1:
                    continue  # the group not recorded in this build
                pos = np.zeros(ntp, np.int64)
                pos[:T] = comp + np.arange(T)
                Bv = max(B, 1)
                if sh:
                    vo = pos % (Bv * N)
                    local = pos // (Bv * N) * Bv + vo // (I_ * N) * I_ + vo % I_
                    mine = (pos // I_) % N == r
                else:
                    local, mine = pos, np.ones(ntp, bool)
                slot = np.where(mine, 7 * Bv * 4096 + local, -1)
                slot[T:] = -1
                if dummy:
                    slot[:] = -1
                if rng.random() < faulty:
                    k = rng.random(ntp)
                    slot[k < 0.004] = -1  # owner missing
                    slot[(k > 0.996)] = slot[k > 0.996] + 1  # wrong offset (or a -1 turned 0: a non-owner writes)
                    hit = rng.random(ntp) < 0.003
                    slot[hit] = rng.choice([-7, 5, 123456])  # bad value, stray writes
                w = np.flatnonzero(slot[:T] >= 0)
                if w.size > 1 and rng.random() < dup:  # a duplicate: a later token at the same block offset
                    same = w[1:][(local[w[1:]] - local[w[0]]) % Bv == 0]
                    if same.size:
                        slot[same[-1]] = slot[w[0]]
                ents.append((g, pos, slot))
            per.append((b // 2, r, nreq, qsl if rng.random() < 1 - noqsl else None, ents))
    order = rng.permutation(len(per))
    cols = {k: [] for k in ("step", "rank", "nreq", "qsl", "cnt", "pos", "slot", "grp")}
    for i in order:
        step, r, nreq, qsl, ents = per[i]
        g = np.concatenate([np.full(p.size, gi, np.int32) for gi, p, _ in ents] + [np.zeros(0, np.int32)])
        p = np.concatenate([p for _, p, _ in ents] + [np.zeros(0, np.int64)])
        s = np.concatenate([s for _, _, s in ents] + [np.zeros(0, np.int64)])
        if g.size and rng.random() < reorder:  # groups out of the Recorder's order: reversed, or interleaved
            o = np.argsort(-g, kind="stable") if rng.random() < 0.5 else np.argsort(rng.random(g.size) < 0.5,
                                                                                    kind="stable")
            g, p, s = g[o], p[o], s[o]
        cols["step"].append(step)
        cols["rank"].append(r)
        cols["nreq"].append(nreq)
        cols["qsl"].append(qsl)
        cols["cnt"].append(g.size)
        cols["pos"].append(p)
        cols["slot"].append(s)
        cols["grp"].append(g)
    n = len(order)
    nreq = np.array(cols["nreq"], np.int64)
    rows = np.r_[0, np.cumsum(nreq)]
    qlen = np.array([0 if q is None else q.size for q in cols["qsl"]], np.int64)
    out = {"obs.step": np.array(cols["step"], np.int64), "obs.site": np.zeros(n, np.int32),
           "obs.rank": np.array(cols["rank"], np.int32), "obs.ubatch": np.full(n, -1, np.int32),
           "obs.num_reqs": nreq.astype(np.int32), "obs.num_reqs_padded": nreq.astype(np.int32), "obs.rows": rows,
           "obs.has_dcp": np.zeros(n, np.uint8), "obs.dcp_rows": np.zeros(n + 1, np.int64),
           "rows.seq_lens": np.full(int(rows[-1]), 5000, np.int32), "rows.dcp_local_seq_lens": np.zeros(0, np.int32),
           "obs.qsl": np.r_[0, np.cumsum(qlen)],
           "rows.query_start_loc": np.concatenate([q for q in cols["qsl"] if q is not None] + [np.zeros(0)]).astype(
               np.int32),
           "obs.slots": np.r_[0, np.cumsum(cols["cnt"])].astype(np.int64)}
    for key, name in (("pos", "positions"), ("slot", "slot_mapping"), ("grp", "slot_group")):
        out["rows." + name] = np.concatenate(cols[key] + [np.zeros(0)]).astype(np.int32)
    from dcptool.dump import DumpConfig, write_dump

    write_dump(path, DumpConfig(dcp_size=N, cp_interleave=I_, sites=("x",), kv_groups=kv), out)
    return open_dumps([str(path)], bounded=bounded)


@pytest.mark.parametrize("seed,N,I_,kv", [(0, 4, 1, KV3), (1, 8, 4, KV3), (2, 3, 2, KV3), (3, 2, 1, None),
                                          (4, 4, 16, KV3[:2]), (5, 1, 1, KV3)])
def test_slot_checks_in_chunks_equal_the_whole_column_reference(tmp_path, monkeypatch, seed, N, I_, kv):
    from slot_reference import old_check_slot_partition, old_check_slots

    import dcptool.check.slot_pass as P
    import dcptool.check.slots as R

    rng = np.random.default_rng(seed)
    d = random_slot_dump(tmp_path / "s.safetensors", rng, 60, N, I_, kv)
    want = old_check_slots(d), old_check_slot_partition(d)
    assert len(want[0]) > 10 and (N == 1 or len(want[1]) > 0)  # the dump has findings of both rules
    kinds = {i.detail["kind"] for i in want[0]}
    assert kinds >= {"padded", "value", "owner-missing", "duplicate"} | ({"non-owner"} if N > 1 else set()) | (
        {"offset"} if kv else set())
    for chunk in (1, 7, 128, 1 << 22):
        monkeypatch.setattr(P, "SLOT_CHUNK", chunk)
        monkeypatch.setattr(P, "SLOT_CHUNK_THREADED", chunk)
        assert R.check_slots(d) == want[0], chunk
        assert R.check_slot_partition(d) == want[1], chunk
        for threads in (1, 3):  # chunks on several threads: the same findings, in the same order
            found, members = P.slot_pass(d, members=N > 1, threads=threads)
            assert (found, R.check_slot_partition(d, members)) == want, (chunk, threads)
    b = open_dumps([str(tmp_path / "s.safetensors")], bounded=True)
    monkeypatch.setattr(P, "SLOT_CHUNK", 129)
    assert (R.check_slots(b), R.check_slot_partition(b)) == want


@pytest.mark.parametrize("size", [0, 1, 127, 128, 129, 1031])
def test_slot_checks_in_chunks_clean_and_awkward_sizes_must_not_trigger(tmp_path, monkeypatch, size):
    from slot_reference import old_check_slot_partition, old_check_slots

    import dcptool.check.slot_pass as P
    import dcptool.check.slots as R

    o = slot_batch(0, [size], [3], 4, 2) + slot_batch(1, [size], [17], 4, 2, ntp=size + 3)
    write(tmp_path / "c.safetensors", o, dcp=4, il=2, kv_groups=tuple(KVGroup.of(g) for g in KV2))
    d = open_dumps([str(tmp_path / "c.safetensors")])
    for chunk in (1, 7, 128):
        monkeypatch.setattr(P, "SLOT_CHUNK", chunk)
        assert R.check_slots(d) == [] == old_check_slots(d)
        assert R.check_slot_partition(d) == [] == old_check_slot_partition(d)


class _ReadSpy:
    """A row column that records the largest read (a slice or an index array) and a read of it whole."""

    def __init__(self, a, log):
        self.a, self.log, self.size, self.shape, self.dtype, self.ndim = a, log, a.size, a.shape, a.dtype, 1

    def __len__(self):
        return self.size

    def __getitem__(self, k):
        out = self.a[k]
        self.log.append(np.size(out))
        return out

    def __array__(self, dtype=None, copy=None):
        self.log.append(self.size)
        return self.a if dtype is None else self.a.astype(dtype)


@pytest.mark.parametrize("threads", [1, 3])
def test_slot_checks_read_the_dump_a_chunk_at_a_time(tmp_path, monkeypatch, threads):
    """Peak memory bounded by the chunk, not the dump: no read of a slot column is much larger than
    SLOT_CHUNK entries (the whole-column implementation read every column whole); on several threads, by
    SLOT_CHUNK_THREADED entries per thread (the threads a host of many cores gets, forced here)."""
    import dcptool.check.slot_pass as P
    import dcptool.check.slots as R

    monkeypatch.setattr(P, "default_threads", lambda bounded=False: 1 if bounded else threads)
    monkeypatch.setattr(P, "SLOT_CHUNK_THREADED", 1000)

    d = random_slot_dump(tmp_path / "s.safetensors", np.random.default_rng(7), 80, 4, 1)
    want = R.check_slots(d), R.check_slot_partition(d)
    total = int(d["obs.slots"][-1])
    log: list[int] = []
    for k in ("rows.positions", "rows.slot_mapping", "rows.slot_group"):
        d.columns[k] = _ReadSpy(d.columns[k], log)
    monkeypatch.setattr(P, "SLOT_CHUNK", 1000)
    most = int(np.diff(d["obs.slots"]).max())
    assert R.check_slots(d) == want[0] and len(want[0]) > 0
    assert R.check_slot_partition(d) == want[1] and len(want[1]) > 0
    assert log and max(log) <= 1000 + 4 * most < total // 4, (max(log), total)


def test_slot_partition_many_wrong_entries_per_member_equal_the_reference(tmp_path, monkeypatch):
    """A rank writing all 1031 tokens (more than the 64 positions a finding keeps): counts and the first
    positions as the whole-column reference has them, in chunks too."""
    from slot_reference import old_check_slot_partition, old_check_slots

    import dcptool.check.slot_pass as P
    import dcptool.check.slots as R

    def all_ranks(r, g, pos, slot):
        if r in (1, 3) and g == 0:
            slot[:] = np.arange(slot.size) + 9000
            slot[r * 100: r * 100 + 70] = -1  # and some of its own positions unwritten

    o = slot_batch(0, [1000, 31], [5, 77], 4, 1, edit=all_ranks) + slot_batch(1, [129], [0], 4, 1, edit=all_ranks)
    write(tmp_path / "m.safetensors", o, dcp=4, il=1, kv_groups=tuple(KVGroup.of(g) for g in KV2))
    d = open_dumps([str(tmp_path / "m.safetensors")])
    want = old_check_slots(d), old_check_slot_partition(d)
    assert len(want[1]) >= 4 and max(i.wrong_rows for i in want[1]) > 700
    for chunk in (7, 1 << 22):
        monkeypatch.setattr(P, "SLOT_CHUNK", chunk)
        assert (R.check_slots(d), R.check_slot_partition(d)) == want


class _IndexSpy(_ReadSpy):
    """A row column that records its reads as ('slice', n) or ('gather', n)."""

    def __getitem__(self, k):
        out = self.a[k]
        self.log.append(("slice" if isinstance(k, slice) else "gather", np.size(out)))
        return out


def test_slot_partition_reads_clean_sets_once_and_takes_the_pass_summaries(tmp_path):
    """slot-partition gathers the entries of sets with a suspect member only (none on a clean recording), and
    given the summaries of a pass made already (check_slot_rules' pass) reads no entry at all."""
    from slot_reference import old_check_slot_partition

    import dcptool.check.slot_pass as P
    import dcptool.check.slots as R

    o = []
    for step in range(8):
        o += slot_batch(step, [40, 1, 90], [step * 7, 300, 1000], 4, 1, ntp=135)
        o += slot_batch(step, [3], [step], 4, 1, site="dummy", dummy=True)
    write(tmp_path / "s.safetensors", o, dcp=4, il=1, kv_groups=tuple(KVGroup.of(g) for g in KV2))
    d = open_dumps([str(tmp_path / "s.safetensors")])
    log: list = []
    for k in ("rows.positions", "rows.slot_mapping", "rows.slot_group"):
        d.columns[k] = _IndexSpy(d.columns[k], log)
    found, members = P.slot_pass(d)
    assert found == [] and log and all(kind == "slice" for kind, _ in log)
    log.clear()
    assert R.check_slot_partition(d, members) == [] and log == []  # the pass's summaries, clean sets unread
    assert R.check_slot_partition(d) == [] and log and all(kind == "slice" for kind, _ in log)  # its own pass
    f = random_slot_dump(tmp_path / "f.safetensors", np.random.default_rng(4), 60, 4, 1)
    want = old_check_slot_partition(f)
    assert want and R.check_slot_partition(f, P.slot_pass(f)[1]) == want == R.check_slot_partition(f)


def test_slot_rules_make_one_pass_for_both(tmp_path, monkeypatch):
    """check_slot_rules (what replay runs, on one background thread) reads the entries once for both rules, with
    the findings of the reference and of the two rules called alone; on two threads at once as well."""
    from concurrent.futures import ThreadPoolExecutor

    from slot_reference import old_check_slot_partition, old_check_slots

    import dcptool.check.slot_pass as P
    import dcptool.check.slots as R
    from dcptool.check.findings import FindingTable

    d = random_slot_dump(tmp_path / "s.safetensors", np.random.default_rng(21), 80, 4, 2)
    want = old_check_slots(d), old_check_slot_partition(d)
    both = FindingTable.concat(d, want)
    passes = []
    real = P.slot_pass
    monkeypatch.setattr(P, "slot_pass", lambda *a, **k: passes.append(1) or real(*a, **k))
    assert R.check_slot_rules(d) == both and len(both) and len(passes) == 1
    assert (R.check_slot_partition(d), R.check_slots(d)) == want[::-1] and len(passes) == 3
    with ThreadPoolExecutor(2) as pool:
        for _ in range(3):
            a, b = pool.submit(R.check_slot_rules, d), pool.submit(R.check_slot_rules, d)
            assert a.result() == b.result() == both


# --------------------------------------------------------------------------------------------
# the slot rules on PCP dumps. simulate records each PCP rank's local tokens with the slot each
# writes, owned over the DCP ranks only as vLLM 0.29-0.34 own them (tests/vllm/test_vllm_pcp_slots.py checks that
# against vLLM's PCP manager); the rules need no PCP rank: a PCP rank's builds are sets of N DCP ranks like any other.


@pytest.mark.parametrize("fault", [None, "slot-wrong-group", "slot-all-ranks"])
def test_slot_rules_on_pcp_simulate_dumps(tmp_path, fault):
    from dcptool.check.replay import replay
    from dcptool.check.slots import check_slot_rules
    from dcptool.model.config import FAULTS
    from dcptool.model.simulate import SimConfig, simulate

    cfg = SimConfig(dcp=4, interleave=2, pcp=2, steps=6, dummy_every=3, max_num_reqs=16, token_budget=1024,
                    inject=() if fault is None else (fault,))
    res = simulate(cfg, tmp_path / "pcp.safetensors")
    d = open_dumps(res.files)
    offs = d["obs.slots"]
    assert d.config.pcp_size == 2 and (d["rows.slot_mapping"] >= 0).any()
    assert {d.site_name(i) for i in np.flatnonzero(np.diff(offs) > 0)} >= {"pcp_partition", "ubatch"}
    found = check_slot_rules(d)
    rr = replay(d, "torch")
    assert not {"slots", "slot-partition"} & set(rr.skipped)
    if fault is None:
        assert found == [] and rr.findings == []
        return
    rule = FAULTS[fault][0]
    touched = set(res.faults[fault].touched[res.files[0]])
    assert touched and set(found.index[found.rule == rule].tolist()) == touched  # exactly where the fault touched
    assert {f.obs for f in rr.findings if f.rule == rule} == touched
