"""The real in-process `SGLangEngine` (SGLang 0.5.23 on its CPU backend) on a tiny model, checked
against the embedded `HFEngine` on the same float32 weights: sampled tokens and their logprobs,
`n` samples of a prompt, greedy decoding, stop token ids and stop strings, prefix caching on and
off, weight updates (`update_weights_from_tensor`, and an update group over gloo with
`update_weights_from_distributed`, both inside 0.5.23's begin/end_weight_update session) checked
by the stale-weights probe, and sleep / wake through release / resume_memory_occupation.
Not in the default suite: `make test-sglang` runs it in its own virtual environment (.venv-sglang).

Two engines, one after the other: prefix caching on with the tokenizer loaded (the config has a
stop string, so SGLang detokenizes), and prefix caching off with `skip_tokenizer_init` (token ids
only) - SGLang's two output paths.

Tolerance (max |diff| measured here: SGLang's torch_native attention in float32 against
transformers' eager attention): 4.8e-7 on sampled-token logprobs (temperature 1 and 0.7), `score`
and greedy logprobs; held to 1e-4, far below what a stale or wrong weight does (the 0.05 weight
noise below moves them by ~1). The stale-weights probe holds float32 engines to 1e-5 (max).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ridgeline.config import load_config
from ridgeline.distributed.weight_sync import (GroupSpec, StaleWeightsError, TensorBroadcaster, check_probe,
                                               probe_logprobs, probe_tokens, probe_tolerance)
from ridgeline.inference.hf_engine import HFEngine
from ridgeline.inference.sglang_engine import SGLangEngine
from ridgeline.inference.types import EngineError, EngineRequest, SamplingParams
from ridgeline.inference.weight_transport import free_port
from ridgeline.models.loading import load_model, load_tokenizer
from ridgeline.training.build import policy_spec

from sglang_checks import (PROMPT_TEXT, TOLERANCE, check_prefix_caching, check_stop_string, check_stop_token_ids,
                           max_diff, stop_string_request, tiny_run, train_steps_then_probe)

pytestmark = pytest.mark.sglang

SETTINGS = {
    "cache_on_tokenizer": ["generator.enable_prefix_caching=true", "generator.sampling_params.stop=['</answer>']"],
    "cache_off_ids_only": ["generator.enable_prefix_caching=false"],
}


def run_config(*overrides: str):
    return load_config([
        "trainer.strategy=single", "generator.backend=sglang", "trainer.logger=console",
        "trainer.policy.model.path=tiny://llama-h64",  # head_dim 64, as the vLLM tests use
        "generator.model_dtype=float32", "generator.inference_engine_tensor_parallel_size=1",
        "trainer.max_prompt_length=128", "generator.sampling_params.max_generate_length=32",
        "generator.max_num_seqs=16", "generator.max_num_batched_tokens=256",
        "+generator.engine_init_kwargs.log_level=warning", *overrides,
    ])


@pytest.fixture(scope="module", params=list(SETTINGS))
def setup(request):
    pytest.importorskip("sglang.srt.entrypoints.engine")
    cfg = run_config(*SETTINGS[request.param])
    tokenizer = load_tokenizer(policy_spec(cfg))
    engine = SGLangEngine.from_config(cfg, tokenizer)
    model = load_model(policy_spec(cfg), torch.float32, tokenizer)
    reference = HFEngine(model, tokenizer, dtype=torch.float32)
    prompt = tokenizer(PROMPT_TEXT, add_special_tokens=False)["input_ids"]
    yield request.param, engine, reference, model, tokenizer, prompt
    engine.close()



def perturbed(model, seed: int) -> list[tuple[str, torch.Tensor]]:
    noise = torch.Generator().manual_seed(seed)
    return [(n, p.detach() + 0.05 * torch.randn(p.shape, generator=noise)) for n, p in model.named_parameters()]


def test_the_cpu_backend_settings_reach_sglang(setup):
    name, engine, *_ = setup
    kw = engine.engine_kwargs
    assert (kw["device"], kw["attention_backend"], kw["disable_overlap_schedule"]) == ("cpu", "torch_native", True)
    assert kw["enable_memory_saver"] is False and kw["disable_radix_cache"] is (name == "cache_off_ids_only")
    assert kw["skip_tokenizer_init"] is (name == "cache_off_ids_only")


def test_n_samples_and_their_logprobs_match_the_embedded_engine(setup):
    _, engine, reference, model, _, prompt = setup
    params = SamplingParams(max_generate_length=24, temperature=1.0)
    outs = engine.generate([EngineRequest(prompt, params)] * 4, seed=1)
    assert len({tuple(o.response_ids) for o in outs}) > 1  # the samples of one prompt differ
    for out in outs:
        assert len(out.logprobs) == len(out.response_ids) and out.stop_reason in ("stop", "length")
        assert max_diff(out.logprobs, reference.score(prompt, out.response_ids)) < TOLERANCE
    # temperature-scaled, unfiltered logprobs (the logprob contract)
    out = engine.generate([EngineRequest(prompt, SamplingParams(max_generate_length=8, temperature=0.7))])[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.response_ids])).logits[0, len(prompt) - 1:-1].float()
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(out.response_ids)[:, None]).squeeze(-1)
    assert max_diff(out.logprobs, expected.tolist()) < TOLERANCE


def test_score_and_greedy_decoding_match_the_embedded_engine(setup):
    _, engine, reference, _, _, prompt = setup
    response = prompt[5:17]
    assert max_diff(engine.score(prompt, response), reference.score(prompt, response)) < TOLERANCE
    greedy = [EngineRequest(prompt, SamplingParams(max_generate_length=16, temperature=0.0))]
    ours, theirs = engine.generate(greedy)[0], reference.generate(greedy)[0]
    assert (ours.response_ids, ours.stop_reason) == (theirs.response_ids, theirs.stop_reason)
    assert max_diff(ours.logprobs, theirs.logprobs) < TOLERANCE


def test_stop_token_ids_end_the_response_as_in_the_embedded_engine(setup):
    _, engine, reference, _, _, prompt = setup
    check_stop_token_ids(engine, reference, prompt)


def test_stop_strings_need_the_tokenizer_and_end_the_response_there(setup):
    name, engine, reference, _, tokenizer, prompt = setup
    request, stop = stop_string_request(reference, tokenizer, prompt)
    if name == "cache_off_ids_only":  # built with skip_tokenizer_init: SGLang would not match it
        with pytest.raises(EngineError, match=r"stop strings.*generator.sampling_params.stop"):
            engine.generate(request)
        return
    check_stop_string(engine, reference, tokenizer, request, stop)


def cached_tokens(engine, prompt: list[int]) -> int:
    """SGLang's own count of prompt tokens served from its radix cache, for one greedy request."""
    out = engine.engine.generate(input_ids=[prompt], sampling_params=[{"max_new_tokens": 2, "temperature": 0.0}])
    return int(out[0]["meta_info"]["cached_tokens"])


