"""`ridgeline serve` under abuse (issue 19): real servers on 127.0.0.1, real HTTP, no mocks.

No key beyond loopback is refused at start; every route but /health needs the key; a body is
refused before it is read (the server's memory is measured); bad sampling values and token ids get
400 naming the field; a huge max_new_tokens is cut to the context; a short request is answered
while a long one runs; 50 concurrent connections are all answered; a weight-group init aimed at a
silent peer fails within its timeout.

Round two (issue 29): request chat templates are refused unless trusted; n, stop strings, JSON
depth and size are bounded before anything runs; lone surrogates get a 400; half-sent headers
neither lock clients out nor stay open; a failing disk weight load changes nothing; a FIFO in
the weights folder and a huge group timeout are refused."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests
import torch

from conftest import HANG_GUARD_S, REPO, chat_ids, in_thread, start_serve
from ridgeline.inference.hf_engine import HFEngine
from ridgeline.inference.http_app import ExposureError
from ridgeline.inference.server import EngineService, ServeLimits, make_http_server
from ridgeline.inference.types import EngineRequest, SamplingParams
from ridgeline.models.tiny import build_char_tokenizer, build_tiny_model

MODEL = "tiny://llama"
KEY = "s3cret-key"
WEIGHT_ROUTES = ("/update_weights_from_disk", "/release_memory_occupation", "/resume_memory_occupation",
                 "/flush_cache", "/init_weights_update_group", "/update_weights_from_distributed",
                 "/destroy_weights_update_group")


def _serve_in_thread(service: EngineService, **kw):
    httpd = make_http_server(service, **kw)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, "http://127.0.0.1:%d" % httpd.server_address[1]


def _stop(httpd, service: EngineService) -> None:
    httpd.shutdown()
    httpd.server_close()
    service.close()


def _service(engine: HFEngine, tok, **kw) -> EngineService:
    """As `ridgeline serve` builds it: generation in steps, the model's context, vocabulary and
    parameter shapes."""
    return EngineService(engine, tok, MODEL, context_length=engine.context_length, vocab_size=engine.vocab_size,
                         weight_shapes={n: tuple(p.shape) for n, p in engine.model.named_parameters()},
                         steps=engine.generate_steps, **kw)


@pytest.fixture(scope="module")
def served():
    """tiny://llama (seed 42, `ridgeline serve`'s weights): greedy decoding of the chat prompts
    below never meets an end token, so every generation runs to its length limit."""
    tok = build_char_tokenizer()
    engine = HFEngine(build_tiny_model("llama", tok, seed=42), tok, dtype=torch.float32)
    service = _service(engine, tok)
    httpd, url = _serve_in_thread(service)
    yield url, engine, tok
    _stop(httpd, service)


@pytest.fixture(scope="module")
def keyed():
    """`ridgeline serve` as a process, with a key, a 1 MiB body cap and a 64-token context."""
    proc, url = start_serve("--api-key", KEY, "--max-body-mb", "1", "--context-length", "64",
                            env={"RIDGELINE_ENGINE_API_KEY": ""})
    yield proc, url
    proc.terminate()
    proc.wait(timeout=HANG_GUARD_S)


def _rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _greedy(max_new: int) -> dict:
    return {"max_new_tokens": max_new, "temperature": 0.0}


# ------------------------------------------------------------------------- exposure and the key


@pytest.mark.integration
def test_weight_routes_are_never_served_beyond_loopback_without_a_key():
    env = {k: v for k, v in os.environ.items() if k != "RIDGELINE_ENGINE_API_KEY"}
    # a model that cannot load: the refusal below shows it came before any model was looked at
    done = subprocess.run([sys.executable, "-m", "ridgeline.cli", "serve", "trainer.policy.model.path=/no/such/model",
                           "--host", "0.0.0.0", "--port", "0"], cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 2 and "listening" not in done.stdout
    message = done.stderr.strip()
    assert message.startswith("ridgeline serve: --host 0.0.0.0 listens beyond this machine without an API key")
    assert "Fix: pass --api-key KEY (or export RIDGELINE_ENGINE_API_KEY=KEY)" in message and "\n" not in message
    assert "Traceback" not in done.stderr and "/no/such/model" not in done.stderr  # refused before any model loads

    tok = build_char_tokenizer()
    service = EngineService(HFEngine(build_tiny_model("llama", tok, seed=42), tok), tok, MODEL)
    try:
        with pytest.raises(ExposureError, match="--host 0.0.0.0 listens beyond this machine"):
            make_http_server(service, "0.0.0.0")
        for host, kw in (("0.0.0.0", {"api_key": KEY}), ("localhost", {}),
                         ("0.0.0.0", {"routes": service.openai_routes()})):  # a run's endpoint: no weight routes
            httpd = make_http_server(service, host, **kw)
            httpd.server_close()
    finally:
        service.close()


def test_serve_says_nothing_of_settings_nobody_set(keyed):
    """No note that the base config's 4-GPU tensor parallelism is not used (issue 35 item 12)."""
    proc, _ = keyed
    assert proc.start_log and not any("is not used" in line for line in proc.start_log), proc.start_log


