"""Observation references: `FILE:I`, observation I of FILE (its index in that file, docs/format.md "Order and several
files"), FILE as the reader was given it. The one form every report prints and `replay --obs` reads back."""

from __future__ import annotations

import os
from collections.abc import Sequence


def obs_ref(file: str, obs: int) -> str:
    """The reference of observation `obs` (its index in `file`)."""
    return f"{file}:{obs}"


def obs_refs(files: Sequence[str], file_index: list[int], obs: list[int]) -> list[str]:
    """obs_ref of many observations (`file_index` into `files`, `obs` in its file), formatted by map's C loop."""
    return list(map("%s:%d".__mod__, zip(map(files.__getitem__, file_index), obs)))


def parse_ref(spec: str) -> tuple[str | None, int]:
    """`FILE:I` -> (FILE, I); `I` alone -> (None, I). ValueError when I is not a non-negative integer. FILE may hold
    colons itself: the index is what follows the last one."""
    file, _, num = spec.rpartition(":")
    num = num.strip()
    if not num.isascii() or not num.isdigit():
        raise ValueError(spec)
    return (file or None), int(num)


def match_file(files: list[str], file: str) -> int | None:
    """The position in `files` of the file `file` names: the same name, else the same file under another name
    (`./run.safetensors` for `run.safetensors`, a link to it); None when it names none of them."""
    if file in files:
        return files.index(file)
    for k, f in enumerate(files):
        try:
            if os.path.samefile(f, file):
                return k
        except OSError:
            continue
    return None
