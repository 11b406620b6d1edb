"""The vLLM plugin's process state: env vars, the frame stack its hooks push, the Recorder it opens, observe, close."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import os
import sys
import threading
from collections import Counter
from pathlib import Path

ENV_DIR = "DCPTOOL_RECORD"
ENV_GUARD = "DCPTOOL_GUARD"  # the Guard instead of the Recorder (DCPTOOL_RECORD wins when both are set)
ENV_ROLLOVER = "DCPTOOL_ROLLOVER"
ENV_UNTESTED = "DCPTOOL_VLLM_UNTESTED"
ENV_MAX_GB = "DCPTOOL_RECORD_MAX_GB"  # a size cap per rank's recording, in GB (10**9 bytes); unset: none
DEFAULT_ROLLOVER = 10_000  # observations per file: a long run leaves many closed files, not one open one
SITES = ("attn_metadata", "ubatch", "dummy", "capture", "dflash_capture", "draft", "prepare_inputs")

log = logging.getLogger("vllm.dcptool")


class _State:
    registered = False
    active = False  # hooks record only while True; False after any failure
    warned = False
    step = -1
    recorder = None  # the Recorder, or the Guard (DCPTOOL_GUARD)
    guarding = False  # DCPTOOL_GUARD (set by register(): builds inside capture are checked, not skipped)
    rank = None
    interleave: int | None = None
    block_tables = None  # the runner's BlockTables, once seen (the slot mappings' KV-cache groups)
    kernel_block_sizes: list | None = None  # the runner's attention kernel block per group (0.32+: not the tables')
    block_sizes: tuple = (None, None)  # (the BlockTables, rows.kv_block_sizes of its slot mappings): read once
    kv_groups: list | None = None  # the groups the recorder's config names (set with the first slot mapping)
    page_size: int | None = None  # the FlashInfer plans' page size, once a builder planned pages (the config's)
    attn_tensors: tuple | None = None  # the metadata tensors whose addresses the recording holds (the config's)
    captured: dict = {}  # a full graph's key -> the addresses its capture's build handed attention
    skipped: Counter = Counter()
    tables: list = []  # candidate hook tables, best first (set by register())
    modules: frozenset = frozenset()  # the modules any of them hooks
    used: dict = {}  # module -> the release line of the table its hooks came from
    lock = threading.RLock()
    local = threading.local()
    atexit = False


STATE = _State()


class Frame:
    """One level of context (site, batch, step scope) around an engine call; never raises into it."""

    __slots__ = ("frame",)

    def __init__(self, make):
        self.frame = None
        if STATE.active:
            try:
                self.frame = make()
            except Exception as e:  # an engine object without what we expect: stop recording
                broken(e)

    def __enter__(self):
        if self.frame is not None:
            st = stack()
            if self.frame.get("scope") and not any(f.get("scope") for f in st):
                STATE.step += 1
            st.append(self.frame)
        return self.frame

    def __exit__(self, *exc):
        if self.frame is not None:
            st = stack()
            if st and st[-1] is self.frame:
                st.pop()
        return False


def stack() -> list[dict]:
    st = getattr(STATE.local, "stack", None)
    if st is None:
        st = STATE.local.stack = []
    return st


def context() -> dict:
    out: dict = {}
    for f in stack():
        out.update(f)  # inner frames win
    return out


def broken(why) -> None:
    """Stop recording for good and say so once; what was recorded so far is still written at exit."""
    STATE.active = False
    if not STATE.warned:
        STATE.warned = True
        log.warning("dcptool: vLLM recording disabled, nothing more is recorded (%s%s)",
                    type(why).__name__ + ": " if isinstance(why, BaseException) else "", why)


def dcp_group() -> tuple[int, int]:
    """(DCP world size, this process's DCP rank) from vLLM's DCP group; (1, 0) before it exists, as vLLM does."""
    from vllm.distributed import parallel_state as ps

    if getattr(ps, "_DCP", None) is None:
        return 1, 0
    g = ps.get_dcp_group()
    return int(g.world_size), int(g.rank_in_group)


def _capturing() -> bool:
    """True inside CUDA-graph capture, where a host copy would invalidate the graph (we skip, counted)."""
    torch = sys.modules.get("torch")  # no torch imported: nothing can be capturing
    if torch is None or not _has_cuda(torch):
        return False
    return torch.cuda.is_current_stream_capturing()


@functools.cache
def _has_cuda(torch) -> bool:
    return bool(torch.cuda.is_available())


def _interleave() -> int | None:
    if STATE.interleave is None:
        try:
            from vllm.config import get_current_vllm_config_or_none

            cfg = get_current_vllm_config_or_none()
            if cfg is not None:
                STATE.interleave = int(cfg.parallel_config.cp_kv_cache_interleave_size)
        except Exception:
            pass
    return STATE.interleave


def _file_name(rank: int, dcp_size: int) -> str:
    """rank<r>, plus the global rank when several processes share DCP rank r (TP/PP/DP groups)."""
    try:
        dist = getattr(sys.modules.get("torch"), "distributed", None)  # a vLLM worker has imported it
        if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() != dcp_size:
            return f"rank{rank}.g{dist.get_rank()}.safetensors"
    except Exception:
        pass
    return f"rank{rank}.safetensors"


def recorder():
    if STATE.recorder is not None:
        return STATE.recorder
    il = _interleave()
    if il is None:
        STATE.skipped["cp_kv_cache_interleave_size not known yet"] += 1
        return None
    import vllm

    from dcptool.engine.recorder.record import Recorder

    dcp_size, rank = dcp_group()
    pcp = 1
    try:
        from vllm.distributed import parallel_state as ps

        if getattr(ps, "_PCP", None) is not None:
            pcp = int(ps.get_pcp_group().world_size)
    except Exception:
        pass
    sites = STATE.tables[0].sites if STATE.tables else SITES
    if not os.environ.get(ENV_DIR):
        return _guard(dcp_size, rank, il, pcp, sites, vllm.__version__)
    if os.environ.get(ENV_GUARD):
        log.warning("dcptool: %s and %s are both set: recording everything (the recording holds all the Guard "
                    "checks); %s is ignored", ENV_DIR, ENV_GUARD, ENV_GUARD)
    out = Path(os.environ[ENV_DIR])
    out.mkdir(parents=True, exist_ok=True)
    path = out / _file_name(rank, dcp_size)
    roll = int(os.environ.get(ENV_ROLLOVER) or DEFAULT_ROLLOVER)
    cap = os.environ.get(ENV_MAX_GB)
    if list(out.glob(f"{path.stem}.*{path.suffix}")):
        log.warning("dcptool: %s already holds dumps named %s.*; this run replaces them (all of them, when it "
                    "writes its first file), record into an empty directory to keep them", out, path.stem)
    # force: an engine is not stopped for an old recording (the Recorder would refuse it otherwise)
    STATE.recorder = Recorder(path, dcp_size, il, sites=sites, pcp_size=pcp, page_size=STATE.page_size,
                              attn_tensors=STATE.attn_tensors, engine="vllm", engine_version=vllm.__version__,
                              rollover=roll, force=True, max_bytes=max(1, int(float(cap) * 1e9)) if cap else None,
                              note=f"dcptool.engine.vllm, pid {os.getpid()}; {sites_note(vllm.__version__)}")
    STATE.rank = rank
    if not STATE.atexit:
        STATE.atexit = True
        atexit.register(close)
    log.info("dcptool: recording DCP metadata to %s (%d observations per file)", path, roll)
    return STATE.recorder


def set_page_size(page: int) -> bool:
    """Make `page` the recording's page_size (DumpConfig.page_size, which kv_pages need): the first FlashInfer plan
    sets it, for a Recorder made later or one that has written no file yet; False for another page size."""
    with STATE.lock:
        if STATE.page_size is None:
            STATE.page_size = page
        rec = STATE.recorder
        if rec is not None and STATE.guarding:
            return rec.set_page_size(STATE.page_size) == page
        if rec is not None and rec.config.page_size is None and not rec.files:
            # (a Recorder made before any plan, e.g. by a micro-batch parent: no file of it holds another page size)
            rec.config = dataclasses.replace(rec.config, page_size=STATE.page_size)
        return (STATE.page_size if rec is None else rec.config.page_size) == page


def set_attn_tensors(names: tuple) -> bool:
    """Make `names` the recording's attn_tensors (the config names what rows.attn_addrs lists), as set_page_size does
    the page size; False where the recording already names others (one backend's tensors per recording)."""
    with STATE.lock:
        if STATE.attn_tensors is None:
            STATE.attn_tensors = tuple(names)
        rec = STATE.recorder
        if rec is not None and STATE.guarding:
            return rec.set_attn_tensors(STATE.attn_tensors) == tuple(names)
        if rec is not None and rec.config.attn_tensors is None and not rec.files:
            rec.config = dataclasses.replace(rec.config, attn_tensors=STATE.attn_tensors)
        return (STATE.attn_tensors if rec is None else rec.config.attn_tensors) == tuple(names)


def _guard(dcp_size: int, rank: int, il: int, pcp: int, sites, version: str):
    """DCPTOOL_GUARD: a Guard (engine.guard) checks every build, inside CUDA-graph capture too (its kernel is
    captured), and writes the last builds as a dump on the first wrong one."""
    from dcptool.engine.guard.guard import Guard

    note = f"dcptool.engine.vllm Guard, pid {os.getpid()}, DCP rank {rank}; {sites_note(version)}"
    STATE.recorder = Guard(os.environ[ENV_GUARD], dcp_size, il, sites=sites, pcp_size=pcp, page_size=STATE.page_size,
                           attn_tensors=STATE.attn_tensors, engine="vllm", engine_version=version, note=note)
    STATE.guarding = True
    STATE.rank = rank
    if not STATE.atexit:
        STATE.atexit = True
        atexit.register(close)
    log.info("dcptool: guarding DCP metadata (a dump in %s on the first wrong value)", os.environ[ENV_GUARD])
    return STATE.recorder


def observe(**kw) -> int:
    if not STATE.guarding and _capturing():
        STATE.skipped["built during CUDA-graph capture"] += 1
        return -1
    rec = recorder()
    if rec is None:
        return -1
    if not stack():  # a build outside any step scope is a step of its own
        STATE.step += 1
    from dcptool.dump import Record  # (the Recorder imported it: no cost here)

    with STATE.lock:
        return rec.record(Record(step=max(STATE.step, 0), rank=dcp_group()[1], **kw))


def observe_batch(site: str, batch, graph: int) -> int:
    """Record a whole InputBatch that is no attention build itself (a micro-batch parent, a PCP input)."""
    nrp = batch.num_reqs_after_padding
    return observe(site=site, seq_lens=batch.seq_lens, num_reqs=batch.num_reqs, num_reqs_padded=nrp,
                    dcp_local_seq_lens=batch.dcp_local_seq_lens, query_start_loc=query_start_loc(batch, nrp),
                    num_tokens_padded=int(batch.num_tokens_after_padding), graph=int(graph))


def query_start_loc(batch, nrp: int):
    """The batch's query_start_loc[:nrp + 1]: the host copy for the Recorder (it keeps host arrays on the host);
    for the Guard the device buffer, which its kernel reads as it is (a host array there costs a copy per build,
    and inside a captured graph is not read at all: replays re-read the buffer)."""
    dev = getattr(batch, "query_start_loc", None) if STATE.guarding else None
    return batch.query_start_loc_np[: nrp + 1] if dev is None else dev[: nrp + 1]


def sites_note(version: str) -> str:
    """What a recording of this vLLM version can hold (written into the dump's config `note`)."""
    t = STATE.tables[0] if STATE.tables else None
    if t is None:
        return ""
    used = sorted(set(STATE.used.values()))
    s = f"vLLM {version}, hook table {'/'.join(used) if used else t.line}; sites possible: {', '.join(t.sites)}"
    return s + (f"; not possible: {t.why_not}" if t.why_not else "") + f"; columns: {t.slots}; builders: {t.builders}"


def close() -> list[Path]:
    """Write what is recorded (atomically) and start over; runs at process exit. Returns the files."""
    with STATE.lock:
        rec, STATE.recorder = STATE.recorder, None
        guarding = STATE.guarding and rec is not None
        if guarding:
            dumped = rec.close()
            files = [dumped] if dumped is not None else []
            log.info("dcptool: the Guard checked %d builds, %d wrong%s", rec.count, rec.wrong,
                     f"; the dump: {dumped}" if dumped is not None else "")
        else:
            files = rec.close() if rec is not None else []
        if rec is not None and not guarding:
            skipped = ", ".join(f"{k} ({v})" for k, v in STATE.skipped.items())
            log.info("dcptool: wrote %d observations to %d file(s) in %s%s", len(rec), len(files),
                     files[0].parent if files else "?", "; not recorded: " + skipped if skipped else "")
        STATE.step = -1
        STATE.interleave = None
        STATE.block_tables = None
        STATE.kernel_block_sizes = None
        STATE.block_sizes = (None, None)
        STATE.kv_groups = None
        STATE.page_size = None
        STATE.attn_tensors = None
        STATE.captured = {}
        STATE.skipped.clear()
        return files
