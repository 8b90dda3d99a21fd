"""The training loop of one process (`trainer.strategy=single`), DESIGN.md's steps in order:

    generate -> reward -> old / ref logprobs -> advantages -> policy update -> weight sync
    (+ eval before training and every `eval_interval` steps, metrics every step, final model;
    after a step: reference refresh at an epoch's end, exports, checkpoints)

`Trainer.from_config` composes the parts from small builders (and resumes from a checkpoint when
`trainer.resume_mode` finds one); `Trainer.train()` runs the loop. The trainer owns the run's
state (`RunState`) and talks to its workers through `ridgeline.training.protocols`: local workers
on `trainer.device`, or FSDP2 rank groups on Ray. The checkpointer (ridgeline.trainer.checkpoint,
docs/checkpointing.md) owns the file format; Ctrl-C handling lives here.
"""

from __future__ import annotations

import dataclasses
import contextlib
import logging
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TYPE_CHECKING, TypeVar

import torch
from transformers import PreTrainedTokenizerBase

from ridgeline.config.loader import save_config
from ridgeline.allocator import active_allocator
from ridgeline.algorithms import load_algorithm_modules
from ridgeline.algorithms.kl_control import KLController, build_kl_controller, kl_penalized_rewards
from ridgeline.algorithms.reward_shaping import RunningRewardStd
from ridgeline.data import DatasetError, PromptDataset, PromptRow
from ridgeline.distributed.ray_calls import LostWorkerError
from ridgeline.distributed.weight_sync import InProcessWeightSync, RemoteWeightSync, WeightSync, probe_logprobs
from ridgeline.generation.generator import Generator
from ridgeline.generation.step_wise import training_samples
from ridgeline.generation.truncation import apply_truncation_policy
from ridgeline.generation.types import GeneratorInput, GeneratorOutput
from ridgeline.inference.build import build_engine
from ridgeline.inference.endpoint import EndpointSettings, HttpEndpoint, check_address
from ridgeline.inference.remote import RemoteEngine
from ridgeline.inference.types import InferenceEngine, SamplingParams
from ridgeline.models.device import memory_metrics, use_device
from ridgeline.models.loading import configure_chat_template, load_tokenizer, model_config
from ridgeline.seeding import derive_seed
from ridgeline.tracking.plot import plot_rewards
from ridgeline.tracking.dumps import DumpOwner, dump_training_batch, eval_dump_folder
from ridgeline.tracking.report import write_report
from ridgeline.tracking.progress import run_progress
from ridgeline.tracking.run_info import RunInfo
from ridgeline.tracking.samples import write_samples
from ridgeline.tracking.trackers import Tracker, build_trackers, disabled_trackers
from ridgeline.trainer import checkpoint
from ridgeline.trainer.checkpoint import Checkpointer
from ridgeline.trainer.builders import (build_critic, build_generator, build_policy_worker, build_ref_worker,
                                        check_environments, check_model_paths, generator_input, load_environments,
                                        policy_spec,
                                        prepare_data, seed_everything, training_autocast_dtype,
                                        training_precision, truncation_policy)
from ridgeline.trainer.dynamic_sampling import (filter_rollout, first_groups, mask_signal_less_groups, num_groups,
                                               replace_rollout)
from ridgeline.trainer.advantages import compute_advantages
from ridgeline.trainer.evaluation import run_eval
from ridgeline.trainer.metrics import reward_metrics, rollout_metrics
from ridgeline.trainer.run_lock import RunLock, run_folders
from ridgeline.trainer.run_record import start_run_info
from ridgeline.trainer.state import AlgorithmState, RunState
from ridgeline.training.batch import TrainingBatch, build_training_batch
from ridgeline.training.memory_estimate import check_memory
from ridgeline.training.protocols import Workers
from ridgeline.training.worker import NonFiniteLossError

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema import RidgelineConfig

log = logging.getLogger(__name__)


@dataclass
class StepTimer:
    seconds: dict[str, float]

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


T = TypeVar("T")


def planned_steps(steps_per_epoch: int, epochs: int, max_steps: int | None,
                  max_training_steps: int | None = None) -> int:
    """The steps a run trains: `trainer.max_steps` when set, else `epochs` x `steps_per_epoch`, capped
    at SkyRL 0.4's `trainer.max_training_steps` when that is set."""
    if max_steps is not None:
        return max_steps
    planned = steps_per_epoch * epochs
    return planned if max_training_steps is None else min(planned, max_training_steps)


def batches_from(position: tuple[int, int], steps_left: int,
                 epoch_batches: Callable[[int, int], Iterable[T]]) -> Iterator[tuple[int, int, T]]:
    """(epoch, batch index within the epoch, batch) for the next `steps_left` steps from `position`
    (epoch, batches done in it), as many passes as that takes: `epoch_batches(epoch, skip)` gives an
    epoch's batches from its `skip`-th on (each epoch's order a function of (seed, epoch), so a
    resumed run picks up exactly where it was). Stops early on an epoch with no batches."""
    epoch, skip = position
    while steps_left > 0:
        produced = False
        for batch, items in enumerate(epoch_batches(epoch, skip), start=skip):
            if steps_left <= 0:  # trainer.max_steps ends the run inside an epoch
                return
            steps_left -= 1
            produced = True
            yield epoch, batch, items
        if not produced:
            return
        epoch, skip = epoch + 1, 0