def test_every_route_but_health_needs_the_key(keyed):
    _, url = keyed
    assert requests.get(f"{url}/health", timeout=HANG_GUARD_S).status_code == 200
    for route in (*WEIGHT_ROUTES, "/generate", "/get_model_info", "/v1/completions", "/v1/chat/completions"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = requests.post(url + route, json={"model_path": "/"}, headers=headers, timeout=HANG_GUARD_S)
            assert r.status_code == 401, (route, headers)
            answer = r.json()
            if route in WEIGHT_ROUTES:  # SGLang's shape on its weight routes
                assert answer["success"] is False and "bearer token" in answer["message"]
            else:
                assert answer["error"]["code"] == 401 and "bearer token" in answer["error"]["message"]
    auth = {"Authorization": f"Bearer {KEY}"}
    info = requests.get(f"{url}/get_model_info", headers=auth, timeout=HANG_GUARD_S).json()
    assert info["context_length"] == 64  # --context-length
    r = requests.post(f"{url}/update_weights_from_disk", json={"model_path": "/no/such/folder"}, headers=auth,
                      timeout=HANG_GUARD_S)
    assert r.status_code == 400 and r.json() == {"success": False, "message": "no *.safetensors files in /no/such/folder"}
    # with the key, a huge max_new_tokens is cut to the 64-token context
    prompt = chat_ids(build_char_tokenizer(), "Say hi.")
    r = requests.post(f"{url}/generate", headers=auth, timeout=HANG_GUARD_S,
                      json={"input_ids": prompt, "sampling_params": _greedy(10**9)})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 64 - len(prompt)


def _exchange(host: str, port: int, head: str, body: bytes, *, answer_first: bool = True) -> str:
    """Send `head`; with `answer_first`, wait until the answer begins (a server that read the body
    first never answers before it: the server's own read timeout ends the wait with a 408, which
    fails the caller's check), then send `body` while a reader collects the answer."""
    received: list[bytes] = []
    began = threading.Event()
    with socket.create_connection((host, port), timeout=HANG_GUARD_S) as s:
        def read() -> None:
            try:
                while chunk := s.recv(65536):
                    received.append(chunk)
                    began.set()
            except OSError:
                pass  # reset by the server once it closed with the body unread
            began.set()

        reader = threading.Thread(target=read, daemon=True)
        s.sendall(head.encode())
        reader.start()
        if answer_first:
            assert began.wait(HANG_GUARD_S)
        try:
            s.sendall(body)
        except OSError:
            pass  # the server closed the connection: the rest is never read
        reader.join(HANG_GUARD_S)
    return b"".join(received).decode()


def test_a_body_is_refused_before_it_is_read(keyed):
    proc, url = keyed
    host, port = url.removeprefix("http://").split(":")
    requests.get(f"{url}/health", timeout=HANG_GUARD_S)
    before = _rss_bytes(proc.pid)
    payload = b"[" + b"1," * (50 * 2**20 - 1) + b"1]"  # 100 MiB of JSON
    head = (f"POST /update_weights_from_disk HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n")
    for extra, want in (("", "401"), (f"Authorization: Bearer {KEY}\r\n", "413")):
        answer = _exchange(host, int(port), head + extra + "\r\n", payload)
        assert answer.startswith(f"HTTP/1.1 {want}"), answer[:200]
    # no Content-Length: a chunked body is counted as it arrives and refused past the cap
    chunk = b"x" * 65536
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(64)) + b"0\r\n\r\n"  # 4 MiB
    answer = _exchange(host, int(port), f"POST /generate HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}"
                                        "\r\nTransfer-Encoding: chunked\r\n\r\n", chunked, answer_first=False)
    assert answer.startswith("HTTP/1.1 413") and "over this server's limit of 1048576 bytes (--max-body-mb)" in answer
    growth = _rss_bytes(proc.pid) - before
    print(f"server RSS growth after a refused 100 MiB body: {growth / 2**20:.1f} MiB")
    assert growth < 20 * 2**20, f"the server grew by {growth / 2**20:.0f} MiB"
    assert requests.get(f"{url}/health", timeout=HANG_GUARD_S).status_code == 200


