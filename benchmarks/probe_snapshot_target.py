"""GPU time of one snapshot by where the slot lies (pinned host memory, as the ring; device memory) against an empty
launch of the same kernel (no rows), back to back behind a sleep (a GPU). A probe for the ring's design."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from bench_record_sets import _arguments, _recorder, snapshot_args


def main() -> None:
    dev = torch.device("cuda")
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        rec = _recorder(Path(d) / "p.safetensors", "async", False)
        kw0, seq0 = _arguments("a", 256, 768, dev, rng)
        rec.observe(step=0, site="attn_metadata", rank=0, num_reqs=256, num_reqs_padded=256, **kw0)
        ring = rec._device.ring
        go3 = ring.go3
        raw = torch._C._cuda_getCurrentRawStream(0)
        devslot = torch.zeros(1 << 22, dtype=torch.int32, device=dev)
        for kind, (reqs, toks) in (("a", (256, 768)), ("b1", (256, 768)), ("b2", (16, 8192)), ("d", (16, 8192))):
            kw, seq = _arguments(kind, reqs, toks, dev, rng)
            secs = [kw.get(n) for n in ("seq_lens", "dcp_local_seq_lens", "query_start_loc", "kv_pages",
                                       "dcp_query_start_loc", "dcp_tot_seq_lens", "positions", "slot_mapping")]
            out, values = [], 0
            for where, base in (("pinned host ring", ring.base), ("device memory", devslot.data_ptr()),
                                ("no rows (empty launch)", None)):
                s = secs if base is not None else [secs[0][:0]] + [None] * 7
                args = snapshot_args(s, ring.base if base is None else base, reqs)
                values = sum(x.numel() for x in secs if x is not None)
                for _ in range(20):
                    go3(raw, *args)
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(50_000_000)
                start.record()
                for _ in range(500):
                    go3(raw, *args)
                end.record()
                torch.cuda.synchronize()
                out.append(f"{where} {start.elapsed_time(end) * 1e3 / 500:.2f} µs")
            print(f"set {kind} ({reqs} req x {toks} tok, {values} values): " + "; ".join(out))
        rec.discard()


if __name__ == "__main__":
    main()
