"""Checks shared by the two SGLang routes of tests/sglang (the in-process engine and a server)."""

from __future__ import annotations

import pytest
import torch

from ridgeline.config import load_config
from ridgeline.distributed.weight_sync import StaleWeightsError, check_probe, probe_logprobs, probe_tokens, probe_tolerance
from ridgeline.trainer.trainer import Trainer

# head_dim 64, as the vLLM tests use; SGLang's torch_native attention takes any, the fp32 weights
# are what matters (trainer.seed 42 seeds them, here and in the folder a server loads)
MODEL = "tiny://llama-h64"


def tiny_run(tmp_path, *overrides: str):
    """`+experiment=tiny` on SGLang: 2 steps of 16 prompts x 8 samples, fp32 everywhere."""
    return load_config(["+experiment=tiny", f"trainer.run_dir={tmp_path}", "generator.backend=sglang",
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
            trainer.run.global_step += 1
            return trainer.train_step(next(batches)[2])

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
