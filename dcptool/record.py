"""The Recorder an engine calls: copy each observation to host memory at once, write dumps atomically."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np

from dcptool.dump import DumpConfig, Observation, pack, write_dump

GRAPH = {"eager": 0, "piecewise": 1, "capture": 2, "full-capture": 2, "replay": 3, "full-replay": 3}


def _host(x, dtype=np.int32) -> np.ndarray | None:
    """A private host copy of a tensor / array / list (never a view of engine memory)."""
    if x is None:
        return None
    if hasattr(x, "detach"):  # torch.Tensor, on any device: .cpu() syncs on that device's stream
        x = x.detach().to("cpu").numpy()
    return np.array(x, dtype=dtype, copy=True).reshape(-1)


def buffer_id(t) -> int:
    """Identity of the storage a tensor view aliases (0 when unknown): its storage's base address."""
    try:
        return int(t.untyped_storage().data_ptr())
    except Exception:
        return 0


class Recorder:
    """Record observations; `close()` (or leaving a `with` block) writes the dump atomically.

    `observe()` never raises into the engine: a value it cannot store is counted in `dropped` and
    warned about once. With `rollover=K`, every K observations go to a new numbered file
    (`run.00000.safetensors`, `run.00001.safetensors`, ...) so a long run never risks one huge file and
    everything up to the last rollover survives a killed process. Read the files together.
    """

    def __init__(self, path: str | os.PathLike, dcp_size: int, cp_interleave: int = 1, *,
                 sites: tuple[str, ...] = (), pcp_size: int = 1, page_size: int | None = None,
                 engine: str | None = None, engine_version: str | None = None, note: str | None = None,
                 rollover: int | None = None):
        self.path = Path(path)
        self.config = DumpConfig(dcp_size=dcp_size, cp_interleave=cp_interleave, sites=tuple(sites),
                                 pcp_size=pcp_size, page_size=page_size, engine=engine,
                                 engine_version=engine_version, note=note)
        if rollover is not None and rollover < 1:
            raise ValueError(f"rollover must be >= 1, got {rollover}")
        self.rollover = rollover
        self.injected: dict[str, list[int]] | None = None
        self.dropped = 0
        self.files: list[Path] = []
        self._obs: list[Observation] = []
        self._count = 0  # observations accepted over all files
        self._file_start = 0  # global index of the current file's first observation
        self._warned = False
        self._closed = False

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return self._count

    def observe(self, *, step: int, site: str, rank: int, seq_lens, num_reqs: int, num_reqs_padded: int,
                dcp_local_seq_lens=None, ubatch: int = -1, parent: int | None = None, req_start: int | None = None,
                tok_start: int | None = None, tok_stop: int | None = None, query_start_loc=None,
                num_tokens_padded: int | None = None, buffer: int | None = None, graph: int | str | None = None,
                kv_pages=None) -> int:
        """Record one attention-metadata build; returns its index (pass it as `parent=` later), -1 if dropped."""
        try:
            if self._closed:
                raise RuntimeError("observe() after close()")
            seq = _host(seq_lens)
            nr, nrp = int(num_reqs), int(num_reqs_padded)
            if not 0 <= nr <= nrp or seq.size < nr or (seq.size and seq.min() < 0):
                raise ValueError(f"num_reqs {nr}, num_reqs_padded {nrp}, {seq.size} seq_lens rows")
            if buffer is None and dcp_local_seq_lens is not None and hasattr(dcp_local_seq_lens, "untyped_storage"):
                buffer = buffer_id(dcp_local_seq_lens)
            if isinstance(graph, str):
                graph = GRAPH[graph]
            qsl = _host(query_start_loc)
            if qsl is not None and qsl.size != seq.size + 1:
                qsl = None  # a query_start_loc that does not cover the rows is of no use to replay
            p = None
            if parent is not None and parent >= 0:
                p = parent - self._file_start if parent >= self._file_start else -1  # -1: in an earlier file
            o = Observation(step=int(step), site=str(site), rank=int(rank), num_reqs=nr, num_reqs_padded=nrp,
                            seq_lens=seq, dcp_local_seq_lens=_host(dcp_local_seq_lens), ubatch=int(ubatch), parent=p,
                            req_start=req_start, tok_start=tok_start, tok_stop=tok_stop, query_start_loc=qsl,
                            num_tokens_padded=num_tokens_padded, buffer=buffer, graph=graph, kv_pages=_host(kv_pages))
        except Exception as e:  # never break the engine
            self.dropped += 1
            if not self._warned:
                self._warned = True
                warnings.warn(f"dcptool Recorder dropped an observation it cannot store ({e}); "
                              "counting further drops silently", RuntimeWarning, stacklevel=2)
            return -1
        self._obs.append(o)
        self._count += 1
        idx = self._count - 1
        if self.rollover is not None and len(self._obs) >= self.rollover:
            self._write_current()
        return idx

    def _target(self) -> Path:
        if self.rollover is None:
            return self.path
        return self.path.with_name(f"{self.path.stem}.{len(self.files):05d}{self.path.suffix or '.safetensors'}")

    def _write_current(self) -> None:
        target = self._target()
        cfg, cols = pack(self._obs, self.config)
        self.config = cfg  # keep site indices stable across rolled files
        injected = None
        if self.injected is not None:
            lo, hi = self._file_start, self._file_start + len(self._obs)
            injected = {k: [i - lo for i in v if lo <= i < hi] for k, v in self.injected.items()}
        write_dump(target, cfg, cols, injected)
        self.files.append(target)
        self._file_start += len(self._obs)
        self._obs = []

    def close(self) -> list[Path]:
        """Write what is left (atomically); returns the files written. Safe to call twice."""
        if not self._closed:
            self._closed = True
            if self._obs or not self.files:
                self._write_current()
        return self.files