def test_prefix_caching_on_and_off(setup):
    name, engine, reference, _, _, prompt = setup
    check_prefix_caching(engine, reference, prompt * 3, cached_tokens, cache_on=name == "cache_on_tokenizer")


def test_update_weights_from_tensor_then_the_probe_passes_and_a_skipped_sync_is_caught(setup):
    _, engine, reference, model, tokenizer, _ = setup
    prompt_ids, response_ids = probe_tokens(tokenizer)
    tolerance = probe_tolerance(engine.dtype)
    original = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    before = torch.tensor(engine.score(prompt_ids, response_ids))
    engine.update_batch_bytes = 64 * 1024  # several update_weights_from_tensor calls in one session
    try:
        for step in (1, 2):
            new = perturbed(model, step)
            model.load_state_dict(dict(new), strict=False)
            engine.update_weights(new)   # what InProcessWeightSync does after a training step
            trainer = probe_logprobs(model, prompt_ids=prompt_ids, response_ids=response_ids)
            check_probe(trainer, torch.tensor(engine.score(prompt_ids, response_ids)), tolerance, step)
            assert (trainer - before).abs().max() > 0.1   # the weights really moved
        # a training step whose sync is skipped: the probe sees the engine's stale weights
        model.load_state_dict(dict(perturbed(model, 3)), strict=False)
        trainer = probe_logprobs(model, prompt_ids=prompt_ids, response_ids=response_ids)
        with pytest.raises(StaleWeightsError, match="after weight sync version 3"):
            check_probe(trainer, torch.tensor(engine.score(prompt_ids, response_ids)), tolerance, 3)
    finally:
        model.load_state_dict(dict(original), strict=False)
        engine.update_weights(original)
    assert max_diff(engine.score(prompt_ids, response_ids), before.tolist()) < TOLERANCE / 10


