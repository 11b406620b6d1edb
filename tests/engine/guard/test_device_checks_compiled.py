"""device_checks_tl.py compiled as a GPU compiles it, on any machine: Triton's front end with the GPU's blocks (1,024
rows, [2 groups, 2,048 tokens] tiles) and ptxas for sm_90. The interpreter runs smaller blocks of one size (256), so
a shape that does not broadcast at the GPU's sizes passes every kernel test here and fails only on the GPU."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dcptool.engine.guard import device_checks_tl as K
from dcptool.engine.guard.device_checks import GUARD_WARPS, KERNEL_ARGS
ann = K.guard_kernel.fn.__annotations__
sig = {a: "i64" if "int64" in str(ann[a]) else "i32" for a in KERNEL_ARGS}
k = triton.compile(ASTSource(fn=K.guard_kernel, signature=sig, constexprs={}), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": GUARD_WARPS})
print("ptx", len(k.asm["ptx"]), "cubin", len(k.asm["cubin"]))
"""


def test_the_check_kernel_compiles_for_a_gpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path))
    got = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    ptx, cubin = (int(x) for x in got.stdout.split()[1::2])
    assert ptx > 0 and cubin > 0
