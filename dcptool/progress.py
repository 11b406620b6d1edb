"""The progress bar on stderr that long commands (replay, simulate) show on a terminal."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text


class Progress:
    """A progress bar on stderr for long work (done / total, rate, time left): shown only once the
    work has run for `delay` seconds, never when disabled (--json, or stderr not a terminal). Call it
    with the units just done; safe from several threads."""

    def __init__(self, total: int, what: str, enabled: bool, unit: str = "obs", delay: float = 1.0):
        import threading
        import time

        self.total, self.what, self.unit, self.delay = total, what, unit, delay
        self.enabled = enabled and total > 0
        self._clock = time.monotonic
        self._t0 = self._clock()
        self._done = 0
        self._bar = None
        self._task = None
        self._lock = threading.Lock()

    def __call__(self, k: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._done += k
            if self._bar is None and self._clock() - self._t0 >= self.delay:
                self._start()
            if self._bar is not None:
                self._bar.update(self._task, completed=min(self._done, self.total))

    def _start(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, ProgressColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar

        unit = self.unit

        class Rate(ProgressColumn):
            def render(self, task) -> Text:
                return Text(f"{task.speed:,.0f} {unit}/s" if task.speed else "", style="progress.data.speed")

        self._bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), Rate(),
                        TimeRemainingColumn(), console=Console(stderr=True), transient=True)
        self._bar.start()
        self._task = self._bar.add_task(self.what, total=self.total, completed=self._done)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
