"""columns.py: the decode path's dcp_query_start_loc and global companion, the slot mappings (under PCP
too), and the faults injected on them, each found exactly where it touched."""

import numpy as np
import pytest
from simulate_cases import EXERCISE, MATRIX, SMALL, config_of, run, verify

from dcptool.check.replay import replay
from dcptool.dcp.slicing import pcp_partition
from dcptool.dump import open_dumps
from dcptool.model.columns import Columns
from dcptool.model.config import HANDED, OPT_IN, applicability
from dcptool.model.rows import make_rows
from dcptool.model.simulate import FAULTS, SimConfig, simulate


def test_tot_local_with_a_sentinel_records_every_observation(tmp_path):
    """tot-local hands the global companion this rank's local lengths; with `sentinel` the view's padded rows hold
    -1, which no global length can be: only the real rows are taken, so no observation is dropped (it was, and
    the tot-local fault with it) and tot-lens still finds the fault."""
    import warnings

    cfg = config_of(EXERCISE["tot-local"], 3, inject=("tot-local", "sentinel"), steps=20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a dropped observation warns
        res, d, rr = run(cfg, tmp_path)
    assert res.faults["tot-local"].count > 0 and res.faults["sentinel"].count > 0
    assert "tot-lens" in rr.by_rule() and "padding" in rr.by_rule()
    assert (d["rows.dcp_tot_seq_lens"] >= 0).all()


def test_issue15_faults_are_opt_in_not_legacy_and_fixed_records_the_decode_path(tmp_path):
    from dcptool.model.config import TRANSFER_FAULTS

    assert OPT_IN == {"dcp-qsl-local", "tot-local", "rank-disagree", "slot-wrong-group", "slot-all-ranks",
                      "ctx-rank-local", "ctx-chunk-unaligned", "ctx-draft-lens", "swa-sharded", "spec-causal-offset",
                      "topk-tie-split", "topk-empty-nan", *TRANSFER_FAULTS} | HANDED
    assert OPT_IN <= set(FAULTS)
    assert not OPT_IN & set(config_of(MATRIX[2], 1, pipeline="legacy").faults)
    res, d, rr = run(config_of(MATRIX[5], 1), tmp_path)
    assert rr.findings == [] and not {"empty-mask", "tot-lens"} & set(rr.skipped)
    q, t = np.diff(d["obs.dqsl"]), np.diff(d["obs.tot"])
    assert (q > 0).sum() > 0 and np.array_equal(t[q > 0], q[q > 0] - 1)  # companion: num_decodes rows
    for i in np.flatnonzero(q > 0)[:50]:  # Q is query_start_loc's prefix, the same on every rank
        assert np.array_equal(d.dqsl_of(i), d.qsl_of(i)[: q[i]])
        assert np.array_equal(d.tot_of(i), d.seq_lens_of(i)[: t[i]])
    sites = {d.site_name(i) for i in np.flatnonzero(q > 0)}
    assert "prepare_inputs" not in sites and "attn_metadata" in sites  # attention builds only


@pytest.mark.parametrize("fault", ["dcp-qsl-local", "tot-local", "rank-disagree"])
def test_issue15_fault_found_exactly_where_it_touched_per_rank_files_too(fault, tmp_path):
    for per_rank in (False, True):
        cfg = config_of(EXERCISE[fault], 5, inject=(fault,))
        res = simulate(cfg, tmp_path / f"{per_rank}.safetensors", force=True, per_rank=per_rank)
        d = open_dumps(res.files)
        rr = replay(d, "torch")
        assert res.faults[fault].count > 0
        verify(res, d, rr)
        assert set(rr.by_rule()) == {FAULTS[fault][0]}


def test_slot_faults_per_rank_files_like_one_file(tmp_path):
    """the slot columns go through observe() per rank as through observe_many(), and each slot fault
    is found exactly where it touched in either layout; the fixed pipeline writes them and replays clean."""
    cfg = SimConfig(dcp=4, interleave=2, pcp=1, inject=("slot-wrong-group", "slot-all-ranks"), **SMALL)
    one, d1, r1 = run(cfg, tmp_path, "one.safetensors")
    many, dn, rn = run(cfg, tmp_path, "many.safetensors", per_rank=True)
    assert d1.has("obs.slots") and dn.has("obs.slots") and d1.config.kv_groups == dn.config.kv_groups
    assert np.array_equal(np.sort(d1["rows.slot_mapping"]), np.sort(dn["rows.slot_mapping"]))
    for res, d, rr in ((one, d1, r1), (many, dn, rn)):
        verify(res, d, rr)
        assert {"slots", "slot-partition"} <= set(rr.by_rule())
    fixed = run(SimConfig(dcp=4, interleave=2, pcp=1, **SMALL), tmp_path, "fixed.safetensors")[2]
    assert fixed.findings == [] and "slots" not in fixed.skipped


def test_pcp_local_rows_write_their_requests_slots_owned_over_dcp_only():
    """under PCP a rank's batch is its local rows. A prefill's two chunks (chunks p and 2P-1-p) are two
    rows of one request: they write into that request's blocks, at the positions the chunks cover; a decode every PCP
    rank holds writes the same slot on each. Ownership is over the DCP ranks only (vLLM's BlockTables(cp_size=
    dcp_size)), never pcp_size * dcp_size: across the DCP ranks of one PCP rank each token is written exactly once."""
    P, N, B = 2, 2, 16
    cfg = SimConfig(dcp=N, pcp=P, page_size=B, max_model_len=1024)
    cols = Columns(cfg, frozenset())
    per_req = -(-cfg.max_model_len // B) + 1
    q, comp = np.array([1, 40]), np.array([299, 0])  # a decode, a 40-token prefill from position 0
    got = []
    for p in range(P):
        lb = pcp_partition(q, comp, q > 1, P, p, N)
        rows = make_rows(lb.query_lens, lb.seq_lens, lb.num_reqs + 1, 24, lb.req)  # a padded row, padded tokens
        pos, out = cols.slots(rows, "final", "step", 0, [])
        real = lb.num_tokens
        req = np.repeat(lb.req, lb.query_lens)
        # the decode, then chunk p (10 tokens from 10p) and chunk 3-p (from 30-10p) of request 1
        assert pos[:real].tolist() == [299] + list(range(10 * p, 10 * p + 10)) + list(range(30 - 10 * p, 40 - 10 * p))
        assert (pos[real:] == 0).all() and (out[:, :, real:] == -1).all()
        owner = pos[:real] // cfg.interleave % N
        assert ((out[:, 0, :real] >= 0) == (owner == np.arange(N)[:, None])).all()  # sharded: the DCP owner only
        assert (out[:, 1, :real] >= 0).all()  # replicated: every DCP rank
        assert ((out[:, 1, :real] // B) // per_req == req).all()  # each token in its own request's blocks
        got.append({(int(r), int(x)): out[:, :, k] for k, (r, x) in enumerate(zip(req, pos[:real]))})
    assert np.array_equal(got[0][(0, 299)], got[1][(0, 299)])  # the decode: one slot, whichever PCP rank holds it
    assert not (set(got[0]) - {(0, 299)}) & set(got[1])  # the prefill's tokens: each on one PCP rank


def test_slot_faults_under_pcp_found_exactly_and_fixed_pcp_replays_clean(tmp_path):
    """simulate --pcp 2 records slot columns on every PCP rank's local builds (and its micro-batches); the fixed
    pipeline replays clean with `slots` and `slot-partition` run, not skipped; each slot fault injected under PCP is
    found exactly where it touched, in one file and in per-rank files."""
    base = dict(dcp=4, interleave=2, pcp=2, spec_tokens=2, ubatches=2, **SMALL)
    res, d, rr = run(SimConfig(**base), tmp_path, "fixed.safetensors")
    assert rr.findings == [] and not {"slots", "slot-partition"} & set(rr.skipped)
    assert d.config.kv_groups is not None and d.config.pcp_size == 2
    offs, sm = d["obs.slots"], d["rows.slot_mapping"]
    recorded = np.flatnonzero(np.diff(offs) > 0)
    assert "prepare_inputs" not in {d.site_name(i) for i in recorded}  # the local batches, not the global one
    wrote = {d.site_name(i) for i in recorded if (sm[offs[i] : offs[i + 1]] >= 0).any()}
    assert wrote == {"pcp_partition", "ubatch"}  # (dummy runs and capture write nothing)
    for fault in ("slot-wrong-group", "slot-all-ranks"):
        assert applicability(SimConfig(**base))[fault] is None
        for per_rank in (False, True):
            cfg = SimConfig(**base, inject=(fault,))
            r, dd, found = run(cfg, tmp_path, f"{fault}{per_rank}.safetensors", per_rank=per_rank)
            assert r.faults[fault].count > 0
            verify(r, dd, found)
            assert FAULTS[fault][0] in found.by_rule()


# --------------------------------------------------------------------------------------------
# The features (--features chunked-context, swa, sparse) and their faults

CTX_FAULTS = ("ctx-rank-local", "ctx-chunk-unaligned", "ctx-draft-lens", "swa-sharded", "spec-causal-offset",
              "topk-tie-split", "topk-empty-nan")
# --dcp 4 with full CUDA graphs: alone, with PCP 2 and micro-batches, with DFlash, with MTP and interleave 16
CTX_ROWS = [(4, 1, 1, 2, 2, "full", "mtp"), (4, 1, 2, 2, 2, "full", "mtp"), (4, 1, 1, 3, 1, "full", "dflash"),
            (4, 16, 1, 2, 1, "full", "mtp")]


@pytest.mark.parametrize("row", MATRIX, ids=lambda r: "N{}-I{}-P{}-K{}-U{}-{}-{}".format(*r))
def test_the_features_are_recorded_on_every_attention_build_and_replay_clean(row, tmp_path):
    """With the features every attention build records the chunked-context schedule every rank shares (vLLM's plan
    of its prefill rows' computed context, each such row covered, back to back; [0] where there is none), each
    KV-cache group's lengths (the sliding-window group's the global ones) and its decode tokens' verify bounds; it
    replays clean."""
    from dcptool.dcp import chunks as C
    from dcptool.dcp.reference import group_lens_np, verify_lens_np

    res, d, rr = run(config_of(row, 17, features=("chunked-context", "swa", "sparse")), tmp_path)
    assert rr.findings == [] and res.faults == {}
    n = np.diff(d["obs.ctx"])
    sites = {d.site_name(i) for i in np.flatnonzero(n > 0)}
    assert "prepare_inputs" not in sites and (n > 0).sum() == sum(d.site_name(i) != "prepare_inputs" for i in
                                                                  range(d.n))
    many = np.flatnonzero(n > 1)
    assert many.size > 0
    for i in many[:40]:
        s = d["rows.ctx_chunks"][d["obs.ctx"][i]:d["obs.ctx"][i + 1]]
        seq, q = d.seq_lens_of(i).astype(np.int64), np.diff(d.qsl_of(i)).astype(np.int64)
        assert C.first_problem(s, seq, d.qsl_of(i), int(d["obs.num_reqs"][i]), row[0], row[1]) is None
        rows = set(s[1:].reshape(-1, 4)[:, 1].tolist())
        assert all(seq[r] - q[r] > 0 for r in rows)
    assert [g.name for g in d.config.kv_groups] == ["attn", "mamba", "swa"] and d.config.group_cp(3).tolist() == [
        row[0], 1, 1]
    gl, vl = np.diff(d["obs.gsl"]), np.diff(d["obs.vrl"])
    assert np.array_equal(gl > 0, n > 0) and (vl > 0).sum() > 0
    for i in np.flatnonzero(vl > 0)[:40]:
        seq, nr, r = d.seq_lens_of(i), int(d["obs.num_reqs"][i]), int(d["obs.rank"][i])
        assert np.array_equal(d["rows.group_seq_lens"][d["obs.gsl"][i]:d["obs.gsl"][i + 1]],
                              group_lens_np(seq, nr, r, row[0], row[1], [True, False, False]))
        assert np.array_equal(d["rows.verify_row_lens"][d["obs.vrl"][i]:d["obs.vrl"][i + 1]],
                              verify_lens_np(seq, d.qsl_of(i), int(vl[i]), r, row[0], row[1]))
    _sparse_topk_is_the_model(d, row, n)


def _sparse_topk_is_the_model(d, row, ctx_lens) -> None:
    """Every attention build records its real query tokens' top-k rows: the fingerprint of the model indexer's set
    (computed from its explicit ids), the rank's share of it and the state that share asks for."""
    from dcptool.dcp import topk

    tk = np.diff(d["obs.topk"])
    assert np.array_equal(tk > 0, ctx_lens > 0) and (tk % 3 == 0).all()
    empty = 0
    for i in np.flatnonzero(tk > 0)[::7][:30]:
        v = d["rows.sparse_topk"][d["obs.topk"][i]:d["obs.topk"][i + 1]].reshape(-1, 3).astype(np.int64)
        seq, q, r = d.seq_lens_of(i).astype(np.int64), d.qsl_of(i).astype(np.int64), int(d["obs.rank"][i])
        q = q - q[0]
        t = np.arange(v.shape[0])
        at = np.searchsorted(q[1:], t, "right")
        ids = topk.model_ids(topk.model_bounds(seq[at] - (q[at + 1] - t) + 1))
        assert np.array_equal(v[:, 0], topk.fingerprint(ids))
        assert np.array_equal(v[:, 1], topk.owned(ids, r, row[0], row[1]))
        assert np.array_equal(v[:, 2], np.where(v[:, 1] == 0, topk.EMPTY_STATE, 0))
        empty += int((v[:, 1] == 0).sum())
    assert row[0] == 1 or empty > 0


@pytest.mark.parametrize("fault", CTX_FAULTS)
@pytest.mark.parametrize("row", CTX_ROWS, ids=["N4-full-U2", "N4-P2-U2", "N4-dflash", "N4-I16"])
def test_feature_faults_found_exactly_where_they_touched(fault, row, tmp_path):
    """Each fault, with --dcp 4 and full CUDA graphs (with or without PCP 2, micro-batches, MTP or DFlash), is
    found as its rule exactly at the observations it touched; one file or one per rank."""
    for per_rank in (False, True):
        cfg = config_of(row, 23, inject=(fault,), steps=14)
        res = simulate(cfg, tmp_path / f"{per_rank}.safetensors", force=True, per_rank=per_rank)
        d = open_dumps(res.files)
        rr = replay(d, "torch")
        rep = res.faults[fault]
        if fault == "ctx-chunk-unaligned" and rep.count == 0:
            continue  # (N * I = 4 or 64 divides the workspace over 1, 2 or 4 prefills: odd counts misalign, and a
            #            short run may have none; EXERCISE's N = 3 misaligns at every count)
        assert rep.applicable and rep.count > 0, (fault, row)
        verify(res, d, rr)
        assert FAULTS[fault][0] in rr.by_rule()
        # (side: rank-local plans do not cover the context)
        assert set(rr.by_rule()) <= {"ctx-agree", "ctx-chunks", "group-lens", "topk-agree", "topk-empty"}


def test_a_fault_models_the_feature_it_needs_and_features_are_checked():
    from dcptool.model.config import FEATURES, SimError

    assert FEATURES == ("chunked-context", "swa", "sparse")
    cfg = SimConfig(inject=("ctx-rank-local",))
    assert cfg.modelled == {"chunked-context"} and SimConfig().modelled == frozenset()
    c = SimConfig(features=("chunked-context",))
    assert c.modelled == {"chunked-context"} and "--features chunked-context" in c.command()
    assert SimConfig(inject=("spec-causal-offset",)).modelled == {"swa"}
    assert SimConfig(inject=("topk-empty-nan",)).modelled == {"sparse"}
    with pytest.raises(SimError, match="--features: unknown feature bogus"):
        SimConfig(features=("bogus",)).validate()


# vLLM #51031 on --dcp 4 with full graphs: with and without PCP 2, micro-batches, MTP and DFlash; and the matrix's
# rows whose interleave (16, the page size) the kernel's half block does not take
KERNEL_BLOCK_ROWS = [(4, 16, 1, 2, 1, "full", "mtp"), (4, 16, 2, 2, 2, "full", "mtp"),
                     (4, 16, 1, 3, 2, "full", "dflash"), (4, 16, 2, 0, 2, "full", "mtp")] + [
    r for r in MATRIX if r[0] > 1 and r[1] == 16]


@pytest.mark.parametrize("row", KERNEL_BLOCK_ROWS, ids=[f"N{r[0]}-I{r[1]}-P{r[2]}-K{r[3]}-U{r[4]}-{r[5]}-{r[6]}"
                                                        for r in KERNEL_BLOCK_ROWS])
def test_slot_kernel_block_is_found_exactly_where_it_touched(row, tmp_path):
    """slot-kernel-block (vLLM 0.22-0.28's slot kernel, dealing by the kernel's half block): every build whose slot
    mapping the kernel computed records the block sizes and is found by kernel-block, at every rank; the slots its
    deal moves are `slots` findings at those builds only; nothing else anywhere."""
    cfg = config_of(row, 11, inject=("slot-kernel-block",), steps=8)
    res, d, rr = run(cfg, tmp_path)
    rep = res.faults["slot-kernel-block"]
    assert rep.applicable and rep.count > 0
    verify(res, d, rr)
    assert "kernel-block" in rr.by_rule() and set(rr.by_rule()) <= {"kernel-block", "slots", "slot-partition"}
    recorded = np.flatnonzero(np.diff(d["obs.kvbs"]) > 0)
    assert sorted(rep.touched[res.files[0]]) == recorded.tolist()
    assert {d.site_name(i) for i in recorded} <= {"attn_metadata", "pcp_partition", "ubatch"}
    kvbs = d["rows.kv_block_sizes"].reshape(-1, 6)
    assert (kvbs == [16, 8, 8, 16, 16, 16]).all()


def test_slot_kernel_block_needs_an_interleave_the_half_block_does_not_take(tmp_path):
    """Dealing by the kernel's block moves positions only where the interleave does not divide it: interleave 1 or
    8 under 16-token pages is not the bug (not applicable, nothing recorded), 16 is; per-rank files as one."""
    why = applicability(config_of((4, 8, 1, 0, 1, "full", "mtp"), 1))["slot-kernel-block"]
    assert why is not None and "--interleave" in why
    res, d, rr = run(config_of((4, 1, 1, 0, 1, "full", "mtp"), 1, inject=("slot-kernel-block",)), tmp_path)
    assert not res.faults["slot-kernel-block"].applicable and rr.findings == [] and not d.has("obs.kvbs")
    row = EXERCISE["slot-kernel-block"]
    one = run(config_of(row, 3, inject=("slot-kernel-block",)), tmp_path, "one.safetensors")
    res = simulate(config_of(row, 3, inject=("slot-kernel-block",)), tmp_path / "pr.safetensors", per_rank=True)
    d = open_dumps(res.files)
    rr = replay(d, "torch")
    verify(res, d, rr)
    assert rr.by_rule() == one[2].by_rule()


PLAN_ROWS = [(4, 1, 1, 2, 1, "full", "mtp"), (4, 1, 2, 2, 2, "full", "mtp"), (4, 16, 1, 3, 2, "full", "dflash"),
             (4, 1, 2, 0, 2, "full", "mtp"), (8, 16, 2, 0, 1, "none", "mtp")]


@pytest.mark.parametrize("row", PLAN_ROWS, ids=[f"N{r[0]}-I{r[1]}-P{r[2]}-K{r[3]}-U{r[4]}-{r[5]}-{r[6]}"
                                                for r in PLAN_ROWS])
def test_flashinfer_prefill_pages_is_found_exactly_where_it_touched(row, tmp_path):
    """The prefill half of vLLM #48003: the plans' prefill counts and last pages of the global lengths, recorded at
    every build whose plan is recorded; plan-pages exactly at the ranks where a value differs from the local
    context's, nothing else anywhere; the columns hold -1 on the rows they do not claim."""
    cfg = config_of(row, 19, inject=("flashinfer-prefill-pages",), steps=8)
    res, d, rr = run(cfg, tmp_path)
    rep = res.faults["flashinfer-prefill-pages"]
    assert rep.applicable and rep.count > 0
    verify(res, d, rr)
    assert set(rr.by_rule()) == {"plan-pages"}
    pre, last = d["rows.kv_prefill_pages"], d["rows.kv_last_page"]
    assert (pre >= -1).all() and (last >= -1).all() and (pre >= 0).any() and (last >= 0).any()
