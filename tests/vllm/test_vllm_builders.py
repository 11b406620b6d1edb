"""What vLLM's attention-metadata builders hand attention, recorded through the plugin and replayed: the
FlashInfer builder's dcp_query_start_loc (0.30+) and the page counts of its plans, the MLA common builder's
dcp_tot_seq_lens. The builders are vLLM's own (backends.py), run by vLLM's build_attn_metadata for batches vLLM builds;
the empty-mask, tot-lens and pages rules check their values. Post-fix releases replay clean; 0.29's FlashInfer plans
count pages from the global lengths (PR #48003), and replay says so."""

import backends as B
import engine as E
import numpy as np
import pytest
from vllm.v1.attention.backends import flashinfer as fi
from vllm.v1.worker.gpu.cudagraph_utils import prepare_inputs_to_capture

from dcptool.check.replay import local_np, replay
from dcptool.dcp.reference import last_page
from dcptool.dump import open_dumps
from dcptool.engine import vllm as plugin

pytestmark = pytest.mark.vllm
GLOBAL_PAGES = E.VERSION.startswith("0.29.")  # pre-PR #48003: the plans' page counts are the global lengths'


def messages(res):
    return [f"{f.site} {f.rule}: {f.message}" for f in res.findings]


def run(dcp, drive, tmp_path, monkeypatch):
    d = open_dumps(E.run_ranks(dcp, drive, tmp_path, monkeypatch))
    return d, replay(d, "torch")


def step(q, s, dcp, rank, il, group, *, mode="none", nrp=None, ntp=None):
    """One real step: vLLM's batch, the runner's DCP step (0.30+), prepare_attn with the builder's group."""
    bufs = E.buffers(16, 256)
    b = E.prepare_inputs(q, s, bufs, num_tokens_padded=ntp, num_reqs_padded=nrp, dcp=(dcp, rank, il))
    if not E.PRE_FIX:
        E.dcp_step(b, bufs, dcp, rank, il)
    bt = B.tables(16, 256, dcp, rank, il)
    with plugin.step(runner=E.runner(bt, dcp, rank, il, bufs)):
        return b, B.attn(E.model_state(), b, bt, group, mode)


def test_the_builders_are_hooked_with_the_releases_table(tmp_path, monkeypatch):
    from vllm.model_executor.layers.attention import mla_attention as mla

    own = plugin.tables_for(E.VERSION)[0]
    for fn in (fi.FlashInferMetadataBuilder.build, fi.FlashInferMetadataBuilder._compute_flashinfer_kv_metadata,
               mla.MLACommonMetadataBuilder.build):
        assert fn.__wrapped_by_dcptool__, fn
    for mod in ("vllm.v1.attention.backends.flashinfer", "vllm.model_executor.layers.attention.mla_attention"):
        assert plugin.STATE.used[mod] == own.line
    d, _ = run(2, lambda rank: step([1], [9], 2, rank, 1, B.mla_builder(16, 2, 1)[1]), tmp_path, monkeypatch)
    assert f"builders: {own.builders}" in d.config.note
    assert ("no dcp_query_start_loc" in d.config.note) == (not B.HAS_DCP_QSL)


# --------------------------------------------------------------------------------------------
# FlashInfer: the decode path's dcp_query_start_loc and the plans' page counts

DECODES = ([1, 1, 1, 1, 1], [40, 33, 7, 1000, 64])
MIXED = ([1, 1, 1, 9, 16], [40, 17, 2, 100, 2048])  # three decodes, then two prefills (decodes first, as reordered)


def _random_batch(seed: int):
    """Seeded decodes then prefills (contexts of awkward sizes: a fresh prefill's 0, 1, 127-129, 1000+)."""
    rng = np.random.default_rng(seed)
    nd, npf = int(rng.integers(0, 4)), int(rng.integers(1, 4))
    q = [1] * nd + [int(x) for x in rng.integers(2, 40, npf)]
    ctx = rng.choice([0, 1, 127, 128, 129, 1000, 1500], nd + npf)
    return q, [int(c) + x for c, x in zip(ctx, q)]


FI_CASES = [  # (batch, dcp, interleave, page size, trtllm-gen decode)
    (DECODES, 2, 1, 16, True), (DECODES, 2, 1, 16, False), (MIXED, 2, 1, 16, True), (MIXED, 4, 16, 64, False),
    (DECODES, 4, 8, 32, False), (MIXED, 3, 1, 16, True),
] + [(_random_batch(k), *c) for k, c in enumerate([(2, 1, 16, False), (4, 8, 32, True), (3, 1, 16, False),
                                                    (4, 16, 64, False), (2, 1, 16, True)])]


