"""Where replay's time goes on one dump: each phase timed alone, then cProfile of a warm library call, top
functions by own time.

    python benchmarks/profile_replay.py bench-data/bench-1000000.safetensors [backend]
    python benchmarks/profile_replay.py bench-data/legacy-dcp8-3000.safetensors triton   # on the GPU

(bench-data/legacy-dcp8-3000.safetensors: `python benchmarks/bench_replay.py --sizes dense` makes it.)
"""

import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from bench_replay import UNIT, child_phases, print_phases  # noqa: E402

from dcptool.check.replay import replay  # noqa: E402
from dcptool.dump import open_dumps  # noqa: E402

path, backend = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "auto")
replay(open_dumps([path]), backend)  # warm: JIT, thread pool
t = time.perf_counter()
res = replay(open_dumps([path]), backend)
print(f"warm replay {time.perf_counter() - t:.3f} s ({len(res.findings):,} findings, {res.backend} on {res.device})")
print_phases([(Path(path).stem, child_phases(path, backend))])
print(f"(units: scan-of-one-observation equivalents per {', '.join(f'{k}: {v}' for k, v in UNIT.items())})")
cProfile.run("replay(open_dumps([path]), backend)", "/tmp/replay.prof")
pstats.Stats("/tmp/replay.prof").sort_stats("tottime").print_stats(18)
