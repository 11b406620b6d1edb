"""The timeline model shared by the text report and the HTML report: observations and findings binned into
(site, rank) rows and step columns, and each cell's character and kind. Rendering stays in report.py and
htmlreport.py."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CLEAN, EMPTY = "·", " "


@dataclass(frozen=True)
class Timeline:
    """The replay as a picture: one row per (site, rank), one column per `width` consecutive steps (from the first)."""

    sites: list[str]  # per row
    ranks: list[int]  # per row
    first_step: int
    last_step: int
    width: int  # steps per column
    obs: np.ndarray  # [rows, cols] observations
    ub_obs: np.ndarray  # [rows, cols, U] observations by micro-batch: index u is micro-batch ubatches[u]
    rules: np.ndarray  # [rows, cols, len(RULES)] findings by rule
    ub_find: np.ndarray  # [rows, cols, U] findings by micro-batch
    first: np.ndarray  # [rows, cols] position in res.findings of the cell's first finding, -1 if none
    ubatches: list[int] | None = None  # the micro-batch of each ub_* index (-1 = full batch); None: u - 1
    hidden_rows: int = 0  # (site, rank) rows past TIMELINE_ROWS, not drawn (their findings are in the table)
    ub_folded: bool = False  # the last ub_* index also counts every higher micro-batch (past TIMELINE_UBATCHES)

    @property
    def columns(self) -> int:
        return int(self.obs.shape[1])

    def steps_of(self, col: int) -> tuple[int, int]:
        lo = self.first_step + col * self.width
        return lo, min(lo + self.width - 1, self.last_step)

    def ticks(self, gap: float) -> list[tuple[int, int]]:
        """(column, step) axis labels: multiples of a round number of steps, at least `gap` columns apart."""
        every = round_up(gap * self.width, (1, 2, 5))
        first = -(-self.first_step // every) * every
        out = [((s - self.first_step) // self.width, s) for s in range(first, self.last_step + 1, every)]
        if not out or out[0][0] >= gap:
            out.insert(0, (0, self.first_step))
        return out

    def worst(self) -> np.ndarray:
        """[rows, cols] index into RULES of each cell's worst finding (errors first, then table order), -1 if none."""
        from dcptool.dcp.rules import RULES, SEVERITY

        prio = np.array([i + (len(RULES) if SEVERITY[r] == "warning" else 0) for i, r in enumerate(RULES)])
        masked = np.where(self.rules > 0, prio, 10 * len(RULES))
        return np.where(self.rules.any(axis=2), masked.argmin(axis=2), -1)


def round_up(x: float, mantissas=(1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8)) -> int:
    """The smallest integer m * 10**e >= x (e >= 0): steps per column and label spacing people read at a glance."""
    scale = 1
    while True:
        for m in mantissas:
            if m * scale >= x and float(m * scale).is_integer():
                return int(m * scale)
        scale *= 10


TIMELINE_ROWS = 256  # (site, rank) rows drawn at most: rows with findings first (docs/limits.md)
TIMELINE_UBATCHES = 16  # distinct micro-batch indices kept apart in cell details; higher ones share the last


