"""later.py: checks run once when asked for, or on background threads that hand back results and errors."""

import threading

import pytest

from dcptool.check import later as L


def test_later_runs_once_when_first_asked():
    calls = []
    x = L.Later(lambda a: calls.append(a) or a * 2, 21)
    assert calls == [] and x.result() == 42 and x.result() == 42 and calls == [21]


def test_threads_run_beside_the_caller_and_hand_back_results_and_errors():
    started, go = threading.Event(), threading.Event()

    def waits():
        started.set()
        assert go.wait(10)
        return "done"

    def fails():
        raise ValueError("check failed")

    t = L.Threads(2)
    a, b = t(waits), t(fails)
    assert started.wait(10)  # running while this thread goes on
    go.set()
    assert a.result() == "done"
    with pytest.raises(ValueError, match="check failed"):
        b.result()
    t.settle()
    assert not any(x.t.is_alive() for x in t.started)


def test_at_most_n_run_at_once():
    inside, most, lock, gate = [0], [0], threading.Lock(), threading.Barrier(2, timeout=10)

    def one():
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        gate.wait()  # two at a time meet here; a third would block the barrier's party count
        with lock:
            inside[0] -= 1

    t = L.Threads(2)
    for _ in range(4):
        t(one)
    t.settle()
    assert most[0] == 2


@pytest.mark.parametrize("one_thread,cores,threads", [(True, 8, False), (False, 1, False), (False, 8, True)])
def test_runner_is_one_thread_where_asked_or_on_one_core(monkeypatch, one_thread, cores, threads):
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    assert isinstance(L.runner(one_thread), L.Threads) == threads


def test_value_waits_for_a_later_and_passes_anything_else():
    assert L.value(L.Later(lambda: 3)) == 3 and L.value(5) == 5 and L.value(None) is None
