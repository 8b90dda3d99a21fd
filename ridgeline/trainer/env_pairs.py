"""DPO pairs made on-policy from an environment (`dpo.pairs=env`): every step, each prompt of the
step's batch gets `generator.n_samples_per_prompt` answers sampled by the current policy through
the RL generator (its env, multi-turn included, and the truncation rules), and its highest- and
lowest-scoring answers become one pair. The tokens are exactly the sampled ones, with the
generator's loss mask (observation tokens of multi-turn answers do not train). Held-out eval is
the RL eval through the generator (`eval/<source>/pass_at_1`, ...), which SFT runs too with
`sft.eval_with_env`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, TYPE_CHECKING

from ridgeline.data import PromptDataset, PromptRow
from ridgeline.data.supervised import PreferencePair, TokenizedChat
from ridgeline.distributed.weight_sync import InProcessWeightSync
from ridgeline.generation.generator import Generator
from ridgeline.generation.truncation import apply_truncation_policy
from ridgeline.generation.types import GeneratorOutput, total_reward
from ridgeline.inference.build import build_engine
from ridgeline.inference.types import SamplingParams
from ridgeline.seeding import derive_seed
from ridgeline.trainer.builders import (build_generator, check_environments, generator_input, load_environments,
                                        truncation_policy)
from ridgeline.trainer.evaluation import run_eval
from ridgeline.training.worker import PolicyWorker

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema import RidgelineConfig


@dataclass
class _Sampling:
    """What `EnvPairs.start` builds: the generator on the engine, and the engine's weight sync."""

    generator: Generator
    weight_sync: InProcessWeightSync


class EnvPairs:
    """The prompts (`data.train_data` unless `with_train` is False, and `data.val_data`: RL rows
    with their checks), their environments (checked before any model loads), and once `start`ed
    the engine that samples from the policy."""

    def __init__(self, cfg: RidgelineConfig, tokenizer, *, with_train: bool = True):
        t, default_env = cfg.trainer, cfg.environment.env_class
        self.cfg = cfg
        self.train = (PromptDataset(list(cfg.data.train_data), default_env_class=default_env,
                                    max_prompt_tokens=t.max_prompt_length, tokenizer=tokenizer,
                                    config_key="data.train_data") if with_train else None)
        self.val = (PromptDataset(list(cfg.data.val_data), default_env_class=default_env,
                                  max_prompt_tokens=t.max_prompt_length, tokenizer=tokenizer,
                                  config_key="data.val_data") if cfg.data.val_data else None)
        self.env_override = load_environments(cfg.environment)
        datasets = {"data.train_data": self.train, "data.val_data": self.val}
        check_environments(cfg.environment, cfg.data, cfg.generator.max_turns,
                           {key: data for key, data in datasets.items() if data is not None}, self.env_override)
        self._sampling: _Sampling | None = None
        self.close = lambda: None

    def start(self, tokenizer, policy: PolicyWorker) -> None:
        """The engine (`generator.*`, in this process) on the policy's weights, and its generator."""
        engine = build_engine(self.cfg, tokenizer, policy.model)
        generator = build_generator(self.cfg.generator, self.cfg.environment, engine, tokenizer)
        self._sampling = _Sampling(generator, InProcessWeightSync(policy, engine))
        self.close = engine.close

    def _started(self) -> _Sampling:
        if self._sampling is None:
            raise RuntimeError("EnvPairs: start(tokenizer, policy) has not run")
        return self._sampling

    def sync(self, step: int) -> None:
        """The engine takes the policy's current weights (version `step`)."""
        self._started().weight_sync.sync(step)

    def pairs(self, rows: Sequence[PromptRow], step: int) -> tuple[list[PreferencePair], dict[str, float]]:
        """Step `step`'s pairs from `rows`, and what sampling them measured."""
        cfg = self.cfg
        params = SamplingParams.from_config(cfg.generator.sampling_params)
        inp = generator_input(list(rows), int(cfg.generator.n_samples_per_prompt), params, uid_prefix=f"{step}-dpo",
                              mode="train", env_override=self.env_override, global_step=step)
        out = self._started().generator.generate(inp, seed=derive_seed(cfg.trainer.seed, "dpo", step))
        shaped = apply_truncation_policy(out.stop_reasons, [len(r) for r in out.response_ids], out.rewards,
                                         out.loss_masks, truncation_policy(cfg.generator, cfg.trainer.algorithm),
                                         training=True)
        out.rewards, out.loss_masks = shaped.rewards, shaped.loss_masks
        pairs, tied = best_worst_pairs(out)
        rewards = [total_reward(r) for r in out.rewards]
        return pairs, {**out.metrics, **shaped.metrics, "reward/avg_raw_reward": sum(rewards) / max(1, len(rewards)),
                       "dpo/pairs": float(len(pairs)), "dpo/tied_prompts": float(tied)}

    def evaluate(self, step: int) -> dict[str, float]:
        """The RL eval of the held-out prompts with the policy's current weights."""
        if self.val is None:
            raise RuntimeError("EnvPairs.evaluate: no data.val_data")
        self.sync(step)
        return run_eval(self._started().generator, [(row.data_source, row) for row in self.val], self.cfg,
                        env_override=self.env_override, global_step=step)[0]


def best_worst_pairs(out: GeneratorOutput) -> tuple[list[PreferencePair], int]:
    """One pair per prompt group (rows sharing a uid, in first-seen order): its first
    highest-reward row as chosen, its first lowest-reward row as rejected. Groups whose rewards are
    all equal carry no preference and give none; their count is returned beside the pairs."""
    groups: dict[str, list[int]] = {}
    for i, uid in enumerate(out.uids):
        groups.setdefault(uid, []).append(i)
    pairs, tied = [], 0
    for rows in groups.values():
        rewards = [total_reward(out.rewards[i]) for i in rows]
        best, worst = max(rewards), min(rewards)
        if best == worst:
            tied += 1
            continue
        chosen, rejected = rows[rewards.index(best)], rows[rewards.index(worst)]
        pairs.append(PreferencePair(_sample(out, chosen), _sample(out, rejected)))
    return pairs, tied


def _sample(out: GeneratorOutput, i: int) -> TokenizedChat:
    return TokenizedChat(list(out.prompt_token_ids[i]), list(out.response_ids[i]), list(out.loss_masks[i]))
