"""ranks.py: the rules across the ranks of one batch: rank-sum (local lengths add up), rank-agree (what every rank
must share), ctx-agree (the same chunked-context schedule) and topk-agree (the same sparse top-k sets), on hand-built
dumps and against the rules as loops."""

import json

import numpy as np
import pytest
from conftest import obs, rules, run, write
from test_decode import _batch, _dump

from dcptool.check.ranks import check_ctx_agree, check_rank_agree, check_topk_agree
from dcptool.check.replay import replay
from dcptool.dcp import chunks as C
from dcptool.dcp import topk as TK
from dcptool.dcp.reference import local_np
from dcptool.dump import Dump, open_dumps, read_dump


def test_rank_sum_at_the_observation_completing_the_set(tmp_path):
    seq = np.array([101, 7, 0], np.int32)
    o = [obs(rank=r, seq=seq, num_reqs=2, num_reqs_padded=3, dcp=4) for r in range(4)]
    assert run(tmp_path, o, dcp=4).findings == []
    o[1].dcp_local_seq_lens = np.array([30, 2, 0], np.int32)  # 25 expected
    res = run(tmp_path, o, dcp=4)
    assert rules(res) == [(1, "mismatch"), (3, "rank-sum")]
    rs = res.findings[1]
    assert (rs.row, rs.recorded, rs.expected) == (0, 106, 101)
    assert rs.detail == {"obs": [0, 1, 2, 3]}


def test_rank_sum_needs_all_ranks(tmp_path):
    seq = np.array([101, 7, 0], np.int32)
    o = [obs(rank=r, seq=seq, num_reqs=2, num_reqs_padded=3, dcp=4) for r in range(3)]
    o[1].dcp_local_seq_lens = np.array([30, 2, 0], np.int32)
    assert rules(run(tmp_path, o, dcp=4)) == [(1, "mismatch")]


# --------------------------------------------------------------------------------------------
# rank-sum, vectorised with the same joins: against the rule as loops


def naive_rank_sum(d: Dump, wrong: set[int]) -> list[tuple[int, int, int, tuple[int, ...]]]:
    """(observation, first bad row, wrong rows, member obs) per docs/replay.md's `rank-sum`, as loops."""
    N, out, done = d.config.dcp_size, [], set()
    key = [(int(d["obs.step"][i]), int(d["obs.site"][i]), int(d["obs.ubatch"][i]), int(d["obs.num_reqs"][i]))
           for i in range(d.n)]
    for w in sorted(wrong):
        nr = key[w][3]
        seq = d.seq_lens_of(w)[:nr]
        by_rank: dict[int, list[int]] = {}
        for m in range(d.n):
            if key[m] == key[w] and d["obs.has_dcp"][m] and np.array_equal(d.seq_lens_of(m)[:nr], seq):
                by_rank.setdefault(int(d["obs.rank"][m]), []).append(m)
        k = by_rank[int(d["obs.rank"][w])].index(w)
        if len(by_rank) < N or any(len(v) <= k for v in by_rank.values()):
            continue
        group = tuple(sorted(v[k] for v in by_rank.values()))
        if group in done:
            continue
        done.add(group)
        n = min(min(d.dcp_of(m).size for m in group), nr)
        total = sum(d.dcp_of(m)[:n].astype(np.int64) for m in group)
        bad = np.flatnonzero(total != seq[:n])
        if bad.size:
            out.append((group[-1], int(bad[0]), int(bad.size), group))
    return out


