"""Micro-batch slicing and the PCP partition against docs/dcp.md and vLLM 0.33.0's own answers.

The expectations marked "vLLM" are vLLM 0.33.0's own answers (create_ubatch_slices + _slice_input_batch;
PCPManager.partition_batch with the runner's prepare_dcp_local_seq_lens), recorded here as literals: these tests
never need vLLM. tests/vllm/engine.py drives the same functions of every release (`make test-vllm`), and
tests/data/make_ubatch_oracle.py regenerates the micro-batch answers of tests/data/ubatch_oracle.json with them.
"""

import json

import numpy as np
import pytest
from conftest import ROOT

from dcptool.check.replay import local_np
from dcptool.dcp.slicing import (
    engine_split,
    parse_engine_version,
    pcp_partition,
    pcp_rank_tokens,
    pcp_replicated,
    split_batch,
    splits_on_request_boundary,
    ubatch_slices,
    uniform_query_len,
)

ORACLE = json.loads((ROOT / "tests" / "data" / "ubatch_oracle.json").read_text())


def _qsl(query_lens, nrp=None):
    q = np.asarray(query_lens)
    nrp = nrp or q.size
    out = np.full(nrp + 1, q.sum())
    out[0] = 0
    out[1 : q.size + 1] = np.cumsum(q)
    return out


def _seq(seq_lens, nrp=None):
    s = np.zeros(nrp or len(seq_lens), np.int64)
    s[: len(seq_lens)] = seq_lens
    return s


# (query_lens, seq_lens, K, num_tokens_padded, num_reqs_padded, N, rank, I) ->
#   per micro-batch: ([req_start, req_stop], [tok_start, tok_stop], num_reqs, num_reqs_padded, qsl, seq_lens, dcp)
UBATCH_CASES = [
    # docs/dcp.md's worked example (vLLM's tests), both ranks: a copied parent row (256) would be stale
    (([1, 1, 10, 1, 1], [64, 96, 512, 32, 48], 2, None, None, 2, 0, 1),
     [([0, 3], [0, 7], 3, 3, [0, 1, 2, 7], [64, 96, 507], [32, 48, 254]),
      ([2, 5], [7, 14], 3, 3, [0, 5, 6, 7], [512, 32, 48], [256, 16, 24])]),
    (([1, 1, 10, 1, 1], [64, 96, 512, 32, 48], 2, None, None, 2, 1, 1),
     [([0, 3], [0, 7], 3, 3, [0, 1, 2, 7], [64, 96, 507], [32, 48, 253]),
      ([2, 5], [7, 14], 3, 3, [0, 5, 6, 7], [512, 32, 48], [256, 16, 24])]),
    # CUDA-graph padded uniform decode (vLLM): the last micro-batch absorbs the request padding
    (([3, 3, 3], [40, 50, 60], 2, 24, 8, 2, 1, 1),
     [([0, 4], [0, 12], 3, 4, [0, 3, 6, 9, 9], [40, 50, 60, 0], [20, 25, 30, 0]),
      ([2, 8], [12, 24], 1, 6, [0, 0, 0, 0, 0, 0, 0], [60, 0, 0, 0, 0, 0], [30, 0, 0, 0, 0, 0])]),
    # a micro-batch entirely in token padding keeps the last real request, 0 tokens, full seq_len (vLLM)
    (([1], [7], 2, 8, 4, 2, 0, 16),
     [([0, 2], [0, 4], 1, 2, [0, 1, 1], [7, 0], [7, 0]),
      ([0, 4], [4, 8], 1, 4, [0, 0, 0, 0, 0], [7, 0, 0, 0], [7, 0, 0, 0])]),
    (([16, 129], [2524, 1242], 3, 290, 2, 4, 1, 1),
     [([0, 2], [0, 96], 2, 2, [0, 16, 96], [2524, 1193], [631, 298]),
      ([1, 2], [96, 192], 1, 1, [0, 49], [1242], [311]),
      ([1, 2], [192, 290], 1, 1, [0, 0], [1242], [311])]),
    # one request spread over four micro-batches (vLLM)
    (([127], [768], 4, 254, 1, 8, 7, 1),
     [([0, 1], [0, 63], 1, 1, [0, 63], [704], [88]),
      ([0, 1], [63, 126], 1, 1, [0, 63], [767], [95]),
      ([0, 1], [126, 189], 1, 1, [0, 1], [768], [96]),
      ([0, 1], [189, 254], 1, 1, [0, 0], [768], [96])]),
    (([4, 513, 16], [1027, 1961, 2157], 4, 538, 6, 8, 4, 16),
     [([0, 2], [0, 134], 2, 2, [0, 4, 134], [1027, 1578], [128, 192]),
      ([1, 2], [134, 268], 1, 1, [0, 134], [1712], [208]),
      ([1, 2], [268, 402], 1, 1, [0, 134], [1846], [224]),
      ([1, 6], [402, 538], 2, 5, [0, 115, 131, 131, 131, 131], [1961, 2157, 0, 0, 0], [240, 272, 0, 0, 0])]),
]


