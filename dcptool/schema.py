"""DESIGN §2 as code. For now: the one encoding of `obs.graph` and the root of dcptool's exceptions (the
column table, DumpConfig and the checks of a hostile file are still in dump.py)."""

from __future__ import annotations

from enum import IntEnum


class DcptoolError(Exception):
    """Bad input or usage that dcptool explains in one line (the CLI prints it and exits 2): DumpError and
    its family, LimitError, SimError, BackendError and the CLI's own Trouble all derive from it."""


class GraphMode(IntEnum):
    """obs.graph: how the observed forward ran (DESIGN §2)."""

    EAGER = 0
    PIECEWISE = 1
    FULL_CAPTURE = 2  # a full CUDA graph being captured: the buffer address it bakes in
    FULL_REPLAY = 3  # a full CUDA graph replayed: must read the buffer its capture baked in

    @property
    def full(self) -> bool:
        return self >= GraphMode.FULL_CAPTURE

    def recorded(self, capturing: bool) -> GraphMode:
        """A dispatched mode as obs.graph records it: a full graph is a capture while capturing, else a replay."""
        if self.full:
            return GraphMode.FULL_CAPTURE if capturing else GraphMode.FULL_REPLAY
        return self

    @classmethod
    def parse(cls, name: str) -> GraphMode:
        """Recorder.observe(graph=...) names; KeyError for any other (the observation is dropped)."""
        return _NAMES[name]

    @classmethod
    def of_vllm(cls, name: str | None) -> GraphMode:
        """vLLM's runtime CUDAGraphMode name as obs.graph (a capture is marked by the caller); others eager."""
        return _VLLM.get(name, GraphMode.EAGER)


_NAMES = {"eager": GraphMode.EAGER, "piecewise": GraphMode.PIECEWISE, "capture": GraphMode.FULL_CAPTURE,
          "full-capture": GraphMode.FULL_CAPTURE, "replay": GraphMode.FULL_REPLAY, "full-replay": GraphMode.FULL_REPLAY}
_VLLM = {"NONE": GraphMode.EAGER, "PIECEWISE": GraphMode.PIECEWISE, "FULL": GraphMode.FULL_REPLAY}
