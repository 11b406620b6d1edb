"""Shared simulate cases for the model's tests: small engines, the issue's matrix, where each fault is exercised, and
the check that every fault is found exactly where it touched."""

from pathlib import Path

from dcptool.check.replay import replay
from dcptool.dump import open_dumps
from dcptool.model.simulate import SimConfig, simulate

# Small engines (16 requests, 1024-token budget) keep each run quick while still crossing vLLM's
# micro-batching thresholds (32 decode / 512 prefill tokens) and padding requests for full graphs.
SMALL = dict(steps=7, dummy_every=3, max_num_reqs=16, token_budget=1024)

# (N, I, P, K, U, graph mode, spec method): every value of every axis of the matrix appears,
# and every fault applies in at least one row (see test_every_fault_is_exercised). One row a line.
_MATRIX = """
1  1 1 0 1 none      mtp
1 16 2 3 2 full      mtp
2  1 1 3 2 full      mtp
2 16 2 0 1 piecewise mtp
2  1 2 3 2 full      mtp
4  1 1 0 2 piecewise mtp
4 16 2 3 1 full      mtp
4  1 2 0 2 none      dflash
8 16 1 3 2 full      dflash
8  1 2 3 2 full      mtp
8 16 2 0 1 none      mtp
2 16 1 0 1 full      mtp
"""
MATRIX = [(*map(int, r[:5]), r[5], r[6]) for r in (line.split() for line in _MATRIX.strip().splitlines())]


def config_of(row, seed, **kw) -> SimConfig:
    N, I_, P, K, U, g, m = row
    return SimConfig(dcp=N, interleave=I_, pcp=P, spec_tokens=K, ubatches=U, cudagraph=g, spec_method=m,
                     page_size=16, seed=seed, **{**SMALL, **kw})


def run(cfg: SimConfig, tmp_path: Path, name: str = "run.safetensors", **kw):
    res = simulate(cfg, tmp_path / name, force=True, **kw)
    d = open_dumps(res.files)
    return res, d, replay(d, "torch")


def verify(res, d, rr) -> None:
    """docs/faults.md: each fault's rule at exactly the observations it touched; nothing anywhere else.

    Keys are (file, index in file). `rank-sum` is a finding about a group of ranks, reported at the
    observation that completes it; it counts as a side finding when any member of the group was touched.
    Stale faults whose surviving rows happen to be right (simulate lists them as shape-only) can only
    be `shape`."""
    touched_all = set()
    by_rule: dict[str, set] = {}
    for f in rr.findings:
        by_rule.setdefault(f.rule, set()).add((f.file, f.obs))
    for rep in res.faults.values():
        if not rep.applicable:
            assert rep.count == 0
            continue
        touched = {(file, i) for file, v in rep.touched.items() for i in v}
        shape_only = {(file, i) for file, v in rep.shape_only.items() for i in v}
        touched_all |= touched
        assert touched - shape_only <= by_rule.get(rep.rule, set()), f"{rep.name}: {rep.rule} not found"
        assert shape_only <= by_rule.get("shape", set()), f"{rep.name}: shape-only not found as shape"
        if len(res.faults) == 1:  # a single fault: its rule is reported nowhere else
            assert by_rule.get(rep.rule, set()) <= touched, f"{rep.name}: {rep.rule} on untouched observations"
    for f in rr.findings:
        if f.rule == "rank-sum":
            assert {(f.file, o) for o in f.detail["obs"]} & touched_all, f.message
        else:
            assert (f.file, f.obs) in touched_all, f"{f.rule} on an untouched observation: {f.message}"
    # the dump carries the same ground truth
    for k, file in enumerate(d.files):
        assert (d.injected[k] or {}) == res.injected(file)


# Where each fault is sure to touch something (and, for most, the default configuration exercises it).
EXERCISE = {
    "dummy-none": (2, 1, 1, 2, 2, "full", "mtp"),
    "dflash-capture-none": (2, 1, 1, 3, 1, "full", "dflash"),
    "ubatch-none": (4, 1, 1, 2, 2, "full", "mtp"),
    "ubatch-parent-rows": (4, 1, 1, 2, 2, "none", "mtp"),
    "pcp-stale": (4, 1, 2, 2, 1, "piecewise", "mtp"),
    "pcp-unpadded": (4, 1, 2, 2, 1, "full", "mtp"),
    "capture-wrong-buffer": (4, 1, 2, 2, 1, "full", "mtp"),
    "graph-stale": (2, 1, 1, 2, 2, "full", "mtp"),
    "sentinel": (4, 16, 1, 2, 1, "full", "mtp"),
    "flashinfer-global-pages": (8, 1, 1, 0, 1, "none", "mtp"),
    "dcp-qsl-local": (4, 1, 1, 0, 2, "piecewise", "mtp"),
    "tot-local": (2, 16, 1, 0, 1, "full", "mtp"),
    "rank-disagree": (2, 1, 1, 3, 2, "full", "mtp"),
    "slot-wrong-group": (4, 2, 1, 2, 2, "full", "mtp"),
    "slot-all-ranks": (3, 16, 1, 2, 2, "piecewise", "mtp"),
    "ctx-rank-local": (4, 1, 2, 2, 2, "full", "mtp"),
    "ctx-chunk-unaligned": (3, 1, 1, 2, 2, "full", "mtp"),  # (N * I = 3 divides no power-of-two workspace share)
    "ctx-draft-lens": (4, 1, 1, 3, 1, "full", "dflash"),
    "swa-sharded": (4, 1, 2, 2, 2, "full", "mtp"),
    "spec-causal-offset": (4, 16, 1, 3, 2, "full", "mtp"),
    "topk-tie-split": (4, 1, 1, 2, 2, "full", "mtp"),
    "topk-empty-nan": (4, 16, 2, 2, 2, "full", "mtp"),
    "graph-addr-moved": (4, 1, 2, 2, 2, "full", "mtp"),
    "slot-kernel-block": (4, 16, 2, 2, 2, "full", "mtp"),
    "buffer-undersized": (4, 1, 2, 2, 2, "full", "mtp"),
    "host-seq-stale": (4, 1, 2, 2, 2, "full", "mtp"),
    "host-seq-written": (4, 1, 2, 2, 2, "full", "mtp"),
    "flashinfer-prefill-pages": (4, 1, 2, 2, 2, "full", "mtp"),
}

# The transfer faults: where each touches transfers (a decode side with DCP 4 and full graphs, and the prefill
# layout or connector the fault needs): fault -> SimConfig keywords beyond config_of's row.
PAIR = {
    "nixl-pcp-stride": dict(kv_connector="nixl", prefill_dcp=2, prefill_pcp=2, prefill_kv_shards="cp"),
    "nixl-single-source": dict(kv_connector="nixl", prefill_dcp=8),
    "mooncake-group-scale": dict(kv_connector="mooncake"),
    "mooncake-unsharded-prefill": dict(kv_connector="mooncake", prefill_dcp=1),
    "lmcache-partial-store": dict(kv_connector="lmcache"),
}
for _f in PAIR:
    EXERCISE[_f] = (4, 16, 1, 2, 2, "full", "mtp")