@pytest.mark.parametrize("case,want", UBATCH_CASES)
def test_ubatches_match_vllm(case, want):
    q, s, k, ntp, nrp, N, rank, il = case
    nrp = nrp or len(q)
    ubs = split_batch(_qsl(q, nrp), _seq(s, nrp), len(q), nrp, ntp, k)
    got = []
    for ub in ubs:
        sl = ub.slice
        dcp = np.zeros(ub.num_reqs_padded, np.int64)
        dcp[: ub.num_reqs] = local_np(ub.seq_lens[: ub.num_reqs], N, rank, il)
        got.append(([sl.req_start, sl.req_stop], [sl.tok_start, sl.tok_stop], ub.num_reqs, ub.num_reqs_padded,
                     ub.query_start_loc.tolist(), ub.seq_lens.tolist(), dcp.tolist()))
    assert got == [tuple(w) for w in want]


@pytest.mark.parametrize("seed", range(6))
def test_ubatches_cover_the_padded_batch(seed):
    """Micro-batches tile [0, num_tokens_padded), straddlers appear in both, seq_lens only shrink at the end."""
    rng = np.random.default_rng(seed)
    for _ in range(50):
        n = int(rng.integers(1, 40))
        q = rng.choice([1, 3, 4, 127, 128, 129, 1000], n)
        comp = rng.integers(0, 5000, n)
        nrp = n + int(rng.integers(0, 4))
        ntp = int(q.sum() + rng.integers(0, 64))
        k = int(rng.integers(1, 5))
        if ntp // k < 1:
            continue
        qsl, seq = _qsl(q, nrp), _seq(comp + q, nrp)
        ubs = split_batch(qsl, seq, n, nrp, ntp, k)
        assert [u.slice.tok_start for u in ubs][0] == 0 and ubs[-1].slice.tok_stop == ntp
        assert all(a.slice.tok_stop == b.slice.tok_start for a, b in zip(ubs, ubs[1:]))
        assert ubs[-1].slice.req_stop == nrp
        for u in ubs:
            parent = seq[u.slice.req_start : u.slice.req_stop]
            assert (u.seq_lens[:-1] == parent[:-1]).all() and u.seq_lens[-1] <= parent[-1]
            assert u.query_start_loc[-1] <= u.slice.tok_stop - u.slice.tok_start


# ---------------------------------------------------------------------------------------------
# The split rule by engine version: vLLM 0.33's token midpoint, 0.34's request boundary for uniform batches


