"""The per-observation value rules (missing, stale ... mismatch, padding, shape, stray, pages), as columns."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dcptool.check.findings import MISSING, PADDING, PAGES, SHAPE, STRAY, VALUE, FindingTable
from dcptool.check.provenance import KINDS, Provenance
from dcptool.dcp.reference import local_np
from dcptool.dcp.rules import RULES
from dcptool.dump import Dump

if TYPE_CHECKING:
    from dcptool.dcp.reference import RowStats

def check_values(d: Dump, prov: Provenance, st: RowStats) -> FindingTable:
    """Wrong real rows (the scan's n_wrong): explained by provenance (stale, global, wrong-rank,
    wrong-interleave) or a mismatch, all at once; `prov` has been prepared for these observations."""
    k = st.n_wrong > 0
    i, first = st.obs[k].astype(np.int64), st.first_wrong[k].astype(np.int64)
    c = d.config
    rec = d.take("rows.dcp_local_seq_lens", d["obs.dcp_rows"][i] + first).astype(np.int64)
    exp = local_np(d.take("rows.seq_lens", d["obs.rows"][i] + first), c.dcp_size, d["obs.rank"][i], c.cp_interleave)
    kind, src, rel, aux = prov.explain_many(i)
    rule = np.array([RULES.index(k) for k in KINDS], np.int8)[kind]
    return FindingTable.build(d, i, rule, VALUE, row=first, recorded=rec, expected=exp, wrong_rows=st.n_wrong[k],
                              source=src, relation=rel, a0=aux)


def check_missing(d: Dump) -> FindingTable:
    return FindingTable.build(d, np.flatnonzero(~d["obs.has_dcp"].astype(bool)), "missing", MISSING)


def check_padding(d: Dump, st: RowStats) -> FindingTable:
    k = st.n_pad > 0
    i, j = st.obs[k].astype(np.int64), st.first_pad[k].astype(np.int64)
    rec = d.take("rows.dcp_local_seq_lens", d["obs.dcp_rows"][i] + j)
    return FindingTable.build(d, i, "padding", PADDING, row=j, recorded=rec, expected=0, wrong_rows=st.n_pad[k],
                              a0=d["obs.num_reqs"][i])


def check_shape(d: Dump) -> FindingTable:
    has = d["obs.has_dcp"].astype(bool)
    nrp = d["obs.num_reqs_padded"]
    dlen = np.diff(d["obs.dcp_rows"])
    i = np.flatnonzero(has & (dlen != nrp))
    return FindingTable.build(d, i, "shape", SHAPE, a0=dlen[i], a1=nrp[i])


def check_stray(d: Dump) -> FindingTable:
    return FindingTable.build(d, np.flatnonzero(d["obs.has_dcp"].astype(bool)), "stray", STRAY)


def check_pages(d: Dump, st: RowStats) -> FindingTable:
    c = d.config
    k = st.n_pages > 0
    i, j = st.obs[k].astype(np.int64), st.first_pages[k].astype(np.int64)
    page = c.page_size
    seq = d.take("rows.seq_lens", d["obs.rows"][i] + j).astype(np.int64)
    local = local_np(seq, c.dcp_size, d["obs.rank"][i], c.cp_interleave)
    claimed = d.take("rows.kv_pages", d["obs.rows"][i] + j).astype(np.int64)
    return FindingTable.build(d, i, "pages", PAGES, row=j, recorded=claimed, expected=-(-local // page),
                              wrong_rows=st.n_pages[k], a0=-(-seq // page), a1=local)
