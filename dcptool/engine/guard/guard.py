"""The Guard: each observation checked as it is made, the last `keep` kept, a v1 dump written on the first wrong one."""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections import deque
from pathlib import Path

from dcptool.dcp.backend import interpreted
from dcptool.dump import Record
from dcptool.dump.observation import GROUPS, NAMES, ROW_TABLE, keyword_door
from dcptool.dump.schema import KVGroup
from dcptool.engine.arguments import buffer_id, host_copy, host_slots, scalars, tensor_type
from dcptool.engine.guard.host_checks import NOT_KEPT, Spec, first_wrong
from dcptool.engine.recorder.record import Recorder
from dcptool.errors import DcptoolError

ON_WRONG = ("dump", "raise", "count")
# the row fields the host path copies as they are (the slot mapping keeps its groups)
_ARRAYS = tuple(f.name for f in ROW_TABLE if f.argument and f.shape != GROUPS and f.name not in NOT_KEPT)
_LEFT_OUT = {f: None for f in NOT_KEPT}
_NOT_KEPT_AT = tuple(NAMES.index(f) for f in NOT_KEPT)


def _free(dir: Path, stem: str) -> Path:
    """dir/stem.safetensors, or stem.<k>.safetensors where that exists (an earlier dump is never replaced: the
    same process id and step again, or a second Guard in one process)."""
    path, k = dir / f"{stem}.safetensors", 0
    while path.exists():
        k += 1
        path = dir / f"{stem}.{k}.safetensors"
    return path


class GuardError(DcptoolError, RuntimeError):
    """on_wrong="raise": a wrong observation was seen (raised at the next observe() or at close())."""