# ------------------------------------------------------------------------- values


def _bad_requests(prompt: list[int]) -> list[tuple[str, dict | str, str]]:
    """(route, body, the field the 400 must name)."""
    def native(**sampling):
        return {"input_ids": prompt, "sampling_params": sampling}

    def completion(**fields):
        return {"model": MODEL, "prompt": prompt, "max_tokens": 2, **fields}

    def chat(**fields):
        return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}

    return [
        ("/generate", native(temperature=-1), "sampling_params.temperature"),
        ("/generate", native(temperature="hot"), "sampling_params.temperature"),
        ("/generate", native(top_p=0), "sampling_params.top_p"),
        ("/generate", native(top_p=1.5), "sampling_params.top_p"),
        ("/generate", native(top_k=-2), "sampling_params.top_k"),
        ("/generate", native(min_p=1.5), "sampling_params.min_p"),
        ("/generate", native(repetition_penalty=0), "sampling_params.repetition_penalty"),
        ("/generate", native(max_new_tokens=-1), "sampling_params.max_new_tokens"),
        ("/generate", native(max_new_tokens="8"), "sampling_params.max_new_tokens"),
        ("/generate", native(sampling_seed=1.5), "sampling_params.sampling_seed"),
        ("/generate", native(skip_special_tokens="no"), "sampling_params.skip_special_tokens"),
        ("/generate", native(stop_token_ids=[1000]), "sampling_params.stop_token_ids"),
        ("/generate", {"input_ids": [5, 101]}, "input_ids"),
        ("/generate", {"input_ids": [5, -3]}, "input_ids"),
        ("/generate", {"input_ids": [5, True]}, "input_ids"),
        ("/generate", {"input_ids": [[5, 6], [5, 500]]}, "input_ids[1]"),
        ("/generate", {"input_ids": prompt, "top_logprobs_num": 21}, "top_logprobs_num"),
        ("/generate", {"input_ids": prompt * 20}, "input_ids"),  # longer than the context
        ("/v1/completions", completion(temperature=-0.5), "temperature"),
        ("/v1/completions", '{"model": "%s", "prompt": [5, 6], "top_p": NaN}' % MODEL, "top_p"),
        ("/v1/completions", completion(n=0), "n"),
        ("/v1/completions", completion(logprobs=21), "logprobs"),
        ("/v1/completions", completion(prompt=[5, 1000]), "prompt"),
        ("/v1/completions", completion(max_tokens=-5), "max_tokens"),
        ("/v1/completions", completion(seed="x"), "seed"),
        ("/v1/completions", completion(stop_token_ids=[-1]), "stop_token_ids"),
        ("/v1/completions", completion(return_token_ids="yes"), "return_token_ids"),
        ("/v1/chat/completions", chat(logprobs=True, top_logprobs=50), "top_logprobs"),
        ("/v1/chat/completions", chat(logprobs="yes"), "logprobs"),
        ("/v1/chat/completions", chat(max_completion_tokens=-1), "max_completion_tokens"),
        ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], '
                                 '"temperature": 1e999}' % MODEL, "temperature"),
    ]


def test_bad_values_get_400_naming_the_field(served):
    url, _, tok = served
    for route, body, field in _bad_requests(chat_ids(tok, "Say hi.")):
        if isinstance(body, str):
            r = requests.post(url + route, data=body, headers={"Content-Type": "application/json"}, timeout=HANG_GUARD_S)
        else:
            r = requests.post(url + route, json=body, timeout=HANG_GUARD_S)
        assert r.status_code == 400, (route, body, r.status_code, r.text)
        error = r.json()["error"]
        assert error["param"] == field and error["code"] == 400 and error["type"] == "Bad Request", (field, error)
        assert field.split(".")[-1].split("[")[0] in error["message"], (field, error["message"])
    # the field is named in the message as a user reads it
    r = requests.post(f"{url}/generate", json={"input_ids": [5, 101]}, timeout=HANG_GUARD_S)
    assert r.json()["error"]["message"] == "input_ids[1]=101 is not a token id of this model (0 .. 100)"
    r = requests.post(f"{url}/generate", json={"input_ids": [5], "sampling_params": {"top_p": 0}}, timeout=HANG_GUARD_S)
    assert r.json()["error"]["message"] == "sampling_params.top_p must be greater than 0 and at most 1, got 0"


