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
