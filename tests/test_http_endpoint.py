"""generator.enable_http_endpoint: the run's engine behind `ridgeline serve`'s OpenAI routes, on a
real HTTP server on 127.0.0.1, with the tiny model."""

import json
import re
import socket

import pytest
import requests
import torch
from transformers import AutoTokenizer

from conftest import HANG_GUARD_S, chat_ids, free_port, in_thread, wait_until_inside
from ridgeline.inference.endpoint import EndpointError, EndpointSettings, HttpEndpoint, SharedEngine, check_address
from ridgeline.inference.hf_engine import HFEngine
from ridgeline.inference.server import EngineService, RequestError
from ridgeline.inference.types import EngineError, EngineRequest, SamplingParams
from ridgeline.models.tiny import build_char_tokenizer, build_tiny_model

NAME = "policy-under-training"


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.fixture()
def tok():
    return build_char_tokenizer()


@pytest.fixture()
def engine(tok):
    return HFEngine(build_tiny_model("llama", tok, seed=0), tok, dtype=torch.float32)


def settings(port: int) -> EndpointSettings:
    return EndpointSettings(host="127.0.0.1", port=port, model_name=NAME, model_path="tiny://llama", chat_max_tokens=5)


def greedy(engine, tok, text: str, n: int = 6):
    return engine.generate([EngineRequest(chat_ids(tok, text), SamplingParams(n, temperature=0.0, logprobs=2))],
                           seed=0)[0]


def test_chat_completion_samples_the_engine_on_the_chat_templated_messages(engine, tok):
    service = EngineService(engine, tok, "tiny://llama", served_model_name=NAME, chat_max_tokens=5)
    body = {"model": NAME, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 6,
            "temperature": 0.0, "logprobs": True, "top_logprobs": 2, "return_token_ids": True,
            "include_stop_str_in_output": True}
    answer = service.openai.chat_completions(body)
    ref = greedy(engine, tok, "Say hi.")
    choice = answer["choices"][0]
    assert answer["object"] == "chat.completion" and answer["model"] == NAME
    assert answer["prompt_token_ids"] == chat_ids(tok, "Say hi.")   # the run's chat template, assistant turn open
    assert choice["token_ids"] == ref.response_ids and choice["finish_reason"] == ref.stop_reason
    assert choice["message"] == {"role": "assistant", "content": tok.decode(ref.response_ids, skip_special_tokens=True)}
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [tok.decode([t]) for t in ref.response_ids]
    assert [c["logprob"] for c in content] == pytest.approx(ref.logprobs, abs=1e-6)
    assert [[e["token"] for e in c["top_logprobs"]] for c in content] == \
           [[tok.decode([t]) for t, _ in top] for top in ref.top_logprobs]
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    assert answer["usage"] == {"prompt_tokens": len(answer["prompt_token_ids"]), "completion_tokens": 6,
                               "total_tokens": len(answer["prompt_token_ids"]) + 6}
    # without max_tokens: the run's max_generate_length (chat_max_tokens); n samples, one per choice
    sampled = service.openai.chat_completions({"model": NAME, "messages": body["messages"], "n": 3, "seed": 1})
    assert len(sampled["choices"]) == 3 and sampled["usage"]["completion_tokens"] <= 15
    assert all(c["logprobs"] is None for c in sampled["choices"])
    for bad, words in [({"stream": "yes"}, "stream must be true or false"),
                       ({"chat_template_kwargs": {"chat_template": "{{ 'x' * 9**9 }}"}}, "--trust-request-chat-template"),
                       ({"n": 16385}, "limit of 16384 per request"),
                       ({"tools": []}, r"does not act on: \['tools'\]"),
                       ({"frequency_penalty": 0.5}, "frequency_penalty"),
                       ({"messages": []}, "messages must be a non-empty list"),
                       ({"top_logprobs": 2}, "top_logprobs needs logprobs=true"),
                       ({"n": 0}, "n must be a whole number >= 1")]:
        with pytest.raises(RequestError, match=words):
            service.openai.chat_completions({"model": NAME, "messages": body["messages"], **bad})
    # OpenAI's default penalties change nothing, so they are accepted
    assert service.openai.chat_completions({**body, "presence_penalty": 0, "frequency_penalty": 0})["choices"][0][
               "token_ids"] == ref.response_ids


