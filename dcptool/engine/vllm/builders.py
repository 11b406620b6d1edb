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

from dcptool.engine.vllm.state import STATE, broken, set_attn_tensors, set_page_size

PAGE_MISMATCH = "page counts of another page size than the recording's"
TENSOR_MISMATCH = "metadata tensors of another backend than the recording's first"


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


def _wrap_builder(take, before=None):
    """A builder method's wrapper: `before(builder, got, sig, args, kwargs)` reads what the call is handed, the
    engine's call, then `take(builder, result, got, sig, args, kwargs)` reads what it handed attention into the
    current build's dict (none outside build_attn_metadata: not recorded)."""

    def make(orig, sig):
        @functools.wraps(orig)
        def build(*args, **kwargs):
            got = getattr(STATE.local, "built", None)
            if before is not None and got is not None and STATE.active:
                try:
                    before(args[0], got, sig, args, kwargs)
                except Exception as e:
                    broken(e)
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


def _host_before(builder, got: dict, sig, args: tuple, kwargs: dict) -> None:
    """FlashInferMetadataBuilder.build under DCP: the host copy of seq_lens it reads, copied as it is handed in
    (common_attn_metadata.seq_lens_cpu; 0.33+: the exact upper bound it reads where it has no drafts to count)."""
    cm = sig.get(args, kwargs, "common_attn_metadata")
    if int(getattr(builder, "dcp_world_size", 1)) <= 1 or cm is None or "host_seq_lens" in got:
        return
    host = getattr(cm, "seq_lens_cpu", None)
    if host is None and getattr(builder, "_num_speculative_tokens", 1) == 0:
        host = getattr(cm, "seq_lens_cpu_upper_bound", None)
    if host is not None and getattr(host, "is_cuda", True) is False:
        got[("host", id(builder))] = (host, host.numpy().copy())


def _take_flashinfer(builder, res, got: dict, sig, args: tuple, kwargs: dict) -> None:
    """FlashInferMetadataBuilder.build: the decode path's dcp_query_start_loc (what mask_dcp_empty_shards_ gets), and
    this build's page counts (from the plan hook) as one value per request row."""
    dqsl = getattr(getattr(res, "decode", None), "dcp_query_start_loc", None)
    if dqsl is not None:
        got.setdefault("dcp_query_start_loc", dqsl)
    host = got.pop(("host", id(builder)), None)
    if host is not None:  # (as read, and as the build left the shared copy)
        got["host_seq_lens"] = (host[1], host[0].numpy().copy())
    pages = got.pop(("plan", id(builder)), None)
    if pages is None or "kv_pages" in got or sig.get(args, kwargs, "common_prefix_len"):
        return  # (a cascade plan claims the pages past the common prefix only: not comparable)
    counts, last, page = pages
    nd = int(res.num_decodes)
    # a decode row's counts where a decode kernel reads the native plan (not trtllm-gen's decode), a prefill row's
    # where its prefill kernel does (not TRTLLMPrefill); under DCP a prefill row's plan covers its local context
    # only (the new tokens attend separately): its own field, which plan-pages checks against cdiv(local context,
    # page)
    import numpy as np  # (the Recorder has imported it by now)

    native_decode = type(getattr(res, "decode", None)).__name__ != "FlashInferTrtllmAPIDecode"
    native_prefill = type(getattr(res, "prefill", None)).__name__ != "TRTLLMPrefill"
    dec = np.arange(counts.size) < nd
    read = np.where(dec, native_decode, native_prefill)
    if int(getattr(builder, "dcp_world_size", 1)) > 1:
        decode = np.where(read & dec, counts, -1).astype(np.int32)
        got["kv_plans"] = (np.where(read & ~dec, counts, -1).astype(np.int32),
                           None if last is None else np.where(read, last, -1).astype(np.int32))
    else:
        decode = np.where(read, counts, -1).astype(np.int32)
    got["kv_pages"] = (decode, page)


def wrap_plan(orig, sig):
    """FlashInferMetadataBuilder._compute_flashinfer_kv_metadata: the page counts the native plans are made from
    (paged_kv_indptr is their cumulative sum), as int32, kept for the build that called it."""

    @functools.wraps(orig)
    def _compute_flashinfer_kv_metadata(*args, **kwargs):
        got = getattr(STATE.local, "built", None)
        counts = None
        if got is not None and STATE.active:
            try:
                n = int(sig.get(args, kwargs, "num_reqs"))
                counts = sig.get(args, kwargs, "num_blocks_np")[:n].astype("int32")
            except Exception as e:
                broken(e)
        out = orig(*args, **kwargs)
        if counts is not None:
            try:  # (the last-page lengths the call wrote into the builder's buffer, where it has one)
                buf = getattr(getattr(args[0], "paged_kv_last_page_len", None), "np", None)
                last = None if buf is None else buf[:n].astype("int32")
                got[("plan", id(args[0]))] = (counts, last, int(sig.get(args, kwargs, "page_size")))
            except Exception as e:
                broken(e)
        return out

    return _compute_flashinfer_kv_metadata


