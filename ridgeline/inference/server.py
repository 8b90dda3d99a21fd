"""`ridgeline serve`: the embedded engine behind an HTTP server, so rollouts can run in another
process or on another machine, and so the remote client is tested against a real server.

It speaks the two APIs of `ridgeline.inference.remote`'s client:

SGLang-style native routes (the same request and answer shapes as SGLang's server)
  GET  /health, /health_generate                 200 when the engine answers
  GET  /get_model_info, /get_server_info         model path, dtype, tp_size, weight version
  POST /generate          {text or input_ids (one, or a list), sampling_params, return_logprob,
                           logprob_start_len, top_logprobs_num}; sampling_params: max_new_tokens,
                           temperature, top_p, top_k, min_p, repetition_penalty, stop,
                           stop_token_ids, skip_special_tokens, no_stop_trim, sampling_seed
  POST /flush_cache
  POST /init_weights_update_group     {master_address, master_port, rank_offset, world_size,
                                       group_name, backend}
  POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache,
                                       weight_version}
  POST /destroy_weights_update_group  {group_name}
  POST /update_weights_from_disk      {model_path}: a folder of safetensors in HF names
  POST /release_memory_occupation, /resume_memory_occupation {tags}: sleep / wake_up(tags)
vLLM's OpenAI-compatible routes (ridgeline.inference.openai_api)
  GET  /v1/models, POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize

Both APIs answer like their servers: the matched stop string in `finish_reason["matched"]` /
`stop_reason`, the top logprobs in `meta_info["output_top_logprobs"]` / `logprobs.top_logprobs`
(chat: OpenAI's `logprobs.content`), and text without special tokens and without the stop string
unless `no_stop_trim` / `include_stop_str_in_output` (token ids always end with the token that
completed it). Errors take OpenAI's shape ({"error": {message, type, param, code}}), but the
weight routes' SGLang-style {success, message}.

Safety (docs/security.md): the server binds 127.0.0.1 unless told otherwise and refuses to serve
the routes that change weights, memory or the cache beyond loopback without an API key; with a key
every route but /health asks for `Authorization: Bearer <key>`, checked before the body is read;
bodies are capped (`ServeLimits.max_body_bytes`) and measured before they are parsed (depth,
number of values), off the event loop; headers and bodies have timeouts; every sampling field and
token id is checked (400 naming the field, request_fields), and what one request may cost (n x
prompts, stop strings) is bounded; a prompt must fit the context, and `max_new_tokens` /
`max_tokens` is cut to what is left of it; a chat template sent with a request is rendered only
when the server trusts them; a disk weight update loads all or nothing. HTTP runs on FastAPI +
uvicorn (http_app).

Engine work runs on one thread (scheduler.EngineScheduler): generations take turns step by step,
so a short request is answered while a long one runs; weight, memory and cache routes run alone,
so a weight update never lands in the middle of a generation. A request without a seed gets a
fresh one from the operating system: the process's global RNG is never touched (a training run's
endpoint shares its process, ridgeline.inference.endpoint).
"""

from __future__ import annotations

import secrets
import stat
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ridgeline.inference import request_fields as fields
from ridgeline.inference.http_app import HttpLimits, HttpServer, Route, build_app, check_exposure
from ridgeline.inference.openai_api import OpenAIApi
from ridgeline.inference.request_fields import ModelLimits, RequestError
from ridgeline.inference.scheduler import EngineScheduler, single_step
from ridgeline.inference.sglang_engine import CUDA_GRAPH, KV_CACHE, WEIGHTS
from ridgeline.inference.types import EngineOutput, EngineRequest, SamplingParams, Steps
from ridgeline.inference.weight_transport import GroupSpec, TensorBroadcaster, dtype_from_name

__all__ = ["EngineService", "RequestError", "ServeLimits", "make_http_server"]

GenerationSteps = Callable[[list[EngineRequest], "int | None"], Steps[list[EngineOutput]]]
"""An engine's generation in steps (`HFEngine.generate_steps`)."""