def test_issue_example_splits_on_a_request_boundary_from_0_34():
    """5 requests x 3 tokens, K=2: 0.34 gives [(0,2,0,6),(2,5,6,15)], 0.33 [(0,3,0,7),(2,5,7,15)] (vLLM)."""
    q = _qsl([3] * 5)
    seq = _seq([40, 50, 60, 70, 80])
    got = {v: [(u.slice.req_start, u.slice.req_stop, u.slice.tok_start, u.slice.tok_stop)
               for u in engine_split(q, seq, 5, 5, 15, 2, v)] for v in ("0.33.0", "0.34.0", None, "0.35.1.dev2+gabc")}
    assert got["0.34.0"] == got["0.35.1.dev2+gabc"] == [(0, 2, 0, 6), (2, 5, 6, 15)]
    assert got["0.33.0"] == got[None] == [(0, 3, 0, 7), (2, 5, 7, 15)]
    # on the boundary no request straddles: micro-batch 0's last seq_len is not cut
    assert engine_split(q, seq, 5, 5, 15, 2, "0.34.0")[0].seq_lens.tolist() == [40, 50]
    assert engine_split(q, seq, 5, 5, 15, 2, "0.33.0")[0].seq_lens.tolist() == [40, 50, 58]


@pytest.mark.parametrize("text,want", [("0.34.0", (0, 34)), ("vLLM 0.33.0", (0, 33)), ("0.34.1.dev3+g1a2b", (0, 34)),
                                       ("v1.2", (1, 2)), (None, None), ("", None),
                                       ("vLLM model runner V2 model (fixed pipeline)", None), ("10.2.3", (10, 2))])
def test_engine_version_parsing(text, want):
    assert parse_engine_version(text) == want


def test_rule_chosen_by_version():
    assert [splits_on_request_boundary(v) for v in ("0.29.0", "0.33.2", "0.34.0", "1.0.0", None, "no version")] == [
        False, False, True, True, False, False]


def test_uniform_query_len():
    assert uniform_query_len(_qsl([3, 3, 3], 5), 3) == 3
    assert uniform_query_len(_qsl([3, 3, 4]), 3) is None
    assert uniform_query_len(_qsl([1]), 1) == 1
    assert uniform_query_len(np.array([0]), 0) is None


def test_request_boundary_falls_back_to_the_midpoint():
    """Fewer requests than micro-batches, or single-token queries: vLLM 0.34 splits at the token midpoint."""
    one = engine_split(_qsl([5]), _seq([50]), 1, 1, 5, 2, "0.34.0")
    assert [(u.slice.tok_start, u.slice.tok_stop) for u in one] == [(0, 2), (2, 5)]
    dec = engine_split(_qsl([1] * 5), _seq([9] * 5), 5, 5, 5, 2, "0.34.0")
    assert [(u.slice.tok_start, u.slice.tok_stop) for u in dec] == [(0, 2), (2, 5)]
    mixed = engine_split(_qsl([3, 3, 4]), _seq([9, 9, 9]), 3, 3, 10, 2, "0.34.0")
    assert [(u.slice.tok_start, u.slice.tok_stop) for u in mixed] == [(0, 5), (5, 10)]


def _oracle_params():
    for i, c in enumerate(ORACLE["cases"]):
        for v in sorted(c["vllm"]):
            yield pytest.param(c, v, id=f"case{i}-vllm{v}")


@pytest.mark.parametrize("case,version", list(_oracle_params()))
def test_splits_match_each_vllm_release(case, version):
    """vLLM's own create_ubatch_slices + _slice_input_batch, per release (tests/data/ubatch_oracle.json,
    written by tests/data/make_ubatch_oracle.py from real vLLM 0.33.0 and 0.34.0)."""
    q, s = case["query_lens"], case["seq_lens"]
    nrp, N, r, il = case["num_reqs_padded"], case["dcp_size"], case["dcp_rank"], case["interleave"]
    ubs = engine_split(_qsl(q, nrp), _seq(s, nrp), len(q), nrp, case["num_tokens_padded"], case["num_ubatches"],
                       version)
    got = []
    for ub in ubs:
        sl = ub.slice
        dcp = np.zeros(ub.num_reqs_padded, np.int64)
        dcp[: ub.num_reqs] = local_np(ub.seq_lens[: ub.num_reqs], N, r, il)
        got.append({"request_slice": [sl.req_start, sl.req_stop], "token_slice": [sl.tok_start, sl.tok_stop],
                    "num_reqs": ub.num_reqs, "num_reqs_padded": ub.num_reqs_padded,
                    "query_start_loc": ub.query_start_loc.tolist(), "seq_lens": ub.seq_lens.tolist(),
                    "dcp_local_seq_lens": dcp.tolist()})
    assert got == case["vllm"][version]