# ------------------------------------------------------------------------------------- trainer
class Trainer:
    def __init__(self, cfg: RidgelineConfig, tokenizer: PreTrainedTokenizerBase, workers: Workers, engine: InferenceEngine,
                 generator: Generator, train_data: PromptDataset, val_data: PromptDataset | None,
                 trackers: list[Tracker], run_dir: Path, run: RunState, checkpointer: Checkpointer,
                 weight_sync: WeightSync, device: torch.device, run_info: RunInfo, colocated: bool = False,
                 shutdown: Callable[[], None] | None = None, env_override: str | None = None,
                 endpoint: HttpEndpoint | None = None, run_lock: RunLock | None = None):
        """`workers` are the one-process workers, or with trainer.strategy=fsdp2 the Ray groups of
        ridgeline.distributed.ray_workers (the same protocols); `weight_sync.sync(step)` brings the
        engine(s) the policy's weights; `device` is where this process computes (its engine and
        workers when they are local; the host for a Ray driver); `colocated`: the engines share the
        training GPUs, so they sleep while the trainer trains; `shutdown()` (if any) stops the
        workers and engines; `endpoint` (generator.enable_http_endpoint) serves `engine`, its
        SharedEngine, over HTTP from the start of `train()` to its end; `run_lock`: the run's folders,
        held until `close()`; `run_info`: the run's `run.json` (its start: `timing/elapsed`)."""
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.workers = workers
        self.engine = engine
        self.generator = generator
        self.train_data = train_data
        self.val_data = val_data
        self.trackers = trackers
        self.run_dir = run_dir
        self.run = run
        self.checkpointer = checkpointer
        self.weight_sync = weight_sync
        self.device = device
        self.run_info = run_info
        self._shutdown = shutdown
        self.endpoint = endpoint
        self.run_lock = run_lock
        self.env_override = env_override  # environment.reward_fn: one env for every row
        self.colocated = colocated
        self.history: list[dict[str, float]] = []
        self.in_step = False                           # a step's update may be half done
        self.stop_requested = False                    # Ctrl-C with trainer.ckpt_on_interrupt

    @classmethod
    def from_config(cls, cfg: RidgelineConfig) -> "Trainer":
        """The trainer of `cfg`, resumed when `trainer.resume_mode` finds a checkpoint. The run's
        folders (trainer.run_dir, trainer.ckpt_path) are locked first, before anything is written
        in them (RunLockedError while another command holds one), and stay locked until `close()`."""
        if cfg.generator.enable_http_endpoint:  # a taken port stops the run before anything is written
            check_address(cfg.generator.http_endpoint_host, cfg.generator.http_endpoint_port)
        if cfg.trainer.async_mode != "sync" and cls is Trainer:  # a caller's slip, not the user's
            raise ValueError(f"trainer.async_mode={cfg.trainer.async_mode} is AsyncTrainer's: build the run's "
                             "trainer with ridgeline.trainer.async_trainer.build_trainer(cfg)")
        run_lock = RunLock.acquire(run_folders(cfg.trainer))
        try:
            return cls._build(cfg, run_lock)
        except BaseException:
            run_lock.release()
            raise

    @classmethod
    def _build(cls, cfg: RidgelineConfig, run_lock: RunLock) -> "Trainer":
        t, alg = cfg.trainer, cfg.trainer.algorithm
        started = time.time()  # the run's start in run.json: before models and data load
        seed_everything(t.seed)
        load_algorithm_modules(alg.algorithm_modules)  # the user's estimators and losses, by name
        if alg.advantage_estimator == "no_op" and alg.use_kl_in_reward and not alg.on_policy_distillation:
            log.warning("advantage_estimator=no_op with use_kl_in_reward and on_policy_distillation=false: the "
                        "environment's reward minus beta * KL to trainer.ref.model.path, not on-policy distillation "
                        "(SkyRL's main_on_policy_distill.py); for that, add +experiment=on_policy_distillation")
        run_dir = Path(t.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        check_model_paths(cfg)  # every model path (policy, ref, critic) before anything loads

        tokenizer = load_tokenizer(policy_spec(cfg))
        configure_chat_template(tokenizer, cfg.generator)
        prepare_data(cfg.data, cfg.environment)
        default_env = cfg.environment.env_class
        train_data = PromptDataset(list(cfg.data.train_data), default_env_class=default_env,
                                   max_prompt_tokens=t.max_prompt_length, tokenizer=tokenizer,
                                   config_key="data.train_data")
        val_data = (PromptDataset(list(cfg.data.val_data), default_env_class=default_env,
                                  max_prompt_tokens=t.max_prompt_length, tokenizer=tokenizer,
                                  config_key="data.val_data")
                    if cfg.data.val_data else None)
        if len(train_data) < t.train_batch_size:
            raise DatasetError(f"data.train_data holds {len(train_data)} usable prompts, fewer than "
                               f"trainer.train_batch_size={t.train_batch_size}. Fix: more rows, or a smaller "
                               "trainer.train_batch_size")
        # environments before any model loads: a row whose env cannot be built stops the run here
        env_override = load_environments(cfg.environment)
        check_environments(cfg.environment, cfg.data, cfg.generator.max_turns,
                           {"data.train_data": train_data, **({"data.val_data": val_data} if val_data else {})},
                           env_override)
        fingerprint = checkpoint.run_fingerprint(cfg, train_data)
        resume_from = checkpoint.find_resume_checkpoint(cfg)
        if resume_from is not None:
            checkpoint.check_resume(cfg, resume_from, fingerprint)  # before any model loads
        # weights + gradients + optimizer states that cannot fit stop here, not in the OOM killer
        check_memory(cfg, model_config(policy_spec(cfg), tokenizer))

        # the learning-rate schedules run over the whole run's optimizer steps (build.lr_schedule)
        training_batches = planned_steps(train_data.num_batches(t.train_batch_size), t.epochs, t.max_steps,
                                         t.max_training_steps)
        if t.strategy == "single":
            device = use_device(t.device)  # this process's current GPU too: pinned buffers land on it
            policy = build_policy_worker(cfg, tokenizer, training_batches=training_batches)
            workers = Workers(policy, build_ref_worker(cfg, tokenizer, policy=policy),
                              build_critic(cfg, tokenizer, training_batches=training_batches))
            engine = build_engine(cfg, tokenizer, policy.model)
            weight_sync: WeightSync = InProcessWeightSync(policy, engine)
            if isinstance(engine, RemoteEngine):
                remote = engine
                weight_sync = RemoteWeightSync(
                    engine, tokenizer, push=lambda version: remote.push_weights(policy.named_weights(), version),
                    trainer_probe=lambda: probe_logprobs(policy.model, tokenizer, device=device))
            shutdown = engine.close
            # an embedded engine on the trainer's GPU releases it while the trainer trains (sleep / wake)
            colocated = bool(t.placement.colocate_all) and device.type == "cuda" and not isinstance(engine, RemoteEngine)
            parameters = sum(p.numel() for p in policy.model.parameters())
            where = (f"one process on {device}, {len(engine.urls)} remote engine(s)" if isinstance(engine, RemoteEngine)
                     else f"one process on {device}")
        else:
            from ridgeline.distributed.ray_workers import build_ray_workers
            ray_workers = build_ray_workers(cfg, tokenizer, training_batches)
            workers = Workers(ray_workers.policy, ray_workers.ref, ray_workers.critic)
            engine, weight_sync, shutdown = ray_workers.engine, ray_workers.weight_sync, ray_workers.shutdown
            parameters = ray_workers.parameters
            where = f"{t.strategy} on Ray: {ray_workers.plan.describe()}"
            # the driver holds no model: it computes rewards and advantages on the host and never
            # opens a CUDA context; engine actors colocated with GPU ranks sleep while they train
            device = torch.device("cpu")
            colocated = bool(t.placement.colocate_all) and ray_workers.plan.device == "GPU" \
                and bool(cfg.generator.run_engines_locally)
        compute = (str(training_autocast_dtype(training_precision(t), device) or torch.float32)
                   if t.strategy == "single" else f"mixed_precision={training_precision(t)} on the ranks")
        endpoint = None
        try:
            if cfg.generator.enable_http_endpoint:
                endpoint = HttpEndpoint(engine, tokenizer, EndpointSettings.from_config(cfg))
                engine = endpoint.engine  # the generator and the loop share it with the endpoint's requests
            run = RunState(run_id=checkpoint.saved_run_id(resume_from) or checkpoint.new_run_id(), algorithm=AlgorithmState(
                kl_controller=(build_kl_controller(alg.kl_ctrl.type, alg.kl_loss_coef, alg.kl_ctrl.kl_target,
                                                   alg.kl_ctrl.horizon) if alg.use_kl_in_reward else None),
                reward_std=RunningRewardStd() if workers.critic is not None and alg.normalize_reward else None))
            generator = build_generator(cfg.generator, cfg.environment, engine, tokenizer)
            loggers = [t.logger] if isinstance(t.logger, str) else list(t.logger)
            log.info("policy %s: %.1fM parameters, training compute %s, engine %s%s (%s; memory allocator %s)",
                     t.policy.model.path, parameters / 1e6, compute, engine.dtype,
                     f", critic {t.critic.model.path}" if workers.critic is not None else "", where, active_allocator())
            checkpoint.clean_interrupted_writes(run_dir)  # the run folder is locked: leftovers are a dead run's
            checkpoint.prepare_metrics(run_dir, resume_from)  # before a tracker opens metrics.jsonl
            trackers = build_trackers(loggers, run_dir, project_name=t.project_name, run_name=t.run_name,
                                      config=dataclasses.asdict(cfg), run_id=run.run_id,
                                      resume_step=checkpoint.checkpoint_step(resume_from) if resume_from else None)
            run_info = start_run_info(cfg, run_dir, run.run_id, where, started)  # after prepare_metrics
            checkpointer = Checkpointer(cfg, tokenizer, fingerprint, run_dir)
            trainer = cls(cfg, tokenizer, workers, engine, generator, train_data, val_data, trackers, run_dir, run,
                          checkpointer, weight_sync, device, run_info, colocated=colocated, shutdown=shutdown,
                          env_override=env_override, endpoint=endpoint, run_lock=run_lock)
            if resume_from is not None:
                checkpointer.load(resume_from, run, workers, trainer.steps_per_epoch)
                weight_sync.sync(run.global_step)   # the engines get the resumed policy
                checkpointer.restore_rng(resume_from, workers)  # last: loading and syncing may draw numbers
            elif not isinstance(weight_sync, InProcessWeightSync):
                weight_sync.sync(0)  # engines in other processes start from the trainer's weights, probed
        except BaseException:
            if endpoint is not None:
                endpoint.close()
            shutdown()
            raise
        return trainer

    # --------------------------------------------------------------------------------- loop
    @property
    def steps_per_epoch(self) -> int:
        return self.train_data.num_batches(self.cfg.trainer.train_batch_size)

    @property
    def total_steps(self) -> int:
        """The run's steps: `trainer.max_steps`, else epochs x batches per epoch."""
        t = self.cfg.trainer
        return planned_steps(self.steps_per_epoch, t.epochs, t.max_steps, t.max_training_steps)

    @property
    def num_epochs(self) -> int:
        """Passes over the data the run's steps take (the last one may be partial)."""
        return -(-self.total_steps // max(1, self.steps_per_epoch))

    def train(self) -> dict[str, Any]:
        t = self.cfg.trainer
        epoch, batch = self.run.data_position
        if self.run.global_step >= self.total_steps:
            log.info("all %d steps were done before the checkpoint; only the final eval and model are redone",
                     self.total_steps)
        elif self.run.global_step:
            log.info("resuming at step %d of %d (batch %d of epoch %d), run folder %s", self.run.global_step + 1,
                     self.total_steps, batch + 1, epoch + 1, self.run_dir)
        elif t.max_steps is not None:
            log.info("training %d steps (trainer.max_steps; %d pass(es) over %d batches), run folder %s",
                     self.total_steps, self.num_epochs, self.steps_per_epoch, self.run_dir)
        else:
            log.info("training %d steps (%d epochs x %d steps), run folder %s", self.total_steps, t.epochs,
                     self.steps_per_epoch, self.run_dir)
        try:
            if self.endpoint is not None:
                self.endpoint.start()
            return self._train()
        except LostWorkerError as err:
            # the step in progress (global_step counts it from its start) and how to continue
            raise err.at_step(self.run.global_step if self.in_step else self.run.global_step + 1,
                              self._resume_hint()) from err.__cause__
        finally:
            self.close()

    def _resume_hint(self) -> str:
        """What continues a run whose Ray worker was lost: its newest checkpoint, by the same command."""
        t = self.cfg.trainer
        last = self.checkpointer.last
        if last is None:
            return (f"No checkpoint was written yet (trainer.ckpt_interval={t.ckpt_interval}): the same command "
                    "starts the run over")
        how = ("the same command resumes from it (trainer.resume_mode=latest)" if t.resume_mode == "latest"
               else "rerun the command with trainer.resume_mode=latest to resume from it")
        return f"The newest checkpoint is {last}: {how}"

    def close(self) -> None:
        """Stop the HTTP endpoint (first: no request reaches an engine being shut down) and the
        workers of other processes (Ray actors and their placement groups), then release the run's
        folders; idempotent."""
        try:
            if self.endpoint is not None:
                self.endpoint.close()
            if self._shutdown is not None:
                shutdown, self._shutdown = self._shutdown, None
                shutdown()
        finally:
            if self.run_lock is not None:
                self.run_lock.release()

    def _train(self) -> dict[str, Any]:
        t = self.cfg.trainer
        start = time.perf_counter()
        first_eval = last_eval = None
        if self.val_data is not None and t.eval_before_train and self.run.global_step == 0:
            first_eval = last_eval = self.evaluate()
            self._log(first_eval)
        if self.run.global_step and self.run.global_step >= self.total_steps:
            log.warning("resumed at step %d, the run's last: nothing left to train (trainer.resume_mode=none "
                        "starts over, or raise trainer.epochs / trainer.max_steps to train on)", self.run.global_step)
        with self._interrupt_handling(), run_progress(self.total_steps, done=self.run.global_step) as steps:
            for epoch, batch, rows in self._remaining_batches():
                self.in_step = True
                self.run.global_step += 1
                metrics = self.train_step(rows)
                metrics.update({"trainer/epoch": float(epoch), "trainer/global_step": float(self.run.global_step)})
                if self.val_data is not None and t.eval_interval > 0 and self.run.global_step % t.eval_interval == 0:
                    last_eval = self.evaluate()
                    metrics.update(last_eval)
                self._log(metrics)
                steps.update(reward=metrics.get("reward/avg_raw_reward"))
                after = self._after_step(epoch, batch)
                if after:
                    # a row of its own for the same step: this work runs after the step's row is
                    # written, since a checkpoint records the rows logged before it
                    self._log({f"timing/{k}": v for k, v in after.items()})
                self.in_step = False
                if self.stop_requested:
                    raise KeyboardInterrupt(f"stopped after step {self.run.global_step} (Ctrl-C)")
        last = self.checkpointer.last
        if t.ckpt_interval <= 0 and last is not None and checkpoint.checkpoint_step(last) != self.run.global_step:
            # the checkpoint of a Ctrl-C is where a rerun resumes (resume_mode=latest): once the run is
            # done, that must be its end, not the steps it has already trained after the interrupt
            self.save_checkpoint()
        # the last step's own eval (eval_interval) counts as the final one
        if self.val_data is not None and not (self.run.global_step and t.eval_interval > 0
                                              and self.run.global_step % t.eval_interval == 0):
            last_eval = self.evaluate()
            self._log(last_eval)
        final_dir = self.save_final_model()
        plot = plot_rewards(self.run_dir / "metrics.jsonl", self.run_dir / "reward.png", title=t.run_name)
        try:
            report = str(write_report(self.run_dir))
        except Exception as exc:  # a report is a convenience: it must never fail a finished run
            log.warning("could not write the run report (%s: %s)", type(exc).__name__, exc)
            report = None
        summary = {"steps": self.run.global_step, "wall_seconds": time.perf_counter() - start,
                   "final_model": str(final_dir), "plot": str(plot), "report": report,
                   "eval_before": first_eval, "eval_after": last_eval,
                   "disabled_trackers": disabled_trackers(self.trackers)}
        for tracker in self.trackers:
            tracker.close()
        return summary

    def _remaining_batches(self) -> Iterator[tuple[int, int, list[PromptRow]]]:
        """(epoch, batch index within the epoch, prompts) from `data_position` on: each epoch's
        order is a function of (seed, epoch), so a resumed run picks up exactly where it was."""
        t = self.cfg.trainer
        return batches_from(self.run.data_position, self.total_steps - self.run.global_step,
                            lambda epoch, skip: self.train_data.batches(t.train_batch_size, seed=t.seed, epoch=epoch,
                                                                        skip_batches=skip))

    def _after_step(self, epoch: int, batch: int) -> dict[str, float]:
        """Bookkeeping once step `global_step` has trained and logged: the data position, the
        reference refresh at an epoch's end, then exports and checkpoints when due. Returns the
        seconds of what ran, under SkyRL's timing names."""
        t = self.cfg.trainer
        timer = StepTimer({})
        epoch_done = batch + 1 == self.steps_per_epoch
        self.run.data_position = (epoch + 1, 0) if epoch_done else (epoch, batch + 1)
        if epoch_done and t.update_ref_every_epoch and self.workers.ref is not None and epoch + 1 < self.num_epochs:
            with timer.phase("update_ref_with_policy"):
                self.update_ref()
        step = self.run.global_step
        if t.hf_save_interval > 0 and (step % t.hf_save_interval == 0 or step == self.total_steps):
            # SkyRL's place: <export_path>/global_step_<N>/{policy,critic} (the run's folder with
            # exports_per_run), and one after the last step
            with timer.phase("save_hf_model"):
                self.checkpointer.export(self.workers, Path(t.exports_dir) / f"global_step_{step}", step)
        if t.ckpt_interval > 0 and (step % t.ckpt_interval == 0 or step == self.total_steps):
            self.save_checkpoint(timer)
        return timer.seconds

    def save_checkpoint(self, timer: StepTimer | None = None) -> Path:
        """`<ckpt_path>/global_step_<N>`, written atomically (see ridgeline.trainer.checkpoint),
        then the checkpoints beyond `max_ckpts_to_keep` removed; `timer` (if any) gets SkyRL's
        `save_checkpoints` (all of it) and `cleanup_old_checkpoints` (the removal)."""
        timer = timer or StepTimer({})
        with timer.phase("save_checkpoints"):
            folder = self.checkpointer.save(self.run, self.workers, self.steps_per_epoch)
            with timer.phase("cleanup_old_checkpoints"):
                self.checkpointer.prune_old()
        return folder

    # --------------------------------------------------------------------------------- Ctrl-C
    @contextlib.contextmanager
    def _interrupt_handling(self) -> Iterator[None]:
        """With `trainer.ckpt_on_interrupt`: the first Ctrl-C during a step lets that step finish (the
        loop then raises KeyboardInterrupt); a Ctrl-C between steps, or a second one, interrupts at
        once. On the way out, a KeyboardInterrupt that arrived between steps writes a checkpoint of
        the last completed step; one that arrived inside a step writes nothing (the step's update may
        be half done) and the newest checkpoint stays the resume point. Either way the
        KeyboardInterrupt leaves with one line: where the checkpoint is and how to resume."""
        previous = None
        if self.cfg.trainer.ckpt_on_interrupt and threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            yield
        except KeyboardInterrupt:
            # `from None`: the command prints this line, and the frames of wherever Ctrl-C landed say nothing
            raise KeyboardInterrupt(self._checkpoint_on_interrupt()) from None
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)

    def _on_sigint(self, signum, frame) -> None:
        if self.stop_requested or not self.in_step:
            raise KeyboardInterrupt
        self.stop_requested = True
        log.warning("Ctrl-C: step %d finishes, then a checkpoint is written and the run stops "
                    "(Ctrl-C again to stop at once without one)", self.run.global_step)

    def _checkpoint_on_interrupt(self) -> str:
        """Save the last completed step when `ckpt_on_interrupt` asks for it and the Ctrl-C came
        between steps; the line that says what was saved and what to type to resume."""
        t = self.cfg.trainer
        step, last = self.run.global_step, self.checkpointer.last
        if self.in_step:
            done = f"stopped inside step {step}: its half-done update is not saved"
        elif step == 0:
            done = "stopped before the first step"
        elif last is not None and checkpoint.checkpoint_step(last) == step:
            done = f"stopped after step {step}, saved in {last}"
        elif not t.ckpt_on_interrupt:
            done = f"stopped after step {step}; nothing saved (trainer.ckpt_on_interrupt=false)"
        else:
            last = self.save_checkpoint()
            done = f"stopped after step {step}: checkpoint {last} written"
        if last is None:
            return (f"{done}; no checkpoint to resume from, the same command starts over"
                    + ("" if t.ckpt_on_interrupt else " (trainer.ckpt_on_interrupt=true saves one at Ctrl-C)"))
        if t.resume_mode == "latest":
            return f"{done}; the same command resumes from {last.name}"
        return f"{done}; to resume from {last.name}, the same command with trainer.resume_mode=latest"

    def update_ref(self) -> None:
        """`update_ref_every_epoch`: the reference becomes the current policy (cast to its dtype)."""
        if self.workers.ref is None:
            raise RuntimeError("update_ref: this run has no reference model")
        self.workers.ref.load_from(self.workers.policy)
        self.run.ref_updated = True
        log.info("reference model set to the policy after epoch %d (update_ref_every_epoch)",
                 self.run.global_step // max(1, self.steps_per_epoch))

    def _log(self, metrics: dict[str, float]) -> None:
        # wall-clock seconds since the run's first start (a resumed run counts the time it was down)
        metrics = {**metrics, "timing/elapsed": time.time() - self.run_info.started}
        self.history.append(dict(metrics, step=self.run.global_step))
        for tracker in self.trackers:
            tracker.log(metrics, self.run.global_step)

    def _generator_input(self, rows: list[PromptRow], n: int, params: SamplingParams, mode: str,
                         tag: str = "", step: int | None = None) -> GeneratorInput:
        step = self.run.global_step if step is None else step
        return generator_input(rows, n, params, uid_prefix=f"{step}-{mode}{tag}", mode=mode,
                               env_override=self.env_override, global_step=step)

    # --------------------------------------------------------------------------------- rollout
    def _generate_train(self, rows: list[PromptRow], round_index: int,
                        step: int) -> tuple[GeneratorOutput, dict[str, float]]:
        """Sample n responses per prompt and score them, then apply the truncation policy
        (`generation.truncation`) to rewards and loss masks. The metrics describe what was
        sampled, with the environment's own rewards, plus what the policy did."""
        cfg = self.cfg
        n = cfg.generator.n_samples_per_prompt
        params = SamplingParams.from_config(cfg.generator.sampling_params)
        tag = f".{round_index}" if round_index else ""
        inp = self._generator_input(rows, n, params, "train", tag, step=step)
        out = self.generator.generate(inp, seed=derive_seed(cfg.trainer.seed, "train", step, round_index))
        metrics = rollout_metrics(out.rewards, out.response_ids, out.stop_reasons, out.uids)
        shaped = apply_truncation_policy(out.stop_reasons, [len(r) for r in out.response_ids], out.rewards,
                                         out.loss_masks, truncation_policy(cfg.generator, cfg.trainer.algorithm),
                                         training=True)
        out.rewards, out.loss_masks = shaped.rewards, shaped.loss_masks
        metrics.update(shaped.metrics)
        if cfg.trainer.algorithm.zero_variance_filter:
            metrics["generate/zero_variance_masked"] = float(
                mask_signal_less_groups(out, cfg.trainer.algorithm.zero_variance_filter_tol))
        return out, metrics

    def rollout_for_step(self, rows: list[PromptRow]) -> tuple[GeneratorOutput, dict[str, float]]:
        """The trajectories step `global_step` trains on: generated now (the asynchronous trainer
        takes them from its generation thread instead)."""
        return self.collect_rollout(rows)

    def collect_rollout(self, rows: list[PromptRow], step: int | None = None) -> tuple[GeneratorOutput, dict[str, float]]:
        """The trajectories of training step `step` (default: the current one) after dynamic
        sampling, and the metrics of the first generated batch (what the policy sampled) plus those
        of dynamic sampling. Every seed and uid derives from `step`, never from the clock."""
        step = self.run.global_step if step is None else step
        ds = self.cfg.trainer.algorithm.dynamic_sampling
        first, metrics = self._generate_train(rows, 0, step)
        if ds.type is None:
            return first, metrics
        target = len(rows)
        if ds.type == "replace":
            rng = random.Random(derive_seed(self.cfg.trainer.seed, "replace", step))
            rollout, copies = replace_rollout(first, ds.min_replace_ratio, rng)
            kept = num_groups(filter_rollout(first))
            if copies == 0 and kept < target:
                log.warning("dynamic_sampling replace: only %d of %d groups carry signal (below "
                            "min_replace_ratio=%s); the batch is trained as it is", kept, target,
                            ds.min_replace_ratio)
            metrics.update({"dynamic_sampling/signal_groups": float(kept),
                            "dynamic_sampling/replaced_groups": float(copies)})
            return rollout, metrics
        parts = [filter_rollout(first)]
        batches = 1
        while sum(num_groups(p) for p in parts) < target and batches < ds.max_sample_batches:
            extra, _ = self._generate_train(self._extra_prompts(target, batches, step), batches, step)
            parts.append(filter_rollout(extra))
            batches += 1
        collected = GeneratorOutput.concat(parts)
        groups = num_groups(collected)
        if groups < target:
            log.warning("dynamic_sampling filter: %d of %d groups with signal after %d batches "
                        "(max_sample_batches); training on those", groups, target, batches)
        metrics.update({"dynamic_sampling/sample_batches": float(batches),
                        "dynamic_sampling/signal_groups": float(min(groups, target)),
                        "dynamic_sampling/short_batch": float(groups < target)})
        return first_groups(collected, target), metrics

    def _extra_prompts(self, count: int, round_index: int, step: int) -> list[PromptRow]:
        """Prompts for a further dynamic-sampling batch: drawn at random from the training set,
        reproducibly per (seed, step, round), so the epoch's own order is left alone."""
        rng = random.Random(derive_seed(self.cfg.trainer.seed, "extra_prompts", step, round_index))
        return [self.train_data[i] for i in rng.sample(range(len(self.train_data)), count)]

    # --------------------------------------------------------------------------------- step
    def train_step(self, rows: list[PromptRow]) -> dict[str, float]:
        cfg, t, alg = self.cfg, self.cfg.trainer, self.cfg.trainer.algorithm
        timer = StepTimer({})
        metrics: dict[str, float] = {}
        with timer.phase("step"):
            with timer.phase("generate"):
                out, rollout_stats = self.rollout_for_step(rows)
            metrics.update(rollout_stats)
            metrics.update(out.metrics)
            n = cfg.generator.n_samples_per_prompt
            if len(out) == 0:
                log.warning("step %d: no prompt group carries signal; the update is skipped", self.run.global_step)
                metrics["dynamic_sampling/skipped_steps"] = 1.0
                return metrics
            with timer.phase("postprocess_generator_output"):
                # SkyRL's reward metrics: the trajectories trained on, with the rewards they train with
                metrics.update(reward_metrics(out.rewards, out.loss_masks, out.uids, n))
                # a few rollouts of every step, for the run report's step browser
                write_samples(self.run_dir / "samples.jsonl", self.run.global_step,
                              [self.tokenizer.decode(p, skip_special_tokens=True) for p in out.prompt_token_ids],
                              out.responses, out.rewards, overwrite=self.run.global_step == 1)
            with timer.phase("convert_to_training_input"):
                # one sample per trajectory, or per turn (generator.step_wise_trajectories); a rank's
                # share of a mini-batch that does not split evenly is padded there (rank_shares)
                samples = training_samples(out, step_wise=bool(cfg.generator.step_wise_trajectories))
                batch = build_training_batch(samples.prompt_token_ids, samples.response_ids, samples.loss_masks,
                                             samples.rewards, samples.uids, samples.rollout_logprobs,
                                             self.tokenizer.pad_token_id, trajectory_index=samples.trajectory_index)
                if cfg.generator.step_wise_trajectories:
                    metrics["generate/step_wise_samples"] = float(len(samples))
            if self.colocated:
                with timer.phase("engine_sleep"):  # the engine's weights and cache leave the GPU for training
                    # level 2 drops the weights instead of copying them to the host and back: the
                    # sync below overwrites every one of them right after the wake
                    self.engine.sleep(2)
            with timer.phase("fwd_logprobs_values_reward"):
                # With one optimizer step per batch the policy has not moved when the loss is taken,
                # so the old logprobs are the training forward's own (detached): one pass saved. The
                # KL-in-reward penalty needs them before training, so it computes them.
                steps_per_batch = t.update_epochs_per_batch * (t.train_batch_size // t.policy_mini_batch_size)
                if steps_per_batch > 1 or alg.use_kl_in_reward:
                    batch.old_logprobs = self.workers.policy.compute_logprobs(batch)
                if self.workers.ref is not None:
                    batch.ref_logprobs = self.workers.ref.compute_logprobs(batch)
                if self.workers.critic is not None:
                    batch.values = self.workers.critic.compute_values(batch)
            controller = self.run.algorithm.kl_controller
            if controller is not None:
                with timer.phase("apply_reward_kl_penalty"):
                    metrics.update(self._apply_reward_kl_penalty(batch, controller))
            with timer.phase("compute_advantages_and_returns"):
                metrics.update(compute_advantages(batch, alg, self.run.algorithm.reward_std))
            try:
                with timer.phase("train_critic_and_policy"):
                    if self.workers.critic is not None:
                        # The critic learns first (SkyRL's order): its update does not touch this step's
                        # advantages, which were computed from the values before it.
                        with timer.phase("critic_train"):
                            metrics.update(self.workers.critic.train(batch))
                    with timer.phase("policy_train"):
                        metrics.update(self.workers.policy.train(batch))
            except NonFiniteLossError as err:
                raise NonFiniteLossError(
                    f"step {self.run.global_step}: {err}. The run stops; resume from the latest checkpoint "
                    "(trainer.resume_mode=latest), or set trainer.nonfinite_loss=skip to drop such "
                    "optimizer steps") from err
            with timer.phase("sync_weights"), self._weights_changing():
                if self.colocated:  # weights first, then the KV cache: never both next to the trainer's state
                    self.engine.wake_up(("weights",))
                metrics.update(self.weight_sync.sync(self.run.global_step))
                if self.colocated:
                    self.engine.wake_up(("kv_cache",))
        metrics.update({f"timing/{k}": v for k, v in timer.seconds.items()})
        if t.dump_data_batch:  # outside the timer: a debugging aid, not part of the step
            # SkyRL's folder and file stem (it pickles its own batch class; this is JSON lines)
            dump_training_batch(batch, self.tokenizer, Path(t.exports_dir) / "dumped_data"
                                / f"global_step_{self.run.global_step}_training_input.jsonl", self.run.global_step)
        trained_tokens = float(batch.attention_mask.sum())
        generated = float(batch.response_mask.sum())
        metrics["throughput/tokens_per_second"] = trained_tokens / timer.seconds["step"]
        metrics["throughput/generate_tokens_per_second"] = generated / max(timer.seconds["generate"], 1e-9)
        metrics["throughput/train_tokens_per_second"] = trained_tokens / max(timer.seconds["policy_train"], 1e-9)
        # This process only: Ray ranks and engine servers are not in it.
        metrics.update(memory_metrics(self.device))
        return metrics

    def _weights_changing(self) -> contextlib.AbstractContextManager[None]:
        """HTTP endpoint requests wait while the engine takes new weights, then see them (a colocated
        engine also keeps them waiting from its sleep on: `SharedEngine`)."""
        return self.endpoint.hold() if self.endpoint is not None else contextlib.nullcontext()

    def _apply_reward_kl_penalty(self, batch: TrainingBatch, controller: KLController) -> dict[str, float]:
        """`use_kl_in_reward`: `batch.rewards` lowered by beta * KL(pi_old || ref) per loss token, then
        the controller steered by the batch KL; SkyRL's `loss/avg_kl`, `loss/avg_kl_max` and
        `loss/kl_loss_coef` (the beta applied). With `on_policy_distillation` the environment's reward
        is dropped and -beta * KL to the teacher is the reward (SkyRL's OnPolicyDistillationTrainer);
        `distill/teacher_kl` is then that KL's mean over the loss tokens."""
        if batch.old_logprobs is None or batch.ref_logprobs is None:  # phase 5 computes both for a KL reward
            raise RuntimeError("use_kl_in_reward: the batch lacks its old-policy or reference logprobs")
        beta = controller.value
        distill = bool(self.cfg.trainer.algorithm.on_policy_distillation)
        penalty = kl_penalized_rewards(batch.rewards, batch.old_logprobs, batch.ref_logprobs, batch.loss_mask,
                                       beta, self.workers.policy.config.kl_estimator, keep_task_reward=not distill)
        batch.rewards = penalty.rewards
        controller.update(penalty.kl_mean, n_steps=batch.batch_size)
        metrics = {"loss/avg_kl": penalty.kl_mean, "loss/avg_kl_max": penalty.kl_max_mean, "loss/kl_loss_coef": beta}
        if distill:
            metrics["distill/teacher_kl"] = penalty.kl_token_mean
        return metrics

    # --------------------------------------------------------------------------------- eval
    def evaluate(self) -> dict[str, float]:
        cfg = self.cfg
        if self.val_data is None:
            raise RuntimeError("evaluate: the run has no data.val_data")
        metrics, acc = run_eval(self.generator, [(row.data_source, row) for row in self.val_data], cfg,
                                env_override=self.env_override, global_step=self.run.global_step)
        if cfg.trainer.dump_eval_results:
            acc.dump(eval_dump_folder(cfg.trainer.exports_dir, self.run.global_step),
                     owner=DumpOwner(self.run_info.run_id, self.run_info.run_dir))
        return metrics

    def save_final_model(self) -> Path:
        """`final_model` (the policy, loadable with plain transformers) and `final_critic`, each
        written whole or not at all (Checkpointer.save_final)."""
        return self.checkpointer.save_final(self.workers, self.run_dir)