@dataclass(frozen=True)
class ServeLimits:
    """What one server takes on (`ridgeline serve`'s flags; SGLang's and vLLM's names where they
    have one)."""

    max_body_bytes: int = 64 * 2**20      # --max-body-mb
    max_running_requests: int = 8         # generations advanced together, step by step
    max_queued_requests: int = 256        # waiting beyond those; more are refused (503)
    request_timeout_s: float = 600.0      # from arrival to answer (generator.remote_request_timeout_s's default)
    max_logprobs: int = 20                # top logprobs per token (vLLM's --max-logprobs)
    backlog: int = 2048                   # the listen queue (uvicorn's default)
    max_sequences: int = 16384            # n x prompts of one request (a remote trainer's batch is one)
    max_stop_strings: int = 64            # stop strings of one request ...
    max_stop_chars: int = 4096            # ... and their total length
    max_json_depth: int = 32              # nesting of a request body's arrays and objects
    max_json_containers: int = 1_000_000  # arrays and objects of a request body
    header_timeout_s: float = 10.0        # from a connection (or a request's first byte) to its last header
    read_timeout_s: float = 60.0          # from the last header to the end of the body
    max_open_connections: int = 2048      # beyond: the oldest connection without a request in progress closes
    max_group_timeout_s: float = 300.0    # the most a weight-update group init may wait for its peers

    @property
    def max_connections(self) -> int:
        """Requests in progress (reading, queued, running) before the server answers 503: room for
        every queued and running request, and the quick info routes besides; also the handler threads."""
        return self.max_running_requests + self.max_queued_requests + 64

    def http(self) -> HttpLimits:
        return HttpLimits(max_body_bytes=self.max_body_bytes, max_requests=self.max_connections,
                          max_json_depth=self.max_json_depth, max_json_containers=self.max_json_containers,
                          read_timeout_s=self.read_timeout_s)


def sampling_from_native(p: dict[str, Any], top_logprobs_num: Any, limits: ModelLimits) -> SamplingParams:
    """SGLang `sampling_params` (and the request's `top_logprobs_num`) -> Ridgeline's; unknown keys
    are refused, not silently dropped."""
    known = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop",
             "stop_token_ids", "skip_special_tokens", "no_stop_trim", "sampling_seed"}
    unknown = sorted(set(p) - known)
    if unknown:
        raise RequestError(f"sampling_params keys not supported by ridgeline serve: {unknown}", "sampling_params")
    for key in ("skip_special_tokens", "no_stop_trim"):
        if key in p:
            fields.flag(p[key], f"sampling_params.{key}")
    fields.seed(p.get("sampling_seed"), "sampling_params.sampling_seed")
    return fields.sampling(p, max_tokens=("sampling_params.max_new_tokens", p.get("max_new_tokens", 128)),
                           prefix="sampling_params.", top_logprobs=("top_logprobs_num", top_logprobs_num),
                           limits=limits)


@dataclass
class _Group:
    spec: GroupSpec
    endpoint: TensorBroadcaster


