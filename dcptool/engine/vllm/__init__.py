"""The vLLM general plugin (entry point `dcptool.engine.vllm:register`): plugin.py says what it records."""

from dcptool.engine.vllm.plugin import (  # noqa: F401
    DEFAULT_ROLLOVER,
    ENV_DIR,
    ENV_GUARD,
    ENV_ROLLOVER,
    ENV_UNTESTED,
    SITES,
    STATE,
    TABLES,
    TESTED,
    Table,
    close,
    register,
    sites_note,
    step,
    tables_for,
)
