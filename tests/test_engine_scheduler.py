"""The engine loop of the servers (ridgeline.inference.scheduler), with plain stepped work: shared
work interleaves step by step, exclusive work runs alone and in arrival order, the queue is
bounded, deadlines hold for queued and running work, closing fails what is left."""

from __future__ import annotations

import threading
import time

import pytest

from conftest import in_thread
from ridgeline.inference.scheduler import EngineScheduler, RequestTimedOut, ServerBusy, single_step


def _wait_for(predicate, timeout_s: float = 300.0) -> None:
    """Poll for a state the test's own events make certain; the limit only keeps a bug from hanging."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def _counting(name: str, steps: int, log: list[str], pause_s: float = 0.0):
    """Stepped work that logs each of its steps and returns its name."""
    def start():
        for i in range(steps):
            log.append(f"{name}{i}")
            time.sleep(pause_s)
            yield
        return name
    return start


def test_shared_work_takes_turns_step_by_step_and_returns_its_result():
    sched = EngineScheduler(max_running=4, max_queued=8, timeout_s=30)
    log: list[str] = []
    gate = threading.Event()

    def gated():  # holds the loop until both jobs are queued, so they start together
        gate.wait()
        return "gate"
        yield

    try:
        threads = [in_thread(lambda: sched.shared(gated, "gate"))]
        _wait_for(lambda: sched.load == (1, 0))
        threads += [in_thread(lambda: sched.shared(_counting("a", 3, log), "a")),
                    in_thread(lambda: sched.shared(_counting("b", 3, log), "b"))]
        _wait_for(lambda: sched.load[1] == 2)
        gate.set()
        for thread, _ in threads:
            thread.join()
        assert [box[0] for _, box in threads] == [("ok", "gate"), ("ok", "a"), ("ok", "b")]
        assert log == ["a0", "b0", "a1", "b1", "a2", "b2"]  # round robin, one step each
        assert sched.shared(lambda: single_step(lambda: 7), "one step") == 7
    finally:
        sched.close()


def test_exclusive_work_waits_for_running_work_and_later_work_waits_for_it():
    sched = EngineScheduler(max_running=4, max_queued=8, timeout_s=300)
    log: list[str] = []
    go = threading.Event()

    def long():  # held at its third step until the others are queued: the order cannot depend on timing
        for i in range(20):
            log.append(f"L{i}")
            if i == 2:
                go.wait()
            yield
        return "L"

    try:
        first, long_box = in_thread(lambda: sched.shared(long, "long"))
        _wait_for(lambda: len(log) >= 3)
        excl, excl_box = in_thread(lambda: sched.exclusive(lambda: log.append("X") or "x", "exclusive"))
        _wait_for(lambda: sched.load[1] == 1)
        later, later_box = in_thread(lambda: sched.shared(_counting("S", 1, log), "later"))
        _wait_for(lambda: sched.load[1] == 2)
        go.set()
        for thread in (first, excl, later):
            thread.join()
        assert (long_box, excl_box, later_box) == ([("ok", "L")], [("ok", "x")], [("ok", "S")])
        assert log == [f"L{i}" for i in range(20)] + ["X", "S0"]
    finally:
        go.set()
        sched.close()


def test_a_full_queue_refuses_at_once():
    sched = EngineScheduler(max_running=1, max_queued=1, timeout_s=30)
    stop = threading.Event()

    def endless():
        while not stop.is_set():
            time.sleep(0.005)
            yield

    try:
        running, _ = in_thread(lambda: sched.shared(endless, "running"))
        _wait_for(lambda: sched.load == (1, 0))
        queued, _ = in_thread(lambda: sched.shared(endless, "queued"))
        _wait_for(lambda: sched.load == (1, 1))
        # refused, not queued: a queued request would end in RequestTimedOut after 30 s instead
        with pytest.raises(ServerBusy, match=r"1 requests are already waiting .*--max-queued-requests 1"):
            sched.shared(endless, "third")
    finally:
        stop.set()
        sched.close()


def test_deadlines_hold_for_running_and_queued_work():
    """Ordered by events, not by the clock: the running generation is held inside its first step
    (the loop cannot admit anything else), so the second request is queued for certain and its
    caller's deadline passes while it waits; once released, the running one meets its own deadline
    (long past by then) at its next step. A loaded machine only makes this slower, never different."""
    sched = EngineScheduler(max_running=1, max_queued=4, timeout_s=0.5)
    started, release = threading.Event(), threading.Event()

    def held():
        started.set()
        release.wait()
        while True:
            yield

    try:
        running, running_box = in_thread(lambda: sched.shared(held, "a long generation"))
        assert started.wait(60)
        queued, queued_box = in_thread(lambda: sched.shared(held, "a queued one"))
        queued.join()  # its caller gives up at its deadline: the loop is still inside the first step
        kind, error = queued_box[0]
        assert kind == "error" and isinstance(error, RequestTimedOut) and "waiting for the engine" in str(error)
        assert sched.load == (1, 0)  # dropped from the queue, not left for the loop
        release.set()
        running.join()
        kind, error = running_box[0]
        assert kind == "error" and isinstance(error, RequestTimedOut)
        assert "a long generation ran past its deadline of 0.5s (running; --request-timeout)" in str(error)
        assert sched.shared(lambda: single_step(lambda: "fine"), "next") == "fine"  # the loop goes on
    finally:
        release.set()
        sched.close()


def test_errors_reach_their_caller_and_close_fails_what_is_left():
    sched = EngineScheduler(max_running=2, max_queued=4, timeout_s=30)

    def broken():
        yield
        raise ValueError("engine said no")

    with pytest.raises(ValueError, match="engine said no"):
        sched.shared(broken, "broken")
    with pytest.raises(KeyError):
        sched.exclusive(lambda: {}["missing"], "broken exclusive")

    def endless():
        while True:
            time.sleep(0.01)
            yield

    thread, box = in_thread(lambda: sched.shared(endless, "endless"))
    _wait_for(lambda: sched.load == (1, 0))
    sched.close()
    thread.join()
    assert box[0][0] == "error" and "shut down" in str(box[0][1])
    with pytest.raises(RuntimeError, match="shutting down"):
        sched.shared(endless, "after close")
