"""The progress bar on stderr that long commands (replay, simulate) show on a terminal."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from rich.console import Console
from rich.text import Text

# A replay's phases, in the order they run; each holds a number of units (observation-scan equivalents:
# the scan of one observation is one unit) that the pipeline estimates (replay.plan_progress) and updates
# as it learns more (after the scan it knows how many views are wrong).
PHASES = ("scan", "provenance", "checks", "findings", "report")


def _thread_timer(delay: float, fn: Callable[[], None]) -> Callable[[], None]:
    """Call fn once after `delay` seconds on a daemon thread; returns the cancel function."""
    t = threading.Timer(delay, fn)
    t.daemon = True
    t.start()
    return t.cancel


class Progress:
    """A progress bar on stderr for long work (done / total, rate, time left): shown once the work has run
    for `delay` seconds, whether or not a unit was done since (a timer wakes it: a slow phase that reports
    nothing still shows), never when disabled (--json, or stderr not a terminal). Call it with the units
    just done; safe from several threads.

    Work in phases (`plan`, `phase`): the total is the sum of the phases' units, the bar names the phase
    running, starting a phase counts the ones before it done, and units reported in a phase never run past
    its end, so the bar reaches 100% only when the last phase does. `clock` and `timer` are injectable
    (tests drive them by hand: no timed tests)."""

    def __init__(self, total: int, what: str, enabled: bool, unit: str = "obs", delay: float = 1.0, *,
                 clock: Callable[[], float] = time.monotonic,
                 timer: Callable[[float, Callable[[], None]], Callable[[], None]] = _thread_timer):
        self.total, self.what, self.unit, self.delay = total, what, unit, delay
        self.enabled = enabled and total > 0
        self._clock = clock
        self._t0 = self._clock()
        self._done = 0
        self._bar = None
        self._task = None
        self._closed = False
        self._lock = threading.RLock()
        self._units: dict[str, int] = {}  # phase -> planned units
        self._phase: str | None = None
        self._cancel = timer(delay, self._wake) if self.enabled else None

    # ----- units

    def __call__(self, k: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._done += k
            if self._phase is not None:
                self._done = min(self._done, self._end(self._phase))
            self._show()

    @property
    def done(self) -> int:
        return self._done

    @property
    def description(self) -> str:
        return self.what if self._phase is None else f"{self.what}: {self._phase}"

    # ----- phases

    def plan(self, **units: int) -> None:
        """Set (or revise) the units of phases, by name; the total becomes their sum (never below what is done)."""
        with self._lock:
            for name, n in units.items():
                self._units[name] = max(0, int(n))
            order = [p for p in PHASES if p in self._units] + [p for p in self._units if p not in PHASES]
            self._units = {p: self._units[p] for p in order}
            self.total = max(sum(self._units.values()), self._done)
            if self.enabled:
                self._show()

    def phase(self, name: str) -> None:
        """Start phase `name`: the phases before it are done."""
        with self._lock:
            if name not in self._units:
                self.plan(**{name: 0})
            self._phase = name
            self._done = max(self._done, self._start_of(name))
            if self.enabled:
                self._show()

    def _start_of(self, name: str) -> int:
        out = 0
        for p, n in self._units.items():
            if p == name:
                return out
            out += n
        return out

    def _end(self, name: str) -> int:
        return self._start_of(name) + self._units.get(name, 0)

    # ----- display

    def _wake(self) -> None:
        with self._lock:
            if self._bar is None and not self._closed:
                self._start()

    def _show(self) -> None:
        if self._bar is None and not self._closed and self._clock() - self._t0 >= self.delay:
            self._start()
        if self._bar is not None:
            self._bar.update(self._task, completed=min(self._done, self.total), total=self.total,
                             description=self.description)

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
        self._task = self._bar.add_task(self.description, total=self.total, completed=min(self._done, self.total))

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._closed = True
            if self._cancel is not None:
                self._cancel()
            if self._bar is not None:
                self._bar.stop()
