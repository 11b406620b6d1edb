"""device_checks_tl.py: the Guard's check kernel (through device_checks.py) on CPU tensors under Triton's interpreter
(or on a GPU): silent on a clean run, and on each per-observation fault the same first wrong observation, rule and
dump as the host path."""

import warnings

import numpy as np
import pytest
import torch
from test_guard import PER_OBS_FAULTS, guard_of, observations, run_sim
from test_host_checks import broken

from dcptool.dump import read_dump
from dcptool.engine.guard.guard import Guard
from dcptool.engine.guard.host_checks import CHECKS

pytestmark = pytest.mark.kernel


def _on(dev, kw):
    return {k: (v.to(dev) if isinstance(v, torch.Tensor) else
                {g: m.to(dev) for g, m in v.items()} if isinstance(v, dict) else v) for k, v in kw.items()}


def _dev() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def test_clean_run_writes_nothing_and_counts(tmp_path):
    d = run_sim(tmp_path, None)
    obs = list(observations(d, True))[:40]
    g = guard_of(d, tmp_path, kernel=True, keep=8)
    for kw in obs:
        assert g.observe(**_on(_dev(), kw)) >= 0
    assert not g._dev.wrong_seen()
    assert g.close() is None and g.count == len(obs) and g.wrong == 0
    assert not (tmp_path / "guard").exists()


@pytest.mark.parametrize("fault", PER_OBS_FAULTS)
def test_same_dump_as_the_host_path(tmp_path, fault):
    d = run_sim(tmp_path, fault)
    host = guard_of(d, tmp_path / "host", keep=6)
    obs = []
    with pytest.warns(RuntimeWarning):
        for kw in observations(d, True):
            obs.append(kw)
            host.observe(**kw)
            if host.dumped is not None:
                break
    dev = guard_of(d, tmp_path / "dev", kernel=True, keep=6, on_wrong="dump")
    with pytest.warns(RuntimeWarning, match="dcptool Guard: wrong DCP metadata"):
        for kw in obs + obs[-1:] * 3:  # (the ring is frozen at the wrong one: what follows is checked, not kept)
            dev.observe(**_on(_dev(), kw))
        dev.close()
    assert dev.first_index == host.first_index and dev.first_rule == host.first_rule
    assert dev.wrong >= 1 and dev.count == len(obs) + 3
    a, b = read_dump(host.dumped), read_dump(dev.dumped)
    assert a.columns.keys() == b.columns.keys()
    for k in a.columns:
        if k != "obs.buffer":  # (the engine's storage: the host path's CPU tensors and the device's differ)
            assert np.array_equal(a[k], b[k]), k


def _as_vllm(kw):
    """The slot entries as vLLM hands them: positions int64, the slot mapping one int64 [groups, tokens] view of a
    wider buffer (rows not contiguous with each other)."""
    sm = kw.get("slot_mapping")
    if sm is None:
        return kw
    rows = torch.stack([sm[g].reshape(-1) for g in sorted(sm)]).to(torch.int64)
    buf = torch.full((rows.shape[0], rows.shape[1] + 3), -7, dtype=torch.int64)
    buf[:, :rows.shape[1]] = rows
    return dict(kw, positions=kw["positions"].to(torch.int64), slot_mapping=buf[:, :rows.shape[1]])


