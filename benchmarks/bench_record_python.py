"""observe()'s Python on the device path, this checkout against another revision, in one run (no GPU needed).

    python benchmarks/bench_record.py --cuda-python [--before REV] [--obs 20000] [--reps 3]

Host tensors go through the host ring the tests use, the launch replaced by a stand-in that writes what the harvest
reads of a slot (bench_record_sets.stand_in_launches; timed alone and subtracted). Each revision runs in a process
of its own (its whole dcptool package: `git archive REV dcptool`), in short blocks interleaved with the other's,
best block of each: the machine's other load hits some blocks, not the minimum. Three argument forms: the tensor
form (seq_lens, dcp_local_seq_lens, query_start_loc as int32 tensors), the plugin's (query_start_loc as numpy), and
the plugin's with positions and a [2, tokens] int64 slot mapping. The same run times the door alone: building the
observation's Record with tuple.__new__ and with keywords.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
import timeit
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMS = ("tensors", "plugin", "plugin + slots")


def _worker(blocks: int, block: int) -> None:
    """One revision's side (run in a process whose dcptool is that revision's): print per form the CPU seconds of
    each block of `block` observations and of the stand-in launches alone, as JSON."""
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_record_sets import stand_in_launches

    from dcptool import Recorder  # (this process's revision)

    rng = np.random.default_rng(0)
    seq = torch.from_numpy(rng.integers(1, 1 << 17, 256).astype(np.int32))
    dcp = torch.from_numpy(rng.integers(1, 1 << 15, 256).astype(np.int32))
    qsl = torch.arange(257, dtype=torch.int32)
    pos = torch.arange(768, dtype=torch.int64)
    sm = torch.from_numpy(rng.integers(-1, 1 << 20, (2, 768))).to(torch.int64)
    kv = [{"name": "attn", "dcp": True}, {"name": "mamba", "dcp": False}]
    forms = {"tensors": dict(query_start_loc=qsl), "plugin": dict(query_start_loc=qsl.numpy()),
             "plugin + slots": dict(query_start_loc=qsl.numpy(), positions=pos, slot_mapping=sm)}
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for name, extra in forms.items():
            rec = Recorder(Path(d) / f"{len(out)}.safetensors", dcp_size=2, kv_groups=kv)
            ring = rec._device.use_host_ring(1 << 20)
            stand_in_launches(ring)
            go3, base = ring.go3, ring.base
            absent = getattr(ring, "absent5", (base, -1) * 5)
            times, alone = [], []
            for i in range(2000):  # warm up (the ring wraps: its pages are touched)
                rec.observe(step=i, site="attn_metadata", rank=0, seq_lens=seq, num_reqs=250, num_reqs_padded=256,
                            dcp_local_seq_lens=dcp, **extra)
            for _ in range(blocks):
                t0 = time_now()
                for i in range(block):
                    rec.observe(step=i, site="attn_metadata", rank=0, seq_lens=seq, num_reqs=250,
                                num_reqs_padded=256, dcp_local_seq_lens=dcp, **extra)
                times.append((time_now() - t0) / block)
                t0 = time_now()
                for _ in range(block):
                    go3(0, 1, base + 64, 1, 250, 256, 8 << 16, 800, 0, 256, 0, 256, 0, 257, *absent)
                alone.append((time_now() - t0) / block)
            assert rec.dropped == 0, rec.dropped
            rec.discard()
            out[name] = (times, alone)
    print(json.dumps(out))


def time_now() -> float:
    import time

    return time.process_time()


def revision_tree(rev: str, into: Path) -> Path | None:
    """Revision rev's dcptool package (and benchmarks, which its worker does not use) under `into`; None if git
    cannot give it."""
    got = subprocess.run(["git", "archive", rev, "dcptool"], cwd=ROOT, capture_output=True)
    if got.returncode:
        print(f"(revision {rev} is not available: {got.stderr.decode().strip()})")
        return None
    with tarfile.open(fileobj=BytesIO(got.stdout)) as t:
        t.extractall(into, filter="data")
    return into


def _run(tree: Path, blocks: int, block: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DCPTOOL_")}
    env.update(PYTHONPATH=str(tree), CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, __file__, "--worker", str(blocks), str(block)], capture_output=True,
                       text=True, env=env, cwd=tree)
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    return json.loads(p.stdout.splitlines()[-1])


def door() -> dict[str, float]:
    """ns to build the Record of one observe() call: tuple.__new__ over the 21 values (the Recorder's door), and
    with keywords (a caller that builds its own Record, as the vLLM plugin does)."""
    from dcptool.dump import Record

    new = tuple.__new__
    vals = (1, "attn_metadata", 0, 250, 256, object(), object(), -1, None, None, None, None, object(), None, None,
            None, None, None, None, None, None)
    kw = dict(zip(Record._fields, vals))
    out = {}
    for name, fn in (("tuple.__new__", lambda: new(Record, vals)), ("keywords", lambda: Record(**kw)),
                     ("(an empty call, subtracted)", lambda: None)):
        out[name] = min(timeit.repeat(fn, number=200_000, repeat=7)) / 200_000 * 1e9
    empty = out.pop("(an empty call, subtracted)")
    return {k: v - empty for k, v in out.items()}


def bench(n: int, reps: int, before: str | None) -> None:
    block, rounds = 1000, max(1, n // 5000) * reps
    trees = {"now": ROOT}
    with tempfile.TemporaryDirectory() as d:
        if before and revision_tree(before, Path(d)) is not None:
            trees[f"before ({before})"] = Path(d)
        res: dict = {k: {f: ([], []) for f in FORMS} for k in trees}
        for _ in range(rounds):  # interleaved: each round one process per revision, 5 blocks each
            for name, tree in trees.items():
                got = _run(tree, 5, block)
                for f in FORMS:
                    res[name][f][0].extend(got[f][0])
                    res[name][f][1].extend(got[f][1])
    print(f"Recorder.observe on the device path, Python only (256 requests; {rounds} rounds x 5 blocks of {block:,} "
          "observations per revision and form, interleaved; CPU time; host tensors, the launch a stand-in):")
    print("| revision | argument form | µs/observe, best block | median block | stand-in launch | Python µs/observe |")
    print("|---|---|---|---|---|---|")
    import numpy as np

    net: dict = {}
    for name in trees:
        for f in FORMS:
            t, s = res[name][f]
            b, m, st = float(np.min(t)) * 1e6, float(np.median(t)) * 1e6, float(np.min(s)) * 1e6
            net[name, f] = b - st
            print(f"| {name} | {f} | {b:.2f} | {m:.2f} | {st:.2f} | {b - st:.2f} |")
    if len(trees) > 1:
        other = next(k for k in trees if k != "now")
        print("now / before, Python per observe: " + ", ".join(f"{f} {net['now', f] / net[other, f]:.3f}x"
                                                               for f in FORMS))
    print("the door, building one observation's Record: " + ", ".join(f"{k} {v:.0f} ns" for k, v in door().items()))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(int(sys.argv[2]), int(sys.argv[3]))
