"""spool.py: a simulate run streamed to its files in parts writes, byte for byte, what one Recorder writes at close()
(and what dump.write_dump writes of the same columns), whatever the part size; optional columns that appear or vanish
between parts are filled as dump.columns fills them; a run that fails leaves nothing behind."""

from pathlib import Path

import numpy as np
import pytest
from conftest import obs, write

from dcptool.dump import DumpConfig, read_dump, write_dump, write_observations
from dcptool.model import simulate as sim_mod
from dcptool.model import spool
from dcptool.model.simulate import SimConfig, progress_units, simulate

CASES = {
    "legacy dcp4": dict(dcp=4, pipeline="legacy"),
    "legacy pcp2 dflash-free": dict(dcp=2, pcp=2, pipeline="legacy"),
    "faults late": dict(dcp=8, interleave=16, inject=("flashinfer-global-pages", "slot-wrong-group", "sentinel")),
    "piecewise ubatches": dict(dcp=2, ubatches=2, cudagraph="piecewise",
                               inject=("ubatch-parent-rows", "rank-disagree")),
    "0.29 decode columns": dict(dcp=4, engine_version="0.29.0", inject=("dcp-qsl-local", "tot-local",
                                                                        "slot-all-ranks")),
}


def _run(tmp_path, monkeypatch, name: str, first: int, part_bytes: int, per_rank: bool, **kw) -> list[bytes]:
    monkeypatch.setattr(spool, "FIRST_PART_OBS", first)
    monkeypatch.setattr(spool, "PART_BYTES", part_bytes)
    d = tmp_path / name
    d.mkdir()
    res = simulate(SimConfig(steps=40, seed=7, max_num_reqs=24, token_budget=512, **kw), d / "run.safetensors",
                   per_rank=per_rank)
    assert not [p for p in d.iterdir() if p.name.startswith(".")]  # no part directory, no temporary left
    return [Path(f).read_bytes() for f in res.files]


