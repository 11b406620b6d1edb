"""The vLLM general plugin (entry point `dcptool.engine.vllm:register`): plugin.py says what it records."""

from dcptool.engine.vllm.plugin import *  # noqa: F403 (the plugin's __all__)
from dcptool.engine.vllm.plugin import __all__  # noqa: F401
