"""observe()'s host path: an observation's arguments as private host copies, checked, as the writer keeps them."""

from __future__ import annotations

from dcptool.dump import Record, Scalars
from dcptool.dump.observation import GROUPS, ROW_TABLE, TOKENS, R
from dcptool.engine.arguments import (
    NO_SLOTS,
    batch_rows,
    check_shared,
    copied_row,
    host_copy,
    host_fast,
    host_slots,
    nonneg,
    per_rank,
    scalars,
)
from dcptool.engine.snapshot.layout import HOST_ROWS

# The row fields the host copies as given, after seq_lens (the slot entries go through dump.slot_entries), with
# their positions in the Record.
_COPIED = tuple((R[f.name], f) for f in ROW_TABLE[1:] if f.argument and f.shape not in (TOKENS, GROUPS))
# The row fields after the slot entries (host values: the metadata tensors' addresses, ...), copied by their rules
_LATE = tuple((R[f.name], f) for f in HOST_ROWS)
_NO_LATE = (None,) * len(_LATE)


class HostPath:
    """What the Recorder keeps of an observation copied on the host (host tensors, numpy arrays, lists, and device
    tensors where the ring does not take them): its rows in dump.ROW_FIELDS order, checked against what a dump
    cannot hold (what cannot be stored raises: the Recorder drops it). The KV-cache groups its slot entries name
    are noted in the writer (Recorder.set_kv_groups checks them). `site_ok`: the site names checked (the
    Recorder's, shared with its device path)."""

    def __init__(self, writer, lock, site_ok: set):
        self._w = writer
        self._lock = lock
        self._site_ok = site_ok

    def row(self, r: Record, vals: Scalars, slots: tuple | None) -> tuple:
        """One observation's rows (slots: its slot entries, None: not copied yet)."""
        if slots is None:
            slots = self.slots(r.positions, r.slot_mapping)
        seq, qsl = batch_rows(r.seq_lens, vals[2], vals[3], r.query_start_loc)
        row = (seq, host_fast(r.dcp_local_seq_lens), qsl, host_fast(r.kv_pages), host_fast(r.dcp_query_start_loc),
               nonneg(host_fast(r.dcp_tot_seq_lens), "dcp_tot_seq_lens"), *slots,
               nonneg(host_fast(r.ctx_chunks), "ctx_chunks"), nonneg(host_fast(r.group_seq_lens), "group_seq_lens"),
               host_fast(r.verify_row_lens), nonneg(host_fast(r.sparse_topk), "sparse_topk"), *self._late(r, seq.size))
        check_shared(vals, r.site, self._site_ok, None if row[3] is None else row[3].size, seq.size,
                      self._w.config.page_size)
        return row

    def many(self, r: Record, k: int) -> tuple[Scalars, list]:
        """One batch seen by k ranks (Recorder.record_many): the scalars they share and their rows, seq_lens and
        query_start_loc one host copy for all, the others [ranks, ...] (a shared row broadcast), the slot entries
        one per rank; in dump.ROW_FIELDS order."""
        if r.slot_mapping is None:
            extras = [self.slots(r.positions, None)] * k
        else:
            per = r.slot_mapping if isinstance(r.slot_mapping, dict) else {0: r.slot_mapping}
            per = {g: host_copy(m).reshape(k, -1) for g, m in per.items()}
            extras = [self.slots(r.positions, {g: m[i] for g, m in per.items()}) for i in range(k)]
        common = scalars(r._replace(rank=0, parent=None, buffer=None))
        seq, qsl = batch_rows(r.seq_lens, common[2], common[3], r.query_start_loc)
        dcp = None if r.dcp_local_seq_lens is None else host_copy(r.dcp_local_seq_lens).reshape(k, -1)
        rows = [seq, dcp, qsl, per_rank(r.kv_pages, k), per_rank(r.dcp_query_start_loc, k),
                nonneg(per_rank(r.dcp_tot_seq_lens, k), "dcp_tot_seq_lens"), *zip(*extras),
                nonneg(per_rank(r.ctx_chunks, k), "ctx_chunks"),
                nonneg(per_rank(r.group_seq_lens, k), "group_seq_lens"), per_rank(r.verify_row_lens, k),
                nonneg(per_rank(r.sparse_topk, k), "sparse_topk"),
                *(None if r[j] is None else copied_row(f, per_rank(r[j], k), seq.size, self._w.config, k)
                  for j, f in _LATE)]
        kv = rows[3]
        check_shared(common, r.site, self._site_ok, None if kv is None else kv.shape[1], seq.size,
                      self._w.config.page_size)
        return common, rows

    def _late(self, r: Record, rows: int) -> tuple:
        """The row fields after the slot entries, copied and checked (none given: one comparison)."""
        if all(r[j] is None for j, _ in _LATE):
            return _NO_LATE
        return tuple(copied_row(f, r[j], rows, self._w.config) for j, f in _LATE)

    def slots(self, positions, slot_mapping) -> tuple:
        """arguments.host_slots for this recording's KV-cache groups; notes the highest group recorded."""
        if positions is None and slot_mapping is None:
            return NO_SLOTS
        kvg = self._w.config.kv_groups
        out = host_slots(positions, slot_mapping, None if kvg is None else len(kvg))
        self.groups_seen(out[2][-1:].tolist())
        return out

    def groups_seen(self, groups) -> None:
        """Note the highest KV-cache group of an observation's slot entries (groups ascending)."""
        if groups:
            with self._lock:
                self._w.saw_group(groups[-1])


def of_rank(rows: list, i: int) -> tuple:
    """Rank i's rows of HostPath.many()'s (seq_lens and query_start_loc shared)."""
    return tuple(x if j in (0, 2) else None if x is None else x[i] for j, x in enumerate(rows))
