"""Memory for the harvest's copies: chunks whose pages a daemon thread touched ahead of use, recycled once written."""

from __future__ import annotations

import sys
import threading
from collections import deque

import numpy as np

ARENA_WORDS = 1 << 20  # int32 words a chunk (4 MiB): the harvest's copies are cut from chunks
SPARE = 2  # chunks kept ready
_PAGE_WORDS = 1024  # int32 words of a 4 KiB page: one write per page touches it


class Chunks:
    """int32 chunks of ARENA_WORDS words, their pages already touched: taking one costs no page fault.

    A harvest copies finished ring slots into fresh memory inside the engine's observe(); the first write to each
    fresh page faults (docs/performance.md: a 128 KB harvest ~40 times longer than into touched pages), which held
    the engine thread long enough to idle the GPU. A daemon thread touches the pages of SPARE chunks ahead of use (its
    faults happen while numpy has released the GIL), and chunks whose copies were all written come back (give())
    and are used again, so a recording that rolls over faults no new page once it runs."""

    def __init__(self, spare: int = SPARE):
        self.spare = spare
        self._ready: deque[np.ndarray] = deque()  # (append / popleft are atomic: no lock on the engine's side)
        self._thread: threading.Thread | None = None
        self.fresh = 0  # chunks take() had to allocate itself (none was ready): their faults were the caller's
        self.recycled = 0

    def take(self) -> np.ndarray:
        """A chunk ready for use (allocated here, untouched, when none is: counted in `fresh`)."""
        try:
            a = self._ready.popleft()
        except IndexError:
            a = np.empty(ARENA_WORDS, np.int32)
            self.fresh += 1
        if len(self._ready) < self.spare and (self._thread is None or not self._thread.is_alive()):
            # (the thread ends once the spares are ready: no idle dcptool- thread is left behind)
            self._thread = threading.Thread(target=self._run, name="dcptool-arena", daemon=True)
            self._thread.start()
        return a

    def give(self, a: np.ndarray) -> None:
        """A chunk no copy lives in any more (the caller checked): kept for reuse, up to twice `spare`."""
        if a.size == ARENA_WORDS and len(self._ready) < 2 * self.spare:
            self._ready.append(a)
            self.recycled += 1

    def _run(self) -> None:
        while len(self._ready) < self.spare:
            a = np.empty(ARENA_WORDS, np.int32)
            a[::_PAGE_WORDS] = 0
            self._ready.append(a)


CHUNKS = Chunks()  # one pool a process: every Recorder's harvests


def unused(chunks: list[np.ndarray], held: int = 0) -> list[np.ndarray]:
    """The chunks no array refers to any more but the caller's list and `held` other references each (a view of a
    chunk holds a reference to it: one left in a dump's columns, or in a row not written yet, keeps it)."""
    # getrefcount: the list's reference, the argument's own, the loop variable's
    return [c for c in chunks if sys.getrefcount(c) <= 3 + held]
