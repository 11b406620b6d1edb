"""The vLLM plugin's KV transfers: NIXL's pull plans, recorded from the connector's own planning.

NIXL's pull worker plans each request in `_read_blocks_for_req` (its TP mapping's source ranks,
`_apply_dcp_prefix_caching`, `_logical_to_kernel_block_ids`; the region-mapped path per memory region) and posts one
`ReadSpec(remote_rank, local_block_ids, remote_block_ids)` per source rank through `_read_blocks`. The wrapper keeps
the request's block tables as the scheduler handed them (the call rewrites the remote ones), watches the ReadSpecs
on their way to `_read_blocks` (which still posts them), and records one transfer per request (dump.transfer) once
the call returns. Both sides' layouts come from what the handshake registered: the remote's TP and DCP sizes and
block sizes (its interleave is its block size under DCP: vLLM sets it so for NIXL), this worker's from its own."""

from __future__ import annotations

import functools

from dcptool.engine.vllm.state import STATE, broken, recorder

NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker"
_KINDS = (("MambaSpec", "mamba"), ("SlidingWindowMLASpec", "swa"), ("SlidingWindowSpec", "swa"),
          ("MLAAttentionSpec", "mla"), ("FullAttentionSpec", "attention"))


def wrap_nixl_read(orig, sig):
    """NixlPullConnectorWorker._read_blocks_for_req(req_id, meta): the call runs unchanged; its ReadSpecs recorded."""

    @functools.wraps(orig)
    def read_blocks_for_req(*args, **kwargs):
        if not STATE.active or STATE.guarding:
            return orig(*args, **kwargs)
        worker, req_id, meta = args[0], sig.get(args, kwargs, "req_id"), sig.get(args, kwargs, "meta")
        try:
            tables = ([list(g) for g in meta.remote.block_ids], [list(g) for g in meta.local_block_ids])
        except Exception as e:
            broken(e)
            return orig(*args, **kwargs)
        reads: list = []
        own = worker.__dict__.get("_read_blocks")
        post = own or worker._read_blocks

        def read(*a, **kw):
            reads.append(kw["read_spec"] if "read_spec" in kw else a[0])
            return post(*a, **kw)

        worker._read_blocks = read
        try:
            return orig(*args, **kwargs)
        finally:
            if own is None:
                del worker._read_blocks
            else:
                worker._read_blocks = own
            if reads and STATE.active:
                _record(worker, req_id, meta, tables, reads)

    return read_blocks_for_req


def _record(worker, req_id, meta, tables, reads) -> None:
    try:
        il = getattr(getattr(getattr(worker, "vllm_config", None), "parallel_config", None),
                     "cp_kv_cache_interleave_size", None)
        if isinstance(il, int) and STATE.interleave is None:
            STATE.interleave = il
        rec = recorder()
        if rec is None or not hasattr(rec, "record_transfer"):
            return
        with STATE.lock:
            rec.record_transfer(nixl_transfer(worker, req_id, meta, tables, reads, max(STATE.step, 0)))
    except Exception as e:  # never break the engine's transfer
        broken(e)


def _kind(spec_type) -> str:
    names = {c.__name__ for c in spec_type.__mro__}
    return next(kind for name, kind in _KINDS if name in names)


