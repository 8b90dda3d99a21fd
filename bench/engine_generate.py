"""Embedded engine throughput on SmolLM2-135M: the quickstart's rollout shape (8 prompts x 8
samples x 16 new tokens, sampled) and its eval shape (200 prompts, greedy, 16 new tokens),
in bf16 (SDPA and eager attention) and fp32. Prints medians of --repeats runs.

    OMP_NUM_THREADS=1 python bench/engine_generate.py [--repeats 3]
"""

from __future__ import annotations

import argparse

import torch
from common import load_smollm2, median_seconds, sum_prompts

from ridgeline.inference.hf_engine import HFEngine
from ridgeline.inference.types import EngineRequest, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, tokenizer = load_smollm2()
    rollout_prompts = sum_prompts(tokenizer, 8)
    eval_prompts = sum_prompts(tokenizer, 200, seed=1)
    for dtype, attn in ((torch.bfloat16, "sdpa"), (torch.bfloat16, "eager"), (torch.float32, "sdpa")):
        engine = HFEngine(model, tokenizer, dtype=dtype, max_num_seqs=64, attn_implementation=attn)
        sampled = SamplingParams(max_generate_length=16, temperature=0.7)
        rollout = [EngineRequest(p, sampled) for p in rollout_prompts for _ in range(8)]
        greedy = SamplingParams(max_generate_length=16, temperature=0.0)
        evals = [EngineRequest(p, greedy) for p in eval_prompts]
        t_rollout = median_seconds(lambda: engine.generate(rollout, seed=0), args.repeats)
        t_eval = median_seconds(lambda: engine.generate(evals), max(1, args.repeats // 2), warmup=0)
        tokens = sum(len(o.response_ids) for o in engine.generate(rollout, seed=0))
        print(f"{str(dtype):15s} {attn:5s} rollout 64x16: {t_rollout:6.2f} s ({tokens / t_rollout:6.1f} new tok/s)   "
              f"eval 200x16 greedy: {t_eval:6.2f} s")


if __name__ == "__main__":
    main()
