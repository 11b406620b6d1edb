"""The run the report tests draw: two DCP ranks, three sites, micro-batches and planted faults (docs/dcp.md's worked
example), replayed once per test module."""

from __future__ import annotations

import numpy as np
from conftest import expected_view, obs, write

from dcptool.check.replay import replay
from dcptool.dcp.slicing import split_batch
from dcptool.dump import open_dumps
from dcptool.report.html import VIEW_FINDINGS

SEQ = np.array([64, 96, 512, 32, 48, 0], np.int32)  # docs/dcp.md's worked example, one padded row
QSL = np.array([0, 1, 2, 12, 13, 14, 14], np.int32)


def timeline_run(steps: int = 12) -> list:
    """Two DCP ranks; sites attn_metadata (every step), ubatch (2 micro-batches from step 2 on) and dummy (steps 4
    and 8). Faults: a -1 in a padded row (step 3, rank 0), a view one row short (step 10, rank 1), micro-batch 0
    copying its parent's rows on rank 1 from step 6 on, None in the dummy run of step 8 (both ranks)."""
    out = []
    for step in range(steps):
        seq = SEQ + np.array([step] * 5 + [0], np.int32)
        for rank in (0, 1):
            view = expected_view(seq, 5, 6, 2, rank)
            if (step, rank) == (3, 0):
                view[5] = -1
            if (step, rank) == (10, 1):
                view = view[:5]
            parent = len(out)
            out.append(obs(step, "attn_metadata", rank, seq, 5, 6, view=view, query_start_loc=QSL))
            if step < 2:
                continue
            for u, ub in enumerate(split_batch(QSL, seq, 5, 6, None, 2)):
                sl = ub.slice
                v = expected_view(ub.seq_lens, ub.num_reqs, ub.num_reqs_padded, 2, rank)
                if (u, rank) == (0, 1) and step >= 6:
                    v = expected_view(seq, 5, 6, 2, rank)[sl.req_start : sl.req_stop]  # the parent's rows
                out.append(obs(step, "ubatch", rank, ub.seq_lens, ub.num_reqs, ub.num_reqs_padded, view=v, ubatch=u,
                               parent=parent, req_start=sl.req_start, tok_start=sl.tok_start, tok_stop=sl.tok_stop,
                               query_start_loc=ub.query_start_loc))
        if step in (4, 8):
            out += [obs(step, "dummy", rank, view=None if step == 8 else "auto") for rank in (0, 1)]
    return out


def expected_findings(steps: int = 12) -> list[tuple]:
    """(step, site, rank, ubatch, rule) of every fault timeline_run plants, in observation order."""
    out = [(3, "attn_metadata", 0, -1, "padding")]
    for s in range(6, steps):
        if s == 8:
            out += [(8, "dummy", r, -1, "missing") for r in (0, 1)]
        if s == 10:
            out.append((10, "attn_metadata", 1, -1, "shape"))
        out += [(s, "ubatch", 1, 0, "stale"), (s, "ubatch", 1, 0, "rank-sum")]
    return sorted(out, key=lambda t: (t[0], t[1] == "dummy"))


def replay_run12(tmp_path_factory) -> tuple:
    """timeline_run() written and replayed (row views as the HTML report prepares them): (path, result)."""
    p = write(tmp_path_factory.mktemp("tl") / "run.safetensors", timeline_run())
    return p, replay(open_dumps([p]), "torch", views=VIEW_FINDINGS)
