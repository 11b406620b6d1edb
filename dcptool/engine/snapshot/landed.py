"""Harvested ring slots: private copies of the ring's finished runs, checked, kept until their observations are
written."""

from __future__ import annotations

import bisect

import numpy as np

from dcptool.engine.snapshot.arena import ARENA_WORDS, CHUNKS, unused
from dcptool.engine.snapshot.layout import slot_rows
from dcptool.engine.snapshot.ring import Slot, SnapshotRing

FEW = 8  # a harvest of up to FEW slots checks them in plain Python (Landed._take_few)


class Landed:
    """Harvested slots: one private copy of each contiguous run of the ring, kept until every observation whose
    rows lie in it is written (the rows are cut out of the copy at the write)."""

    def __init__(self):
        self.runs: list[tuple[int, np.ndarray, int]] = []  # (first index, copy, its ring word)
        self._arena: np.ndarray | None = None  # where _keep cuts the copies from
        self._arena_at = 0

    def take(self, ring: SnapshotRing, take: list[Slot]) -> list[tuple[Slot, int]]:
        """Copy finished slots out of the ring, their headers checked at once (done == seqno, flags); returns
        the slots that do not hold their observation, each with its flags."""
        bad_slots: list[tuple[Slot, int]] = []
        if not take:
            return bad_slots
        if len(take) <= FEW:
            return self._take_few(ring, take)
        cols = tuple(zip(*take))  # (one pass over the slots, in C)
        index, starts, words = np.array(cols[0], np.int64), np.array(cols[1], np.int64), np.array(cols[2], np.int64)
        ends = starts + words
        cut = (np.flatnonzero(starts[1:] != ends[:-1]) + 1).tolist()  # (where the ring wrapped)
        for i, j in zip([0, *cut], [*cut, len(take)]):
            lo = int(starts[i])
            blk = self._keep(ring.np[lo:int(ends[j - 1])])
            self.runs.append((take[i][0], blk, lo))
            offs = starts[i:j] - lo
            seqno = index[i:j] & 0x7FFFFFFF
            flags = blk[offs + 5]
            bad = (blk[offs + 1] != seqno) | (flags != 0)
            if bad.any():
                bad_slots += [(take[i + k], int(flags[k])) for k in np.flatnonzero(bad).tolist()]
        return bad_slots

    def _take_few(self, ring: SnapshotRing, take: list[Slot]) -> list[tuple[Slot, int]]:
        """take() for a few slots (a harvest every slot or two, as large slots are fenced): the same copies and
        checks without take()'s dozen numpy calls, which cost more than the checks of a few slots."""
        bad_slots = []
        n = len(take)
        i = 0
        while i < n:
            j = i + 1
            while j < n and take[j][1] == take[j - 1][1] + take[j - 1][2]:  # (contiguous: one copy)
                j += 1
            lo = take[i][1]
            blk = self._keep(ring.np[lo:take[j - 1][1] + take[j - 1][2]])
            self.runs.append((take[i][0], blk, lo))
            for s in take[i:j]:
                o = s[1] - lo
                f = int(blk[o + 5])
                if f or int(blk[o + 1]) != s[0] & 0x7FFFFFFF:
                    bad_slots.append((s, f))
            i = j
        return bad_slots

    def _keep(self, src: np.ndarray) -> np.ndarray:
        """A private copy of src, cut from a chunk of ARENA_WORDS words (arena.CHUNKS: its pages touched ahead of
        use, so the copy costs no page fault on the engine's thread; one allocation per ~1,000 observations instead
        of one per harvest); a chunk is given back once no harvested run still to write lies in it (written())."""
        a, pos, n = self._arena, self._arena_at, src.size
        if a is None or pos + n > a.size:
            a = self._arena = CHUNKS.take() if n <= ARENA_WORDS else np.empty(n, np.int32)
            pos = 0
        out = a[pos:pos + n]
        np.copyto(out, src)
        self._arena_at = pos + n
        return out

    def rows(self, rows: list, in_flight: int | None) -> list:
        """rows with each Slot replaced by its rows (slot_rows) from the copies; in_flight: the index of the
        oldest slot not harvested yet (None: none), which no slot to write may reach."""
        firsts = [x[0] for x in self.runs]
        rows = list(rows)
        for i, r in enumerate(rows):
            if type(r) is Slot:
                first, blk, lo = self.runs[bisect.bisect_right(firsts, r[0]) - 1]
                if first > r[0] or (in_flight is not None and in_flight <= r[0]):
                    raise RuntimeError(f"dcptool Recorder: observation {r[0]} is written before it landed")
                rows[i] = slot_rows(blk, r[1] - lo, r[3])
        return rows

    def written(self, file_start: int) -> None:
        """Observations before file_start are written: drop the copies none still to write points into, and give
        their chunks back where nothing refers to them any more."""
        if self.runs:
            firsts = [x[0] for x in self.runs]
            k = max(0, bisect.bisect_right(firsts, file_start) - 1)
            gone = {id(r[1].base): r[1].base for r in self.runs[:k] if r[1].base is not None}
            del self.runs[:k]
            for r in self.runs:
                gone.pop(id(r[1].base), None)
            gone.pop(id(self._arena), None)
            chunks = list(gone.values())
            gone.clear()
            for c in unused(chunks):
                CHUNKS.give(c)