def test_oracle_fixture_covers_both_rules():
    """The fixture holds both releases and cases where they disagree (else the test above proves little)."""
    cases = ORACLE["cases"]
    assert all({"0.33.0", "0.34.0"} <= set(c["vllm"]) for c in cases) and len(cases) >= 100
    differ = [c for c in cases if [u["token_slice"] for u in c["vllm"]["0.33.0"]]
              != [u["token_slice"] for u in c["vllm"]["0.34.0"]]]
    assert len(differ) >= 20


def test_ubatch_slices_reject_bad_input():
    with pytest.raises(ValueError):
        ubatch_slices(np.array([0, 1]), 1, 1, 1, 0)
    with pytest.raises(ValueError):
        ubatch_slices(np.array([0]), 0, 0, 0, 2)


# ---------------------------------------------------------------------------------------------
# PCP

# (query_lens, seq_lens, prefill_lens, P, rank, N, I) -> vLLM: (local->global rows, local query lens,
#   local seq_lens, DCP rank 0 local lengths or None)
PCP_CASES = [
    # docs/dcp.md (PCP): decodes with 16 and 24 computed tokens -> [17, 25] on every PCP rank; N=2 rank 0 -> [9, 13]
    (([1, 1], [17, 25], None, 2, 0, 2, 1), ([0, 1], [1, 1], [17, 25], [9, 13])),
    # P=4, N=2, I=16: short prefills (15 tokens: 7 * 2 < 15) are cut, 3- and 9-token ones replicated
    (([15, 1, 3, 17, 15, 9, 1000, 3], [15, 487, 3, 634, 3774, 9, 1000, 3304],
      [33, 94, 27, 647, 3809, 36, 1032, 1280], 4, 0, 2, 16),
     ([1, 7, 0, 0, 2, 3, 4, 4, 5, 6, 6], [1, 3, 2, 1, 3, 17, 2, 1, 9, 125, 125],
      [487, 3304, 2, 15, 3, 634, 3761, 3774, 9, 125, 1000], [247, 1656, 2, 15, 3, 320, 1888, 1888, 9, 64, 504])),
    (([15, 1, 3, 17, 15, 9, 1000, 3], [15, 487, 3, 634, 3774, 9, 1000, 3304],
      [33, 94, 27, 647, 3809, 36, 1032, 1280], 4, 1, 2, 16),
     ([1, 7, 0, 0, 2, 3, 4, 4, 5, 6, 6], [1, 3, 2, 2, 3, 17, 2, 2, 9, 125, 125],
      [487, 3304, 4, 14, 3, 634, 3763, 3773, 9, 250, 875], [247, 1656, 4, 14, 3, 320, 1888, 1888, 9, 128, 443])),
    # P=3, N=4, I=16: three prefills (the last a 1-token chunk that is still prefilling, so replicated
    # but not a decode): each prefill's two chunks in request order
    (([17, 129, 1], [17, 3765, 2305], [62, 3772, 2342], 3, 1, 4, 16),
     ([0, 0, 1, 1, 2], [3, 3, 22, 22, 1], [6, 15, 3680, 3746, 2305], [6, 15, 928, 944, 577])),
    (([17, 129, 1], [17, 3765, 2305], [62, 3772, 2342], 3, 2, 4, 16),
     ([0, 0, 1, 1, 2], [3, 3, 22, 22, 1], [9, 12, 3702, 3724, 2305], [9, 12, 928, 940, 577])),
    # PCP without DCP shards decodes round robin: ranks 0-2 get one decode each, rank 3 none
    (([1, 291, 3, 3], [2014, 291, 4373, 4231], [1664, 324, 406, 3573], 4, 0, 1, 16),
     ([0, 1, 1], [1, 37, 32], [2014, 37, 291], None)),
    (([1, 291, 3, 3], [2014, 291, 4373, 4231], [1664, 324, 406, 3573], 4, 1, 1, 16),
     ([2, 1, 1], [3, 37, 37], [4373, 74, 259], None)),
    (([1, 291, 3, 3], [2014, 291, 4373, 4231], [1664, 324, 406, 3573], 4, 3, 1, 16),
     ([1, 1], [37, 37], [148, 185], None)),
    # a rank whose chunks are all empty runs one empty row (seq_len 0), as vLLM does
    (([2], [2], [30], 3, 2, 1, 1), ([0], [0], [0], None)),
]


