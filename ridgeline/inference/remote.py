"""Remote inference engines (`generator.run_engines_locally=false`): a client for servers at
`generator.remote_inference_engine_urls`, behind the same `InferenceEngine` interface.

Two server APIs, picked by `generator.backend`:
- `sglang` (and `hf`, i.e. `ridgeline serve`): SGLang's native routes. `/generate` takes a batch
  of token-id prompts with per-item sampling params and seeds; weight updates go through
  `/init_weights_update_group` + `/update_weights_from_distributed`, the trainer broadcasting
  each tensor in the group (nccl between GPUs, gloo otherwise).
- `vllm`: the OpenAI-compatible `/v1/completions` with token prompts, `logprobs=N` (0 unless
  `sampling_params.logprobs` asks for more) and `return_token_ids` (one HTTP request per sample so
  each gets its own seed, sent concurrently so vLLM batches them). Weight updates need the server
  started with `VLLM_SERVER_DEV_MODE=1` and
  `--worker-extension-cls ridgeline.inference.vllm_worker.RidgelineWorkerExtension`: the client
  calls the extension through `/collective_rpc` and sends with Ridgeline's weight-sync protocol.

Both send the repetition penalty and the stop strings (kept in the output, as SkyRL asks: SGLang's
`no_stop_trim`, vLLM's `include_stop_str_in_output`); a server matches stop strings only if it
loaded its tokenizer (the client refuses to send stop strings to an SGLang server started with
`--skip-tokenizer-init`, which would ignore them).

Requests are spread over the servers in contiguous slices (samples of one prompt stay on one server,
where its prefix is cached). Connection errors are retried with exponential backoff; every request
has a timeout; the servers' health is checked at start, naming any URL that does not answer.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Sequence, TYPE_CHECKING

import requests
import torch

from ridgeline.inference.weight_transport import GroupSpec, TensorBroadcaster, WeightSender, free_port, usable_backend
from ridgeline.inference.launch import WORKER_EXTENSION
from ridgeline.inference.sglang_engine import (
    IDLE_TIMEOUT_S,
    native_output as sglang_native_output,
    release_tags,
    resume_tags,
    sglang_sampling_params,
)
from ridgeline.inference.types import (
    WAKE_TAGS,
    EngineError,
    EngineOutput,
    EngineRequest,
    MemoryTag,
    SamplingParams,
    TopLogprobs,
    wake_order,
)
from ridgeline.seeding import request_seeds

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema import RidgelineConfig

log = logging.getLogger(__name__)

API_KEY_ENV = "RIDGELINE_ENGINE_API_KEY"
GROUP_NAME = "ridgeline_weight_update"


@dataclass(frozen=True)
class RemoteSettings:
    """What the client needs from the config (see `from_config` for the keys)."""

    urls: tuple[str, ...]
    api: str                       # "sglang" (native routes) or "openai" (vLLM)
    dtype: torch.dtype             # the servers' weights dtype (generator.model_dtype)
    timeout_s: float = 600.0       # one HTTP request
    max_retries: int = 3           # connection errors only; a server's error answer is not retried
    backoff_s: float = 0.5         # first retry delay, doubled each time
    api_key: str | None = None
    override_existing_update_group: str = "auto"   # auto | enable | disable
    weight_sync_backend: str = "gloo"
    weight_sync_timeout_s: float = 60.0
    trainer_host: str = "127.0.0.1"   # the address the servers reach the trainer at for weight sync

    @classmethod
    def from_config(cls, cfg: RidgelineConfig, gpus: bool | None = None) -> "RemoteSettings":
        """`gpus`: whether the process that pushes the weights computes on GPUs (FSDP2's rank 0, which
        the Ray driver knows from its plan); None: this process's CUDA (`usable_backend`)."""
        from ridgeline.models.loading import DTYPES

        g = cfg.generator
        return cls(urls=tuple(normalize_url(u) for u in g.remote_inference_engine_urls),
                   api="openai" if g.backend == "vllm" else "sglang", dtype=DTYPES[g.model_dtype],
                   timeout_s=float(g.remote_request_timeout_s), max_retries=int(g.remote_max_retries),
                   api_key=os.environ.get(API_KEY_ENV) or None,
                   override_existing_update_group=str(g.override_existing_update_group),
                   weight_sync_backend=usable_backend(g.weight_sync_backend, gpus), weight_sync_timeout_s=float(g.weight_sync_timeout),
                   trainer_host=os.environ.get("RIDGELINE_TRAINER_HOST", "127.0.0.1"))


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if url.startswith(("http://", "https://")) else f"http://{url}"