class EngineService:
    """The routes as plain methods over one engine: body dict in, answer dict out (a RequestError
    for a bad request). Engine work goes through the service's `EngineScheduler`."""

    def __init__(self, engine, tokenizer, model_path: str, *, tp_size: int = 1, served_model_name: str | None = None,
                 tokenizer_path: str | None = None, chat_max_tokens: int = 1024, context_length: int | None = None,
                 vocab_size: int | None = None, weight_shapes: dict[str, tuple[int, ...]] | None = None,
                 trust_request_chat_template: bool = False,
                 steps: GenerationSteps | None = None, limits: ServeLimits = ServeLimits()):
        """`served_model_name`: the name OpenAI requests must give as `model` (default `model_path`,
        vLLM's rule); `tokenizer_path`: a hub id or folder AutoTokenizer loads the model's tokenizer
        from (/v1/models' `root`, /get_model_info's `tokenizer_path`; default `model_path`);
        `chat_max_tokens`: the `max_tokens` of a chat request that sets none (vLLM fills
        the context; here the config's `generator.sampling_params.max_generate_length`);
        `context_length`: prompt + response tokens a request may take (None: the engine judges);
        `vocab_size`: token ids accepted (default: the tokenizer's); `weight_shapes`: the engine's
        parameters by name, so /update_weights_from_disk checks a whole folder before it loads any
        of it (None: that route refuses); `trust_request_chat_template`: render a chat template a
        request sends (vLLM's --trust-request-chat-template; default: refused); `steps`: the engine's
        generation in steps, so requests take turns step by step (None: each generation is one
        step, e.g. an engine shared with a training loop)."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.served_model_name = served_model_name or model_path
        self.tokenizer_path = tokenizer_path or model_path
        self.chat_max_tokens = chat_max_tokens
        self.tp_size = tp_size
        self.limits = limits
        self.model_limits = ModelLimits(vocab_size=vocab_size or len(tokenizer), context_length=context_length,
                                        max_logprobs=limits.max_logprobs, max_sequences=limits.max_sequences,
                                        max_stop_strings=limits.max_stop_strings,
                                        max_stop_chars=limits.max_stop_chars)
        self.weight_shapes = weight_shapes
        self.trust_request_chat_template = trust_request_chat_template
        self._forming = threading.Lock()  # one weight-update group forms at a time
        self._steps: GenerationSteps = steps or (lambda requests, seed: single_step(
            lambda: engine.generate(requests, seed=seed)))
        self.weight_version = "0"
        self.groups: dict[str, _Group] = {}
        self.scheduler = EngineScheduler(max_running=limits.max_running_requests,
                                         max_queued=limits.max_queued_requests, timeout_s=limits.request_timeout_s)
        self.started = time.time()
        self.openai = OpenAIApi(self)

    def close(self) -> None:
        """Stop the engine loop; requests still waiting fail."""
        self.scheduler.close()

    # -- info ---------------------------------------------------------------------------------
    def model_info(self, _: dict) -> dict:
        return {"model_path": self.model_path, "tokenizer_path": self.tokenizer_path, "is_generation": True,
                "dtype": str(self.engine.dtype).removeprefix("torch."), "weight_version": self.weight_version,
                "context_length": self.model_limits.context_length}

    def server_info(self, _: dict) -> dict:
        running, queued = self.scheduler.load
        return {"tp_size": self.tp_size, "dp_size": 1, "version": "ridgeline-serve",
                "model_path": self.model_path, "weight_version": self.weight_version,
                "weight_update_groups": sorted(self.groups), "context_length": self.model_limits.context_length,
                "max_running_requests": self.limits.max_running_requests, "running_requests": running,
                "queued_requests": queued}

    # -- generation ---------------------------------------------------------------------------
    def generate(self, body: dict) -> Any:
        """SGLang's /generate: `text` (a text or a list, tokenized with the tokenizer's special
        tokens, as SGLang does) or `input_ids`, one of the two."""
        if body.get("stream") is not None and fields.flag(body["stream"], "stream"):
            raise RequestError("stream=true is not supported: ridgeline serve answers with the whole response. "
                               "Fix: send stream=false", "stream")
        if ("text" in body) == ("input_ids" in body):
            raise RequestError("send either text (a text or a list of texts) or input_ids (token ids or a list of "
                               "them), one of the two", "input_ids")
        limits = self.model_limits
        if "text" in body:
            prompts, single = self._texts(body["text"])
        else:
            prompts, single = fields.token_batch(body["input_ids"], "input_ids", limits)
        fields.sequence_count(1, len(prompts), "text" if "text" in body else "input_ids", limits)
        raw = body.get("sampling_params") or {}
        raw_list = raw if isinstance(raw, list) else [raw] * len(prompts)
        if len(raw_list) != len(prompts) or not all(isinstance(p, dict) for p in raw_list):
            raise RequestError(f"sampling_params must be an object or a list of {len(prompts)} objects, one per "
                               "input", "sampling_params")
        tops = body.get("top_logprobs_num")
        tops = tops if isinstance(tops, list) else [tops] * len(prompts)
        if len(tops) != len(prompts):
            raise RequestError(f"{len(tops)} top_logprobs_num for {len(prompts)} inputs", "top_logprobs_num")
        start = body.get("logprob_start_len", -1)
        starts = start if isinstance(start, list) else [start] * len(prompts)
        if len(starts) != len(prompts):
            raise RequestError(f"{len(starts)} logprob_start_len for {len(prompts)} inputs", "logprob_start_len")
        starts = [-1 if s is None else fields.whole(s, "logprob_start_len", -1) for s in starts]
        fields.flag(body.get("return_logprob", False), "return_logprob")
        requests = []
        for i, (ids, p, n) in enumerate(zip(prompts, raw_list, tops)):
            stop = fields.stop_token_ids(p.get("stop_token_ids"), "sampling_params.stop_token_ids", limits)
            request = EngineRequest(ids, sampling_from_native(p, n, limits), stop)
            requests.append(fields.fit_context(request, "input_ids" if single else f"input_ids[{i}]", limits))
        outputs = self.sample(requests, [p.get("sampling_seed") for p in raw_list])
        results = []
        for ids, out, first, p in zip(prompts, outputs, starts, raw_list):
            meta = {"id": uuid.uuid4().hex, "prompt_tokens": len(ids), "completion_tokens": len(out.response_ids),
                    "finish_reason": _finish(out), "weight_version": self.weight_version,
                    "output_token_logprobs": [[lp, t, None] for lp, t in zip(out.logprobs, out.response_ids)]}
            if out.top_logprobs is not None:
                meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in top] for top in out.top_logprobs]
            if first >= 0:
                meta["input_token_logprobs"] = self.prompt_logprobs(ids, first)
            text = self.response_text(out, p.get("skip_special_tokens", True), p.get("no_stop_trim", False))
            results.append({"text": text, "output_ids": out.response_ids, "meta_info": meta})
        return results[0] if single else results

    def _texts(self, value: Any) -> tuple[list[list[int]], bool]:
        """SGLang's `text`: a text or a non-empty list of texts -> (token ids per text, was_single)."""
        texts = [value] if isinstance(value, str) else value
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError(f"text must be a text or a non-empty list of texts, got {fields.short(value)}", "text")
        prompts = [self.encode(t, add_special_tokens=True) for t in texts]
        for i, ids in enumerate(prompts):
            if not ids:
                raise RequestError("text: an empty text has no token to continue from",
                                   "text" if isinstance(value, str) else f"text[{i}]")
        return prompts, isinstance(value, str)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """`text`'s token ids; `add_special_tokens`: the tokenizer's own (e.g. a BOS) around them."""
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def sample(self, requests: list[EngineRequest], seeds: list[Any]) -> list[EngineOutput]:
        """Generate through the scheduler. Requests asking for no new token (scoring only) skip the
        engine."""
        todo = [i for i, r in enumerate(requests) if r.sampling_params.max_generate_length > 0]
        outputs = [EngineOutput([], [], "length", top_logprobs=[] if r.sampling_params.num_top_logprobs else None)
                   for r in requests]
        if todo:
            # one generator per batch: the first seed given makes the whole batch reproducible; without
            # one, a fresh seed, so that the engine never reseeds (and so moves) the process's global RNG
            seed = next((int(s) for s in seeds if s is not None), None)
            seed = secrets.randbits(63) if seed is None else seed
            batch = [requests[i] for i in todo]
            done = self.scheduler.shared(lambda: self._steps(batch, seed), f"a generation of {len(batch)} sequence(s)")
            for i, out in zip(todo, done):
                outputs[i] = out
        return outputs

    def prompt_logprobs(self, ids: list[int], first: int) -> list[list[Any]]:
        """SGLang's `input_token_logprobs` from position `first`: like SGLang, the first entry has
        no logprob (None: the logits before it are not part of the request), the others are each
        token's logprob given everything before it."""
        first = min(max(first, 0), len(ids) - 1)
        scored = []
        if first + 1 < len(ids):
            scored = self.scheduler.shared(lambda: single_step(lambda: self.engine.score(ids[:first + 1], ids[first + 1:])),
                                           "scoring a prompt")
        return [[None, ids[first], None]] + [[lp, t, None] for lp, t in zip(scored, ids[first + 1:])]

    def response_text(self, out: EngineOutput, skip_special_tokens: bool, keep_stop: bool) -> str:
        """The response text as both servers give it: special tokens skipped unless asked, a matched
        stop string cut off unless kept (`no_stop_trim`, `include_stop_str_in_output`)."""
        text = self.tokenizer.decode(out.response_ids, skip_special_tokens=skip_special_tokens)
        cut = -1 if out.matched_stop is None or keep_stop else text.rfind(out.matched_stop)
        return text if cut < 0 else text[:cut]

    # -- weights ------------------------------------------------------------------------------
    def flush_cache(self, _: dict) -> dict:
        self.scheduler.exclusive(self.engine.reset_prefix_cache, "a cache flush")
        return {"success": True, "message": "Cache flushed."}

    def init_weights_update_group(self, body: dict) -> dict:
        """Join the trainer's group (no engine work: the engine keeps serving while it forms). A
        peer that never answers fails it within `timeout_s` (default 60), naming the peer."""
        name = _group_name(body)
        if name in self.groups:
            return {"success": False, "message": f"weight update group {name!r} already exists; destroy it "
                                                 "first (/destroy_weights_update_group)"}
        host = body.get("master_address")
        if not isinstance(host, str) or not host:
            raise RequestError(f"master_address must be the trainer's host name or address, got {host!r}",
                               "master_address")
        backend = body.get("backend", "nccl")
        if backend not in ("gloo", "nccl"):
            raise RequestError(f"backend must be gloo or nccl, got {backend!r}", "backend")
        world = fields.whole(body.get("world_size"), "world_size", 2)
        spec = GroupSpec(port=fields.whole(body.get("master_port"), "master_port", 1, 65536),
                         rank=fields.whole(body.get("rank_offset"), "rank_offset", 1, world), world_size=world,
                         backend=backend, host=host, group_name=name,
                         timeout_s=fields.number(body.get("timeout_s", 60.0), "timeout_s", 0.0,
                                                 self.limits.max_group_timeout_s, low_open=True))
        if spec.backend == "nccl" and not torch.cuda.is_available():
            return {"success": False, "message": "backend nccl needs a CUDA GPU on this server; ask for gloo"}
        # one group forms at a time: each waiting init holds a handler thread for up to its timeout
        if not self._forming.acquire(blocking=False):
            raise RequestError("another weight update group is forming on this server; retry once it has (or its "
                               "timeout_s has passed)", "group_name", status=429)
        try:
            self.groups[name] = _Group(spec, TensorBroadcaster(spec))  # blocks until every member joined
        finally:
            self._forming.release()
        return {"success": True, "message": f"joined {name} as rank {spec.rank} of {spec.world_size}"}

    def destroy_weights_update_group(self, body: dict) -> dict:
        name = _group_name(body)
        group = self.groups.pop(name, None)
        if group is None:
            return {"success": False, "message": f"no weight update group {name!r}"}
        group.endpoint.close()
        return {"success": True, "message": f"destroyed {name}"}

    def update_weights_from_distributed(self, body: dict) -> dict:
        """Receive the tensors over the group (generations go on meanwhile), then load them alone
        on the engine."""
        name = _group_name(body)
        group = self.groups.get(name)
        if group is None:
            return {"success": False, "message": f"no weight update group {name!r}; call "
                                                 "/init_weights_update_group first"}
        names, dtypes, shapes = _tensor_list(body)
        tensors = group.endpoint.receive_tensors(shapes, dtypes)

        def load() -> None:
            self.engine.update_weights(zip(names, tensors))
            if body.get("flush_cache", True):
                self.engine.reset_prefix_cache()

        self.scheduler.exclusive(load, f"loading {len(names)} received tensors")
        self.weight_version = _version(body, self.weight_version)
        return {"success": True, "message": f"updated {len(names)} tensors (version {self.weight_version})"}

    def update_weights_from_disk(self, body: dict) -> dict:
        """All or nothing: every file is checked (a regular file, never a FIFO or a device that
        would block the read), its tensors' names and shapes checked against the engine's and read
        into memory on this request's thread; only then do they load, alone on the engine, in one
        call. A bad file, name or shape leaves the weights and their version as they were."""
        from safetensors import SafetensorError, safe_open

        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise RequestError(f"model_path must be a folder of *.safetensors files, got {path!r}", "model_path")
        if self.weight_shapes is None:
            return {"success": False, "message": "this server cannot check weights before loading them"}
        folder = Path(path)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            return {"success": False, "message": f"no *.safetensors files in {folder}"}
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                if not stat.S_ISREG(f.stat().st_mode):
                    return {"success": False, "message": f"{f} is not a regular file; nothing was loaded"}
                with safe_open(str(f), framework="pt") as reader:
                    for name in reader.keys():
                        problem = self._weight_problem(name, reader.get_slice(name).get_shape())
                        if problem:
                            return {"success": False, "message": f"{f}: {problem}; nothing was loaded"}
                    tensors.update((name, reader.get_tensor(name)) for name in reader.keys()
                                   if name in self.weight_shapes)
            except (OSError, SafetensorError) as e:
                return {"success": False, "message": f"{f} cannot be read as safetensors ({e}); nothing was loaded"}
        if not tensors:
            return {"success": False, "message": f"no tensor in {folder} names a parameter of this model; nothing was "
                                                 "loaded"}

        def load() -> None:
            self.engine.update_weights(tensors.items())
            self.engine.reset_prefix_cache()

        self.scheduler.exclusive(load, f"loading weights from {folder}")
        self.weight_version = _version(body, self.weight_version)
        return {"success": True, "message": f"loaded {len(files)} file(s) from {folder}"}

    def _weight_problem(self, name: str, shape: list[int]) -> str | None:
        """Why tensor `name` of `shape` cannot load (None: it can, or the engine has no such
        parameter and skips it, as tied weights' second names)."""
        want = self.weight_shapes.get(name) if self.weight_shapes is not None else None
        if want is not None and tuple(shape) != tuple(want):
            return f"tensor {name} has shape {list(shape)}, the model's has {list(want)}"
        return None

    def release_memory(self, body: dict) -> dict:
        """SGLang's route; the embedded engine releases its weights and KV cache together."""
        tags = _memory_tags(body)
        if set(tags) - {CUDA_GRAPH} != {WEIGHTS, KV_CACHE}:
            raise RequestError(f"tags={tags!r}: ridgeline serve releases the weights and the KV cache together; "
                               "send no tags, or both", "tags")
        self.scheduler.exclusive(self.engine.sleep, "releasing memory")
        return {"success": True}

    def resume_memory(self, body: dict) -> dict:
        """SGLang's route: "weights" and "kv_cache" are the engine's wake-up tags, "cuda_graph"
        names memory the embedded engine does not have (nothing to resume); no tags: all."""
        tags = tuple(t for t in _memory_tags(body) if t != CUDA_GRAPH)
        self.scheduler.exclusive(lambda: self.engine.wake_up(tags), "resuming memory")
        return {"success": True}

    def health_generate(self, _: dict) -> dict:
        probe = EngineRequest([self.tokenizer.eos_token_id or 0], SamplingParams(1, 0.0))
        self.scheduler.shared(lambda: self._steps([probe], 0), "a health check")
        return {}

    def openai_routes(self) -> list[Route]:
        """The OpenAI API (openai_api: with vLLM's /tokenize and /detokenize) and /health: all a
        training run's HTTP endpoint exposes (no weight, memory or cache route: agents sample from
        the run's engine, they do not steer it)."""
        return [Route("GET", "/health", lambda _: {}, "native"), *self.openai.routes()]

    def routes(self) -> list[Route]:
        """Every route: `ridgeline serve`."""
        return [
            *self.openai_routes(),
            Route("GET", "/health_generate", self.health_generate, "native"),
            Route("GET", "/get_model_info", self.model_info, "native"),
            Route("GET", "/get_server_info", self.server_info, "native"),
            Route("POST", "/generate", self.generate, "native"),
            Route("POST", "/flush_cache", self.flush_cache, "weights"),
            Route("POST", "/init_weights_update_group", self.init_weights_update_group, "weights"),
            Route("POST", "/destroy_weights_update_group", self.destroy_weights_update_group, "weights"),
            Route("POST", "/update_weights_from_distributed", self.update_weights_from_distributed, "weights"),
            Route("POST", "/update_weights_from_disk", self.update_weights_from_disk, "weights"),
            Route("POST", "/release_memory_occupation", self.release_memory, "weights"),
            Route("POST", "/resume_memory_occupation", self.resume_memory, "weights"),
        ]


