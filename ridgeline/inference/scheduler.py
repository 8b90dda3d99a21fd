"""The engine loop of an HTTP server: one thread makes every engine call, so that one long request
cannot hold the others and a weight change never lands inside a generation.

- Shared work (generation, scoring) is stepped work (`types.Steps`): up to `max_running` requests
  run at once, the loop advancing each by one engine step in turn (round robin). The embedded
  engine's step is one forward pass of the request's batch, so a short request finishes after its
  own few steps however long the others are. Requests are not merged into one batch across
  requests (vLLM's and SGLang's continuous batching): under load the engine does the same work
  as serially, but no request waits for another to end.
- Exclusive work (loading weights, sleep / wake, cache flush) runs alone: it waits for the
  running requests to end, and requests that arrive after it wait for it (first come, first served).
- The queue is bounded (`max_queued`: beyond it a request is refused at once, `ServerBusy`), and
  every request has a deadline (`timeout_s` from its arrival): past it a queued request is dropped
  at once, a running generation at its next step, and fails with `RequestTimedOut` (exclusive work
  that has started runs to its end).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from ridgeline.inference.types import Steps

log = logging.getLogger(__name__)

T = TypeVar("T")


class ServerBusy(RuntimeError):
    """The queue is full (answered 503)."""


class RequestTimedOut(RuntimeError):
    """A request ran past its deadline (answered 503)."""


def single_step(call: Callable[[], T]) -> Steps[T]:
    """Work the engine cannot split (an engine without stepped generation, a scoring forward), as
    one step."""
    return call()
    yield  # noqa: unreachable - makes this function a generator


@dataclass(eq=False)
class _Job:
    what: str
    deadline: float
    start: Callable[[], Steps[Any]] | None = None   # shared work
    call: Callable[[], Any] | None = None           # exclusive work
    steps: Steps[Any] | None = None
    result: Any = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        if self.steps is not None:
            self.steps.close()  # a generator left mid-way releases what it holds
        self.result, self.error = result, error
        self.done.set()


class EngineScheduler:
    """See the module docstring. `shared` / `exclusive` block the calling thread until the work is
    done and return its result (or raise its error); `close` fails what is queued or running."""

    def __init__(self, *, max_running: int, max_queued: int, timeout_s: float, name: str = "ridgeline-engine"):
        if max_running < 1 or max_queued < 1 or timeout_s <= 0:
            raise ValueError(f"max_running={max_running}, max_queued={max_queued} must be >= 1 and "
                             f"timeout_s={timeout_s} > 0")
        self.max_running, self.max_queued, self.timeout_s = max_running, max_queued, timeout_s
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._running: list[_Job] = []
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def shared(self, start: Callable[[], Steps[T]], what: str) -> T:
        """Run the stepped work `start()` makes, interleaved with other shared work."""
        return self._submit(_Job(what, time.monotonic() + self.timeout_s, start=start))

    def exclusive(self, call: Callable[[], T], what: str) -> T:
        """Run `call()` with nothing else on the engine."""
        return self._submit(_Job(what, time.monotonic() + self.timeout_s, call=call))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    @property
    def load(self) -> tuple[int, int]:
        """(running, queued) right now."""
        with self._cond:
            return len(self._running), len(self._queue)

    # -- the callers' side ---------------------------------------------------------------------
    def _submit(self, job: _Job) -> Any:
        with self._cond:
            if self._closed:
                raise RuntimeError("the server is shutting down")
            if len(self._queue) >= self.max_queued:
                raise ServerBusy(f"{len(self._queue)} requests are already waiting for the engine "
                                 f"(--max-queued-requests {self.max_queued}); retry later")
            self._queue.append(job)
            self._cond.notify_all()
        # the caller keeps the deadline of queued work: the loop may be busy with a long step
        if not job.done.wait(max(0.0, job.deadline - time.monotonic())):
            with self._cond:
                if job in self._queue:
                    self._queue.remove(job)
                    job.finish(error=self._timed_out(job, "waiting for the engine"))
            job.done.wait()  # running: shared work stops at its next step, exclusive work ends
        if job.error is not None:
            raise job.error
        return job.result

    # -- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                ready = self._ready_exclusive()  # admits shared work first
                while not self._closed and not ready and not self._running:
                    self._cond.wait()
                    ready = self._ready_exclusive()
                if self._closed:
                    self._fail_all(RuntimeError("the server shut down before this request was done"))
                    return
                exclusive = self._queue.popleft() if ready else None
                running = list(self._running)
            if exclusive is not None:
                self._run_exclusive(exclusive)
                continue
            for job in running:
                self._step(job)

    def _ready_exclusive(self) -> bool:
        """Called with the lock held: admit shared work at the head of the queue while there is
        room; whether exclusive work heads the queue with nothing running."""
        while self._queue and self._queue[0].start is not None and len(self._running) < self.max_running:
            self._running.append(self._queue.popleft())
        return bool(self._queue) and self._queue[0].call is not None and not self._running

    def _run_exclusive(self, job: _Job) -> None:
        try:
            if job.call is None:  # queued as shared work: the loop never hands it here
                raise RuntimeError(f"{job.what}: not exclusive work")
            job.finish(result=job.call())
        except Exception as e:  # noqa: BLE001 - the caller gets the error
            job.finish(error=e)

    def _step(self, job: _Job) -> None:
        """Advance one shared job by one step (starting it on its first)."""
        if time.monotonic() > job.deadline:
            return self._retire(job, error=self._timed_out(job, "running"))
        try:
            if job.steps is None:
                if job.start is None:  # queued as exclusive work: the loop never hands it here
                    raise RuntimeError(f"{job.what}: not shared work")
                job.steps = job.start()
            next(job.steps)
        except StopIteration as end:
            job.steps = None  # finished: nothing to close
            self._retire(job, result=end.value)
        except Exception as e:  # noqa: BLE001 - the caller gets the error
            job.steps = None
            self._retire(job, error=e)

    def _retire(self, job: _Job, result: Any = None, error: BaseException | None = None) -> None:
        with self._cond:
            self._running.remove(job)
        job.finish(result, error)

    def _timed_out(self, job: _Job, state: str) -> RequestTimedOut:
        return RequestTimedOut(f"{job.what} ran past its deadline of {self.timeout_s:g}s ({state}; "
                               "--request-timeout)")

    def _fail_all(self, error: BaseException) -> None:
        for job in [*self._running, *self._queue]:
            job.finish(error=error)
        self._running.clear()
        self._queue.clear()
