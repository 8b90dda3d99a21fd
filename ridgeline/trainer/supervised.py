"""The step loop of `ridgeline sft` and `ridgeline dpo`: supervised objectives on the RL run's
machinery. The policy worker is the RL trainer's (`training.build.build_policy_worker`: device,
precision, LoRA, optimizer, schedule), trained through `PolicyWorker.train` with the registered
`sft` / `dpo` losses (ridgeline.algorithms.supervised); DPO's frozen reference is the RL side's
reference worker. Checkpoints, resume, the final model and the trackers are the RL trainer's
(ridgeline.trainer.checkpoint, ridgeline.tracking).

Per step: `trainer.train_batch_size` examples (chats, or preference pairs) in the epoch's
(seed, epoch) order -> one `TrainingBatch` (a pair is two consecutive rows of one trajectory, so
mini-batches never split it) -> (DPO) the reference's logprobs in `old_logprobs` -> the
worker's optimizer steps (`trainer.policy_mini_batch_size` examples each). Eval on
`data.val_data`: the mean NLL per assistant token (SFT), or the DPO loss and reward metrics over
every held-out pair, before training, every `trainer.eval_interval` steps and at the end.
"""

from __future__ import annotations

import dataclasses
import copy
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TYPE_CHECKING

import torch

from ridgeline.config.loader import save_config
from ridgeline.algorithms.supervised import (PREFERENCE_LOSSES, preference_metrics, preference_sums,
                                              sequence_logratios)
from ridgeline.data.schema import DatasetError
from ridgeline.data.dataset import epoch_order
from ridgeline.data.sources import SourceDigest
from ridgeline.data.supervised import (PreferenceColumns, SFTColumns, TokenizedChat,
                                       load_preference_pairs, load_sft_examples)
from ridgeline.errors import UserError
from ridgeline.models.loading import configure_chat_template, load_tokenizer
from ridgeline.tracking.progress import run_progress
from ridgeline.tracking.trackers import build_trackers
from ridgeline.trainer import checkpoint
from ridgeline.trainer.builders import check_model_paths, prepare_data
from ridgeline.trainer.checkpoint import Checkpointer
from ridgeline.trainer.env_pairs import EnvPairs
from ridgeline.trainer.run_lock import RunLock, run_folders
from ridgeline.trainer.state import RunState
from ridgeline.trainer.trainer import batches_from, planned_steps
from ridgeline.training.batch import TrainingBatch, build_training_batch
from ridgeline.training.build import build_policy_worker, build_ref_worker, policy_spec, seed_everything
from ridgeline.training.protocols import Workers

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema import RidgelineConfig

log = logging.getLogger(__name__)


class SupervisedConfigError(UserError):
    """A setting `ridgeline sft` / `ridgeline dpo` cannot run with."""


@dataclass(frozen=True)
class Objective:
    """What differs between SFT and DPO: the loss, how examples load, how many batch rows one
    example is, and the held-out metrics."""

    name: str                                                        # "sft" | "dpo": the policy loss
    rows_per_example: int
    load: Callable[[Sequence[str], Any, RidgelineConfig, str], tuple[list[Any], list[SourceDigest]]]


def _load_sft(specs, tokenizer, cfg, key):
    s = cfg.sft
    return load_sft_examples(specs, tokenizer, SFTColumns(s.messages_key, s.prompt_key, s.response_key),
                             int(s.max_length), key)


def _load_dpo(specs, tokenizer, cfg, key):
    d = cfg.dpo
    return load_preference_pairs(specs, tokenizer, PreferenceColumns(d.prompt_key, d.chosen_key, d.rejected_key),
                                 int(d.max_length), key)


SFT = Objective("sft", 1, _load_sft)
DPO = Objective("dpo", 2, _load_dpo)


def samples_of(objective: Objective, examples: Sequence[Any]) -> list[TokenizedChat]:
    """The batch rows of `examples`: a chat each, or a pair's chosen then rejected answer."""
    if objective.rows_per_example == 1:
        return list(examples)
    return [side for pair in examples for side in (pair.chosen, pair.rejected)]


