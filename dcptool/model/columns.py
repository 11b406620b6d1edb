"""What DCP attention consumes beside the local lengths, on every rank at once: the decode path's
dcp_query_start_loc and global companion, the KV slot mappings and MLA's chunked-context schedule, with the faults
injected on them."""

from __future__ import annotations

import numpy as np

from dcptool.dcp import chunks, topk
from dcptool.dcp.reference import group_lens_np, last_page, local_np, slot_deal, verify_lens_np
from dcptool.dump.schema import INT32_MAX
from dcptool.model.config import SimConfig, kv_groups_of
from dcptool.model.rows import Rows, num_decodes


class Columns:
    """The decode path's columns and the slot mappings of the batches of one configuration, as the runner model
    records them; `faults`: the faults that apply."""

    def __init__(self, cfg: SimConfig, faults: frozenset[str]):
        self.cfg, self.F = cfg, faults
        self.N, self.P, self.I, self.G = cfg.dcp, cfg.pcp, cfg.interleave, cfg.page_size
        self.ranks = np.arange(self.N).reshape(-1, 1)
        self.workspace = chunks.workspace_size(cfg.max_model_len, cfg.max_num_reqs, self.G, self.N, self.I)
        self.groups = [(g["name"], g["dcp"]) for g in kv_groups_of(cfg)]  # (name, DCP-sharded) per KV-cache group
        self._prefix: topk.Prefix | None = None  # --features sparse: the fingerprints' prefix sums, made once

    def decode_path(self, b: Rows, view: np.ndarray, odd_seq: np.ndarray | None, marks: list):
        """What vLLM's FlashInfer decode path (0.30+) receives beside the local lengths, per rank ([N, ...]):
        dcp_query_start_loc = query_start_loc[:num_decodes+1] and the global companion seq_lens[:num_decodes]
        (as MLA's dcp_tot_seq_lens); num_decodes as split_decodes_and_prefills at threshold 1 (padded rows
        count). (None, None) when the batch has no decode rows: no decode path. Applies their faults
        (dcp-qsl-local, tot-local)."""
        N, F = self.N, self.F
        ql = np.diff(b.qsl)
        nd = num_decodes(ql, 1, b.nrp)
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
        out = np.full((N, len(self.groups), ntp), -1, np.int64)
        if not _computed(role, kind):
            return pos, out
        F = self.F
        for g, (_, dcp) in enumerate(self.groups):
            out[:, g, :real] = sharded if dcp else replicated
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

    def chunked_context(self, b: Rows, odd_seq: np.ndarray | None, marks: list) -> np.ndarray | list | None:
        """The chunked-context schedule MLA's builder plans on each rank (dcp.chunks: vLLM 0.29-0.34's plan): one
        row every rank shares, or a list of each rank's where they differ; for the prefill rows (after the decodes,
        split_decodes_and_prefills at the spec-decode threshold 1 + K) of real requests, their computed context
        seq_len - query_len. Applies the chunked-context faults (appending (fault, [N] ranks) to `marks` where the
        ctx rules can see them)."""
        N, F, nr = self.N, self.F, b.nr
        q = np.diff(b.qsl[: nr + 1])
        nd = num_decodes(q, self.cfg.decode_query_len, nr)
        rows = np.arange(nd, nr)
        seqs = [b.seq] * N if odd_seq is None else [b.seq] * (N - 1) + [odd_seq]
        ctx = [(s[nd:nr] - (0 if "ctx-draft-lens" in F else q[nd:])).tolist() for s in seqs]
        if "ctx-rank-local" in F and N > 1:
            ctx[-1] = local_np(np.asarray(ctx[-1], np.int64), N, N - 1, self.I).tolist()
        sched = [self._schedule(c, rows) for c in ctx]
        V = N * self.I
        if "ctx-draft-lens" in F:
            marks.append(("ctx-draft-lens", np.array([s.size > 1 for s in sched])))
        if "ctx-chunk-unaligned" in F:
            marks.append(("ctx-chunk-unaligned", np.array([V > 1 and s.size > 1 and bool(
                s[0] % V or (s[1:].reshape(-1, chunks.ENTRY)[:, 2] % V).any()) for s in sched])))
        if "ctx-rank-local" in F and N > 1:
            marks.append(("ctx-rank-local", np.arange(N) == N - 1 if not np.array_equal(sched[-1], sched[0])
                          else np.zeros(N, bool)))
        same = all(np.array_equal(s, sched[0]) for s in sched[1:])
        return sched[0] if same else sched

    def _schedule(self, ctx: list[int], rows: np.ndarray) -> np.ndarray:
        if "ctx-chunk-unaligned" in self.F:
            mx, plans = chunks.legacy_plan(ctx, self.workspace)
            return chunks.legacy_encode(mx, plans, ctx, rows)
        mx, plans = chunks.plan_chunks(ctx, self.workspace, self.G, self.N, self.I)
        return chunks.encode(mx, plans, rows)

    def group_lens(self, b: Rows, odd_seq: np.ndarray | None, marks: list) -> tuple:
        """(group_seq_lens [N, groups * rows], verify_row_lens [N, tokens] or None) on every rank
        (dcp.reference.group_lens_np and verify_lens_np): per KV-cache group the lengths its attention metadata
        reads (the sliding-window group, replicated, the global ones), and per query token of the decode rows (before
        the first row longer than the spec-decode threshold 1 + K) the rank-local KV length it attends to. Applies
        swa-sharded and spec-causal-offset (appending (fault, [N] ranks) to `marks` where group-lens sees them)."""
        N, F, nr, I_ = self.N, self.F, b.nr, self.I
        seqs = np.broadcast_to(b.seq, (N, b.nrp)).astype(np.int64)
        if odd_seq is not None:
            seqs = seqs.copy()
            seqs[N - 1] = odd_seq
        sharded = [dcp for _, dcp in self.groups]
        gl = group_lens_np(seqs, nr, self.ranks, N, I_, sharded)
        if "swa-sharded" in F:
            g = next(k for k, (name, _) in enumerate(self.groups) if name == "swa")
            s = slice(g * b.nrp, (g + 1) * b.nrp)
            wrong = group_lens_np(seqs, nr, self.ranks, N, I_, [True])  # the swa group dealt as sharded: [N, nrp]
            marks.append(("swa-sharded", (wrong != gl[:, s]).any(axis=1)))
            gl[:, s] = wrong
        q = np.diff(b.qsl[: nr + 1])
        T = int(b.qsl[num_decodes(q, self.cfg.decode_query_len, nr)] - b.qsl[0])
        if T == 0:
            return gl, None
        verify = verify_lens_np(seqs, b.qsl, T, self.ranks, N, I_)
        if "spec-causal-offset" in F:
            row = np.searchsorted(b.qsl[1:] - b.qsl[0], np.arange(T), "right")
            k = b.qsl[row + 1] - b.qsl[0] - 1 - np.arange(T)  # tokens after each one in its row
            shifted = local_np(seqs[:, row], N, self.ranks, I_) - k
            marks.append(("spec-causal-offset", (shifted != verify).any(axis=1)))
            verify = shifted
        return gl, verify

    def sparse_topk(self, b: Rows, marks: list) -> np.ndarray | None:
        """rows.sparse_topk on every rank ([N, 3 * tokens]; None for a batch without real query tokens): per query
        token of the batch, in order, the fingerprint of its top-k set (dcp.topk's model indexer over its position + 1
        KV positions), how many of the set's entries the rank owns, and the rank's partial result (output 0 and LSE
        -inf where it owns none, else finite). Every rank selects the same set. Applies topk-tie-split and
        topk-empty-nan on the last DCP rank (appending (fault, [N] ranks) to `marks` where they changed a value)."""
        N, F, I_ = self.N, self.F, self.I
        q = b.qsl[: b.nr + 1].astype(np.int64) - int(b.qsl[0])
        T = int(q[-1]) if q.size else 0
        if T <= 0:
            return None
        t = np.arange(T, dtype=np.int64)
        row = np.searchsorted(q[1:], t, "right")
        L = np.maximum(b.seq[row].astype(np.int64) - (q[row + 1] - t) + 1, 0)  # the KV positions token t attends to
        if self._prefix is None:
            self._prefix = topk.Prefix(self.cfg.max_model_len + 1)
        bounds = topk.model_bounds(np.minimum(L, self.cfg.max_model_len))
        fp = np.broadcast_to(self._prefix.fingerprint(bounds), (N, T)).copy()
        own = topk.model_owned(bounds, self.ranks, N, I_)
        if "topk-tie-split" in F:
            odd = topk.model_bounds(np.minimum(L, self.cfg.max_model_len), lowest=False)
            fp[N - 1] = self._prefix.fingerprint(odd)
            own[N - 1] = topk.model_owned(odd, N - 1, N, I_)
            marks.append(("topk-tie-split", (np.arange(N) == N - 1) & (fp[N - 1] != fp[0]).any()))
        state = np.where(own == 0, topk.EMPTY_STATE, 0)
        if "topk-empty-nan" in F:
            state[N - 1] = np.where(own[N - 1] == 0, topk.LSE_NEG_INF | topk.NON_FINITE, 0)
            marks.append(("topk-empty-nan", (np.arange(N) == N - 1) & (own[N - 1] == 0).any()))
        return np.stack([fp, own, state], axis=-1).reshape(N, 3 * T)

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
        nd = num_decodes(q, 1, nr)
        seq = np.asarray(b.seq[:nr], np.int64)
        covered = seq.copy()
        covered[nd:] -= q[nd:]
        local = local_np(covered, N, self.ranks, self.I)
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
