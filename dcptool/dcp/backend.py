"""Where Triton kernels run: the GPU, or Triton's interpreter on the CPU (switched on before triton is imported)."""

from __future__ import annotations

import functools
import importlib
import os
import sys
from types import ModuleType
from typing import TYPE_CHECKING

from dcptool.errors import DcptoolError

if TYPE_CHECKING:
    import torch


class BackendError(DcptoolError, RuntimeError):
    """The requested backend cannot run here (says why and what to use instead)."""


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def load(module: str) -> ModuleType:
    """Import a module of Triton kernels (switching on the interpreter first when there is no GPU)."""
    import torch  # (here, not above: cubin.py asks interpreted() in processes that never import torch)

    if not torch.cuda.is_available():
        if "triton" in sys.modules and not interpreted():
            raise BackendError("triton was imported without TRITON_INTERPRET=1 and there is no GPU; "
                               "set TRITON_INTERPRET=1 before starting, or use --backend torch")
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401 - the first import of triton, once the interpreter is decided
    except ImportError as e:  # pragma: no cover - triton is a Linux dependency
        raise BackendError(f"triton is not installed ({e}); use --backend torch") from None
    return importlib.import_module(module)


def device() -> torch.device:
    """Where the Triton kernels run: the GPU when there is one, else the CPU (interpreter)."""
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
