"""Regenerate empty_mask_oracle.json from vLLM itself (0.34.0 venv, CPU): mask_dcp_empty_shards_ and
split_decodes_and_prefills (threshold 1, both require_uniform) on seeded random batches.

Run: ~/.cache/dcptool-vllm-0.34.0/bin/python tests/data/make_empty_mask_oracle.py (writes the JSON beside it).
"""

import json
import os

os.environ.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", VLLM_TARGET_DEVICE="cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm.v1.attention.backends.utils import split_decodes_and_prefills  # noqa: E402
from vllm.v1.attention.ops.dcp import mask_dcp_empty_shards_  # noqa: E402


class _Meta:
    """The CommonAttentionMetadata fields split_decodes_and_prefills reads."""

    is_prefilling = None


def main() -> None:
    rng = np.random.default_rng(0)
    masks = []
    for _ in range(300):
        n = int(rng.integers(0, 7))
        rows = int(rng.integers(0, 12))
        q = np.concatenate([[0], np.cumsum(rng.integers(0, 3, n))])
        s = rng.integers(0, 3, n) * rng.integers(0, 2, n)
        lse = torch.zeros(rows, 2)
        mask_dcp_empty_shards_(lse, torch.tensor(s), torch.tensor(q))
        masks.append({"q": q.tolist(), "s": s.tolist(), "rows": rows,
                      "masked": torch.isinf(lse[:, 0]).nonzero().flatten().tolist()})
    splits = []
    for _ in range(300):
        n = int(rng.integers(1, 7))
        ql = rng.choice([0, 1, 1, 2, 3], n)
        cm = _Meta()
        cm.query_start_loc_cpu = torch.tensor(np.concatenate([[0], np.cumsum(ql)]), dtype=torch.int32)
        cm.max_query_len, cm.num_reqs, cm.num_actual_tokens = int(ql.max()), n, int(ql.sum())
        a = split_decodes_and_prefills(cm, decode_threshold=1, require_uniform=False)[0]
        b = split_decodes_and_prefills(cm, decode_threshold=1, require_uniform=True)[0]
        splits.append({"ql": ql.tolist(), "a": a, "b": b})
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "empty_mask_oracle.json")
    with open(out, "w") as f:
        json.dump({"vllm": "0.34.0", "mask": masks, "split": splits}, f)


if __name__ == "__main__":
    main()
