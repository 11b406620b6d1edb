"""CUDA graphs in the runner model: vLLM's default capture sizes, the descriptors its CudaGraphManager captures
(FULL_AND_PIECEWISE for --cudagraph full), and its dispatch."""

from __future__ import annotations

from dataclasses import dataclass

from dcptool.dump.schema import GraphMode
from dcptool.model.config import SimConfig

# vLLM defaults the model follows (ParallelConfig.dbo_*_token_threshold, CompilationConfig's ceiling).
DBO_DECODE_TOKENS = 32
DBO_PREFILL_TOKENS = 512
MAX_GRAPH_TOKENS = 512


@dataclass(frozen=True)
class Desc:
    """A batch execution descriptor: graph mode, padded tokens, padded requests (None: no request padding)."""

    mode: GraphMode  # as dispatched: EAGER, PIECEWISE or FULL_REPLAY (a full graph; recorded() says capture or replay)
    num_tokens: int
    num_reqs: int | None
    ubatches: int = 1


def capture_sizes(max_num_reqs: int, max_num_tokens: int, decode_query_len: int) -> list[int]:
    """vLLM's default cudagraph_capture_sizes (VllmConfig): 1, 2, 4, then every 8 to 256, every 16
    above, up to min(2 * max_num_seqs * decode_query_len, 512), plus the uniform decode sizes."""
    mx = min(max_num_reqs * decode_query_len * 2, MAX_GRAPH_TOKENS)
    if decode_query_len > 1:
        n = min(max_num_reqs, MAX_GRAPH_TOKENS)
        counts = {c for c in (1, 2, 4) if c <= n} | set(range(8, min(n + 1, 256), 8)) | set(range(256, n + 1, 16))
        decode = {c * decode_query_len for c in counts | {n} if c * decode_query_len <= mx}
    else:
        decode = {max_num_reqs} if max_num_reqs <= mx else set()
    mx = min(max_num_tokens, mx)
    sizes = {s for s in (1, 2, 4) if s <= mx} | set(range(8, min(mx + 1, 256), 8)) | set(range(256, mx + 1, 16))
    if max_num_tokens <= mx:
        sizes.add(max_num_tokens)
    sizes |= {s for s in decode if s <= max_num_tokens}
    return sorted(sizes)


class Graphs:
    """The descriptors vLLM's CudaGraphManager captures, and its dispatch (smallest compatible graph)."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        dql, R = cfg.decode_query_len, cfg.max_num_reqs
        self.full: list[Desc] = []  # uniform-decode FULL graphs (and their micro-batched twins)
        self.piecewise: list[Desc] = []
        if cfg.cudagraph == "none":
            return
        sizes = capture_sizes(R, cfg.token_budget, dql)
        self.max_size = sizes[-1]
        if cfg.cudagraph == "full":
            for s in sizes:
                tok = -(-s // dql) * dql
                if tok > R * dql or tok > self.max_size or tok // dql > R:
                    continue
                d = Desc(GraphMode.FULL_REPLAY, tok, tok // dql)
                if d not in self.full:
                    self.full.append(d)
                    if cfg.ubatches > 1 and tok >= max(DBO_DECODE_TOKENS, cfg.ubatches):
                        self.full.append(Desc(GraphMode.FULL_REPLAY, tok, tok // dql, cfg.ubatches))
        self.piecewise = [Desc(GraphMode.PIECEWISE, s, None) for s in sizes]

    def captures(self) -> list[Desc]:
        """In vLLM's capture order: PIECEWISE first, then FULL, each largest first (twin after its base)."""
        by_size = sorted(self.piecewise, key=lambda d: -d.num_tokens)
        return by_size + sorted(self.full, key=lambda d: -d.num_tokens)

    def dispatch(self, num_reqs: int, num_tokens: int, uniform_decode: bool, ubatch: bool) -> Desc:
        cfg = self.cfg
        base = self._smallest_full(num_tokens) if uniform_decode else None
        if base is not None and base.num_reqs < num_reqs:
            base = None
        if ubatch and cfg.ubatches > 1 and num_tokens >= (DBO_DECODE_TOKENS if uniform_decode else DBO_PREFILL_TOKENS):
            # a micro-batched FULL graph when one was captured, unless its second half would be empty
            twin = None if base is None else Desc(GraphMode.FULL_REPLAY, base.num_tokens, base.num_reqs, cfg.ubatches)
            if twin is not None and twin in self.full and 2 * num_tokens >= twin.num_tokens:
                return twin
            return Desc(GraphMode.EAGER, num_tokens, None, cfg.ubatches)
        if base is not None:
            return base
        for d in self.piecewise:
            if d.num_tokens >= num_tokens:
                return d
        return Desc(GraphMode.EAGER, num_tokens, None)

    def _smallest_full(self, num_tokens: int) -> Desc | None:
        return next((d for d in self.full if d.ubatches == 1 and d.num_tokens >= num_tokens), None)