def examples_batch(objective: Objective, examples: Sequence[Any], pad_id: int, tag: str) -> TrainingBatch:
    """`examples` in the batch layout; example k's rows are trajectory k."""
    rows = samples_of(objective, examples)
    per = objective.rows_per_example
    batch = build_training_batch([r.prompt_ids for r in rows], [r.response_ids for r in rows],
                                 [r.loss_mask for r in rows], [0.0] * len(rows),
                                 [f"{tag}-{i // per}" for i in range(len(rows))], None, pad_id,
                                 trajectory_index=[i // per for i in range(len(rows))])
    # the policy worker passes advantages to every loss; the sft and dpo losses do not read them
    batch.advantages = torch.zeros_like(batch.rewards)
    return batch


def worker_config(cfg: RidgelineConfig, objective: Objective, *, with_reference: bool = False) -> RidgelineConfig:
    """The config the RL builders make this run's workers from: the objective's loss (with the
    `dpo.*` settings where the loss reads its config), logprobs at temperature 1, one sample per
    example, no KL or entropy term, micro-batches counted in examples (`micro_*_batch_size_per_gpu`
    x rows per example: a pair never straddles two micro-batches), the longest row `max_length`.
    `with_reference` switches a KL key on only so `build_ref_worker` builds the frozen reference."""
    c = copy.deepcopy(cfg)
    t, g, alg = c.trainer, c.generator, c.trainer.algorithm
    max_length = c.sft.max_length if objective.name == "sft" else c.dpo.max_length
    alg.policy_loss_type, alg.use_kl_loss, alg.use_kl_in_reward, alg.use_entropy_loss = (
        objective.name, with_reference, False, False)
    t.micro_train_batch_size_per_gpu *= objective.rows_per_example
    t.micro_forward_batch_size_per_gpu *= objective.rows_per_example
    t.update_epochs_per_batch, t.max_prompt_length = 1, max_length
    g.n_samples_per_prompt, g.max_input_length = 1, max_length
    g.sampling_params.temperature, g.sampling_params.max_generate_length = 1.0, 0
    return c


def check_supported(cfg: RidgelineConfig, objective: Objective) -> None:
    t = cfg.trainer
    problems = []
    if t.strategy != "single":
        problems.append(f"trainer.strategy={t.strategy}: `ridgeline {objective.name}` runs in one process for now. "
                        "Fix: trainer.strategy=single (trainer.device picks the GPU or CPU)")
    if t.critic.model.path is not None:
        problems.append(f"trainer.critic.model.path={t.critic.model.path}: {objective.name} trains no critic. "
                        "Fix: trainer.critic.model.path=null")
    if objective is SFT and cfg.sft.eval_with_env and not cfg.data.val_data:
        problems.append("sft.eval_with_env=true scores data.val_data through the generator, but data.val_data=[]. "
                        "Fix: held-out RL rows in data.val_data, or sft.eval_with_env=false")
    if objective is DPO and cfg.dpo.pairs == "env" and cfg.generator.n_samples_per_prompt < 2:
        problems.append(f"dpo.pairs=env pairs the best and worst of each prompt's answers, but "
                        f"generator.n_samples_per_prompt={cfg.generator.n_samples_per_prompt} samples one. "
                        "Fix: generator.n_samples_per_prompt=4 (or more than 1)")
    if problems:
        raise SupervisedConfigError("\n".join(problems))


def fingerprint(cfg: RidgelineConfig, objective: Objective, digests: list[SourceDigest], examples: int) -> dict[str, Any]:
    """What a resume must not change (`checkpoint.check_resume` compares it)."""
    t = cfg.trainer
    return {"command": objective.name, "trainer.policy.model.path": t.policy.model.path,
            "data.train_data": [d.__dict__ for d in digests], "usable training rows": examples,
            "trainer.seed": t.seed, "trainer.train_batch_size": t.train_batch_size,
            **({"dpo.beta": cfg.dpo.beta, "dpo.loss_type": cfg.dpo.loss_type} if objective is DPO else {})}


class SupervisedTrainer:
    def __init__(self, cfg: RidgelineConfig, objective: Objective, tokenizer, workers: Workers, train: list[Any],
                 val: list[Any] | None, checkpointer: Checkpointer, run: RunState, trackers, run_dir: Path,
                 envs: EnvPairs | None = None):
        """`train` / `val`: the examples (chats, pairs), or with `envs` (dpo.pairs=env) the
        prompt rows each step samples its pairs from and the held-out prompts."""
        self.cfg, self.objective, self.tokenizer, self.workers = cfg, objective, tokenizer, workers
        self.train_examples, self.val_examples = train, val
        self.checkpointer, self.run, self.trackers, self.run_dir = checkpointer, run, trackers, run_dir
        self.envs = envs   # dpo.pairs=env: sampling pairs; or sft.eval_with_env: the generator's eval only
        self.history: list[dict[str, float]] = []

    @classmethod
    def from_config(cls, cfg: RidgelineConfig, objective: Objective) -> "SupervisedTrainer":
        t = cfg.trainer
        check_supported(cfg, objective)
        seed_everything(t.seed)
        run_dir = Path(t.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        check_model_paths(cfg)
        tokenizer = load_tokenizer(policy_spec(cfg))
        configure_chat_template(tokenizer, cfg.generator)
        prepare_data(cfg.data, cfg.environment)  # data.prepare writes the files first, as for RL runs
        envs = None
        if objective is DPO and cfg.dpo.pairs == "env":
            envs = EnvPairs(cfg, tokenizer)
        elif objective is SFT and cfg.sft.eval_with_env:
            envs = EnvPairs(cfg, tokenizer, with_train=False)
        if envs is not None and envs.train is not None:
            train, digests = list(envs.train), envs.train.digests()
            val = list(envs.val) if envs.val is not None else None
        else:
            train, digests = objective.load(list(cfg.data.train_data), tokenizer, cfg, "data.train_data")
            val = (objective.load(list(cfg.data.val_data), tokenizer, cfg, "data.val_data")[0]
                   if cfg.data.val_data else None)
        if len(train) < t.train_batch_size:
            raise DatasetError(f"data.train_data holds {len(train)} usable examples, fewer than "
                               f"trainer.train_batch_size={t.train_batch_size}. Fix: more rows, or a smaller "
                               "trainer.train_batch_size")
        identity = fingerprint(cfg, objective, digests, len(train))
        resume_from = checkpoint.find_resume_checkpoint(cfg)
        if resume_from is not None:
            checkpoint.check_resume(cfg, resume_from, identity)
        steps = _planned_steps(len(train), cfg)
        policy = build_policy_worker(worker_config(cfg, objective), tokenizer, training_batches=steps)
        ref = (build_ref_worker(worker_config(cfg, objective, with_reference=True), tokenizer, policy=policy)
               if objective is DPO else None)
        workers = Workers(policy, ref)
        if envs is not None:
            envs.start(tokenizer, policy)
        run = RunState(run_id=checkpoint.saved_run_id(resume_from) or checkpoint.new_run_id())
        checkpoint.clean_interrupted_writes(run_dir)
        checkpoint.prepare_metrics(run_dir, resume_from)
        loggers = [t.logger] if isinstance(t.logger, str) else list(t.logger)
        trackers = build_trackers(loggers, run_dir, project_name=t.project_name, run_name=t.run_name,
                                  config=dataclasses.asdict(cfg), run_id=run.run_id,
                                  resume_step=checkpoint.checkpoint_step(resume_from) if resume_from else None)
        checkpointer = Checkpointer(cfg, tokenizer, identity, run_dir)
        trainer = cls(cfg, objective, tokenizer, workers, train, val, checkpointer, run, trackers, run_dir, envs)
        if resume_from is not None:
            checkpointer.load(resume_from, run, workers, trainer.steps_per_epoch)
            if envs is not None:
                envs.sync(run.global_step)  # the engine samples from the resumed policy
            checkpointer.restore_rng(resume_from, workers)
        return trainer

    # ---------------------------------------------------------------------------------- loop
    @property
    def steps_per_epoch(self) -> int:
        return len(self.train_examples) // int(self.cfg.trainer.train_batch_size)

    @property
    def total_steps(self) -> int:
        return _planned_steps(len(self.train_examples), self.cfg)

    def _remaining_batches(self) -> Iterator[tuple[int, int, list[Any]]]:
        """(epoch, batch in the epoch, examples) from the run's data position on."""
        t = self.cfg.trainer
        size, examples = int(t.train_batch_size), self.train_examples

        def epoch_batches(epoch: int, skip: int) -> Iterator[list[Any]]:
            order = epoch_order(len(examples), int(t.seed), epoch)
            for batch in range(skip, self.steps_per_epoch):
                yield [examples[i] for i in order[batch * size:(batch + 1) * size]]

        return batches_from(self.run.data_position, self.total_steps - self.run.global_step, epoch_batches)

    def train(self) -> dict[str, Any]:
        t = self.cfg.trainer
        start = time.perf_counter()
        before = after = None
        try:
            if self.val_examples and t.eval_before_train and self.run.global_step == 0:
                before = after = self.evaluate()
                self._log(before)
            with run_progress(self.total_steps, done=self.run.global_step) as bar:
                for epoch, batch, examples in self._remaining_batches():
                    self.run.global_step += 1
                    metrics = self.train_step(examples)
                    metrics.update({"trainer/epoch": float(epoch), "trainer/global_step": float(self.run.global_step)})
                    if self.val_examples and t.eval_interval > 0 and self.run.global_step % t.eval_interval == 0:
                        after = self.evaluate()
                        metrics.update(after)
                    self._log(metrics)
                    bar.update()
                    epoch_done = batch + 1 == self.steps_per_epoch
                    self.run.data_position = (epoch + 1, 0) if epoch_done else (epoch, batch + 1)
                    step = self.run.global_step
                    if t.hf_save_interval > 0 and (step % t.hf_save_interval == 0 or step == self.total_steps):
                        # SkyRL's place, as RL runs: <export_path>/global_step_<N>/policy (or the run's folder)
                        self.checkpointer.export(self.workers, Path(t.exports_dir) / f"global_step_{step}", step)
                    if t.ckpt_interval > 0 and (step % t.ckpt_interval == 0 or step == self.total_steps):
                        self.checkpointer.save(self.run, self.workers, self.steps_per_epoch)
                        self.checkpointer.prune_old()
            if self.val_examples and (after is None or t.eval_interval <= 0
                                      or self.run.global_step % t.eval_interval):
                after = self.evaluate()
                self._log(after)
            final = self.checkpointer.save_final(self.workers, self.run_dir)
        finally:
            for tracker in self.trackers:
                tracker.close()
            if self.envs is not None:
                self.envs.close()
        return {"steps": self.run.global_step, "wall_seconds": time.perf_counter() - start, "eval_before": before,
                "eval_after": after, "final_model": str(final), "history": self.history}

    def train_step(self, examples: Sequence[Any]) -> dict[str, float]:
        sampled: dict[str, float] = {}
        if self.envs is not None and self.objective is DPO:  # examples are prompts: pairs are sampled now
            t0 = time.perf_counter()
            examples, sampled = self.envs.pairs(examples, self.run.global_step)
            sampled["timing/generate"] = time.perf_counter() - t0
            if not examples:
                log.warning("step %d: every prompt's answers scored the same, no pair to train on; the step takes "
                            "no optimizer step (more answers per prompt, generator.n_samples_per_prompt, or a "
                            "higher temperature make pairs likelier)", self.run.global_step)
                return sampled
        batch = self._batch(examples, f"{self.run.global_step}-train")
        t0 = time.perf_counter()
        metrics = self.workers.policy.train(batch)
        metrics.update(sampled)
        if self.envs is not None and self.objective is DPO:  # the next step samples from the updated policy
            self.envs.sync(self.run.global_step)
        if self.objective is DPO:  # TRL's names, means over the step's pairs
            metrics.update(preference_metrics(metrics, prefix="policy/"))
            metrics = {k: v for k, v in metrics.items() if not k.endswith("_sum")}
        metrics["timing/policy_train"] = time.perf_counter() - t0
        metrics["train/loss"] = metrics["policy/policy_loss"]
        metrics["train/tokens"] = float(batch.loss_mask.sum())
        return metrics

    def _batch(self, examples: Sequence[Any], tag: str) -> TrainingBatch:
        batch = examples_batch(self.objective, examples, self.tokenizer.pad_token_id, tag)
        if self.workers.ref is not None:  # DPO: the frozen reference's logprobs ride in old_logprobs
            batch.old_logprobs = self.workers.ref.compute_logprobs(batch)
        return batch

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out metrics over every example of `data.val_data` (`trainer.eval_batch_size` at a time);
        with env pairs, the RL eval of the held-out prompts through the generator."""
        if self.envs is not None and self.objective is DPO:
            return self.envs.evaluate(self.run.global_step)
        generated = self.envs.evaluate(self.run.global_step) if self.envs is not None else {}
        val = self.val_examples
        if not val:  # the loop evaluates only with held-out examples
            raise RuntimeError("evaluate: no held-out examples (data.val_data)")
        size = int(self.cfg.trainer.eval_batch_size)
        nll = tokens = 0.0
        chosen, rejected = [], []
        for start in range(0, len(val), size):
            batch = self._batch(val[start:start + size], f"{self.run.global_step}-eval")
            logprobs = self.workers.policy.compute_logprobs(batch)
            if self.objective is SFT:
                nll -= float((logprobs * batch.loss_mask).sum())
                tokens += float(batch.loss_mask.sum())
            else:
                if batch.old_logprobs is None:  # `_batch` puts the reference's logprobs there for DPO
                    raise RuntimeError("DPO eval: the batch lacks the reference's logprobs")
                ratios = sequence_logratios(logprobs, batch.old_logprobs, batch.loss_mask,
                                            average=self.cfg.dpo.loss_type == "ipo")
                chosen.append(ratios[0::2])
                rejected.append(ratios[1::2])
        if self.objective is SFT:
            return {"eval/loss": nll / max(1.0, tokens), **generated}
        c, r = torch.cat(chosen), torch.cat(rejected)
        beta = float(self.cfg.dpo.beta)
        losses = PREFERENCE_LOSSES.get(str(self.cfg.dpo.loss_type))(c, r, beta)
        return {"eval/loss": float(losses.mean()),
                **{f"eval/{k}": v for k, v in preference_metrics(preference_sums(c, r, beta)).items()}}

    def _log(self, metrics: dict[str, float]) -> None:
        self.history.append(dict(metrics, step=self.run.global_step))
        for tracker in self.trackers:
            tracker.log(metrics, self.run.global_step)


def _planned_steps(examples: int, cfg: RidgelineConfig) -> int:
    t = cfg.trainer
    return planned_steps(examples // int(t.train_batch_size), int(t.epochs), t.max_steps, t.max_training_steps)


def run_supervised(cfg: RidgelineConfig, objective: Objective) -> dict[str, Any]:
    """`ridgeline sft` / `ridgeline dpo` on a validated config: the run's folders locked, trained,
    released."""
    run_lock = RunLock.acquire(run_folders(cfg.trainer))
    try:
        return SupervisedTrainer.from_config(cfg, objective).train()
    finally:
        run_lock.release()
