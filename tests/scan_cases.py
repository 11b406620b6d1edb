"""The row scan's test cases, shared by tests/check/test_scan.py (the CPU path) and tests/gpu/test_scan_cuda.py (the
GPU path): the torch reference's answer, random pairs of observations, a streamed read. Not part of the package."""

import numpy as np
import torch
from conftest import random_dump

from dcptool.check import scan as scan_mod
from dcptool.dcp.reference import check_rows
from dcptool.dump import open_dumps


def reference_stats(d):
    t = lambda k: torch.from_numpy(np.ascontiguousarray(d[k]))  # noqa: E731
    kv = t("rows.kv_pages") if d.has("rows.kv_pages") else None
    st = check_rows(t("rows.seq_lens"), t("obs.rows"), t("rows.dcp_local_seq_lens"), t("obs.dcp_rows"),
                    t("obs.num_reqs"), t("obs.num_reqs_padded"), t("obs.rank"), d.config.dcp_size,
                    d.config.cp_interleave, kv_pages=kv, page_size=d.config.page_size or 1)
    st = st.stacked().numpy().astype(np.int64)
    if d.config.dcp_size == 1:
        st[0:4] = [[0], [-1], [0], [-1]]
    hit = np.flatnonzero((st[0] > 0) | (st[2] > 0) | (st[4] > 0))
    return hit, st[:, hit]


def as_array(s):
    return s.obs, np.stack([s.n_wrong, s.first_wrong, s.n_pad, s.first_pad, s.n_pages, s.first_pages])


def pair_dump(path, rng, n=240):
    """Observations whose seq_lens rows repeat (a few templates of awkward lengths, some cut short or with one
    row changed), and pairs pointing back, forward, at themselves or nowhere: -> (dump, pairs, want)."""
    from dcptool.dump import DumpConfig, write_dump

    tmpl = [rng.integers(0, 9, k).astype(np.int32) for k in (0, 1, 127, 128, 129, 300, 1031)]
    pick = rng.integers(0, len(tmpl), n)
    seqs = [tmpl[k].copy() for k in pick]
    for s in seqs:
        if s.size and rng.random() < 0.15:
            s[rng.integers(0, s.size)] += 1
        elif s.size and rng.random() < 0.05:
            s.resize(s.size - 1, refcheck=False)
    lens = np.array([s.size for s in seqs], np.int64)
    rows = np.zeros(n + 1, np.int64)
    rows[1:] = np.cumsum(lens)
    z = np.zeros(n, np.int32)
    cols = {"obs.step": np.arange(n, dtype=np.int64), "obs.site": z, "obs.rank": (np.arange(n) % 4).astype(np.int32),
            "obs.ubatch": z - 1, "obs.num_reqs": lens.astype(np.int32), "obs.num_reqs_padded": lens.astype(np.int32),
            "obs.rows": rows, "obs.has_dcp": z.astype(np.uint8), "obs.dcp_rows": np.zeros(n + 1, np.int64),
            "rows.seq_lens": np.concatenate(seqs), "rows.dcp_local_seq_lens": np.zeros(0, np.int32)}
    write_dump(path, DumpConfig(dcp_size=4, cp_interleave=1, sites=("x",)), cols)
    # the pair with the same template mostly (an earlier one, else a later one), sometimes any or none
    pairs = np.full(n, -1, np.int64)
    for i in range(n):
        same = np.flatnonzero(pick == pick[i])
        r = rng.random()
        pairs[i] = (same[same < i][-1] if (same < i).any() and r < 0.6 else same[-1] if r < 0.8
                    else rng.integers(0, n) if r < 0.9 else i if r < 0.95 else -1)
    want = np.array([p >= 0 and not np.array_equal(seqs[i], seqs[p]) for i, p in enumerate(pairs)])
    return open_dumps([str(path)]), pairs, np.flatnonzero(want)


class Future:
    """The pairs as replay hands them to the scan: a future (rank_pairs on another thread), counted."""

    def __init__(self, value):
        self.value, self.got = value, 0

    def result(self):
        self.got += 1
        return self.value


def streamed_scan_agrees(tmp_path, monkeypatch, backend: str) -> None:
    """scan of a streamed read (the rows still coming in pieces while the chunks go) against one read."""
    import dcptool.dump as dump_mod
    from dcptool.dump import stream

    monkeypatch.setattr(stream, "STREAM_PIECE", 1024)
    path = tmp_path / "r.safetensors"
    d = random_dump(path, np.random.default_rng(11), 200, 4, 16)
    prev = np.arange(d.n) - 1
    want = scan_mod.scan(d, backend, pairs=prev)
    s = dump_mod.read_dump(path, stream=True)
    got = scan_mod.scan(s, backend, pairs=prev)
    s.finish()
    assert all(np.array_equal(x, y) for x, y in zip(as_array(got), as_array(want))) and want.obs.size
    assert np.array_equal(got.differ, want.differ)


def rank_pair_files(tmp_path, rng, steps=60, ranks=4):
    """A file per DCP rank, each step one batch on every rank (awkward lengths), some ranks' seq_lens with a row
    changed or cut short: -> (paths, the pairs rank_pairs gives on the files end to end, the observations whose
    rows differ from their pair's). A pair lies in another file: the scan compares it across files."""
    from dcptool.check.ranks import rank_pairs
    from dcptool.dump import DumpConfig, write_dump

    lens = rng.choice([0, 1, 127, 128, 129, 300, 1031], size=steps)
    batch = [rng.integers(0, 9, k).astype(np.int32) for k in lens]
    paths, per_rank = [], []
    for r in range(ranks):
        seqs = [b.copy() for b in batch]
        for s in seqs:
            u = rng.random()
            if s.size and u < 0.1:
                s[rng.integers(0, s.size)] += 1
            elif s.size and u < 0.15:
                s.resize(s.size - 1, refcheck=False)
        per_rank.append(seqs)
        n = np.array([s.size for s in seqs], np.int64)
        rows = np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
        z = np.zeros(steps, np.int32)
        cols = {"obs.step": np.arange(steps, dtype=np.int64), "obs.site": z, "obs.rank": z + r, "obs.ubatch": z - 1,
                "obs.num_reqs": n.astype(np.int32), "obs.num_reqs_padded": n.astype(np.int32), "obs.rows": rows,
                "obs.has_dcp": z.astype(np.uint8), "obs.dcp_rows": np.zeros(steps + 1, np.int64),
                "rows.seq_lens": np.concatenate(seqs), "rows.dcp_local_seq_lens": np.zeros(0, np.int32)}
        paths.append(str(tmp_path / f"rank{r}.00000.safetensors"))
        write_dump(paths[-1], DumpConfig(dcp_size=ranks, cp_interleave=1, sites=("x",)), cols)
    d = open_dumps(paths)
    pairs = rank_pairs(d).prev
    seqs = [s for r in per_rank for s in r]
    want = np.flatnonzero([p >= 0 and not np.array_equal(seqs[i], seqs[p]) for i, p in enumerate(pairs.tolist())])
    return paths, pairs, want
