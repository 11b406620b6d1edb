"""Each launch way (dcptool/engine/snapshot/launch.py WAYS: the launcher's C entry, cuda.core, Triton's compiled
launcher; and Triton's dispatch) timed in one run on a GPU, for the lead to pick DCPTOOL_LAUNCH's default:

    python benchmarks/bench_record.py --launch [--obs 20000] [--reps 5]

Per way, interleaved over --reps rounds (median): the launch alone (CPU µs, precomputed arguments) of the
Recorder's two snapshot kernels and of the Guard's check kernel; Recorder.observe() on an idle GPU with that way as
the ring's launch (CPU µs per observe, harvests included: what an engine pays); the Guard's eager observe() with
that way as its launch; the GPU time per snapshot (back to back behind a sleeping kernel, the same for every way).
Every way is first checked on known values as the Recorder checks it (arm.every_way); one that fails says why.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from dcptool.engine.recorder.record import Recorder
from dcptool.engine.snapshot import kernels as K
from dcptool.engine.snapshot.arm import every_way
from dcptool.engine.snapshot.launch import WAYS
from dcptool.engine.snapshot.layout import head_struct


def markdown(header: tuple, rows: list) -> list[str]:
    """A markdown table's lines."""
    return [f"| {' | '.join(header)} |", "|" + "---|" * len(header)] + [f"| {' | '.join(map(str, r))} |" for r in rows]


def _per_call(fn, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def _guard_ways(tmp: Path) -> dict:
    """The Guard's check kernel: name -> (its launch, checked on the probe) or (None, why), and a Guard."""
    from dcptool.engine.guard import device_checks as D
    from dcptool.engine.guard.guard import Guard
    from dcptool.engine.snapshot.launch import way

    g = Guard(tmp / "guard", 2, 1)
    seq = torch.arange(1, 257, dtype=torch.int32, device="cuda")
    kw = dict(step=0, site="attn_metadata", rank=0, seq_lens=seq, num_reqs=256, num_reqs_padded=256,
              dcp_local_seq_lens=(seq + 1) // 2)
    g.observe(**kw)
    dev = g._dev
    probe = D._Probe(dev)
    ck = D._probe_check(probe, dev.dispatch)
    out = {}
    for name in WAYS:
        try:
            go = way(name, ck, True)
            if go is None:
                raise RuntimeError("not available here")
            D._probe_check(probe, go)
            out[name] = (go, None)
        except Exception as e:
            out[name] = (None, repr(e))
    out["dispatch"] = (dev.dispatch, None)
    return {"guard": g, "kw": kw, "ways": out}


def bench_launch(n: int, reps: int, tmp: Path) -> None:
    dev = torch.device("cuda")
    seq = torch.randint(1, 1 << 17, (256,), dtype=torch.int32, device=dev)
    dcp = (seq // 2).to(torch.int32)
    qsl = torch.arange(257, dtype=torch.int32, device=dev)
    kw = dict(site="attn_metadata", rank=0, seq_lens=seq, num_reqs=250, num_reqs_padded=256, dcp_local_seq_lens=dcp,
              query_start_loc=qsl.cpu().numpy())  # (the plugin's form)
    rec = Recorder(tmp / "launch.safetensors", dcp_size=2, force=True)
    rec.observe(step=0, **kw)
    ring = rec._device.ring
    ways = every_way(ring)
    ways["dispatch"] = (K.snapshot_dispatch, K.snapshot_args_dispatch)
    guard = _guard_ways(tmp)
    own = (ring.go, ring.how, ring.go3, ring.how3)
    raw = torch.cuda.current_stream().cuda_stream
    ent = [seq.data_ptr(), 256, 2, dcp.data_ptr(), 256, 0, qsl.data_ptr(), 257, 0, 0, -1, 0]
    args = (1, ring.base, 1, 250, 256, rec._device._ksec, (rec._device._head_words + 769) & ~7,
            seq.data_ptr(), 256, dcp.data_ptr(), 256, qsl.data_ptr(), 257, *ring.absent5)
    res: dict = {w: {"go": [], "go3": [], "observe": [], "guard": [], "gpu": []} for w in ways}
    step = 1
    for _ in range(reps):
        for name, (go, go3) in ways.items():
            if go is None:
                continue
            with rec._lock:
                rec._harvest.harvest(wait=True)  # nothing in flight: slot 0 is free to overwrite
            head_struct(4).pack_into(ring.np, 0, 1, -1, 250, 256, 4, 0, 800, 0, *ent)
            res[name]["go"].append(_per_call(lambda go=go: go(raw, ring.base), n))
            res[name]["go3"].append(_per_call(lambda go3=go3: go3(raw, *args), n))
            ring.go, ring.go3 = go, go3  # (the Recorder launches through this way now)
            t0 = time.perf_counter()
            for _ in range(n):
                rec.observe(step=step, **kw)
                step += 1
            res[name]["observe"].append((time.perf_counter() - t0) / n * 1e6)
            torch.cuda.synchronize()
            gg = guard["ways"].get(name, (None, None))[0]
            if gg is not None:
                g = guard["guard"]
                g._dev.go = gg
                t0 = time.perf_counter()
                for i in range(n):
                    g.observe(**{**guard["kw"], "step": i})
                res[name]["guard"].append((time.perf_counter() - t0) / n * 1e6)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(200_000_000)  # (the launches queue behind it: their GPU time alone is timed)
            start.record()
            for _ in range(2000):
                go3(raw, *args)
            end.record()
            torch.cuda.synchronize()
            res[name]["gpu"].append(start.elapsed_time(end) / 2000 * 1e3)
    ring.go, ring.how, ring.go3, ring.how3 = own
    rows = []
    for name, (go, why) in ways.items():
        if go is None:
            rows.append((name, f"not available: {why}", "", "", "", ""))
            continue
        m = {k: (f"{np.median(v):.2f}" if v else "-") for k, v in res[name].items()}
        gwhy = guard["ways"].get(name, (None, "-"))[1]
        rows.append((name, m["go"], m["go3"], m["observe"], m["guard"] if not gwhy else gwhy, m["gpu"]))
    print(f"launch ways on {torch.cuda.get_device_name()}, {reps} interleaved rounds of {n:,} calls each, median; "
          f"the Recorder's own choice: {own[3]}")
    print("\n".join(markdown(("way", "launch alone, descriptor kernel µs", "launch alone, fast-path kernel µs",
                               "Recorder.observe µs (idle GPU)", "Guard.observe µs (eager)", "GPU µs per snapshot"),
                              rows)))
    rec.discard()
    guard["guard"].close()
