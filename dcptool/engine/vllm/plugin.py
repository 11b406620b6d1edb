"""vLLM general plugin: with DCPTOOL_RECORD=<dir>, record every attention-metadata build of model runner V2.

Install dcptool next to vLLM (entry point group `vllm.general_plugins`, name `dcptool`); vLLM calls
`register()` in every process. Without DCPTOOL_RECORD it does nothing. With it, the worker
modules below are wrapped as they are imported, and every `build_attn_metadata` call of model
runner V2 (model states, speculators, DFlash capture) is recorded, with the batch it was built
for, into `<dir>/rank<r>.NNNNN.safetensors` through `dcptool.engine.recorder.record.Recorder`.

Supported: vLLM 0.29.x to 0.34.x, through one hook table per release line (TABLES). The table is
picked by what the installed vLLM has: the one named by its version first, then any other whose
hook points all have the parameters the wrappers read (checked per module as it is imported). A
version newer than every table is tried with the newest table; an older one records nothing
unless DCPTOOL_VLLM_UNTESTED=1. If no table matches a module's signatures, or anything in the
recording path fails, it logs one warning and stops recording. The engine's own calls always run,
with their own results and exceptions.

What is recorded is what attention consumes: vLLM's `build_attn_metadata` (every supported
release) first cuts `seq_lens` and `dcp_local_seq_lens` to `[:num_reqs]`; the plugin checks that
in the function's source when it wraps it, and records those views, not the arguments.

This module is the plugin's entry (register, step, close); state holds the process's state and the
Recorder it opens, hooks the wrappers of vLLM's functions, tables the hook tables and the import hook.
"""

from __future__ import annotations

import os
import sys

from dcptool.engine.vllm.hooks import learn
from dcptool.engine.vllm.state import (
    DEFAULT_ROLLOVER,
    ENV_DIR,
    ENV_GUARD,
    ENV_ROLLOVER,
    ENV_UNTESTED,
    SITES,
    STATE,
    Frame,
    broken,
    close,
    log,
    sites_note,
)
from dcptool.engine.vllm.tables import TABLES, TESTED, Finder, Table, hooked_modules, patch, tables_for

__all__ = ["DEFAULT_ROLLOVER", "ENV_DIR", "ENV_GUARD", "ENV_ROLLOVER", "ENV_UNTESTED", "SITES", "STATE", "TABLES",
           "TESTED", "Table", "close", "register", "sites_note", "step", "tables_for"]


def register() -> None:
    """vLLM's plugin entry point (every process). Does nothing unless DCPTOOL_RECORD or DCPTOOL_GUARD is set."""
    if STATE.registered or not (os.environ.get(ENV_DIR) or os.environ.get(ENV_GUARD)):
        return
    STATE.registered = True
    STATE.guarding = not os.environ.get(ENV_DIR)
    try:
        import vllm

        version = getattr(vllm, "__version__", "unknown")
        STATE.tables = tables_for(version, bool(os.environ.get(ENV_UNTESTED)))
        if not STATE.tables:
            return broken(f"vLLM {version} is not supported (supported: {', '.join(t.line for t in TABLES)}; "
                           f"tested with {', '.join(TESTED)}); {ENV_UNTESTED}=1 records anyway if every hook "
                           "point matches")
        if not version.startswith(tuple(r for t in TABLES for r in t.releases)):
            log.warning("dcptool: vLLM %s is newer than the releases this plugin knows; recording with the hook "
                        "table of %s, if every hook point matches", version, STATE.tables[0].line)
        STATE.modules = frozenset(hooked_modules())
        STATE.active = True
        sys.meta_path.insert(0, Finder())
        for name in sorted(STATE.modules):
            if name in sys.modules:
                patch(name, sys.modules[name])
    except Exception as e:
        broken(e)


class step:
    """Group builds into one engine step, as GPUModelRunner.execute_model does (for drivers and tests);
    `dummy=True` as execute_model(dummy_run=True) does: its builds are recorded at site `dummy`; `runner`:
    the GPUModelRunner, read as the execute_model hook reads it (the interleave)."""

    def __init__(self, dummy: bool = False, runner=None):
        self._frame = {"scope": True, "site": "dummy"} if dummy else {"scope": True}
        self._runner = runner

    def _make(self) -> dict:
        if self._runner is not None:
            learn(self._runner)
        return dict(self._frame)

    def __enter__(self):
        self._f = Frame(self._make)
        return self._f.__enter__()

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