@pytest.mark.parametrize("collide", [False, True], ids=["hashes", "salt-0-collides"])
@pytest.mark.parametrize("seed", range(15))
def test_rank_sum_agrees_with_the_rule_as_loops(tmp_path, monkeypatch, seed, collide):
    """`salt-0-collides`: the first hash is 0 for every row, so every batch of one (step, site, ubatch, num_reqs)
    shares it and members fail the exact confirmation: rank-sum takes the second hash, same findings."""
    if collide:
        import dcptool.check.ranks as ranks
        from dcptool.dcp.segments import mix

        monkeypatch.setattr(ranks, "mix", lambda v, j, salt: mix(v, j, salt) * np.uint64(salt != 0))
    rng = np.random.default_rng(100 + seed)
    N = int(rng.choice([2, 3, 4]))
    batches = [(int(rng.integers(0, 3)), int(rng.integers(0, 2)), rng.integers(1, 40, int(rng.integers(1, 4))))
               for _ in range(6)]
    o = []
    for _ in range(int(rng.integers(10, 50))):
        step, site, seq = batches[int(rng.integers(0, len(batches)))]
        rank = int(rng.integers(0, N))
        nr = seq.size
        view = local_np(seq, N, rank, 1).astype(np.int32)
        if rng.random() < 0.3:
            view[int(rng.integers(0, nr))] += int(rng.choice([-1, 1, 5]))
        if rng.random() < 0.1:
            view = view[:-1]
        o.append(obs(step=step, site=f"s{site}", rank=rank, seq=seq, num_reqs=nr, num_reqs_padded=nr, dcp=N,
                     view=view))
    o.sort(key=lambda x: x.step)
    d = open_dumps([write(tmp_path / "d.safetensors", o, dcp=N)])
    res = replay(d, "torch")
    got = [(f.index, f.row, f.wrong_rows, tuple(sorted(f.detail["obs"]))) for f in res.findings if f.rule == "rank-sum"]
    wrong = {f.index for f in res.findings if f.rule in ("stale", "global", "wrong-rank", "wrong-interleave",
                                                         "mismatch")}
    assert sorted(got) == sorted(naive_rank_sum(d, wrong))


# --------------------------------------------------------------------------------------------
# rank-agree


def test_rank_agree_names_the_differing_ranks_once_per_batch():
    base = _batch(3, 1, [9, 5, 30], 4, [0, 1, 2, 3, 3], 4, 3)
    assert check_rank_agree(_dump(base, 3)) == []
    cases = {"seq_lens": lambda x: setattr(x, "seq_lens", np.array([9, 6, 30, 0])),
             "num_reqs_padded": lambda x: setattr(x, "num_reqs_padded", 5) or setattr(
                 x, "seq_lens", np.array([9, 5, 30, 0, 0])) or setattr(x, "dcp_local_seq_lens", np.pad(
                     x.dcp_local_seq_lens, (0, 1))) or setattr(x, "query_start_loc", np.array([0, 1, 2, 3, 3, 3])),
             "query_start_loc": lambda x: setattr(x, "query_start_loc", np.array([0, 1, 2, 3, 4])),
             "num_tokens_padded": lambda x: setattr(x, "num_tokens_padded", 8),
             "graph": lambda x: setattr(x, "graph", 0),
             "num_reqs": lambda x: setattr(x, "num_reqs", 2)}
    for field, change in cases.items():
        o = _batch(3, 1, [9, 5, 30], 4, [0, 1, 2, 3, 3], 4, 3)
        change(o[2])  # the majority (ranks 0, 1) is the reference
        got = check_rank_agree(_dump(o, 3))
        assert [(i.index, i.detail["field"], i.detail["ranks"]) for i in got] == [
            (2, field, [2])], field
        assert "rank 2" in got[0].text
    # two ranks of three differ: one finding, at the first of them, naming both
    o = _batch(3, 1, [9, 5, 30], 4, [0, 1, 2, 3, 3], 4, 3) + _batch(3, 1, [9, 5, 30], 4, [0, 1, 2, 3, 3], 4, 3, step=2)
    o[4].seq_lens = np.array([9, 6, 30, 0])
    o[5].num_tokens_padded = 8
    got = check_rank_agree(_dump(o, 3))
    assert [(i.index, i.detail["ranks"]) for i in got] == [(4, [1, 2])]
    assert got[0].detail["fields"] == {"1": "seq_lens", "2": "num_tokens_padded"}
    # N=2 tie: the lower rank's values are the reference
    o = _batch(2, 1, [9, 5], 2, [0, 1, 2], 2, 0)
    o[0].seq_lens = np.array([9, 4])
    assert [i.index for i in check_rank_agree(_dump(o, 2))] == [1]
    # different batches at different steps or sites are not compared
    o = _batch(2, 1, [9, 5], 2, [0, 1, 2], 2, 0) + _batch(2, 1, [8, 3], 2, [0, 1, 2], 2, 0, step=2)
    o[2].site = o[3].site = "draft"
    assert check_rank_agree(_dump(o, 2)) == []


