"""The enumerated options of the command line, one Enum each: what --help lists, what the CLI and the
library accept, and how a refusal names them (stdlib only: `dcptool --help` imports it)."""

from __future__ import annotations

from enum import Enum


class Backend(str, Enum):
    AUTO = "auto"  # Triton on a GPU, torch on CPU
    TRITON = "triton"  # the Triton interpreter without a GPU
    TORCH = "torch"


class CudaGraph(str, Enum):
    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"  # FULL_AND_PIECEWISE


class Pipeline(str, Enum):
    FIXED = "fixed"  # vLLM after the fix
    LEGACY = "legacy"  # every pre-fix fault


class SpecMethod(str, Enum):
    MTP = "mtp"
    DFLASH = "dflash"


class KVConnector(str, Enum):
    NONE = "none"  # one instance: no transfers
    NIXL = "nixl"  # pulls from a prefill instance
    MOONCAKE = "mooncake"
    LMCACHE = "lmcache"  # stores into a keyed store


class KVShards(str, Enum):
    DCP = "dcp"  # KV sharded over the DCP ranks, every PCP rank a replica (model runner V2)
    CP = "cp"  # over the CP world pcp x dcp (V1's BlockTable, vllm-ascend)


def values(e: type[Enum]) -> tuple[str, ...]:
    return tuple(m.value for m in e)


def metavar(e: type[Enum]) -> str:
    """`[a|b|c]`, as --help shows the choices."""
    return "[" + "|".join(values(e)) + "]"


def spoken(e: type[Enum]) -> str:
    """`a, b or c`, as a refusal names the choices."""
    v = values(e)
    return v[0] if len(v) == 1 else ", ".join(v[:-1]) + " or " + v[-1]
