"""The embedded engine's sleep/wake on CUDA, on Qwen2.5-0.5B's architecture in bf16 (random
weights, `random://qwen2.5-0.5b`): sleeping frees at least 90% of the GPU memory the awake engine
holds, and after waking the engine generates exactly what it generated before sleeping."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from ridgeline.data import encode_chat_prompt
from ridgeline.inference.hf_engine import HFEngine
from ridgeline.inference.types import EngineRequest, SamplingParams
from ridgeline.models.loading import ModelSpec, load_model, load_tokenizer

pytestmark = pytest.mark.gpu

SPEC = ModelSpec("random://qwen2.5-0.5b", seed=0)
SEED = 1234


def test_sleep_frees_the_engine_memory_and_wake_restores_generation(figures):
    tokenizer = load_tokenizer(SPEC)
    gc.collect()
    torch.cuda.empty_cache()
    # What other tests left allocated is not the engine's: measure from here.
    baseline = torch.cuda.memory_allocated()
    model = load_model(SPEC, torch.bfloat16, tokenizer).to("cuda")
    engine = HFEngine(model, tokenizer, dtype=torch.bfloat16)
    del model  # the engine holds its own copy
    gc.collect()

    params = SamplingParams(max_generate_length=32, temperature=1.0)
    prompts = [encode_chat_prompt(tokenizer, [{"role": "user", "content": f"What is {a} + {b}?"}])
               for a, b in [(3, 4), (12, 30), (7, 8), (21, 9)]]
    requests = [EngineRequest(p, params) for p in prompts for _ in range(4)]  # 4 samples per prompt
    before = engine.generate(requests, seed=SEED)
    awake = torch.cuda.memory_allocated() - baseline

    t0 = time.perf_counter()
    engine.sleep()
    torch.cuda.synchronize()
    sleep_seconds = time.perf_counter() - t0
    asleep = torch.cuda.memory_allocated() - baseline

    t0 = time.perf_counter()
    engine.wake_up()
    torch.cuda.synchronize()
    wake_seconds = time.perf_counter() - t0
    after = engine.generate(requests, seed=SEED)

    figures.record("sleep_wake_hf_engine", model="random://qwen2.5-0.5b bf16",
                   engine_awake_gib=awake / 2**30, engine_asleep_gib=asleep / 2**30,
                   freed_fraction=1 - asleep / awake, sleep_seconds=sleep_seconds, wake_seconds=wake_seconds)
    assert awake > 0.9 * 494_032_768 * 2  # at least the bf16 weights were on the GPU
    assert asleep <= 0.10 * awake, (asleep, awake)
    assert {p.device.type for p in engine.model.parameters()} == {"cuda"}
    assert [o.response_ids for o in after] == [o.response_ids for o in before]
    assert len({tuple(o.response_ids) for o in before}) > 1  # sampled, not one repeated answer
