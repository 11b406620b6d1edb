"""The progress bar: silent when disabled or quick, shown on stderr for long work."""

import io

from conftest import cli, obs, write
from rich.console import Console

from dcptool import progress


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
