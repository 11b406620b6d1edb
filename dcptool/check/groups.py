"""Per KV-cache group and per query token (group-lens): the lengths each group's attention metadata reads match the
group's sharding, and each query token's rank-local causal bound is the formula on its own position."""

from __future__ import annotations

import numpy as np

from dcptool.check.findings import FindingTable, Written
from dcptool.dcp.reference import local_of
from dcptool.dcp.segments import first_per_segment, ragged
from dcptool.dump import Dump


def check_group_lens(d: Dump) -> FindingTable:
    """Two columns, each where recorded (a dump with neither has nothing to check):

    `rows.group_seq_lens`: per KV-cache group (kv_groups order), one value per seq_lens row; on a real row, a
    DCP-sharded group's must be this rank's local length, a replicated one's (a sliding-window group under
    per-group DCP, Mamba state) the global seq_len (vLLM #47541: sliding-window groups stay replicated).
    `rows.verify_row_lens`: per query token of the batch (a prefix of its tokens, in order), the number of this
    rank's KV positions it attends to in a DCP-sharded group: local(position + 1), the position of token t of row r
    being seq_len - (query_start_loc[r + 1] - t); under speculative verification (query length q > 1) that is
    local(seq_len - k) for the k-th token from the end, not local(seq_len) - k (the shard mapping comes after the
    causal offset). One finding per observation, its first problem."""
    found = Written(d)
    first: dict[int, tuple] = {}
    if d.has("obs.gsl"):
        _groups(d, first)
    if d.has("obs.vrl", "obs.qsl"):
        _verify(d, first)
    for i in sorted(first):
        text, row, rec, exp, detail = first[i]
        found.add(i, "group-lens", text, row=row, recorded=rec, expected=exp, detail=detail)
    return found.table()