class EngineHTTPError(EngineError):
    """A server answered a call with an HTTP error status (`status`)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class EngineUnreachable(EngineError):
    """No answer from a server after the retries (or a timeout while it worked on a request)."""

    def __init__(self, url: str, call: str, attempts: int, cause: Exception, timeout_s: float):
        self.url = url
        self.summary = f"{call}: {type(cause).__name__} after {attempts} attempt(s)"
        super().__init__(f"remote inference engine {url}: {self.summary} ({cause}). Check that the server is "
                         "up and reachable (generator.remote_inference_engine_urls); a slow server needs a longer "
                         f"generator.remote_request_timeout_s (now {timeout_s:g}s).")


class RemoteEngine:
    """The `InferenceEngine` interface over HTTP servers (see the module docstring)."""

    def __init__(self, settings: RemoteSettings):
        if not settings.urls:
            raise EngineError("generator.remote_inference_engine_urls is empty. Fix: list the servers, e.g. "
                              "generator.remote_inference_engine_urls=['127.0.0.1:8001']")
        self.settings = settings
        self.urls = [normalize_url(u) for u in settings.urls]
        self.dtype = settings.dtype
        self.session = requests.Session()
        if settings.api_key:
            self.session.headers["Authorization"] = f"Bearer {settings.api_key}"
        self.retried = 0      # connection retries so far (logged and counted, never silent)
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="ridgeline-remote")
        self._group: _UpdateGroup | None = None
        self._asleep_tags: tuple[MemoryTag, ...] = ()   # put to sleep by this client (WAKE_TAGS)
        self._released: list[str] = []                  # SGLang servers: their memory tags released
        self._detokenizes: dict[str, bool] = {}         # SGLang servers: whether they loaded a tokenizer
        self.check_health()
        self.model_names = [self._model_name(u) for u in self.urls]

    # -- HTTP ---------------------------------------------------------------------------------
    def request(self, method: str, url: str, route: str, body: dict | None = None,
                timeout_s: float | None = None) -> Any:
        """One call with retries on connection errors; the decoded JSON answer (None when empty)."""
        s = self.settings
        delay = s.backoff_s
        for attempt in range(s.max_retries + 1):
            try:
                r = self.session.request(method, url + route, json=body, timeout=timeout_s or s.timeout_s)
            except (requests.ConnectionError, requests.Timeout) as e:
                if attempt == s.max_retries or isinstance(e, requests.ReadTimeout):
                    # a read timeout means the server took the request: resending could run it twice
                    raise EngineUnreachable(url, f"{method} {route}", attempt + 1, e, s.timeout_s) from e
                self.retried += 1
                log.warning("remote engine %s: %s %s: %s; retry %d/%d in %.1fs", url, method, route,
                            type(e).__name__, attempt + 1, s.max_retries, delay)
                time.sleep(delay)
                delay *= 2
                continue
            if r.status_code == 401:
                raise EngineError(f"remote inference engine {url} refused the request (401 Unauthorized). "
                                  f"Fix: export {API_KEY_ENV}=<the server's API key>.")
            if r.status_code >= 400:
                raise EngineHTTPError(f"remote inference engine {url}: {method} {route} answered "
                                      f"{r.status_code}: {r.text[:500]}", r.status_code)
            return r.json() if r.content and r.headers.get("content-type", "").startswith("application/json") \
                else None
        raise AssertionError("unreachable")

    def check_health(self) -> None:
        """Every server answers /health, or an error names the ones that do not."""
        dead = []
        for url in self.urls:
            try:
                self.request("GET", url, "/health", timeout_s=min(10.0, self.settings.timeout_s))
            except EngineUnreachable as e:
                dead.append(f"{url} ({e.summary})")
        if dead:
            raise EngineError("remote inference engine(s) unreachable: " + "; ".join(dead) + ". Fix: start "
                              "the servers (ridgeline serve, python -m sglang.launch_server, or vLLM's "
                              "python -m vllm.entrypoints.openai.api_server), or correct "
                              "generator.remote_inference_engine_urls.")

    def _model_name(self, url: str) -> str:
        if self.settings.api == "openai":
            data = self.request("GET", url, "/v1/models")["data"]
            return data[0]["id"]
        return self.request("GET", url, "/get_model_info").get("model_path", "")

    def _map(self, fn: Callable[..., Any], *iterables: Iterable[Any]) -> list[Any]:
        return list(self._pool.map(fn, *iterables))

    # -- generation ---------------------------------------------------------------------------
    def generate(self, requests_: list[EngineRequest], seed: int | None = None) -> list[EngineOutput]:
        if not requests_:
            return []
        # every sample gets a seed of its own, so a batch is reproducible with a seed and its
        # samples still differ without one
        base = seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
        seeds = request_seeds(base, len(requests_))
        slices = spread(len(requests_), len(self.urls))
        if self.settings.api == "openai":
            jobs = [(self.urls[s], self.model_names[s], requests_[i], seeds[i])
                    for s, (lo, hi) in enumerate(slices) for i in range(lo, hi)]
            return self._map(lambda job: self._complete(*job), jobs)
        parts = self._map(lambda s: self._generate_native(self.urls[s], requests_[slices[s][0]:slices[s][1]],
                                                          seeds[slices[s][0]:slices[s][1]]),
                          [s for s, (lo, hi) in enumerate(slices) if hi > lo])
        return [out for part in parts for out in part]

    def _generate_native(self, url: str, reqs: list[EngineRequest], seeds: list[int]) -> list[EngineOutput]:
        if any(r.sampling_params.stop for r in reqs) and not self._matches_stop_strings(url):
            raise EngineError(f"remote inference engine {url} was started with --skip-tokenizer-init, so it cannot "
                              "match stop strings (generator.sampling_params.stop / eval_sampling_params.stop): it "
                              "would ignore them. Fix: restart it without --skip-tokenizer-init")
        params = [sglang_sampling_params(r.sampling_params, r.stop_token_ids, seed=sd) for r, sd in zip(reqs, seeds)]
        body = {"input_ids": [r.prompt_token_ids for r in reqs], "sampling_params": params,
                "return_logprob": True, "top_logprobs_num": [r.sampling_params.num_top_logprobs for r in reqs]}
        answer = self.request("POST", url, "/generate", body)
        if isinstance(answer, dict):
            answer = [answer]
        if not isinstance(answer, list) or len(answer) != len(reqs):
            raise EngineError(f"remote inference engine {url}: /generate answered {type(answer).__name__} "
                              f"of length {len(answer) if isinstance(answer, list) else '-'} for {len(reqs)} inputs")
        return [native_output(a, url, r.sampling_params.num_top_logprobs) for a, r in zip(answer, reqs)]

    def _matches_stop_strings(self, url: str) -> bool:
        """Whether the SGLang server at `url` loaded its tokenizer (SGLang matches stop strings on
        detokenized text); asked once, from `/get_server_info`."""
        if url not in self._detokenizes:
            info = self.request("GET", url, "/get_server_info") or {}
            self._detokenizes[url] = not info.get("skip_tokenizer_init", False)
        return self._detokenizes[url]

    def _complete(self, url: str, model: str, req: EngineRequest, seed: int) -> EngineOutput:
        answer = self.request("POST", url, "/v1/completions", completion_body(model, req, seed))
        return openai_output(answer, url, req.sampling_params.num_top_logprobs)

    def score(self, prompt_ids: list[int], response_ids: list[int], url: str | None = None) -> list[float]:
        url = url or self.urls[0]
        ids = list(prompt_ids) + list(response_ids)
        if self.settings.api == "openai":
            body = {"model": self.model_names[self.urls.index(url)], "prompt": ids, "max_tokens": 1,
                    "prompt_logprobs": 0, "return_token_ids": True}
            entries = self.request("POST", url, "/v1/completions", body)["choices"][0]["prompt_logprobs"]
            return [float(entries[i][str(t)]["logprob"]) for i, t in enumerate(ids) if i >= len(prompt_ids)]
        # SGLang's input logprobs start at logprob_start_len, whose own entry is None: start one
        # token early and drop it
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                "logprob_start_len": len(prompt_ids) - 1}
        entries = self.request("POST", url, "/generate", body)["meta_info"]["input_token_logprobs"][1:]
        if len(entries) != len(response_ids):
            raise EngineError(f"remote inference engine {url}: {len(entries)} input logprobs for "
                              f"{len(response_ids)} response tokens")
        return [float(e[0]) for e in entries]

    def score_all(self, prompt_ids: list[int], response_ids: list[int]) -> list[list[float]]:
        """`score` on every server (the weight-sync probe checks each one)."""
        return self._map(lambda u: self.score(prompt_ids, response_ids, u), self.urls)

    # -- weights and memory -------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.push_weights(named_tensors, None)

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None) -> dict[str, float]:
        """Push the weights to every server (cast to the servers' dtype) as weight version `version`
        (None: the next one); returns bytes / seconds. Servers this client put to sleep get their
        weights' memory back first."""
        self.wake_up(("weights",))
        if self._group is None:
            self._group = self._open_group()
        return self._group.push(list(named_tensors), version)

    def reset_prefix_cache(self) -> None:
        route = "/reset_prefix_cache" if self.settings.api == "openai" else "/flush_cache"
        self._map(lambda u: self.request("POST", u, route), self.urls)

    def sleep(self, level: int = 1) -> None:
        """vLLM servers: `/sleep?level=N`; SGLang servers release all their memory by its tags
        (KV cache, weights, CUDA graphs) at either level: the client cannot know whether a server
        keeps a host copy of its weights, and the next `update_weights` refills them."""
        if self.settings.api == "openai":
            self._map(lambda u: self.request("POST", u, f"/sleep?level={level}"), self.urls)
        else:
            tags = release_tags(2, weights_cpu_backup=False)
            self._map(lambda u: self._release_when_idle(u, tags), self.urls)
            self._released = tags
        self._asleep_tags = WAKE_TAGS

    def _release_when_idle(self, url: str, tags: list[str]) -> None:
        """An SGLang server asserts that its scheduler is idle when memory is released (the assertion
        kills a scheduler still closing its last batch, and the server with it): `/flush_cache?timeout=`
        first waits, server-side, until it is idle (400 if it is not within the time)."""
        self.request("POST", url, f"/flush_cache?timeout={IDLE_TIMEOUT_S:g}")
        self.request("POST", url, "/release_memory_occupation", {"tags": tags})

    def wake_up(self, tags: tuple[MemoryTag, ...] = WAKE_TAGS) -> None:
        """Take back what this client put to sleep, for `tags`: vLLM's `/wake_up?tags=...`, SGLang's
        `/resume_memory_occupation {"tags": [...]}` (`sglang_engine.resume_tags`)."""
        todo = tuple(t for t in wake_order(tags) if t in self._asleep_tags)
        if not todo:
            return
        if self.settings.api == "openai":
            query = "&".join(f"tags={t}" for t in todo)
            self._map(lambda u: self.request("POST", u, f"/wake_up?{query}"), self.urls)
        else:
            resumed = resume_tags(todo, self._released)
            if resumed:
                self._map(lambda u: self.request("POST", u, "/resume_memory_occupation", {"tags": resumed}),
                          self.urls)
            self._released = [t for t in self._released if t not in resumed]
        self._asleep_tags = tuple(t for t in self._asleep_tags if t not in todo)

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.session.close()

    def _open_group(self) -> "_UpdateGroup":
        return (_VLLMUpdateGroup if self.settings.api == "openai" else _SGLangUpdateGroup)(self)


def spread(n: int, servers: int) -> list[tuple[int, int]]:
    """Contiguous slices [lo, hi) of n requests over the servers, sizes differing by at most one."""
    base, extra = divmod(n, servers)
    out, lo = [], 0
    for s in range(servers):
        hi = lo + base + (1 if s < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def native_output(answer: dict, url: str, top_n: int = 0) -> EngineOutput:
    """An SGLang `/generate` item -> EngineOutput (`sglang_engine.native_output`), errors naming `url`."""
    try:
        return sglang_native_output(answer, top_n)
    except EngineError as e:
        raise EngineError(f"remote inference engine {url}: {e}") from e


def completion_body(model: str, req: EngineRequest, seed: int) -> dict:
    """The `/v1/completions` request of one sample (vLLM's OpenAI-compatible server): token-id
    prompt, `logprobs=N` with token ids as keys (`return_tokens_as_token_ids`), stop strings kept in
    the output."""
    p: SamplingParams = req.sampling_params
    body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": p.max_generate_length,
            "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "min_p": p.min_p,
            "repetition_penalty": p.repetition_penalty, "logprobs": p.num_top_logprobs,
            "return_token_ids": True, "seed": seed, "skip_special_tokens": True}
    if p.num_top_logprobs:
        body["return_tokens_as_token_ids"] = True
    if p.stop:
        body["stop"] = list(p.stop)
        body["include_stop_str_in_output"] = True
    if req.stop_token_ids:
        body["stop_token_ids"] = list(req.stop_token_ids)
    return body


def openai_top_logprobs(positions: list[dict[str, float]], n: int) -> list[TopLogprobs]:
    """`logprobs.top_logprobs` of a completion ({"token_id:ID": logprob} per position, the top n
    plus the sampled token) -> the n most likely (token id, logprob) pairs per position."""
    out = []
    for entries in positions:
        ranked = sorted(((float(lp), int(key.removeprefix("token_id:"))) for key, lp in entries.items()),
                        key=lambda pair: -pair[0])
        out.append([(tok, lp) for lp, tok in ranked[:n]])
    return out


def openai_output(answer: dict, url: str, top_n: int = 0) -> EngineOutput:
    """A vLLM `/v1/completions` answer with `return_token_ids` and `logprobs=top_n` -> EngineOutput."""
    try:
        choice = answer["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        lps = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        top = openai_top_logprobs(choice["logprobs"]["top_logprobs"], top_n) if top_n else None
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise EngineError(f"remote inference engine {url}: /v1/completions answer lacks token_ids or "
                          f"logprobs.token_logprobs / top_logprobs (a server older than vLLM 0.10 has no "
                          f"return_token_ids): {e!r}") from e
    if len(lps) != len(ids) or (top is not None and len(top) != len(ids)):
        raise EngineError(f"remote inference engine {url}: {len(ids)} token ids but {len(lps)} logprobs")
    matched = choice.get("stop_reason")
    return EngineOutput(ids, lps, "length" if choice.get("finish_reason") == "length" else "stop",
                        matched_stop=matched if isinstance(matched, str) else None, top_logprobs=top)


# -- weight-update groups --------------------------------------------------------------------
class _UpdateGroup:
    """The trainer (rank 0) and every server's workers in one group; rank offsets from their tp."""

    def __init__(self, client: RemoteEngine):
        self.client = client
        self.version = 0

    def _world(self, sizes: list[int]) -> tuple[list[int], int]:
        offsets, rank = [], 1
        for size in sizes:
            offsets.append(rank)
            rank += size
        return offsets, rank

    def _spec(self, world: int) -> GroupSpec:
        s = self.client.settings
        return GroupSpec(port=free_port(), rank=0, world_size=world, backend=s.weight_sync_backend,
                         host=s.trainer_host, timeout_s=s.weight_sync_timeout_s, group_name=GROUP_NAME)

    def _together(self, calls: Sequence[Callable[[], Any]], local: Callable[[], Any]) -> Any:
        """Run the servers' HTTP calls while this process does its part of a collective. A server
        that refuses (e.g. "group already exists") fails the call at once instead of leaving this
        side waiting for the group's timeout (its thread then gives up on its own)."""
        pool = self.client._pool
        futures = [pool.submit(c) for c in calls]
        mine = pool.submit(local)
        wait([*futures, mine], return_when=FIRST_EXCEPTION)
        for f in futures:
            error = f.exception() if f.done() else None
            if error is not None:
                raise error
        result = mine.result()
        for f in futures:
            f.result()
        return result

    def push(self, named: list[tuple[str, torch.Tensor]], version: int | None) -> dict[str, float]:
        """Send weight version `version` (None: the next) to every server; bytes / seconds."""
        raise NotImplementedError

    def close(self) -> None: ...


class _SGLangUpdateGroup(_UpdateGroup):
    """SGLang's update group. From 0.5.2x a server loads weights only inside a session,
    `/begin_weight_update` ... `/end_weight_update` (400 otherwise); an older server (and
    `ridgeline serve`) answers those routes 404 and updates without one."""

    def __init__(self, client: RemoteEngine):
        super().__init__(client)
        self.sessions: dict[str, bool] = {}   # server URL -> whether it has weight-update sessions
        c = client
        sizes = [int(c.request("GET", u, "/get_server_info").get("tp_size", 1)) for u in c.urls]
        offsets, world = self._world(sizes)
        spec = self._spec(world)
        if c.settings.override_existing_update_group in ("auto", "enable"):
            for u in c.urls:  # a group left behind by an earlier run would refuse ours
                try:
                    c.request("POST", u, "/destroy_weights_update_group", {"group_name": GROUP_NAME})
                except EngineError:
                    pass  # none existed
        bodies = [{"master_address": spec.host, "master_port": spec.port, "rank_offset": off, "world_size": world,
                   "group_name": GROUP_NAME, "backend": spec.backend} for off in offsets]
        calls = [functools.partial(c.request, "POST", u, "/init_weights_update_group", b)
                 for u, b in zip(c.urls, bodies)]
        self.endpoint: TensorBroadcaster = self._together(calls, lambda: TensorBroadcaster(spec))
        log.info("weight-update group %s: trainer + %d server rank(s) over %s", GROUP_NAME, world - 1, spec.backend)

    def push(self, named: list[tuple[str, torch.Tensor]], version: int | None) -> dict[str, float]:
        t0 = time.perf_counter()
        self.version = self.version + 1 if version is None else int(version)
        dtype = self.client.dtype
        tensors = [t.detach().to(dtype) if t.is_floating_point() else t.detach() for _, t in named]
        body = {"names": [n for n, _ in named], "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
                "shapes": [list(t.shape) for t in tensors], "group_name": GROUP_NAME, "flush_cache": True,
                "weight_version": str(self.version)}
        c = self.client
        opened = [u for u, has in zip(c.urls, c._map(self._begin, c.urls)) if has]
        calls = [functools.partial(c.request, "POST", u, "/update_weights_from_distributed", body) for u in c.urls]
        try:
            sent = self._together(calls, lambda: self.endpoint.send_tensors(tensors))
        except BaseException:
            for u in opened:  # close the sessions so the next sync can open them; the failure is what counts
                try:
                    c.request("POST", u, "/end_weight_update", {})
                except EngineError as e:
                    log.warning("remote inference engine %s: closing its weight-update session failed: %s", u, e)
            raise
        c._map(lambda u: c.request("POST", u, "/end_weight_update", {}), opened)
        return {"bytes": sent, "seconds": time.perf_counter() - t0}

    def _begin(self, url: str) -> bool:
        """Open `url`'s weight-update session; False for a server without sessions (404, learned once)."""
        if self.sessions.get(url) is False:
            return False
        try:
            self.client.request("POST", url, "/begin_weight_update", {})
        except EngineHTTPError as e:
            if e.status != 404:
                raise
            log.info("remote inference engine %s has no /begin_weight_update (SGLang before 0.5.2x, or ridgeline "
                     "serve): its weights are updated without a session", url)
            self.sessions[url] = False
            return False
        self.sessions[url] = True
        return True

    def close(self) -> None:
        self.endpoint.close()


class _VLLMUpdateGroup(_UpdateGroup):
    """vLLM: each worker of each server joins Ridgeline's own weight-sync group through the worker
    extension (`/collective_rpc`), then receives with `WeightReceiver`."""

    def __init__(self, client: RemoteEngine):
        super().__init__(client)
        c = client
        versions = [self._rpc(u, "ridgeline_weights_version") for u in c.urls]  # one result per worker
        sizes = [len(v) for v in versions]
        if c.settings.override_existing_update_group == "disable":
            taken = [u for u, v in zip(c.urls, versions) if any(int(x or 0) > 0 for x in v)]
            if taken:  # "auto" / "enable": joining closes the receiver another trainer left there
                raise EngineError(f"remote inference engine(s) {', '.join(taken)} already hold weights pushed by "
                                  "another trainer's update group, and generator.override_existing_update_group="
                                  "disable. Fix: restart those servers, or override_existing_update_group=auto")
        offsets, world = self._world(sizes)
        spec = self._spec(world)
        calls = [functools.partial(self._rpc, u, "ridgeline_init_receiver", json.dumps({**asdict(spec), "rank": off}))
                 for u, off in zip(c.urls, offsets)]
        self.sender: WeightSender = self._together(calls, lambda: WeightSender(spec))

    def _rpc(self, url: str, method: str, *args: str) -> list[Any]:
        try:
            answer = self.client.request("POST", url, "/collective_rpc", {"method": method, "args": list(args)})
        except EngineError as e:
            raise EngineError(f"{e}. vLLM weight updates need the server started with VLLM_SERVER_DEV_MODE=1 "
                              f"and --worker-extension-cls {WORKER_EXTENSION} (ridgeline importable in the "
                              "server's environment); see docs/engines.md") from e
        return (answer or {}).get("results", [])

    def push(self, named: list[tuple[str, torch.Tensor]], version: int | None) -> dict[str, float]:
        t0 = time.perf_counter()
        calls = [functools.partial(self._rpc, u, "ridgeline_receive_weights") for u in self.client.urls]
        stats = self._together(calls, lambda: self.sender.send(named, self.client.dtype, version))
        self.version = stats.version
        self.client.reset_prefix_cache()
        return {"bytes": stats.bytes, "seconds": time.perf_counter() - t0}

    def close(self) -> None:
        self.sender.close()

