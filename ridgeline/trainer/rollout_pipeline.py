"""The generation thread of the asynchronous modes (docs/async.md): it generates the batches of
the coming steps while the trainer trains, on a fixed lag.

The rule, for a lag of S steps (`max_staleness_steps`; 1 for one-step off-policy):

* the batch of step j is generated, whole, by policy version `max(v0, j - 1 - S)` (v0: the version
  the engine held when the pipeline started: 0, or the resumed step), and trained at step j:
  staleness `j - 1 - version <= S`, exactly S once the pipeline is full;
* the trainer syncs version v into the engine only once every batch that needs an older version
  (steps <= v + S) is generated, and the thread starts batch v + S + 1 only once version v is in.

So a weight update never lands inside a batch: no group straddles an update, every token's
rollout logprob is the one policy version of its batch, and the version each batch gets is a
function of its step alone, never of timing: a run is reproducible, and a resumed one (given the
batches generated ahead, which the checkpoint keeps) trains exactly what the uninterrupted run did.
The engine waits for an update only as long as the update itself; the trainer waits only when
generation is the slower side (or, for S > 1, for the batch still holding the old weights).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ridgeline.data import PromptRow
from ridgeline.generation.types import GeneratorOutput
from ridgeline.trainer.scheduled import ScheduledBatch

log = logging.getLogger(__name__)

Produce = Callable[[int, list[PromptRow]], tuple[GeneratorOutput, dict[str, float]]]


@dataclass(frozen=True)
class PlannedStep:
    """A training step still to be generated: its number and its prompts' place in the data order."""
    step: int
    position: tuple[int, int]   # (epoch, batch within it)
    rows: list[PromptRow]


class RolloutPipeline:
    """One generation thread over `plan` (in step order), on lag `lag`. `produce(step, rows)` is the
    trainer's `collect_rollout` (generation, truncation policy, dynamic sampling), seeded by the step.
    `ahead` are batches already generated (restored from a checkpoint): the plan starts after them.
    The trainer calls `take(j)` for step j's batch, and `before_sync(v)` / `after_sync(v)` around
    each weight sync."""

    def __init__(self, produce: Produce, plan: list[PlannedStep], lag: int, engine_version: int,
                 ahead: list[ScheduledBatch]):
        self.lag = lag
        self._produce = produce
        self._plan = plan
        self._start_version = engine_version
        self._engine_version = engine_version
        self._ready: dict[int, ScheduledBatch] = {b.step: b for b in ahead}
        steps = [p.step for p in plan] + [b.step for b in ahead]
        self._last_step = max(steps, default=engine_version)
        # every step up to here is generated (restored ones included)
        self._done_through = plan[0].step - 1 if plan else self._last_step
        self._error: BaseException | None = None
        self._stopping = False
        self._cond = threading.Condition()
        # held while a batch is generated: the trainer takes it to use the engine itself (eval), since
        # an engine in this process (the embedded one, vLLM's LLM) is not made for two callers at once
        self.engine_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ridgeline-rollouts", daemon=True)

    def required_version(self, step: int) -> int:
        """The policy version that generates step `step`'s batch."""
        return max(self._start_version, step - 1 - self.lag)

    # -- the generation thread -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            for item in self._plan:
                needed = self.required_version(item.step)
                with self._cond:
                    self._cond.wait_for(lambda: self._stopping or self._engine_version >= needed)
                    if self._stopping:
                        return
                    version = self._engine_version
                if version != needed:  # the sync rule makes this impossible; never train on a guess
                    raise RuntimeError(f"internal: step {item.step}'s batch needs policy version {needed}, the "
                                       f"engine holds {version}")
                with self.engine_lock:
                    start = time.perf_counter()
                    out, metrics = self._produce(item.step, item.rows)
                    seconds = time.perf_counter() - start
                batch = ScheduledBatch(step=item.step, version=version, position=item.position, out=out,
                                       metrics=metrics, generate_seconds=seconds)
                with self._cond:
                    self._ready[item.step] = batch
                    self._done_through = item.step
                    self._cond.notify_all()
        except BaseException as exc:  # handed to the trainer, which raises it in its own thread
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    # -- the trainer's side ----------------------------------------------------------------------
    def _wait(self, ready: Callable[[], bool]) -> None:
        with self._cond:
            self._cond.wait_for(lambda: ready() or self._error is not None)
            if self._error is not None and not ready():
                raise self._error

    def take(self, step: int) -> ScheduledBatch:
        """Step `step`'s batch, once generated (an error of the generation thread is raised here)."""
        self._wait(lambda: step in self._ready)
        with self._cond:
            return self._ready.pop(step)

    def before_sync(self, version: int) -> None:
        """Wait until every batch that needs a version older than `version` is generated: the thread
        is then between batches, waiting for this version (or done)."""
        through = min(version + self.lag, self._last_step)
        self._wait(lambda: self._done_through >= through)

    def after_sync(self, version: int) -> None:
        """The engine now holds `version`: the thread may go on."""
        with self._cond:
            self._engine_version = version
            self._cond.notify_all()

    def ahead_of(self, step: int) -> list[ScheduledBatch]:
        """The generated batches of steps step+1 .. step+lag (what a checkpoint after `step` keeps;
        after `before_sync(step)` they are all there), in step order."""
        with self._cond:
            return [self._ready[s] for s in sorted(self._ready) if step < s <= step + self.lag]

    def stop(self, wait_s: float | None = None) -> None:
        """Stop after the batch in progress (if any); wait for the thread up to `wait_s` (None: until
        it ends). A thread still generating when the wait ends is a daemon: it never holds up exit."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(wait_s)
            if self._thread.is_alive():
                log.warning("the generation thread is still finishing a batch; it is left to end with the process")
