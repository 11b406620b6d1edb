"""Provenance (docs/replay.md): the precedence on hand-built dumps; the bulk search agrees with a naive reading of the
precedence; keys cannot collide; no quadratic path.

The naive reference below is the rule text as loops, on purpose: it is the spec the vectorised
joins (hashes, latest_before) must reproduce exactly, including "most recent first"."""

import numpy as np
import pytest
from conftest import expected_view, obs, rules, run, worked_example, write

import dcptool.check.provenance as provenance
from dcptool.check.provenance import INTERLEAVES, Provenance, latest_before, local_np
from dcptool.check.replay import replay
from dcptool.dump import Dump, DumpConfig, open_dumps, write_dump

# --------------------------------------------------------------------------------------------
# docs/replay.md's precedence on hand-built dumps


def pcp_dump(stale: bool):
    """PCP 2: the global batch (1 decode + 1 prefill of 8), then rank 0's local batch."""
    g_seq = np.array([17, 40, 0, 0], np.int32)  # decode with 16 computed; prefill 32 computed + 8 new
    glob = obs(step=1, site="prepare_inputs", seq=g_seq, num_reqs=2, num_reqs_padded=4)
    # local rank 0: decode replicated [17]; prefill chunks 0 and 3 of 2 tokens: ends at 34 and 40
    l_seq = np.array([17, 34, 40, 0, 0, 0], np.int32)
    view = glob.dcp_local_seq_lens if stale else "auto"
    local = obs(step=1, site="pcp_partition", seq=l_seq, num_reqs=3, num_reqs_padded=6, view=view)
    return [obs(step=0), glob, local]


def test_pcp_local_batch_with_the_global_view_is_stale_earlier_in_step(tmp_path):
    res = run(tmp_path, pcp_dump(True))
    assert rules(res) == [(2, "stale"), (2, "shape")]
    f = res.findings[0]
    assert f.source.relation == "earlier-in-step" and f.source.obs == 1 and f.source.site == "prepare_inputs"
    assert run(tmp_path, pcp_dump(False)).findings == []


def test_global_wrong_rank_wrong_interleave(tmp_path):
    seq = np.array([1000, 77, 35, 0], np.int32)
    o = [obs(step=0, seq=seq, num_reqs=3, view=[1000, 77, 35, 0]),
         obs(step=1, seq=seq, num_reqs=3, view=expected_view(seq, 3, 4, 2, 1)),
         obs(step=2, seq=seq, num_reqs=3, view=expected_view(seq, 3, 4, 2, 0, il=16))]
    res = run(tmp_path, o)
    assert rules(res) == [(0, "global"), (1, "wrong-rank"), (2, "wrong-interleave")]
    assert res.findings[1].detail == {"rank": 1} and res.findings[2].detail == {"interleave": 16}


def test_wrong_interleave_tries_page_size(tmp_path):
    seq = np.array([1000, 77, 35, 0], np.int32)
    res = run(tmp_path, [obs(seq=seq, num_reqs=3, view=expected_view(seq, 3, 4, 2, 0, il=48))], page_size=48)
    assert res.findings[0].detail == {"interleave": 48}


def test_earlier_step_names_the_most_recent_source(tmp_path):
    a, b = np.array([300, 301, 0], np.int32), np.array([500, 9, 0], np.int32)
    o = [obs(step=0, seq=a, num_reqs=2, num_reqs_padded=3), obs(step=1, seq=b, num_reqs=2, num_reqs_padded=3),
         obs(step=2, seq=a, num_reqs=2, num_reqs_padded=3),
         obs(step=3, seq=b, num_reqs=2, num_reqs_padded=3, view=expected_view(a, 2, 3, 2, 0))]
    (f,) = run(tmp_path, o).findings
    assert f.rule == "stale" and f.source.relation == "earlier-step" and f.source.obs == 2 and f.source.step == 2


