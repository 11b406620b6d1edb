"""The host copy of the lengths a build's metadata builder reads (host-copy: one the device's lengths moved past, or
one a build wrote in place)."""

from __future__ import annotations

import numpy as np

from dcptool.check.findings import FindingTable, Written
from dcptool.dcp.segments import ragged
from dcptool.dump import Dump


def _first_differing(d: Dump, idx: np.ndarray, a_off: np.ndarray, a: np.ndarray, b_off: np.ndarray,
                     b: np.ndarray) -> dict[int, tuple[int, int, int, int]]:
    """For observations idx: the first real row (< num_reqs, within both rows) where a and b differ ->
    (row, a's value, b's value, how many real rows differ)."""
    k = np.minimum(np.minimum(np.diff(a_off)[idx], np.diff(b_off)[idx]), d["obs.num_reqs"].astype(np.int64)[idx])
    seg, j, _ = ragged(np.zeros(idx.size, np.int64), np.maximum(k, 0))
    va, vb = a[a_off[idx][seg] + j], b[b_off[idx][seg] + j]
    bad = va != vb
    if not bad.any():
        return {}
    sb = seg[bad]
    first = np.unique(sb, return_index=True)[1]
    count = np.bincount(sb, minlength=idx.size)
    return {int(idx[sb[f]]): (int(j[bad][f]), int(va[bad][f]), int(vb[bad][f]), int(count[sb[f]])) for f in first}


def check_host_copy(d: Dump) -> FindingTable:
    """A build whose metadata builder read a host copy of seq_lens (rows.host_seq_lens) that differs from the
    device's (rows.seq_lens) on a real row: async scheduling left the copy behind the device (vLLM #29449's
    FlashAttention DCP path read seq_lens_cpu, which async speculative decoding had not updated), or an earlier
    build wrote it in place; and a build that wrote the shared copy in place (rows.host_seq_lens_after differs
    from what it read: 0.29's FlashInfer DCP path subtracted the prefill query lengths from the runner's
    seq_lens_cpu, vLLM #48003), which every build after it reads. One finding per build, the in-place write first."""
    found = Written(d)
    if not d.has("obs.hseq"):
        return found.table()
    h_off, h = d["obs.hseq"], d["rows.host_seq_lens"]
    has = np.flatnonzero(np.diff(h_off) > 0)
    wrote = {}
    if d.has("obs.hseq_after"):
        a_off = d["obs.hseq_after"]
        both = has[np.diff(a_off)[has] > 0]
        wrote = _first_differing(d, both, h_off, h, a_off, d["rows.host_seq_lens_after"])
    stale = _first_differing(d, has, h_off, h, d["obs.rows"], d["rows.seq_lens"])
    for i in sorted(set(wrote) | set(stale)):
        if i in wrote:
            row, before, after, n = wrote[i]
            found.add(i, "host-copy", f"the build wrote the shared host copy of seq_lens (seq_lens_cpu) in place: row "
                      f"{row} {before} -> {after} ({n} real rows changed); every build after it that reads the copy "
                      "reads the changed lengths", row=row, recorded=after, expected=before, wrong_rows=n,
                      detail={"kind": "written-in-place"})
        else:
            row, host, dev, n = stale[i]
            found.add(i, "host-copy", f"the build's metadata builder read a host copy of seq_lens (seq_lens_cpu) "
                      f"that differs from the device's: row {row} holds {host} on the host, {dev} on the device "
                      f"({n} real rows differ; a copy async scheduling left behind, or one an earlier build wrote in "
                      "place)", row=row, recorded=host, expected=dev, wrong_rows=n, detail={"kind": "stale"})
    return found.table()
