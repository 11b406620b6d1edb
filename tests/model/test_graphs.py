"""graphs.py: vLLM's CUDA-graph capture sizes and the runner model's graph dispatch."""

from dcptool.dump.schema import GraphMode
from dcptool.model.config import SimConfig
from dcptool.model.graphs import Desc, Graphs, capture_sizes


def test_capture_sizes_are_vllms_defaults():
    """vLLM's default cudagraph_capture_sizes for 64 requests, a 2048-token budget and 2 draft tokens."""
    sizes = capture_sizes(64, 2048, 3)
    assert sizes[:4] == [1, 2, 3, 4] and sizes[-1] == 384 and 256 in sizes and 264 not in sizes


def test_dispatch_picks_the_smallest_compatible_graph():
    """Uniform decodes replay the smallest FULL graph with room for their requests (micro-batched ones its
    twin), other batches the smallest PIECEWISE graph, and batches larger than every graph run eager."""
    g = Graphs(SimConfig(max_num_reqs=16, token_budget=1024, spec_tokens=2, ubatches=2, cudagraph="full"))
    full, piecewise, eager = GraphMode.FULL_REPLAY, GraphMode.PIECEWISE, GraphMode.EAGER
    assert g.dispatch(5, 15, True, False) == Desc(full, 18, 6)
    assert g.dispatch(5, 15, False, False) == Desc(piecewise, 16, None)
    assert g.dispatch(20, 200, False, False) == Desc(eager, 200, None)
    assert g.dispatch(11, 33, True, True) == Desc(full, 33, 11, 2)  # micro-batched: the captured twin
    assert g.dispatch(20, 600, False, True) == Desc(eager, 600, None, 2)  # a micro-batched prefill
    assert g.captures()[0] == Desc(piecewise, 96, None) and g.captures()[-1] == Desc(full, 3, 1)
    assert Graphs(SimConfig(cudagraph="none")).dispatch(5, 15, True, False) == Desc(eager, 15, None)
