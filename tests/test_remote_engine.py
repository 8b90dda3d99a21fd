"""The remote client (ridgeline.inference.remote) against a real `ridgeline serve` process on
127.0.0.1: generation and logprobs equal to the embedded engine on the same weights, both server
APIs, a weight update applied over a real gloo group, errors that name the URL, retries, bearer
tokens, and a training run whose rollouts come from the server."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from ridgeline.distributed.weight_sync import probe_logprobs
from ridgeline.inference.hf_engine import HFEngine
from ridgeline.inference.remote import (
    RemoteEngine,
    RemoteSettings,
    completion_body,
    native_output,
    normalize_url,
    openai_output,
    spread,
)
from ridgeline.inference.server import EngineService, RequestError, make_http_server
from ridgeline.inference.types import EngineError, EngineRequest, SamplingParams
from ridgeline.models.tiny import build_char_tokenizer, build_tiny_model
from ridgeline.tracking.dumps import read_eval_dump

from conftest import chat_ids, served_engine, serving

MODEL = "tiny://llama"
SEED = 42  # trainer.seed, which also seeds tiny:// models


@pytest.fixture(scope="module")
def server():
    with serving() as url:
        yield url


@pytest.fixture(scope="module")
def local():
    """The embedded engine on the weights the server loads (tiny://llama, seed 42)."""
    return served_engine()


def _client(url: str, api: str = "sglang", **kw) -> RemoteEngine:
    return RemoteEngine(RemoteSettings(urls=(url,), api=api, dtype=torch.float32, weight_sync_backend="gloo",
                                       weight_sync_timeout_s=30.0, **kw))


def _requests(tok, n: int = 3, greedy: bool = False) -> list[EngineRequest]:
    params = SamplingParams(max_generate_length=12, temperature=0.0 if greedy else 1.0)
    prompts = [chat_ids(tok, "What is 2 + 3?"), chat_ids(tok, "Say hi.")]
    return [EngineRequest(p, params) for p in prompts for _ in range(n)]


def _scores(local_engine: HFEngine, reqs, outs) -> list[list[float]]:
    return [local_engine.score(r.prompt_token_ids, o.response_ids) for r, o in zip(reqs, outs)]


@pytest.mark.parametrize("api", ["sglang", "openai"])
def test_generation_matches_the_embedded_engine(server, local, api):
    engine, tok = local
    client = _client(server, api)
    try:
        greedy = _requests(tok, n=1, greedy=True)
        assert [o.response_ids for o in client.generate(greedy, seed=0)] == \
               [o.response_ids for o in engine.generate(greedy, seed=0)]
        reqs = _requests(tok)
        outs = client.generate(reqs, seed=7)
        assert len(outs) == len(reqs) and all(o.response_ids for o in outs)
        assert all(o.stop_reason in ("stop", "length") for o in outs)
        # every sampled token's logprob is the embedded engine's logprob of that token
        for o, ref in zip(outs, _scores(engine, reqs, outs)):
            assert len(o.logprobs) == len(o.response_ids)
            assert torch.allclose(torch.tensor(o.logprobs), torch.tensor(ref), atol=1e-5)
        # seeds make it reproducible, and samples of one prompt differ (each has its own seed)
        again = client.generate(reqs, seed=7)
        assert [o.response_ids for o in again] == [o.response_ids for o in outs]
        assert len({tuple(o.response_ids) for o in outs[:3]}) > 1
        prompt, response = reqs[0].prompt_token_ids, outs[0].response_ids
        assert torch.allclose(torch.tensor(client.score(prompt, response)),
                              torch.tensor(engine.score(prompt, response)), atol=1e-5)
    finally:
        client.close()


def _perturbed(seed: int) -> torch.nn.Module:
    tok = build_char_tokenizer()
    model = build_tiny_model("llama", tok, seed=SEED)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def test_weight_update_over_a_gloo_group_is_applied(server, local):
    engine, tok = local
    client = _client(server)
    try:
        prompt, response = chat_ids(tok, "What is 2 + 3?"), chat_ids(tok, "5")
        before = client.score(prompt, response)
        for version, seed in ((1, 1), (2, 2)):  # the group is built once and reused
            model = _perturbed(seed)
            stats = client.push_weights(model.named_parameters(), version)
            assert stats["bytes"] == sum(p.numel() * 4 for p in model.parameters())
            want = probe_logprobs(model, prompt_ids=prompt, response_ids=response)
            got = torch.tensor(client.score(prompt, response))
            assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
            assert (got - torch.tensor(before)).abs().max() > 1e-3  # the weights really changed
            info = client.request("GET", client.urls[0], "/get_server_info")
            assert info["weight_version"] == str(version)
            # `ridgeline serve` has no /begin_weight_update (as SGLang before 0.5.2x): the 404 is learned
            # once and the weights load without a session (make test-sglang covers a server that has them)
            assert client._group.sessions == {client.urls[0]: False}
        # a second client (a restarted trainer) takes the group over: override_existing_update_group=auto
        other = _client(server)
        try:
            model = build_tiny_model("llama", build_char_tokenizer(), seed=SEED)
            other.push_weights(model.named_parameters(), 3)
            assert torch.allclose(torch.tensor(other.score(prompt, response)), torch.tensor(before), atol=1e-5)
        finally:
            other.close()
    finally:
        client.close()


def test_disabled_override_refuses_an_existing_group(server):
    first, second = _client(server), _client(server, override_existing_update_group="disable")
    try:
        model = build_tiny_model("llama", build_char_tokenizer(), seed=SEED)
        first.push_weights(model.named_parameters(), 1)
        with pytest.raises(EngineError, match="already exists"):
            second.push_weights(model.named_parameters(), 1)
    finally:
        first.close()
        second.close()


def test_unreachable_server_is_named_after_retries():
    with pytest.raises(EngineError) as err:
        RemoteEngine(RemoteSettings(urls=("127.0.0.1:9",), api="sglang", dtype=torch.float32,
                                    max_retries=2, backoff_s=0.05))
    msg = str(err.value)
    assert "http://127.0.0.1:9" in msg and "unreachable" in msg and "3 attempt(s)" in msg  # the retries, counted
    assert "generator.remote_inference_engine_urls" in msg


def test_retries_connection_errors_with_backoff_then_succeeds(local):
    """The server comes up while the client is retrying: the call succeeds and the retries are counted."""
    engine, tok = local
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    servers = []

    def start_late():  # the port refuses connections until now
        servers.append(make_http_server(EngineService(engine, tok, MODEL), "127.0.0.1", port))
        servers[0].serve_forever()

    timer = threading.Timer(0.3, start_late)
    timer.daemon = True
    timer.start()
    try:
        client = RemoteEngine(RemoteSettings(urls=(f"127.0.0.1:{port}",), api="sglang", dtype=torch.float32,
                                             max_retries=10, backoff_s=0.1))  # up to ~100 s: a busy machine's late start
        assert client.retried >= 1
        client.close()
    finally:
        timer.cancel()
        if servers:
            servers[0].shutdown()
            servers[0].server_close()


def test_bearer_token_is_required_and_sent(local, monkeypatch):
    engine, tok = local
    httpd = make_http_server(EngineService(engine, tok, MODEL), api_key="s3cret")
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = "127.0.0.1:%d" % httpd.server_address[1]
    try:
        with pytest.raises(EngineError, match="401 Unauthorized.*RIDGELINE_ENGINE_API_KEY"):
            _client(url)  # /health is open, /get_model_info is not
        client = _client(url, api_key="s3cret")
        assert client.generate(_requests(tok, n=1, greedy=True), seed=0)
        client.close()
        monkeypatch.setenv("RIDGELINE_ENGINE_API_KEY", "s3cret")
        from ridgeline.config import load_config
        cfg = load_config(["trainer.strategy=single", "generator.backend=hf", "trainer.logger=console",
                           "generator.run_engines_locally=false", f"generator.remote_inference_engine_urls=['{url}']"])
        settings = RemoteSettings.from_config(cfg)
        assert settings.api_key == "s3cret" and settings.api == "sglang" and settings.urls == (f"http://{url}",)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_sleep_and_wake_by_tags_through_the_server(local):
    """SGLang's release / resume routes: the client wakes the weights, then the KV cache (with
    SGLang's cuda_graph tag, memory the embedded engine does not have); generation waits for both."""
    _, tok = local
    engine = HFEngine(build_tiny_model("llama", tok, seed=SEED), tok, dtype=torch.float32)
    httpd = make_http_server(EngineService(engine, tok, MODEL))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    client = _client("127.0.0.1:%d" % httpd.server_address[1])
    reqs = _requests(tok, n=1, greedy=True)
    try:
        before = [o.response_ids for o in client.generate(reqs, seed=0)]
        client.sleep()
        with pytest.raises(EngineError, match="500.*asleep"):
            client.generate(reqs, seed=0)
        client.wake_up(("weights",))
        with pytest.raises(EngineError, match=r"asleep \(kv_cache released\)"):
            client.generate(reqs, seed=0)
        client.wake_up()  # what is still asleep: the KV cache
        client.wake_up()  # nothing: no request, no error
        assert [o.response_ids for o in client.generate(reqs, seed=0)] == before
        with pytest.raises(EngineError, match=r"400.*tags=\['kv'\] must be a list of"):
            client.request("POST", client.urls[0], "/resume_memory_occupation", {"tags": ["kv"]})
        with pytest.raises(EngineError, match="400.*releases the weights and the KV cache together"):
            client.request("POST", client.urls[0], "/release_memory_occupation", {"tags": ["kv_cache"]})
    finally:
        client.close()
        httpd.shutdown()
        httpd.server_close()


def test_bad_requests_get_clear_answers(server):
    client = _client(server)
    try:
        with pytest.raises(EngineError, match="400.*either text .* or input_ids"):
            client.request("POST", client.urls[0], "/generate", {"text": "hello", "input_ids": [1, 2]})
        with pytest.raises(EngineError, match="400.*not supported by ridgeline serve.*frequency_penalty"):
            client.request("POST", client.urls[0], "/generate",
                           {"input_ids": [1, 2], "sampling_params": {"frequency_penalty": 1.0}})
        with pytest.raises(EngineError, match="404"):
            client.request("POST", client.urls[0], "/no_such_route", {})
    finally:
        client.close()


def test_spread_and_urls():
    assert spread(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert spread(2, 3) == [(0, 1), (1, 2), (2, 2)]
    assert normalize_url("10.0.0.2:30000/") == "http://10.0.0.2:30000"
    assert normalize_url("https://h:1") == "https://h:1"


def test_requests_spread_over_two_servers(server, local):
    engine, tok = local
    httpd = make_http_server(EngineService(engine, tok, MODEL))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    second = "127.0.0.1:%d" % httpd.server_address[1]
    client = RemoteEngine(RemoteSettings(urls=(server, second), api="sglang", dtype=torch.float32))
    try:
        reqs = _requests(tok, n=2, greedy=True)
        outs = client.generate(reqs, seed=0)
        assert [o.response_ids for o in outs] == [o.response_ids for o in engine.generate(reqs, seed=0)]
    finally:
        client.close()
        httpd.shutdown()
        httpd.server_close()


def test_eval_through_a_remote_server_scores_like_the_embedded_engine(server, tmp_path):
    from ridgeline.config import load_config
    from ridgeline.entrypoints.eval import CheckpointArgumentError, evaluate_model

    client = _client(server)  # the server may hold weights an earlier test pushed: restore them
    client.update_weights(build_tiny_model("llama", build_char_tokenizer(), seed=SEED).named_parameters())
    client.close()
    base = ["+experiment=tiny", f"trainer.export_path={tmp_path}", "data.prepare.num_train=16",
            "generator.model_dtype=float32", "generator.eval_sampling_params.temperature=0.0"]
    remote_cfg = base + ["generator.run_engines_locally=false", f"generator.remote_inference_engine_urls=['{server}']"]
    local = evaluate_model(load_config(base), output=tmp_path / "local")
    remote = evaluate_model(load_config(remote_cfg), output=tmp_path / "remote")
    assert remote.metrics["eval/all/avg_score"] == local.metrics["eval/all/avg_score"]
    responses = [[r["output_response"] for r in read_eval_dump(tmp_path / d)] for d in ("local", "remote")]
    assert responses[0] == responses[1] and len(responses[0]) == 16
    with pytest.raises(CheckpointArgumentError, match="the servers score the weights they hold"):
        evaluate_model(load_config(remote_cfg), checkpoint=tmp_path, output=tmp_path / "x")


def test_a_run_starts_by_pushing_its_weights_to_the_servers(server, tmp_path):
    """A server launched with other weights is corrected before the first rollout."""
    from ridgeline.config import load_config
    from ridgeline.trainer.trainer import Trainer

    client = _client(server)
    client.update_weights(_perturbed(3).named_parameters())
    client.close()
    cfg = load_config(["+experiment=tiny", f"trainer.run_dir={tmp_path}", f"trainer.export_path={tmp_path}", "generator.model_dtype=float32",
                       "generator.run_engines_locally=false", f"generator.remote_inference_engine_urls=['{server}']"])
    trainer = Trainer.from_config(cfg)
    try:
        tok = trainer.tokenizer
        prompt, response = chat_ids(tok, "What is 2 + 3?"), chat_ids(tok, "5")
        want = probe_logprobs(trainer.workers.policy.model, prompt_ids=prompt, response_ids=response)
        assert torch.allclose(torch.tensor(trainer.engine.score(prompt, response)), want, atol=1e-5)
    finally:
        trainer.close()


@pytest.mark.integration
def test_training_with_rollouts_from_a_remote_server(server, tmp_path):
    """A tiny GRPO run whose engine is the server: weights are pushed and probed after every step."""
    from ridgeline.config import load_config
    from ridgeline.entrypoints.run import run_training

    cfg = load_config(["+experiment=tiny", "trainer.strategy=single", "trainer.logger=[console,jsonl]",
                       f"trainer.run_dir={tmp_path}", f"trainer.export_path={tmp_path}", "trainer.epochs=1", "generator.model_dtype=float32",
                       "generator.run_engines_locally=false", f"generator.remote_inference_engine_urls=['{server}']"])
    cfg.trainer.train_batch_size = cfg.trainer.policy_mini_batch_size
    run_training(cfg)
    rows = [json.loads(line) for line in (Path(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    synced = [r for r in rows if "weight_sync/megabytes" in r]
    assert synced and all(r["weight_sync/probe_abs_diff"] <= 1e-5 for r in synced)
    assert all(r["weight_sync/megabytes"] > 0 for r in synced)


@pytest.mark.needs_memory_gib(4)  # a local Ray, 4 rank actors with torch: ~3.2 GiB measured
@pytest.mark.integration
def test_fsdp2_ranks_push_to_a_remote_server(server, tmp_path):
    """trainer.strategy=fsdp2 with remote engines: policy rank 0 gathers and pushes the weights, the
    driver's client generates; the run equals the one-process remote run step for step."""
    from ridgeline.config import load_config
    from ridgeline.distributed.placement import PlacementConfigError, plan_placement
    from ridgeline.entrypoints.run import run_training
    from ridgeline.inference.parallelism import EngineParallelism

    placement = load_config(["+experiment=tiny"]).trainer.placement
    with pytest.raises(PlacementConfigError, match="colocate_all=true .* remote servers"):
        plan_placement(placement, num_engines=1, engine=EngineParallelism(), use_ref=False, use_critic=False, device="CPU",
                       remote_engines=True)

    common = ["+experiment=tiny", "data.prepare.num_train=48", "trainer.logger=jsonl", "trainer.epochs=1",
              "generator.model_dtype=float32", "generator.run_engines_locally=false",
              f"generator.remote_inference_engine_urls=['{server}']"]
    rows = {}
    for name, extra in (("single", ["trainer.strategy=single"]),
                        ("fsdp2", ["trainer.strategy=fsdp2", "trainer.placement.colocate_all=false",
                                   "trainer.placement.policy_num_gpus_per_node=2",
                                   "trainer.placement.ref_num_gpus_per_node=2"])):
        client = _client(server)  # both runs start from the server holding the initial weights; each
        client.update_weights(build_tiny_model("llama", build_char_tokenizer(), seed=SEED).named_parameters())
        client.close()            # run's own client then takes the server's update group over
        cfg = load_config(common + extra + [f"trainer.run_dir={tmp_path / name}", f"trainer.export_path={tmp_path / name}"])
        run_training(cfg)
        rows[name] = [r for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
                      if "policy/policy_loss" in r]
    assert rows["fsdp2"] and len(rows["fsdp2"]) == len(rows["single"])
    for a, b in zip(rows["single"], rows["fsdp2"]):
        assert b["weight_sync/probe_abs_diff"] <= 1e-5 and b["weight_sync/megabytes"] > 0
        for key in ("reward/avg_raw_reward", "policy/policy_loss", "policy/raw_grad_norm"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), key


# ------------------------------------------------------------------ SkyRL's sampling keys


@pytest.fixture(scope="module")
def served():
    """`ridgeline serve`'s routes over HTTP in this process, on a perturbed tiny model (its greedy
    text depends on the penalty: "WWWW..." for "Say hi.", "zGGG..." at penalty 2 for the sum)."""
    tok = build_char_tokenizer()
    engine = HFEngine(_perturbed(1), tok, dtype=torch.float32)
    httpd = make_http_server(EngineService(engine, tok, MODEL))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield "127.0.0.1:%d" % httpd.server_address[1], engine, tok
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("api", ["sglang", "openai"])
def test_stop_strings_penalty_and_top_logprobs_reach_the_server_through_both_apis(served, api):
    url, engine, tok = served
    client = _client(url, api)
    try:
        stop = SamplingParams(max_generate_length=12, temperature=0.0, stop=("WU", "WW"), logprobs=2)
        penalized = SamplingParams(max_generate_length=12, temperature=0.0, repetition_penalty=2.0, logprobs=3)
        reqs = [EngineRequest(chat_ids(tok, "Say hi."), stop),
                EngineRequest(chat_ids(tok, "What is 2 + 3?"), penalized)]
        outs, refs = client.generate(reqs, seed=0), engine.generate(reqs, seed=0)
        for out, ref in zip(outs, refs):
            assert (out.response_ids, out.stop_reason, out.matched_stop) == \
                   (ref.response_ids, ref.stop_reason, ref.matched_stop)
            assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-6)
            assert [[t for t, _ in top] for top in out.top_logprobs] == \
                   [[t for t, _ in top] for top in ref.top_logprobs]
            assert torch.allclose(torch.tensor([[lp for _, lp in top] for top in out.top_logprobs]),
                                  torch.tensor([[lp for _, lp in top] for top in ref.top_logprobs]), atol=1e-6)
        assert tok.decode(outs[0].response_ids) == "WW" and outs[0].matched_stop == "WW"
        assert [len(top) for top in outs[1].top_logprobs] == [3] * 12
        plain = engine.generate([EngineRequest(reqs[1].prompt_token_ids, SamplingParams(12, 0.0))])[0]
        assert outs[1].response_ids != plain.response_ids  # the penalty arrived
    finally:
        client.close()


def test_serve_answers_stop_strings_and_top_logprobs_as_sglang_and_vllm_do(served):
    _, engine, tok = served
    service = EngineService(engine, tok, MODEL)
    prompt = chat_ids(tok, "Say hi.")
    native = {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": 2,
              "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "stop": "WW"}}
    answer = service.generate(native)
    assert answer["output_ids"] == tok.encode("WW", add_special_tokens=False)
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": "WW"}
    assert answer["text"] == ""  # SGLang trims the stop string from the text unless no_stop_trim
    assert [len(top) for top in answer["meta_info"]["output_top_logprobs"]] == [2, 2]
    native["sampling_params"]["no_stop_trim"] = True
    assert service.generate(native)["text"] == "WW"

    completion = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "stop": ["WW"], "logprobs": 1,
                  "return_token_ids": True}
    choice = service.openai.completions(completion)["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("", "stop", "WW")
    # vLLM's top_logprobs: the top N and the sampled token, keyed by token text (or "token_id:ID")
    assert choice["logprobs"]["top_logprobs"][0].keys() == {"W"}
    completion.update(include_stop_str_in_output=True, return_tokens_as_token_ids=True)
    choice = service.openai.completions(completion)["choices"][0]
    w = tok.convert_tokens_to_ids("W")
    assert choice["text"] == "WW" and choice["logprobs"]["top_logprobs"][0].keys() == {f"token_id:{w}"}

    for bad, words in [({"stop": [""]}, "stop must be a non-empty string"),
                       ({"repetition_penalty": 0}, "repetition_penalty must be greater than 0"),
                       ({"logprobs": -1}, "top logprobs must be a whole number")]:
        with pytest.raises(RequestError, match=words):
            service.openai.completions({"model": MODEL, "prompt": prompt, **bad})


def test_completion_requests_carry_the_sampling_keys():
    req = EngineRequest([5, 6], SamplingParams(max_generate_length=9, temperature=0.5, top_k=-1,
                                               repetition_penalty=1.2, stop=("</sql>",), logprobs=4), (2,))
    assert completion_body("m", req, seed=3) == {
        "model": "m", "prompt": [5, 6], "max_tokens": 9, "temperature": 0.5, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
        "repetition_penalty": 1.2, "logprobs": 4, "return_token_ids": True, "seed": 3, "skip_special_tokens": True,
        "return_tokens_as_token_ids": True, "stop": ["</sql>"], "include_stop_str_in_output": True,
        "stop_token_ids": [2],
    }
    plain = completion_body("m", EngineRequest([5], SamplingParams()), seed=0)
    assert plain["logprobs"] == 0 and not {"stop", "return_tokens_as_token_ids", "stop_token_ids"} & plain.keys()
    # answers: top logprobs ranked from vLLM's {token: logprob} (the top N plus the sampled token)
    answer = {"choices": [{"token_ids": [7, 8], "finish_reason": "stop", "stop_reason": "</sql>",
                           "logprobs": {"token_logprobs": [-0.1, -3.0],
                                        "top_logprobs": [{"token_id:7": -0.1, "token_id:9": -2.6},
                                                         {"token_id:8": -3.0, "token_id:4": -0.2,
                                                          "token_id:9": -1.9}]}}]}
    out = openai_output(answer, "u", top_n=2)
    assert (out.stop_reason, out.matched_stop) == ("stop", "</sql>")
    assert out.top_logprobs == [[(7, -0.1), (9, -2.6)], [(4, -0.2), (9, -1.9)]]
    native = {"output_ids": [7], "meta_info": {"finish_reason": {"type": "stop", "matched": "</sql>"},
                                               "output_token_logprobs": [[-0.1, 7, None]],
                                               "output_top_logprobs": [[[-0.1, 7, None], [-2.6, 9, None]]]}}
    out = native_output(native, "u", top_n=2)
    assert out.matched_stop == "</sql>" and out.top_logprobs == [[(7, -0.1), (9, -2.6)]]
