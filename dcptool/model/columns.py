"""What DCP attention consumes beside the local lengths, on every rank at once: the decode path's
dcp_query_start_loc and global companion, and the KV slot mappings, with the faults injected on them."""

from __future__ import annotations

import numpy as np

from dcptool.dcp.reference import last_page, local_of, slot_deal
from dcptool.dump.schema import INT32_MAX
from dcptool.model.config import KV_GROUPS, SimConfig
from dcptool.model.rows import Rows


class Columns:
    """The decode path's columns and the slot mappings of the batches of one configuration, as the runner model
    records them; `faults`: the faults that apply."""

    def __init__(self, cfg: SimConfig, faults: frozenset[str]):
        self.cfg, self.F = cfg, faults
        self.N, self.P, self.I, self.G = cfg.dcp, cfg.pcp, cfg.interleave, cfg.page_size
        self.ranks = np.arange(self.N).reshape(-1, 1)

    def decode_path(self, b: Rows, view: np.ndarray, odd_seq: np.ndarray | None, marks: list):
        """What vLLM's FlashInfer decode path (0.30+) receives beside the local lengths, per rank ([N, ...]):
        dcp_query_start_loc = query_start_loc[:num_decodes+1] and the global companion seq_lens[:num_decodes]
        (as MLA's dcp_tot_seq_lens); num_decodes as split_decodes_and_prefills at threshold 1 (padded rows
        count). (None, None) when the batch has no decode rows: no decode path. Applies their faults
        (dcp-qsl-local, tot-local)."""
        N, F = self.N, self.F
        ql = np.diff(b.qsl)
        nd = int(np.argmax(ql > 1)) if (ql > 1).any() else b.nrp
        if nd == 0:
            return None, None
        q = b.qsl[: nd + 1]
        dq = np.broadcast_to(q, (N, nd + 1))
        seqs = np.broadcast_to(b.seq[:nd], (N, nd)).copy()
        if odd_seq is not None:
            seqs[N - 1] = odd_seq[:nd]
        tot = seqs
        if "dcp-qsl-local" in F:
            s = np.zeros((N, nd), np.int64)
            k = min(nd, view.shape[1])
            s[:, :k] = view[:, :k]
            dq = np.zeros((N, nd + 1), np.int64)
            np.cumsum(ql[:nd] * (s > 0), axis=1, out=dq[:, 1:])  # empty shards' query tokens dropped
            marks.append(("dcp-qsl-local", (dq != q).any(axis=1)))
        if "tot-local" in F:
            # the real rows only: a padded row of the view may hold another fault's sentinel (-1), which no
            # global length can be (the Recorder would drop the whole observation, and the fault with it)
            real = min(nd, b.nr)
            k = min(real, view.shape[1])
            tot = seqs.copy()
            tot[:, :k] = view[:, :k]
            marks.append(("tot-local", (tot[:, :real] != seqs[:, :real]).any(axis=1)))
        return dq, tot

    def slots(self, b: Rows, role: str, kind: str, req0: int, marks: list) -> tuple | None:
        """(positions [ntp], slot mappings [N, groups, ntp]) as vLLM's _compute_slot_mappings_kernel writes them
        on every DCP rank, or None where simulate records none (drafts, the global batch of a PCP step).

        Request k of the batch (k + req0 in a micro-batch's parent, b.req[k] where rows are a PCP rank's local
        rows) owns blocks k * blocks_per_request + j, so slots are distinct as vLLM's allocator makes them. Dummy
        runs and graph capture write nothing (get_dummy_slot_mappings). Faults append (fault, [N] ranks) to `marks`
        where replay's `slots` / `slot-partition` can see the change.

        Under PCP a rank's batch is its local rows (the PCP partition): their positions, and the slot each token's
        KV lands at in this process's cache. vLLM 0.29-0.34 compute the global batch's slot mapping with DCP-only
        ownership (BlockTables(cp_size=dcp_size, cp_rank=dcp_rank), not over pcp_size * dcp_size: the cache is
        sharded over DCP and every PCP rank keeps a whole replica of its DCP shard), then hand attention its
        PCP-gathered form (PCPManager._convert_to_gathered_slot_mappings: every PCP rank's local tokens, a
        replicated request written once, from PCP rank 0's copy, at the same slot). Simulate records each PCP
        rank's own tokens of it, those replicated tokens with the slot their copy writes."""
        if not _kernel_ran(role):
            return None
        N, I_, B = self.N, self.I, self.G
        nr, ntp = b.nr, b.ntp
        per_req = -(-self.cfg.max_model_len // B) + 1
        top = req0 + b.nrp if b.req is None else int(b.req[:nr].max(initial=0)) + 1  # past the highest request
        if (top + 1) * per_req * B > INT32_MAX:
            return None  # slot ids past int32: an engine this large records no slots here
        q = np.diff(b.qsl[: nr + 1])
        real = int(b.qsl[nr])
        req = np.repeat(np.arange(nr), q)
        pos = np.zeros(ntp, np.int64)
        pos[:real] = b.seq[req] - q[req] + (np.arange(real) - b.qsl[req])
        p = pos[:real]
        ranks = self.ranks  # [N, 1]
        owner, local = slot_deal(p, B, N, I_)
        base = (req + req0 if b.req is None else b.req[req]) * per_req
        sharded = np.where(owner == ranks, (base + local // B) * B + local % B, -1)  # [N, real]
        replicated = np.broadcast_to((base + p // B) * B + p % B, (N, real))
        out = np.full((N, len(KV_GROUPS), ntp), -1, np.int64)
        if not _computed(role, kind):
            return pos, out
        F = self.F
        out[:, 0, :real] = sharded
        out[:, 1, :real] = replicated
        if "slot-wrong-group" in F:
            out[:, 1, :real] = sharded
            # what the `slots` rule can see on a rank: a token it does not own left unwritten while it writes
            # others, or a slot at another block offset than p % B (a rank owning none of the tokens writes
            # nothing at all in the group, which is what a dummy build looks like)
            own = owner == ranks
            moved = (own & (local % B != p % B)).any(axis=1)
            marks.append(("slot-wrong-group", (own.any(axis=1) & (~own).any(axis=1)) | moved))
        if "slot-all-ranks" in F:
            out[:, 0, :real] = (base + local // B) * B + local % B  # no is_local mask: every rank writes
            marks.append(("slot-all-ranks", (owner != ranks).any(axis=1)))
        if "slot-kernel-block" in F:
            # vLLM 0.22-0.28: dealt by the kernel's block K, addressed in the kernel blocks the block table lists
            # (manager block m is kernel blocks 2m, 2m + 1: slot = (2 base + p // KN) K + the dealt offset)
            K = B // 2
            kown, klocal = slot_deal(p, K, N, I_)
            out[:, 0, :real] = np.where(kown == ranks, base * B + klocal, -1)
            marks.append(("slot-kernel-block", np.ones(N, bool)))  # (the block sizes every rank records)
        return pos, out

    def plans(self, b: Rows, pages: bool, marks: list) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(kv_prefill_pages, kv_last_page) [N, nrp] of a build whose plan is recorded, where
        flashinfer-prefill-pages is injected (otherwise nothing: dumps as before). vLLM 0.29's FlashInfer builder:
        the prefill rows (past the decodes, threshold 1) claim cdiv(global seq_len, page) pages and every row's last
        page is taken from the global length its plan covers (seq_len; a prefill row's context seq_len -
        query_len), where the rank holds the local ones; marks the ranks where a value differs."""
        if "flashinfer-prefill-pages" not in self.F or not pages:
            return None, None
        N, G, nr, nrp = self.N, self.G, b.nr, b.nrp
        q = np.diff(b.qsl[: nr + 1]).astype(np.int64)
        nd = int(np.argmax(q > 1)) if (q > 1).any() else nr
        seq = np.asarray(b.seq[:nr], np.int64)
        covered = seq.copy()
        covered[nd:] -= q[nd:]
        local = local_of(np.broadcast_to(covered, (N, nr)).copy(), self.ranks, N, self.I)
        pre = np.full((N, nrp), -1, np.int64)
        pre[:, nd:nr] = -(-seq[nd:] // G)
        last = np.full((N, nrp), -1, np.int64)
        last[:, :nr] = last_page(covered, G)
        marks.append(("flashinfer-prefill-pages", (pre[:, nd:nr] != -(-local[:, nd:] // G)).any(axis=1)
                      | (last[:, :nr] != last_page(local, G)).any(axis=1)))
        return pre, last

    def block_sizes(self, role: str, kind: str) -> np.ndarray | None:
        """The block sizes a build's slot mapping worked with (rows.kv_block_sizes: per KV-cache group the
        manager's, the attention kernel's and the one it deals positions by), where the slot mapping kernel ran and
        a fault on them is injected (otherwise nothing is recorded: dumps as before). The attention group's kernel
        block is half the manager's under slot-kernel-block (the backend split it), which the slot mapping deals by."""
        if "slot-kernel-block" not in self.F or not _computed(role, kind):
            return None
        B = self.G
        return np.array([B, B // 2, B // 2, B, B, B], np.int32)


def _kernel_ran(role: str) -> bool:
    """simulate records the slot mappings of the build (not a draft's, nor the global batch of a PCP step)."""
    return role not in ("draft", "global")


def _computed(role: str, kind: str) -> bool:
    """The slot-mapping kernel computed the build's mappings (dummy runs and capture write PAD_SLOT_ID only)."""
    return _kernel_ran(role) and kind not in ("dummy", "capture") and role not in ("dummy", "dflash")