def _group_name(body: dict) -> str:
    name = body.get("group_name", "weight_update_group")
    if not isinstance(name, str) or not name:
        raise RequestError(f"group_name must be a non-empty string, got {name!r}", "group_name")
    return name


def _entries(body: dict, key: str) -> list[Any]:
    value = body.get(key)
    if not isinstance(value, list):
        raise RequestError(f"{key} must be a list with one entry per tensor", key)
    return value


def _tensor_list(body: dict) -> tuple[list[str], list[str], list[list[int]]]:
    """`names`, `dtypes` and `shapes` of a weight update: one entry per tensor, in broadcast order."""
    names, dtypes, shapes = (_entries(body, "names"), _entries(body, "dtypes"), _entries(body, "shapes"))
    if not len(names) == len(dtypes) == len(shapes):
        raise RequestError("names, dtypes and shapes must have the same length", "names")
    if not all(isinstance(n, str) for n in names):
        raise RequestError("names must be strings (Hugging Face parameter names)", "names")
    for i, d in enumerate(dtypes):
        if not isinstance(d, str):
            raise RequestError(f"dtypes[{i}] must be a dtype name such as 'bfloat16', got {d!r}", "dtypes")
        dtype_from_name(d.removeprefix("torch."))
    for i, shape in enumerate(shapes):
        if not isinstance(shape, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                  for x in shape):
            raise RequestError(f"shapes[{i}] must be a list of sizes >= 0, got {shape!r}", "shapes")
    return names, dtypes, shapes


