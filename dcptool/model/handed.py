"""What else simulate's builds hand attention, recorded where a fault on it is injected: the per-request metadata
tensors (their addresses at the build and at the capture of the graph a replay runs, their buffers' capacities),
the host copy of seq_lens the builder reads, with the faults on them."""

from __future__ import annotations

import numpy as np

from dcptool.dump.schema import GraphMode, addr_words
from dcptool.model.config import SimConfig
from dcptool.model.rows import Rows, num_decodes

# The per-request metadata tensors simulate's attention builds hand attention (FlashAttention's DCP path): the
# builder's local context lengths and the batch's seq_lens (dcptool.config's attn_tensors)
TENSORS = ("dcp_context_kv_lens", "seq_lens")
_TENSOR_FAULTS = frozenset({"graph-addr-moved", "buffer-undersized"})
_COPY_FAULTS = frozenset({"host-seq-stale", "host-seq-written"})
_DRAFT_MODELS = ("draft", "dflash")  # the roles whose builds run a drafter's builder (its own persistent buffer)


def tensor_faults(faults) -> bool:
    """The faults on the metadata tensors are among `faults`: simulate records them (and names them in the config)."""
    return bool(_TENSOR_FAULTS & set(faults))


class Handed:
    """The metadata tensors of every build of one configuration (`faults`: those that apply), per process."""

    def __init__(self, cfg: SimConfig, faults: frozenset[str]):
        self.cfg, self.F = cfg, faults
        self.on = tensor_faults(faults)  # (otherwise nothing is recorded: dumps as before)
        self.copies_on = bool(_COPY_FAULTS & faults)
        self._fresh = 0
        self._captured: dict[tuple, np.ndarray] = {}  # (process, model, tokens, requests, micro-batch) -> words

    def _builder_buf(self, proc: int, model: int) -> int:
        """The builder's persistent dcp_context_kv_lens buffer (one per model a process runs)."""
        return (0x7D << 40) | (proc << 24) | (model << 12)

    def _batch_buf(self, proc: int, slot: int) -> int:
        """The seq_lens buffer of the batch a build reads (the input buffers its view lives beside)."""
        return (0x7C << 40) | (proc << 24) | (slot << 12)

    def addrs(self, procs: range, role: str, slot: int, graph: GraphMode, key: tuple,
              marks: list) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(attn_addrs [ranks, words], graph_addrs [ranks, words] or None) of one build on processes `procs`, or
        (None, None) where none are recorded. `key`: the graph the build captures or replays (tokens, requests,
        micro-batch). graph-addr-moved: the builder returns a tensor allocated at this build, so a full-graph
        replay's build hands attention another address than the graph captured (marks the ranks it touched)."""
        if not self.on or role == "global":
            return None, None
        model = 1 + _DRAFT_MODELS.index(role) if role in _DRAFT_MODELS else 0
        addrs = np.empty((len(procs), 2), np.int64)
        for r, proc in enumerate(procs):
            if "graph-addr-moved" in self.F:
                self._fresh += 1
                ctx = (0x7B << 40) | (proc << 28) | (self._fresh << 4)
            else:
                ctx = self._builder_buf(proc, model)
            addrs[r] = (ctx, self._batch_buf(proc, slot))
        words = addr_words(addrs).reshape(len(procs), -1)
        if not graph.full:
            return words, None
        keys = [(proc, model, *key) for proc in procs]
        if graph == GraphMode.FULL_CAPTURE:
            for k, w in zip(keys, words):
                self._captured[k] = w
            return words, None
        captured = [self._captured.get(k) for k in keys]
        if any(c is None for c in captured):
            return words, None  # (a replay of no capture recorded here: alias's domain, not checked)
        gw = np.stack(captured)
        if "graph-addr-moved" in self.F:
            marks.append(("graph-addr-moved", (gw != words).any(axis=1)))
        return words, gw

    def caps(self, procs: range, role: str, nrp: int, marks: list) -> np.ndarray | None:
        """attn_caps [ranks, tensors] of one build (None where none are recorded): the request rows each tensor's
        buffer holds, max_num_reqs (the builder's and the runner's persistent buffers). buffer-undersized: the
        builder's dcp_context_kv_lens buffer is one row short of the largest padded batch the engine builds (as
        vllm-ascend sized it by max_num_seqs, one below the graph-mode maximum with its dummy request), so the
        builds that pad to max_num_reqs requests need a row it lacks (marks the ranks it touched)."""
        if not self.on or role == "global":
            return None
        R = self.cfg.max_num_reqs
        caps = np.full((len(procs), len(TENSORS)), R, np.int32)
        if "buffer-undersized" in self.F:
            caps[:, 0] = R - 1
            marks.append(("buffer-undersized", np.full(len(procs), nrp > R - 1)))
        return caps

    def host_copies(self, b: Rows, role: str, kind: str, pages: bool, marks: list):
        """(host_seq_lens, host_seq_lens_after) of one attention build, shared by every rank (None, None where none
        are recorded): the host copy of seq_lens the metadata builder reads, as read and as left. host-seq-stale
        (vLLM #29449): under async scheduling with drafts the copy of a real step's build counts every draft of
        its verify rows (query length 1 + K) as accepted, while the device's lengths count what the rejection
        sampler kept (simulate's engine: none of them). host-seq-written (vLLM #48003): the builder subtracts its
        prefill rows' query lengths (the rows past its decodes, threshold 1) from the shared copy in place."""
        if not self.copies_on or not pages or role in ("global", "dummy") or kind != "step":
            return None, None
        nr = b.nr
        host = np.asarray(b.seq, np.int64).copy()
        q = np.diff(b.qsl[: nr + 1])
        N = self.cfg.dcp
        if "host-seq-stale" in self.F:
            k = self.cfg.spec_tokens
            verify = np.flatnonzero(q == 1 + k) if k > 0 else np.zeros(0, np.int64)
            host[verify] += k
            marks.append(("host-seq-stale", np.full(N, verify.size > 0)))
        after = host
        if "host-seq-written" in self.F:
            nd = num_decodes(q, 1, nr)
            after = host.copy()
            after[nd:nr] -= q[nd:]
            marks.append(("host-seq-written", np.full(N, nd < nr)))
        return host.astype(np.int32), after.astype(np.int32)