def test_a_huge_max_new_tokens_is_cut_to_the_context(served):
    url, engine, tok = served
    prompt = chat_ids(tok, "Say hi.")
    room = engine.context_length - len(prompt)
    answer = requests.post(f"{url}/generate", json={"input_ids": prompt, "sampling_params": _greedy(10**9)},
                           timeout=HANG_GUARD_S).json()
    assert answer["meta_info"]["completion_tokens"] == room
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": room}
    choice = requests.post(f"{url}/v1/completions", timeout=HANG_GUARD_S, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 10**9, "temperature": 0.0, "return_token_ids": True,
    }).json()["choices"][0]
    assert len(choice["token_ids"]) == room and choice["finish_reason"] == "length"
    assert choice["token_ids"] == answer["output_ids"]


# ------------------------------------------------------------------------- load


@pytest.mark.integration
def test_a_short_request_is_answered_while_a_long_one_runs(served):
    url, engine, tok = served
    prompt = chat_ids(tok, "Say hi.")
    long_body = {"input_ids": [prompt] * 8, "sampling_params": _greedy(480)}
    box: list = []
    start = time.perf_counter()
    long = threading.Thread(target=lambda: box.append(requests.post(f"{url}/generate", json=long_body, timeout=HANG_GUARD_S)),
                            daemon=True)
    long.start()
    deadline = time.monotonic() + HANG_GUARD_S
    while requests.get(f"{url}/get_server_info", timeout=HANG_GUARD_S).json()["running_requests"] < 1:
        assert time.monotonic() < deadline and long.is_alive()
        time.sleep(0.01)
    t0 = time.perf_counter()
    short = requests.post(f"{url}/generate", json={"input_ids": prompt, "sampling_params": _greedy(3)}, timeout=HANG_GUARD_S)
    short_s = time.perf_counter() - t0
    still_running = long.is_alive()  # the short one was answered while the long one ran: they took turns
    long.join(HANG_GUARD_S)
    long_s = time.perf_counter() - start
    assert short.status_code == 200 and still_running, (short_s, long_s)
    # taking turns changes no result: both equal the engine's own generation
    ref = engine.generate([EngineRequest(prompt, SamplingParams(480, 0.0))], seed=0)[0]
    assert [a["output_ids"] for a in box[0].json()] == [ref.response_ids] * 8
    assert short.json()["output_ids"] == ref.response_ids[:3]
    print(f"short request {short_s * 1000:.0f} ms while the long one took {long_s:.2f} s")


def test_fifty_concurrent_connections_are_all_answered(served):
    url, engine, tok = served
    prompt = chat_ids(tok, "What is 2 + 3?")
    barrier = threading.Barrier(50)
    answers: list = [None] * 50

    def one(i: int) -> None:
        barrier.wait()
        try:
            answers[i] = requests.post(f"{url}/generate", json={"input_ids": prompt, "sampling_params": _greedy(4)},
                                       timeout=HANG_GUARD_S)
        except requests.RequestException as e:
            answers[i] = e

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_GUARD_S)
    failed = [a for a in answers if not isinstance(a, requests.Response) or a.status_code != 200]
    assert not failed, failed[:3]
    ref = engine.generate([EngineRequest(prompt, SamplingParams(4, 0.0))], seed=0)[0].response_ids
    assert all(a.json()["output_ids"] == ref for a in answers)


