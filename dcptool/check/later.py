"""How replay's checks run: on background threads beside the row scan (numpy releases the GIL in its long calls, so
on a many-core host the checks phase shrinks to its longest check), or one after the other when their results are
asked for. Either way the results are collected in the same order, so the findings are identical."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

CHECK_THREADS = 4  # checks running at once beside the scan (at most the cores there are)


class Later:
    """A check run when its result is first asked for, once."""

    def __init__(self, f: Callable, *a):
        self.f, self.a, self.done = f, a, False

    def result(self):
        if not self.done:
            self.value, self.done = self.f(*self.a), True
        return self.value


class Background:
    """A check on a thread of its own (daemon: an interrupted replay exits at once, not when its checks end),
    at most `slots` running at a time; result() waits and re-raises what the check raised."""

    def __init__(self, slots: threading.Semaphore, f: Callable, *a):
        self.value, self.error = None, None
        self.t = threading.Thread(target=self._run, args=(slots, f, a), daemon=True, name="dcptool-check")
        self.t.start()

    def _run(self, slots, f, a) -> None:
        with slots:
            try:
                self.value = f(*a)
            except BaseException as e:  # handed to the caller by result()
                self.error = e

    def result(self):
        self.t.join()
        if self.error is not None:
            raise self.error
        return self.value


class Threads:
    """Checks on background threads: each a Background, at most n running at once. settle() waits for every one
    started: when the replay fails (a file rewritten while it is read, a check tripping over rows not yet
    validated), the error must not end the process while checks still run on the dump's buffers (daemon threads
    that the interpreter's exit stops in the middle of numpy or torch code can abort it)."""

    def __init__(self, n: int):
        self.slots, self.started = threading.Semaphore(n), []

    def __call__(self, f: Callable, *a) -> Background:
        self.started.append(Background(self.slots, f, *a))
        return self.started[-1]

    def settle(self) -> None:
        for b in self.started:
            b.t.join()


def runner(one_thread: bool) -> Callable:
    """later(f, *a) -> an object whose result() is f(*a): on background threads, or when asked for where one
    thread is wanted (a bounded dump: each read drops the pages it touched, and reads of several threads at once
    would hold more; one core; nothing to check)."""
    n = min(CHECK_THREADS, (os.cpu_count() or 1))
    return Later if one_thread or n < 2 else Threads(n)


def value(x):
    """x, or its result() where x is a check run by later()."""
    return x.result() if hasattr(x, "result") else x
