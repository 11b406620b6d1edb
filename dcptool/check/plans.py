"""What FlashInfer's native plans claim beside the decode rows' page counts (plan-pages): the prefill rows' page
counts, which under DCP cover the row's local context, and every planned row's last-page length."""

from __future__ import annotations

import numpy as np

from dcptool.check.findings import FindingTable, Written
from dcptool.dcp.reference import last_page, local_np
from dcptool.dcp.segments import ragged
from dcptool.dump import Dump


def check_plan_pages(d: Dump) -> FindingTable:
    """A planned row whose native plan claims other pages than the rank's local length: a prefill row's count
    (rows.kv_prefill_pages) against cdiv(local(seq_len - query_len), page) (the new tokens attend separately under
    DCP: the plan covers the local context), a row's last-page length (rows.kv_last_page) against that of the local
    length its plan covers (decode rows: seq_len; prefill rows: the context). Real rows of observations with
    query_start_loc; -1: not recorded. One finding per observation, at its first wrong row (vLLM 0.29's FlashInfer
    builder counts both from the global lengths, PR #48003)."""
    found = Written(d)
    cfg = d.config
    have = [c for c in ("rows.kv_prefill_pages", "rows.kv_last_page") if d.has(c)]
    if not have or cfg.page_size is None or not d.has("obs.qsl"):
        return found.table()
    page = int(cfg.page_size)
    roff, qoff = d["obs.rows"], d["obs.qsl"]
    nr = d["obs.num_reqs"].astype(np.int64)
    ok = np.flatnonzero((np.diff(qoff) >= nr + 1) & (nr > 0))
    obs, j, at = ragged(roff[ok], nr[ok])
    obs = ok[obs]
    pre = d["rows.kv_prefill_pages"][at].astype(np.int64) if d.has("rows.kv_prefill_pages") else np.full(at.size, -1)
    last = d["rows.kv_last_page"][at].astype(np.int64) if d.has("rows.kv_last_page") else np.full(at.size, -1)
    seq = d["rows.seq_lens"][at].astype(np.int64)
    qsl = d["rows.query_start_loc"]
    q = qsl[qoff[obs] + j + 1].astype(np.int64) - qsl[qoff[obs] + j]
    covered = np.where(pre >= 0, seq - q, seq)
    local = local_np(np.maximum(covered, 0), cfg.dcp_size, d["obs.rank"][obs], cfg.cp_interleave)
    want_pre, want_last = -(-local // page), last_page(local, page)
    bad_pre = (pre >= 0) & (pre != want_pre)
    bad_last = (last >= 0) & (last != want_last)
    bad = bad_pre | bad_last
    if not bad.any():
        return found.table()
    first = np.flatnonzero(bad)[np.unique(obs[bad], return_index=True)[1]]
    count = np.bincount(obs[bad], minlength=d.n)
    for k in first.tolist():
        i, row = int(obs[k]), int(j[k])
        what = "prefill row" if pre[k] >= 0 else "decode row"
        if bad_pre[k]:
            glob = "; the count of the global seq_len" if pre[k] == -(-seq[k] // page) else ""
            text = (f"the native prefill plan of {what} {row} claims {pre[k]} pages, but this rank holds "
                    f"cdiv({local[k]}, {page}) = {want_pre[k]} pages of its context (local of seq_len {seq[k]} - "
                    f"query_len {q[k]}){glob}")
            rec, exp = int(pre[k]), int(want_pre[k])
        else:
            text = (f"the native plan of {what} {row} has last-page length {last[k]}, but the local length it covers "
                    f"is {local[k]} (last page {want_last[k]} of {page})"
                    f"{'; that of the global length' if last[k] == last_page(covered[k:k + 1], page)[0] else ''}")
            rec, exp = int(last[k]), int(want_last[k])
        found.add(i, "plan-pages", text + f" ({int(count[i])} wrong rows)", row=row, recorded=rec, expected=exp,
                  wrong_rows=int(count[i]), detail={"row_kind": what.split()[0], "field": "pages" if bad_pre[k]
                                                    else "last_page"})
    return found.table()