def test_endpoint_serves_the_openai_routes_refuses_another_model_and_frees_its_port(engine, tok):
    port = free_port()
    endpoint = HttpEndpoint(engine, tok, settings(port))
    endpoint.start()
    url = f"http://127.0.0.1:{port}"
    try:
        messages = [{"role": "user", "content": "Say hi."}]
        r = requests.post(f"{url}/v1/chat/completions", timeout=HANG_GUARD_S,
                          json={"model": NAME, "messages": messages, "max_tokens": 6, "temperature": 0.0})
        assert r.status_code == 200, r.text
        ref = greedy(engine, tok, "Say hi.")
        assert r.json()["choices"][0]["message"]["content"] == tok.decode(ref.response_ids, skip_special_tokens=True)
        assert requests.get(f"{url}/v1/models", timeout=HANG_GUARD_S).json()["data"][0]["id"] == NAME
        r = requests.post(f"{url}/v1/completions", timeout=HANG_GUARD_S,
                          json={"model": NAME, "prompt": chat_ids(tok, "Say hi."), "max_tokens": 6, "temperature": 0.0,
                                "return_token_ids": True})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == ref.response_ids

        # another model name: refused, in OpenAI's error shape (SkyRL's endpoint does the same)
        r = requests.post(f"{url}/v1/chat/completions", timeout=HANG_GUARD_S,
                          json={"model": "tiny://llama", "messages": messages})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["code"] == 400 and error["type"] == "Bad Request" and error["param"] == "model"
        assert f"model 'tiny://llama' is not served here; this server serves '{NAME}'" in error["message"]
        r = requests.post(f"{url}/v1/completions", timeout=HANG_GUARD_S, json={"prompt": [1, 2]})
        assert r.status_code == 400 and "the field `model` is required" in r.json()["error"]["message"]
        # the weight, memory and native routes of `ridgeline serve` are not exposed
        for route in ("/generate", "/update_weights_from_disk", "/release_memory_occupation", "/flush_cache"):
            assert requests.post(f"{url}{route}", json={}, timeout=HANG_GUARD_S).status_code == 404, route
        assert not port_is_free(port)
    finally:
        endpoint.close()
    assert port_is_free(port)
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{url}/health", timeout=HANG_GUARD_S)
    endpoint.close()  # idempotent


