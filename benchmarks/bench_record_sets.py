"""What recording costs an engine-like loop for each argument set the vLLM plugin passes (bench_record.py --sets).

    python benchmarks/bench_record.py --sets [--steps 200] [--reps 3]     (a GPU)
    python benchmarks/bench_record.py --sets --cpu                         (a reduced smoke run, no GPU)
    python benchmarks/bench_record.py --sets --python                      (observe()'s Python per set, no GPU)

The argument sets (dcptool/engine/vllm/state.py `observe`, hooks.py `_slot_kwargs`: the plugin passes
positions and the [groups, tokens] slot mappings of build_attn_metadata, int64 as vLLM holds them):
(a) the fast-path set: seq_lens, dcp_local_seq_lens, query_start_loc; (b) + positions + slot_mapping, 1 KV-cache
group and 2; (c) + dcp_query_start_loc + dcp_tot_seq_lens; (d) + kv_pages; (e) everything the plugin passes the
Recorder for one build, in the forms it passes them (guard_engine.Engine's keywords, fields `all`: the host values of
FlashInfer's plans, the host copies of seq_lens, the block sizes, FlashAttention's addresses and capacities, MLA's
chunked context, a hybrid's per-group lengths; query_start_loc and the page counts as numpy arrays, the plugin's
Recorder form), and each step one KV transfer plan recorded as the plugin records NIXL's (connectors.nixl_transfer of
the pull worker's ReadSpecs, Recorder.record_transfer): a request arriving with an 8,192-token prompt, 256 blocks a
DCP rank, read from the prefill's rank of the same shard; its CPU µs (plan made and recorded) in its own column, and
a line saying whether replay of a recording of the set finds anything (it must not). Two workloads: a decode step of 256
requests and 768 tokens (3 query tokens a request: speculative decoding), and an 8,192-token prefill step of 16
requests. Each step: an in-place update of the metadata buffers, 3 queued bf16 4096x4096 matmuls (CPU: 256x256
float32) and 4 observes; recording off, cuda_mode="sync" (the baseline: .to("cpu") per tensor) and the device
snapshot ("async"), interleaved in one run, median of --reps. Host syncs are counted with
torch.cuda.set_sync_debug_mode("warn") around each observe() (each synchronising call warns; "error" would make
observe drop the observation instead: observe() catches everything), and the waits of a full ring (an event waited
for: not a call the debug mode sees) from the ring's counter. Each step ends waiting for its work, as vLLM waits for
the sampled tokens (--run-ahead: no wait, the CPU queues steps until the launch queue or the ring is full, and that
wait lands in observe()'s time); on the CPU they are not measurable and the table says
how many observations copied their slots on the host instead ("host slot copies": 0 on the device path).
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import numpy as np
import torch

from dcptool import Recorder  # noqa: E402

WORKLOADS = {"decode 256 req x 768 tok": (256, 768), "prefill 16 req x 8192 tok": (16, 8192)}
SETS = ("a", "b1", "b2", "c", "d", "e")
SET_NAMES = {"a": "(a) seq_lens, dcp_local_seq_lens, query_start_loc", "b1": "(b) + positions + slot_mapping, 1 group",
             "b2": "(b) + positions + slot_mapping, 2 groups", "c": "(c) (b, 1 group) + dcp_query_start_loc + "
             "dcp_tot_seq_lens", "d": "(d) (c) + kv_pages",
             "e": "(e) the plugin's every field, as it passes them, + a NIXL transfer plan a step"}
PROMPT = 8192  # the tokens of the request whose KV each step of set (e) pulls
BLOCK = 16  # its block (NIXL under DCP: the interleave is the block size)

# what torch warns of each synchronising operation under set_sync_debug_mode("warn"); its first call in a process
# also warns that the mode is a prototype ("Synchronization debug mode ..."), which is not a synchronisation
SYNC_WARNING = "called a synchronizing CUDA operation"


class MLAAttentionSpec:  # (named as vLLM's: connectors reads a group's kind from its spec's class names)
    pass


def nixl_plan(step: int, rank: int = 0, dcp: int = 2):
    """One request's pull as NIXL's worker plans it on DCP rank `rank` (what wraps _read_blocks_for_req sees) and the
    plugin records it: connectors.nixl_transfer of the handshake's layouts (a prefill of TP `dcp`, DCP `dcp`, this
    side DCP `dcp`, 16-token blocks), the scheduler's block tables and the ReadSpecs posted (the rank's 256 blocks of
    the prompt, from the prefill worker holding the same shard)."""
    from types import SimpleNamespace as NS

    from dcptool.engine.vllm.connectors import nixl_transfer
    from dcptool.engine.vllm.state import STATE

    if STATE.interleave is None:
        STATE.interleave = BLOCK  # (what the plugin reads from the worker's vllm_config as it records)
    info = NS(remote_tp_size=dcp, remote_dcp_size=dcp, remote_block_size=BLOCK, remote_physical_blocks_per_logical=1)
    worker = NS(transfer_topo=NS(get_engine_info=lambda e: info), block_size=BLOCK,
                _physical_blocks_per_logical_kv_block=1, world_size=dcp, dcp_size=dcp, dcp_rank=rank, pcp_size=1,
                _group_spec_types=(MLAAttentionSpec,), _dcp_replicated_groups=set(), region_group_ids=None,
                kv_cache_config=NS(transfer_groups=[NS(kv_cache_spec=NS(sliding_window=None))]),
                dst_region_group_ids={"prefill": None})
    n = PROMPT // (BLOCK * dcp)
    remote, local = [list(range(1000 + n * step, 1000 + n * (step + 1)))], [list(range(n * step, n * (step + 1)))]
    meta = NS(remote=NS(engine_id="prefill", num_tokens=PROMPT, block_ids=remote), local_block_ids=local,
              local_num_computed_blocks=(0,))
    reads = [NS(remote_rank=rank, local_block_ids=local, remote_block_ids=remote, block_ids_by_region=False)]
    return nixl_transfer(worker, f"req-{step}", meta, (remote, local), reads, step)


def _plugin_arguments(reqs: int, toks: int, dev: torch.device) -> tuple[dict, torch.Tensor]:
    """Set (e): guard_engine.Engine's keywords for this workload (every field), in the plugin's Recorder form."""
    from guard_engine import Engine, Shape

    q = toks // reqs
    shape = Shape(reqs, decode_q=q) if q <= 4 else Shape(0, (q,) * reqs, (0,) * reqs)
    e = Engine(dev, shape, 8, torch.float32, "all", matmuls=0)
    e.update()
    kw = dict(e.kv, query_start_loc=e.qsl.cpu().numpy())  # (the Recorder is handed query_start_loc_np)
    return kw, e.seq


def _arguments(kind: str, reqs: int, toks: int, dev: torch.device, rng) -> tuple[dict, torch.Tensor]:
    """observe()'s row arguments for one set (the tensors the engine keeps and updates in place) and seq_lens."""
    def t(a, dtype):
        return torch.from_numpy(np.asarray(a)).to(dtype).to(dev)

    if kind == "e":
        return _plugin_arguments(reqs, toks, dev)
    seq = t(rng.integers(1, 1 << 17, reqs), torch.int32)
    kw = dict(seq_lens=seq, dcp_local_seq_lens=(seq // 2).to(torch.int32),
              query_start_loc=t(np.linspace(0, toks, reqs + 1).astype(np.int64), torch.int32))
    if kind == "a":
        return kw, seq
    groups = 2 if kind == "b2" else 1
    kw["positions"] = t(rng.integers(0, 1 << 17, toks), torch.int64)
    kw["slot_mapping"] = t(rng.integers(-1, 1 << 20, (groups, toks)), torch.int64)
    if kind in ("c", "d"):
        kw["dcp_query_start_loc"] = kw["query_start_loc"].clone()
        kw["dcp_tot_seq_lens"] = seq.clone()
    if kind == "d":
        kw["kv_pages"] = (seq // 16 + 1).to(torch.int32)
    return kw, seq


def _recorder(path: Path, mode: str, cpu: bool) -> Recorder:
    from dcptool.engine.vllm.builders import FLASH_ATTN_TENSORS

    kv = [{"name": "attn", "dcp": True, "block_size": 16}, {"name": "mamba", "dcp": False}]
    rec = Recorder(path, dcp_size=2, page_size=16, kv_groups=kv, cuda_mode=mode, force=True,
                   attn_tensors=FLASH_ATTN_TENSORS)
    if cpu and mode == "async":
        rec._device.use_host_ring(1 << 20)  # host tensors through the ring and the interpreted kernel
    return rec


def _loop(kw: dict, seq: torch.Tensor, mode: str | None, steps: int, mm: tuple, path: Path, cpu: bool,
          run_ahead: bool = False, transfers: bool = False) -> dict:
    """One run: per-step seconds, CPU seconds per observe, syncs in observe() (warnings), ring waits, host slot
    copies, recorded, dropped. Each step ends waiting for its work, as an engine waits for the sampled tokens
    (run_ahead: it does not, and the CPU queues steps until a queue is full: the launch queue, or the ring, whose
    wait then counts in observe()'s time). transfers: a recording (sync, async) records a NIXL plan each step
    (nixl_plan; CPU seconds per transfer, made and recorded, its syncs counted with observe()'s)."""
    rec = None if mode is None else _recorder(path, "async" if mode == "floor" else mode, cpu)
    copies = [0]
    observe = None if rec is None else rec.observe
    if rec is not None:
        host = rec._host.slots

        def counted(*a):
            copies[0] += 1
            return host(*a)
        rec._host.slots = counted
        # (the first observe starts the ring, whose launch check synchronises once: before the counted loop)
        rec.observe(step=0, site="attn_metadata", rank=0, num_reqs=seq.numel(), num_reqs_padded=seq.numel(), **kw)
        if mode == "floor":
            observe = _empty_launch(rec, seq)
    spent = moved = 0.0
    transfers = transfers and mode in ("sync", "async")
    debug = (lambda mode: None) if cpu else torch.cuda.set_sync_debug_mode
    sampled = None if cpu else torch.cuda.Event()
    if not cpu:
        torch.cuda.synchronize()
    waits = 0 if rec is None or rec._device.ring is None else rec._device.ring.waits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        for s, last in engine_steps(seq, mm, steps):
            if rec is not None:
                debug("warn")  # (only observe()'s synchronising calls are counted, not the step's own wait)
                t = time.perf_counter()
                observe(step=s, site="attn_metadata", rank=0, num_reqs=seq.numel(), num_reqs_padded=seq.numel(),
                        **kw)
                spent += time.perf_counter() - t
                if last and transfers:
                    t = time.perf_counter()
                    rec.record_transfer(nixl_plan(s))
                    moved += time.perf_counter() - t
                debug("default")
            if last and sampled is not None and not run_ahead:
                sampled.record()  # the engine waits for the step's sampled tokens before it schedules the next
                sampled.synchronize()
        if not cpu:
            torch.cuda.synchronize()
        per = (time.perf_counter() - t0) / steps
    syncs = sum(SYNC_WARNING in str(w.message) for w in caught)
    out = dict(step=per, cpu=spent / (4 * steps), syncs=syncs, copies=copies[0], n=0, dropped=0, waits=0,
               transfer=moved / steps)
    if mode == "floor":
        rec.discard()  # (its launches wrote over the first observation's slot)
    elif rec is not None:
        if rec._device.ring is not None:
            out["waits"] = rec._device.ring.waits - waits  # (the ring full: observe() waited for the GPU)
        rec.close()
        out.update(n=len(rec), dropped=rec.dropped)
    return out


def engine_steps(seq: torch.Tensor, mm: tuple, steps: int):
    """An engine-like loop: each step refreshes its metadata buffer on the stream (seq += 1), then 3 queued matmuls
    and 4 attention-metadata builds; yields (step, last build of the step) where each build is observed."""
    a, b, c = mm
    for s in range(steps):
        seq.add_(1)  # the engine refreshes its metadata buffers on the stream every step
        for k in range(4):
            if k < 3:
                torch.mm(a, b, out=c)
            yield s, k == 3


def snapshot_args(secs: list, slot: int, reqs: int) -> tuple:
    """snapshot_args_kernel's launch arguments after the stream (grid, slot, seqno 1, num_reqs, num_reqs_padded,
    modes, words, the eight sections) for eight device tensors or None, snapshotted into the slot at `slot`."""
    from dcptool.engine.snapshot.arm import args_of
    from dcptool.engine.snapshot.kernels import snapshot_args_grid
    from dcptool.engine.snapshot.layout import ENTRY, FIXED, SECTIONS

    k = len(SECTIONS)
    modes, total, at = args_of(secs, slot)
    return (snapshot_args_grid(total), slot, 1, reqs, reqs, k << 16 | modes, (FIXED + ENTRY * k + total + 7) & ~7, *at)


def _empty_launch(rec: Recorder, seq: torch.Tensor):
    """The floor of one launch per observation: an observe() stand-in that launches the snapshot kernel with no rows
    (its header only) through the ring's launcher, the arguments computed once: no Recorder bookkeeping, no harvest."""
    from dcptool.engine.snapshot.layout import ARGS_SECTIONS

    ring = rec._device.ring
    args = snapshot_args([seq[:0]] + [None] * (ARGS_SECTIONS - 1), ring.base, 0)
    go3, raw, did = ring.go3, ring.raw, ring.did

    def observe(**_):
        go3(raw(did), *args)
    return observe


def _gpu_per_snapshot(kw: dict, seq: torch.Tensor, path: Path, n: int = 32) -> float:
    """GPU time of one snapshot of this set: n observe() calls queued behind a sleeping kernel (so the GPU runs
    them back to back, after the CPU has queued them all), timed with CUDA events."""
    rec = _recorder(path, "async", False)
    obs = dict(step=0, site="attn_metadata", rank=0, num_reqs=seq.numel(), num_reqs_padded=seq.numel(), **kw)
    rec.observe(**obs)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(50_000_000)
    start.record()
    for _ in range(n):
        rec.observe(**obs)
    end.record()
    torch.cuda.synchronize()
    rec.discard()
    return start.elapsed_time(end) * 1e3 / n


def bench_sets(steps: int, reps: int, tmp: Path, cpu: bool, run_ahead: bool = False) -> None:
    dev = torch.device("cpu" if cpu else "cuda")
    torch.manual_seed(0)
    size, dtype = (256, torch.float32) if cpu else (4096, torch.bfloat16)
    mm = (torch.randn(size, size, dtype=dtype, device=dev), torch.randn(size, size, dtype=dtype, device=dev),
          torch.empty(size, size, dtype=dtype, device=dev))
    rng = np.random.default_rng(0)
    workloads = {k: (r, t // 8 if cpu else t) for k, (r, t) in WORKLOADS.items()}  # (CPU: the interpreter is slow)
    name = "CPU (host ring, interpreted kernel; reduced: tokens / 8)" if cpu else torch.cuda.get_device_name()
    how = ("the CPU running ahead (no wait per step)" if run_ahead
           else "a wait at the end of each step (as an engine waits for its sampled tokens)")
    print(f"argument sets on {name}: {steps} steps x {reps} runs a cell, off / sync / async interleaved, 4 observes "
          f"a step, {how}")
    print("| workload | argument set | recording | ms/step | vs off | CPU µs/observe | host syncs in observe "
          "| ring waits | host slot copies | recorded | GPU µs/snapshot | CPU µs/transfer |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    replayed = []
    for wname, (reqs, toks) in workloads.items():
        for kind in SETS:
            kw, seq = _arguments(kind, reqs, toks, dev, rng)
            base = seq.clone()
            for mode in (None, "sync", "async", "floor"):  # warm up (cuBLAS, the kernel, the ring)
                _loop(kw, seq, mode, 3, mm, tmp / "w.safetensors", cpu, run_ahead)
            res: dict = {None: [], "sync": [], "async": [], "floor": []}
            for _ in range(reps):
                for mode in res:
                    seq.copy_(base)
                    res[mode].append(_loop(kw, seq, mode, steps, mm, tmp / f"{kind}.safetensors", cpu, run_ahead,
                                           kind == "e"))
            gpu = "-" if cpu else f"{_gpu_per_snapshot(kw, seq, tmp / 'g.safetensors'):.2f}"
            off = float(np.median([r["step"] for r in res[None]]))
            for mode, label in ((None, "off"), ("sync", "sync (baseline)"), ("async", "device snapshot"),
                                ("floor", "floor: an empty launch per observe")):
                rs = res[mode]
                m = float(np.median([r["step"] for r in rs]))
                vs = "-" if mode is None else f"{(m / off - 1) * 100:+.1f}%"
                us = "-" if mode is None else f"{np.median([r['cpu'] for r in rs]) * 1e6:.1f}"
                syncs = "-" if cpu else str(max(r["syncs"] for r in rs))
                rec = "-" if mode in (None, "floor") else (f"{sum(r['n'] for r in rs):,}"
                                                + (f" ({sum(r['dropped'] for r in rs)} dropped)"
                                                   if any(r["dropped"] for r in rs) else ""))
                copies = "-" if mode in (None, "floor") else str(max(r["copies"] for r in rs))
                waits = "-" if mode != "async" else str(max(r["waits"] for r in rs))
                moved = (f"{np.median([r['transfer'] for r in rs]) * 1e6:.1f}" if kind == "e" and mode in
                         ("sync", "async") else "-")
                print(f"| {wname} | {SET_NAMES[kind]} | {label} | {m * 1e3:.3f} | {vs} | {us} | {syncs} | {waits} "
                      f"| {copies} | {rec} | {gpu if mode == 'async' else '-'} | {moved} |")
            if kind == "e":
                seq.copy_(base)  # (the values the set's other fields were made for)
                replayed.append(f"set (e), {wname}: {_replayed(kw, seq, tmp / 'replayed.safetensors')}")
    print("\n".join(replayed))


def _replayed(kw: dict, seq: torch.Tensor, path: Path) -> str:
    """Two steps of a set recorded (cuda_mode "sync": every field as observe() took it), its transfer plans too,
    replayed: what replay finds (the set's values are right: nothing)."""
    from dcptool.check.replay import replay
    from dcptool.dump import read_dump

    rec = _recorder(path, "sync", True)
    for s in range(2):
        for _ in range(4):
            rec.observe(step=s, site="attn_metadata", rank=0, num_reqs=seq.numel(), num_reqs_padded=seq.numel(), **kw)
        rec.record_transfer(nixl_plan(s))
    files = rec.close()
    found = sorted({f.rule for f in replay(read_dump(files[0]), "torch").findings})
    return (f"{len(rec)} observations ({rec.dropped} dropped), 2 of them transfers, recorded and replayed: "
            + (f"FINDINGS: {', '.join(found)}" if found else "no finding"))


def stand_in_launches(ring, on_fast=None) -> None:
    """Replace the ring's launches with stand-ins that write what the harvest reads of a slot (done = seqno, flags
    0; the fast path's header counts) and copy no rows: observe()'s Python measured alone (--python, and
    bench_record.py --cuda-python). on_fast(): called per fast-path launch."""
    a, base = ring.np, ring.base

    def go(raw, at):
        w = (at - base) >> 2
        a[w + 1] = a[w]

    def go3(raw, *args):
        # now: grid, slot, seqno, nr, nrp, modes, words, then 8 sections; before: slot, seqno, nr, nrp, ksec,
        # words, then 3
        if len(args) == 12:
            at, seqno, _, _, ksec, _, *secs = args
            nsec = ksec & 0xFFFF
        else:
            _, at, seqno, _, _, modes, _, *secs = args
            nsec = modes >> 16
        w = (at - base) >> 2
        a[w + 1] = seqno
        a[w + 4] = nsec
        a[w + 5] = 0
        a[w + 10:w + 10 + 4 * nsec:4] = -1
        a[w + 10:w + 10 + 2 * len(secs):4] = secs[1::2]
        if on_fast is not None:
            on_fast()
    ring.go = go
    ring.go3 = go3


def bench_sets_python(n: int, reps: int, tmp: Path) -> None:
    """observe()'s Python per argument set (the decode workload), host tensors through the host ring with the
    launches replaced by stand-ins: the fast path (now) against the general path of the same Recorder (what
    every set but (a) took before), interleaved blocks of 500, best block; the stand-in's own cost subtracted."""
    rng = np.random.default_rng(0)
    dev = torch.device("cpu")
    block = 500
    print("observe()'s Python per argument set (decode 256 req x 768 tok; host ring, stand-in launches; CPU time, "
          f"best of {max(1, n // block) * reps} interleaved blocks of {block}):")
    print("| argument set | fast path µs/observe | general path µs/observe | fast / general |")
    print("|---|---|---|---|")
    for kind in SETS:
        kw, seq = _arguments(kind, 256, 768, dev, rng)
        recs, res = {}, {"fast": [], "general": []}
        for way in res:
            rec = _recorder(tmp / f"py-{kind}-{way}.safetensors", "async", True)
            fast = rec._device.fast  # (the Recorder takes it up at its first device observation)
            stand_in_launches(rec._device.ring)
            if way == "general":
                rec._fast = rec._device.fast = None  # (observe() then takes the general device path always)
            recs[way] = rec
            assert fast is not None
        for _ in range(max(1, n // block) * reps):
            for way, rec in recs.items():
                t0 = time.process_time()
                for i in range(block):
                    rec.observe(step=i, site="attn_metadata", rank=0, num_reqs=256, num_reqs_padded=256, **kw)
                res[way].append((time.process_time() - t0) / block)
        for rec in recs.values():
            assert rec.dropped == 0, rec.dropped
            rec.discard()
        f, g = (min(res[w]) * 1e6 for w in ("fast", "general"))
        print(f"| {SET_NAMES[kind]} | {f:.2f} | {g:.2f} | {f / g:.2f} |")
    bench_transfer_python(max(1, n // block) * reps, tmp)


def bench_transfer_python(blocks: int, tmp: Path, block: int = 100) -> None:
    """Set (e)'s transfer per step in parts (CPU time, best of `blocks` interleaved blocks of `block`): the NIXL plan
    made (nixl_plan: connectors.nixl_transfer of 256 blocks a DCP rank), Recorder.record_transfer of plans made
    ahead, and both, as the --sets loop times them."""
    rec = _recorder(tmp / "py-transfer.safetensors", "async", True)
    plans = [nixl_plan(i) for i in range(block)]
    parts = {"the plan made (connectors.nixl_transfer)": lambda i: nixl_plan(i),
             "recorded (Recorder.record_transfer)": lambda i: rec.record_transfer(plans[i]),
             "both (the --sets column)": lambda i: rec.record_transfer(nixl_plan(i))}
    res: dict = {k: [] for k in parts}
    for _ in range(blocks):
        for name, fn in parts.items():
            t0 = time.process_time()
            for i in range(block):
                fn(i)
            res[name].append((time.process_time() - t0) / block)
    assert rec.dropped == 0, rec.dropped
    rec.discard()
    print(f"\nset (e)'s transfer per step ({PROMPT:,}-token prompt, {PROMPT // (BLOCK * 2)} blocks a DCP rank; best of "
          f"{blocks} interleaved blocks of {block}):")
    print("| part | CPU µs/transfer |")
    print("|---|---|")
    for name, t in res.items():
        print(f"| {name} | {min(t) * 1e6:.1f} |")


def bench_sets_python_vs(n: int, reps: int, before: str, tmp: Path) -> None:
    """--sets --python for this checkout and git revision `before` (its dcptool package, these benchmarks) in one run:
    each revision's run in a process of its own, `reps` rounds interleaved, the best of each row over the rounds."""
    import os
    import shutil
    import subprocess
    import sys

    from bench_record_python import revision_tree

    root = Path(__file__).resolve().parents[1]
    trees = {"now": root}
    if revision_tree(before, tmp / "before") is not None:
        shutil.copytree(root / "benchmarks", tmp / "before" / "benchmarks")
        trees[f"before ({before})"] = tmp / "before"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCPTOOL_")}
    best: dict = {}
    for _ in range(reps):
        for name, tree in trees.items():
            p = subprocess.run([sys.executable, str(tree / "benchmarks" / "bench_record.py"), "--sets", "--python",
                                "--obs", str(n), "--reps", "1"], capture_output=True, text=True, cwd=tree,
                               env={**env, "PYTHONPATH": str(tree), "CUDA_VISIBLE_DEVICES": ""})
            if p.returncode:
                raise RuntimeError(p.stderr[-3000:])
            for line in p.stdout.splitlines():
                cells = [c.strip() for c in line.strip("| ").split(" | ")]
                if line.startswith("| ") and not line.startswith("| argument") and not line.startswith("| part"):
                    vals = [float(c) for c in cells[1:3 if cells[0].startswith("(") else 2]]
                    got = best.setdefault((name, cells[0]), vals)
                    best[name, cells[0]] = [min(a, b) for a, b in zip(got, vals)]
    rows = list(dict.fromkeys(k for _, k in best))
    names = list(trees)
    print(f"observe()'s Python per set and the transfer's parts, {' / '.join(names)} (CPU µs; best of {reps} "
          f"interleaved rounds, {n:,} observations a set a round; host ring, stand-in launches):")
    print("| row | " + " | ".join(f"{k} fast path | {k} general path" for k in names) + " |")
    print("|---|" + "---|---|" * len(names))
    for r in rows:
        print(f"| {r} | " + " | ".join(" | ".join(f"{v:.1f}" for v in best.get((k, r), [])) + (
            " | -" if not r.startswith("(") else "") for k in names) + " |")