def test_precedence_parent_rows_before_earlier_in_step(tmp_path):
    o = worked_example(True)
    # an earlier observation of the same step whose expected rows equal the copied parent rows
    o.insert(0, obs(step=3, site="prepare_inputs", seq=[64, 96, 512], num_reqs=3, num_reqs_padded=3))
    for x in o[2:]:
        x.parent = 1
    (f,) = run(tmp_path, o).findings
    assert f.source.relation == "parent-rows"


def test_precedence_global_before_wrong_rank(tmp_path):
    # rank 1, L = 1: global [1] and rank 0's [1] both hold; global comes first
    (f,) = run(tmp_path, [obs(rank=1, seq=[1, 0], num_reqs=1, num_reqs_padded=2, view=[1, 0])]).findings
    assert f.rule == "global"


def test_precedence_earlier_in_step_before_global(tmp_path):
    seq = np.array([8, 8, 0], np.int32)
    o = [obs(step=0, site="a", seq=[16, 16, 0], num_reqs=2, num_reqs_padded=3),
         obs(step=0, site="b", seq=seq, num_reqs=2, num_reqs_padded=3, view=[8, 8, 0])]
    (f,) = run(tmp_path, o).findings
    assert (f.rule, f.source.relation) == ("stale", "earlier-in-step")


def test_stale_source_must_be_the_same_rank(tmp_path):
    seq = np.array([17, 17, 0], np.int32)  # rank 0 must hold [9, 9]
    o = [obs(step=0, rank=1, site="a", seq=[17, 17, 0], num_reqs=2, num_reqs_padded=3),  # rank 1: [8, 8]
         obs(step=0, rank=0, site="b", seq=seq, num_reqs=2, num_reqs_padded=3, view=[8, 8, 0])]
    (f,) = run(tmp_path, o).findings
    assert f.rule == "wrong-rank"  # rank 1's rows of this very batch, not stale from rank 1's other batch


# --------------------------------------------------------------------------------------------
# The naive reference


def _expected(d: Dump, s: int, rank: int, rows: int) -> np.ndarray:
    """The first `rows` expected rows of s for `rank`, zero past num_reqs (a padded row, or past the view)."""
    c = d.config
    nr = int(d["obs.num_reqs"][s])
    out = np.zeros(max(nr, rows), np.int64)
    out[:nr] = local_np(d.seq_lens_of(s)[:nr], c.dcp_size, rank, c.cp_interleave)
    return out[:rows]


def _strip(v: np.ndarray) -> np.ndarray:
    nz = np.flatnonzero(v)
    return v[: nz[-1] + 1] if nz.size else v[:0]


def naive_explain(d: Dump, i: int, rec: np.ndarray):
    c = d.config
    rank, step = int(d["obs.rank"][i]), int(d["obs.step"][i])
    m = rec.size
    if "obs.parent" in d.columns and "obs.req_start" in d.columns:
        p, rs = int(d["obs.parent"][i]), int(d["obs.req_start"][i])
        if p >= 0 and rs >= 0:
            pe = _expected(d, p, int(d["obs.rank"][p]), rs + m)[rs : rs + m]
            pv = d.dcp_of(p)
            if np.array_equal(pe, rec) or (pv is not None and np.array_equal(pv[rs : rs + m], rec)):
                return "stale", (p, "parent-rows"), {}
    if m == 0:
        return "mismatch", None, {}
    for s in range(i - 1, -1, -1):
        if int(d["obs.rank"][s]) == rank and int(d["obs.step"][s]) == step and d["obs.num_reqs"][s] >= 1:
            if np.array_equal(_expected(d, s, rank, m), rec):
                return "stale", (s, "earlier-in-step"), {}
    seq = d.seq_lens_of(i)[:m].astype(np.int64)
    if np.array_equal(rec, seq):
        return "global", None, {}
    for r in range(c.dcp_size):
        if r != rank and np.array_equal(local_np(seq, c.dcp_size, r, c.cp_interleave), rec):
            return "wrong-rank", None, {"rank": r}
    extra = (c.page_size,) if c.page_size and c.page_size not in INTERLEAVES else ()
    for il in INTERLEAVES + extra:
        if il != c.cp_interleave and np.array_equal(local_np(seq, c.dcp_size, rank, il), rec):
            return "wrong-interleave", None, {"interleave": il}
    want = _strip(rec)
    if want.size:
        for s in range(i - 1, -1, -1):
            if int(d["obs.rank"][s]) == rank and int(d["obs.step"][s]) < step:
                if np.array_equal(_strip(_expected(d, s, rank, int(d["obs.num_reqs"][s]))), want):
                    return "stale", (s, "earlier-step"), {}
    return "mismatch", None, {}