def test_a_request_past_its_deadline_or_a_full_queue_gets_503():
    """The engine loop is held by exclusive work (as a long weight load would hold it) while
    requests arrive: one waits in the queue, the next is refused at once; with a short deadline,
    the waiting one is dropped at it. (Two servers: with one, a slow machine could let the deadline
    empty the queue before the second request arrived.)"""
    tok = build_char_tokenizer()
    body = {"input_ids": chat_ids(tok, "Say hi."), "sampling_params": _greedy(2)}
    for deadline_s in (HANG_GUARD_S, 1.0):
        engine = HFEngine(build_tiny_model("llama", tok, seed=42), tok, dtype=torch.float32)
        service = _service(engine, tok, limits=ServeLimits(request_timeout_s=deadline_s, max_queued_requests=1))
        httpd, url = _serve_in_thread(service)
        holding, release = threading.Event(), threading.Event()
        try:
            holder, _ = in_thread(lambda: service.scheduler.exclusive(
                lambda: holding.set() or release.wait(HANG_GUARD_S), "holding the engine"))
            assert holding.wait(HANG_GUARD_S)
            t0 = time.perf_counter()
            waiting, box = in_thread(lambda: requests.post(f"{url}/generate", json=body, timeout=HANG_GUARD_S))
            if deadline_s == HANG_GUARD_S:  # no deadline it could reach: the queue stays full
                while service.scheduler.load != (0, 1):
                    time.sleep(0.005)
                r = requests.post(f"{url}/generate", json=body, timeout=HANG_GUARD_S)
                assert r.status_code == 503 and r.json()["error"]["code"] == 503
                message = r.json()["error"]["message"]
                assert "1 requests are already waiting for the engine (--max-queued-requests 1)" in message
                release.set()
                waiting.join(HANG_GUARD_S)
                assert box[0][1].status_code == 200  # it waited, and is answered once the engine is free
            else:
                waiting.join(HANG_GUARD_S)
                r = box[0][1]
                assert r.status_code == 503 and time.perf_counter() - t0 >= 1.0
                assert "ran past its deadline of 1s (waiting for the engine; --request-timeout)" in \
                    r.json()["error"]["message"]
                release.set()
            holder.join(HANG_GUARD_S)
            assert requests.post(f"{url}/generate", json=body, timeout=HANG_GUARD_S).status_code == 200
        finally:
            release.set()
            _stop(httpd, service)


# ------------------------------------------------------------------------- weight-update groups


def test_a_group_init_aimed_at_a_silent_peer_fails_within_its_timeout(served):
    url, _, _ = served
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # takes connections (the kernel completes them) and never answers
    port = silent.getsockname()[1]
    try:
        body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "group_name": "silent", "backend": "gloo", "timeout_s": 2}
        r = requests.post(f"{url}/init_weights_update_group", json=body, timeout=HANG_GUARD_S)
        assert r.status_code == 400  # its own 2 s ended it: the message says so
        message = r.json()["message"]
        assert f"127.0.0.1:{port} took the connection but did not answer the rendezvous within 2s" in message
        assert "silent" not in requests.get(f"{url}/get_server_info", timeout=HANG_GUARD_S).json()["weight_update_groups"]
        r = requests.post(f"{url}/init_weights_update_group", json={**body, "master_port": "x"}, timeout=HANG_GUARD_S)
        assert r.status_code == 400 and r.json() == {"success": False,
                                                     "message": "master_port must be a whole number, got 'x'"}
    finally:
        silent.close()


# ------------------------------------------------------------------------- round two (issue 29)


def _error(r: requests.Response, status: int, param: str | None) -> str:
    assert r.status_code == status, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["code"] == status and error["param"] == param, error
    return error["message"]


def test_a_request_chat_template_is_refused_unless_the_server_trusts_them(served):
    url, engine, tok = served
    template = "{% for m in messages %}{{ m.content }}{% endfor %}!"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for route, body, param in (
            ("/v1/chat/completions", {**chat, "chat_template_kwargs": {"chat_template": template}},
             "chat_template_kwargs.chat_template"),
            ("/v1/chat/completions", {**chat, "chat_template": template}, "chat_template"),
            ("/tokenize", {"messages": chat["messages"], "chat_template_kwargs": {"chat_template": template}},
             "chat_template_kwargs.chat_template")):
        message = _error(requests.post(url + route, json=body, timeout=HANG_GUARD_S), 400, param)
        assert "--trust-request-chat-template" in message
    # other template variables still reach the model's own template
    r = requests.post(f"{url}/tokenize", json={"messages": chat["messages"], "chat_template_kwargs": {"x": 1}},
                      timeout=HANG_GUARD_S)
    assert r.status_code == 200 and r.json()["tokens"] == chat_ids(tok, "hi")

    trusting = _service(engine, tok, trust_request_chat_template=True)
    httpd, trusted_url = _serve_in_thread(trusting)
    try:
        r = requests.post(f"{trusted_url}/tokenize", timeout=HANG_GUARD_S, json={
            "messages": chat["messages"], "chat_template_kwargs": {"chat_template": template}})
        assert r.status_code == 200 and r.json()["tokens"] == tok("hi!", add_special_tokens=False)["input_ids"]
    finally:
        _stop(httpd, trusting)


