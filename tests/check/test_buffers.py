"""buffers.py: graph-addr on seeded random recordings of full-graph replays, against a reference reading of the rule
(one observation at a time, numpy), and on hand-built replays that must and must not be found."""

import numpy as np
import pytest

from dcptool.check.buffers import check_graph_addr
from dcptool.dump import Dump, DumpConfig, Observation, addr_words, pack, word_addrs
from dcptool.dump.schema import validate_columns

TENSORS = ("dcp_context_kv_lens", "seq_lens")


def _dump(observations) -> Dump:
    cfg, cols = pack(observations, DumpConfig(dcp_size=2, attn_tensors=TENSORS))
    validate_columns("t", cfg, cols)
    n = len(observations)
    return Dump(files=["t"], config=cfg, columns=cols, file_index=np.zeros(n, np.int32),
                file_obs=np.arange(n, dtype=np.int64))


def _obs(step, graph, addrs, gaddrs=None):
    return Observation(step=step, site="attn_metadata", rank=0, num_reqs=1, num_reqs_padded=1,
                       seq_lens=np.array([9]), dcp_local_seq_lens=np.array([5]), graph=graph,
                       attn_addrs=None if addrs is None else addr_words(addrs),
                       graph_addrs=None if gaddrs is None else addr_words(gaddrs))


def _reference(observations) -> dict[int, tuple[int, int, int]]:
    """The rule read plainly: a full-graph replay with both address lists whose lists differ; per finding the first
    tensor that moved (or -1 for lists of another length) and how many moved."""
    out = {}
    for i, o in enumerate(observations):
        if o.graph != 3 or o.attn_addrs is None or o.graph_addrs is None or not o.attn_addrs.size \
                or not o.graph_addrs.size:
            continue
        a, g = word_addrs(o.attn_addrs), word_addrs(o.graph_addrs)
        if a.size != g.size:
            out[i] = (-1, a.size, g.size)
        elif (a != g).any():
            moved = np.flatnonzero(a != g)
            out[i] = (int(moved[0]), int(a[moved[0]]), int(g[moved[0]]))
    return out


@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 1000])
def test_random_recordings_match_the_reference(n):
    rng = np.random.default_rng(n)
    base = np.array([0x7F0000000000, 0x7F0000100000], np.int64)
    observations = []
    for i in range(n):
        graph = int(rng.integers(0, 4))
        addrs = base + rng.integers(0, 3, 2) * 0x1000  # (a third of the tensors moved, in either position)
        gaddrs = base if graph == 3 and rng.random() < 0.9 else None
        if gaddrs is not None and rng.random() < 0.05:
            gaddrs = base[:1]  # a graph that captured another number of tensors
        observations.append(_obs(i, graph, None if rng.random() < 0.05 else addrs, gaddrs))
    want = _reference(observations)
    if not n:
        return
    found = {f.obs: f for f in check_graph_addr(_dump(observations))}
    assert want or n < 100  # (a large recording holds moved tensors)
    assert sorted(found) == sorted(want)
    for i, (k, rec, exp) in want.items():
        f = found[i]
        assert (f.recorded, f.expected) == (rec, exp)
        if k >= 0:
            assert TENSORS[k] in f.message and f.detail["tensor"] == TENSORS[k]


def test_a_replay_reading_a_moved_tensor_is_found_and_a_steady_one_is_not():
    cap = [0x7F0000001000, 0x7F0000002000]
    d = _dump([_obs(0, 2, cap), _obs(1, 3, cap, cap), _obs(2, 3, [0x7F0000009000, cap[1]], cap),
               _obs(3, 0, [0x7F0000009000, cap[1]]),  # eager: reads what it wrote
               _obs(4, 3, [0x7F0000009000, cap[1]])])  # a replay of no capture seen: not checked
    found = list(check_graph_addr(d))
    assert [f.obs for f in found] == [2] and found[0].rule == "graph-addr"
    assert "dcp_context_kv_lens is at 0x7f0000009000" in found[0].message and "0x7f0000001000" in found[0].message


def test_without_the_graph_column_nothing_is_checked():
    d = _dump([_obs(0, None, [1], [2])])
    assert list(check_graph_addr(d)) == []


def _capped(step, nrp, caps):
    return Observation(step=step, site="attn_metadata", rank=0, num_reqs=min(nrp, 3), num_reqs_padded=nrp,
                       seq_lens=np.array([9] * nrp), dcp_local_seq_lens=np.array([5] * min(nrp, 3) + [0] * (nrp - 3)),
                       attn_caps=None if caps is None else np.array(caps, np.int32))


@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 1000])
def test_capacity_on_random_recordings_matches_the_reference(n):
    """capacity against the rule read plainly (torch): a build whose num_reqs_padded exceeds any buffer's rows, at
    its first short tensor, recorded = that capacity, expected = num_reqs_padded."""
    import torch

    rng = np.random.default_rng(100 + n)
    observations = []
    for i in range(n):
        nrp = int(rng.integers(3, 40))
        caps = None if rng.random() < 0.1 else rng.integers(nrp - 2, nrp + 30, 2)
        observations.append(_capped(i, nrp, caps))
    if not n:
        return
    want = {}
    for i, o in enumerate(observations):
        if o.attn_caps is None:
            continue
        short = torch.from_numpy(o.attn_caps.astype(np.int64)) < o.num_reqs_padded
        if bool(short.any()):
            want[i] = int(o.attn_caps[int(torch.nonzero(short)[0])])
    from dcptool.check.buffers import check_capacity

    found = {f.obs: f for f in check_capacity(_dump(observations))}
    assert want or n < 100
    assert {i: f.recorded for i, f in found.items()} == want
    assert all(f.expected == observations[i].num_reqs_padded and f.rule == "capacity" for i, f in found.items())


def test_a_buffer_one_row_short_of_the_padded_batch_is_found_and_a_full_one_is_not():
    from dcptool.check.buffers import check_capacity

    d = _dump([_capped(0, 16, [16, 16]), _capped(1, 16, [15, 16]), _capped(2, 8, [15, 16]), _capped(3, 16, None),
               _capped(4, 16, [0, 0])])
    found = list(check_capacity(d))
    assert [f.obs for f in found] == [1, 4]
    assert "buffer behind dcp_context_kv_lens holds 15" in found[0].message and found[0].wrong_rows == 1
    assert found[1].detail == {"tensor": "dcp_context_kv_lens", "short": 2}