def timeline(res, max_columns: int, max_rows: int = TIMELINE_ROWS, by_site: bool = False) -> Timeline | None:
    """Bin the replay's observations and findings into at most `max_columns` step buckets (numpy, no loop per row),
    in at most `max_rows` rows: one per (site, rank), or with `by_site` one per site (every rank folded in; its
    rank is -1).

    Rows, micro-batch indices and steps are recorded numbers, so none of them may size an array: the
    rows drawn are capped (TIMELINE_ROWS), micro-batch indices are indexed by the values present and
    capped (TIMELINE_UBATCHES), and step offsets are taken modulo 2**64 (steps may span all of int64).
    """
    from dcptool.dcp.rules import RULES

    g = res.grid
    if g is None or g.count.size == 0:
        return None
    fa = res.findings.cells()  # from the columns: no Finding object per finding
    # rows: distinct (site, rank), compared as columns (no packing into one integer)
    site = np.concatenate([g.site.astype(np.int64), fa[:, 0]])
    rank = np.concatenate([g.rank.astype(np.int64), fa[:, 1]])
    if by_site:
        rank = np.full(rank.size, -1, np.int64)
    order = np.lexsort((rank, site))
    new = np.ones(order.size, bool)
    new[1:] = (site[order][1:] != site[order][:-1]) | (rank[order][1:] != rank[order][:-1])
    row_all = np.empty(order.size, np.int64)
    row_all[order] = np.cumsum(new) - 1
    key_site, key_rank = site[order][new], rank[order][new]
    n_rows = key_site.size
    keep = np.arange(n_rows)
    if n_rows > max_rows:  # rows with findings first, then the rest, each in (site, rank) order
        flagged = np.zeros(n_rows, bool)
        flagged[row_all[g.site.size:]] = True
        keep = np.sort(np.lexsort((np.arange(n_rows), ~flagged))[:max_rows])
    remap = np.full(n_rows, -1, np.int64)
    remap[keep] = np.arange(keep.size)
    row_g, row_f = remap[row_all[: g.site.size]], remap[row_all[g.site.size :]]
    lo, hi = int(g.step.min()), int(g.step.max())
    span = hi - lo + 1
    width = round_up(span / max(max_columns, 1))  # a round number of steps per column, for readable labels
    cols = -(-span // width)
    ub_vals = np.unique(np.concatenate([g.ubatch.astype(np.int64), fa[:, 3]]))
    folded = ub_vals.size > TIMELINE_UBATCHES
    ub_vals = ub_vals[:TIMELINE_UBATCHES]

    def column(steps) -> np.ndarray:
        off = np.asarray(steps, np.int64).view(np.uint64) - np.uint64(lo % 2**64)
        return (off // np.uint64(width)).astype(np.int64)

    def ub_index(u) -> np.ndarray:
        return np.minimum(np.searchsorted(ub_vals, u), ub_vals.size - 1)

    sel = row_g >= 0
    ub_obs = np.zeros((keep.size, cols, ub_vals.size), np.int64)
    np.add.at(ub_obs, (row_g[sel], column(g.step[sel]), ub_index(g.ubatch[sel])), g.count[sel])
    rules = np.zeros((keep.size, cols, len(RULES)), np.int64)
    ub_find = np.zeros_like(ub_obs)
    first = np.full((keep.size, cols), -1, np.int64)
    sel = np.flatnonzero(row_f >= 0)
    if sel.size:
        fr, fc = row_f[sel], column(fa[sel, 2])
        np.add.at(rules, (fr, fc, fa[sel, 4]), 1)
        np.add.at(ub_find, (fr, fc, ub_index(fa[sel, 3])), 1)
        # findings are in observation order, so the first one to land in a cell is its earliest
        cell = fr * cols + fc
        uniq, pos = np.unique(cell, return_index=True)
        first.reshape(-1)[uniq] = sel[pos]
    return Timeline(sites=[res.config.sites[int(k)] for k in key_site[keep]], ranks=[int(r) for r in key_rank[keep]],
                    first_step=lo, last_step=hi, width=width, obs=ub_obs.sum(axis=2), ub_obs=ub_obs, rules=rules,
                    ub_find=ub_find, first=first, ubatches=[int(u) for u in ub_vals], hidden_rows=n_rows - keep.size,
                    ub_folded=bool(folded))


def cells(tl: Timeline) -> tuple[np.ndarray, np.ndarray]:
    """Per cell: its character and its kind (empty, clean, warning, error)."""
    from dcptool.dcp.rules import RULE_CODES, RULES, SEVERITY

    worst = tl.worst()
    codes = np.array([RULE_CODES[r] for r in RULES] + [CLEAN, EMPTY])
    kinds = np.array([SEVERITY[r] for r in RULES] + ["clean", "empty"])
    pick = np.where(worst >= 0, worst, np.where(tl.obs > 0, len(RULES), len(RULES) + 1))
    return codes[pick], kinds[pick]
