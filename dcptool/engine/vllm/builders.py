"""The vLLM plugin's wrappers of the attention backends' metadata builders: what FlashInfer and MLA hand attention.

vLLM's build_attn_metadata runs one metadata builder per attention group. What a builder derives from the batch is
handed to attention and to nothing else, so it is read where the builder returns it: the FlashInfer builder's
`dcp_query_start_loc` (its trtllm-gen/XQA decode metadata, 0.30+) and the page counts its native plans claim
(`num_blocks_np`, as `_compute_flashinfer_kv_metadata` receives them), and the MLA common builder's
`dcp_tot_seq_lens` (its decode metadata) and chunked prefill context (its prefill metadata's chunks, with the
max_context_chunk its plan, plan_mla_context_chunks, was given). The build_attn_metadata hook (hooks) opens a `Build`
around the engine's call; the builders' hooks fill it; the hook records them with the build's observation.
"""

from __future__ import annotations

import functools

from dcptool.engine.vllm.state import STATE, broken, set_page_size

PAGE_MISMATCH = "page counts of another page size than the recording's"


class Build:
    """The builders' columns of one build_attn_metadata call (a dict, first builder wins per column)."""

    __slots__ = ("got", "prev")

    def __enter__(self) -> dict:
        self.prev = getattr(STATE.local, "built", None)
        self.got = STATE.local.built = {}
        return self.got

    def __exit__(self, *exc):
        STATE.local.built = self.prev
        return False


def _wrap_builder(take):
    """A builder method's wrapper: the engine's call, then `take(builder, result, got, sig, args, kwargs)` reads
    what it handed attention into the current build's dict (none outside build_attn_metadata: not recorded)."""

    def make(orig, sig):
        @functools.wraps(orig)
        def build(*args, **kwargs):
            res = orig(*args, **kwargs)
            got = getattr(STATE.local, "built", None)
            if got is not None and STATE.active:
                try:
                    take(args[0], res, got, sig, args, kwargs)
                except Exception as e:
                    broken(e)
            return res

        return build

    return make


def _take_flashinfer(builder, res, got: dict, sig, args: tuple, kwargs: dict) -> None:
    """FlashInferMetadataBuilder.build: the decode path's dcp_query_start_loc (what mask_dcp_empty_shards_ gets), and
    this build's page counts (from the plan hook) as one value per request row."""
    dqsl = getattr(getattr(res, "decode", None), "dcp_query_start_loc", None)
    if dqsl is not None:
        got.setdefault("dcp_query_start_loc", dqsl)
    pages = got.pop(("plan", id(builder)), None)
    if pages is None or "kv_pages" in got or sig.get(args, kwargs, "common_prefix_len"):
        return  # (a cascade plan claims the pages past the common prefix only: not comparable)
    counts, page = pages
    if int(getattr(builder, "dcp_world_size", 1)) > 1:
        # under DCP a prefill row's plan covers its local context only (the new tokens attend separately):
        # unknown (-1) to the page-count rule, which checks cdiv(local length, page) on decode rows
        counts[int(res.num_decodes):] = -1
    got["kv_pages"] = (counts, page)


def wrap_plan(orig, sig):
    """FlashInferMetadataBuilder._compute_flashinfer_kv_metadata: the page counts the native plans are made from
    (paged_kv_indptr is their cumulative sum), as int32, kept for the build that called it."""

    @functools.wraps(orig)
    def _compute_flashinfer_kv_metadata(*args, **kwargs):
        got = getattr(STATE.local, "built", None)
        if got is not None and STATE.active:
            try:
                n = int(sig.get(args, kwargs, "num_reqs"))
                got[("plan", id(args[0]))] = (sig.get(args, kwargs, "num_blocks_np")[:n].astype("int32"),
                                              int(sig.get(args, kwargs, "page_size")))
            except Exception as e:
                broken(e)
        return orig(*args, **kwargs)

    return _compute_flashinfer_kv_metadata


