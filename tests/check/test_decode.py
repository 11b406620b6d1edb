"""decode.py: the decode path's empty-shard mask (empty-mask) and global companion (tot-lens) on hand-built batches,
against vLLM's own mask (an oracle file) and a reference reading of the rule."""

import json

import numpy as np
from conftest import ROOT, obs, rules, run

from dcptool.check.decode import check_empty_mask, check_tot_lens, decode_counts, lse_mask
from dcptool.check.ranks import check_rank_agree
from dcptool.dcp.reference import local_np
from dcptool.dump import Dump, DumpConfig, Observation, pack
from dcptool.dump.schema import validate_columns


def _dump(observations, N, I=1) -> Dump:
    cfg, cols = pack(observations, DumpConfig(dcp_size=N, cp_interleave=I))
    validate_columns("t", cfg, cols)
    n = len(observations)
    return Dump(files=["t"], config=cfg, columns=cols, file_index=np.zeros(n, np.int32),
                file_obs=np.arange(n, dtype=np.int64))


def _batch(N, I, seq, nrp, qsl, ntp, graph, step=1, Q=None):
    """One decode batch on every rank, as the FlashInfer DCP decode path receives it (Q = qsl prefix)."""
    seq = np.zeros(nrp, np.int64) + np.pad(np.asarray(seq), (0, nrp - len(seq)))
    nr = int(np.count_nonzero(seq))
    qsl = np.asarray(qsl)
    Q = qsl if Q is None else np.asarray(Q)
    out = []
    for r in range(N):
        S = np.zeros(nrp, np.int64)
        S[:nr] = local_np(seq[:nr], N, r, I)
        out.append(Observation(step=step, site="attn_metadata", rank=r, num_reqs=nr, num_reqs_padded=nrp,
                               seq_lens=seq, dcp_local_seq_lens=S, query_start_loc=qsl, num_tokens_padded=ntp,
                               graph=graph, dcp_query_start_loc=Q, dcp_tot_seq_lens=seq[: Q.size - 1]))
    return out


def _masked(o: Observation, rows: int) -> list[int]:
    q = o.dcp_query_start_loc
    return np.flatnonzero(lse_mask(q, o.dcp_local_seq_lens[: q.size - 1], rows)).tolist()


def _em(d):
    return [(i.index, i.detail["field"]) for i in check_empty_mask(d)]


def test_empty_mask_worked_example_eager_n2_i16():
    """Computed by vLLM 0.33.0 and 0.34.0: N=2, I=16, eager, seq_lens [7,40,16,17]."""
    o = _batch(2, 16, [7, 40, 16, 17], 4, [0, 1, 2, 3, 4], 4, 0)
    assert o[0].dcp_query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert [x.dcp_local_seq_lens.tolist() for x in o] == [[7, 24, 16, 16], [0, 16, 0, 1]]
    assert [_masked(x, 4) for x in o] == [[], [0, 2]]
    assert np.flatnonzero(lse_mask(np.arange(5), np.array([7, 40, 16, 17]), 4)).tolist() == []  # global: nothing
    d = _dump(o, 2, 16)
    assert check_empty_mask(d) == [] and check_rank_agree(d) == [] and check_tot_lens(d) == []
    # broken Q: rank-local (rank 1 drops its empty shards' query tokens)
    bad = _batch(2, 16, [7, 40, 16, 17], 4, [0, 1, 2, 3, 4], 4, 0)
    bad[1].dcp_query_start_loc = np.array([0, 0, 1, 1, 2])
    got = check_empty_mask(_dump(bad, 2, 16))
    assert [(i.index, i.detail["field"]) for i in got] == [(1, "dcp_query_start_loc")]
    assert got[0].row == 1 and got[0].recorded == 0 and got[0].expected == 1
    assert got[0].detail["expected_masked"] == [0, 2] and got[0].detail["masked"] != [0, 2]
    # broken S: global lengths on rank 1 mask nothing where rows 0 and 2 must be masked
    bad = _batch(2, 16, [7, 40, 16, 17], 4, [0, 1, 2, 3, 4], 4, 0)
    bad[1].dcp_local_seq_lens = np.array([7, 40, 16, 17])
    got = check_empty_mask(_dump(bad, 2, 16))
    assert [(i.index, i.detail["field"]) for i in got] == [(1, "mask")]
    assert got[0].detail["masked"] == [] and got[0].detail["expected_masked"] == [0, 2]
    assert "all_ranks_masked" not in got[0].detail


