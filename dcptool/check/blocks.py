"""The block sizes a build's slot mapping worked with (kernel-block: the DCP ranks dealt positions by the attention
kernel's block where the KV-cache manager's differs)."""

from __future__ import annotations

import numpy as np

from dcptool.check.findings import FindingTable, Written
from dcptool.dcp.reference import misdealt, slot_deal
from dcptool.dcp.segments import ragged
from dcptool.dump import Dump

MANAGER, KERNEL, DEALT = range(3)  # a group's three words in rows.kv_block_sizes


def group_sizes(d: Dump) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every recorded (observation, KV-cache group): (observation, group, [k, 3] block sizes)."""
    off = d["obs.kvbs"]
    n = np.diff(off)
    has = np.flatnonzero(n > 0)
    seg, j, at = ragged(off[has], n[has])
    v = d["rows.kv_block_sizes"][at].astype(np.int64).reshape(-1, 3)
    return has[seg[::3]], j[::3] // 3, v


def check_kernel_block(d: Dump) -> FindingTable:
    """A DCP-sharded KV-cache group whose slot mapping deals positions to the ranks by another block than the
    KV-cache manager's (the virtual block, it times dcp_size) where that sends a position elsewhere: vLLM's
    manager block is a multiple of the interleave, a kernel block a backend split it into need not be (FlashInfer
    MLA's 64 under interleave 128), and dealing by it writes positions on ranks that do not own them, at local
    positions past the kernel block. One finding per observation, at its first such group; groups whose sizes
    are unknown (0) are not checked."""
    found = Written(d)
    cfg = d.config
    if cfg.dcp_size == 1 or not d.has("obs.kvbs"):
        return found.table()
    obs, grp, v = group_sizes(d)
    sharded = cfg.group_dcp(int(grp.max(initial=-1)) + 1)[grp] if grp.size else np.zeros(0, bool)
    cand = np.flatnonzero(sharded & (v[:, DEALT] != v[:, MANAGER]) & (v > 0).all(axis=1))
    if cand.size == 0:
        return found.table()
    pairs, inv = np.unique(v[cand][:, [DEALT, MANAGER]], axis=0, return_inverse=True)
    first = np.array([misdealt(int(a), int(b), cfg.dcp_size, cfg.cp_interleave) for a, b in pairs.tolist()])
    at = first[inv.reshape(-1)]
    wrong = cand[at >= 0]
    p0 = at[at >= 0]
    keep = np.unique(obs[wrong], return_index=True)[1]  # (groups ascend within an observation: its first)
    count = np.bincount(obs[wrong], minlength=d.n)
    N, I_ = cfg.dcp_size, cfg.cp_interleave
    for k, p in zip(wrong[keep].tolist(), p0[keep].tolist()):
        i, g = int(obs[k]), int(grp[k])
        mgr, ker, dealt = (int(x) for x in v[k])
        name = cfg.kv_groups[g].name if cfg.kv_groups is not None and g < len(cfg.kv_groups) else f"group {g}"
        got = [int(x) for x in slot_deal(np.int64(p), dealt, N, I_)]
        want = [int(x) for x in slot_deal(np.int64(p), mgr, N, I_)]
        by = "the attention kernel's block" if dealt == ker else "neither the manager's nor the kernel's block"
        found.add(i, "kernel-block", f"KV-cache group {name}: the slot mapping deals positions to the DCP ranks by "
                  f"{dealt}-token blocks ({by}; the KV-cache manager's is {mgr}, the kernel's {ker}) under interleave "
                  f"{I_}: position {p} goes to rank {got[0]} at local position {got[1]}, not to rank {want[0]} at "
                  f"{want[1]} (KV written on ranks that do not own it)", recorded=dealt, expected=mgr,
                  wrong_rows=int(count[i]), detail={"group": name, "manager_block": mgr, "kernel_block": ker,
                                                    "dealt_by": dealt, "first_position": p})
    return found.table()