def _agree_text(N: int, seqs: dict[int, list[int]]) -> list[tuple[int, str]]:
    """rank-agree on one batch of N ranks whose rank r holds seq_lens seqs[r] (the rest [9, 5])."""
    o = _batch(N, 1, [9, 5], 2, [0, 1, 2], 2, 0)
    for r, seq in seqs.items():
        o[r].seq_lens = np.array(seq)
    return [(i.index, i.text) for i in check_rank_agree(_dump(o, N))]


SHARE = "ranks disagree on what every rank of this batch must share: "


def test_rank_agree_says_when_the_ranks_split_evenly():
    """Hardening 8c: with the ranks split evenly no values are the majority's; the lowest rank's are the reference
    only as the lowest, and the message says so (it said "and the majority have")."""
    assert _agree_text(2, {0: [9, 4]}) == [(1, SHARE + "rank 1 seq_lens [9, 5]; the ranks split evenly, so the "
                                           "lowest rank's values are the reference: rank 0 (obs t:0) has seq_lens "
                                           "[9, 4] (ranks 1 differ)")]
    assert _agree_text(4, {2: [9, 4], 3: [9, 4]}) == [(2, SHARE + "rank 2 seq_lens [9, 4]; rank 3 seq_lens [9, 4]; "
                                                        "the ranks split evenly, so the lowest rank's values are the "
                                                        "reference: rank 0 (obs t:0) has seq_lens [9, 5] (ranks 2, 3 "
                                                        "differ)")]
    (f,) = _agree_text(3, {1: [9, 4], 2: [9, 3]})  # three ways, one rank each
    assert "the ranks split evenly" in f[1] and "majority" not in f[1]


def test_rank_agree_names_a_real_majority_and_a_largest_group_short_of_one():
    assert _agree_text(3, {0: [9, 4]}) == [(0, SHARE + "rank 0 seq_lens [9, 4]; rank 1 (obs t:1) and the majority have "
                                           "seq_lens [9, 5] (ranks 0 differ)")]
    assert _agree_text(4, {3: [9, 4]}) == [(3, SHARE + "rank 3 seq_lens [9, 4]; rank 0 (obs t:0) and the majority have "
                                           "seq_lens [9, 5] (ranks 3 differ)")]
    # 2 of 4 alike, the other two differing each its own way: the largest group, not a majority
    assert _agree_text(4, {2: [9, 4], 3: [9, 3]}) == [(2, SHARE + "rank 2 seq_lens [9, 4]; rank 3 seq_lens [9, 3]; "
                                                       "rank 0 (obs t:0) and the largest group (2 of 4 ranks) have "
                                                       "seq_lens [9, 5] (ranks 2, 3 differ)")]


