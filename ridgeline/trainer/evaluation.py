"""Held-out evaluation: the eval loop `Trainer.evaluate` and `ridgeline eval` share (`run_eval`),
and pass@k per data source and over everything, SkyRL's metric names.

With `generator.eval_n_samples_per_prompt = n` samples per prompt, a prompt with c passing
samples (SkyRL's pass: a positive reward, `ridgeline.trainer.metrics.passes`) contributes to every
source it belongs to and to `all`:

    eval/<source>/pass_at_1     mean over prompts of c / n          (unbiased pass@1)
    eval/<source>/pass_at_<k>   mean over prompts of 1 - C(n-c, k) / C(n, k), for k = 2, 4, 8, ...
                                below n (a pass@k curve) and k = n (share of prompts with at
                                least one passing sample: SkyRL's pass_at_<n>); only when n > 1
    eval/<source>/avg_score     mean reward over all samples (SkyRL's)
    eval/<source>/mean_positive_reward  mean over samples of the reward's positive part (SkyRL's)
    eval/<source>/accuracy      share of samples that are solved (reward >= 1.0; Ridgeline's)
    eval/<source>/num_prompts   how many prompts were scored

pass@k is the unbiased estimator of Chen et al. 2021, "Evaluating Large Language Models Trained
on Code": the probability that k samples drawn without replacement from the n include a passing
one. Sampling exactly k per prompt and counting the hits would estimate the same number with
more variance.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, TYPE_CHECKING


from ridgeline.data import PromptRow
from ridgeline.generation.generator import Generator
from ridgeline.generation.truncation import apply_truncation_policy
from ridgeline.generation.types import GeneratorInput, GeneratorOutput, Reward, total_reward
from ridgeline.inference.types import SamplingParams
from ridgeline.models.text import decode_text
from ridgeline.seeding import derive_seed
from ridgeline.tracking.dumps import DumpOwner, write_eval_dump
from ridgeline.trainer.builders import generator_input, truncation_policy
from ridgeline.trainer.metrics import SOLVED_THRESHOLD, passes, positive_reward

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema import RidgelineConfig

log = logging.getLogger(__name__)


def metric_key(data_source: str) -> str:
    # A data source like "openai/gsm8k" would add a level to "eval/<source>/pass_at_1".
    return data_source.replace("/", "_")


# ------------------------------------------------------------------------------------ pass@k
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with n samples of which c pass (Chen et al. 2021):

        pass@k = 1 - C(n - c, k) / C(n, k)

    C(n - c, k) / C(n, k) is the chance that k samples drawn without replacement from the n are
    all failures. Exact integer binomials: n is a sample count, never large enough to overflow.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def reported_ks(n: int) -> list[int]:
    """The k of the pass@k metrics for n samples per prompt: 1, the powers of two below n, and
    n itself (1, 2, 4, 8, 16 for n = 16; 1, 2, 4, 5 for n = 5)."""
    ks = [1]
    while ks[-1] * 2 < n:
        ks.append(ks[-1] * 2)
    return ks + [n] if n > 1 else ks


@dataclass
class PromptGroup:
    """The samples of one prompt."""

    data_source: str
    index: int                                   # the prompt's position in the eval, from 0
    rewards: list[float] = field(default_factory=list)   # total reward of each sample
    passed: list[bool] = field(default_factory=list)     # `passes` of each sample
    positive: list[float] = field(default_factory=list)  # `positive_reward` of each sample

    def add(self, reward: Reward, loss_mask: Sequence[int]) -> None:
        self.rewards.append(total_reward(reward))
        self.passed.append(passes(reward, loss_mask))
        self.positive.append(positive_reward(reward))

    @property
    def num_passed(self) -> int:
        return sum(self.passed)


def summarize(groups: Sequence[PromptGroup]) -> dict[str, float]:
    """pass_at_<k>, avg_score, mean_positive_reward, accuracy and num_prompts of these prompts
    (metric name -> value).

    pass@k uses the smallest sample count n of the groups, so every prompt has k <= n samples;
    in an eval every prompt gets the same n. Empty input gives {}."""
    if not groups:
        return {}
    n = min(len(g.rewards) for g in groups)
    result: dict[str, float] = {}
    for k in reported_ks(n):
        result[f"pass_at_{k}"] = sum(pass_at_k(len(g.rewards), g.num_passed, k) for g in groups) / len(groups)
    samples = [r for g in groups for r in g.rewards]
    result["avg_score"] = sum(samples) / len(samples)
    result["mean_positive_reward"] = sum(p for g in groups for p in g.positive) / len(samples)
    result["accuracy"] = sum(r >= SOLVED_THRESHOLD for r in samples) / len(samples)
    result["num_prompts"] = len(groups)
    return result


# ------------------------------------------------------------------------------------ accumulator
@dataclass
class EvalAccumulator:
    """Collects scored eval samples batch by batch; `metrics()` summarizes, `dump()` writes them.

    Usage, per generated batch:

        acc.add(data_sources, inp, out, decode)

    with one data source per trajectory of `out` (the name it is reported under), the batch's
    input `inp` and `decode` turning token ids into text (the tokenizer's `decode`).
    """

    groups: dict[tuple, PromptGroup] = field(default_factory=dict)   # insertion order = prompt order
    records: list[dict[str, Any]] = field(default_factory=list)
    _calls: int = 0

    def add(self, data_sources: Sequence[str], inp: GeneratorInput, out: GeneratorOutput,
            decode: Callable[[list[int]], str]) -> None:
        """Score one generated batch and keep a record per sample.

        Samples with the same uid (`out.uids`) are the n samples of one prompt. They group within
        this call only: a prompt's samples are generated together, and a uid may come again in
        another batch. Rewards may be numbers or per-token lists (multi-turn); a trajectory's
        reward is their sum, and whether it passes is read from the last token's (SkyRL's rule,
        `passes`).

        A record holds SkyRL-Train's fields (`input_prompt` and `output_response`: the decoded
        token ids, special tokens kept; `score`: the reward as the generator gave it; `stop_reason`,
        `env_class`, `env_extras`, `data_source`) and Ridgeline's: `prompt_index`, `sample_index`,
        `passed`, `parsed` (the answer the env read), `ground_truth`, `num_tokens`.
        """
        self._calls += 1
        size = len(data_sources)
        if len(out) != size or len(inp.env_classes) != size:
            raise ValueError(f"EvalAccumulator.add: {size} data sources for {len(inp.env_classes)} inputs and "
                             f"{len(out)} trajectories")
        uids = out.uids
        for i, source in enumerate(data_sources):
            key = (self._calls, uids[i])   # the call number scopes a uid to its batch
            group = self.groups.get(key)
            if group is None:
                group = self.groups[key] = PromptGroup(source, index=len(self.groups))
            group.add(out.rewards[i], out.loss_masks[i])
            passed = group.passed[-1]
            metadata = out.step_metadata[i] if i < len(out.step_metadata) else {}
            extras = inp.env_extras[i]
            truth = (extras.get("reward_spec") or {}).get("ground_truth")
            if truth is None:  # e.g. an env that reads it from elsewhere reports it in its metadata
                truth = metadata.get("ground_truth")
            self.records.append({
                "input_prompt": decode(out.prompt_token_ids[i]), "output_response": decode(out.response_ids[i]),
                "score": out.rewards[i], "stop_reason": out.stop_reasons[i], "env_class": inp.env_classes[i],
                "env_extras": extras, "data_source": source,
                "prompt_index": group.index, "sample_index": len(group.rewards) - 1, "passed": passed,
                "parsed": metadata.get("parsed"), "ground_truth": truth, "num_tokens": len(out.response_ids[i]),
            })

    def metrics(self) -> dict[str, float]:
        """`eval/<source>/<metric>` for every data source (sorted) and `eval/all/<metric>`."""
        by_source: dict[str, list[PromptGroup]] = {}
        for group in self.groups.values():
            by_source.setdefault(group.data_source, []).append(group)
        result: dict[str, float] = {}
        for source in sorted(by_source):
            for name, value in summarize(by_source[source]).items():
                result[f"eval/{metric_key(source)}/{name}"] = value
        for name, value in summarize(list(self.groups.values())).items():
            result[f"eval/all/{name}"] = value
        return result

    def dump(self, folder: Path, extra_metrics: dict[str, float] | None = None,
             owner: DumpOwner | None = None) -> Path:
        """SkyRL's dump files in `folder` (`ridgeline.tracking.dumps.write_eval_dump`): one
        `<data_source>.jsonl` per data source, every sample's record, and `aggregated_results.jsonl`,
        the metrics plus `extra_metrics` (e.g. timings); `owner`: the training run writing it.
        Returns the folder."""
        return write_eval_dump(folder, self.records, {**self.metrics(), **(extra_metrics or {})}, owner=owner)


# ------------------------------------------------------------------------------------ the eval loop
def run_eval(generator: Generator, rows: Sequence[tuple[str, PromptRow]], cfg: RidgelineConfig, *,
             env_override: str | None = None, global_step: int = 0) -> tuple[dict[str, float], EvalAccumulator]:
    """Score `rows` ((label, row) pairs: the label is the data source a row is reported under) in
    batches of `trainer.eval_batch_size`, `generator.eval_n_samples_per_prompt` samples each with
    `generator.eval_sampling_params`; the truncation policy's eval rule applies
    (`zero_reward_on_non_stop`). Returns the metrics (`eval/...` and `timing/eval`) and the
    accumulator holding every sample. `Trainer.evaluate` and `ridgeline eval` both run this.

    Batch b samples with `derive_seed(trainer.seed, "eval", b)`, the same at every step, so evals
    of successive steps differ by the policy, not by the dice."""
    t0 = time.perf_counter()
    params = SamplingParams.from_config(cfg.generator.eval_sampling_params)
    n = cfg.generator.eval_n_samples_per_prompt
    batch_size = cfg.trainer.eval_batch_size
    policy = truncation_policy(cfg.generator, cfg.trainer.algorithm)
    acc = EvalAccumulator()
    num_batches = -(-len(rows) // batch_size)
    for b in range(num_batches):
        batch = rows[b * batch_size:(b + 1) * batch_size]
        inp = generator_input([row for _, row in batch], n, params, uid_prefix=f"{global_step}-eval{b}", mode="eval",
                              env_override=env_override, global_step=global_step)
        out = generator.generate(inp, seed=derive_seed(cfg.trainer.seed, "eval", b))
        out.rewards = apply_truncation_policy(out.stop_reasons, [len(r) for r in out.response_ids], out.rewards,
                                              out.loss_masks, policy, training=False).rewards
        acc.add([label for label, _ in batch for _ in range(n)], inp, out,
                lambda ids: decode_text(generator.tokenizer, ids))
        log.info("eval batch %d/%d: %d prompts x %d samples", b + 1, num_batches, len(batch), n)
    return {**acc.metrics(), "timing/eval": time.perf_counter() - t0}, acc
