"""A Recorder's settings from its keywords: what it records (dump.DumpConfig) and how (Options)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dcptool.dump import DumpConfig
from dcptool.dump.schema import KVGroup
from dcptool.engine.snapshot.ring import DEFAULT_RING_BYTES


@dataclass(frozen=True)
class Options:
    """How a Recorder records (Recorder's keywords of the same names)."""

    rollover: int | None = None  # observations per numbered file (None: one file, written at close())
    force: bool = False  # replace an earlier recording at the path
    cuda_mode: str = "async"  # "async": CUDA tensors through the snapshot ring; "sync": .to("cpu")
    ring_bytes: int = DEFAULT_RING_BYTES  # the snapshot ring's size
    ring_full: str = "wait"  # what a full ring does: "wait" for the oldest launches, or "drop" the observation
    max_bytes: int | None = None  # the recording's size cap (None: none)

    def check(self) -> None:
        """ValueError for a setting a Recorder cannot run with."""
        if self.rollover is not None and self.rollover < 1:
            raise ValueError(f"rollover must be >= 1, got {self.rollover}")
        if self.cuda_mode not in ("async", "sync"):
            raise ValueError(f"cuda_mode must be 'async' or 'sync', got {self.cuda_mode!r}")
        if self.max_bytes is not None and (type(self.max_bytes) is not int or self.max_bytes < 1):
            raise ValueError(f"max_bytes must be an integer >= 1, got {self.max_bytes!r}")
        if self.ring_full not in ("wait", "drop"):
            raise ValueError(f"ring_full must be 'wait' or 'drop', got {self.ring_full!r}")


_CONFIG = tuple(f.name for f in dataclasses.fields(DumpConfig))
_OPTIONS = tuple(f.name for f in dataclasses.fields(Options))


def settings(dcp_size: int | None, cp_interleave: int, config: DumpConfig | None, options: Options | None,
             kw: dict) -> tuple[DumpConfig, Options]:
    """Recorder(path, dcp_size, cp_interleave, *, config=, options=, **kw): the keywords are DumpConfig's fields
    (sites, pcp_size, page_size, engine, engine_version, note, kv_groups) and Options' (rollover, force, cuda_mode,
    ring_bytes, ring_full, max_bytes), each over the `config` / `options` given. TypeError for any other keyword,
    as for a function that does not take it; ValueError for a setting it cannot run with."""
    unknown = [k for k in kw if k not in _CONFIG and k not in _OPTIONS]
    if unknown:
        raise TypeError(f"Recorder() got an unexpected keyword argument {unknown[0]!r}")
    cfg = {k: v for k, v in kw.items() if k in _CONFIG}
    if "sites" in cfg:
        cfg["sites"] = tuple(cfg["sites"])
    if cfg.get("kv_groups") is not None:
        cfg["kv_groups"] = tuple(KVGroup.of(g) for g in cfg["kv_groups"])
    if cfg.get("attn_tensors") is not None:
        cfg["attn_tensors"] = tuple(cfg["attn_tensors"])
    if config is None:
        if dcp_size is None:
            raise TypeError("Recorder() missing required argument: 'dcp_size' (or config=)")
        config = DumpConfig(dcp_size=dcp_size, cp_interleave=cp_interleave, **cfg)
    else:
        if dcp_size is not None or cp_interleave != 1:
            raise TypeError("Recorder(): dcp_size and cp_interleave go in config= when one is given")
        config = dataclasses.replace(config, **cfg)
    opts = {k: v for k, v in kw.items() if k in _OPTIONS}
    options = Options(**opts) if options is None else dataclasses.replace(options, **opts)
    options.check()
    return config, options