def test_empty_mask_worked_example_full_graph_n4_i4():
    """N=4, I=4, FULL graph, seq_lens [5,20,3] padded to 4 requests / 4 tokens."""
    o = _batch(4, 4, [5, 20, 3], 4, [0, 1, 2, 3, 3], 4, 3)
    assert o[0].dcp_query_start_loc.tolist() == [0, 1, 2, 3, 3]  # num_decodes 4: the padded row is a decode
    assert [x.dcp_local_seq_lens.tolist() for x in o] == [[4, 8, 3, 0], [1, 4, 0, 0], [0, 4, 0, 0], [0, 4, 0, 0]]
    assert [_masked(x, 4) for x in o] == [[3], [2, 3], [0, 2, 3], [0, 2, 3]]
    d = _dump(o, 4, 4)
    assert check_empty_mask(d) == [] and check_rank_agree(d) == [] and check_tot_lens(d) == []
    # broken Q: the padded row not counted as a decode (num_decodes 3)
    bad = _batch(4, 4, [5, 20, 3], 4, [0, 1, 2, 3, 3], 4, 3, Q=[0, 1, 2, 3])
    got = check_empty_mask(_dump(bad, 4, 4))
    assert [(i.index, i.detail["field"]) for i in got] == [(k, "num_decodes") for k in range(4)]
    assert got[0].recorded == 3 and got[0].expected == 4
    # broken S: rank 2 holds rank 1's lengths, so it keeps row 0 it must mask
    bad = _batch(4, 4, [5, 20, 3], 4, [0, 1, 2, 3, 3], 4, 3)
    bad[2].dcp_local_seq_lens = np.array([1, 4, 0, 0])
    got = check_empty_mask(_dump(bad, 4, 4))
    assert [(i.index, i.detail["field"]) for i in got] == [(2, "mask")]
    assert got[0].detail["masked"] == [2, 3] and got[0].detail["expected_masked"] == [0, 2, 3]


def test_empty_mask_row_masked_on_every_rank_is_named(tmp_path):
    """Every real row must be unmasked on at least one rank: rank 0 zeroing request 0 leaves row 0 to nobody."""
    o = _batch(2, 16, [7, 40, 16, 17], 4, [0, 1, 2, 3, 4], 4, 0)
    o[0].dcp_local_seq_lens = np.array([0, 24, 16, 16])
    got = check_empty_mask(_dump(o, 2, 16))
    assert [(i.index, i.detail["field"]) for i in got] == [(0, "mask")]
    assert got[0].detail["all_ranks_masked"] == [0] and "every rank" in got[0].text
    # through replay: the view's own rule first (the rule table's order), then empty-mask
    res = run(tmp_path, o, dcp=2, il=16)
    assert rules(res) == [(0, "mismatch"), (0, "empty-mask"), (1, "rank-sum")]