@pytest.mark.parametrize("case,want", PCP_CASES)
def test_pcp_partition_matches_vllm(case, want):
    q, s, pl, P, rank, N, il = case
    q, s = np.array(q), np.array(s)
    comp = s - q
    pl = np.where(q > 1, s, comp) if pl is None else np.array(pl)
    loc = pcp_partition(q, comp, comp < pl, P, rank, N)
    rows, lq, ls, dcp = want
    assert loc.req.tolist() == rows
    assert loc.query_lens.tolist() == lq
    assert loc.seq_lens.tolist() == ls
    if dcp is not None:
        assert local_np(loc.seq_lens, N, 0, il).tolist() == dcp


def test_pcp_design_example_padded():
    """docs/dcp.md (PCP): local [17, 25], N=2, I=1, rank 0 -> [9, 13], padded to 4 rows [9, 13, 0, 0]."""
    loc = pcp_partition([1, 1], [16, 24], [False, False], 2, 1, 2)
    view = np.zeros(4, np.int64)
    view[: loc.num_reqs] = local_np(loc.seq_lens, 2, 0, 1)
    assert loc.seq_lens.tolist() == [17, 25] and view.tolist() == [9, 13, 0, 0]


@pytest.mark.parametrize("seed", range(8))
def test_pcp_partition_properties(seed):
    """Every prefill token runs on exactly one rank; decodes (and, with DCP, short prefills) on all."""
    rng = np.random.default_rng(seed)
    for _ in range(40):
        P = int(rng.integers(2, 5))
        N = int(rng.choice([1, 2, 4]))
        n = int(rng.integers(1, 12))
        q = rng.choice([1, 2, 3, 7, 8, 127, 128, 129, 1000, 4097], n)
        comp = rng.integers(0, 3000, n)
        isp = rng.random(n) < 0.6
        q = np.where(isp, q, int(rng.choice([1, 3])))
        rep = pcp_replicated(q, isp, P, N)
        covered = np.zeros(n, np.int64)
        for rank in range(P):
            loc = pcp_partition(q, comp, isp, P, rank, N)
            if loc.num_tokens == 0:
                assert loc.num_reqs == 1 and loc.seq_lens.tolist() == [0]
                continue
            assert (np.diff(isp[loc.req].astype(int)) >= 0).all(), "decodes come first"
            assert (loc.seq_lens == comp[loc.req] + loc.offset + loc.query_lens).all()
            assert (loc.query_lens > 0).all() and (loc.offset + loc.query_lens <= q[loc.req]).all()
            np.add.at(covered, loc.req, loc.query_lens)
        sharded_decodes = N == 1
        want = np.where(rep & ~(sharded_decodes & ~isp), P * q, q)
        want = np.where(rep & (N > 1), P * q, want)
        assert (covered == want).all()
        assert pcp_rank_tokens(q, isp, P, N).tolist() == [pcp_partition(q, comp, isp, P, r, N).num_tokens
                                                           for r in range(P)]


def test_pcp_size_one_is_the_batch_itself():
    loc = pcp_partition([5, 1], [10, 20], [True, False], 1, 0, 2)
    assert loc.req.tolist() == [0, 1] and loc.seq_lens.tolist() == [15, 21]
    with pytest.raises(ValueError):
        pcp_partition([1], [1], [False], 2, 2)


