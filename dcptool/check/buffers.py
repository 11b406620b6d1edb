"""The metadata tensors a build hands attention: where they are (graph-addr: a full-graph replay reads the addresses
its capture baked in) and how many request rows their buffers hold (capacity)."""

from __future__ import annotations

import numpy as np

from dcptool.check.findings import FindingTable, Written
from dcptool.dcp.segments import ragged
from dcptool.dump import Dump, GraphMode, word_addrs

_SHOWN = 8  # tensors named in a finding's detail


def _rows(d: Dump, offsets: str, column: str, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows of `column` of observations idx: (segment, index within it, value)."""
    off = d[offsets]
    seg, j, at = ragged(off[idx], np.diff(off)[idx])
    return seg, j, d[column][at]


def check_graph_addr(d: Dump) -> FindingTable:
    """A full-graph replay runs the kernels its capture recorded, on the addresses the capture's build handed them:
    a replay whose build handed attention a metadata tensor at another address (rows.attn_addrs against
    rows.graph_addrs, the addresses that graph captured) wrote values the graph never reads, and the graph reads
    the captured buffer, stale or reused. One finding per such replay: the first tensor that moved, and how many
    did; a replay whose build hands another number of tensors than the graph captured is one too."""
    found = Written(d)
    if not d.has("obs.graph", "obs.addrs", "obs.gaddrs"):
        return found.table()
    na, ng = np.diff(d["obs.addrs"]), np.diff(d["obs.gaddrs"])
    cand = np.flatnonzero((d["obs.graph"] == GraphMode.FULL_REPLAY) & (na > 0) & (ng > 0))
    if cand.size == 0:
        return found.table()
    sa, _, wa = _rows(d, "obs.addrs", "rows.attn_addrs", cand)
    sg, _, wg = _rows(d, "obs.gaddrs", "rows.graph_addrs", cand)
    same_len = na[cand] == ng[cand]
    # (rows of equal length compared word by word, both in the same ragged order)
    k = same_len[sa]
    diff = np.zeros(cand.size, bool)
    diff[sa[k][wa[k] != wg[same_len[sg]]]] = True
    cfg = d.config
    ca, cg = na[cand], ng[cand]
    at_a, at_g = np.cumsum(ca) - ca, np.cumsum(cg) - cg
    for p in np.flatnonzero(diff | ~same_len).tolist():
        i = int(cand[p])
        built = word_addrs(wa[at_a[p]:at_a[p] + ca[p]])
        captured = word_addrs(wg[at_g[p]:at_g[p] + cg[p]])
        if built.size != captured.size:
            found.add(i, "graph-addr", f"full-graph replay: the build hands attention {built.size} metadata "
                      f"tensors, the graph captured {captured.size}: the graph reads the tensors of its capture",
                      recorded=built.size, expected=captured.size, wrong_rows=abs(built.size - captured.size),
                      detail={"tensors": int(built.size), "captured_tensors": int(captured.size)})
            continue
        moved = np.flatnonzero(built != captured)
        t = int(moved[0])
        name = cfg.tensor_name(t)
        found.add(i, "graph-addr", f"full-graph replay: {name} is at {int(built[t]):#x}, but the graph captured it "
                  f"at {int(captured[t]):#x}: the graph reads the captured buffer, which this build did not write "
                  f"(a tensor allocated anew at each build instead of a persistent buffer; {moved.size} of "
                  f"{built.size} tensors moved)", recorded=int(built[t]), expected=int(captured[t]),
                  wrong_rows=int(moved.size),
                  detail={"tensor": name, "moved": [cfg.tensor_name(int(m)) for m in moved[:_SHOWN]]})
    return found.table()


def check_capacity(d: Dump) -> FindingTable:
    """A build that needs more request rows (num_reqs_padded) than the buffer behind a metadata tensor holds
    (rows.attn_caps): the build's [:num_reqs_padded] view of it is cut short, or a kernel writes past its end into
    whatever lies after it. One finding per such build, naming the first short tensor and how many are."""
    found = Written(d)
    if not d.has("obs.caps"):
        return found.table()
    off = d["obs.caps"]
    n = np.diff(off)
    has = np.flatnonzero(n > 0)
    seg, j, caps = _rows(d, "obs.caps", "rows.attn_caps", has)
    need = d["obs.num_reqs_padded"].astype(np.int64)[has][seg]
    short = caps < need
    if not short.any():
        return found.table()
    obs = has[seg[short]]
    first = np.unique(obs, return_index=True)[1]
    count = np.bincount(obs, minlength=d.n)
    cfg = d.config
    for k in first.tolist():
        i, t = int(obs[k]), int(j[short][k])
        cap, nrp = int(caps[short][k]), int(d["obs.num_reqs_padded"][i])
        name = cfg.tensor_name(t)
        found.add(i, "capacity", f"the build needs {nrp} request rows (num_reqs_padded), but the buffer behind {name} "
                  f"holds {cap}: its view is cut short or a kernel writes {nrp - cap} rows past its end ("
                  f"{int(count[i])} of {int(n[i])} tensors short; a buffer sized below the largest padded batch)",
                  recorded=cap, expected=nrp, wrong_rows=nrp - cap, detail={"tensor": name, "short": int(count[i])})
    return found.table()
