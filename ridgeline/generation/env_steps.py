"""Run many environment calls at once, each under a time limit, never letting one take the run down.

Environment code is user code: it may raise, return junk, or hang (a slow SQL query, a stuck
sandbox, an infinite loop in a reward function). Calls run concurrently on a pool of `max_workers`
daemon threads that lives as long as the runner; a call that raises (anything but
KeyboardInterrupt), returns an output that fails its checks (`EnvOutputError`) or passes its time
limit becomes an `EnvCallFailure`, which the generator counts (and, for `init` and `step`, scores
0). A thread cannot be killed, so a timed-out call keeps running until it returns by itself: its
thread leaves the pool (a fresh one takes its place, so stuck calls never eat into `max_workers`),
the number of such stragglers is reported, and being a daemon thread it cannot keep the process
from exiting.

What a timeout cannot stop: a call that holds the GIL (a regular expression with catastrophic
backtracking, a long pure-C loop) keeps every other thread, this runner's included, from running
until it returns. That is why the parsers of model text in `ridgeline.envs` run in linear time.

Why not `concurrent.futures.ThreadPoolExecutor`: its threads are joined at interpreter exit (one
hung reward function would hang the process at the end of training) and a stuck call keeps its
worker. Why a pool rather than a thread per call: starting 64 threads and an asyncio loop cost
~9 ms a step for a one-line reward, a tenth of a tiny model's whole rollout.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ridgeline.envs.base import EnvOutputError, exception_text
from ridgeline.tracking.progress import progress

T = TypeVar("T")


@dataclass(frozen=True)
class EnvCallFailure:
    """Why an environment call produced no result."""

    kind: str          # "error" | "timeout" | "bad_output"
    message: str       # one line
    details: str = ""  # the traceback (the env's own frames), for the log
    field: str = ""    # bad_output: the part of the output that failed its check (EnvOutputError.field)


@dataclass(eq=False)
class _Job:
    call: Callable[[], Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    started: float | None = None   # time.monotonic() when a worker picked it up
    abandoned: bool = False        # timed out: the result is no longer wanted


class EnvRunner:
    """`run(calls)` -> results in order; each call is a zero-argument function.

    max_workers: calls in flight at once; 0 runs them one by one in the caller's thread (no time
    limit can then be enforced). timeout_s: per call, counted from when it starts running.
    """

    def __init__(self, max_workers: int = 10, timeout_s: float | None = 60.0):
        if max_workers < 0:
            raise ValueError(f"max_workers must be >= 0, got {max_workers}")
        self.max_workers = max_workers
        self.timeout_s = timeout_s if timeout_s and timeout_s > 0 else None
        self._stragglers = 0
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._workers = 0   # healthy pool threads started so far (created on first use)

    @property
    def stragglers(self) -> int:
        """Timed-out calls whose thread is still running."""
        return self._stragglers

    def run(self, calls: Sequence[Callable[[], T]], desc: str = "env steps") -> list[T | EnvCallFailure]:
        with progress(len(calls), desc) as bar:
            if self.max_workers == 0:
                results = []
                for call in calls:
                    results.append(_guarded(call))
                    bar.update()
                return results
            self._fill_pool()
            jobs = [_Job(call) for call in calls]
            for job in jobs:
                self._queue.put(job)
            out: dict[_Job, T | EnvCallFailure] = {}
            waiting = {job.future: job for job in jobs}
            while waiting:
                done, _ = concurrent.futures.wait(waiting, timeout=self._next_deadline(waiting.values()),
                                                  return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    out[waiting.pop(future)] = future.result()
                    bar.update()
                for job in self._expire(waiting.values()):
                    del waiting[job.future]
                    out[job] = EnvCallFailure("timeout", f"no result after {self.timeout_s:g} s "
                                                         "(environment.step_timeout_s)")
                    bar.update()
            return [out[job] for job in jobs]

    def _next_deadline(self, jobs: Any) -> float | None:
        """Seconds until the earliest running call's limit; a call not yet started cannot run out
        before one full limit from now, so that bounds the wait too."""
        if self.timeout_s is None:
            return None
        now = time.monotonic()
        limits = [job.started + self.timeout_s - now for job in jobs if job.started is not None]
        return max(0.0, min(limits, default=self.timeout_s))

    def _expire(self, jobs: Any) -> list[_Job]:
        """Abandon running calls past their limit; each one's thread is replaced in the pool."""
        if self.timeout_s is None:
            return []
        now, expired = time.monotonic(), []
        for job in list(jobs):
            if job.started is None or now - job.started < self.timeout_s:
                continue
            with self._lock:
                if job.future.done():   # finished just now: the next wait collects it
                    continue
                job.abandoned = True
                self._stragglers += 1
                self._workers -= 1
            expired.append(job)
        if expired:
            self._fill_pool()
        return expired

    def _fill_pool(self) -> None:
        with self._lock:
            missing = self.max_workers - self._workers
            self._workers += max(0, missing)
        for _ in range(missing):
            threading.Thread(target=self._work, name="ridgeline-env", daemon=True).start()

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            job.started = time.monotonic()
            result = _guarded(job.call)
            with self._lock:
                if job.abandoned:   # its replacement already serves the queue: this thread ends
                    self._stragglers -= 1
                    return
                job.future.set_result(result)


DETAILS_LIMIT = 20_000   # characters of a traceback kept for the log


def _guarded(call: Callable[[], T]) -> T | EnvCallFailure:
    start = time.perf_counter()
    try:
        return call()
    except KeyboardInterrupt:   # only the main thread gets one (max_workers=0): the user stops the run
        raise
    except EnvOutputError as exc:
        field = exc.field[:40] if isinstance(exc.field, str) else "type"   # a log key: hashable and short
        return EnvCallFailure("bad_output", exception_text(exc, 600, with_type=False), field=field)
    except BaseException as exc:  # user code: anything may come out of it (SystemExit, a BaseException subclass)
        details = _user_traceback(exc)
        if len(details) > DETAILS_LIMIT:
            details = f"{details[:DETAILS_LIMIT // 2]}\n... [{len(details) - DETAILS_LIMIT} characters]\n" \
                      f"{details[-DETAILS_LIMIT // 2:]}"
        return EnvCallFailure("error", f"{exception_text(exc)} (after {time.perf_counter() - start:.2f} s)", details)


_PACKAGE = str(Path(__file__).resolve().parents[1])   # ridgeline/


def _user_traceback(exc: BaseException) -> str:
    """Where the env's own code raised: the traceback without Ridgeline's frames (the generator's
    call into the env is the same every time), or the whole one when Ridgeline's own env raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    theirs = [f for f in frames if not str(Path(f.filename).resolve()).startswith(_PACKAGE)]
    if not theirs:
        return "".join(traceback.format_exception(exc))
    return ("in the environment's code:\n" + "".join(traceback.format_list(theirs))
            + "".join(traceback.format_exception_only(exc)))
