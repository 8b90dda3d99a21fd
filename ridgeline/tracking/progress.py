"""Progress bars that appear only for a person watching a terminal (drawn with rich, on stderr).

    with run_progress(total=20, done=0) as steps:        # the run's one overall bar: step 7/20, ETA
        for step in ...:
            with progress(total=len(batches), desc="generate") as bar:   # a bar under it, while it lasts
                for batch in batches:
                    bar.update()
            steps.update(reward=0.42)

A bar is drawn when stderr is a terminal. In a log file, a CI job or a test a loop that runs
longer than `STEP_LOG_EVERY_S` logs a line instead (`generate 310/1024 (30%), 4m05s elapsed, ETA
9m30s`) at most that often, so a long eval written to a file still shows it is moving; short loops
write nothing. `RIDGELINE_PROGRESS=1` forces bars on, `RIDGELINE_PROGRESS=0` forces them off. The
returned object counts updates either way.

All bars open at one time share one display at the bottom of the terminal: the first bar opened
starts it, bars opened meanwhile (from any thread) join it as lines of their own. While it is up,
what the process prints (the console table) and logs goes above it instead of breaking its line.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TextIO

ENV_VAR = "RIDGELINE_PROGRESS"
_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")
# the ETA averages the speed over this many seconds: RL steps take seconds to minutes each, and
# rich's default of 30 s would estimate from one or two of them
ETA_WINDOW_S = 3600.0
# off a terminal the run's progress is a log line at most this often (and at the last step)
STEP_LOG_EVERY_S = 30.0
_log = logging.getLogger("ridgeline.progress")


def progress_enabled(stream: TextIO | None = None) -> bool:
    """Whether bars are drawn on `stream` (stderr by default): `RIDGELINE_PROGRESS` decides when
    set to a yes/no value, else whether the stream is a terminal."""
    setting = os.environ.get(ENV_VAR, "").strip().lower()
    if setting in _ON:
        return True
    if setting in _OFF:
        return False
    stream = stream or sys.stderr
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Progress:
    """A counter, with a line of the shared display attached when bars are on."""

    def __init__(self, total: int | None, display: "_Display | None" = None, task: Any = None):
        self.total = total
        self.n = 0
        self._display = display
        self._task = task

    @property
    def visible(self) -> bool:
        return self._display is not None

    def update(self, n: int = 1, **values: Any) -> None:
        """Count `n` more done; `values` (e.g. reward=0.42) are shown after the bar."""
        self.n += n
        self._show(n, values)

    def set_postfix(self, **values: Any) -> None:
        """Short live values after the bar (e.g. reward=0.42); ignored when no bar is drawn."""
        self._show(0, values)

    def _show(self, advance: int, values: dict[str, Any]) -> None:
        if self._display is None:
            return
        if values:  # no values leave the shown ones as they are
            self._display.bars.update(self._task, advance=advance, postfix=_postfix(values))
        else:
            self._display.bars.update(self._task, advance=advance)


def _postfix(values: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items() if v is not None)


class _Display:
    """One rich `Progress` (a live display on `stream`) with the bars open now; stdout, stderr and
    the logging handlers writing to them go above it while it is up."""

    def __init__(self, stream: TextIO):
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        console = Console(file=stream, force_terminal=True)
        self.bars = RichProgress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[postfix]}"),
            console=console, refresh_per_second=4, speed_estimate_period=ETA_WINDOW_S,
            # stdout goes above the bar only when it is this terminal too: `ridgeline train > log`
            # keeps the console table in the file
            redirect_stdout=sys.stdout.isatty(), redirect_stderr=True, transient=False)
        self.users = 0
        self._handlers: list[tuple[logging.StreamHandler, TextIO]] = []

    def start(self) -> None:
        real = (sys.stdout, sys.stderr)
        self.bars.start()  # from here sys.stdout / sys.stderr write above the display
        # log handlers keep the stream they were given (logging.basicConfig's stderr): point them
        # at the redirected one while the display is up
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in real:
                old = handler.setStream(sys.stderr if handler.stream is real[1] else sys.stdout)
                if old is not None:  # None: the handler had that stream already
                    self._handlers.append((handler, old))

    def stop(self) -> None:
        for handler, old in self._handlers:
            handler.setStream(old)
        self._handlers.clear()
        self.bars.stop()


_lock = threading.Lock()
_display: _Display | None = None


@contextmanager
def progress(total: int | None, desc: str = "", *, leave: bool = False, done: int = 0,
             stream: TextIO | None = None) -> Iterator[Progress]:
    """A `Progress` for a loop of `total` items (None when unknown), `done` of them done before
    (they do not count towards the speed). `leave=False` removes the bar when done, right for the
    inner loops of a step; pass `leave=True` to keep its last state on screen."""
    stream = stream or sys.stderr
    if not progress_enabled(stream):
        # off a terminal: a line now and then for a loop that takes long, none for a short one
        yield StepLog(total, done, STEP_LOG_EVERY_S, desc=desc or "progress", first_after_s=STEP_LOG_EVERY_S)
        return
    global _display
    with _lock:
        display = _display
        if display is None:
            display = _display = _Display(stream)
            display.start()
        display.users += 1
        task = display.bars.add_task(desc, total=total, completed=done, postfix="")
    counter = Progress(total, display, task)
    counter.n = done
    try:
        yield counter
    finally:
        with _lock:
            if not leave:
                display.bars.remove_task(task)
            display.users -= 1
            if display.users == 0:
                display.stop()
                _display = None


@contextmanager
def run_progress(total: int, done: int = 0, desc: str = "step", *, stream: TextIO | None = None,
                 log_every_s: float = STEP_LOG_EVERY_S) -> Iterator[Progress]:
    """The run's overall bar: `done` of `total` steps at the start (a resumed run), the elapsed
    time and the ETA from the steps done since; it stays on screen at the end. Off a terminal (a
    log file, a job) the same figures are logged as a line (`step_line`) at most every
    `log_every_s` seconds, and at the last step."""
    if progress_enabled(stream or sys.stderr):
        with progress(total, desc, leave=True, done=done, stream=stream) as bar:
            yield bar
    else:
        yield StepLog(total, done, log_every_s, desc=desc)


def step_line(done: int, total: int, elapsed_s: float, timed_steps: int, desc: str = "step") -> str:
    """`step 7/20 (35%), 1m02s elapsed, ETA 2m00s`: the ETA is the steps left at the mean time of
    the `timed_steps` steps taken in `elapsed_s` (unknown before the first)."""
    eta = _duration((total - done) * elapsed_s / timed_steps) if timed_steps else "?"
    return f"{desc} {done}/{total} ({100 * done // max(total, 1)}%), {_duration(elapsed_s)} elapsed, ETA {eta}"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class StepLog(Progress):
    """A bar where no bar is drawn: `step_line` logged (logger `ridgeline.progress`) at most every
    `every_s` seconds and at the last update. `first_after_s`: nothing before that much time has
    passed, so a loop that ends quickly writes nothing (0: the first update is logged, as the run's
    steps are)."""

    def __init__(self, total: int | None, done: int, every_s: float, clock: Callable[[], float] | None = None,
                 *, desc: str = "step", first_after_s: float = 0.0):
        super().__init__(total)
        self.n = self._first = done
        self._every_s, self._clock, self._desc = every_s, clock or time.monotonic, desc
        self._start = self._clock()
        self._quiet_until = self._start + first_after_s
        self._last: float | None = None

    def update(self, n: int = 1, **values: Any) -> None:
        super().update(n, **values)
        now = self._clock()
        if now < self._quiet_until:
            return
        finished = self.total is not None and self.n >= self.total
        if self._last is None or now - self._last >= self._every_s or finished:
            self._last = now
            _log.info(step_line(self.n, self.total or self.n, now - self._start, self.n - self._first, self._desc))
