"""A snapshot slot's layout: the header the host and the kernels agree on (its one home: kernels.py and
kernels_tl.py import it), one section per row field of the observation, and how a harvested slot gives its rows.

Ring slots (int32 words; a slot starts at a multiple of 8 words, 32 bytes; the CPU writes the header before the
launch (observe()'s fast path: its kernel writes it), the kernel writes `flags` and `done`; a slot describes
itself, so a later fused check kernel can read, or extend, it):

    word 0      seqno        the observation's index & 0x7fffffff (CPU)
    word 1      done         -1 (CPU); the kernel writes seqno here last (checked at harvest)
    word 2      num_reqs
    word 3      num_reqs_padded
    word 4      nsec         K, the number of section entries (= len(SECTIONS))
    word 5      flags        0 (CPU); kernel: bit 0 a value int32 cannot hold, bit 1 a negative value in
                             a section that forbids them (seq_lens, dcp_tot_seq_lens, positions)
    word 6      words        the slot's size in words (header and rows, rounded up to 8)
    word 7      0            (reserved)
    words 8+4k .. 11+4k      section k, in SECTIONS order: source address (int64, words 8+4k and 9+4k), count
                             (word 10+4k; -1: absent, or held on the host), mode (word 11+4k; bit 0 int64 source,
                             bit 1 negatives flagged)
    then the rows of the sections with count >= 0, back to back, from word 8+4K.

A section is a row field of dump.observation.FIELDS_TABLE (its name, shape rule, non-negative or not, the config
setting it needs): the descriptor kernel loops over the header's entries and needs no edit for a new one.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from dcptool.dump.observation import HOST_ROWS, ROW_TABLE, ROWS, ROWS_PLUS_1, Field
from dcptool.engine.arguments import Groups

FIXED = 8  # the fixed header words of a slot
ENTRY = 4  # header words per section (address: 2, count, mode)
HEAD_READ = 64  # words the descriptor kernel reads at a slot's start in one go (the ring is padded by it)
MAX_SECTIONS = (HEAD_READ - FIXED) // ENTRY  # the sections one read of the header covers
ABSENT = (0, -1, 0)  # a header entry of an absent section (or one the host holds): address, count, mode

# the slot's sections: the table's row fields up to the last device one (past the slot entries' KV-cache groups: the
# chunked context, the groups' lengths ...), in its order; the ones after it are host values (the metadata tensors'
# addresses, ...), kept beside the slot (its host-held rows) and never in its header, so that an observation without
# them costs what it did before they existed
SECTIONS: tuple[Field, ...] = ROW_TABLE[:len(ROW_TABLE) - len(HOST_ROWS)]
_NO_HOST_ROWS = (None,) * len(HOST_ROWS)
# observe()'s fast path (kernels.snapshot_args_dispatch): sections 0-7 as kernel arguments; their negative-value
# flags at bits 8 + k of its `modes` argument (bit k: int64, set per observation)
ARGS_SECTIONS = 8
ARGS_NEG = sum(1 << (8 + k) for k, s in enumerate(SECTIONS[:ARGS_SECTIONS]) if s.nonneg)
# the slot entries' sections: positions, the slot mapping rows, their KV-cache groups (always the host's)
POS, SLOT, SGRP = (next(k for k, s in enumerate(SECTIONS) if s.section == name) for name in ("pos", "slot", "sgrp"))
if (len(SECTIONS) > MAX_SECTIONS or not all(s.device for s in SECTIONS[:ARGS_SECTIONS]) or SECTIONS[SGRP].device
        or any(f.device for f in HOST_ROWS)):
    raise ImportError(f"snapshot layout: {len(SECTIONS)} sections (at most {MAX_SECTIONS}), the fast path's "
                      f"{ARGS_SECTIONS} first ones device sections, the KV-cache groups and the row fields after "
                      "them the host's")


def head_struct(k: int) -> struct.Struct:
    """A slot header with k section entries (the fixed words, then address, count, mode per section)."""
    return struct.Struct("<8i" + "qii" * k)


class Layout(NamedTuple):
    """What the device path derives from its sections once (not per observation)."""

    nsec: int  # K
    head: struct.Struct  # the header
    head_words: int  # the header's words, + 7 (rounded down to 8 words once the rows are added)
    modes: tuple[int, ...]  # each section's header mode (bit 1: negatives flagged)
    rules: tuple[tuple[int, Field], ...]  # (k, section) for the sections with a length rule, a setting or nonneg
    plus1: tuple[int, ...]  # the sections of ROWS_PLUS_1 length
    sized: tuple[int, ...]  # ... and of ROWS length
    needs: tuple[tuple[int, str], ...]  # (k, setting) for the sections that need a config setting
    fast_pad: tuple  # the fast path's host-held sections past query_start_loc (None)
    ksec: int  # the fast path kernel's `modes` argument without the int64 bits


def layout(sections: tuple[Field, ...]) -> Layout:
    k = len(sections)
    rules = tuple((j, x) for j, x in enumerate(sections) if x.shape in (ROWS, ROWS_PLUS_1) or x.needs or x.nonneg)
    return Layout(k, head_struct(k), FIXED + ENTRY * k + 7, tuple(2 if x.nonneg else 0 for x in sections), rules,
                  tuple(j for j, x in enumerate(sections) if x.shape == ROWS_PLUS_1),
                  tuple(j for j, x in enumerate(sections) if x.shape == ROWS),
                  tuple((j, x.needs) for j, x in enumerate(sections) if x.needs), (None,) * (k - 3), k << 16 | ARGS_NEG)


def host_rules(rules: tuple, config, ent: list, host: list, rows: int, words: int) -> int:
    """The sections' length rules when the host holds some sections (`rules`: Layout.rules; `ent`: the header's
    entries, 3 per section, `host`: the host-held arrays, both updated); returns the slot's words."""
    for k, sec in rules:
        n = ent[3 * k + 1]
        h = host[k]
        size = n if n >= 0 else -1 if h is None else h.size
        if size < 0:
            continue
        if sec.needs and getattr(config, sec.needs) is None:
            raise ValueError(f"{sec.name} needs {sec.needs} in the config")
        if sec.shape == ROWS_PLUS_1 and size != rows + 1:  # of no use to replay (as on the host path)
            ent[3 * k + 1] = -1
            if n >= 0:
                words -= n
            else:
                host[k] = None
        elif sec.shape == ROWS and size != rows:
            raise ValueError(f"{sec.name} needs one value per seq_lens row ({rows}), got {size}")
        elif sec.nonneg and h is not None and h.size and h.min() < 0:
            raise ValueError(f"negative {sec.name}")
    return words


def slot_rows(blk: np.ndarray, o: int, host: list | None) -> tuple:
    """A harvested slot's rows, from word o of blk (a private copy of the ring): one entry per section in SECTIONS
    order, a view of the copy, a host array, or None; then the HOST_ROWS the host holds past the sections (None
    each where it holds none)."""
    k = int(blk[o + 4])
    counts = blk[o + FIXED:o + FIXED + ENTRY * k].reshape(k, ENTRY)[:, 2].tolist()
    p = o + FIXED + ENTRY * k
    out = []
    for j, n in enumerate(counts):
        if n >= 0:
            out.append(blk[p:p + n])
            p += n
        else:
            out.append(None if host is None else host[j])
    g = out[SGRP] if k > SGRP else None
    if type(g) is Groups:  # slot sections snapshotted raw: dump.slot_entries' entries, one per token and group
        pos = out[POS]
        out[POS] = np.tile(pos, len(g))
        out[SGRP] = np.repeat(np.array(g, np.int32), pos.size)
    if host is not None and len(host) > k:
        return (*out, *host[k:])
    return (*out, *_NO_HOST_ROWS)