@pytest.mark.parametrize("fault", [None, "slot-wrong-group", "slot-all-ranks"])
def test_vllms_int64_slot_entries_are_read_as_they_are(tmp_path, fault, monkeypatch):
    """int64 positions and a strided int64 slot mapping are read by the kernel itself (no copy on the host: the
    device path's conversion is never called) and flagged and kept as the host path does with int32 ones."""
    from dcptool.engine.guard.device_checks import GuardDevice

    d = run_sim(tmp_path, fault)
    obs = [kw for kw in observations(d, True) if kw.get("slot_mapping") is not None]
    scan = guard_of(d, tmp_path / "scan", on_wrong="count")  # (the host path finds the window to run: cheap)
    for kw in obs:
        scan.observe(**kw)
        if scan.first_rule is not None:
            break
    obs = obs[max(0, scan.first_index - 3):scan.first_index + 3] if scan.first_rule else obs[:6]
    host = guard_of(d, tmp_path / "host", keep=4)
    dev = guard_of(d, tmp_path / "dev", kernel=True, keep=4)
    copies = []
    real = GuardDevice._i32
    monkeypatch.setattr(GuardDevice, "_i32", lambda self, x: copies.append(x) or real(self, x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the dumps' warnings: test_same_dump_as_the_host_path checks them)
        for kw in obs:
            host.observe(**kw)
            assert dev.observe(**_on(_dev(), _as_vllm(kw))) >= 0
        host.close(), dev.close()
    assert copies == [] and obs
    assert (dev.first_index, dev.first_rule, dev.count) == (host.first_index, host.first_rule, len(obs))
    assert (fault is None) == (dev.first_rule is None) == (dev.dumped is None)
    if fault:  # the slot entries kept from the int64 reads are the host path's
        a, b = read_dump(host.dumped), read_dump(dev.dumped)
        assert a.columns.keys() == b.columns.keys()
        for k in a.columns:
            if k != "obs.buffer":
                assert np.array_equal(a[k], b[k]), k


@pytest.mark.parametrize("case", ["values+padding", "values+slots", "pages+tot-lens"])
def test_rules_broken_in_different_rows_all_count(tmp_path, case):
    """One build breaking two rules in different rows: the kernel ORs the rows' rule bits (a max kept only the
    higher bit, so the first rule named could differ from the host path's)."""
    t = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    kw = dict(step=0, site="s", rank=0, seq_lens=t(8, 5, 0), num_reqs=2, num_reqs_padded=3,
              dcp_local_seq_lens=t(4, 4, 0))  # rank 0 of 2: 4, 3 (row 1 wrong)
    if case == "values+padding":
        kw["dcp_local_seq_lens"] = t(4, 4, 7)
    elif case == "values+slots":  # position 1 is rank 1's
        kw.update(positions=t(0, 1), slot_mapping={0: t(5, 6)}, query_start_loc=t(0, 1, 2, 2))
    else:  # pages wrong in row 0, the global companion in row 1
        kw.update(dcp_local_seq_lens=t(4, 3, 0), kv_pages=t(2, 1), dcp_tot_seq_lens=t(8, 6))
    rules = []
    for kernel in (False, True):
        g = Guard(tmp_path / str(kernel), 2, 1, page_size=4, on_wrong="count", kernel=kernel)
        g.observe(**(_on(_dev(), kw) if kernel else kw))
        g.close()
        rules.append(g.first_rule)
    assert rules[0] == rules[1] == case.split("+")[0]
    kept, _, _ = g._dev.kept()
    assert bin(kept[-1][1]).count("1") == 2  # both rules' bits


@pytest.mark.parametrize("name", CHECKS)
def test_each_device_rule_is_reported_under_the_tables_name(tmp_path, name):
    """Each check the rule table marks `device`, broken alone in one build: the kernel and the host path both report
    it under the table's name (test_host_checks holds the names to the table: none other)."""
    c = broken(name)
    t = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a, np.int32))  # noqa: E731
    kw = dict(step=0, site="s", rank=1, seq_lens=t(c["seq"]), num_reqs=3, num_reqs_padded=4,
              dcp_local_seq_lens=t(c["dcp"]), query_start_loc=t(c["qsl"]), kv_pages=t(c["kv"]),
              dcp_query_start_loc=t(c.get("dqsl")), dcp_tot_seq_lens=t(c.get("tot")))
    # the host values (graph, addresses ...) go to observe() as they are
    kw.update((k, v) for k, v in c.items() if k not in ("seq", "dcp", "qsl", "kv", "dqsl", "tot", "slots", "spec"))
    pos, slot, grp = c.get("slots", (None,) * 3)
    if pos is not None:
        kw.update(positions=t(pos[grp == 0]), slot_mapping={g: t(slot[grp == g]) for g in (0, 1)})
    groups = [{"name": "attn", "dcp": True}, {"name": "mamba", "dcp": False}]
    seen = []
    for kernel in (False, True):
        g = Guard(tmp_path / str(kernel), 2, c["spec"].cp_interleave if "spec" in c else 1, page_size=4,
                  kv_groups=groups, on_wrong="count", kernel=kernel)
        g.observe(**(_on(_dev(), kw) if kernel else kw))
        g.close()
        seen.append((g.first_rule, g.wrong))
    assert seen == [(name, 1), (name, 1)]