def test_update_group_over_gloo_with_update_weights_from_distributed(setup):
    """SGLang's distributed update path: the engine's scheduler joins an update group whose rank 0
    is Ridgeline's `TensorBroadcaster` (the trainer side of the remote client), and loads what it
    broadcasts."""
    _, engine, reference, model, tokenizer, _ = setup
    prompt_ids, response_ids = probe_tokens(tokenizer)
    spec = GroupSpec(port=free_port(), rank=0, world_size=2, backend="gloo", timeout_s=60.0, group_name="rl_test")
    original = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    new = perturbed(model, 4)
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(engine.init_weights_update_group, spec.host, spec.port, 1, 2, spec.group_name, "gloo")
        sender = TensorBroadcaster(spec)
        joined.result(timeout=60)
        try:
            received = pool.submit(engine.update_weights_from_distributed, [n for n, _ in new],
                                   [t.dtype for _, t in new], [list(t.shape) for _, t in new], spec.group_name)
            sender.send_tensors(t for _, t in new)
            received.result(timeout=60)
        finally:
            engine.destroy_weights_update_group(spec.group_name)
            sender.close()
    try:
        model.load_state_dict(dict(new), strict=False)
        trainer = probe_logprobs(model, prompt_ids=prompt_ids, response_ids=response_ids)
        check_probe(trainer, torch.tensor(engine.score(prompt_ids, response_ids)), probe_tolerance(engine.dtype))
    finally:
        model.load_state_dict(dict(original), strict=False)
        engine.update_weights(original)


def test_sleep_and_wake_call_release_and_resume_with_tags(setup, caplog):
    """On SGLang's CPU backend release / resume_memory_occupation run (they flush the KV cache, which
    the radix cache shows) and free nothing; the engine refuses work until both tags are awake."""
    name, engine, _, model, _, prompt = setup
    greedy = [EngineRequest(prompt, SamplingParams(max_generate_length=8, temperature=0.0))]
    before = engine.generate(greedy)[0].response_ids
    long_prompt = prompt * 3
    cached_tokens(engine, long_prompt)
    with caplog.at_level(logging.INFO, logger="ridgeline.inference.sglang_engine"):
        for level in (1, 2):
            engine.sleep(level)
            assert engine._released == (["kv_cache"] if level == 1 else ["kv_cache", "weights", "cuda_graph"])
            with pytest.raises(EngineError, match="asleep"):
                engine.generate(greedy)
            if level == 2:  # a weight sync wakes the weights itself, then loads them
                engine.update_weights([(n, p.detach()) for n, p in model.named_parameters()])
            else:
                engine.wake_up(("weights",))
            with pytest.raises(EngineError, match=r"asleep \(kv_cache released\)"):
                engine.generate(greedy)
            engine.wake_up()
            assert engine._released == [] and engine.generate(greedy)[0].response_ids == before
    assert caplog.text.count("free nothing there") == 1  # said once per engine
    # releasing the KV cache flushed the radix cache: of the long prompt only the prefix the last
    # greedy request cached again (the prompt) is left, not the whole of it as before
    assert cached_tokens(engine, long_prompt) <= len(prompt) < len(long_prompt) - 1
    with pytest.raises(EngineError, match="level must be 1 or 2"):
        engine.sleep(3)


def test_training_steps_sync_into_the_engine_and_a_skipped_sync_is_caught(tmp_path):
    """`generator.backend=sglang` in a real run: the trainer's `InProcessWeightSync` puts each step's
    weights into the engine (update_weights_from_tensor in a begin/end session), checked by the
    probe; a skipped sync is caught."""
    cfg = tiny_run(tmp_path, "+generator.engine_init_kwargs.log_level=warning")
    metrics = train_steps_then_probe(cfg)
    assert metrics["timing/sync_weights"] > 0
