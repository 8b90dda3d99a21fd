"""A real SGLang server (`python -m sglang.launch_server`, 0.5.23 on its CPU backend) on 127.0.0.1,
driven by Ridgeline's remote client as a run builds it (`generator.run_engines_locally=false`,
`generator.remote_inference_engine_urls`, SGLang's native API), checked against the embedded
`HFEngine` on the same float32 weights: sampled tokens and their logprobs, `n` samples, greedy
decoding, stop token ids and stop strings, prefix caching on and off, a weight sync over an update
group on gloo (`/init_weights_update_group` + `/update_weights_from_distributed` inside 0.5.23's
`/begin_weight_update` ... `/end_weight_update`) checked by the stale-weights probe, real training
steps, and sleep / wake through `/release_memory_occupation` / `/resume_memory_occupation`.
Not in the default suite: `make test-sglang` runs it in .venv-sglang.

Two servers, one after the other (one per module parameter): the default one (tokenizer loaded,
radix cache on) and `--skip-tokenizer-init --disable-radix-cache` (token ids only, no prefix
cache) - SGLang's two output paths. Tolerance as in test_sglang_engine.py: 1e-4 (measured ~5e-7).
"""

from __future__ import annotations

import sys

import pytest
import torch

from ridgeline.distributed.weight_sync import StaleWeightsError, check_probe, probe_logprobs, probe_tokens, probe_tolerance
from ridgeline.inference.build import build_engine
from ridgeline.inference.hf_engine import HFEngine
from ridgeline.inference.launch import SGLANG_CPU_SERVER_ENV, ServerProcess, sglang_server_command
from ridgeline.inference.remote import RemoteEngine
from ridgeline.inference.types import EngineError, EngineRequest, SamplingParams
from ridgeline.inference.weight_transport import free_port
from ridgeline.models.loading import engine_model_folder, load_model, load_tokenizer
from ridgeline.training.build import policy_spec

from sglang_checks import (PROMPT_TEXT, TOLERANCE, check_prefix_caching, check_stop_string, check_stop_token_ids,
                           max_diff, stop_string_request, tiny_run, train_steps_then_probe)

pytestmark = pytest.mark.sglang

SERVERS = {"tokenizer_cache_on": (), "ids_only_cache_off": ("--skip-tokenizer-init", "--disable-radix-cache")}


def remote_config(tmp_path, url: str):
    return tiny_run(tmp_path, "generator.run_engines_locally=false", f"generator.remote_inference_engine_urls=['{url}']",
                    "generator.weight_sync_backend=gloo")


@pytest.fixture(scope="module", params=list(SERVERS))
def server(request, tmp_path_factory):
    pytest.importorskip("sglang.srt.entrypoints.http_server")
    cfg = tiny_run(tmp_path_factory.mktemp("model"))
    port = free_port()
    command = sglang_server_command(engine_model_folder(policy_spec(cfg)), port, *SERVERS[request.param],
                                    "--log-level", "warning", python=sys.executable)
    proc = ServerProcess(command, f"http://127.0.0.1:{port}", SGLANG_CPU_SERVER_ENV, timeout_s=600)
    yield request.param, proc.url
    proc.stop()


@pytest.fixture(scope="module")
def setup(server, tmp_path_factory):
    name, url = server
    cfg = remote_config(tmp_path_factory.mktemp("run"), url)
    tokenizer = load_tokenizer(policy_spec(cfg))
    client = build_engine(cfg, tokenizer)
    assert isinstance(client, RemoteEngine)
    model = load_model(policy_spec(cfg), torch.float32, tokenizer)
    reference = HFEngine(model, tokenizer, dtype=torch.float32)
    prompt = tokenizer(PROMPT_TEXT, add_special_tokens=False)["input_ids"]
    yield name, client, reference, model, tokenizer, prompt
    client.close()



def cached_tokens(client: RemoteEngine, prompt: list[int]) -> int:
    """The server's own count of prompt tokens served from its radix cache, for one greedy request."""
    answer = client.request("POST", client.urls[0], "/generate", {
        "input_ids": prompt, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}})
    return int(answer["meta_info"]["cached_tokens"])


def test_the_server_runs_as_started(setup):
    name, client, *_ = setup
    info = client.request("GET", client.urls[0], "/get_server_info")
    assert (info["device"], info["attention_backend"]) == ("cpu", "torch_native")
    assert info["skip_tokenizer_init"] is info["disable_radix_cache"] is (name == "ids_only_cache_off")