def _groups(d: Dump, first: dict) -> None:
    cfg = d.config
    off = d["obs.gsl"]
    lens = np.diff(off)
    rows = np.diff(d["obs.rows"])
    cand = np.flatnonzero(lens > 0)
    if cand.size == 0:
        return
    R = rows[cand]
    G = np.where(R > 0, lens[cand] // np.maximum(R, 1), 0)
    named = len(cfg.kv_groups) if cfg.kv_groups is not None else None
    bad = (R == 0) | (lens[cand] % np.maximum(R, 1) != 0) | ((G != named) if named is not None else False)
    for k in np.flatnonzero(bad).tolist():
        i = int(cand[k])
        first.setdefault(i, (f"group_seq_lens holds {int(lens[i])} values: not one per seq_lens row ({int(rows[i])})"
                             f" for each of the {named if named is not None else 'recorded'} KV-cache groups",
                             None, int(lens[i]), None, {"problem": "length"}))
    ok = cand[~bad]
    if ok.size == 0:
        return
    seg, j, at = ragged(off[ok], lens[ok])
    Rs = rows[ok][seg]
    g, r = j // Rs, j % Rs
    nr = d["obs.num_reqs"][ok].astype(np.int64)[seg]
    real = r < nr
    seg, g, r, at = seg[real], g[real], r[real], at[real]
    seq = d.take("rows.seq_lens", d["obs.rows"][ok][seg] + r).astype(np.int64)
    rank = d["obs.rank"][ok].astype(np.int64)[seg]
    loc = local_of(seq, rank, cfg.dcp_size, cfg.cp_interleave)
    sharded = cfg.group_dcp(int(g.max(initial=-1)) + 1)[g] if g.size else np.zeros(0, bool)
    want = np.where(sharded, loc, seq)
    got = d["rows.group_seq_lens"][at].astype(np.int64)
    wrong = np.flatnonzero(got != want)
    firsts, nbad = first_per_segment(seg, wrong, ok.size)
    for w in firsts.tolist():
        i, grp = int(ok[seg[w]]), int(g[w])
        name = cfg.kv_groups[grp].name if cfg.kv_groups is not None else f"group {grp}"
        if not sharded[w] and got[w] == loc[w]:
            why = (": this rank's DCP-local length, but the group is replicated (every rank keeps every position: "
                   "a sliding-window group stays replicated under per-group DCP)")
        elif sharded[w] and got[w] == seq[w] and cfg.dcp_size > 1:
            why = ": the global length, but DCP shards this group"
        else:
            why = ""
        first.setdefault(i, (f"KV-cache group {name!r} row {int(r[w])} gets length {int(got[w])}, expected "
                             f"{int(want[w])}{why} ({int(nbad[seg[w]])} wrong value{'s' if nbad[seg[w]] > 1 else ''})",
                             int(r[w]), int(got[w]), int(want[w]),
                             {"problem": "group", "group": grp, "replicated": not bool(sharded[w])}))


def _verify(d: Dump, first: dict) -> None:
    cfg = d.config
    off, qoff = d["obs.vrl"], d["obs.qsl"]
    lens = np.diff(off)
    rows = np.diff(d["obs.rows"])
    cand = np.flatnonzero((lens > 0) & (np.diff(qoff) == rows + 1))
    if cand.size == 0:
        return
    q = d["rows.query_start_loc"]
    nr = d["obs.num_reqs"][cand].astype(np.int64)
    qs = q[qoff[cand]].astype(np.int64)
    real = q[qoff[cand] + nr].astype(np.int64) - qs  # the real rows' tokens
    over = lens[cand] > real
    for k in np.flatnonzero(over).tolist():
        i = int(cand[k])
        first.setdefault(i, (f"verify_row_lens holds {int(lens[i])} values, more than the batch's "
                             f"{int(real[k])} real query tokens", None, int(lens[i]), int(real[k]),
                             {"problem": "length"}))
    ok = np.flatnonzero(~over)
    seg, t, at = ragged(off[cand[ok]], lens[cand[ok]])
    if seg.size == 0:
        return
    # each token's row: the rows whose query_start_loc[r + 1] <= t, counted per observation (one sorted search)
    nrow = nr[ok]
    rseg, rr, rat = ragged(qoff[cand[ok]] + 1, nrow)
    ends = q[rat].astype(np.int64) - qs[ok][rseg]
    span = np.int64(1) << np.int64(33)
    key = rseg * span + ends
    order = np.argsort(key, kind="stable")
    row = np.searchsorted(key[order], seg * span + t, "right") - np.searchsorted(key[order], seg * span, "left")
    row = np.minimum(row, nrow[seg] - 1)
    start = np.cumsum(nrow) - nrow
    end = ends[start[seg] + row]  # query_start_loc[r + 1], relative
    i_obs = cand[ok][seg]
    seq = d.take("rows.seq_lens", d["obs.rows"][i_obs] + row).astype(np.int64)
    pos1 = seq - (end - t) + 1  # the token's position + 1: the KV positions it attends to, globally
    rank = d["obs.rank"][i_obs].astype(np.int64)
    N, I_ = cfg.dcp_size, cfg.cp_interleave
    want = local_of(pos1, rank, N, I_)
    got = d["rows.verify_row_lens"][at].astype(np.int64)
    wrong = np.flatnonzero(got != want)
    if wrong.size == 0:
        return
    firsts, nbad = first_per_segment(seg, wrong, ok.size)
    for w in firsts.tolist():
        i, k = int(i_obs[w]), int(end[w] - t[w] - 1)  # k: tokens after this one in its row
        shifted = int(local_of(seq[w], rank[w], N, I_)) - k
        why = (f" = local(seq_len {int(seq[w])}) - {k}: the causal offset taken after the shard mapping; it must be "
               f"local(seq_len - {k})") if got[w] == shifted and k > 0 else ""
        first.setdefault(i, (f"query token {int(t[w])} (row {int(row[w])}, {k} token{'s' if k != 1 else ''} before "
                             f"its row's end) attends to {int(got[w])} of this rank's KV positions, expected "
                             f"local(position + 1) = {int(want[w])}{why} ({int(nbad[seg[w]])} wrong token"
                             f"{'s' if nbad[seg[w]] > 1 else ''})", int(row[w]), int(got[w]), int(want[w]),
                             {"problem": "verify", "token": int(t[w]), "after_shard": bool(why)}))