def _version(body: dict, current: str) -> str:
    """The weight version after an update: the request's, or one more than the current."""
    given = body.get("weight_version")
    return str(given) if given else str(int(current) + 1 if current.isdigit() else 1)


def _memory_tags(body: dict) -> list[str]:
    """The `tags` of SGLang's release / resume routes (none: all of SGLang's memory types)."""
    tags = body.get("tags")
    if tags is None:
        return [WEIGHTS, KV_CACHE, CUDA_GRAPH]
    if not isinstance(tags, list) or not set(tags) <= {WEIGHTS, KV_CACHE, CUDA_GRAPH}:
        raise RequestError(f"tags={tags!r} must be a list of {[WEIGHTS, KV_CACHE, CUDA_GRAPH]}", "tags")
    return tags


def _finish(out: EngineOutput) -> dict[str, Any]:
    """SGLang's finish_reason: "matched" is the stop string, else the stop token."""
    if out.stop_reason == "stop":
        if out.matched_stop is not None:
            return {"type": "stop", "matched": out.matched_stop}
        return {"type": "stop", "matched": out.response_ids[-1] if out.response_ids else None}
    return {"type": "length", "length": len(out.response_ids)}


def make_http_server(service: EngineService, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                     routes: list[Route] | None = None) -> HttpServer:
    """An HTTP server over `service`'s `routes` (default: all of them), bound on return (port 0
    picks a free port: `server.server_address`). OSError when host:port cannot be listened on;
    `ExposureError` for steering routes beyond loopback without `api_key`."""
    routes = service.routes() if routes is None else routes
    check_exposure(host, api_key, steering=any(r.family == "weights" for r in routes))
    limits = service.limits
    app = build_app(routes, api_key=api_key, limits=limits.http(), workers=limits.max_connections)
    return HttpServer(app, host, port, backlog=limits.backlog, max_open=limits.max_open_connections,
                      header_timeout_s=limits.header_timeout_s)