def test_n_samples_and_their_logprobs_match_the_embedded_engine(setup):
    _, client, reference, _, _, prompt = setup
    outs = client.generate([EngineRequest(prompt, SamplingParams(max_generate_length=24, temperature=1.0))] * 4, seed=1)
    assert len({tuple(o.response_ids) for o in outs}) > 1  # each sample has a seed of its own
    worst = 0.0
    for out in outs:
        assert len(out.logprobs) == len(out.response_ids) and out.stop_reason in ("stop", "length")
        worst = max(worst, max_diff(out.logprobs, reference.score(prompt, out.response_ids)))
    greedy = [EngineRequest(prompt, SamplingParams(max_generate_length=16, temperature=0.0))]
    ours, theirs = client.generate(greedy)[0], reference.generate(greedy)[0]
    assert (ours.response_ids, ours.stop_reason) == (theirs.response_ids, theirs.stop_reason)
    worst = max(worst, max_diff(ours.logprobs, theirs.logprobs),
                max_diff(client.score(prompt, prompt[5:17]), reference.score(prompt, prompt[5:17])))
    print(f"max |SGLang server logprob - embedded engine| = {worst:.3g}")
    assert worst < TOLERANCE


def test_stop_token_ids_end_the_response_as_in_the_embedded_engine(setup):
    _, client, reference, _, _, prompt = setup
    check_stop_token_ids(client, reference, prompt)


def test_stop_strings_end_the_response_or_are_refused_without_a_tokenizer(setup):
    name, client, reference, _, tokenizer, prompt = setup
    request, stop = stop_string_request(reference, tokenizer, prompt)
    if name == "ids_only_cache_off":  # the server would ignore it: refused, naming the server and the fix
        with pytest.raises(EngineError, match=r"--skip-tokenizer-init.*Fix: restart it without"):
            client.generate(request)
        return
    check_stop_string(client, reference, tokenizer, request, stop)


def test_prefix_caching_on_and_off(setup):
    name, client, reference, _, _, prompt = setup
    check_prefix_caching(client, reference, prompt * 2, cached_tokens, cache_on=name == "tokenizer_cache_on")


def test_weight_sync_over_an_update_group_then_the_probe_passes_and_a_skipped_sync_is_caught(setup):
    _, client, _, model, tokenizer, _ = setup
    prompt_ids, response_ids = probe_tokens(tokenizer)
    tolerance = probe_tolerance(client.dtype)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    before = torch.tensor(client.score(prompt_ids, response_ids))
    noise = torch.Generator().manual_seed(1)
    try:
        for version in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn(p.shape, generator=noise))
            if version == 1:
                stats = client.push_weights(model.named_parameters(), version)
                assert stats["bytes"] == sum(p.numel() * 4 for p in model.parameters())
                assert client._group.sessions == {client.urls[0]: True}  # 0.5.23's begin/end_weight_update
            trainer = probe_logprobs(model, prompt_ids=prompt_ids, response_ids=response_ids)
            engine = torch.tensor(client.score(prompt_ids, response_ids))
            if version == 1:
                check_probe(trainer, engine, tolerance, version)
                assert (engine - before).abs().max() > 0.1  # the weights really moved
            else:  # a step whose sync was skipped: the server kept version 1
                with pytest.raises(StaleWeightsError, match="after weight sync version 2"):
                    check_probe(trainer, engine, tolerance, version)
    finally:
        model.load_state_dict(original, strict=False)  # named_parameters: the tied lm_head is embed_tokens
        client.push_weights(model.named_parameters(), 3)
    assert max_diff(client.score(prompt_ids, response_ids), before.tolist()) < TOLERANCE


def test_training_steps_push_to_the_server_and_a_skipped_sync_is_caught(server, tmp_path):
    """A run with rollouts from the server: `RemoteWeightSync` pushes the start weights and each
    step's over a new update group (the one above is another trainer's: override_existing_update_group
    auto takes it over) and probes the server after every push."""
    _, url = server
    metrics = train_steps_then_probe(remote_config(tmp_path, url))
    assert metrics["weight_sync/megabytes"] > 0 and metrics["weight_sync/probe_abs_diff"] <= 1e-5


def test_sleep_and_wake_release_and_resume_with_tags(setup):
    """`/release_memory_occupation` with SGLang's tags, then `/resume_memory_occupation` weights
    first, the KV cache (and CUDA graphs) after; on the CPU they free nothing, and releasing the KV
    cache flushes the radix cache."""
    name, client, _, _, _, prompt = setup
    greedy = [EngineRequest(prompt, SamplingParams(max_generate_length=8, temperature=0.0))]
    before = client.generate(greedy)[0].response_ids
    long_prompt = prompt * 2
    cached_tokens(client, long_prompt)
    client.sleep(1)
    assert client._released == ["kv_cache", "weights", "cuda_graph"]
    client.wake_up(("weights",))
    assert client._released == ["kv_cache", "cuda_graph"]
    client.wake_up()
    assert client._released == [] and client._asleep_tags == ()
    assert cached_tokens(client, long_prompt) == 0
    assert client.generate(greedy)[0].response_ids == before
