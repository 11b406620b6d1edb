"""The progress bar: silent when disabled or quick, shown on stderr for long work."""

import io

from conftest import cli, obs, write
from rich.console import Console

from dcptool.report import progress


def test_disabled_or_quick_work_shows_nothing():
    p = progress.Progress(100, "replay", enabled=False)
    p(50)
    assert p._bar is None
    q = progress.Progress(100, "replay", enabled=True, delay=3600)
    q(100)
    assert q._bar is None


def test_long_work_starts_a_bar_and_counts(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(progress, "Console", lambda **kw: Console(file=out, force_terminal=True, width=100))
    with progress.Progress(1000, "replay", enabled=True, delay=0.0) as p:
        p(400)
        p(400)
        assert p._bar is not None
        task = p._bar.tasks[0]
        assert task.completed == 800 and task.total == 1000
    assert "replay" in out.getvalue()


def test_cli_json_has_no_progress_output(tmp_path):
    r = cli("replay", write(tmp_path / "a.safetensors", [obs(step=i) for i in range(3)]), "--json")
    assert r.stderr == ""


# --------------------------------------------------------------------------------------------
# Phases and the timer: a fake clock and a hand-fired timer, no timed tests


class FakeTimer:
    """Records the timer progress.Progress arms; the test fires it."""

    def __init__(self):
        self.armed, self.cancelled = [], False

    def __call__(self, delay, fn):
        self.armed.append((delay, fn))
        return self.cancel

    def cancel(self):
        self.cancelled = True

    def fire(self):
        for _, fn in self.armed:
            fn()


def fake_bar(monkeypatch, total=100, delay=1.0):
    out = io.StringIO()
    monkeypatch.setattr(progress, "Console", lambda **kw: Console(file=out, force_terminal=True, width=120))
    now = [0.0]
    timer = FakeTimer()
    p = progress.Progress(total, "replay", enabled=True, delay=delay, clock=lambda: now[0], timer=timer)
    return p, timer, now, out


def test_a_silent_slow_phase_still_shows_the_bar_within_delay(monkeypatch):
    """Before: the bar started only when a unit was reported after `delay`, so a phase that reported nothing
    (provenance, building findings) showed nothing at all. Now the timer armed at start shows it."""
    p, timer, now, _ = fake_bar(monkeypatch)
    assert timer.armed and timer.armed[0][0] == 1.0
    p(10)  # quick: no bar yet
    assert p._bar is None
    now[0] = 5.0  # a long phase that reports nothing; the timer fires
    timer.fire()
    assert p._bar is not None and p._bar.tasks[0].completed == 10
    with p:
        pass
    assert timer.cancelled


def test_closed_bar_is_not_started_by_a_late_timer(monkeypatch):
    p, timer, now, _ = fake_bar(monkeypatch)
    with p:
        pass
    timer.fire()
    assert p._bar is None and timer.cancelled


def test_phases_add_up_and_the_bar_reaches_the_end_only_with_the_last(monkeypatch):
    p, timer, now, _ = fake_bar(monkeypatch, total=1000)
    p.plan(scan=1000, checks=200, provenance=0, findings=0)
    assert p.total == 1200
    p.phase("scan")
    p(600)
    p(600)  # a scan reporting past its phase is capped at the phase's end
    assert p.done == 1000
    p.plan(provenance=500, findings=100)  # after the scan: wrong views known
    assert p.total == 1800 and list(p._units) == ["scan", "provenance", "checks", "findings"]
    p.phase("provenance")
    assert p.done == 1000 and p.description == "replay: provenance"
    p.phase("checks")  # starting a phase counts the ones before it done
    assert p.done == 1500
    timer.fire()
    task = p._bar.tasks[0]
    assert (task.completed, task.total, task.description) == (1500, 1800, "replay: checks")
    p.phase("findings")
    p(10**9)
    assert p.done == 1800 == p.total and p._bar.tasks[0].completed == 1800
    p.plan(report=300)  # the CLI's HTML page: one more phase, so not at 100% yet
    p.phase("report")
    assert p.total == 2100 and p.done == 1800


def test_replay_walks_the_phases_in_order(monkeypatch):
    """The library's replay drives the phases (a recording bar, not a terminal): the scan's observations,
    then provenance, checks and findings, and ends with every planned unit done."""
    from dcptool.check.replay import replay
    from dcptool.dump import open_dumps

    seen = []

    class Recorder(progress.Progress):
        def phase(self, name):
            super().phase(name)
            seen.append((name, self.done, self.total))

    legacy = str(progress.__file__).rsplit("/dcptool/", 1)[0] + "/samples/legacy.safetensors"
    d = open_dumps([legacy])
    bar = Recorder(d.n, "replay", enabled=True, delay=3600, timer=lambda *a: (lambda: None))
    res = replay(d, "torch", progress=bar)
    names = [s[0] for s in seen]
    assert names[:4] == ["scan", "provenance", "checks", "findings"]
    assert seen[0][1] == 0 and seen[1][1] == d.n  # the scan covered every observation
    assert bar.total > d.n and bar._units["provenance"] > 0  # wrong views: provenance has weight
    assert bar.done == bar.total and res.findings
    # a plain callable still gets the scan's units and nothing else
    got = []
    replay(d, "torch", progress=got.append)
    assert sum(got) == d.n