def nixl_transfer(worker, req_id: str, meta, tables, reads, step: int):
    """The transfer NIXL planned for one request on this decode worker (dump.transfer.TransferRecord): `tables` are
    the remote's and this worker's logical block ids per group as the scheduler handed them, `reads` the ReadSpecs
    posted (kernel block ids per group; per memory region where `block_ids_by_region`)."""
    from dcptool.dump.transfer import GroupPlan, Side, TransferRecord

    engine = meta.remote.engine_id
    topo = worker.transfer_topo
    info = topo.get_engine_info(engine)
    rdcp = int(getattr(info, "remote_dcp_size", 1))
    r_kernel = int(info.remote_block_size)
    r_block = r_kernel * int(info.remote_physical_blocks_per_logical)
    l_kernel = int(worker.block_size)
    l_block = l_kernel * int(worker._physical_blocks_per_logical_kv_block)
    src = Side(tp=int(info.remote_tp_size), dcp=rdcp, interleave=r_block if rdcp > 1 else 1)
    dst = Side(tp=int(worker.world_size), pcp=int(getattr(worker, "pcp_size", 1)), dcp=int(worker.dcp_size),
               interleave=int(STATE.interleave or 1))
    replicated = set(getattr(worker, "_dcp_replicated_groups", ()) or ())
    computed = list(getattr(meta, "local_num_computed_blocks", ()) or ())
    local, remote = _regions(worker, engine)
    source_group = {lg: rg for lg, rg in zip(local, remote) if lg >= 0 and rg >= 0}  # where the layouts differ
    groups = []
    for g, t in enumerate(worker._group_spec_types):
        kind = _kind(t)
        spec = worker.kv_cache_config.transfer_groups[g].kv_cache_spec
        sharded = kind != "mamba" and g not in replicated
        groups.append(GroupPlan(kind, tables[0][source_group.get(g, g)], tables[1][g], r_block, l_block, r_kernel,
                                l_kernel, sharded,
                                sharded, int(getattr(spec, "sliding_window", 0) or 0) if kind == "swa" else 0, 0,
                                computed[g] if g < len(computed) else 0))
    copies = _copies(worker, engine, reads, r_kernel, l_kernel, rdcp)
    num_tokens = getattr(meta.remote, "num_tokens", None)
    return TransferRecord(step=step, rank=int(worker.dcp_rank), request=str(req_id), source=str(engine), src=src,
                          dst=dst, groups=groups, seq_len=-1 if num_tokens is None else int(num_tokens),
                          dst_rank=int(worker.dcp_rank), copies=copies)


def _regions(worker, engine) -> tuple[list[int], list[int]]:
    """(this worker's, the remote's) KV-cache group of each memory region (releases without regions: none)."""
    remote = list(getattr(worker, "dst_region_group_ids", {}).get(engine) or [])
    return list(getattr(worker, "region_group_ids", None) or remote), remote