class Guard:
    """Check each observation as it is made and keep the last `keep` (the flight recorder); on the first wrong one
    write them, the wrong one last, as a standard v1 dump in `dir` (once) and warn in one line naming the file.

    A clean run writes nothing. `on_wrong`: "dump" (default), "raise" (GuardError at the next observe() after the
    wrong one was seen, and at close()), "count" (only `wrong` counts). `observe()` takes exactly
    Recorder.observe's keywords and returns the observation's index in the Guard's stream (-1: dropped, as the
    Recorder drops); the other keywords (`pcp_size`, `page_size`, `kv_groups`, `sites`, `engine`...) are the
    Recorder's and go into the dump.

    CPU tensors and numpy arrays are copied and checked with the numpy reference (host_checks). CUDA tensors (and
    CPU tensors with `kernel=True`, under the Triton interpreter) take one launch of the check kernel
    (device_checks): the device ring keeps the last `keep`, a wrong one sets a flag in pinned host memory and
    freezes the ring; observe() reads the flag without a sync and, once set, waits for the stream and writes the
    dump. The host values checked against the device's seq_lens and query_start_loc (the host copy of seq_lens,
    FlashInfer's plans) reach the kernel through host memory it reads, no wait (`host_undecided` counts the builds
    that found no room). The index observe() returns counts the host's calls (a captured launch replayed by a graph
    has its own index on the device, not one the host saw). Slots: max_rows / max_tokens, or sized from the first
    observation (device_checks.GuardDevice says what a larger one does).
    """

    def __init__(self, dir: str | os.PathLike, dcp_size: int, cp_interleave: int = 1, keep: int = 64,
                 on_wrong: str = "dump", *, max_rows: int | None = None, max_tokens: int | None = None,
                 kernel: bool | None = None, **recorder_kw):
        if on_wrong not in ON_WRONG:
            raise ValueError(f"on_wrong must be one of {ON_WRONG}, got {on_wrong!r}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.dir = Path(dir)
        self.keep = keep
        self.on_wrong = on_wrong
        self._kw = dict(recorder_kw, dcp_size=dcp_size, cp_interleave=cp_interleave)
        self._spec = Spec(dcp_size, cp_interleave, recorder_kw.get("page_size"), None)
        self._dev = None  # device_checks.GuardDevice, made at the first device observation
        self._ngroups = None
        if recorder_kw.get("kv_groups") is not None:
            self.set_kv_groups(recorder_kw["kv_groups"])
        self._ring: deque = deque(maxlen=keep)  # (index, the Record with host copies)
        self._lock = threading.Lock()
        self.count = 0  # observations seen
        self.wrong = 0  # wrong observations seen
        self.dropped = 0  # observations that could not be checked (a value a dump cannot hold)
        self.skipped_capture = 0  # captured before the ring existed (device_checks.GuardDevice)
        self.first_rule: str | None = None  # what the first wrong observation broke: a check of host_checks.CHECKS
        self.first_index = -1  # its index in the Guard's stream
        self.dumped: Path | None = None  # the dump written, once
        self.dump_dropped = 0
        self._raised = False
        self._read = False  # the device ring was read (after the flag)
        self.closed = False
        self._sizes = (max_rows, max_tokens)
        # None: CUDA tensors take the kernel; True: CPU tensors too, which only Triton's interpreter can run the kernel
        # on (compiled, it would read host memory at device addresses): on a GPU machine without it they take the
        # host path
        self._kernel = None if kernel and _compiled_on_a_gpu() else kernel
        self._tensor = tensor_type()

    @property
    def host_undecided(self) -> int:
        """Device builds whose host copy of seq_lens and FlashInfer plans the kernel could not be handed (the
        host-values ring full: never waited for): their host-copy against the device's seq_lens and their plan-pages
        were not decided (device_checks.HostValues)."""
        return 0 if self._dev is None else self._dev.host_values.full

    def set_kv_groups(self, kv_groups) -> None:
        """Name the KV-cache groups (and whether DCP shards each), as Recorder.set_kv_groups: for the slot checks
        and the dump's config."""
        groups = tuple(KVGroup.of(g) for g in kv_groups)
        self._kw["kv_groups"] = groups
        self._ngroups = len(groups)
        self._set_spec(self._spec._replace(sharded=tuple(g.dcp for g in groups)))

    def set_page_size(self, page_size: int) -> int:
        """Set the page size (the pages check and the dump's config) if none was given; returns the one in use."""
        if self._spec.page_size is None:
            self._kw["page_size"] = page_size
            self._set_spec(self._spec._replace(page_size=page_size))
        return self._spec.page_size

    def set_attn_tensors(self, names) -> tuple:
        """Name the metadata tensors rows.attn_addrs lists (the dump's config) if none were; returns the names in
        use."""
        if self._kw.get("attn_tensors") is None:
            self._kw["attn_tensors"] = tuple(names)
        return self._kw["attn_tensors"]

    def _set_spec(self, spec) -> None:
        self._spec = spec
        if self._dev is not None:  # (launches captured before keep what they were captured with)
            self._dev.spec = spec

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    observe = keyword_door("observe", "record", """Check one attention-metadata build and keep it; its index in this
        Guard's stream, -1 if dropped (Recorder.observe's keywords).""")

    def record(self, r: Record) -> int:
        """observe() for a caller that builds the observation's Record itself (the vLLM plugin)."""
        for k in _NOT_KEPT_AT:
            if r[k] is not None:
                r = r._replace(**_LEFT_OUT)
                break
        dev = self._dev
        if self.first_rule is not None or (dev is not None and dev.flag_np[0]):
            self._poll()
        seq = r.seq_lens
        if type(seq) is self._tensor and (seq.is_cuda if self._kernel is None else self._kernel):
            return self._observe_device(r)
        try:
            kept, rule = self._check_host(r)
        except Exception:  # never break the engine
            with self._lock:
                self.dropped += 1
            return -1
        with self._lock:
            i = self.count
            self.count += 1
            self._ring.append((i, kept))
            if rule is not None:
                self.wrong += 1
                if self.first_rule is None:
                    self.first_rule, self.first_index = rule, i
                    if self.on_wrong == "dump":
                        self._dump()
        return i

    def _check_host(self, r: Record) -> tuple[Record, str | None]:
        """The record with private host copies (the engine reuses its buffers), and the first rule it breaks."""
        buffer = r.buffer
        if buffer is None and hasattr(r.dcp_local_seq_lens, "untyped_storage"):
            buffer = buffer_id(r.dcp_local_seq_lens)  # the engine's buffer, not the copy's
        copies = {f: host_copy(getattr(r, f)) for f in _ARRAYS}
        sm = r.slot_mapping
        if sm is not None:
            sm = ({g: host_copy(m) for g, m in sm.items()} if isinstance(sm, dict)
                  else host_copy(sm).reshape(-1, copies["positions"].size))
        kept = r._replace(buffer=buffer, slot_mapping=sm, **copies)
        slots = ((None,) * 3 if r.positions is None and r.slot_mapping is None
                 else host_slots(kept.positions, sm, self._ngroups))
        rule = first_wrong(self._spec, kept._replace(rank=int(r.rank), num_reqs=int(r.num_reqs),
                                                     num_reqs_padded=int(r.num_reqs_padded)), slots)
        return kept, rule

    def _observe_device(self, r: Record) -> int:
        """One launch of the check kernel; nothing read back."""
        dcp = r.dcp_local_seq_lens
        try:
            if r.buffer is None and dcp is not None:
                r = r._replace(buffer=buffer_id(dcp))
            vals = scalars(r)
            with self._lock:
                if self._dev is None:
                    import torch

                    from dcptool.engine.guard.device_checks import GuardDevice

                    self._dev = GuardDevice(torch, r.seq_lens.device, self.keep, self._spec, *self._sizes)
                i = -1
                if self._dev.launch(vals, r):
                    i = self.count
                    self.count += 1
        except Exception:  # never break the engine
            with self._lock:
                self.dropped += 1
            return -1
        if i < 0:
            with self._lock:
                self.skipped_capture += 1
            return -1
        if dcp is None and self._spec.dcp_size > 1 and self.first_rule is None:
            self.first_rule = "missing"  # the host knows it now; the dump waits for the kernel's ring (_poll)
        return i

    def _poll(self) -> None:
        """Read the device flag (no sync); on the first wrong observation dump the ring (on_wrong="dump");
        on_wrong="raise": raise once the flag is seen."""
        dev = self._dev
        if dev is not None and not self._read and (dev.wrong_seen() or self.first_rule is not None):
            self._from_device()
        if self.on_wrong == "raise" and self.first_rule is not None and not self._raised:
            self._raised = True
            raise GuardError(f"dcptool Guard: a wrong observation ({self.first_rule})")

    def _from_device(self) -> None:
        """The flag is set: wait for the stream, read the frozen ring (the wrong observation last), dump it."""
        with self._lock:
            self._read = True  # (once: the one wait for the stream)
            kept, _, self.wrong = self._dev.kept()
            if not kept or not kept[-1][1]:  # (nothing wrong in the ring)
                return
            from dcptool.engine.guard.device_checks import rule_of

            self.first_index, bits = kept[-1][0], kept[-1][1]
            self.first_rule = rule_of(bits)
            if self.on_wrong == "dump":
                self._dump([(i, r) for i, _, r in kept if r is not None], kept[-1][2] is None)

    def _dump(self, kept: list | None = None, lost: bool = False) -> None:
        """Write the ring (the wrong observation last) as a v1 dump through a Recorder; parents outside it dropped.
        `lost`: the wrong one was larger than its slot (the ring could not grow): the dump ends before it."""
        kept = list(self._ring) if kept is None else kept
        if not kept:
            warnings.warn(f"dcptool Guard: wrong DCP metadata ({self.first_rule}), larger than the ring's slots: "
                          "nothing kept to write", RuntimeWarning, stacklevel=3)
            return
        step, rank = kept[-1][1].step, kept[-1][1].rank
        at = {i: j for j, (i, _) in enumerate(kept)}
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            path = _free(self.dir, f"guard.{os.getpid()}.rank{rank}.step{step}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (a held path: the Recorder picks another name and says so)
                rec = Recorder(path, **self._kw)
                for _, r in kept:
                    p = r.parent
                    rec.record(r._replace(parent=None if p is None or p < 0 else at.get(p)))
                files = rec.close()
        except Exception as e:  # never break the engine (a full disk, a directory it may not write)
            warnings.warn(f"dcptool Guard: wrong DCP metadata ({self.first_rule}) at step {step}, and its dump "
                          f"could not be written: {e}", RuntimeWarning, stacklevel=3)
            return
        self.dump_dropped = rec.dropped  # (observations the dump could not hold: none expected)
        self.dumped = files[0] if files else rec.path
        where = f"after step {step} (the wrong one was larger than the ring's slots)" if lost else f"at step {step}"
        warnings.warn(f"dcptool Guard: wrong DCP metadata ({self.first_rule}) {where}: the last {len(kept)} "
                      f"observations are in {self.dumped}", RuntimeWarning, stacklevel=3)

    def close(self) -> Path | None:
        """Stop; returns the dump written (None: a clean run). on_wrong="raise": raises if it has not yet."""
        if self._dev is not None and not self.closed:
            self.count, self.wrong = self._dev.counts()  # (waits for the stream)
            if not self._read and (self._dev.wrong_seen() or self.first_rule is not None):
                self._from_device()
        self.closed = True
        self._ring.clear()
        self._poll()
        return self.dumped


def _compiled_on_a_gpu() -> bool:
    """Triton compiles the check kernel for a GPU here (torch sees one and the interpreter is off)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_available() and not interpreted()