@pytest.mark.integration
def test_n_stop_strings_and_json_are_bounded_before_anything_runs(served):
    url, _, tok = served
    prompt = chat_ids(tok, "Say hi.")
    completion = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    assert "2000000 sequences, more than this server's limit of 16384" in _error(
        requests.post(f"{url}/v1/completions", json={**completion, "n": 2_000_000}, timeout=HANG_GUARD_S), 400, "n")
    assert "2 sample(s) of 8193 prompt(s)" in _error(requests.post(
        f"{url}/v1/completions", json={**completion, "prompt": [prompt] * 8193, "n": 2}, timeout=HANG_GUARD_S), 400, "n")
    assert "limit of 16384" in _error(requests.post(f"{url}/generate", json={"input_ids": [[5]] * 16385},
                                                    timeout=HANG_GUARD_S), 400, "input_ids")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert "65 stop strings, more than this server's limit of 64" in _error(
        requests.post(f"{url}/v1/chat/completions", json={**chat, "stop": [f"s{i}" for i in range(65)]},
                      timeout=HANG_GUARD_S), 400, "stop")
    assert "4100 characters in all, more than this server's limit of 4096" in _error(
        requests.post(f"{url}/generate", json={"input_ids": prompt, "sampling_params": {"stop": ["x" * 4100]}},
                      timeout=HANG_GUARD_S), 400, "sampling_params.stop")
    assert "limit of 1024" in _error(requests.post(f"{url}/v1/completions", timeout=HANG_GUARD_S, json={
        **completion, "stop_token_ids": [5] * 1025}), 400, "stop_token_ids")
    # a body's arrays and objects are counted before it is parsed: 1.2 M empty lists in 3.6 MB
    many = b'{"model": "m", "prompt": [' + b"[]," * 1_200_000 + b"[]]}"
    r = requests.post(f"{url}/v1/completions", data=many, headers={"Content-Type": "application/json"}, timeout=HANG_GUARD_S)
    assert "1200003 JSON arrays and objects, more than this server's limit of 1000000" in _error(r, 413, None)
    # commas, brackets and escapes inside strings are text, not values
    text = "[{,}]\\\"" * 300_000
    r = requests.post(f"{url}/tokenize", json={"prompt": text, "return_token_strs": False}, timeout=HANG_GUARD_S)
    assert r.status_code == 200 and r.json()["count"] == len(tok(text)["input_ids"])


def test_deep_json_and_lone_surrogates_get_400_naming_the_field(served):
    url, _, _ = served
    headers = {"Content-Type": "application/json"}
    for depth in (40, 100_000):  # the second raised RecursionError (500) before
        body = '{"model": "%s", "prompt": %s1%s}' % (MODEL, "[" * depth, "]" * depth)
        message = _error(requests.post(f"{url}/v1/completions", data=body, headers=headers, timeout=HANG_GUARD_S), 400, None)
        assert message == "the request body nests arrays and objects more than 32 deep (this server's limit)"
    unbalanced = '{"prompt": ' + "[" * 100_000
    assert "brackets do not balance" in _error(requests.post(f"{url}/v1/completions", data=unbalanced,
                                                             headers=headers, timeout=HANG_GUARD_S), 400, None)
    lone = '{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800b"}]}' % MODEL
    message = _error(requests.post(f"{url}/v1/chat/completions", data=lone, headers=headers, timeout=HANG_GUARD_S), 400,
                     "messages[0].content")
    assert message.startswith("messages[0].content holds a lone UTF-16 surrogate")
    r = requests.post(f"{url}/generate", data='{"text": "\\udfff"}', headers=headers, timeout=HANG_GUARD_S)
    assert _error(r, 400, "text")