def _copies(worker, engine, reads, r_kernel: int, l_kernel: int, rdcp: int):
    """The ReadSpecs as copies [k, 7] int64 (group, source worker, source kernel id, offset, destination kernel id,
    offset, slots), in the order posted. Local ids in the remote's finer units (block_size_ratio > 1: NIXL's mapped
    sub-blocks) are split into their kernel block and offset; a region's reads belong to the region's group (a
    shared region's are left out), each pair once (its first). One array op per group list, none per block."""
    import numpy as np

    ratio = max(1, l_kernel // r_kernel)
    regions = _regions(worker, engine)[0]
    parts = []
    for spec in reads:
        by_region = bool(getattr(spec, "block_ids_by_region", False))
        rr = spec.remote_rank % rdcp
        for k, (rids, lids) in enumerate(zip(spec.remote_block_ids, spec.local_block_ids)):
            g = regions[k] if by_region and regions is not None else k
            if g < 0:
                continue
            rid, lid = np.asarray(rids, np.int64).reshape(-1), np.asarray(lids, np.int64).reshape(-1)
            n = min(rid.size, lid.size)  # (pairs, as zip makes them)
            c = np.empty((n, 7), np.int64)
            c[:, 0], c[:, 1], c[:, 2], c[:, 3] = g, rr, rid[:n], 0
            if ratio == 1 or _kind(worker._group_spec_types[g]) == "mamba":
                c[:, 4], c[:, 5], c[:, 6] = lid[:n], 0, min(r_kernel, l_kernel)
            else:
                c[:, 4], c[:, 5], c[:, 6] = lid[:n] // ratio, lid[:n] % ratio * r_kernel, r_kernel
            parts.append(c)
    if not parts:
        return np.zeros((0, 7), np.int64)
    out = parts[0] if len(parts) == 1 else np.concatenate(parts)
    if out.shape[0] > 1:  # each pair once, its first (a stable sort: the first of equal rows comes first)
        order = np.lexsort(out.T[::-1])
        s = out[order]
        again = (s[1:] == s[:-1]).all(axis=1)
        if again.any():
            keep = np.ones(out.shape[0], bool)
            keep[order[1:][again]] = False
            out = out[keep]
    return out


def lmcache_store(*, step: int, rank: int, request, engine, block_ids, block_size: int, tokens: tuple[int, int],
                  piece: tuple[int, int]):
    """One LMCache multi-process store as a transfer (store=True): worker `rank` of an engine of layout `engine`
    (dump.transfer.Side) stores the request's blocks `block_ids` (its logical block ids for tokens [start, end),
    `block_size` tokens per block on each rank) whole, in order, under a key for tokens `tokens` whose object is
    piece `piece[0]` of `piece[1]` (LMCache's kv_worker_id and kv_world_size: the pieces split the tokens as the
    engine's DCP shards do; one piece claims them all)."""
    import numpy as np

    from dcptool.dump.transfer import GroupPlan, Side, TransferRecord

    start, end = tokens
    first = start // (block_size * engine.dcp)
    ids = np.asarray(block_ids, np.int64).reshape(-1)
    claim = Side(tp=1, dcp=piece[1], interleave=engine.interleave)
    group = GroupPlan("mla", ids, ids, block_size, block_size, src_first=first, dst_first=first)
    copies = np.stack([np.zeros(ids.size, np.int64), np.full(ids.size, rank), ids, np.zeros(ids.size, np.int64),
                       ids, np.zeros(ids.size, np.int64), np.full(ids.size, block_size)], axis=1)
    return TransferRecord(step=step, rank=rank, request=request, source="vllm", src=engine, dst=claim, groups=[group],
                          seq_len=end, dst_rank=piece[0], copies=copies, store=True)


def mooncake_pull(*, step: int, rank: int, request, meta, plan, prefill, decode, block_size: int,
                  kernel_block_size: int | None = None, kinds: tuple[str, ...] | None = None):
    """One pull vllm-ascend's Mooncake connector planned on decode worker `rank` (its DCP rank) as a transfer: `meta`
    the request's ReqMeta (the prefill's and this side's block tables per KV-cache group, `remote_port`,
    `remote_block_size`, `num_computed_tokens`, `num_external_tokens`), `plan` what `_get_kv_split_metadata` returned
    for it (per shard: handshake ports, local and remote kernel block ids per group), `prefill` and `decode` both
    sides' layouts (dump.transfer.Side; Mooncake's CP ranks hold blocks round-robin: cp_shards, interleave = the
    block size), `block_size` and `kernel_block_size` this side's (the prefill's kernel blocks are
    `kernel_block_size` too: Mooncake expands both sides to one kernel size), `kinds` each group's kind (mla).

    A port's offset from `remote_port` is `tp_rank + tp * pcp_rank` on the prefill, so it names worker
    `pcp_rank * dcp + tp_rank % dcp`. This side's table starts at the decode prefix (`num_computed_tokens` over
    `block_size` times the decode's CP world)."""
    from dcptool.dump.transfer import GroupPlan, Side, TransferRecord

    prefill, decode = Side.of(prefill), Side.of(decode)
    kernel = kernel_block_size or block_size
    r_block = int(meta.remote_block_size or block_size)
    world = decode.pcp * decode.dcp if decode.cp_shards else decode.dcp
    first = int(meta.num_computed_tokens) // (block_size * world)
    kinds = kinds or ("mla",) * len(meta.remote_block_ids)
    groups = [GroupPlan(kind, list(src), list(dst), r_block, block_size, kernel, kernel, dst_first=first)
              for kind, src, dst in zip(kinds, meta.remote_block_ids, meta.local_block_ids)]
    reads = []
    for ports, local, remote in zip(*plan):
        for port in ports:
            off = int(port) - int(meta.remote_port)
            worker = off // prefill.tp * prefill.dcp + off % prefill.tp % prefill.dcp
            reads.append((worker, [list(g) for g in remote], [list(g) for g in local]))
    return TransferRecord(step=step, rank=rank, request=request, source=str(meta.remote_engine_id), src=prefill,
                          dst=decode, groups=groups, dst_rank=rank, reads=reads,
                          seq_len=int(meta.num_computed_tokens) + int(meta.num_external_tokens))