# ---------------------------------------------------------------------------------------------
# The rule reaches replay: the ubatch-slice check and --split follow the dump's engine version


def _uniform_dump(tmp_path, split_version: str, engine_version: str | None, q=3, n=5, k=2, name="d"):
    """A uniform batch (n requests x q tokens) and its k micro-batches as `split_version` splits them."""
    from dcptool.dump import DumpConfig, Observation, write_observations

    qsl = _qsl([q] * n).astype(np.int32)
    seq = np.arange(40, 40 + 10 * n, 10, dtype=np.int32)
    out = [Observation(step=1, site="attn_metadata", rank=0, num_reqs=n, num_reqs_padded=n, seq_lens=seq,
                       dcp_local_seq_lens=local_np(seq, 2, 0, 1).astype(np.int32), query_start_loc=qsl,
                       num_tokens_padded=n * q)]
    for u, ub in enumerate(engine_split(qsl, seq, n, n, n * q, k, split_version)):
        sl = ub.slice
        out.append(Observation(step=1, site="ubatch", rank=0, ubatch=u, num_reqs=ub.num_reqs,
                               num_reqs_padded=ub.num_reqs_padded, seq_lens=ub.seq_lens,
                               dcp_local_seq_lens=local_np(ub.seq_lens, 2, 0, 1).astype(np.int32), parent=0,
                               req_start=sl.req_start, tok_start=sl.tok_start, tok_stop=sl.tok_stop,
                               query_start_loc=ub.query_start_loc, num_tokens_padded=sl.tok_stop - sl.tok_start))
    path = tmp_path / f"{name}.safetensors"
    write_observations(path, out, DumpConfig(dcp_size=2, engine_version=engine_version))
    return str(path)


def _replay(path, **kw):
    from dcptool.check.replay import replay
    from dcptool.dump import open_dumps

    return replay(open_dumps([path]), "torch", **kw)


def test_a_0_34_recording_replays_clean_by_its_own_rule(tmp_path):
    p = _uniform_dump(tmp_path, "0.34.0", "0.34.0")
    assert _replay(p).findings == []
    assert _replay(p, split=2).findings == []  # --split follows the recorded version too


def test_a_0_34_split_is_wrong_for_a_0_33_engine(tmp_path):
    """The same micro-batches claimed by 0.33 (or replayed with --engine-version 0.33.0) are mis-split."""
    p = _uniform_dump(tmp_path, "0.34.0", "0.33.0")
    fs = _replay(p).findings
    assert [(f.obs, f.rule, f.detail["field"], f.recorded, f.expected) for f in fs] == [
        (1, "ubatch-slice", "req_stop", 2, 3), (2, "ubatch-slice", "tok_start", 6, 7)]
    assert "vLLM 0.33.0 splits this batch" in fs[0].message
    q = _uniform_dump(tmp_path, "0.34.0", "0.34.0", name="e")
    assert [f.obs for f in _replay(q, engine_version="0.33.0").findings] == [1, 2]


def test_without_a_version_micro_batches_are_checked_at_their_recorded_bounds(tmp_path):
    """Dumps that name no engine version: no split-point check (as before); --split uses 0.33's rule."""
    p = _uniform_dump(tmp_path, "0.34.0", None)
    assert _replay(p).findings == []
    fs = _replay(p, split=2).findings
    assert {f.rule for f in fs} == {"ubatch-slice"} and all(f.detail.get("split") for f in fs)
    assert _replay(p, split=2, engine_version="0.34.0").findings == []


def test_0_34_accepts_the_midpoint_when_dp_ranks_disagree(tmp_path):
    """vLLM 0.34 splits a uniform batch at the token midpoint when its DP ranks disagree on the
    uniform count (not recorded), so both splits are vLLM's."""
    assert _replay(_uniform_dump(tmp_path, "0.33.0", "0.34.0")).findings == []


