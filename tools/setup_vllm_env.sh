#!/usr/bin/env bash
# The environment `make test-vllm` runs in: one real vLLM release on CPU, plus dcptool (editable) and pytest.
# Usage: VLLM_VERSION=0.29.0 tools/setup_vllm_env.sh   (default 0.33.0)
#
# vLLM pins a CUDA torch, so nothing is resolved: every package goes in with --no-deps at a pinned
# version, next to torch 2.13.0's CPU build (about 80 s and a 400 MB download the first time,
# 3.7 GB on disk). Safe to re-run: a venv that already imports vllm is only topped up.
# Target: $VLLM_VENV (default ~/.cache/dcptool-vllm-$VLLM_VERSION); one venv per release.
set -euo pipefail
VERSION=${VLLM_VERSION:-0.33.0}
VENV=${VLLM_VENV:-$HOME/.cache/dcptool-vllm-$VERSION}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY="$VENV/bin/python"
pip_() { "$PY" -m pip install -q --no-deps "$@"; }

installed() { (cd / && "$PY" -c "import sys, importlib.metadata as m; sys.exit(m.version('vllm') != '$VERSION')") 2>/dev/null; }
if ! { test -x "$PY" && installed && "$PY" -c "import vllm" 2>/dev/null; }; then
  echo "building the vLLM test environment in $VENV (first time only)"
  python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  pip_ torch==2.13.0 triton==3.9.0 numpy==2.4.6 'setuptools>=77.0.3'
  pip_ "vllm==$VERSION"
  # vLLM's pure-Python requirements, as resolved for 0.33.0 (no CUDA packages); 0.29-0.34 import with these
  pip_ aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 annotated-types==0.8.0 \
    anyio==4.16.0 apache-tvm-ffi==0.1.11 attrs==26.1.0 cachetools==8.0.2 cbor2==6.3.0 \
    certifi==2026.10.19.post1 charset-normalizer==3.5.3 click==8.5.1 cloudpickle==3.1.3 einops==0.8.2 \
    fastapi==0.136.3 filelock==4.3.1 frozenlist==1.8.0 fsspec==2026.9.0 h11==0.16.0 hf-xet==1.8.0 \
    httpcore2==2.16.2 httpx2==2.16.2 huggingface_hub==2.4.0 idna==3.20 Jinja2==3.1.6 llguidance==1.7.6 \
    markdown-it-py==4.3.0 MarkupSafe==3.0.4 mdurl==0.1.2 mpmath==1.3.0 msgspec==0.23.0 multidict==7.2.1 \
    networkx==3.6.1 openai==3.57.0 opentelemetry-api==1.45.2 oss-harmony==0.0.11 packaging==26.4 \
    partial-json-parser==0.2.1.1.post7 pillow==13.0.0 prometheus_client==0.26.0 propcache==0.5.4 psutil==7.2.2 \
    py-cpuinfo==9.0.0 pybase64==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5 Pygments==2.21.0 PyYAML==6.0.4 \
    pyzmq==27.3.0 regex==2026.11.19 requests==2.34.2 rich==15.0.0 safetensors==0.8.0 shellingham==1.5.4 \
    sniffio==1.3.1 starlette==1.10.0 sympy==1.14.0 tokenizers==0.23.3 tqdm==4.70.1 transformers==5.20.2 \
    truststore==0.10.5 typer==0.29.2 typing-inspection==0.4.5 typing_extensions==4.16.0 urllib3==2.8.0 \
    uvloop==0.23.0 xgrammar==0.2.8 yarl==1.25.1
fi
# FlashInfer's Python package, so that vLLM's FlashInfer and MLA attention-metadata builder modules import on CPU
# (tests/vllm/test_vllm_builders.py runs them). --no-deps: it requires CUDA packages (cuda-python, cuDNN frontend,
# CUTLASS DSL, NCCL); of its requirements its import needs only pynvml (nvidia-ml-py) beside vLLM's own. A venv built
# before this line is topped up. (vLLM's CUTLASS-MLA and FlashAttention-MLA modules still need CUDA: docs/limits.md)
fi_ok() { (cd / && "$PY" -c "import sys, importlib.metadata as m
sys.exit(m.version('flashinfer-python') != '0.7.2.post1' or m.version('nvidia-ml-py') != '13.615.71')") 2>/dev/null; }
fi_ok || pip_ flashinfer-python==0.7.2.post1 nvidia-ml-py==13.615.71
"$PY" -c "import pytest" 2>/dev/null || pip_ pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1
# LMCache's multi-process connector planning, before and after its DCP fix (tests/vllm/test_vllm_lmcache.py reads
# its source: its modules import LMCache's CUDA ops, so the wheels are only unpacked, each in a directory of its own)
for v in 0.5.4 0.5.6; do
  test -d "$VENV/lmcache-$v/lmcache" || "$PY" -m pip install -q --no-deps --target "$VENV/lmcache-$v" "lmcache==$v"
done
# vllm-ascend's Mooncake connector planning (tests/vllm/test_vllm_mooncake.py reads its source: the module imports
# torch_npu and Mooncake's transfer engine). PyPI has vllm-ascend as a source archive only: pip downloads it after
# preparing its metadata (setuptools-scm; SOC_VERSION names an Ascend chip, COMPILE_CUSTOM_KERNELS=0 builds nothing),
# and only the connector's file is unpacked.
VA=0.23.0.post1
MC=vllm_ascend/distributed/kv_transfer/kv_p2p/mooncake_connector.py
if ! test -f "$VENV/vllm-ascend-$VA/$MC"; then
  pip_ setuptools-scm==10.3.4 vcs-versioning==2.6.0
  tmp=$(mktemp -d)
  SOC_VERSION=ascend910b1 COMPILE_CUSTOM_KERNELS=0 "$PY" -m pip download -q --no-deps --no-build-isolation \
    -d "$tmp" "vllm-ascend==$VA"
  mkdir -p "$VENV/vllm-ascend-$VA"
  tar -xzf "$tmp/vllm_ascend-$VA.tar.gz" -C "$VENV/vllm-ascend-$VA" --strip-components=1 "vllm_ascend-$VA/$MC"
  rm -rf "$tmp"
fi
# dcptool itself, editable from this checkout, so vLLM's plugin loader finds its `vllm.general_plugins` entry point
# (checked from / so that a checkout in the current directory does not answer for the installed one)
if ! (cd / && "$PY" -c "
import sys, importlib.metadata as m, dcptool
eps = [e for e in m.entry_points(group='vllm.general_plugins') if e.name == 'dcptool']
sys.exit(not eps or dcptool.__file__ != '$REPO/dcptool/__init__.py')" 2>/dev/null); then
  pip_ --no-build-isolation -e "$REPO" 2>&1 | grep -v -i -E "warning|deprecat|^\s*$|!!|\*\*\*|^  " || true
fi
echo "vLLM test environment ready: $VENV ($("$PY" -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null))"