def _take_mla(builder, res, got: dict, sig, args: tuple, kwargs: dict) -> None:
    """MLACommonMetadataBuilder.build: the global companion its decode metadata carries (dcp_tot_seq_lens), and the
    chunked prefill context its prefill metadata hands attention (ctx_chunks)."""
    tot = getattr(getattr(res, "decode", None), "dcp_tot_seq_lens", None)
    if tot is not None:
        got.setdefault("dcp_tot_seq_lens", tot)
    planned = got.pop(("ctx", id(builder)), 0)
    if "ctx_chunks" not in got and hasattr(res, "num_decodes"):
        got["ctx_chunks"] = ctx_schedule(getattr(getattr(res, "prefill", None), "chunked_context", None),
                                         int(res.num_decodes), planned)


def ctx_schedule(cc, num_decodes: int, max_context_chunk: int) -> list[int]:
    """The schedule dump.observation's ctx_chunks holds, from the chunked-context metadata attention gets
    (MLACommonPrefillMetadata.ChunkedContextMetadata: its chunks, each a request slice of the prefill rows, which
    follow the decodes, with each request's piece length; under DCP their starts are local, so a piece's global
    start is the sum of the request's pieces before it) and the max_context_chunk its plan was given; [0] for none
    (chunked_context None: this rank calls no DCP KV gather)."""
    if cc is None:
        return [0]
    out, done = [max_context_chunk], {}
    for c, chunk in enumerate(cc.chunks):
        first = int(chunk.request_slice.start)
        for k, n in enumerate(chunk.seq_lens.tolist()):
            r = first + k
            out += (c, num_decodes + r, done.get(r, 0), int(n))
            done[r] = done.get(r, 0) + int(n)
    return out


def wrap_verify(orig, sig):
    """AITER MLA's AiterMLAHelper.dcp_local_verify_row_lens (a static method): the rank-local KV length of every
    verify token of the decodes (speculative verification under DCP), kept for the build that asked for it
    (verify_row_lens: one value per token of the decode rows, which come first)."""

    @functools.wraps(orig)
    def dcp_local_verify_row_lens(*args, **kwargs):
        out = orig(*args, **kwargs)
        got = getattr(STATE.local, "built", None)
        if got is not None and STATE.active:
            got.setdefault("verify_row_lens", out)
        return out

    return staticmethod(dcp_local_verify_row_lens)


def wrap_ctx_plan(orig, sig):
    """plan_mla_context_chunks: the max_context_chunk the chunked context is planned with (the metadata keeps only
    the chunks), kept for the MLA build that called it."""

    @functools.wraps(orig)
    def plan_mla_context_chunks(*args, **kwargs):
        got = getattr(STATE.local, "built", None)
        if got is not None and STATE.active:
            built = getattr(STATE.local, "mla_builder", None)
            if built is not None:
                got[("ctx", built)] = int(sig.get(args, kwargs, "max_context_chunk"))
        return orig(*args, **kwargs)

    return plan_mla_context_chunks


wrap_flashinfer = _wrap_builder(_take_flashinfer)


def wrap_mla(orig, sig):
    """MLACommonMetadataBuilder.build (_take_mla), the builder noted while it runs (its plan's max_context_chunk is
    read by wrap_ctx_plan for it)."""
    inner = _wrap_builder(_take_mla)(orig, sig)

    @functools.wraps(orig)
    def build(*args, **kwargs):
        prev = getattr(STATE.local, "mla_builder", None)
        STATE.local.mla_builder = id(args[0])
        try:
            return inner(*args, **kwargs)
        finally:
            STATE.local.mla_builder = prev

    return build


def builder_kwargs(got: dict, rows: int, kw: dict) -> None:
    """The builders' columns of this build as observe() arguments; kv_pages one value per seq_lens row (-1: none)."""
    for k in ("dcp_query_start_loc", "dcp_tot_seq_lens", "verify_row_lens"):
        if k in got:
            kw[k] = got[k]
    if "ctx_chunks" in got:
        import numpy as np  # (the Recorder has imported it by now)

        kw["ctx_chunks"] = np.asarray(got["ctx_chunks"], np.int64)
    pages = got.get("kv_pages")
    if pages is None:
        return
    counts, page = pages
    if not set_page_size(page):
        STATE.skipped[PAGE_MISMATCH] += 1
        return
    if counts.shape[0] != rows:  # (a consumer that reads the whole seq_lens argument: rows past the build's)
        import numpy as np  # (the Recorder has imported it by now)

        full = np.full(rows, -1, np.int32)
        k = min(rows, counts.shape[0])
        full[:k] = counts[:k]
        counts = full
    kw["kv_pages"] = counts