def _recorded(d: Dump, i: int) -> np.ndarray:
    v = d.dcp_of(i)
    return np.asarray(v[: min(v.size, int(d["obs.num_reqs"][i]))], np.int64)


def _coincidental_dump(path, seed: int, max_rows: int = 4, n: int | None = None) -> Dump:
    """Small values, few steps and ranks: views that copy other observations' rows (prefixes, zero
    extensions, other ranks), global lengths and random rows, so every relation is exercised. Views of
    up to `max_rows` real rows; 5-49 observations in 4 steps, or `n` in n / 8 steps."""
    rng = np.random.default_rng(seed)
    N, il = int(rng.choice([2, 3, 4])), int(rng.choice([1, 2]))
    drawn = int(rng.integers(5, 50))
    steps = rng.integers(0, 4 if n is None else max(4, n // 8), drawn if n is None else n).astype(np.int64)
    n = drawn if n is None else n
    if rng.random() < 0.7:
        steps.sort()  # mostly in step order; sometimes not (one file need not be)
    rank = rng.integers(0, N, n).astype(np.int32)
    nr = rng.integers(0, max_rows + 1, n).astype(np.int32)
    nrp = nr + rng.integers(0, 3, n).astype(np.int32)
    seq = [np.where(np.arange(p) < r, rng.integers(0, 12, p), 0).astype(np.int32) for r, p in zip(nr, nrp)]
    parent = np.full(n, -1, np.int64)
    req_start = np.full(n, -1, np.int32)
    views = []
    for k in range(n):
        own = _expected_rows(seq[k], nr[k], nrp[k], N, int(rank[k]), il)
        u = rng.random()
        if u < 0.35 and k:
            s = int(rng.integers(0, k))
            other = _expected_rows(seq[s], nr[s], nrp[s], N, int(rank[k]), il)
            v = np.zeros(nrp[k], np.int64)
            v[: min(other.size, v.size)] = other[: v.size]
        elif u < 0.5:
            v = rng.integers(0, 6, nrp[k])
        elif u < 0.6:
            v = seq[k].astype(np.int64)
        elif u < 0.7:
            v = _expected_rows(seq[k], nr[k], nrp[k], N, int((rank[k] + 1) % N), il)
        else:
            v = own
        if k and rng.random() < 0.15:
            parent[k], req_start[k] = int(rng.integers(0, k)), int(rng.integers(0, 3))
        views.append(np.asarray(v[: v.size - (rng.random() < 0.1)], np.int32))
    offs = np.concatenate([[0], np.cumsum(nrp)]).astype(np.int64)
    voffs = np.concatenate([[0], np.cumsum([v.size for v in views])]).astype(np.int64)
    cols = {"obs.step": steps, "obs.site": rng.integers(0, 2, n).astype(np.int32), "obs.rank": rank,
            "obs.ubatch": np.full(n, -1, np.int32), "obs.num_reqs": nr, "obs.num_reqs_padded": nrp, "obs.rows": offs,
            "rows.seq_lens": np.concatenate(seq), "obs.has_dcp": np.ones(n, np.uint8), "obs.dcp_rows": voffs,
            "rows.dcp_local_seq_lens": np.concatenate(views), "obs.parent": parent, "obs.req_start": req_start}
    write_dump(path, DumpConfig(dcp_size=N, cp_interleave=il, sites=("a", "b")), cols)
    return open_dumps([path])


def _expected_rows(seq, nr, nrp, N, rank, il) -> np.ndarray:
    out = np.zeros(int(nrp), np.int64)
    out[:nr] = local_np(seq[:nr], N, rank, il)
    return out


@pytest.mark.parametrize(("seed", "max_rows"), [(s, 4) for s in range(40)] + [(s, r) for s in range(8)
                                                                             for r in (21, 90)])
def test_bulk_search_agrees_with_the_naive_precedence(tmp_path, seed, max_rows):
    """Views of up to 90 rows: the value rules test growing prefixes of rows (1, 4, 16, 64), the wrong-rank
    interval narrowing across them."""
    d = _coincidental_dump(tmp_path / "d.safetensors", seed, max_rows)
    res = replay(d, "torch")
    value = [f for f in res.findings if f.rule in ("stale", "global", "wrong-rank", "wrong-interleave", "mismatch")]
    for f in value:
        rule, src, detail = naive_explain(d, f.index, _recorded(d, f.index))
        got = None if f.source is None else (f.source.index, f.source.relation)
        assert (f.rule, got, f.detail) == (rule, src, detail), f.message


def test_the_fuzz_exercises_every_relation(tmp_path):
    seen = set()
    for seed in range(40):
        d = _coincidental_dump(tmp_path / f"d{seed}.safetensors", seed)
        seen |= {f.rule if f.source is None else f.source.relation for f in replay(d, "torch").findings}
    assert {"parent-rows", "earlier-in-step", "earlier-step", "global", "wrong-rank", "mismatch"} <= seen


def test_explain_without_prepare_searches_that_one(tmp_path):
    d = _coincidental_dump(tmp_path / "d.safetensors", 3)
    wrong = [f.index for f in replay(d, "torch").findings if f.rule in ("stale", "mismatch")]
    p = Provenance(d)
    for i in wrong:
        rule, src, detail = p.explain(i, _recorded(d, i))
        assert (rule, None if src is None else (src.index, src.relation), detail) == \
            naive_explain(d, i, _recorded(d, i))


# --------------------------------------------------------------------------------------------
# latest_before, the join primitive


def test_latest_before_against_brute_force():
    rng = np.random.default_rng(7)
    for _ in range(50):
        nc, nq = int(rng.integers(0, 40)), int(rng.integers(0, 20))
        c_run, c_idx, c_val = rng.integers(0, 3, nc), rng.integers(0, 30, nc), rng.integers(0, 5, nc)
        q_run, q_idx, q_thr = rng.integers(0, 3, nq), rng.integers(0, 30, nq), rng.integers(0, 6, nq)
        got = latest_before(c_run, c_idx, c_val, q_run, q_idx, q_thr)
        for k in range(nq):
            ok = [int(c_idx[j]) for j in range(nc)
                  if c_run[j] == q_run[k] and c_idx[j] < q_idx[k] and c_val[j] < q_thr[k]]
            assert got[k] == max(ok, default=-1)


# --------------------------------------------------------------------------------------------
# Keys that cannot collide


def test_rank_and_step_keys_do_not_collide(tmp_path):
    """Packed as rank * 2**48 + step, rank 1 step 0 and rank 0 step 2**48 were one key: a rank-0 view equal to
    rank 1's rows of an observation of another step was called `stale`/earlier-in-step. It is `wrong-rank`."""
    seq = (17, 25, 0, 0)
    a = obs(step=0, rank=1, seq=seq)
    b = obs(step=2**48, rank=0, seq=seq, view=local_np(np.array([17, 25, 0, 0]), 2, 1, 1) * [1, 1, 0, 0])
    res = replay(open_dumps([write(tmp_path / "d.safetensors", [a, b])]), "torch")
    assert [(f.obs, f.rule, f.detail) for f in res.findings] == [(1, "wrong-rank", {"rank": 1})]


def test_earlier_step_keys_do_not_collide_across_ranks(tmp_path):
    """The same expected rows on two ranks are two keys: only the same rank is a source."""
    seq = np.array([40, 7, 0, 0], np.int32)
    early = [obs(step=0, rank=r, seq=seq) for r in (0, 1)]
    own = local_np(seq, 2, 1, 1) * [1, 1, 0, 0]
    later = obs(step=5, rank=1, seq=(41, 8, 0, 0), view=own)  # step 0's rows of rank 1: earlier-step, obs 1
    res = replay(open_dumps([write(tmp_path / "d.safetensors", early + [later])]), "torch")
    f = res.findings[0]
    assert (f.rule, f.source.obs, f.source.relation) == ("stale", 1, "earlier-step")


def test_no_packed_keys_left():
    """No key packs columns into one integer (`* 2**k`, `<< k`) in the modules that build keys."""
    import inspect

    import dcptool.check.replay as replay_mod
    import dcptool.report.timeline
    from dcptool.check import alias, decode, plan, ranks, ubatch, values
    from dcptool.dcp import rules

    for mod in (provenance, rules, plan, values, alias, ranks, ubatch, decode, replay_mod):
        src = inspect.getsource(mod)
        assert "<< 48" not in src and "* (1 << 48)" not in src and "2**48" not in src, mod.__name__
    assert "* n_ranks" not in inspect.getsource(dcptool.report.timeline.timeline)


# --------------------------------------------------------------------------------------------
# No quadratic path: 4,000 wrong views of one rank in one step (was 428 s)


def _budget(monkeypatch, owner, name: str, limit: int) -> list[int]:
    """Counts calls of owner.name and fails fast past `limit`: work linear in the findings passes, the old
    search (every earlier candidate for each finding) trips it within the first few hundred findings."""
    fn, calls = getattr(owner, name), [0]

    def counted(*a, **kw):
        calls[0] += 1
        if calls[0] > limit:
            raise AssertionError(f"{name}: more than {limit} calls, the search is quadratic")
        return fn(*a, **kw)

    monkeypatch.setattr(owner, name, counted)
    return calls


def _one_step_dump(path, n: int, rows: int, same_lead: bool) -> Dump:
    rng = np.random.default_rng(5)
    seq = rng.integers(1, 1000, (n, rows)).astype(np.int32)
    if same_lead:  # every observation's first two expected rows alike: one hash bucket for the old signature
        seq[:, :2] = [500, 300]
    dcp = rng.integers(1000, 2000, (n, rows)).astype(np.int32)  # never a local length: all `mismatch`
    dcp[:, :2] = [250, 150] if same_lead else dcp[:, :2]
    offs = np.arange(n + 1, dtype=np.int64) * rows
    step = np.zeros(n, np.int64) if not same_lead else np.arange(n, dtype=np.int64)
    cols = {"obs.step": step, "obs.site": np.zeros(n, np.int32), "obs.rank": np.zeros(n, np.int32),
            "obs.ubatch": np.full(n, -1, np.int32), "obs.num_reqs": np.full(n, rows, np.int32),
            "obs.num_reqs_padded": np.full(n, rows, np.int32), "obs.rows": offs, "rows.seq_lens": seq.ravel(),
            "obs.has_dcp": np.ones(n, np.uint8), "obs.dcp_rows": offs.copy(), "rows.dcp_local_seq_lens": dcp.ravel()}
    write_dump(path, DumpConfig(dcp_size=2, sites=("attn_metadata",)), cols)
    return open_dumps([path])


@pytest.mark.parametrize("same_lead", [False, True], ids=["one-step", "one-bucket-many-steps"])
def test_thousands_of_wrong_views_cost_linear_work(tmp_path, monkeypatch, same_lead):
    n = 4000
    d = _one_step_dump(tmp_path / "d.safetensors", n, 4, same_lead)
    exact = _budget(monkeypatch, provenance, "expected_of", 4 * n)  # the exact comparisons
    seqs = _budget(monkeypatch, Dump, "seq_lens_of", 8 * n)  # rank-sum compared every pair of a group
    res = replay(d, "torch")
    assert len(res.findings) == n and {f.rule for f in res.findings} == {"mismatch"}
    assert exact[0] <= 4 * n and seqs[0] <= 8 * n


def test_many_identical_wrong_views_cite_their_source(tmp_path, monkeypatch):
    """2,000 observations of one step all holding the rows observation 0 must hold: each is stale from the
    one observation that holds them, found without comparing against every earlier one."""
    seq = np.array([100, 60, 9, 0], np.int32)
    first = obs(step=0, rank=0, seq=seq, num_reqs=3)
    copies = [obs(step=0, rank=0, seq=(101, 61, 10, 0), num_reqs=3, view=local_np(seq, 2, 0, 1) * [1, 1, 1, 0])
              for _ in range(2000)]
    d = open_dumps([write(tmp_path / "d.safetensors", [first] + copies)])
    exact = _budget(monkeypatch, provenance, "expected_of", 4 * 2000)
    res = replay(d, "torch")
    assert [(f.obs, f.rule, f.source.obs) for f in res.findings] == [(k, "stale", 0) for k in range(1, 2001)]
    assert exact[0] <= 4 * 2000


@pytest.mark.parametrize("block", [1, 7, 1 << 16])
def test_lead_follows_a_streamed_read(tmp_path, monkeypatch, block):
    """lead() on a dump still being read (blocks of LEAD_BLOCK observations, each once its rows are in) gives
    the one read's expected rows 0 and 1: against the formula row by row, 0 past num_reqs."""
    from conftest import random_dump

    import dcptool.dump as dump_mod
    from dcptool.dump import stream

    monkeypatch.setattr(stream, "STREAM_PIECE", 256)
    monkeypatch.setattr(provenance, "LEAD_BLOCK", block)
    path = tmp_path / "r.safetensors"
    one = random_dump(path, np.random.default_rng(3), 257, 4, 16)
    s = dump_mod.read_dump(path, stream=True)
    got = provenance.Provenance(s).lead()
    s.finish()
    c = one.config
    for j, col in enumerate(got):
        want = [int(local_np(one.seq_lens_of(i)[j], c.dcp_size, int(one["obs.rank"][i]), c.cp_interleave))
                if one["obs.num_reqs"][i] > j else 0 for i in range(one.n)]
        assert col.tolist() == want and any(want)
    assert [x.tolist() for x in provenance.Provenance(one).lead()] == [x.tolist() for x in got]


@pytest.mark.parametrize("bulk", [1, 7, 64])
def test_the_search_in_blocks_of_wrong_views_agrees_with_the_naive_precedence(tmp_path, monkeypatch, bulk):
    """prepare() searches BULK_ROWS recorded rows of wrong views at a time (a recording wrong everywhere is not
    searched at once): blocks of one view or a few give the precedence's answers."""
    monkeypatch.setattr(provenance, "BULK_ROWS", bulk)
    for seed in range(8):
        d = _coincidental_dump(tmp_path / f"d{seed}.safetensors", seed)
        for f in replay(d, "torch").findings:
            if f.rule in ("stale", "global", "wrong-rank", "wrong-interleave", "mismatch"):
                got = None if f.source is None else (f.source.index, f.source.relation)
                assert (f.rule, got, f.detail) == naive_explain(d, f.index, _recorded(d, f.index)), f.message


def _value_answers(d: Dump) -> list[tuple]:
    return [(f.index, f.rule, None if f.source is None else (f.source.index, f.source.relation), f.detail)
            for f in replay(d, "torch").findings
            if f.rule in ("stale", "global", "wrong-rank", "wrong-interleave", "mismatch")]


@pytest.mark.parametrize("n", [1, 127, 128, 129, 1000])
@pytest.mark.parametrize("seed", range(3))
def test_blocks_find_the_sources_one_search_finds(tmp_path, monkeypatch, n, seed):
    """Each block of wrong views looks up its own candidates in the keys indexed once for all (segments.KeyIndex):
    blocks of a few rows give the answers of one block of them all (where the lookup is every candidate the
    old whole-column pass found), on dumps of up to 1,000 observations over n / 8 steps."""
    d = _coincidental_dump(tmp_path / "d.safetensors", seed, max_rows=6, n=n)
    whole = _value_answers(d)
    assert whole or n == 1
    for bulk in (1, 7, 64):
        monkeypatch.setattr(provenance, "BULK_ROWS", bulk)
        assert _value_answers(open_dumps([tmp_path / "d.safetensors"])) == whole


def _far_sources(noise: int, seed: int) -> list:
    """Rank 0 of DCP 2: step 0 holds two clean observations (A on rank 0 and rank 1, whose rank-1 rows no view
    holds); steps 1..noise one wrong view each (random rows: mismatches, many blocks); the last step a clean B,
    then views holding B's expected rows (earlier-in-step, a clean source), A's rank-0 expected rows with zeros
    after them (earlier-step, a clean source in a step no wrong view is in), and step 1's expected rows
    (earlier-step, a source itself wrong, in the first block)."""
    rng = np.random.default_rng(seed)
    a, b = np.array([301, 77, 40, 0], np.int32), np.array([520, 33, 9, 0], np.int32)
    first = rng.integers(200, 900, 4).astype(np.int32)
    out = [obs(step=0, rank=0, seq=a, num_reqs=3), obs(step=0, rank=1, seq=a, num_reqs=3)]
    for k in range(1, noise + 1):
        seq = first if k == 1 else rng.integers(200, 900, 4).astype(np.int32)
        out.append(obs(step=k, rank=0, seq=seq, num_reqs=4, num_reqs_padded=4,
                       view=rng.integers(1000, 2000, 4).astype(np.int32)))
    last = noise + 1
    own = rng.integers(200, 900, 4).astype(np.int32)
    out += [obs(step=last, rank=0, seq=b, num_reqs=3),
            obs(step=last, rank=0, seq=own, num_reqs=2, view=expected_view(b, 2, 4, 2, 0)),
            obs(step=last, rank=0, seq=own, num_reqs=4, num_reqs_padded=4, view=expected_view(a, 3, 4, 2, 0)),
            obs(step=last, rank=0, seq=own, num_reqs=4, num_reqs_padded=4, view=expected_view(first, 4, 4, 2, 0))]
    return out


@pytest.mark.parametrize("bulk", [1, 4, 64, 1 << 20])
@pytest.mark.parametrize("noise", [0, 1, 127, 128, 129, 1000])
def test_a_source_outside_every_block_is_still_cited(tmp_path, monkeypatch, bulk, noise):
    """A block's candidates are narrowed by its views' keys, not by the steps or observations the blocks hold:
    a view whose source is clean (never a wrong view), in a step no wrong view is in, or a wrong view of the
    first block, is explained as one search over every observation explains it (the naive precedence)."""
    monkeypatch.setattr(provenance, "BULK_ROWS", bulk)
    d = open_dumps([write(tmp_path / "d.safetensors", _far_sources(noise, noise + bulk))])
    got = _value_answers(d)
    for i, rule, src, detail in got:
        assert (rule, src, detail) == naive_explain(d, i, _recorded(d, i))
    b = noise + 2  # the last step's clean observation
    third = (b + 3, "stale", (2, "earlier-step"), {}) if noise else (b + 3, "mismatch", None, {})
    assert got[-3:] == [(b + 1, "stale", (b, "earlier-in-step"), {}), (b + 2, "stale", (0, "earlier-step"), {}), third]
    assert [r for _, r, _, _ in got[:-3]] == ["mismatch"] * noise
