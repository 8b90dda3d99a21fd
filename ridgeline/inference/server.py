"""`ridgeline serve`: the embedded engine behind an HTTP server, so rollouts can run in another
process or on another machine, and so the remote client is tested against a real server.

It speaks the two APIs of `ridgeline.inference.remote`'s client:

SGLang-style native routes (the same request and answer shapes as SGLang's server)
  GET  /health, /health_generate                 200 when the engine answers
  GET  /get_model_info, /get_server_info         model path, dtype, tp_size, weight version
  POST /generate          {input_ids, sampling_params, return_logprob, logprob_start_len,
                           top_logprobs_num}; sampling_params: max_new_tokens, temperature,
                           top_p, top_k, min_p, repetition_penalty, stop, stop_token_ids,
                           skip_special_tokens, no_stop_trim, sampling_seed
  POST /flush_cache
  POST /init_weights_update_group     {master_address, master_port, rank_offset, world_size,
                                       group_name, backend}
  POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache,
                                       weight_version}
  POST /destroy_weights_update_group  {group_name}
  POST /update_weights_from_disk      {model_path}: a folder of safetensors in HF names
  POST /release_memory_occupation, /resume_memory_occupation {tags}: sleep / wake_up(tags)
OpenAI-compatible routes (the subset of vLLM's that rollouts and agents need)
  GET  /v1/models
  POST /v1/completions    {model, prompt: token ids or text, n, max_tokens, temperature, top_p,
                           top_k, min_p, repetition_penalty, stop, include_stop_str_in_output,
                           logprobs, prompt_logprobs, seed, stop_token_ids, skip_special_tokens,
                           return_token_ids, return_tokens_as_token_ids}
  POST /v1/chat/completions {model, messages, n, max_completion_tokens / max_tokens, the sampling
                           fields above, logprobs: bool, top_logprobs, chat_template_kwargs}:
                           the messages rendered with the tokenizer's chat template

Both APIs answer like their servers: the matched stop string in `finish_reason["matched"]` /
`stop_reason`, the top logprobs in `meta_info["output_top_logprobs"]` / `logprobs.top_logprobs`
(chat: OpenAI's `logprobs.content`), and text without special tokens and without the stop string
unless `no_stop_trim` / `include_stop_str_in_output` (token ids always end with the token that
completed it). OpenAI requests must name the served model (`served_model_name`, the config's
`generator.model_name`); a request naming another, a field this server does not act on, or
`stream=true` is refused with a 400 in OpenAI's error shape ({"error": {message, type, param,
code}}, which every error answer takes but the weight routes' SGLang-style {success, message}).

With an API key every route but /health asks for `Authorization: Bearer <key>`. Requests are
served one at a time (the engine batches within a request; the remote client sends one batched
request per server), so a weight update never lands in the middle of a generation. A request
without a seed gets a fresh one from the operating system: the process's global RNG is never
touched (a training run's endpoint shares its process, ridgeline.inference.endpoint).
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from jinja2 import TemplateError

from ridgeline.inference.sglang_engine import CUDA_GRAPH, KV_CACHE, WEIGHTS
from ridgeline.inference.weight_transport import GroupSpec, TensorBroadcaster, WeightSyncError
from ridgeline.inference.types import EngineOutput, EngineRequest, SamplingParams

log = logging.getLogger(__name__)

class RequestError(ValueError):
    """A request the server refuses (answered 400 with this message)."""


def _stop_strings(value: Any, key: str) -> tuple[str, ...]:
    """A `stop` field (null, a string or a list of strings, as both APIs take it)."""
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"{key} must be a non-empty string or a list of non-empty strings, got {value!r}")
    return tuple(stops)


def _sampling(max_tokens: Any, p: dict[str, Any], stop_key: str, top_logprobs: Any) -> SamplingParams:
    penalty = float(p.get("repetition_penalty", 1.0))
    if penalty <= 0:
        raise RequestError(f"repetition_penalty must be greater than 0, got {penalty:g}")
    if top_logprobs is not None and (isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int)
                                     or top_logprobs < 0):
        raise RequestError(f"the number of top logprobs must be a whole number >= 0, got {top_logprobs!r}")
    return SamplingParams(max_generate_length=int(max_tokens), temperature=float(p.get("temperature", 1.0)),
                          top_p=float(p.get("top_p", 1.0)), top_k=int(p.get("top_k", -1)),
                          min_p=float(p.get("min_p", 0.0)), repetition_penalty=penalty,
                          stop=_stop_strings(p.get("stop"), stop_key), logprobs=top_logprobs)


def sampling_from_native(p: dict[str, Any], top_logprobs_num: int | None = None) -> SamplingParams:
    """SGLang `sampling_params` (and the request's `top_logprobs_num`) -> Ridgeline's; unknown keys
    are refused, not silently dropped."""
    known = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop",
             "stop_token_ids", "skip_special_tokens", "no_stop_trim", "sampling_seed"}
    unknown = sorted(set(p) - known)
    if unknown:
        raise RequestError(f"sampling_params keys not supported by ridgeline serve: {unknown}")
    return _sampling(p.get("max_new_tokens", 128), p, "sampling_params.stop", top_logprobs_num or None)


def sampling_from_completion(body: dict[str, Any]) -> SamplingParams:
    """The sampling fields of an OpenAI `/v1/completions` request -> Ridgeline's."""
    return _sampling(body.get("max_tokens", 16), body, "stop", body.get("logprobs"))


# The fields of the OpenAI routes. Any other is refused with a 400 naming it, never ignored; `user`
# and SkyRL's `session_id` (a routing hint) change no answer, so they are accepted.
_OPENAI_FIELDS = {"model", "n", "seed", "stream", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                  "repetition_penalty", "stop", "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output",
                  "return_token_ids", "return_tokens_as_token_ids", "logprobs", "user", "session_id"}
COMPLETION_FIELDS = _OPENAI_FIELDS | {"prompt", "prompt_logprobs"}
CHAT_FIELDS = _OPENAI_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "chat_template_kwargs"}
# penalties this server does not apply: accepted only at OpenAI's default, which applies none
_ZERO_ONLY = ("frequency_penalty", "presence_penalty")