@pytest.mark.parametrize("seed", range(3))
def test_rank_agree_with_the_scans_pairs_equals_reading_the_rows_itself(monkeypatch, seed):
    """replay hands check_rank_agree the scan's comparison of each member with the one before it; the findings
    are the standalone check's, whatever the chunking (pairs across chunk edges), and the planted ones."""
    from dcptool.check import scan as scan_mod
    from dcptool.check.ranks import rank_pairs

    rng = np.random.default_rng(seed)
    o, planted = [], set()
    for step in range(40):
        n = int(rng.choice([1, 2, 5, 40]))
        b = _batch(3, 1, rng.integers(1, 50, n), n + 1, np.arange(n + 2).clip(0, n), n + 1, 3, step=step)
        if rng.random() < 0.3:
            k = int(rng.integers(0, 3))
            b[k].seq_lens = b[k].seq_lens.copy()
            b[k].seq_lens[int(rng.integers(0, n))] += 1
            planted.add((step, k))
        o += b
    d = _dump(o, 3)
    want = check_rank_agree(d)
    assert {(i.index // 3, i.detail["ranks"][0]) for i in want} == planted and planted
    pairs = rank_pairs(d)
    for target in (1, 7, 64, 1 << 18):
        monkeypatch.setattr(scan_mod, "CHUNK_ROWS", target)
        got = check_rank_agree(d, pairs, scan_mod.scan(d, "torch", pairs=pairs.prev).differ)
        assert got == want, target


def test_rank_agree_in_replay_output_names_the_rule(tmp_path):
    from conftest import cli

    o = _batch(2, 1, [9, 5], 2, [0, 1, 2], 2, 0)
    o[1].seq_lens = np.array([9, 6])
    o[1].dcp_local_seq_lens = np.array([4, 3])
    o[1].dcp_tot_seq_lens = np.array([9, 6])
    p = write(tmp_path / "d.safetensors", o)
    r = cli("replay", p)
    assert r.returncode == 1 and "rank-agree" in r.stdout and "rank 1 seq_lens [9, 6]" in r.stdout
    r = cli("replay", p, "--json")
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [(x["rule"], x["obs"], x["detail"]["ranks"]) for x in lines if x["type"] == "finding"] == [
        ("rank-agree", 1, [1])]
    assert lines[-1]["by_rule"] == {"rank-agree": 1}


def test_rank_agree_row_compare_and_hashes_do_not_depend_on_the_chunking(rng):
    from dcptool.check.ranks import _row_hashes
    from dcptool.check.scan import rows_differ

    o = [obs(step=k // 2, rank=k % 2, seq=rng.integers(0, 3, int(rng.integers(0, 4))).astype(np.int32),
             num_reqs=0, num_reqs_padded=0, view=[]) for k in range(60)]
    d = _dump(o, 2)
    other = rng.integers(0, d.n, d.n)
    want = np.array([not np.array_equal(d.seq_lens_of(i), d.seq_lens_of(other[i])) for i in range(d.n)])
    idx = np.arange(d.n)
    whole = _row_hashes(d, "obs.rows", "rows.seq_lens", idx)
    assert np.array_equal(whole == whole[other], ~want | (whole == whole[other]))  # equal rows: equal hashes
    for step in (1, 3, 17, 1 << 22):
        assert np.array_equal(rows_differ(d, "obs.rows", "rows.seq_lens", idx, other, step), want), step
        assert np.array_equal(_row_hashes(d, "obs.rows", "rows.seq_lens", idx, step), whole), step
    # a trailing 0 changes the hash (the length is compared beside it too)
    d = _dump([obs(seq=[3, 0], num_reqs=1, num_reqs_padded=2), obs(seq=[3, 1], num_reqs=1, num_reqs_padded=2)], 2)
    h = _row_hashes(d, "obs.rows", "rows.seq_lens", np.arange(2))
    assert h[0] != h[1]


@pytest.mark.parametrize("bulk", [1, 200, 5000])
def test_rank_sum_in_blocks_of_steps_finds_what_one_block_finds(tmp_path, monkeypatch, bulk):
    """rank-sum adds up the batches of its wrong observations in blocks of whole steps (BULK_ROWS rows each, so a
    recording wrong everywhere is not added up at once): any block size gives the same findings."""
    from dcptool.check import ranks
    from dcptool.check.scan import scan
    from dcptool.model.simulate import SimConfig, simulate

    p = tmp_path / "legacy.safetensors"
    simulate(SimConfig(dcp=4, steps=30, pipeline="legacy", seed=5), p)
    d = read_dump(p)
    st = scan(d, "torch")
    wrong = st.obs[st.n_wrong > 0]
    want = [f.to_json() for f in ranks.check_rank_sum(d, wrong)]
    assert want
    monkeypatch.setattr(ranks, "BULK_ROWS", bulk)
    assert len(ranks._step_blocks(d, np.unique(wrong))) > (1 if bulk < 5000 else 0)
    assert [f.to_json() for f in ranks.check_rank_sum(d, wrong)] == want


# --------------------------------------------------------------------------------------------
# ctx-agree


def _ctx_batches(N: int, steps: int, seed: int):
    """steps batches of N ranks, each with one prefill row of random context after a decode row; every rank's
    schedule vLLM's plan of the batch's context (workspace 256: long contexts take several chunks)."""
    rng = np.random.default_rng(seed)
    out, plans = [], []
    for step in range(steps):
        ctx = int(rng.choice([0, 1, 3, 127, 128, 129, 1000]))
        o = _batch(N, 1, [9, ctx + 5], 2, [0, 1, 6], 6, 0, step=step)
        s = C.encode(*C.plan_chunks([ctx], 256, 16, N, 1), [1])
        for x in o:
            x.ctx_chunks = s
        out += o
        plans.append(ctx)
    return out, plans


@pytest.mark.parametrize("N", [2, 3, 4])
def test_ctx_agree_names_the_rank_that_plans_other_gathers(N):
    """The schedules of one batch's ranks must be equal: a clean run is silent; a rank that planned from its own
    share of the context (vLLM #53573's rank-local metadata) is named once per batch, with the gathers each calls;
    a rank that called none (chunked_context None) is said to."""
    o, ctx = _ctx_batches(N, 30, N)
    assert check_ctx_agree(_dump(o, N)) == []
    planted = []
    for step, c in enumerate(ctx):
        x = o[step * N + N - 1]
        mine = int(local_np(np.array([c]), N, N - 1, 1)[0])
        x.ctx_chunks = C.encode(*C.plan_chunks([mine], 256, 16, N, 1), [1])
        if not np.array_equal(x.ctx_chunks, o[step * N].ctx_chunks):
            planted.append((step * N + N - 1, mine))
    got = check_ctx_agree(_dump(o, N))
    assert [(f.index, f.detail["ranks"]) for f in got] == [(i, [N - 1]) for i, _ in planted] and planted
    for f, (_, mine) in zip(got, planted):
        assert ("calls no DCP KV gather" in f.text) == (mine == 0)
        assert f.detail["gathers"] == {str(N - 1): C.gathers(o[f.index].ctx_chunks, N, 1)}


def test_ctx_agree_compares_only_the_ranks_that_recorded_a_schedule():
    o, _ = _ctx_batches(3, 2, 0)
    o[1].ctx_chunks = None  # rank 1 of step 0 recorded none: unknown, not a disagreement
    o[5].ctx_chunks = np.array([0])  # rank 2 of step 1 has no chunked context: it calls no gather
    got = check_ctx_agree(_dump(o, 3))
    want = [] if np.array_equal(o[3].ctx_chunks, [0]) else [(5, [2])]
    assert [(f.index, f.detail["ranks"]) for f in got] == want


def test_ctx_agree_in_replay(tmp_path):
    o = _batch(2, 1, [9, 505], 2, [0, 1, 6], 6, 0, Q=[0, 1])  # a decode, then a prefill of 5 tokens on 500 of context
    o[0].ctx_chunks = C.encode(*C.plan_chunks([500], 256, 16, 2, 1), [1])
    o[1].ctx_chunks = np.array([0])
    p = write(tmp_path / "c.safetensors", o)
    res = replay(open_dumps([p]), "torch")
    assert [(f.rule, f.obs) for f in res.findings] == [("ctx-agree", 1)]
    assert "rank 1 calls no DCP KV gather (no chunked context); the ranks split evenly" in res.findings[0].message
    assert "rank 0 (obs " in res.findings[0].message and "has a schedule that calls 2 DCP KV gathers of [128, 122] " \
        "local rows" in res.findings[0].message


# --------------------------------------------------------------------------------------------
# topk-agree: the ranks' sparse top-k sets


def _topk_batches(N: int, I: int, steps: int, seed: int, lowest_on=None):
    """steps batches of N ranks: a decode row and a prefill row, every query token's top-k row recorded (dcp.topk's
    model indexer: fingerprint, the rank's share, the state it asks for); `lowest_on`: the (step, rank) pairs whose
    rank breaks the tie at the k-th score the other way."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        ctx = int(rng.choice([0, 1, 127, 128, 129, 2047, 2048, 2049, 5000]))
        o = _batch(N, I, [int(rng.integers(1, 9000)), ctx + 5], 2, [0, 1, 6], 6, 0, step=step)
        seq = o[0].seq_lens.astype(np.int64)
        t = np.arange(6)
        L = np.r_[seq[0], seq[1] - 4 + t[1:] - 1]  # each token's position + 1
        for r, x in enumerate(o):
            ids = TK.model_ids(TK.model_bounds(L, lowest=(step, r) not in (lowest_on or ())))
            own = TK.owned(ids, r, N, I)
            x.sparse_topk = np.stack([TK.fingerprint(ids), own, np.where(own == 0, TK.EMPTY_STATE, 0)], 1).ravel()
        out += o
    return out


@pytest.mark.parametrize("N, I", [(2, 1), (3, 1), (4, 16)])
def test_topk_agree_names_the_rank_that_breaks_ties_another_way(N, I):
    """A clean run (every rank the same sets, each its own share) is silent; a rank that breaks the tie at the k-th
    score another way is named once per batch where a token's context is longer than k (shorter ones tie nothing),
    with its first differing token."""
    o = _topk_batches(N, I, 30, N)
    assert check_topk_agree(_dump(o, N, I)) == []
    odd = {(s, N - 1) for s in range(30)}
    o = _topk_batches(N, I, 30, N, lowest_on=odd)
    got = check_topk_agree(_dump(o, N, I))
    want = []
    for s in range(30):
        L_long = (o[s * N].seq_lens[:2] > TK.TOPK).any()
        if L_long:
            want.append((s * N + N - 1, [N - 1]))
    assert [(f.index, f.detail["ranks"]) for f in got] == want and want
    f = got[0]
    fp = [o[f.index].sparse_topk[::3], o[f.index - 1].sparse_topk[::3]]
    assert f.detail["tokens"] == {str(N - 1): int(np.flatnonzero(fp[0] != fp[1])[0])}
    assert "top-k sets" in f.text and f"rank {N - 1} from query token" in f.text


@pytest.mark.parametrize("rows", [1, 5, 127])
def test_topk_agree_hashes_the_fingerprints_in_chunks_as_in_one(monkeypatch, rows):
    """The fingerprints (every third value) are hashed a chunk of observations at a time: chunks of a few rows
    find what one chunk finds."""
    from dcptool.check import ranks
    from dcptool.dcp import segments

    o = _topk_batches(4, 16, 30, 4, lowest_on={(s, 3) for s in range(0, 30, 3)})
    whole = check_topk_agree(_dump(o, 4, 16))
    monkeypatch.setattr(ranks, "obs_chunks", lambda lens, step: segments.obs_chunks(lens, rows))
    got = check_topk_agree(_dump(o, 4, 16))
    assert [(f.index, f.detail) for f in got] == [(f.index, f.detail) for f in whole] and whole


def test_topk_agree_compares_only_the_ranks_that_recorded_sets(tmp_path):
    o = _topk_batches(3, 1, 2, 7, lowest_on={(0, 1)})
    o[1].sparse_topk = None  # rank 1 of step 0 recorded none: unknown, not a disagreement
    assert check_topk_agree(_dump(o, 3)) == []
    o = _batch(2, 1, [5000, 25], 2, [0, 1, 6], 6, 0, Q=[0, 1])  # a decode on 5000 positions: its k-th score ties
    for r, x in enumerate(o):
        ids = TK.model_ids(TK.model_bounds(np.r_[5000, np.arange(21, 26)], lowest=r == 0))
        x.sparse_topk = np.stack([TK.fingerprint(ids), TK.owned(ids, r, 2, 1), np.zeros(6, np.int64)], 1).ravel()
    res = replay(open_dumps([write(tmp_path / "t.safetensors", o)]), "torch")
    assert [(f.rule, f.obs) for f in res.findings] == [("topk-agree", 1)]
    assert "rank 1 from query token 0 (1 of 6 tokens differ); the ranks split evenly" in res.findings[0].message
    d1 = open_dumps([write(tmp_path / "one.safetensors", _topk_batches(1, 1, 2, 1), dcp=1)])
    assert replay(d1, "torch").skipped.get("topk-agree") == "dcp_size is 1"
    d0 = open_dumps([write(tmp_path / "none.safetensors", _batch(2, 1, [9, 20], 2, [0, 1, 6], 6, 0, Q=[0, 1]))])
    assert "topk-agree" not in replay(d0, "torch").skipped  # (a feature the dump does not have)
