"""Where replay's time goes on one dump: cProfile of a warm library call, top functions by own time.

    python benchmarks/profile_replay.py bench-data/bench-1000000.safetensors [backend]
"""

import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dcptool.dump import open_dumps  # noqa: E402
from dcptool.replay import replay  # noqa: E402

path, backend = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "auto")
replay(open_dumps([path]), backend)  # warm: JIT, thread pool
t = time.perf_counter()
replay(open_dumps([path]), backend)
print(f"warm replay {time.perf_counter() - t:.3f} s")
cProfile.run("replay(open_dumps([path]), backend)", "/tmp/replay.prof")
pstats.Stats("/tmp/replay.prof").sort_stats("tottime").print_stats(18)