def _token_batch(value: Any, what: str) -> tuple[list[list[int]], bool]:
    """A list of token ids or a list of such lists -> (batch, was_single)."""
    if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
        return [value], True
    if isinstance(value, list) and value and all(
            isinstance(row, list) and row and all(isinstance(t, int) for t in row) for row in value):
        return value, False
    raise RequestError(f"{what} must be a non-empty list of token ids or a list of such lists "
                       "(this server is token-in/token-out: tokenize on the client)")


@dataclass
class _Group:
    spec: GroupSpec
    endpoint: TensorBroadcaster


class EngineService:
    """The routes as plain methods over one engine: body dict in, (status, body) out."""

    def __init__(self, engine, tokenizer, model_path: str, *, tp_size: int = 1, served_model_name: str | None = None,
                 chat_max_tokens: int = 1024):
        """`served_model_name`: the name OpenAI requests must give as `model` (default `model_path`,
        vLLM's rule); `chat_max_tokens`: the `max_tokens` of a chat request that sets none (vLLM fills
        the context; here the config's `generator.sampling_params.max_generate_length`)."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.served_model_name = served_model_name or model_path
        self.chat_max_tokens = chat_max_tokens
        self.tp_size = tp_size
        self.weight_version = "0"
        self.groups: dict[str, _Group] = {}
        self.lock = threading.Lock()  # one request at a time on the engine
        self.started = time.time()

    # -- info ---------------------------------------------------------------------------------
    def model_info(self, _: dict) -> dict:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                "dtype": str(self.engine.dtype).removeprefix("torch."), "weight_version": self.weight_version}

    def server_info(self, _: dict) -> dict:
        return {"tp_size": self.tp_size, "dp_size": 1, "version": "ridgeline-serve",
                "model_path": self.model_path, "weight_version": self.weight_version,
                "weight_update_groups": sorted(self.groups)}

    def models(self, _: dict) -> dict:
        return {"object": "list", "data": [{"id": self.served_model_name, "object": "model", "owned_by": "ridgeline",
                                            "root": self.model_path, "created": int(self.started)}]}

    # -- generation ---------------------------------------------------------------------------
    def generate(self, body: dict) -> Any:
        if body.get("stream"):
            raise RequestError("stream=true is not supported by ridgeline serve")
        if "text" in body and "input_ids" not in body:
            raise RequestError("send input_ids: ridgeline serve is token-in/token-out")
        prompts, single = _token_batch(body.get("input_ids"), "input_ids")
        raw = body.get("sampling_params") or {}
        raw_list = raw if isinstance(raw, list) else [raw] * len(prompts)
        if len(raw_list) != len(prompts):
            raise RequestError(f"{len(raw_list)} sampling_params for {len(prompts)} inputs")
        tops = body.get("top_logprobs_num")
        tops = tops if isinstance(tops, list) else [tops] * len(prompts)
        if len(tops) != len(prompts):
            raise RequestError(f"{len(tops)} top_logprobs_num for {len(prompts)} inputs")
        params = [sampling_from_native(p, n) for p, n in zip(raw_list, tops)]
        start = body.get("logprob_start_len", -1)
        starts = start if isinstance(start, list) else [start] * len(prompts)
        seeds = [p.get("sampling_seed") for p in raw_list]
        requests = [EngineRequest(ids, sp, tuple(p.get("stop_token_ids") or ()))
                    for ids, sp, p in zip(prompts, params, raw_list)]
        outputs = self._generate(requests, seeds)
        results = []
        for ids, out, first, p in zip(prompts, outputs, starts, raw_list):
            meta = {"id": uuid.uuid4().hex, "prompt_tokens": len(ids), "completion_tokens": len(out.response_ids),
                    "finish_reason": _finish(out), "weight_version": self.weight_version,
                    "output_token_logprobs": [[lp, t, None] for lp, t in zip(out.logprobs, out.response_ids)]}
            if out.top_logprobs is not None:
                meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in top] for top in out.top_logprobs]
            if first is not None and first >= 0:
                meta["input_token_logprobs"] = self._input_logprobs(ids, int(first))
            text = self._text(out, bool(p.get("skip_special_tokens", True)), bool(p.get("no_stop_trim", False)))
            results.append({"text": text, "output_ids": out.response_ids, "meta_info": meta})
        return results[0] if single else results

    def _generate(self, requests: list[EngineRequest], seeds: list[Any]) -> list[EngineOutput]:
        """Requests asking for no new token (scoring only) skip the engine."""
        todo = [i for i, r in enumerate(requests) if r.sampling_params.max_generate_length > 0]
        outputs = [EngineOutput([], [], "length", top_logprobs=[] if r.sampling_params.num_top_logprobs else None)
                   for r in requests]
        if todo:
            # one generator per batch: the first seed given makes the whole batch reproducible; without
            # one, a fresh seed, so that the engine never reseeds (and so moves) the process's global RNG
            seed = next((int(s) for s in seeds if s is not None), None)
            seed = secrets.randbits(63) if seed is None else seed
            with self.lock:
                for i, out in zip(todo, self.engine.generate([requests[i] for i in todo], seed=seed)):
                    outputs[i] = out
        return outputs

    def _input_logprobs(self, ids: list[int], first: int) -> list[list[Any]]:
        """SGLang's `input_token_logprobs` from position `first`: like SGLang, the first entry has
        no logprob (None: the logits before it are not part of the request), the others are each
        token's logprob given everything before it."""
        first = min(max(first, 0), len(ids) - 1)
        with self.lock:
            scored = self.engine.score(ids[:first + 1], ids[first + 1:]) if first + 1 < len(ids) else []
        return [[None, ids[first], None]] + [[lp, t, None] for lp, t in zip(scored, ids[first + 1:])]

    def _text(self, out: EngineOutput, skip_special_tokens: bool, keep_stop: bool) -> str:
        """The response text as both servers give it: special tokens skipped unless asked, a matched
        stop string cut off unless kept (`no_stop_trim`, `include_stop_str_in_output`)."""
        text = self.tokenizer.decode(out.response_ids, skip_special_tokens=skip_special_tokens)
        cut = -1 if out.matched_stop is None or keep_stop else text.rfind(out.matched_stop)
        return text if cut < 0 else text[:cut]

    def _check_openai(self, body: dict, route: str, fields: set[str]) -> None:
        """What every OpenAI request must satisfy: the served model named, no streaming, no field
        this server would not act on."""
        if body.get("stream"):
            raise RequestError(f"{route}: stream=true is not supported; send stream=false")
        unknown = sorted(k for k in set(body) - fields if not (k in _ZERO_ONLY and body[k] in (0, None)))
        if unknown:
            raise RequestError(f"{route}: fields this server does not act on: {unknown}; remove them")
        if "model" not in body:
            raise RequestError(f"{route}: the field `model` is required; this server serves {self.served_model_name!r}")
        if body["model"] != self.served_model_name:
            raise RequestError(f"{route}: model {body['model']!r} is not served here; this server serves "
                               f"{self.served_model_name!r} (generator.model_name)")

    def completions(self, body: dict) -> dict:
        self._check_openai(body, "/v1/completions", COMPLETION_FIELDS)
        prompt = body.get("prompt")
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
            texts = [prompt] if isinstance(prompt, str) else prompt
            prompts = [list(self.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        else:
            prompts, _ = _token_batch(prompt, "prompt")
        n = _sample_count(body)
        params = sampling_from_completion(body)
        stop = tuple(int(t) for t in body.get("stop_token_ids") or ())
        requests = [EngineRequest(ids, params, stop) for ids in prompts for _ in range(n)]
        outputs = self._generate(requests, [body.get("seed")])
        want_lp = body.get("logprobs") is not None
        prompt_lp = body.get("prompt_logprobs") is not None
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        choices = []
        for i, (req, out) in enumerate(zip(requests, outputs)):
            text = self._text(out, bool(body.get("skip_special_tokens", True)),
                              bool(body.get("include_stop_str_in_output", False)))
            choice: dict[str, Any] = {"index": i, "text": text, "finish_reason": out.stop_reason,
                                      "stop_reason": out.matched_stop, "logprobs": None}
            if want_lp:
                choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in out.response_ids],
                                      "token_logprobs": out.logprobs}
                if out.top_logprobs is not None:
                    # vLLM's shape: the top N and the sampled token, keyed by token
                    choice["logprobs"]["top_logprobs"] = [
                        {self._token_key(t, as_ids): v for t, v in [*top, (tok, lp)]}
                        for top, tok, lp in zip(out.top_logprobs, out.response_ids, out.logprobs)]
            if body.get("return_token_ids"):
                choice["token_ids"] = out.response_ids
                choice["prompt_token_ids"] = req.prompt_token_ids
            if prompt_lp:
                entries = self._input_logprobs(req.prompt_token_ids, 0)
                choice["prompt_logprobs"] = [None if lp is None else {str(t): {"logprob": lp}}
                                             for lp, t, _ in entries]
            choices.append(choice)
        usage = {"prompt_tokens": sum(len(p) for p in prompts) * n,
                 "completion_tokens": sum(len(o.response_ids) for o in outputs)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.served_model_name, "choices": choices, "usage": usage}

    def chat_completions(self, body: dict) -> dict:
        """OpenAI's chat completions: the messages rendered with the tokenizer's chat template (the
        one the run's prompts use, with the assistant turn opened), then `n` samples of one batch."""
        self._check_openai(body, "/v1/chat/completions", CHAT_FIELDS)
        prompt = self._chat_prompt(body.get("messages"), body.get("chat_template_kwargs"))
        want_lp, top = bool(body.get("logprobs")), body.get("top_logprobs")
        if top is not None and not want_lp:
            raise RequestError("top_logprobs needs logprobs=true")
        limit = next((body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None),
                     self.chat_max_tokens)
        params = _sampling(limit, body, "stop", top or None)
        stop = tuple(int(t) for t in body.get("stop_token_ids") or ())
        requests = [EngineRequest(prompt, params, stop) for _ in range(_sample_count(body))]
        outputs = self._generate(requests, [body.get("seed")])
        skip, keep = bool(body.get("skip_special_tokens", True)), bool(body.get("include_stop_str_in_output", False))
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        choices = []
        for i, out in enumerate(outputs):
            choice: dict[str, Any] = {"index": i, "message": {"role": "assistant", "content": self._text(out, skip, keep)},
                                      "logprobs": self._chat_logprobs(out, as_ids) if want_lp else None,
                                      "finish_reason": out.stop_reason, "stop_reason": out.matched_stop}
            if body.get("return_token_ids"):
                choice["token_ids"] = out.response_ids
            choices.append(choice)
        completion_tokens = sum(len(o.response_ids) for o in outputs)
        answer = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                  "model": self.served_model_name, "choices": choices,
                  "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens,
                            "total_tokens": len(prompt) + completion_tokens}}
        if body.get("return_token_ids"):
            answer["prompt_token_ids"] = prompt  # vLLM's field: with `token_ids`, the exact tokens sampled from
        return answer

    def _chat_prompt(self, messages: Any, template_kwargs: Any) -> list[int]:
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise RequestError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise RequestError(f"chat_template_kwargs must be an object, got {template_kwargs!r}")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                      **(template_kwargs or {}))
        except (TemplateError, ValueError, TypeError) as e:
            raise RequestError(f"the chat template cannot render these messages: {e}") from e
        # the rendered text holds the template's special tokens: no second bos
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _chat_logprobs(self, out: EngineOutput, as_ids: bool) -> dict[str, Any]:
        """OpenAI's `logprobs.content`: per sampled token its text, logprob, UTF-8 bytes and the top
        `top_logprobs` alternatives."""
        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = self._token_key(token, as_ids)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        tops = out.top_logprobs or [[] for _ in out.response_ids]
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top]}
                            for t, lp, top in zip(out.response_ids, out.logprobs, tops)]}

    def _token_key(self, token: int, as_ids: bool) -> str:
        return f"token_id:{token}" if as_ids else self.tokenizer.decode([token])

    # -- weights ------------------------------------------------------------------------------
    def flush_cache(self, _: dict) -> dict:
        with self.lock:
            self.engine.reset_prefix_cache()
        return {"success": True, "message": "Cache flushed."}

    def init_weights_update_group(self, body: dict) -> dict:
        name = body.get("group_name", "weight_update_group")
        if name in self.groups:
            return {"success": False, "message": f"weight update group {name!r} already exists; destroy it "
                                                 "first (/destroy_weights_update_group)"}
        spec = GroupSpec(port=int(body["master_port"]), rank=int(body["rank_offset"]),
                         world_size=int(body["world_size"]), backend=body.get("backend", "nccl"),
                         host=str(body["master_address"]), timeout_s=float(body.get("timeout_s", 60.0)),
                         group_name=name)
        if spec.backend == "nccl" and not torch.cuda.is_available():
            return {"success": False, "message": "backend nccl needs a CUDA GPU on this server; ask for gloo"}
        self.groups[name] = _Group(spec, TensorBroadcaster(spec))  # blocks until every member joined
        return {"success": True, "message": f"joined {name} as rank {spec.rank} of {spec.world_size}"}

    def destroy_weights_update_group(self, body: dict) -> dict:
        name = body.get("group_name", "weight_update_group")
        group = self.groups.pop(name, None)
        if group is None:
            return {"success": False, "message": f"no weight update group {name!r}"}
        group.endpoint.close()
        return {"success": True, "message": f"destroyed {name}"}

    def update_weights_from_distributed(self, body: dict) -> dict:
        name = body.get("group_name", "weight_update_group")
        group = self.groups.get(name)
        if group is None:
            return {"success": False, "message": f"no weight update group {name!r}; call "
                                                 "/init_weights_update_group first"}
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        if not len(names) == len(dtypes) == len(shapes):
            raise RequestError("names, dtypes and shapes must have the same length")
        with self.lock:
            tensors = group.endpoint.receive_tensors(shapes, dtypes)
            self.engine.update_weights(zip(names, tensors))
            if body.get("flush_cache", True):
                self.engine.reset_prefix_cache()
        self.weight_version = str(body.get("weight_version") or int(self.weight_version) + 1)
        return {"success": True, "message": f"updated {len(names)} tensors (version {self.weight_version})"}

    def update_weights_from_disk(self, body: dict) -> dict:
        from safetensors.torch import load_file

        folder = Path(body["model_path"])
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            return {"success": False, "message": f"no *.safetensors files in {folder}"}
        with self.lock:
            for f in files:
                self.engine.update_weights(load_file(str(f)).items())
            self.engine.reset_prefix_cache()
        self.weight_version = str(body.get("weight_version") or int(self.weight_version) + 1)
        return {"success": True, "message": f"loaded {len(files)} file(s) from {folder}"}

    def release_memory(self, body: dict) -> dict:
        """SGLang's route; the embedded engine releases its weights and KV cache together."""
        tags = _memory_tags(body)
        if set(tags) - {CUDA_GRAPH} != {WEIGHTS, KV_CACHE}:
            raise RequestError(f"tags={tags!r}: ridgeline serve releases the weights and the KV cache together; "
                               "send no tags, or both")
        with self.lock:
            self.engine.sleep()
        return {"success": True}

    def resume_memory(self, body: dict) -> dict:
        """SGLang's route: "weights" and "kv_cache" are the engine's wake-up tags, "cuda_graph"
        names memory the embedded engine does not have (nothing to resume); no tags: all."""
        tags = _memory_tags(body)
        with self.lock:
            self.engine.wake_up(tuple(t for t in tags if t != CUDA_GRAPH))
        return {"success": True}

    def health_generate(self, _: dict) -> dict:
        with self.lock:
            self.engine.generate([EngineRequest([self.tokenizer.eos_token_id or 0], SamplingParams(1, 0.0))], seed=0)
        return {}

    def openai_routes(self) -> dict[tuple[str, str], Callable[[dict], Any]]:
        """The OpenAI API and /health: all a training run's HTTP endpoint exposes (no weight, memory
        or cache route: agents sample from the run's engine, they do not steer it)."""
        return {
            ("GET", "/health"): lambda _: {}, ("GET", "/v1/models"): self.models,
            ("POST", "/v1/completions"): self.completions, ("POST", "/v1/chat/completions"): self.chat_completions,
        }

    def routes(self) -> dict[tuple[str, str], Callable[[dict], Any]]:
        """Every route: `ridgeline serve`."""
        return {
            **self.openai_routes(),
            ("GET", "/health_generate"): self.health_generate,
            ("GET", "/get_model_info"): self.model_info, ("GET", "/get_server_info"): self.server_info,
            ("POST", "/generate"): self.generate,
            ("POST", "/flush_cache"): self.flush_cache,
            ("POST", "/init_weights_update_group"): self.init_weights_update_group,
            ("POST", "/destroy_weights_update_group"): self.destroy_weights_update_group,
            ("POST", "/update_weights_from_distributed"): self.update_weights_from_distributed,
            ("POST", "/update_weights_from_disk"): self.update_weights_from_disk,
            ("POST", "/release_memory_occupation"): self.release_memory,
            ("POST", "/resume_memory_occupation"): self.resume_memory,
        }


