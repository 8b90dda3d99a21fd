"""`ridgeline tinker` driven by the real tinker SDK (0.38) on 127.0.0.1, on the tiny model: every
call the SDK makes for sessions, training (LoRA and full-parameter), the built-in and custom
losses, sampling with logprobs and prompt logprobs, and weights (save / load / for sampler / list),
checked against the formulas and against the training forward; a second server on the same
checkpoint folder resumes a client exactly. Bad input: 400 naming the field, 401 without the key."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

tinker = pytest.importorskip("tinker", reason="the tinker SDK is in the dev extra: pip install -e '.[dev]'")
import httpx  # noqa: E402  (the SDK's HTTP client, installed with it)
from tinker import types  # noqa: E402

from conftest import HANG_GUARD_S  # noqa: E402
from ridgeline.inference.http_app import ExposureError  # noqa: E402
from ridgeline.tinker.command import make_server  # noqa: E402
from ridgeline.tinker.service import TinkerService  # noqa: E402

BASE = "tiny://llama"
KEY = "tml-ridgeline-test"


class Server:
    def __init__(self, root, api_key=None):
        self.service = TinkerService([BASE], root)
        self.http = make_server(self.service, "127.0.0.1", 0, api_key, 8 << 20)
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()
        host, port = self.http.server_address
        self.url = f"http://{host}:{port}"

    def stop(self):
        self.http.shutdown()
        self.http.server_close()
        self.service.futures.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("tinker"), api_key=KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    # closed before the server stops: an open client's session heartbeat would report the dead server
    with tinker.ServiceClient(base_url=server.url, api_key=KEY) as service:
        yield service


def datum(tokens, **inputs) -> types.Datum:
    """A Datum over `tokens`: input tokens[:-1], targets tokens[1:], plus per-position inputs."""
    n = len(tokens) - 1
    loss_inputs = {"target_tokens": np.asarray(tokens[1:], np.int64)}
    loss_inputs.update({k: np.asarray(v, np.float32) for k, v in inputs.items()})
    assert all(len(v) == n for v in loss_inputs.values())
    return types.Datum(model_input=types.ModelInput.from_ints(list(tokens[:-1])), loss_fn_inputs=loss_inputs)


TOKENS = [5, 17, 33, 8, 41, 12, 60, 7, 19, 25, 3, 44]


def logprobs(result, i=0) -> np.ndarray:
    return np.asarray(result.loss_fn_outputs[i]["logprobs"].to_numpy(), np.float64)


def test_service_calls(server, client):
    caps = tinker.RestClient(base_url=server.url, api_key=KEY).get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == [BASE]
    assert httpx.get(server.url + "/api/v1/healthz").json() == {"status": "ok"}  # open, as /health
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    info = training.get_info()
    assert (info.is_lora, info.lora_rank, info.model_data.model_name) == (True, 4, BASE)
    tokenizer = training.get_tokenizer()
    assert tokenizer.decode(tokenizer.encode("abc", add_special_tokens=False)) == "abc"


def test_cross_entropy_is_a_weighted_sum_and_adam_params_apply(client):
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    weights = [0.0] * 4 + [1.0, 2.0, 0.5] + [1.0] * 4
    d = datum(TOKENS, weights=weights)
    fwd = training.forward([d], "cross_entropy").result()
    lp = logprobs(fwd)
    assert fwd.metrics["loss:sum"] == pytest.approx(-(lp * weights).sum(), rel=1e-5)
    out = training.forward_backward([d], "cross_entropy").result()
    np.testing.assert_allclose(logprobs(out), lp, atol=1e-6)   # forward_only added no gradient, changed nothing
    # learning rate 0: Adam moves nothing
    training.optim_step(types.AdamParams(learning_rate=0.0)).result()
    assert training.forward([d], "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
        out.metrics["loss:sum"], abs=1e-6)
    before = out.metrics["loss:sum"]
    for _ in range(3):
        training.forward_backward([d], "cross_entropy").result()
        step = training.optim_step(types.AdamParams(learning_rate=1e-2, grad_clip_norm=1.0)).result()
    assert step.metrics["optim/step"] == 4.0 and step.metrics["optim/skipped"] == 0.0
    assert training.forward([d], "cross_entropy").result().metrics["loss:sum"] < before - 1.0


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "dro"])
def test_rl_losses_follow_the_sdk_formulas(client, loss_fn):
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    rng = np.random.default_rng(0)
    n = len(TOKENS) - 1
    ce = training.forward([datum(TOKENS, weights=[1.0] * n)], "cross_entropy").result()
    lp = logprobs(ce)
    q = lp + rng.normal(0, 0.3, n)          # the sampler's logprobs: ratios on both sides of the clip range
    adv = np.r_[np.zeros(4), rng.normal(0, 1, n - 4)]
    config = {"ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, "dro": {"beta": 0.2}}.get(loss_fn)
    out = training.forward_backward([datum(TOKENS, logprobs=q, advantages=adv)], loss_fn, config).result()
    r = np.exp(lp - q)
    expected = {
        "importance_sampling": -(r * adv).sum(),
        "ppo": -np.minimum(r * adv, np.clip(r, 0.9, 1.1) * adv).sum(),
        "cispo": -(np.clip(r, 0.8, 1.2) * adv * lp).sum(),
        "dro": -(adv * lp - 0.5 * 0.2 * (lp - q) ** 2).sum(),
    }[loss_fn]
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-4)
    np.testing.assert_allclose(logprobs(out), lp, atol=1e-5)


def test_custom_loss_runs_through_the_sdk(client):
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()

    def mean_nll(data, logprobs_list):
        loss = -sum(lp.sum() for lp in logprobs_list) / len(logprobs_list)
        return loss, {"mean_nll": float(loss.detach())}

    n = len(TOKENS) - 1
    d = datum(TOKENS, weights=[1.0] * n)
    lp = logprobs(training.forward([d], "cross_entropy").result())
    out = training.forward_backward_custom([d, d], mean_nll).result()
    assert out.metrics["loss:sum"] == pytest.approx(-lp.sum(), rel=1e-5)
    assert out.metrics["surrogate_loss:sum"] != 0.0


def test_sampling_logprobs_are_the_training_logprobs(client):
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    d = datum(TOKENS, weights=[1.0] * (len(TOKENS) - 1))
    training.forward_backward([d], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = TOKENS[:5]
    result = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=3,
                            sampling_params=types.SamplingParams(max_tokens=6, seed=1),
                            include_prompt_logprobs=True).result()
    assert len(result.sequences) == 3 and all(len(s.tokens) == 6 for s in result.sequences)
    assert {s.stop_reason for s in result.sequences} == {"length"}
    for seq in result.sequences:   # the engine's sampled logprobs are the trained model's (the probe's fp32 bound)
        full = prompt + list(seq.tokens)
        train_lp = logprobs(training.forward([datum(full, weights=[1.0] * (len(full) - 1))], "cross_entropy").result())
        np.testing.assert_allclose(seq.logprobs, train_lp[len(prompt) - 1:], atol=1e-4)
    assert result.prompt_logprobs[0] is None
    trained = logprobs(training.forward([d], "cross_entropy").result())
    np.testing.assert_allclose(result.prompt_logprobs[1:], trained[:4], atol=1e-4)
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    np.testing.assert_allclose(scored[1:], logprobs(training.forward([d], "cross_entropy").result()), atol=1e-4)
    # the same seed, the same samples; a stop token ends a sample with "stop"
    again = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=3,
                           sampling_params=types.SamplingParams(max_tokens=6, seed=1)).result()
    assert [list(s.tokens) for s in again.sequences] == [list(s.tokens) for s in result.sequences]
    first = result.sequences[0].tokens[0]
    stopped = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=1,
                             sampling_params=types.SamplingParams(max_tokens=6, seed=1, stop=[int(first)])).result()
    assert list(stopped.sequences[0].tokens) == [first] and stopped.sequences[0].stop_reason == "stop"


def test_base_model_sampler(server, client):
    sampler = client.create_sampling_client(base_model=BASE).result()
    assert sampler.get_base_model() == BASE
    out = sampler.sample(prompt=types.ModelInput.from_ints(TOKENS[:3]), num_samples=2,
                         sampling_params=types.SamplingParams(max_tokens=4, temperature=0.0)).result()
    assert [list(s.tokens) for s in out.sequences][0] == list(out.sequences[1].tokens)   # greedy: the same
    record = httpx.get(f"{server.url}/api/v1/samplers/{sampler._sampling_session_id}", headers={"X-API-Key": KEY})
    assert record.json()["base_model"] == BASE


def test_clients_on_one_base_keep_their_own_adapters(client):
    a = client.create_lora_training_client(base_model=BASE, rank=4).result()
    b = client.create_lora_training_client(base_model=BASE, rank=8).result()
    d = datum(TOKENS, weights=[1.0] * (len(TOKENS) - 1))
    before = b.forward([d], "cross_entropy").result().metrics["loss:sum"]
    for _ in range(2):
        a.forward_backward([d], "cross_entropy").result()
        a.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert a.forward([d], "cross_entropy").result().metrics["loss:sum"] < before - 0.5
    assert b.forward([d], "cross_entropy").result().metrics["loss:sum"] == before
    assert b.get_info().lora_rank == 8


def test_full_parameter_client(client):
    full = client.create_lora_training_client(base_model=BASE, rank=0).result()
    assert full.get_info().is_lora is False
    d = datum(TOKENS, weights=[1.0] * (len(TOKENS) - 1))
    before = full.forward([d], "cross_entropy").result().metrics["loss:sum"]
    full.forward_backward([d], "cross_entropy").result()
    full.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert full.forward([d], "cross_entropy").result().metrics["loss:sum"] < before
    path = full.save_weights_for_sampler("full-1").result().path
    sampler = client.create_sampling_client(model_path=path).result()
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    np.testing.assert_allclose(scored[1:], logprobs(full.forward([d], "cross_entropy").result()), atol=1e-4)


def test_state_resumes_exactly_on_a_new_server(tmp_path):
    first = Server(tmp_path)
    d = datum(TOKENS, weights=[1.0] * (len(TOKENS) - 1))
    adam = types.AdamParams(learning_rate=1e-2)
    try:
        with tinker.ServiceClient(base_url=first.url, api_key=KEY) as service:
            training = service.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
            training.forward_backward([d], "cross_entropy").result()
            training.optim_step(adam).result()
            path = training.save_state("after-1").result().path
            sampler_path = training.save_weights_for_sampler("after-1").result().path
            training.forward_backward([d], "cross_entropy").result()
            training.optim_step(adam).result()   # Adam's moments matter from here on
            expected = training.forward([d], "cross_entropy").result().metrics["loss:sum"]
            listed = tinker.RestClient(base_url=first.url, api_key=KEY).list_checkpoints(training.model_id).result()
            assert {c.tinker_path for c in listed.checkpoints} == {path, sampler_path}
    finally:
        first.stop()   # the server goes; its checkpoint folder stays
    second = Server(tmp_path)
    try:
        with tinker.ServiceClient(base_url=second.url, api_key=KEY) as service:
            resumed = service.create_training_client_from_state_with_optimizer(path).result()
            resumed.forward_backward([d], "cross_entropy").result()
            resumed.optim_step(adam).result()
            assert resumed.forward([d], "cross_entropy").result().metrics["loss:sum"] == expected
            weights_only = service.create_training_client_from_state(path).result()
            assert weights_only.get_info().lora_rank == 4
            # load_state_with_optimizer into a client that exists: the same state, the same next step
            other = service.create_lora_training_client(base_model=BASE, rank=4).result()
            other.load_state_with_optimizer(path).result()
            other.forward_backward([d], "cross_entropy").result()
            other.optim_step(adam).result()
            assert other.forward([d], "cross_entropy").result().metrics["loss:sum"] == expected
            with pytest.raises(tinker.BadRequestError, match="rank"):
                service.create_lora_training_client(base_model=BASE, rank=8).result().load_state(path).result()
            sampled = service.create_sampling_client(model_path=sampler_path).result().sample(
                prompt=types.ModelInput.from_ints(TOKENS[:4]), num_samples=1,
                sampling_params=types.SamplingParams(max_tokens=3)).result()
            assert len(sampled.sequences[0].tokens) == 3
    finally:
        second.stop()


def _post(server, path, body, key=KEY, **kw):
    headers = {"X-API-Key": key} if key else {}
    kw.setdefault("timeout", HANG_GUARD_S)   # a hang guard: httpx's own 5 s is a busy machine's clock
    return httpx.post(server.url + "/api/v1" + path, json=body, headers=headers, **kw)


def test_a_finished_session_ends_its_heartbeat_and_starts_nothing(server):
    """ServiceClient.close(status) / the end of its `with` block: POST /sessions/{id}/finish (first
    reason wins); the heartbeat then answers 410, which stops the SDK's loop, and the session starts
    no new client. The `client` fixture's `with` block runs the SDK's own call."""
    session = _post(server, "/create_session", {"tags": [], "user_metadata": None, "sdk_version": "0"}).json()
    sid = session["session_id"]
    assert _post(server, "/session_heartbeat", {"session_id": sid}).status_code == 200
    bad = _post(server, f"/sessions/{sid}/finish", {"reason": {"type": "done"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reason.type"
    assert _post(server, f"/sessions/{sid}/finish", {"reason": {"type": "errored"}, "detail": None}).status_code == 200
    assert _post(server, f"/sessions/{sid}/finish", {"reason": {"type": "success"}}).status_code == 200
    gone = _post(server, "/session_heartbeat", {"session_id": sid})
    assert gone.status_code == 410 and "(errored)" in gone.text   # the first reason stands
    refused = _post(server, "/create_model", {"session_id": sid, "model_seq_id": 0, "base_model": BASE})
    assert refused.status_code == 400 and "finished by its client" in refused.json()["error"]["message"]


def test_bad_requests_name_their_field(server, client):
    assert _post(server, "/create_session", {}, key=None).status_code == 401
    assert _post(server, "/create_session", {}, key="tml-wrong").status_code == 401
    bearer = httpx.post(server.url + "/api/v1/get_server_capabilities", headers={"Authorization": f"Bearer {KEY}"})
    assert bearer.status_code == 200
    bad = _post(server, "/create_session", {"tags": "x", "sdk_version": "0"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] in ("tags", "user_metadata")
    session = _post(server, "/create_session", {"tags": [], "user_metadata": None, "sdk_version": "0"}).json()
    unknown = _post(server, "/create_model", {"session_id": session["session_id"], "model_seq_id": 0,
                                               "base_model": "/etc"})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "base_model"
    garbage = httpx.post(server.url + "/api/v1/forward_backward", content=b"\xff\x00garbage",
                         headers={"X-API-Key": KEY, "Content-Type": "application/x-protobuf"})
    assert garbage.status_code == 400
    too_long = _post(server, "/asample", {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                                          "sampling_params": {"max_tokens": 10**6}, "base_model": BASE})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "sampling_params.max_tokens"
    big = _post(server, "/telemetry", {"x": "y" * (9 << 20)})
    assert big.status_code == 413
    training = client.create_lora_training_client(base_model=BASE, rank=4).result()
    n = len(TOKENS) - 1
    with pytest.raises(tinker.BadRequestError, match="loss_fn_config.beta"):
        training.forward_backward([datum(TOKENS, logprobs=[0.0] * n, advantages=[0.0] * n)], "ppo",
                                  {"beta": 1.0}).result()
    with pytest.raises(tinker.BadRequestError, match=r"loss_fn_inputs\.advantages is missing"):
        training.forward_backward([datum(TOKENS, logprobs=[0.0] * n)], "importance_sampling").result()
    with pytest.raises(tinker.BadRequestError, match="target_tokens must be int64 token ids"):
        training.forward_backward([datum([5, 10**6, 3], weights=[1.0, 1.0])], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="non-finite"):
        training.forward_backward([datum(TOKENS, logprobs=[0.0] * n, advantages=[math.nan] * n)],
                                  "importance_sampling").result()
    assert training.forward([datum(TOKENS, weights=[1.0] * n)], "cross_entropy").result().metrics["loss:sum"] > 0


def test_loopback_by_default(tmp_path):
    with pytest.raises(ExposureError, match="--api-key"):
        make_server(TinkerService([BASE], tmp_path), "0.0.0.0", 0, None, 1 << 20)


def test_command_refuses_before_loading(capsys):
    from ridgeline.cli import main

    assert main(["tinker", "--model", BASE, "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "--api-key" in capsys.readouterr().err
    assert main(["tinker", "--model", BASE, "--max-samplers", "0"]) == 2
    assert "--max-samplers must be positive" in capsys.readouterr().err


def test_bf16_sampler_passes_the_low_precision_probe(tmp_path):
    import torch

    from ridgeline.tinker.checkpoints import ModelMeta
    from ridgeline.tinker.models import BaseModels, Sampler, TrainedModel

    base = BaseModels([BASE], 0, torch.bfloat16).get(BASE)
    trained = TrainedModel("m", base, ModelMeta(BASE, 4, "all-linear", 0))
    sampler = Sampler.from_model(trained, "m")   # raises StaleWeightsError past the bf16 bound
    assert sampler.engine.dtype == torch.bfloat16
    from ridgeline.inference.types import SamplingParams
    seqs, prompt_lp = sampler.sample(TOKENS[:4], 2, SamplingParams(max_generate_length=3), (), 0, True)
    assert [len(s.tokens) for s in seqs] == [3, 3] and len(prompt_lp) == 4 and math.isnan(prompt_lp[0])


def test_a_running_future_answers_try_again(server):
    """A poll on work still running gets Tinker's 408 "try again" (released by an event, not a clock)."""
    import threading as th

    from ridgeline.tinker.futures import Result

    release = th.Event()
    store = server.service.futures
    store.poll_wait_s = 0.05   # this server's polls give up at once while the work is held
    try:
        request_id = store.submit(lambda: (release.wait(), Result(json={"ok": 1}))[1])
        pending = _post(server, "/retrieve_future", {"request_id": request_id})
        assert pending.status_code == 408 and pending.json()["type"] == "try_again"
    finally:
        release.set()
        store.poll_wait_s = 40.0
    assert _post(server, "/retrieve_future", {"request_id": request_id}).json() == {"ok": 1}
    unknown = _post(server, "/retrieve_future", {"request_id": "req-none"})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "request_id"
