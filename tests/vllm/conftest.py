"""tests/vllm: the installed vLLM release's own code on CPU (0.29-0.34) through the plugin (`make test-vllm` only).

Collected only with DCPTOOL_TEST_VLLM=1 (the Makefile sets it and runs these in the vLLM venv),
so the default `make test` never imports vLLM. vLLM is loaded here the way a worker loads it:
the environment first (Triton interpreter, no GPU, CPU platform), then vLLM's plugin loader,
which finds dcptool's `vllm.general_plugins` entry point and calls register() before any
worker module is imported.
"""

import os
import sys
import tempfile

if not os.environ.get("DCPTOOL_TEST_VLLM"):
    collect_ignore_glob = ["*"]
else:
    # Before vLLM or Triton is imported: Triton kernels run in its interpreter on CPU tensors; an
    # empty CUDA_VISIBLE_DEVICES keeps vLLM from swapping Triton for a placeholder without a GPU;
    # the CPU platform keeps vLLM from pinning memory.
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ["DCPTOOL_RECORD"] = tempfile.mkdtemp(prefix="dcptool-vllm-")  # each test points it elsewhere
    sys.path.insert(0, os.path.dirname(__file__))
    from vllm.plugins import load_general_plugins

    load_general_plugins()

    import pytest

    @pytest.fixture(autouse=True)
    def _fresh_recording():
        """Each test records into its own files; and the plugin must still be recording afterwards."""
        from dcptool.engine import vllm as plugin

        yield
        plugin.close()
        assert plugin.STATE.active, "the plugin disabled itself: vLLM's internals differ from what it expects"