def test_empty_mask_q_checks_and_short_view():
    base = dict(N=2, I=1, seq=[9, 5], nrp=2, qsl=[0, 1, 2], ntp=2, graph=0)
    for Q, field in (([1, 1, 2], "dcp_query_start_loc"), ([0, 2, 1], "dcp_query_start_loc")):
        o = _batch(**base, Q=Q)
        assert _em(_dump(o, 2)) == [(0, field), (1, field)], Q
    o = _batch(**base)
    o[0].dcp_local_seq_lens = np.array([5])  # shorter than num_decodes: vLLM raises in the mask
    assert _em(_dump(o, 2)) == [(0, "seq_lens")]
    # a mixed batch: decodes end at the first query longer than 1
    o = _batch(2, 1, [9, 5, 30], 3, [0, 1, 2, 12], 12, 0, Q=[0, 1, 2])
    assert _em(_dump(o, 2)) == []
    o = _batch(2, 1, [9, 5, 30], 3, [0, 1, 2, 12], 12, 0, Q=[0, 1, 2, 12])
    assert _em(_dump(o, 2)) == [(0, "num_decodes"), (1, "num_decodes")]
    # the builder's num_reqs is num_reqs_padded under a FULL graph: there the real count alone is wrong;
    # outside one either count is accepted (eager builds see num_reqs, a drafter's padded batch the padded one)
    o = _batch(2, 1, [9, 5], 3, [0, 1, 2, 2], 2, 3, Q=[0, 1, 2])
    assert _em(_dump(o, 2)) == [(0, "num_decodes"), (1, "num_decodes")]
    for Q in ([0, 1, 2], [0, 1, 2, 2]):
        assert _em(_dump(_batch(2, 1, [9, 5], 3, [0, 1, 2, 2], 2, 0, Q=Q), 2)) == []
    # no query_start_loc recorded: Q checked on its own (starts at 0, never decreases), the mask from Q
    o = _batch(**base)
    for x in o:
        x.query_start_loc = None
    assert _em(_dump(o, 2)) == []
    o[1].dcp_query_start_loc = np.array([0, 2, 1])
    assert _em(_dump(o, 2)) == [(1, "dcp_query_start_loc")]


def test_lse_mask_and_decode_split_are_vllms():
    """tests/data/empty_mask_oracle.json: vLLM 0.34.0's mask_dcp_empty_shards_ and split_decodes_and_prefills
    (threshold 1, require_uniform both ways) on seeded random batches (make_empty_mask_oracle.py; 0.33.0's
    mask agrees)."""
    o = json.loads((ROOT / "tests" / "data" / "empty_mask_oracle.json").read_text())
    for c in o["mask"]:
        assert np.flatnonzero(lse_mask(np.array(c["q"]), np.array(c["s"]), c["rows"])).tolist() == c["masked"], c
    obs_ = [Observation(step=0, site="a", rank=0, num_reqs=len(c["ql"]), num_reqs_padded=len(c["ql"]),
                        seq_lens=np.full(len(c["ql"]), 5), dcp_local_seq_lens=None,
                        query_start_loc=np.concatenate([[0], np.cumsum(c["ql"])])) for c in o["split"]]
    d = _dump(obs_, 2)
    a, b = decode_counts(d, np.arange(d.n), np.array([len(c["ql"]) for c in o["split"]]))
    assert a.tolist() == [c["a"] for c in o["split"]] and b.tolist() == [c["b"] for c in o["split"]]


def _reference_empty_mask(d: Dump) -> set[int]:
    """Per observation, in plain Python: the observations check_empty_mask must flag."""
    c = d.config
    out = set()
    for i in range(d.n):
        Q = d.dqsl_of(i).astype(np.int64)
        if Q.size == 0:
            continue
        nd = Q.size - 1
        qsl = d.qsl_of(i).astype(np.int64)
        nr, nrp = int(d["obs.num_reqs"][i]), int(d["obs.num_reqs_padded"][i])
        fits = set()
        for R in ((nrp,) if d["obs.graph"][i] >= 2 else (nrp, nr)):  # the builder's num_reqs (FULL: padded)
            ql = np.diff(qsl[: R + 1])
            a = next((j for j in range(R) if ql[j] > 1), R)
            b = a if not (R and ql[0] == 0 and a < R) else next(j for j in range(R) if ql[j] >= 1)
            fits |= {(a, R), (b, R)}
        R = next((r for x, r in fits if x == nd), None)
        if Q[0] != 0 or (np.diff(Q) < 0).any() or R is None or not np.array_equal(Q, qsl[: nd + 1]):
            out.add(i)
            continue
        view = d.dcp_of(i)
        if view.size < nd:
            out.add(i)
            continue
        seq = d.seq_lens_of(i).astype(np.int64)
        exp = np.array([local_np(seq[j], c.dcp_size, int(d["obs.rank"][i]), c.cp_interleave) if j < nr else 0
                        for j in range(nd)], np.int64)
        T = max(int(d["obs.num_tokens_padded"][i]), int(qsl[nd])) if nd == R else int(qsl[nd])
        if not np.array_equal(lse_mask(Q, view[:nd], T), lse_mask(Q, exp, T)):
            out.add(i)
    return out