FLASH_ATTN_TENSORS = ("dcp_context_kv_lens", "seq_lens")  # what FlashAttention's DCP path hands its kernels per request


def _take_flash_attn(builder, res, got: dict, sig, args: tuple, kwargs: dict) -> None:
    """FlashAttentionMetadataBuilder.build under DCP: the addresses of the per-request tensors its kernels read
    (dcp_context_kv_lens, the local context lengths, and seq_lens): a full graph replays the ones it captured."""
    ctx = getattr(res, "dcp_context_kv_lens", None)
    if ctx is None or "attn_addrs" in got:
        return
    got["attn_addrs"] = (FLASH_ATTN_TENSORS, (int(ctx.data_ptr()), int(res.seq_lens.data_ptr())))
    got["attn_caps"] = (_capacity(ctx), _capacity(res.seq_lens))


def _capacity(t) -> int:
    """The request rows the buffer behind a 1-D tensor holds from the tensor's start (a view of a persistent
    buffer: the rest of the buffer is there for a larger batch); -1 where unknown."""
    try:
        if t.dim() != 1 or t.stride(0) != 1:
            return -1
        return min(t.untyped_storage().nbytes() // t.element_size() - t.storage_offset(), 2**31 - 1)
    except (AttributeError, RuntimeError):
        return -1


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


wrap_flashinfer = _wrap_builder(_take_flashinfer, _host_before)
wrap_flash_attn = _wrap_builder(_take_flash_attn)


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


def _graph_key(kw: dict) -> tuple:
    """The CUDA graph a build's metadata is captured in or replayed by: vLLM keys its FULL graphs by the batch
    descriptor (padded tokens and requests, micro-batching), a drafter's apart from the model's."""
    return (kw["site"] in ("draft", "dflash_capture"), kw["num_reqs_padded"], kw.get("num_tokens_padded"),
            kw.get("ubatch", -1))


def _addresses(named: tuple, kw: dict) -> None:
    """The metadata tensors' addresses as observe() arguments (int32 words), named in the recording's config; at
    a full-graph capture they are remembered for the graph (a capture build itself may go unrecorded: the
    Recorder skips builds made during stream capture), at a replay the graph's captured ones go beside them."""
    names, ptrs = named
    from dcptool.dump.schema import GraphMode, addr_words  # (the Recorder imported it)

    if not set_attn_tensors(names):
        STATE.skipped[TENSOR_MISMATCH] += 1
        return
    words = addr_words(ptrs)
    kw["attn_addrs"] = words
    if kw["graph"] == GraphMode.FULL_CAPTURE:
        STATE.captured[_graph_key(kw)] = words
    elif kw["graph"] == GraphMode.FULL_REPLAY:
        kw["graph_addrs"] = STATE.captured.get(_graph_key(kw))


def builder_kwargs(got: dict, rows: int, kw: dict) -> None:
    """The builders' columns of this build as observe() arguments; kv_pages one value per seq_lens row (-1: none)."""
    for k in ("dcp_query_start_loc", "dcp_tot_seq_lens", "verify_row_lens"):
        if k in got:
            kw[k] = got[k]
    if "ctx_chunks" in got:
        import numpy as np  # (the Recorder has imported it by now)

        kw["ctx_chunks"] = np.asarray(got["ctx_chunks"], np.int64)
    if "host_seq_lens" in got:
        kw["host_seq_lens"], kw["host_seq_lens_after"] = got["host_seq_lens"]
    if "attn_addrs" in got:
        _addresses(got["attn_addrs"], kw)
        caps = got.get("attn_caps")
        if "attn_addrs" in kw and caps is not None and min(caps) >= 0:
            import numpy as np  # (the Recorder has imported it by now)

            kw["attn_caps"] = np.array(caps, np.int32)
    pages = got.get("kv_pages")
    if pages is None:
        return
    counts, page = pages
    if not set_page_size(page):
        STATE.skipped[PAGE_MISMATCH] += 1
        return
    if "kv_plans" in got and got["kv_plans"][1] is not None:
        kw["kv_prefill_pages"], kw["kv_last_page"] = (_per_row(x, rows) for x in got["kv_plans"])
    kw["kv_pages"] = _per_row(counts, rows)


def _per_row(counts, rows: int):
    """One value per seq_lens row: a consumer that reads the whole seq_lens argument has rows past the build's (-1)."""
    if counts.shape[0] == rows:
        return counts
    import numpy as np  # (the Recorder has imported it by now)

    full = np.full(rows, -1, np.int32)
    k = min(rows, counts.shape[0])
    full[:k] = counts[:k]
    return full
