#!/usr/bin/env bash
# The whole suite on the accelerator machine's image (Python 3.12, numpy 2.5, torch 2.11, triton 3.6, one GPU):
# kernels compiled and CUDA paths on the GPU. Logs go to $OUT if set.
# Usage (from the repo root on that machine): tools/accelerator_suite.sh [pytest args...]
set -uo pipefail
export PYTHONUNBUFFERED=1
log=${OUT:-/tmp}/accelerator-suite.log
python3 -c 'import sys, numpy, torch, triton; print("python", sys.version.split()[0], "numpy", numpy.__version__,
"torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available())' | tee "$log"
# the entry points (dcptool, the vLLM plugin) without the network: the image has setuptools
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$log" 2>&1 || echo "(editable install failed; PYTHONPATH only)"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
workers=$(( $(nproc) > 12 ? 12 : $(nproc) ))
python3 -m pytest -q -p no:cacheprovider -n "$workers" "$@" 2>&1 | tee -a "$log" | tail -25
rc=${PIPESTATUS[0]}
# No interpreter pass here: CI runs it on the CPU (make test). On this image triton 3.6's interpreter
# cannot run loops bounded by a loaded value under numpy 2.5 (`int()` of a 1-element array), which is the
# interpreter's limitation, not the kernels': here the kernels run compiled, on the GPU.
exit $rc
