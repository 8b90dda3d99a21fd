"""The Tinker API's futures: every training, weight and sampling call is queued and answered with a
request id; the client polls `/api/v1/retrieve_future` until the result is there.

One worker thread runs the queue in arrival order (the SDK sends a training client's calls in its
own order, one at a time, so arrival order is that order), so model work never overlaps on the
CPU. A poll waits on the request's event for up to `poll_wait_s`, then answers "try again" (HTTP
408): the client asks again at once, and no poll sleeps on the clock. Finished results stay readable (a
client may ask twice), at most `keep_done` of them: the oldest go first.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from ridgeline.inference.request_fields import RequestError
from ridgeline.inference.scheduler import ServerBusy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Result:
    """A finished request: a JSON object, protobuf bytes, or a failure (`category`: the SDK's
    RequestErrorCategory, "user" for bad input, "server" for a bug)."""

    json: dict | None = None
    proto: bytes | None = None
    error: str | None = None
    category: str = "user"


@dataclass
class _Pending:
    done: threading.Event
    result: Result | None = None


class FutureStore:
    def __init__(self, *, max_queued: int, keep_done: int = 4096, poll_wait_s: float = 40.0):
        self.poll_wait_s, self.keep_done = poll_wait_s, keep_done
        self._queue: queue.Queue[tuple[_Pending, Callable[[], Result]] | None] = queue.Queue(maxsize=max_queued)
        self._requests: OrderedDict[str, _Pending] = OrderedDict()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name="tinker-work", daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], Result]) -> str:
        """Queue `work`; its request id. ServerBusy (503) when the queue is full."""
        pending = _Pending(threading.Event())
        try:
            self._queue.put_nowait((pending, work))
        except queue.Full:
            raise ServerBusy(f"{self._queue.maxsize} requests are queued already (--max-queued-requests); "
                             "try again later") from None
        request_id = f"req-{next(self._ids)}"
        with self._lock:
            self._requests[request_id] = pending
        return request_id

    def done(self, result: Result) -> str:
        """A request answered at once (no model work): its id, already finished."""
        pending = _Pending(threading.Event(), result)
        pending.done.set()
        request_id = f"req-{next(self._ids)}"
        with self._lock:
            self._requests[request_id] = pending
        return request_id

    def wait(self, request_id: str) -> Result | None:
        """The result of `request_id`, waiting up to `poll_wait_s`; None while it runs."""
        with self._lock:
            pending = self._requests.get(request_id)
        if pending is None:
            raise RequestError(f"request_id {request_id!r} is not a request of this server (or its result was "
                               f"dropped: the server keeps the last {self.keep_done})", "request_id")
        if not pending.done.wait(self.poll_wait_s):
            return None
        return pending.result

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            pending, work = item
            try:
                pending.result = work()
            except RequestError as e:
                pending.result = Result(error=str(e), category="user")
            except Exception as e:  # noqa: BLE001 - the client gets the failure instead of a hung future
                log.exception("tinker request failed")
                pending.result = Result(error=f"{type(e).__name__}: {e}", category="server")
            pending.done.set()
            self._forget_old()

    def _forget_old(self) -> None:
        with self._lock:
            done = [rid for rid, p in self._requests.items() if p.done.is_set()]
            for rid in done[:max(0, len(done) - self.keep_done)]:
                del self._requests[rid]
