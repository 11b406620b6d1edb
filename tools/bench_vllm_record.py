"""What recording costs: µs per attention-metadata build with the vLLM plugin on, for a 256-row batch.

    python tools/bench_vllm_record.py [--rows 256] [--builds 2000] [--device cpu|cuda]

Without vLLM installed it times dcptool's Recorder.observe on the tensors a build receives
(seq_lens, the DCP view, query_start_loc) on the given device: the copies to host memory are
the cost (on a GPU each is a device-to-host copy that waits for the stream). In the vLLM venv
(`make test-vllm` builds it) it also times vLLM's own DefaultModelState.prepare_attn with the
plugin off and on, and the time to write one rolled file.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def timed(fn, n: int, repeats: int = 5) -> float:
    """Median over `repeats` runs of n calls, in µs per call (the machine may be shared)."""
    fn()  # warm up (first-call allocations, kernel compilation)
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return sorted(runs)[repeats // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--builds", type=int, default=2000)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    import numpy as np
    import torch

    from dcptool.engine.recorder.record import Recorder

    dev = torch.device(a.device)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(1, 100_000, (a.rows,), generator=g, dtype=torch.int32).to(dev)
    view = (seq // 2).to(torch.int32)
    qsl = np.arange(a.rows + 1, dtype=np.int32)
    out = tempfile.mkdtemp(prefix="dcptool-bench-")
    rec = Recorder(os.path.join(out, "rank0.safetensors"), 2, 1, sites=("attn_metadata",), rollover=10_000)

    def observe():
        rec.observe(step=0, site="attn_metadata", rank=0, seq_lens=seq, num_reqs=a.rows, num_reqs_padded=a.rows,
                    dcp_local_seq_lens=view, query_start_loc=qsl, num_tokens_padded=a.rows, graph=0)

    us = timed(observe, a.builds)
    print(f"Recorder.observe, {a.rows} rows on {dev}: {us:.1f} us per build")
    while (len(rec) + 1) % 10_000:  # up to the observation that completes a rolled file
        observe()
    t0 = time.perf_counter()
    observe()  # the 10,000th observation writes the rolled file
    print(f"rolling a file of 10,000 observations x {a.rows} rows: {(time.perf_counter() - t0) * 1e3:.0f} ms "
          f"({os.path.getsize(rec.files[-1]) / 1e6:.1f} MB)")
    rec.close()
    import importlib.util

    if importlib.util.find_spec("vllm") is not None and dev.type == "cpu":
        _vllm_builds(a, os.path.join(out, "vllm"))


def _vllm_builds(a, out: str) -> None:
    """vLLM's prepare_attn (no attention layers: only the build path itself) with the plugin off and on."""
    import sys

    # as tests/vllm/conftest.py: vLLM on CPU, then its plugin loader (which calls dcptool's register())
    os.environ.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", VLLM_TARGET_DEVICE="cpu", DCPTOOL_RECORD=out)
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "vllm"))
    import engine as E

    from dcptool.engine import vllm as plugin

    E.set_dcp(2, 0)
    bufs = E.buffers(a.rows, a.rows)
    b = E.prepare_inputs([1] * a.rows, list(range(100, 100 + a.rows)), bufs)
    E.dcp_step(b, bufs, 2, 0, 1)
    ms, bt = E.model_state(), E.tables(a.rows, a.rows, 2, 0, 1)
    plugin.STATE.interleave = 1
    on = timed(lambda: E.attn(ms, b, bt), a.builds)
    plugin.STATE.active = False
    off = timed(lambda: E.attn(ms, b, bt), a.builds)
    plugin.STATE.active = True
    print(f"vLLM prepare_attn, {a.rows} rows: {off:.1f} us without recording, {on:.1f} us with "
          f"(+{on - off:.1f} us per build)")
    plugin.close()


if __name__ == "__main__":
    main()
