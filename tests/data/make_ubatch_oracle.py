#!/usr/bin/env python3
"""Regenerate tests/data/ubatch_oracle.json: vLLM's own micro-batch splits of seeded random batches.

Development aid, not a test dependency: run it once per vLLM release (0.33+, the releases with model runner V2's
micro-batching), with the python of the venv tools/setup_vllm_env.sh builds for that release, e.g.

    VLLM_VERSION=0.33.0 tools/setup_vllm_env.sh
    ~/.cache/dcptool-vllm-0.33.0/bin/python tests/data/make_ubatch_oracle.py   # adds "0.33.0"
    VLLM_VERSION=0.34.0 tools/setup_vllm_env.sh
    ~/.cache/dcptool-vllm-0.34.0/bin/python tests/data/make_ubatch_oracle.py   # adds "0.34.0"

It builds the cases (same seed, same cases every time), builds each full batch as the runner's prepare_inputs
does (tests/vllm/engine.py: vLLM's InputBuffers, InputBatch and position/seq_len kernel), computes its DCP view
with vLLM's helper, asks vLLM's create_ubatch_slices + _slice_input_batch (model runner V2) and stores the answers
under vllm.__version__. `uniform_token_count` is what the 0.34 runner would pass for the batch with its DP ranks
agreeing: the common query length when every request has the same one, else None; 0.33 takes no such argument.
An argument names another file to write (default: ubatch_oracle.json beside this script).
"""
from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("ubatch_oracle.json")
# vLLM on CPU, as tests/vllm/conftest.py loads it: Triton kernels in its interpreter, no GPU, the CPU platform
os.environ.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", VLLM_TARGET_DEVICE="cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "vllm"), str(Path(__file__).resolve().parents[2])]


def cases() -> list[dict]:
    """Seeded random batches with awkward sizes: uniform multi-token decodes whose request count K
    does not divide, too few requests for one per micro-batch, CUDA-graph token and request padding,
    mixed batches with long prefills, single requests."""
    import numpy as np

    rng = np.random.default_rng(1334)
    # the example (5 requests x 3 tokens, K=2) and docs/dcp.md's worked example first
    out = [{"query_lens": [3] * 5, "seq_lens": [40, 50, 60, 70, 80], "num_ubatches": 2, "num_tokens_padded": 15,
            "num_reqs_padded": 5, "dcp_size": 2, "dcp_rank": 0, "interleave": 1},
           {"query_lens": [1, 1, 10, 1, 1], "seq_lens": [64, 96, 512, 32, 48], "num_ubatches": 2,
            "num_tokens_padded": 14, "num_reqs_padded": 5, "dcp_size": 2, "dcp_rank": 1, "interleave": 1}]
    for i in range(160):
        kind = i % 4
        k = int(rng.choice([2, 2, 3, 4]))
        if kind in (0, 1):  # uniform: spec-decode verification (q = 1 + drafts)
            q = int(rng.choice([2, 3, 4, 5, 8]))
            n = int(rng.integers(1, 24))
            ql = [q] * n
        elif kind == 2:  # mixed: decodes then prefill chunks
            n = int(rng.integers(1, 16))
            ql = sorted(int(x) for x in rng.choice([1, 3, 4, 7, 127, 129, 1000], n))
        else:  # uniform single tokens, or one request
            n = int(rng.integers(1, 20))
            ql = [1] * n if rng.random() < 0.5 else [int(rng.integers(2, 600))]
            n = len(ql)
        comp = [int(x) for x in rng.integers(0, 3000, n)]
        seq = [c + q for c, q in zip(comp, ql)]
        tokens = sum(ql)
        pad = kind == 1 or rng.random() < 0.4
        nrp = n + (int(rng.integers(0, 5)) if pad else 0)
        ntp = tokens + (int(rng.integers(0, 3 * max(ql))) if pad else 0)
        if kind == 1:  # a FULL decode graph: requests padded, tokens = padded requests * q
            ntp = nrp * ql[0]
        if ntp < k:
            continue
        dcp = int(rng.choice([2, 4, 8]))
        out.append({"query_lens": ql, "seq_lens": seq, "num_ubatches": k, "num_tokens_padded": ntp,
                    "num_reqs_padded": nrp, "dcp_size": dcp, "dcp_rank": int(rng.integers(dcp)),
                    "interleave": int(rng.choice([1, 1, 16]))})
    return out


def ask(case: dict) -> list[dict]:
    import engine  # tests/vllm/engine.py: model runner V2's pieces on CPU, from vLLM's own classes
    import torch
    from vllm.v1.worker.gpu.ubatch_utils import _slice_input_batch, create_ubatch_slices

    n, N, r, il = len(case["query_lens"]), case["dcp_size"], case["dcp_rank"], case["interleave"]
    nrp = max(n, case["num_reqs_padded"])
    bufs = engine.buffers(nrp, max(sum(case["query_lens"]), case["num_tokens_padded"]))
    batch = engine.prepare_inputs(case["query_lens"], case["seq_lens"], bufs,
                                  num_tokens_padded=case["num_tokens_padded"], num_reqs_padded=nrp)
    engine.dcp_step(batch, bufs, N, r, il)
    k = case["num_ubatches"]
    if "uniform_token_count" in inspect.signature(create_ubatch_slices).parameters:
        slices = create_ubatch_slices(batch, k, case["uniform_token_count"])
    else:
        slices = create_ubatch_slices(batch, k)
    mnr = bufs.max_num_reqs
    res = []
    for sl in slices:
        ent = {"request_slice": [sl.request_slice.start, sl.request_slice.stop],
               "token_slice": [sl.token_slice.start, sl.token_slice.stop]}
        try:
            ub_bufs = [torch.full((m,), -1, dtype=torch.int32) for m in (mnr + 1, mnr, mnr)]  # as UBatchRunner's
            ub = _slice_input_batch(batch, sl, *ub_bufs, dcp_size=N, dcp_rank=r, cp_interleave=il)
            ent.update(num_reqs=ub.num_reqs, num_reqs_padded=ub.num_reqs_after_padding,
                       query_start_loc=ub.query_start_loc.tolist(), seq_lens=ub.seq_lens.tolist(),
                       dcp_local_seq_lens=ub.dcp_local_seq_lens.tolist())
        except AssertionError as e:
            ent["error"] = f"AssertionError: {e}"
        res.append(ent)
    return res


def main() -> None:
    import vllm

    data = json.loads(OUT.read_text()) if OUT.exists() else {"cases": []}
    cs = cases()
    for c in cs:
        q = c["query_lens"]
        c["uniform_token_count"] = q[0] if len(set(q)) == 1 else None
    if data["cases"]:
        old = [{k: v for k, v in c.items() if k != "vllm"} for c in data["cases"]]
        if old != cs:
            sys.exit(f"{OUT}: its cases differ from this script's; delete it to start over")
        cs = data["cases"]
    for c in cs:
        c.setdefault("vllm", {})[vllm.__version__] = ask(c)
    data = {"about": "vLLM's own micro-batch splits (create_ubatch_slices + _slice_input_batch), by release; "
                     "regenerate with tests/data/make_ubatch_oracle.py", "cases": cs}
    OUT.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"{OUT}: {len(cs)} cases, vLLM {vllm.__version__} added", file=sys.stderr)


if __name__ == "__main__":
    main()
