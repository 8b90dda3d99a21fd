"""The asynchronous modes (`trainer.async_mode`, docs/async.md): the same training step as
`Trainer`, with its rollouts generated ahead by a generation thread (`RolloutPipeline`) on a fixed
lag: 1 step for `one_step_off_policy`, `trainer.fully_async.max_staleness_steps` for `fully_async`.

Only three things differ from the synchronous loop: where a step's rollouts come from
(`rollout_for_step`), when the engine takes new weights (`PipelineWeightSync`: between two
generated batches), and what a checkpoint keeps (the batches generated ahead). Eval, trackers,
dynamic sampling (run by the generation thread, per step), multi-turn, exports and resume are the
synchronous loop's own.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Iterator, TYPE_CHECKING

from ridgeline.algorithms.off_policy import corrects_off_policy
from ridgeline.data import PromptRow
from ridgeline.distributed.weight_sync import WeightSync
from ridgeline.errors import UserError
from ridgeline.generation.types import GeneratorOutput
from ridgeline.trainer.rollout_pipeline import PlannedStep, RolloutPipeline
from ridgeline.trainer.scheduled import ScheduledBatch
from ridgeline.trainer.trainer import StepTimer, Trainer

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema import RidgelineConfig

log = logging.getLogger(__name__)


class AsyncModeError(UserError, ValueError):
    """An asynchronous mode asked for with a setting it cannot run with."""


def build_trainer(cfg: RidgelineConfig) -> Trainer:
    """The trainer `trainer.async_mode` asks for: `Trainer` (sync) or `AsyncTrainer`; built, locked,
    resumed (`Trainer.from_config`)."""
    return (Trainer if cfg.trainer.async_mode == "sync" else AsyncTrainer).from_config(cfg)


def staleness_lag(cfg: RidgelineConfig) -> int:
    """Steps a batch is generated ahead of the step that trains it (its exact staleness once the
    pipeline is full)."""
    mode = cfg.trainer.async_mode
    return 1 if mode == "one_step_off_policy" else int(cfg.trainer.fully_async.max_staleness_steps)


class PipelineWeightSync:
    """The run's weight sync, applied only when the generation thread is between batches
    (RolloutPipeline's rule); `async/engine_version` is the version the engine then holds."""

    def __init__(self, inner: WeightSync, pipeline: RolloutPipeline):
        self.inner, self.pipeline = inner, pipeline
        self._ready: tuple[int, float] | None = None   # (version, seconds waited for it)

    def prepare(self, version: int) -> None:
        """Wait until the generation thread has generated every batch of the older weights."""
        start = time.perf_counter()
        self.pipeline.before_sync(version)
        self._ready = (version, time.perf_counter() - start)

    def sync(self, version: int) -> dict[str, float]:
        if self._ready is None or self._ready[0] != version:
            self.prepare(version)
        assert self._ready is not None
        waited, self._ready = self._ready[1], None
        metrics = self.inner.sync(version)
        self.pipeline.after_sync(version)
        return {**metrics, "async/engine_version": float(version), "async/sync_wait_seconds": waited}


def staleness_metrics(batch: ScheduledBatch, max_staleness: int) -> dict[str, float]:
    """SkyRL's `async/staleness_*` over the batch's groups (one version per batch here, so mean = max
    = min), and the share of loss tokens sampled by an older policy than the one trained."""
    groups = len(set(batch.out.uids))
    stale = batch.staleness
    loss_tokens = sum(sum(mask) for mask in batch.out.loss_masks)
    return {
        "async/staleness_mean": float(stale), "async/staleness_max": float(stale),
        "async/staleness_min": float(stale), "async/staleness_ratio": float(stale > 0),
        "async/staleness_violation_count": float(groups if stale > max_staleness else 0),
        "async/policy_version": float(batch.version),
        "async/off_policy_token_frac": float(stale > 0) if loss_tokens else 0.0,
        "async/generate_seconds": batch.generate_seconds,
    }


class AsyncTrainer(Trainer):
    """`Trainer` with its rollouts generated ahead (module docstring)."""

    pipeline: RolloutPipeline | None = None
    pipeline_sync: PipelineWeightSync | None = None

    @property
    def lag(self) -> int:
        return staleness_lag(self.cfg)

    def _train(self) -> dict[str, Any]:
        t = self.cfg.trainer
        if self.colocated:
            raise AsyncModeError(
                f"trainer.async_mode={t.async_mode} generates while the trainer trains, but "
                "trainer.placement.colocate_all=true puts the engines to sleep on the training GPUs while it does. "
                "Fix: trainer.placement.colocate_all=false (engines on GPUs of their own), or trainer.async_mode=sync")
        if self.lag > 0 and not corrects_off_policy(t.algorithm):
            log.warning("trainer.async_mode=%s trains on batches generated up to %d step(s) ago without an off-policy "
                        "correction. Fix: trainer.algorithm.use_tis=true trainer.algorithm.tis_imp_ratio_cap=2.0 "
                        "(the +experiment=fully_async / one_step_off_policy presets set them), or a mask of "
                        "trainer.algorithm.off_policy_correction (docs/algorithms.md)", t.async_mode, self.lag)
        pipeline = self._start_pipeline()
        inner = self.weight_sync
        self.weight_sync = self.pipeline_sync = PipelineWeightSync(inner, pipeline)
        finished = False
        try:
            summary = super()._train()
            finished = True
            return summary
        finally:
            pipeline.stop(wait_s=None if finished else 5.0)  # on an error: never hold up its report
            self.weight_sync, self.pipeline, self.pipeline_sync = inner, None, None

    def _start_pipeline(self) -> RolloutPipeline:
        """The generation thread over the steps still to train, after the batches the checkpoint
        kept (those that still meet the staleness bound: a changed bound regenerates them)."""
        step = self.run.global_step
        plan = [PlannedStep(step + i, (epoch, batch), rows)
                for i, (epoch, batch, rows) in enumerate(self._remaining_batches(), start=1)]
        ahead = self.run.rollouts_ahead
        expected = [(p.step, p.position) for p in plan[:len(ahead)]]
        if [(b.step, b.position) for b in ahead] != expected or any(b.staleness > self.lag for b in ahead):
            if ahead:
                log.warning("the checkpoint's %d batch(es) generated ahead do not fit this run (another "
                            "trainer.async_mode or staleness bound): they are generated again", len(ahead))
            ahead = []
        self.run.rollouts_ahead = []
        pipeline = RolloutPipeline(self._produce, plan[len(ahead):], self.lag, engine_version=step, ahead=ahead)
        log.info("trainer.async_mode=%s: batches generated %d step(s) ahead of training by a generation thread%s",
                 self.cfg.trainer.async_mode, self.lag,
                 f" ({len(ahead)} restored from the checkpoint)" if ahead else "")
        self.pipeline = pipeline
        pipeline.start()
        return pipeline

    def _produce(self, step: int, rows: list[PromptRow]) -> tuple[GeneratorOutput, dict[str, float]]:
        return self.collect_rollout(rows, step)

    def rollout_for_step(self, rows: list[PromptRow]) -> tuple[GeneratorOutput, dict[str, float]]:
        """Step `global_step`'s batch from the generation thread, with the staleness metrics and the
        trainer's wait for it (SkyRL's `timing/wait_for_generation_buffer`)."""
        assert self.pipeline is not None, "rollout_for_step runs inside _train"
        start = time.perf_counter()
        batch = self.pipeline.take(self.run.global_step)
        if batch.position != self.run.data_position:  # both walk one order; never train another batch
            raise RuntimeError(f"internal: step {self.run.global_step} got the batch at {batch.position}, the data "
                               f"order is at {self.run.data_position}")
        metrics = dict(batch.metrics)
        metrics.update(staleness_metrics(batch, self.lag))
        metrics["timing/wait_for_generation_buffer"] = time.perf_counter() - start
        return batch.out, metrics

    @contextlib.contextmanager
    def _weights_changing(self) -> Iterator[None]:
        """Wait for the generation thread's batch on the old weights first, then hold the HTTP
        endpoint's requests only for the sync itself."""
        assert self.pipeline_sync is not None, "weights change inside _train"
        self.pipeline_sync.prepare(self.run.global_step)
        with super()._weights_changing():
            yield

    def evaluate(self) -> dict[str, float]:
        """The synchronous eval, once the generation thread is between batches (the engine is
        one caller's at a time); the engine holds the current policy then."""
        if self.pipeline is None:
            return super().evaluate()
        with self.pipeline.engine_lock:
            return super().evaluate()

    def save_checkpoint(self, timer: StepTimer | None = None):
        """The synchronous checkpoint, plus the batches generated for the next `lag` steps."""
        self.run.rollouts_ahead = self.pipeline.ahead_of(self.run.global_step) if self.pipeline else []
        try:
            return super().save_checkpoint(timer)
        finally:
            self.run.rollouts_ahead = []