@pytest.mark.parametrize("per_rank", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_parts_of_any_size_write_the_same_bytes(tmp_path, monkeypatch, case, per_rank):
    one = _run(tmp_path, monkeypatch, "one", 10**9, 1 << 40, per_rank, **CASES[case])  # the whole run: one part
    many = _run(tmp_path, monkeypatch, "many", 37, 1, per_rank, **CASES[case])  # 37 observations, then 64 a part
    assert len(one) == len(many) and all(a == b for a, b in zip(one, many))
    # and what the plain writer makes of the same columns
    for f in sorted((tmp_path / "many").glob("*.safetensors")):
        d = read_dump(f)
        write_dump(tmp_path / "again.safetensors", d.config, d.columns, d.injected[0])
        assert (tmp_path / "again.safetensors").read_bytes() == f.read_bytes()


def test_optional_columns_appear_and_vanish_between_parts(tmp_path):
    """Column filled from parts where the optional columns come and go: what write_observations makes of all."""
    rng = np.random.default_rng(3)
    cfg = DumpConfig(dcp_size=2, cp_interleave=1, sites=("a", "b"), page_size=16)
    run = []
    for i in range(60):
        part = i // 20
        extra = {}
        if part == 1:  # the middle part only: parents, query_start_loc, kv_pages
            extra = dict(parent=i - 1 if i % 2 else None, query_start_loc=np.array([0, 1, 3, 3, 3]),
                         kv_pages=np.array([2, 2, 0, 0]) if i % 3 else None)
        if part == 2:  # the last: slot entries and tot lens
            extra = dict(positions=np.arange(3), slot_mapping=rng.integers(-1, 50, 3),
                         dcp_tot_seq_lens=np.array([17, 25]), num_tokens_padded=4)
        run.append(obs(step=i, site="ab"[i % 2], rank=i % 2, **extra))
    col = spool.Column(tmp_path)
    for part in range(3):
        p = tmp_path / f"part{part}.safetensors"
        chunk = run[part * 20 : part * 20 + 20]
        for o in chunk:  # parents index the part (as a Recorder's part file holds them)
            if o.parent is not None:
                o.parent -= part * 20
        write_observations(p, chunk, cfg)
        assert col.add(p) == 20 and not p.exists()
    for o in run[20:40]:
        if o.parent is not None:
            o.parent += 20
    whole = tmp_path / "whole.safetensors"
    write_observations(whole, run, cfg, {"x": [3, 59]})
    assert b"".join(col.chunks({"x": [3, 59]}, tmp_path / "out.safetensors")) == whole.read_bytes()


def test_a_failed_or_interrupted_run_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(spool, "FIRST_PART_OBS", 50)
    calls = []

    def stop(k):
        calls.append(k)
        if len(calls) == 30:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        simulate(SimConfig(steps=60), tmp_path / "run.safetensors", progress=stop, per_rank=True)
    assert list(tmp_path.iterdir()) == []
    real = sim_mod.atomic_write
    written = []

    def second_fails(path, chunks, **kw):
        if written:
            raise OSError(28, "No space left on device")
        real(path, chunks, **kw)
        written.append(path)

    monkeypatch.setattr(sim_mod, "atomic_write", second_fails)
    with pytest.raises(OSError):
        simulate(SimConfig(steps=10), tmp_path / "run.safetensors", per_rank=True)
    assert written and list(tmp_path.iterdir()) == []  # the file already written went too: no partial set


def test_progress_counts_the_steps_then_the_write(tmp_path):
    cfg = SimConfig(steps=40)
    got = []
    simulate(cfg, tmp_path / "run.safetensors", progress=got.append)
    assert sum(got) == progress_units(cfg) == 40 + 5 and got[:40] == [1] * 40


def test_a_large_run_says_its_size_first(tmp_path, monkeypatch):
    """Once the bytes a step takes say the run will pass NOTICE_BYTES (here 30 MB of a 35 MB run), once; the estimate
    runs ahead of the truth while the batches still grow (the first ~50 steps), within 1.7x here."""
    monkeypatch.setattr(spool, "FIRST_PART_OBS", 64)
    monkeypatch.setattr(spool, "PART_BYTES", 1 << 18)
    monkeypatch.setattr(sim_mod, "NOTICE_BYTES", 30_000_000)
    said = []
    res = simulate(SimConfig(steps=300), tmp_path / "run.safetensors", notice=said.append)
    size = Path(res.files[0]).stat().st_size
    assert len(said) == 1 and said[0].startswith("300 steps will write about ") and "free" in said[0], said
    est = float(said[0].split("about ")[1].split(" MB")[0]) * 1e6
    assert 30e6 <= est <= 1.7 * size and size > 30e6, (est, size)
    said.clear()
    monkeypatch.setattr(sim_mod, "NOTICE_BYTES", 1 << 40)
    simulate(SimConfig(steps=60), tmp_path / "run.safetensors", notice=said.append, force=True)
    assert said == []


def test_cli_says_the_size_on_stderr(tmp_path, monkeypatch):
    from conftest import cli

    monkeypatch.setattr(spool, "FIRST_PART_OBS", 64)
    monkeypatch.setattr(spool, "PART_BYTES", 1 << 16)
    monkeypatch.setattr(sim_mod, "NOTICE_BYTES", 1 << 20)
    r = cli("simulate", "--steps", "60", "-o", tmp_path / "run.safetensors")
    assert r.returncode == 0 and r.stderr.startswith("dcptool: 60 steps will write about "), r.stderr
    assert r.stderr.splitlines()[1].startswith(f"dcptool: wrote {tmp_path / 'run.safetensors'}: ")


def test_parts_are_cut_at_step_boundaries(tmp_path, monkeypatch):
    """A micro-batch's parent is in its part: the parent column of a many-part run is the one-part run's."""
    monkeypatch.setattr(spool, "FIRST_PART_OBS", 5)
    monkeypatch.setattr(spool, "PART_BYTES", 1)
    res = simulate(SimConfig(dcp=2, steps=30, pipeline="legacy"), tmp_path / "run.safetensors")
    d = read_dump(res.files[0])
    par = d["obs.parent"]
    kids = np.flatnonzero(par >= 0)
    assert kids.size and (d["obs.step"][par[kids]] == d["obs.step"][kids]).all()
    assert write(tmp_path / "w.safetensors", [obs()])  # (the helpers still write plain dumps)