def test_split_points_checked_on_awkward_batches(tmp_path):
    """K=3 over 7 requests of 4 tokens: 0.34 splits at 8 and 16 (two requests each), the last takes 3."""
    p = _uniform_dump(tmp_path, "0.34.0", "0.34.0", q=4, n=7, k=3)
    from dcptool.dump import open_dumps

    d = open_dumps([p])
    assert d["obs.tok_start"][1:].tolist() == [0, 8, 16] and d["obs.req_start"][1:].tolist() == [0, 2, 4]
    assert _replay(p).findings == []
    assert [f.obs for f in _replay(p, engine_version="0.33.0").findings] == [1, 2, 3]


def test_cli_engine_version_option(tmp_path):
    from typer.testing import CliRunner

    from dcptool.cli import app

    p = _uniform_dump(tmp_path, "0.34.0", None)
    r = CliRunner().invoke(app, ["replay", p, "--split", "2", "--json", "--engine-version", "0.34.0"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in r.output.splitlines()]
    assert [(x["req_start"], x["req_stop"], x["tok_start"], x["tok_stop"]) for x in rows if x["type"] == "split"] == [
        (0, 2, 0, 6), (2, 5, 6, 15)]
    assert CliRunner().invoke(app, ["replay", p, "--split", "2"]).exit_code == 1
    bad = CliRunner().invoke(app, ["replay", p, "--engine-version", "latest"])
    assert bad.exit_code == 2 and "--engine-version: 'latest'" in bad.output


@pytest.mark.parametrize("seed", range(4))
def test_split_point_check_survives_hostile_micro_batches(tmp_path, seed):
    """Random parents, bounds, ubatch indices and query_start_locs (not monotone, past the batch) in a
    dump that names 0.34.0: the split-point check reports or stays quiet, it never raises."""
    from dcptool.dump import DumpConfig, DumpError, Observation, write_observations

    rng = np.random.default_rng(seed)
    for t in range(15):
        out = []
        for i in range(int(rng.integers(2, 12))):
            nrp = int(rng.integers(1, 6))
            nr = int(rng.integers(0, nrp + 1))
            seq = rng.integers(0, 50, nrp).astype(np.int32)
            qsl = np.concatenate([[0], np.cumsum(rng.integers(-1, 5, nrp))]).astype(np.int32)
            kw = dict(query_start_loc=qsl, num_tokens_padded=int(rng.integers(-1, 30)))
            if i and rng.random() < 0.7:
                kw.update(ubatch=int(rng.integers(0, 4)), parent=int(rng.integers(i)),
                          req_start=int(rng.integers(0, 6)), tok_start=int(rng.integers(0, 20)),
                          tok_stop=int(rng.integers(0, 30)))
            out.append(Observation(step=0, site="ubatch", rank=0, num_reqs=nr, num_reqs_padded=nrp, seq_lens=seq,
                                   dcp_local_seq_lens=local_np(seq, 2, 0, 1).astype(np.int32), **kw))
        path = tmp_path / f"h{t}.safetensors"
        try:
            write_observations(path, out, DumpConfig(dcp_size=2, engine_version="0.34.0"))
        except DumpError:
            continue
        for f in _replay(str(path), split=2).findings:
            assert f.rule and f.message


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
def test_split_point_check_agrees_with_vllm_on_every_fixture_case(tmp_path, version):
    """The check's vectorised split rule against vLLM's own micro-batches (the oracle fixture): each
    release's micro-batches, recorded in a dump naming that release, replay clean; named as the other
    release, exactly the cases where the two releases differ are flagged (0.33 does not accept 0.34's
    request-boundary split; 0.34 accepts the midpoint of a uniform batch, see above)."""
    from dcptool.dump import DumpConfig, Observation, write_observations

    obs, parents_that_differ = [], set()
    for c in ORACLE["cases"]:
        q, s, nrp, ntp = c["query_lens"], c["seq_lens"], c["num_reqs_padded"], c["num_tokens_padded"]
        N, r, il = c["dcp_size"], c["dcp_rank"], c["interleave"]
        seq = _seq(s, nrp).astype(np.int32)
        view = np.zeros(nrp, np.int32)
        view[: len(q)] = local_np(seq[: len(q)], N, r, il)
        p = len(obs)
        obs.append(Observation(step=0, site="attn_metadata", rank=r, num_reqs=len(q), num_reqs_padded=nrp,
                               seq_lens=seq, dcp_local_seq_lens=view, query_start_loc=_qsl(q, nrp).astype(np.int32),
                               num_tokens_padded=ntp))
        mine, other = c["vllm"][version], c["vllm"]["0.34.0" if version == "0.33.0" else "0.33.0"]
        if [u["token_slice"] for u in mine] != [u["token_slice"] for u in other]:
            parents_that_differ.add(p)
        for u, ub in enumerate(mine):
            obs.append(Observation(step=0, site="ubatch", rank=r, ubatch=u, num_reqs=ub["num_reqs"],
                                   num_reqs_padded=ub["num_reqs_padded"],
                                   seq_lens=np.array(ub["seq_lens"], np.int32),
                                   dcp_local_seq_lens=np.array(ub["dcp_local_seq_lens"], np.int32), parent=p,
                                   req_start=ub["request_slice"][0], tok_start=ub["token_slice"][0],
                                   tok_stop=ub["token_slice"][1],
                                   query_start_loc=np.array(ub["query_start_loc"], np.int32)))
    path = tmp_path / "oracle.safetensors"
    # (each case has its own DCP size; the dump's is 8, so only ubatch-slice findings are looked at)
    write_observations(path, obs, DumpConfig(dcp_size=8, engine_version=version))
    own = [f for f in _replay(str(path)).findings if f.rule == "ubatch-slice"]
    assert own == []
    other = "0.34.0" if version == "0.33.0" else "0.33.0"
    flagged = {int(f.detail["parent_obs"]) for f in _replay(str(path), engine_version=other).findings
               if f.rule == "ubatch-slice"}
    assert flagged == (parents_that_differ if version == "0.34.0" else set())


def test_the_releases_modelled_are_the_plugin_s():
    """One list of the vLLM releases dcptool knows: the split rules here, the plugin's hook tables there."""
    from dcptool.dcp.slicing import RELEASES
    from dcptool.engine.vllm.tables import TABLES

    lines = sorted({tuple(int(x) for x in r.rstrip(".").split(".")) for t in TABLES for r in t.releases})
    assert lines == list(RELEASES)


@pytest.mark.parametrize("version,known", [("0.29.0", True), ("0.34.1.dev3+g1a2b", True), ("vLLM 0.31.2", True),
                                           ("9.9", False), ("0.35.0", False), ("0.28.1", False), ("banana", True)])
def test_unmodelled_names_the_releases_and_the_rule_used(version, known):
    from dcptool.dcp.slicing import unmodelled

    why = unmodelled(version)
    assert (why is None) == known  # (text naming no version: the dump's free text, nothing to warn about)
    if not known:
        assert "0.29, 0.30, 0.31, 0.32, 0.33, 0.34" in why
        assert ("0.34 does" if version in ("9.9", "0.35.0") else "0.33 does") in why


@pytest.mark.parametrize("command", [["replay", "SAMPLE", "--json"], ["simulate", "--steps", "1", "--json"]])
def test_an_engine_version_without_a_model_is_warned_about(command):
    from conftest import cli

    args = [str(ROOT / "samples" / "legacy.safetensors") if a == "SAMPLE" else a for a in command]
    r = cli(*args, "--engine-version", "9.9")
    assert r.returncode in (0, 1) and json.loads(r.stdout.splitlines()[-1])  # it runs, JSON untouched
    assert r.stderr == (f"dcptool {command[0]}: warning: --engine-version 9.9: no model of this release; dcptool "
                        "knows vLLM 0.29, 0.30, 0.31, 0.32, 0.33, 0.34, and splits micro-batches as 0.34 does (a "
                        "uniform decode batch on a request boundary)\n")
    quiet = cli(*args, "--engine-version", "0.34.0")
    assert quiet.returncode == r.returncode and quiet.stderr == ""