def _sample_count(body: dict) -> int:
    n = body.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise RequestError(f"n must be a whole number >= 1, got {n!r}")
    return n


def _memory_tags(body: dict) -> list[str]:
    """The `tags` of SGLang's release / resume routes (none: all of SGLang's memory types)."""
    tags = body.get("tags")
    if tags is None:
        return [WEIGHTS, KV_CACHE, CUDA_GRAPH]
    if not isinstance(tags, list) or not set(tags) <= {WEIGHTS, KV_CACHE, CUDA_GRAPH}:
        raise RequestError(f"tags={tags!r} must be a list of {[WEIGHTS, KV_CACHE, CUDA_GRAPH]}")
    return tags


def _finish(out: EngineOutput) -> dict[str, Any]:
    """SGLang's finish_reason: "matched" is the stop string, else the stop token."""
    if out.stop_reason == "stop":
        if out.matched_stop is not None:
            return {"type": "stop", "matched": out.matched_stop}
        return {"type": "stop", "matched": out.response_ids[-1] if out.response_ids else None}
    return {"type": "length", "length": len(out.response_ids)}


def error_body(status: HTTPStatus, message: str) -> dict[str, Any]:
    """OpenAI's error shape (vLLM's and SkyRL's endpoints answer the same)."""
    return {"error": {"message": message, "type": status.phrase, "param": None, "code": int(status)}}


