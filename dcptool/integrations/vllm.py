"""The plugin's former home: vLLM configurations naming `dcptool.integrations.vllm:register` keep loading.

The plugin lives in dcptool.engine.vllm; this module only forwards its public names to it."""

from dcptool.engine.vllm import ENV_DIR, close, register, step  # noqa: F401