def test_empty_mask_seeded_random_matches_reference(rng):
    """Random decode/mixed batches on every rank with random corruptions of Q and S; the vectorised check
    flags exactly what the per-observation reference (vLLM's mask, spelled out) flags."""
    for trial in range(6):
        N, I = int(rng.choice([2, 3, 4])), int(rng.choice([1, 2, 16]))
        o = []
        for step in range(25):
            nr = int(rng.integers(1, 7))
            nrp = nr + int(rng.integers(0, 3))
            ql = np.concatenate([np.sort(rng.choice([1, 1, 1, 5], nr)), np.zeros(nrp - nr, np.int64)])
            qsl = np.concatenate([[0], np.cumsum(ql)])
            seq = np.concatenate([rng.integers(1, 3 * N * I, nr) + ql[:nr], np.zeros(nrp - nr, np.int64)])
            graph = int(rng.choice([0, 3])) if nrp == nr else 3  # requests are padded for FULL graphs only
            R = nrp if graph == 3 else nr
            nd = next((j for j in range(R) if ql[j] > 1), R)
            batch = _batch(N, I, seq[:nr].tolist(), nrp, qsl, int(qsl[-1]) + int(rng.integers(0, 3)), graph,
                           step=step, Q=qsl[: nd + 1])
            for x in batch:
                x.seq_lens = seq
                u = rng.random()
                if u < 0.1 and x.dcp_query_start_loc.size > 1:
                    q = x.dcp_query_start_loc.copy()
                    q[rng.integers(1, q.size)] += int(rng.choice([-1, 1]))
                    x.dcp_query_start_loc = q
                elif u < 0.25:
                    v = x.dcp_local_seq_lens.copy()
                    v[rng.integers(0, nrp)] = int(rng.choice([0, 1, 7]))
                    x.dcp_local_seq_lens = v
                elif u < 0.3:
                    x.dcp_query_start_loc = x.dcp_query_start_loc[:-1] if x.dcp_query_start_loc.size > 1 else \
                        x.dcp_query_start_loc
            o += batch
        d = _dump(o, N, I)
        assert {i.index for i in check_empty_mask(d)} == _reference_empty_mask(d), trial


def test_tot_lens_triggers_on_local_companion_not_on_global(tmp_path):
    o = _batch(2, 1, [9, 5, 30], 4, [0, 1, 2, 3, 3], 4, 3)
    assert check_tot_lens(_dump(o, 2)) == []
    o[1].dcp_tot_seq_lens = o[1].dcp_local_seq_lens[:4]
    got = check_tot_lens(_dump(o, 2))
    assert [(i.index, i.row, i.recorded, i.expected) for i in got] == [(1, 0, 4, 9)]
    assert "local lengths" in got[0].text and got[0].wrong_rows == 3
    # padded rows of the companion are not real rows
    o = _batch(2, 1, [9, 5, 30], 4, [0, 1, 2, 3, 3], 4, 3)
    o[0].dcp_tot_seq_lens = np.array([9, 5, 30, 77])
    assert check_tot_lens(_dump(o, 2)) == []


def test_new_checks_are_skipped_by_name_without_their_columns(tmp_path):
    res = run(tmp_path, [obs(rank=0), obs(rank=1)])
    assert res.findings == []
    assert "obs.dqsl" in res.skipped["empty-mask"] and "obs.tot" in res.skipped["tot-lens"]
    assert "rank-agree" not in res.skipped  # needs only the required columns
    res = run(tmp_path, _batch(2, 1, [9, 5], 2, [0, 1, 2], 2, 0))
    assert res.findings == [] and not {"empty-mask", "tot-lens"} & set(res.skipped)