def _host_value_build(rng, nr: int, page: int, rank: int, il: int, wrong_host: bool, wrong_plan: bool) -> dict:
    """A random build with the host values of host-copy and plan-pages (numpy, as the plugin passes them) and right
    device tensors: decodes (query 1) then prefills over contexts of awkward lengths, FlashInfer's plans from the
    formula (a decode row's prefill count -1), some entries -1 (not recorded), padded rows behind; then, at random,
    a few values moved (the host copy, a page count, a last page: mostly wrong, sometimes moved to where they stay
    right; wrong_host / wrong_plan: one real row's host copy / a recorded plan value one off), a plan shorter than
    num_reqs, query_start_loc too short, to be judged as the host path judges them."""
    from dcptool.dcp.reference import last_page, local_np

    nrp = nr + int(rng.integers(0, 3))
    q = np.where(rng.random(nr) < 0.5, 1, rng.integers(1, 300, nr))
    ctx = rng.choice([0, 1, 15, 16, 17, 127, 128, 129, 1000, 4097, 65536], nr)
    seq = np.zeros(nrp, np.int64)
    seq[:nr] = ctx + q
    qsl = np.concatenate([[0], np.cumsum(q), np.full(nrp - nr, q.sum())]).astype(np.int64)
    local = local_np(seq[:nr] - q, 2, rank, il)
    pre = np.where((q > 1) & (rng.random(nr) > 0.1), -(-local // page), -1)  # (-1: a decode row, or not recorded)
    last = last_page(local_np(np.where(pre >= 0, seq[:nr] - q, seq[:nr]), 2, rank, il), page)  # (what pre covers)
    last[rng.random(nr) < 0.1] = -1
    host = seq.copy()
    if nr and wrong_host:
        host[int(rng.integers(0, nr))] += 1
    recorded = np.flatnonzero(np.concatenate([pre, last]) >= 0)
    if wrong_plan and recorded.size:
        k = int(rng.choice(recorded))
        (pre if k < nr else last)[k % nr] += 1
    for a, p in ((host, 0.2), (pre, 0.2), (last, 0.2)):
        if nr and rng.random() < p:
            a[rng.integers(0, nr, int(rng.integers(1, 3)))] += rng.choice([-1, 1, page, 0])
    if nr and rng.random() < 0.1:  # a build that writes its host copy in place
        kw_after = host.copy()
        kw_after[int(rng.integers(0, nr))] += 1
    else:
        kw_after = host.copy()
    if rng.random() < 0.15:
        pre = pre[:max(nr - 3, 0)]
    if rng.random() < 0.1:
        qsl = qsl[:nr]
    t = lambda a: torch.from_numpy(np.asarray(a, np.int32))  # noqa: E731
    return dict(step=0, site="s", rank=rank, num_reqs=nr, num_reqs_padded=nrp, seq_lens=t(seq),
                dcp_local_seq_lens=t(np.append(local_np(seq[:nr], 2, rank, il), np.zeros(nrp - nr))),
                query_start_loc=t(qsl), host_seq_lens=host.astype(np.int32), host_seq_lens_after=kw_after,
                kv_prefill_pages=pre.astype(np.int32), kv_last_page=last.astype(np.int32))


@pytest.mark.parametrize("nr", [0, 1, 127, 128, 129, 1000, 1300])
def test_host_copy_and_plan_pages_are_decided_by_the_kernel_as_the_host_path_decides_them(tmp_path, nr):
    """Seeded random builds of every size, each with the host values of host-copy and plan-pages in turn (the host
    copy alone, the plans alone, both): the kernel's rule bits for the two checks (handed the host values in the
    host-values ring, compared with the device's seq_lens and query_start_loc) are those the numpy reference gives,
    with right values, moved ones, -1 entries, short plans, a short query_start_loc, pages of 1 and 16."""
    from dcptool.engine.guard.device_checks import BIT

    rng = np.random.default_rng(nr + 39)
    verdicts = set()
    for case in range(8):
        page, rank, il = int(rng.choice([1, 16])), int(rng.integers(0, 2)), int(rng.choice([1, 2]))
        kw = _host_value_build(rng, nr, page, rank, il, case % 2 == 1, case % 4 >= 2)
        for left_out in (("kv_prefill_pages", "kv_last_page"), ("host_seq_lens", "host_seq_lens_after"), ()):
            b = {k: v for k, v in kw.items() if k not in left_out}
            host = Guard(tmp_path / "h", 2, il, page_size=page, on_wrong="count")
            host.observe(**b)
            host.close()
            dev = Guard(tmp_path / "d", 2, il, page_size=page, on_wrong="count", kernel=True)
            dev.observe(**_on(_dev(), b))
            kept, _, _ = dev._dev.kept()
            dev.close()
            bits = kept[-1][1]
            want = {host.first_rule} - {None}
            got = {n for n in ("host-copy", "plan-pages") if bits & BIT[n]}
            assert (dev.first_rule, dev.dropped, host.dropped) == (host.first_rule, 0, 0), (case, left_out)
            assert bits & ~(BIT["host-copy"] | BIT["plan-pages"]) == 0
            assert got == want if left_out else got >= want  # (both: the host path names the first the table lists)
            verdicts.add((left_out[1:], tuple(sorted(got))))
    if nr:  # (the seeds give right and wrong builds of each)
        assert {(("kv_last_page",), ()), (("kv_last_page",), ("host-copy",)), (("host_seq_lens_after",), ()),
                (("host_seq_lens_after",), ("plan-pages",))} <= verdicts, verdicts


def _slot_build(rng, n_tok: int, n_groups: int, rank: int, il: int, wrong: str | None) -> tuple[dict, list]:
    """A random build's slot entries for n_groups KV-cache groups (some sharded, some replicated): right as vLLM
    deals them (this rank's positions get a slot, the others -1; padded tokens -1), then `wrong`: an entry of another
    rank's, a missing one of this rank's (wrong only in a group the rank writes in), a padded token with a slot, a
    value below -1."""
    N = 2
    real = int(rng.integers(0, n_tok + 1)) if n_tok else 0
    nr = int(rng.integers(1, 5))
    qsl = np.sort(rng.integers(0, real + 1, nr + 1))
    qsl[0], qsl[-1] = 0, real
    pos = rng.integers(0, 5000, n_tok)
    sharded = [bool(rng.random() < 0.7) for _ in range(n_groups)]
    mine = (pos // il) % N == rank
    maps = {}
    for g in range(n_groups):
        own = mine if sharded[g] else np.ones(n_tok, bool)
        s = np.where(own, rng.integers(0, 10 ** 6, n_tok), -1)
        s[real:] = -1
        maps[g] = s
    if wrong and n_tok:
        g = int(rng.integers(0, n_groups))
        s = maps[g]
        t = int(rng.integers(0, n_tok))
        if wrong == "other-rank" and real and sharded[g] and (~mine[:real]).any():
            s[int(rng.choice(np.flatnonzero(~mine[:real])))] = 7
        elif wrong == "missing" and real and mine[:real].any():
            s[int(rng.choice(np.flatnonzero(mine[:real] | (not sharded[g]))))] = -1
        elif wrong == "padded" and real < n_tok:
            s[int(rng.integers(real, n_tok))] = 3
        elif wrong == "below":
            s[t] = -2
    t32 = lambda a: torch.from_numpy(np.asarray(a, np.int32))  # noqa: E731
    from dcptool.dcp.reference import local_np

    seq = rng.integers(1, 300, nr)
    kw = dict(step=0, site="s", rank=rank, num_reqs=nr, num_reqs_padded=nr, seq_lens=t32(seq),
              dcp_local_seq_lens=t32(local_np(seq, N, rank, il)), query_start_loc=t32(qsl), positions=t32(pos),
              slot_mapping={g: t32(m) for g, m in maps.items()})
    groups = [{"name": f"g{g}", "dcp": sh} for g, sh in enumerate(sharded)]
    return kw, groups


@pytest.mark.parametrize("n_tok", [0, 1, 127, 128, 129, 1000, 1300])
def test_slot_ownership_is_decided_by_the_kernel_as_the_host_path_decides_it(tmp_path, n_tok):
    """Seeded random builds of every token count (blocks of the token pass: one, several, a partial one), 1 to 5
    KV-cache groups (the kernel takes them two at a time), sharded and replicated, right and with one entry moved:
    the kernel's slots bit is the numpy reference's verdict, and the entries it keeps are those handed to it."""
    from dcptool.engine.guard.device_checks import BIT

    rng = np.random.default_rng(n_tok + 40)
    verdicts = set()
    for case in range(10):
        n_groups, rank, il = int(rng.integers(1, 6)), int(rng.integers(0, 2)), int(rng.choice([1, 2]))
        wrong = [None, "other-rank", "missing", "padded", "below"][case % 5]
        kw, groups = _slot_build(rng, n_tok, n_groups, rank, il, wrong)
        seen = []
        for kernel in (False, True):
            g = Guard(tmp_path / f"{case}{kernel}", 2, il, kv_groups=groups, on_wrong="count", kernel=kernel)
            g.observe(**(_on(_dev(), kw) if kernel else kw))
            if kernel:
                kept, _, _ = g._dev.kept()
                bits, rec = kept[-1][1:]
            g.close()
            seen.append(g.first_rule)
        assert seen[0] == seen[1], (case, wrong, n_groups)
        want = np.stack([kw["slot_mapping"][k].numpy() for k in range(n_groups)])
        assert np.array_equal(rec.positions, kw["positions"].numpy()) and np.array_equal(rec.slot_mapping, want)
        assert bits & ~BIT["slots"] == 0 and bool(bits) == (seen[0] == "slots")
        verdicts.add(seen[0])
    if n_tok > 1:
        assert verdicts == {None, "slots"}, verdicts