def make_http_server(service: EngineService, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                     routes: Mapping[tuple[str, str], Callable[[dict], Any]] | None = None) -> ThreadingHTTPServer:
    """An HTTP server over `service`'s `routes` (default: all of them), bound on return (port 0
    picks a free port: `server.server_address`); OSError when host:port cannot be listened on."""
    routes = dict(service.routes() if routes is None else routes)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:  # route access logs to logging, quietly
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, status: int, body: Any) -> None:
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _handle(self, method: str) -> None:
            path = self.path.split("?", 1)[0]
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if api_key and path != "/health" and self.headers.get("Authorization") != f"Bearer {api_key}":
                return self._send(HTTPStatus.UNAUTHORIZED, error_body(HTTPStatus.UNAUTHORIZED,
                                                                      "missing or wrong bearer token"))
            route = routes.get((method, path)) or (routes.get(("GET", path)) if method == "POST" else None)
            if route is None:
                return self._send(HTTPStatus.NOT_FOUND, error_body(HTTPStatus.NOT_FOUND, f"no route {method} {path}"))
            try:
                body = json.loads(raw) if raw else {}
                if not isinstance(body, dict):
                    raise RequestError("the request body must be a JSON object")
                result = route(body)
            except (RequestError, KeyError, TypeError, json.JSONDecodeError) as e:
                return self._send(HTTPStatus.BAD_REQUEST, error_body(HTTPStatus.BAD_REQUEST, f"{type(e).__name__}: {e}"))
            except WeightSyncError as e:
                return self._send(HTTPStatus.BAD_REQUEST, {"success": False, "message": str(e)})
            except Exception as e:  # noqa: BLE001 - the client gets the error instead of a dropped connection
                log.exception("%s %s failed", method, path)
                return self._send(HTTPStatus.INTERNAL_SERVER_ERROR,
                                  error_body(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}"))
            failed = isinstance(result, dict) and result.get("success") is False
            self._send(HTTPStatus.BAD_REQUEST if failed else HTTPStatus.OK, result)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self._handle("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._handle("POST")

    return _Server((host, port), Handler)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # agents open many connections at once; http.server's default backlog is 5
