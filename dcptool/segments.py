"""Ragged segments: the layout every columnar rule uses (observation i's rows are [start_i, start_i + count_i))."""

from __future__ import annotations

import numpy as np


def ragged(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Segments (start, count) -> (segment of each element, index within it, absolute index)."""
    counts = np.asarray(counts, np.int64)
    seg = np.repeat(np.arange(counts.size), counts)
    j = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return seg, j, np.asarray(starts, np.int64)[seg] + j
