"""dump/info.py: describe() (what `dcptool inspect` shows) on the bundled sample and against a direct count."""

import json
import os
from collections import Counter

import numpy as np
from conftest import ROOT, obs, write

from dcptool.dump import DumpInfo, describe, open_dumps

LEGACY = ROOT / "samples" / "legacy.safetensors"


def test_describe_the_legacy_sample():
    info = describe(open_dumps([LEGACY]))
    assert isinstance(info, DumpInfo)
    assert info.files == [str(LEGACY)] and info.format == "1" and info.bytes == os.path.getsize(LEGACY)
    assert (info.config.dcp_size, info.config.pcp_size, info.config.page_size) == (4, 2, 16)
    assert (info.observations, info.with_view, info.without_view) == (1136, 1088, 48)
    assert info.steps == (0, 24) and info.distinct_steps == 25
    assert info.sites == {"prepare_inputs": 192, "pcp_partition": 192, "ubatch": 208, "dummy": 16, "capture": 336,
                          "draft": 192}
    assert info.ranks == {0: 284, 1: 284, 2: 284, 3: 284} and info.ubatches == {-1: 928, 0: 104, 1: 104}
    assert (info.seq_rows, info.dcp_rows, info.max_num_reqs, info.max_num_reqs_padded) == (16880, 16232, 24, 24)
    assert info.optional[:3] == ["obs.parent", "obs.req_start", "obs.tok_start"] and "rows.kv_pages" in info.optional
    assert sorted(info.injected) == ["capture-wrong-buffer", "dummy-none", "flashinfer-global-pages", "graph-stale",
                                     "pcp-stale", "pcp-unpadded", "sentinel", "ubatch-none", "ubatch-parent-rows"]
    assert info.injected["dummy-none"] == [*range(8), *range(816, 824)] and info.injected["capture-wrong-buffer"] == []
    j = info.to_json()
    assert json.loads(json.dumps(j)) == j  # plain JSON: the keys of ranks and ubatches are strings
    assert j["steps"] == [0, 24] and j["ranks"] == {"0": 284, "1": 284, "2": 284, "3": 284}
    assert j["ubatches"] == {"-1": 928, "0": 104, "1": 104} and j["config"] == info.config.to_json()


def test_describe_counts_what_a_direct_count_gives(tmp_path):
    """Two files of seeded random observations: every count of describe() against Counter over the observations."""
    rng = np.random.default_rng(21)
    runs = []
    for _ in range(2):
        runs.append([obs(step=int(s), site=["x", "y", "z"][int(k)], rank=int(r), ubatch=int(u),
                         view=None if none else "auto")
                     for s, k, r, u, none in zip(rng.integers(0, 50, 40), rng.integers(0, 3, 40),
                                                 rng.integers(0, 2, 40), rng.integers(-1, 2, 40),
                                                 rng.random(40) < 0.2)])
    paths = [write(tmp_path / f"r{f}.safetensors", o, note="seeded") for f, o in enumerate(runs)]
    info = describe(open_dumps(paths))
    every = runs[0] + runs[1]
    with_view = sum(o.dcp_local_seq_lens is not None for o in every)
    assert info.files == paths and info.bytes == sum(os.path.getsize(p) for p in paths)
    assert (info.observations, info.with_view, info.without_view) == (80, with_view, 80 - with_view)
    assert info.steps == (min(o.step for o in every), max(o.step for o in every))
    assert info.distinct_steps == len({o.step for o in every})
    assert info.sites == dict(Counter(o.site for o in every))
    assert info.ranks == dict(sorted(Counter(o.rank for o in every).items()))
    assert info.ubatches == dict(sorted(Counter(o.ubatch for o in every).items()))
    assert (info.seq_rows, info.dcp_rows) == (80 * 4, with_view * 4)
    assert (info.max_num_reqs, info.max_num_reqs_padded) == (2, 4) and info.injected == {}
    assert info.config.note == "seeded" and "obs.parent" not in info.optional


def test_describe_an_empty_dump(tmp_path):
    info = describe(open_dumps([write(tmp_path / "e.safetensors", [], sites=("attn_metadata",))]))
    assert (info.observations, info.with_view, info.without_view, info.distinct_steps) == (0, 0, 0, 0)
    assert info.steps is None and (info.max_num_reqs, info.max_num_reqs_padded) == (0, 0)
    assert info.sites == info.ranks == info.ubatches == {} and (info.seq_rows, info.dcp_rows) == (0, 0)
    assert info.to_json()["steps"] is None