def test_a_taken_port_is_refused_in_one_sentence(engine, tok, tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        message = (f"generator.http_endpoint_port={port}: 127.0.0.1:{port} is already in use (another server, or "
                   "another run's endpoint)")
        with pytest.raises(EndpointError, match=re.escape(message)):
            check_address("127.0.0.1", port)
        with pytest.raises(EndpointError, match=re.escape(message)):
            HttpEndpoint(engine, tok, settings(port))
        # a training run refuses before any model loads
        from ridgeline.config import load_config
        from ridgeline.trainer.trainer import Trainer
        cfg = load_config(["+experiment=tiny", f"trainer.export_path={tmp_path}", "generator.enable_http_endpoint=true",
                           f"generator.http_endpoint_port={port}"])
        with pytest.raises(EndpointError, match=re.escape(message)):
            Trainer.from_config(cfg)
        assert not (tmp_path / "tiny").exists()
    with pytest.raises(EndpointError, match="generator.http_endpoint_host=no.such.host.invalid: cannot listen"):
        check_address("no.such.host.invalid", 8000)


def test_requests_wait_while_the_engine_sleeps_or_takes_weights_and_then_see_the_new_ones(engine, tok):
    shared = SharedEngine(engine)
    new_weights = build_tiny_model("llama", tok, seed=1).state_dict()
    before, after_ids = greedy(engine, tok, "Say hi."), None

    # a colocated engine asleep while the trainer trains: a request waits for its new weights
    shared.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        shared.generate([EngineRequest(chat_ids(tok, "Say hi."), SamplingParams(6, 0.0))])  # the loop's own bug fails
    thread, box = in_thread(lambda: greedy(shared, tok, "Say hi."))
    wait_until_inside(thread, "_wait_until_usable")
    assert not box  # waiting
    shared.wake_up(("weights",))
    shared.update_weights(new_weights.items())
    wait_until_inside(thread, "_wait_until_usable")
    assert not box  # the KV cache is still asleep
    shared.wake_up(("kv_cache",))
    thread.join(HANG_GUARD_S)
    after = greedy(engine, tok, "Say hi.")
    assert after.logprobs != pytest.approx(before.logprobs, abs=1e-3)  # the two tiny models differ
    assert box[0][0] == "ok" and box[0][1].logprobs == after.logprobs  # served by the new weights only

    # a weight sync under hold(): requests wait, then see the weights it loaded
    old_weights = build_tiny_model("llama", tok, seed=0).state_dict()
    with shared.hold():
        thread, box = in_thread(lambda: greedy(shared, tok, "Say hi."))
        wait_until_inside(thread, "generate")  # blocked on the lock hold() keeps
        assert not box
        shared.update_weights(old_weights.items())
    thread.join(HANG_GUARD_S)
    assert box[0][0] == "ok" and box[0][1].logprobs == before.logprobs

    # closing releases a waiting request with an error instead of leaving it hanging
    shared.sleep()
    thread, box = in_thread(lambda: greedy(shared, tok, "Say hi."))
    wait_until_inside(thread, "_wait_until_usable")
    shared.close()
    thread.join(HANG_GUARD_S)
    assert box[0][0] == "error" and isinstance(box[0][1], EngineError) and "closed" in str(box[0][1])


JUDGE = '''
import json
import re
from pathlib import Path

import requests

LOG = Path(__file__).with_name("judge.jsonl")


def score(response_text, extras):
    """Asks the policy being trained, over the run's endpoint, about its own answer."""
    url = "http://127.0.0.1:PORT/v1/chat/completions"
    ask = {"messages": [{"role": "user", "content": "Right? " + response_text}], "max_tokens": 3, "temperature": 0.0}
    good = requests.post(url, json={"model": "NAME", **ask}, timeout=120)
    wrong = requests.post(url, json={"model": "tiny://llama", **ask}, timeout=120)
    with LOG.open("a") as f:
        f.write(json.dumps({"good": [good.status_code, good.json()], "wrong": [wrong.status_code, wrong.json()]}) + "\\n")
    return 1.0 if good.status_code == 200 else 0.0
'''


def _judge(tmp_path, port: int) -> list[str]:
    """Overrides for a tiny run whose every reward comes from JUDGE, over an endpoint on `port`."""
    judge = tmp_path / "judge.py"
    judge.write_text(JUDGE.replace("PORT", str(port)).replace("NAME", NAME))
    return ["+experiment=tiny", f"trainer.export_path={tmp_path}", "data.prepare.num_train=4",
            "data.prepare.num_val=2", f"environment.reward_fn={judge}:score", "generator.enable_http_endpoint=true",
            f"generator.http_endpoint_port={port}", f"generator.model_name={NAME}"]


def _judge_calls(tmp_path) -> list[dict]:
    calls = [json.loads(line) for line in (tmp_path / "judge.jsonl").read_text().splitlines()]
    for call in calls:
        status, answer = call["good"]
        assert status == 200 and answer["model"] == NAME and isinstance(answer["choices"][0]["message"]["content"], str)
        status, answer = call["wrong"]
        assert status == 400 and "is not served here" in answer["error"]["message"]
    return calls


def test_a_training_run_serves_its_policy_to_an_env_over_http_and_frees_the_port(tmp_path):
    from ridgeline.config import load_config
    from ridgeline.entrypoints.run import run_training
    from ridgeline.tracking.trackers import read_metrics

    port = free_port()
    cfg = load_config(_judge(tmp_path, port) + [
        "trainer.train_batch_size=4", "trainer.policy_mini_batch_size=4", "generator.n_samples_per_prompt=2",
        "trainer.micro_train_batch_size_per_gpu=8", "trainer.eval_before_train=false"])
    summary = run_training(cfg)
    assert summary["steps"] == 1
    # every trajectory of the step, and the final eval's 2 prompts, asked the policy over HTTP
    assert len(_judge_calls(tmp_path)) == 4 * 2 + 2
    step = next(r for r in read_metrics(tmp_path / "tiny" / "metrics.jsonl") if "reward/avg_raw_reward" in r)
    assert step["reward/avg_raw_reward"] == 1.0
    assert port_is_free(port)  # the endpoint stopped with the run


PARITY = '''
import requests


def score(response_text, extras):
    if PORT:  # an unseeded, sampled request to the run's endpoint, whose answer changes nothing
        requests.post("http://127.0.0.1:PORT/v1/chat/completions", timeout=120, json={
            "model": "NAME", "messages": [{"role": "user", "content": response_text}], "max_tokens": 3}).raise_for_status()
    return float(len(response_text) % 2)
'''


@pytest.mark.integration
def test_requests_to_the_endpoint_leave_the_runs_rollouts_unchanged(tmp_path):
    """The endpoint's requests take turns with the generator and draw their own seeds: a run whose
    environment calls the endpoint trains exactly like the same run without those calls."""
    from ridgeline.config import load_config
    from ridgeline.entrypoints.run import run_training
    from ridgeline.tracking.trackers import read_metrics

    rows = []
    for port in (free_port(), 0):
        out = tmp_path / str(port)
        out.mkdir()
        (out / "score.py").write_text(PARITY.replace("PORT", str(port)).replace("NAME", NAME))
        run_training(load_config([
            "+experiment=tiny", f"trainer.export_path={out}", "data.prepare.num_train=8", "data.prepare.num_val=2",
            "trainer.train_batch_size=4", "trainer.policy_mini_batch_size=4", "generator.n_samples_per_prompt=2",
            "trainer.micro_train_batch_size_per_gpu=8", f"environment.reward_fn={out / 'score.py'}:score",
            f"generator.enable_http_endpoint={port > 0}", f"generator.http_endpoint_port={port or 8000}",
            f"generator.model_name={NAME}"]))
        rows.append([r for r in read_metrics(out / "tiny" / "metrics.jsonl") if "policy/policy_loss" in r])
    with_calls, without = rows
    assert len(with_calls) == len(without) == 2
    for a, b in zip(with_calls, without):
        for key in ("reward/avg_raw_reward", "generate/avg_num_tokens", "policy/policy_loss", "policy/raw_grad_norm"):
            assert a[key] == b[key], key


def test_ridgeline_eval_serves_its_engine_too(tmp_path):
    from ridgeline.config import load_config
    from ridgeline.entrypoints.eval import evaluate_model

    port = free_port()
    report = evaluate_model(load_config(_judge(tmp_path, port)), output=tmp_path / "eval")
    assert len(_judge_calls(tmp_path)) == report.num_samples == 2
    assert report.metrics["eval/all/avg_score"] == 1.0
    assert port_is_free(port)


def test_config_refuses_an_endpoint_that_cannot_listen_or_serve():
    from ridgeline.config import ConfigError, load_config

    base = ["+experiment=tiny", "generator.enable_http_endpoint=true"]
    cfg = load_config(base + ["trainer.policy.model.path=tiny://llama"])
    assert cfg.generator.model_name == "tiny://llama"  # SkyRL's default: the policy's path
    with pytest.raises(ConfigError) as err:
        load_config(base + ["generator.http_endpoint_port=70000", "generator.http_endpoint_host=' '",
                            "generator.model_name=''"])
    assert [p.split(" ")[0] for p in err.value.problems] == [
        "generator.http_endpoint_port=70000", "generator.http_endpoint_host", "generator.model_name"]
    assert "is not a TCP port the endpoint can listen on (1-65535" in str(err.value)
    with pytest.raises(ConfigError, match=re.escape(
            "generator.http_endpoint_port=8001 is the port of the remote engine 127.0.0.1:8001")):
        load_config(base + ["generator.http_endpoint_port=8001", "generator.run_engines_locally=false",
                            "generator.remote_inference_engine_urls=['127.0.0.1:8001']"])
    # nothing is checked while the endpoint is off
    load_config(["+experiment=tiny", "generator.http_endpoint_port=0"])


def test_an_interrupted_run_stops_its_endpoint_and_frees_the_port(tmp_path):
    from ridgeline.config import load_config
    from ridgeline.trainer.trainer import Trainer

    port = free_port()
    trainer = Trainer.from_config(load_config([
        "+experiment=tiny", f"trainer.export_path={tmp_path}", "data.prepare.num_train=16", "trainer.eval_before_train=false",
        "generator.enable_http_endpoint=true", f"generator.http_endpoint_port={port}"]))
    served = []

    def interrupted_step(rows):  # Ctrl-C inside the first step, once the endpoint has answered
        served.append(requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=HANG_GUARD_S).json()["data"][0])
        raise KeyboardInterrupt

    trainer.train_step = interrupted_step
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert [m["id"] for m in served] == ["tiny://llama"]  # generator.model_name's default: the policy's path
    # `root`: a folder AutoTokenizer loads (tiny:// has none of its own)
    assert AutoTokenizer.from_pretrained(served[0]["root"])("Say hi.")["input_ids"] == \
           build_char_tokenizer()("Say hi.")["input_ids"]
    assert port_is_free(port)
