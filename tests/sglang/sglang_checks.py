"""Checks shared by the two SGLang routes of tests/sglang (the in-process engine and a server)."""

from __future__ import annotations

import pytest
import torch

from ridgeline.config import load_config
from ridgeline.distributed.weight_sync import StaleWeightsError, check_probe, probe_logprobs, probe_tokens, probe_tolerance
from ridgeline.inference.types import EngineRequest, SamplingParams
from ridgeline.trainer.trainer import Trainer

# head_dim 64, as the vLLM tests use; SGLang's torch_native attention takes any, the fp32 weights
# are what matters (trainer.seed 42 seeds them, here and in the folder a server loads)
MODEL = "tiny://llama-h64"
PROMPT_TEXT = "Probe: 12 + 30 = 42. The quick brown fox"
# max |SGLang logprob - embedded engine| measured ~4.8e-7 (fp32, torch_native attention against
# transformers' eager attention); 1e-4 is far below what a stale or wrong weight does (~1e-1 and more)
TOLERANCE = 1e-4


def max_diff(a, b) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def check_prefix_caching(engine, reference, long_prompt: list[int], cached_tokens, cache_on: bool) -> None:
    """SGLang's radix cache serves a repeated prompt (`cached_tokens(engine, prompt)`: SGLang's own
    count) only when on; the samples of one prompt score as in the embedded engine either way."""
    first, again = cached_tokens(engine, long_prompt), cached_tokens(engine, long_prompt)
    if cache_on:
        assert again >= len(long_prompt) - 1 > first  # the repeat is served from the cache
    else:
        assert first == again == 0
    outs = engine.generate([EngineRequest(long_prompt, SamplingParams(max_generate_length=8))] * 3, seed=3)
    for out in outs:
        assert max_diff(out.logprobs, reference.score(long_prompt, out.response_ids)) < TOLERANCE


def check_stop_token_ids(engine, reference, prompt: list[int]) -> None:
    """A stop token id ends the response as in the embedded engine: kept, stop reason "stop"."""
    greedy = SamplingParams(max_generate_length=16, temperature=0.0)
    free = reference.generate([EngineRequest(prompt, greedy)])[0].response_ids
    stop = free[3]
    request = [EngineRequest(prompt, greedy, stop_token_ids=(stop,))]
    ours, theirs = engine.generate(request)[0], reference.generate(request)[0]
    assert ours.response_ids == theirs.response_ids == free[:free.index(stop) + 1]  # the stop token is kept
    assert ours.stop_reason == theirs.stop_reason == "stop" and ours.matched_stop is None


def stop_string_request(reference, tokenizer, prompt: list[int]) -> tuple[list[EngineRequest], str]:
    """A greedy request whose stop string is two characters its free response contains."""
    greedy = SamplingParams(max_generate_length=24, temperature=0.0)
    text = tokenizer.decode(reference.generate([EngineRequest(prompt, greedy)])[0].response_ids,
                            skip_special_tokens=True)
    stop = text[6:8]
    return [EngineRequest(prompt, SamplingParams(max_generate_length=24, temperature=0.0, stop=(stop,)))], stop


def check_stop_string(engine, reference, tokenizer, request: list[EngineRequest], stop: str) -> None:
    """The stop string ends the response where the embedded engine ends it, kept and reported."""
    ours, theirs = engine.generate(request)[0], reference.generate(request)[0]
    assert ours.response_ids == theirs.response_ids and (ours.stop_reason, ours.matched_stop) == ("stop", stop)
    assert tokenizer.decode(ours.response_ids, skip_special_tokens=True).endswith(stop)  # the string is kept
    assert max_diff(ours.logprobs, theirs.logprobs) < TOLERANCE


def tiny_run(tmp_path, *overrides: str):
    """`+experiment=tiny` on SGLang: 2 steps of 16 prompts x 8 samples, fp32 everywhere."""
    return load_config(["+experiment=tiny", f"trainer.run_dir={tmp_path}", f"trainer.export_path={tmp_path}", "generator.backend=sglang",
                        f"trainer.policy.model.path={MODEL}", "generator.model_dtype=float32",
                        "data.prepare.num_train=32", *overrides])


class _SkippedSync:
    """A weight sync that sends nothing: the bug the stale-weights probe is there to catch."""

    def sync(self, version: int) -> dict[str, float]:
        return {}


def train_steps_then_probe(cfg) -> dict[str, float]:
    """Two real training steps (rollouts from SGLang, a GRPO update, the step's weight sync): after
    the first the engine scores the probe as the trainer's policy does; the second step's sync is
    skipped, and the probe catches the stale engine. The first step's metrics are returned."""
    trainer = Trainer.from_config(cfg)
    try:
        tokenizer, engine, policy = trainer.tokenizer, trainer.engine, trainer.workers.policy.model
        prompt_ids, response_ids = probe_tokens(tokenizer)
        tolerance = probe_tolerance(engine.dtype)
        before = torch.tensor(engine.score(prompt_ids, response_ids))
        batches = trainer._remaining_batches()

        def step() -> dict[str, float]:
            rows = next(batches)[2]   # before the step count moves: the batches left are counted from it
            trainer.run.global_step += 1
            return trainer.train_step(rows)

        metrics = step()
        trainer_lp = probe_logprobs(policy, prompt_ids=prompt_ids, response_ids=response_ids)
        engine_lp = torch.tensor(engine.score(prompt_ids, response_ids))
        check_probe(trainer_lp, engine_lp, tolerance, 1)
        assert (engine_lp - before).abs().max() > 1e-3, "the training step did not move the engine's logprobs"

        trainer.weight_sync = _SkippedSync()
        step()
        trainer_lp = probe_logprobs(policy, prompt_ids=prompt_ids, response_ids=response_ids)
        with pytest.raises(StaleWeightsError, match="after weight sync version 2"):
            check_probe(trainer_lp, torch.tensor(engine.score(prompt_ids, response_ids)), tolerance, 2)
        return metrics
    finally:
        trainer.close()
