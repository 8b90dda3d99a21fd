"""The single-turn generator: chat prompt -> token ids -> engine -> text -> environment -> reward.

Token-in/token-out: the prompt is tokenized once with the chat template, the engine returns token
ids and their logprobs, and the trainer trains on exactly those ids; text is decoded only for the
environment. An environment that raises costs its trajectory the reward (0), is counted in the
metrics and logged once with its traceback; the run goes on.
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import Any

from transformers import PreTrainedTokenizerBase

from ridgeline import envs
from ridgeline.data import encode_chat_prompt
from ridgeline.generation.types import GeneratorInput, GeneratorOutput
from ridgeline.inference.types import EngineRequest, InferenceEngine

log = logging.getLogger(__name__)


class SingleTurnGenerator:
    def __init__(self, engine: InferenceEngine, tokenizer: PreTrainedTokenizerBase, *,
                 env_settings: dict[str, dict[str, Any]] | None = None,
                 zero_reward_on_non_stop: bool = False):
        self.engine = engine
        self.tokenizer = tokenizer
        self.env_settings = env_settings or {}
        self.zero_reward_on_non_stop = zero_reward_on_non_stop
        self._logged_env_errors: set[str] = set()

    def encode_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return encode_chat_prompt(self.tokenizer, messages)

    def generate(self, inp: GeneratorInput, seed: int | None = None) -> GeneratorOutput:
        t0 = time.perf_counter()
        environments = [envs.make(cls, extras=extras, **self.env_settings.get(cls, {}))
                        for cls, extras in zip(inp.env_classes, inp.env_extras)]
        prompt_ids = []
        for env, prompt in zip(environments, inp.prompts):
            messages, _ = env.init(prompt)
            prompt_ids.append(self.encode_prompt(messages))
        requests = [EngineRequest(p, inp.sampling_params) for p in prompt_ids]
        results = self.engine.generate(requests, seed=seed)
        t_engine = time.perf_counter() - t0

        texts = self.tokenizer.batch_decode([r.response_ids for r in results], skip_special_tokens=True)
        rewards, env_errors, zeroed = [], 0, 0
        for env, text, result in zip(environments, texts, results):
            reward = self._reward(env, text)
            if reward is None:
                env_errors += 1
                reward = 0.0
            if self.zero_reward_on_non_stop and result.stop_reason != "stop" and reward != 0.0:
                zeroed += 1
                reward = 0.0
            rewards.append(reward)
            env.close()
        metrics = {
            "generate/env_errors": float(env_errors),
            "generate/zeroed_non_stop": float(zeroed),
            "generate/engine_seconds": t_engine,
            "generate/env_seconds": time.perf_counter() - t0 - t_engine,
        }
        return GeneratorOutput(
            prompt_token_ids=prompt_ids,
            response_ids=[r.response_ids for r in results],
            rewards=rewards,
            loss_masks=[[1] * len(r.response_ids) for r in results],
            stop_reasons=[r.stop_reason for r in results],
            rollout_logprobs=[r.logprobs for r in results],
            responses=texts,
            metrics=metrics,
        )

    def _reward(self, env: envs.Env, text: str) -> float | None:
        try:
            out = env.step(text)
            reward = float(out.reward)
            if reward != reward:  # NaN from a user reward function is junk, not a score
                raise ValueError(f"environment returned a NaN reward for {text[:80]!r}")
            return reward
        except Exception:
            name = type(env).__name__
            if name not in self._logged_env_errors:
                self._logged_env_errors.add(name)
                log.error("environment %s raised; the trajectory gets reward 0 (logged once per env, "
                          "counted in generate/env_errors):\n%s", name, traceback.format_exc())
            return None