@pytest.mark.parametrize("batch,dcp,il,page,trtllm", FI_CASES,
                         ids=[f"{'decode' if c[0] is DECODES else 'mixed' if c[0] is MIXED else f'random{k}'}-"
                              f"N{c[1]}-I{c[2]}-P{c[3]}-{'trtllm' if c[4] else 'native'}"
                              for k, c in enumerate(FI_CASES)])
def test_flashinfer_columns_are_vllms_and_replay(tmp_path, monkeypatch, batch, dcp, il, page, trtllm):
    q, s = batch
    built = []

    def drive(rank):
        b, g = B.flashinfer(page, 16, dcp, il, trtllm_decode=trtllm)
        plans = B.Plans(monkeypatch, b)
        _, md = step(q, s, dcp, rank, il, g)
        planned = plans.decode or plans.prefill
        built.append((md, np.diff(b.paged_kv_indptr.np[: len(q) + 1]) if planned else None,
                      b.paged_kv_last_page_len.np[: len(q)].copy() if planned else None))

    d, res = run(dcp, drive, tmp_path, monkeypatch)
    nd = sum(1 for x in q if x == 1)
    assert d.n == dcp and d.config.page_size == (page if built[0][1] is not None else None)
    misplanned = set()  # the ranks whose builder planned a read prefill count or last page off the local length
    for i, (md, pages, lasts) in enumerate(built):
        assert md.num_decodes == nd
        dqsl = getattr(md.decode, "dcp_query_start_loc", None)
        if trtllm and B.HAS_DCP_QSL:  # the Q mask_dcp_empty_shards_ gets: query_start_loc[:num_decodes + 1]
            got = d["rows.dcp_query_start_loc"][d["obs.dqsl"][i]:d["obs.dqsl"][i + 1]]
            assert got.tolist() == dqsl.tolist() == np.cumsum([0] + q[:nd]).tolist()
        else:
            assert dqsl is None
        if pages is None:  # trtllm-gen decode of a pure-decode batch plans no pages
            assert not d.has("rows.kv_pages")
            continue
        rows = slice(d["obs.rows"][i], d["obs.rows"][i + 1])
        kv, pre, last = (d[c][rows] for c in ("rows.kv_pages", "rows.kv_prefill_pages", "rows.kv_last_page"))
        native = type(md.decode).__name__ == "FIDecode"  # (trtllm-gen decode does not read the native plan)
        read = np.r_[np.full(nd, native), np.full(len(q) - nd, type(md.prefill).__name__ == "FIPrefill")]
        assert kv[:nd].tolist() == (pages[:nd].tolist() if native else [-1] * nd)  # the plan's own indptr
        assert (kv[nd:] == -1).all() and (pre[:nd] == -1).all()  # DCP prefill rows: their own field
        assert pre[nd:].tolist() == np.where(read[nd:], pages[nd:], -1).tolist()
        assert last.tolist() == np.where(read, lasts, -1).tolist()  # the builder's paged_kv_last_page_len
        rank = int(d["obs.rank"][i])
        local = local_np(np.asarray(s), dcp, rank, il)
        want = -(-np.asarray(s if GLOBAL_PAGES else local) // page)
        assert kv[:nd].tolist() == np.where(read[:nd], want[:nd], -1).tolist()
        ctx = local_np(np.asarray(s) - np.asarray(q) * (np.arange(len(q)) >= nd), dcp, rank, il)
        wrong = ((read[nd:] & (pages[nd:] != -(-ctx[nd:] // page))).any()
                 or (read & (lasts != last_page(ctx, page))).any())
        if wrong:
            misplanned.add(rank)
    assert sorted({f.rank for f in res.findings if f.rule == "plan-pages"}) == sorted(misplanned), messages(res)
    assert not misplanned or GLOBAL_PAGES  # (post-fix releases plan the local context)
    ran = {"pages": d.has("rows.kv_pages"), "empty-mask": trtllm and B.HAS_DCP_QSL}
    assert [r for r, on in ran.items() if on and r in res.skipped] == [], res.skipped
    # the host copy of seq_lens the builder read is recorded where it reads a shared one (0.29's seq_lens_cpu,
    # 0.33+'s exact upper bound; 0.30-0.32 read a fresh seq_lens.cpu()); 0.29's builder subtracts the prefill rows'
    # query lengths from the shared copy in place (PR #48003's second half): host-copy at every rank of a batch with
    # prefills, nowhere else
    assert d.has("obs.hseq") or not (GLOBAL_PAGES or E.VERSION >= "0.33")
    written = sorted(f.rank for f in res.findings if f.rule == "host-copy")
    assert written == (list(range(dcp)) if GLOBAL_PAGES and nd < len(q) else []), messages(res)
    assert all(f.detail["kind"] == "written-in-place" for f in res.findings if f.rule == "host-copy")
    pages = [f for f in res.findings if f.rule not in ("host-copy", "plan-pages")]
    if not GLOBAL_PAGES or built[0][1] is None:
        assert pages == [], messages(res)
        return
    # 0.29: the plans claim cdiv(global, page) pages on a rank that holds cdiv(local, page): PR #48003 (decode rows
    # where the native decode kernel reads them)
    dec = np.asarray(s[:nd])
    want = [r for r in range(dcp) if (-(-dec // page) != -(-local_np(dec, dcp, r, il) // page)).any()
            and type(built[0][0].decode).__name__ == "FIDecode"]
    assert {f.rule for f in pages} <= {"pages"} and sorted(f.rank for f in pages) == want, messages(res)
    known = {(p.known.bug.id, p.known.verdict) for p in res.problems}
    assert (("pr48003-flashinfer-global-pages", "match") in known) == bool(want)
    assert known <= {("pr48003-flashinfer-global-pages", "match"), ("pr48003-host-written", "match"),
                     ("pr48003-flashinfer-prefill-plans", "match")}
    assert (("pr48003-host-written", "match") in known) == bool(written)


@pytest.mark.parametrize("trtllm", [True, False], ids=["trtllm", "native"])
def test_flashinfer_full_graph_padded_batch_replays_clean(tmp_path, monkeypatch, trtllm):
    """A FULL-graph replay of a padded batch: the builder gets num_reqs_padded rows, padded rows are decodes of 0
    tokens; dcp_query_start_loc covers them, and their page counts (0) are not checked."""
    def drive(rank):
        b, g = B.flashinfer(16, 16, 2, 1, trtllm_decode=trtllm, mode="full")
        B.Plans(monkeypatch, b)
        step([1, 1, 1], [18, 26, 3], 2, rank, 1, g, mode="full", nrp=4, ntp=4)

    d, res = run(2, drive, tmp_path, monkeypatch)
    assert d["obs.num_reqs_padded"].tolist() == [4, 4] and d["obs.num_reqs"].tolist() == [3, 3]
    if trtllm and B.HAS_DCP_QSL:
        assert d["rows.dcp_query_start_loc"].tolist() == [0, 1, 2, 3, 3] * 2
    if not trtllm:  # local lengths [9, 13, 2] and [9, 13, 1]: one page of 16 each (0.29: the global 18, 26, 3)
        assert d["rows.kv_pages"].tolist() == ([2, 2, 1, 0] if GLOBAL_PAGES else [1, 1, 1, 0]) * 2
    # (0.29: the decode rows' counts and last pages of the global lengths, on each rank)
    want = ["pages", "plan-pages"] * 2 if GLOBAL_PAGES and not trtllm else []
    assert sorted(f.rule for f in res.findings) == sorted(want), messages(res)


def test_flashinfer_capture_records_the_builders_columns(tmp_path, monkeypatch):
    """CUDA-graph capture runs the builders too (build_for_cudagraph_capture): the capture observations carry them."""
    def drive(rank):
        bufs, bt = E.buffers(16, 64), B.tables(16, 64, 2, rank, 1)
        b, g = B.flashinfer(16, 16, 2, 1, trtllm_decode=True, mode="full")
        B.Plans(monkeypatch, b)
        for nr in (8, 4):
            prepare_inputs_to_capture(nr, nr, E.model_state(), bufs, bt, [[g[0]]], g[1], full_cudagraph=True)

    d, res = run(2, drive, tmp_path, monkeypatch)
    assert {d.site_name(i) for i in range(d.n)} == {"capture"}
    if B.HAS_DCP_QSL:
        assert sorted(np.diff(d["obs.dqsl"]).tolist()) == [5, 5, 9, 9]
    assert res.findings == [] or E.PRE_FIX, messages(res)  # (0.29's capture hands attention None: `missing`)


def test_flashinfer_plans_from_global_lengths_are_found(tmp_path, monkeypatch):
    """The pre-PR #48003 ordering on any release: page counts taken before the lengths are localised."""
    monkeypatch.setattr(fi, "get_dcp_local_seq_lens", lambda seq, *a, **k: seq)

    def drive(rank):
        b, g = B.flashinfer(16, 16, 2, 1)
        B.Plans(monkeypatch, b)
        step(*DECODES, 2, rank, 1, g)

    d, res = run(2, drive, tmp_path, monkeypatch)
    assert {f.rule for f in res.findings} == {"pages", "plan-pages"}, messages(res)  # (counts and last pages)
    f = next(f for f in res.findings if f.rule == "pages")
    assert f.recorded == -(-40 // 16) and f.expected == -(-20 // 16)


@pytest.mark.skipif(not E.HAS_UBATCH, reason=f"vLLM {E.VERSION} has no model-runner-V2 micro-batching")
def test_flashinfer_in_micro_batches(tmp_path, monkeypatch):
    """Each micro-batch runs its own builder: its columns go with its observation; the parent (recorded first, before
    any plan) gets the recording's page size too."""
    q, s = MIXED

    def drive(rank):
        bufs = E.buffers(16, 256)
        b = E.prepare_inputs(q, s, bufs)
        E.dcp_step(b, bufs, 2, rank, 1)
        bt = B.tables(16, 256, 2, rank, 1)
        builders = [B.flashinfer(16, 16, 2, 1, trtllm_decode=True) for _ in range(2)]
        for x, _ in builders:
            B.Plans(monkeypatch, x)
        g, kv = builders[0][1]
        g.metadata_builders = [x for x, _ in builders]
        ur = E.ubatch_runner(E.model_state(), 16, 2, rank, 1)
        ur.attn_groups, ur.kv_cache_config = [[g]], kv
        with plugin.step(runner=E.runner(bt, 2, rank, 1, bufs)):
            E.ubatch_prepare(ur, b, bt, "none")

    d, res = run(2, drive, tmp_path, monkeypatch)
    assert d.n == 6 and d.config.page_size == 16 and d.has("rows.kv_pages")
    # each micro-batch's own decodes: the first holds the three, the second none (the rest of a prefill)
    dq = np.diff(d["obs.dqsl"])
    assert [dq[d["obs.ubatch"] == u].tolist() for u in (-1, 0, 1)] == [[0, 0], [4, 4], [0, 0]]
    kv, pre = ([d[c][d["obs.rows"][i]:d["obs.rows"][i + 1]].tolist() for i in range(3)]
               for c in ("rows.kv_pages", "rows.kv_prefill_pages"))
    # rank 0: the parent has no builder; micro-batch 0 plans its decodes' local pages (20, 9, 1 of 16), which the
    # trtllm-gen decode does not read (-1), and the local context of its two prefill rows (local of 100 - 9 and
    # 2034 - 9 at rank 0 of 2: 46 and 1013 tokens, 3 and 64 pages); micro-batch 1 is the rest of the last prefill
    assert d.seq_lens_of(1).tolist() == [40, 17, 2, 100, 2034] and kv == [[-1] * 5, [-1] * 5, [-1]]
    assert pre[1] == [-1, -1, -1, 3, 64]
    assert res.findings == [], messages(res)


# --------------------------------------------------------------------------------------------
# MLA: the decode metadata's dcp_tot_seq_lens


@pytest.mark.parametrize("dcp,il", [(2, 1), (4, 8), (3, 16)])
def test_mla_tot_seq_lens_are_the_global_lengths_and_replay_clean(tmp_path, monkeypatch, dcp, il):
    q, s = DECODES

    def drive(rank):
        step(q, s, dcp, rank, il, B.mla_builder(64, dcp, il)[1])

    d, res = run(dcp, drive, tmp_path, monkeypatch)
    assert d.has("obs.tot") and "tot-lens" not in res.skipped
    for i in range(d.n):
        assert d["rows.dcp_tot_seq_lens"][d["obs.tot"][i]:d["obs.tot"][i + 1]].tolist() == s
    assert res.findings == [], messages(res)


def test_mla_companion_holding_the_local_lengths_is_found(tmp_path, monkeypatch):
    """A builder that hands the decode kernels the local lengths as the global companion (docs/faults.md tot-local)."""
    def drive(rank):
        b, g = B.mla_builder(64, 2, 1)
        orig = b._build_decode
        b._build_decode = lambda **kw: orig(**{**kw, "dcp_tot_seq_lens_device": kw["seq_lens_device"]})
        step(*DECODES, 2, rank, 1, g)

    d, res = run(2, drive, tmp_path, monkeypatch)
    assert {f.rule for f in res.findings} == {"tot-lens"} and len(res.findings) == 2, messages(res)
    assert all(f.detail["local"] for f in res.findings)
