"""Writes samples/handmade.safetensors through dcptool's dump API: the worked example of docs/dcp.md.

    python samples/make_handmade.py

Two DCP ranks (interleave 1), five steps. Step 2 is a dummy run that got `None`; step 3 splits
query lens [1,1,10,1,1] / seq_lens [64,96,512,32,48] into two micro-batches, and micro-batch 0
copies its parent's rows (the classic stale bug: 256 where 254/253 belong); step 4 leaves a -1
sentinel in a padded row.
"""

from pathlib import Path

import numpy as np

from dcptool.dcp.reference import local_np
from dcptool.dcp.slicing import split_batch
from dcptool.dump import DumpConfig, Observation, write_observations

N, I = 2, 1


def local(seq, nr, nrp, rank):
    out = np.zeros(nrp, np.int32)
    out[:nr] = local_np(np.asarray(seq[:nr]), N, rank, I)
    return out


def main() -> None:
    obs: list[Observation] = []
    for step in range(5):
        for rank in range(N):
            if step == 3:
                q = np.array([0, 1, 2, 12, 13, 14], np.int32)
                seq = np.array([64, 96, 512, 32, 48], np.int32)
            else:
                q = np.array([0, 1, 2, 3, 3], np.int32)
                seq = np.array([100 + 7 * step, 33, 2048 + step, 0], np.int32)
            nr, nrp = (5, 5) if step == 3 else (3, 4)
            view = local(seq, nr, nrp, rank)
            if step == 4:
                view[3] = -1
            parent = len(obs)
            obs.append(Observation(step=step, site="dummy" if step == 2 else "attn_metadata", rank=rank,
                                   num_reqs=nr, num_reqs_padded=nrp, seq_lens=seq,
                                   dcp_local_seq_lens=None if step == 2 else view, query_start_loc=q))
            if step == 3:
                for u, ub in enumerate(split_batch(q, seq, nr, nrp, None, 2)):
                    sl = ub.slice
                    mine = local(ub.seq_lens, ub.num_reqs, ub.num_reqs_padded, rank)
                    copied = view[sl.req_start:sl.req_stop]
                    obs.append(Observation(step=step, site="ubatch", rank=rank, ubatch=u, num_reqs=ub.num_reqs,
                                           num_reqs_padded=ub.num_reqs_padded, seq_lens=ub.seq_lens,
                                           dcp_local_seq_lens=copied if u == 0 else mine, parent=parent,
                                           req_start=sl.req_start, tok_start=sl.tok_start, tok_stop=sl.tok_stop,
                                           query_start_loc=ub.query_start_loc))
    out = Path(__file__).with_name("handmade.safetensors")
    write_observations(out, obs, DumpConfig(dcp_size=N, cp_interleave=I, engine="handmade",
                                            note="docs/dcp.md worked example"))
    print(f"wrote {out} ({len(obs)} observations)")


if __name__ == "__main__":
    main()