def _half_sent(host: str, port: int) -> socket.socket:
    s = socket.create_connection((host, port), timeout=HANG_GUARD_S)
    s.sendall(f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Le".encode())
    return s


def _until_closed(s: socket.socket) -> bytes:
    """What the server sends until it ends the connection (a close, or a reset when bytes were
    unread); blocks until then (the socket's timeout bounds the wait)."""
    received = b""
    try:
        while chunk := s.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def test_half_sent_headers_neither_lock_clients_out_nor_stay_open(served):
    url, _, _ = served
    host, port = url.removeprefix("http://").split(":")
    # 340 half-sent requests: before, each counted against the 328 connections uvicorn allowed,
    # and every /health answered 503
    idle = [_half_sent(host, int(port)) for _ in range(340)]
    try:
        for _ in range(3):
            assert requests.get(f"{url}/health", timeout=HANG_GUARD_S).status_code == 200
    finally:
        for s in idle:
            s.close()

    tok = build_char_tokenizer()
    engine = HFEngine(build_tiny_model("llama", tok, seed=42), tok, dtype=torch.float32)
    service = _service(engine, tok, limits=ServeLimits(header_timeout_s=1.0, read_timeout_s=3.0))
    httpd, small = _serve_in_thread(service)
    try:
        # headers not done within the header timeout: the server closes the connection (the
        # socket's own timeout is a hang guard; the close is the event)
        s = _half_sent(host, httpd.server_address[1])
        assert _until_closed(s) == b""
        s.close()
        # a body that does not arrive within the read timeout: 408, the connection closed
        with socket.create_connection((host, httpd.server_address[1]), timeout=HANG_GUARD_S) as s:
            s.sendall(f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Length: 100\r\n\r\n{{".encode())
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 3s" in answer
    finally:
        _stop(httpd, service)

    # The limits, with timeouts no slow machine reaches (hang guards): what fills them stays. Each
    # check on a fresh server, so that no connection of an earlier one (closed by the client, not
    # yet seen by the server on a busy machine) is counted or is older than the first new one.
    def limited_server():
        engine = HFEngine(build_tiny_model("llama", tok, seed=42), tok, dtype=torch.float32)
        service = _service(engine, tok, limits=ServeLimits(
            header_timeout_s=HANG_GUARD_S, read_timeout_s=HANG_GUARD_S, max_open_connections=100,
            max_running_requests=1, max_queued_requests=1))
        return (service, *_serve_in_thread(service))

    # past 100 open connections, the oldest without a request in progress is closed for a new one
    service, httpd, small = limited_server()
    try:
        idle = [_half_sent(host, httpd.server_address[1]) for _ in range(120)]
        assert requests.get(f"{small}/health", timeout=HANG_GUARD_S).status_code == 200
        assert _until_closed(idle[0]) == b""
        for s in idle:
            s.close()
    finally:
        _stop(httpd, service)

    service, httpd, small = limited_server()
    try:
        # bodies that trickle in fill the requests in progress (1 + 1 + 64): others get 503 until
        # they end, /health is answered throughout
        slow = []
        for _ in range(66):
            s = socket.create_connection((host, httpd.server_address[1]), timeout=HANG_GUARD_S)
            s.sendall(f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Length: 100\r\n\r\n{{".encode())
            slow.append(s)
        deadline = time.monotonic() + HANG_GUARD_S
        probe = {"input_ids": [5], "sampling_params": {"max_new_tokens": 0}}  # answered without the engine
        while (r := requests.post(f"{small}/generate", json=probe, timeout=HANG_GUARD_S)).status_code != 503:
            assert time.monotonic() < deadline, r.status_code
        assert "66 requests are in progress, this server's limit" in r.json()["error"]["message"]
        assert requests.get(f"{small}/health", timeout=HANG_GUARD_S).status_code == 200
        with socket.create_connection((host, httpd.server_address[1]), timeout=HANG_GUARD_S) as s:  # body never read
            s.sendall(f"POST /health HTTP/1.1\r\nHost: {host}\r\nContent-Length: 1000000000\r\n\r\n".encode())
            assert _until_closed(s).startswith(b"HTTP/1.1 200")
        for s in slow:  # the clients go away: their places free up
            s.close()
        while (r := requests.post(f"{small}/generate", json=probe, timeout=HANG_GUARD_S)).status_code != 200:
            assert time.monotonic() < deadline, r.status_code
            time.sleep(0.01)
        assert requests.post(f"{small}/generate", json={"input_ids": [5], "sampling_params": _greedy(1)},
                             timeout=HANG_GUARD_S).status_code == 200
    finally:
        _stop(httpd, service)


def test_a_failing_disk_weight_load_changes_nothing(tmp_path):
    from safetensors.torch import save_file

    tok = build_char_tokenizer()
    engine = HFEngine(build_tiny_model("llama", tok, seed=42), tok, dtype=torch.float32)
    service = _service(engine, tok)
    httpd, url = _serve_in_thread(service)
    body = {"input_ids": chat_ids(tok, "Say hi."), "sampling_params": _greedy(8)}
    try:
        before = requests.post(f"{url}/generate", json=body, timeout=HANG_GUARD_S).json()
        params = dict(engine.model.named_parameters())
        names = sorted(params)
        # the 1st file's tensors are good (and change the output), the 2nd file has a wrong shape
        save_file({n: torch.zeros_like(params[n]) for n in names[:3]}, str(tmp_path / "a.safetensors"))
        save_file({names[3]: torch.zeros(2, 2)}, str(tmp_path / "b.safetensors"))
        r = requests.post(f"{url}/update_weights_from_disk", json={"model_path": str(tmp_path)}, timeout=HANG_GUARD_S)
        assert r.status_code == 400 and r.json()["success"] is False
        assert f"b.safetensors: tensor {names[3]} has shape [2, 2]" in r.json()["message"]
        assert "nothing was loaded" in r.json()["message"]
        after = requests.post(f"{url}/generate", json=body, timeout=HANG_GUARD_S).json()
        assert after["output_ids"] == before["output_ids"] and after["meta_info"]["weight_version"] == "0"
        # a file that is not safetensors, and a folder of no parameter of this model
        (tmp_path / "b.safetensors").write_bytes(b"not safetensors")
        r = requests.post(f"{url}/update_weights_from_disk", json={"model_path": str(tmp_path)}, timeout=HANG_GUARD_S)
        assert "cannot be read as safetensors" in r.json()["message"]
        (tmp_path / "b.safetensors").unlink()
        (tmp_path / "a.safetensors").unlink()
        save_file({"no.such.weight": torch.zeros(2)}, str(tmp_path / "c.safetensors"))
        r = requests.post(f"{url}/update_weights_from_disk", json={"model_path": str(tmp_path)}, timeout=HANG_GUARD_S)
        assert "no tensor in" in r.json()["message"]
        # the good file alone loads, and moves the version
        save_file({n: torch.zeros_like(params[n]) for n in names[:3]}, str(tmp_path / "c.safetensors"))
        r = requests.post(f"{url}/update_weights_from_disk", json={"model_path": str(tmp_path)}, timeout=HANG_GUARD_S)
        assert r.json()["success"] is True
        assert requests.post(f"{url}/generate", json=body, timeout=HANG_GUARD_S).json()["meta_info"]["weight_version"] == "1"
    finally:
        _stop(httpd, service)


def test_a_fifo_of_weights_and_a_huge_group_timeout_are_refused(served, tmp_path):
    url, _, tok = served
    os.mkfifo(tmp_path / "model.safetensors")  # before: the engine blocked reading it, /generate timed out
    r = requests.post(f"{url}/update_weights_from_disk", json={"model_path": str(tmp_path)}, timeout=HANG_GUARD_S)
    assert r.status_code == 400 and "model.safetensors is not a regular file" in r.json()["message"]
    body = {"input_ids": chat_ids(tok, "Say hi."), "sampling_params": _greedy(2)}
    assert requests.post(f"{url}/generate", json=body, timeout=HANG_GUARD_S).status_code == 200

    group = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
             "group_name": "g", "backend": "gloo", "timeout_s": 1e9}
    r = requests.post(f"{url}/init_weights_update_group", json=group, timeout=HANG_GUARD_S)
    assert r.status_code == 400 and r.json()["message"] == "timeout_s must be greater than 0 and at most 300, got 1e+09"
    # one group forms at a time: a second init while one waits for a silent peer is refused (429)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        silent.settimeout(HANG_GUARD_S)
        # the first must still be forming when the second arrives: on a machine too slow for that
        # within the first's timeout_s (its answer came first), the pair again with twice the time
        timeout_s = 3
        while True:
            first, box = in_thread(lambda: requests.post(f"{url}/init_weights_update_group", timeout=HANG_GUARD_S,
                                                         json={**group, "master_port": silent.getsockname()[1],
                                                               "timeout_s": timeout_s}))
            peer, _ = silent.accept()  # the first init is connecting
            r = requests.post(f"{url}/init_weights_update_group", json={**group, "group_name": "h", "timeout_s": 3},
                              timeout=HANG_GUARD_S)
            first_was_forming = not box  # no answer yet when the second was answered
            first.join(HANG_GUARD_S)
            peer.close()
            if r.status_code == 429 or first_was_forming or timeout_s >= 300:
                break
            timeout_s = min(2 * timeout_s, 300)
        assert r.status_code == 429 and "another weight update group is forming" in r.json()["message"]
        assert box[0][1].status_code == 400
    finally:
        silent.close()
