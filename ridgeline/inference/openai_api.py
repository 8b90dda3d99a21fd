"""vLLM's OpenAI-compatible routes over an `EngineService` (`ridgeline serve` and a training run's
endpoint), in vLLM's request and answer shapes, so the `openai` client and vLLM clients work as
they are:

  GET  /v1/models            the served model: `id` (the name requests give as `model`), `root`
                             (a hub id or folder AutoTokenizer loads, where the model has one)
  POST /v1/completions       {model, prompt: text, texts, token ids or lists of them, n, max_tokens
                             (16), temperature, top_p, top_k, min_p, repetition_penalty, stop,
                             stop_token_ids, seed, logprobs: N, echo, prompt_logprobs: 0,
                             add_special_tokens, skip_special_tokens, include_stop_str_in_output,
                             return_token_ids, return_tokens_as_token_ids}
  POST /v1/chat/completions  {model, messages, the sampling fields above, max_completion_tokens /
                             max_tokens, logprobs: bool, top_logprobs: N, chat_template_kwargs,
                             add_generation_prompt, continue_final_message, add_special_tokens}:
                             the messages rendered with the model's chat template (the run's,
                             generator.chat_template*)
  POST /tokenize             {prompt: text, add_special_tokens} or {messages, ...the chat's template
                             fields}, return_token_strs -> {count, max_model_len, tokens, token_strs}
  POST /detokenize           {tokens} -> {prompt}

Text is decoded without special tokens (`skip_special_tokens`, default true) and without the
matched stop string (unless `include_stop_str_in_output`); `finish_reason` is "stop" or "length",
`stop_reason` the stop string or stop token id that ended a choice (None: the end-of-sequence
token). Usage counts each prompt once and every sampled token.

`stream=true` answers the same choices as server-sent events in vLLM's chunk shapes
(`text_completion` / `chat.completion.chunk` events, `stream_options.include_usage`'s last
event with the usage, then `data: [DONE]`); the answer is computed whole first, then sent.

Refused with a 400 naming the field, never ignored: a `model` other than the served one (required
on the generation routes, as SkyRL's endpoint asks; optional on /tokenize and /detokenize, as
vLLM's), a field this server does not act on (`tools`, `response_format`, `best_of`, a non-zero
penalty...), top logprobs of prompt tokens (`prompt_logprobs` > 0, `echo` with `logprobs` > 0:
the engine scores each prompt token, not its alternatives), content parts other than text, and a
chat template sent with the request (`chat_template`, `chat_template_kwargs.chat_template`) unless
the server trusts them (`--trust-request-chat-template`, vLLM's flag: rendering a template is
running a program; one of 150 bytes took 2 GB).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Protocol

from jinja2 import TemplateError

from ridgeline.inference import request_fields as fields
from ridgeline.inference.http_app import EventStream, Route
from ridgeline.inference.request_fields import ModelLimits, RequestError
from ridgeline.inference.types import EngineOutput, EngineRequest, SamplingParams, TopLogprobs



class EngineService(Protocol):
    """What the OpenAI routes use of `ridgeline.inference.server.EngineService` (which serves these
    routes beside its own, so it sits above this module)."""

    tokenizer: Any
    served_model_name: str
    chat_max_tokens: int
    model_limits: ModelLimits

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]: ...

    def sample(self, requests: list[EngineRequest], seeds: list[Any]) -> list[EngineOutput]: ...

    def prompt_logprobs(self, ids: list[int], first: int) -> list[list[Any]]: ...

    def response_text(self, out: EngineOutput, skip_special_tokens: bool, keep_stop: bool) -> str: ...

_SAMPLING = {"n", "seed", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop",
             "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output", "return_token_ids",
             "return_tokens_as_token_ids", "logprobs"}
# `user` and SkyRL's `session_id` (a routing hint) change no answer, so they are accepted
_ANY = {"model", "stream", "user", "session_id"}
_TEMPLATE = {"chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
             "add_special_tokens"}
COMPLETION_FIELDS = _ANY | _SAMPLING | {"prompt", "prompt_logprobs", "echo", "add_special_tokens", "stream_options"}
CHAT_FIELDS = _ANY | _SAMPLING | _TEMPLATE | {"messages", "max_completion_tokens", "top_logprobs", "stream_options"}
TOKENIZE_FIELDS = _TEMPLATE | {"model", "prompt", "messages", "return_token_strs"}
DETOKENIZE_FIELDS = {"model", "tokens"}
# OpenAI fields this server does not apply: accepted only at a value (or null) that applies nothing
_NEUTRAL: dict[str, tuple[Any, ...]] = {"frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},),
                                        "suffix": ("",)}
_FLAGS = ("stream", "skip_special_tokens", "include_stop_str_in_output", "return_token_ids",
          "return_tokens_as_token_ids", "echo", "add_special_tokens", "add_generation_prompt",
          "continue_final_message", "return_token_strs")
COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


class OpenAIApi:
    """The routes as plain methods: body dict in, answer dict out (a RequestError for a bad
    request). Generation goes through the service (its scheduler, its context cap)."""

    def __init__(self, service: EngineService):
        self.service = service
        self.tokenizer = service.tokenizer

    def routes(self) -> list[Route]:
        return [Route("GET", "/v1/models", self.models, "openai"),
                Route("POST", "/v1/completions", self.completions, "openai"),
                Route("POST", "/v1/chat/completions", self.chat_completions, "openai"),
                Route("POST", "/tokenize", self.tokenize, "openai"),
                Route("POST", "/detokenize", self.detokenize, "openai")]

    # -- routes ---------------------------------------------------------------------------------
    def models(self, _: dict) -> dict:
        s = self.service
        return {"object": "list", "data": [{"id": s.served_model_name, "object": "model", "owned_by": "ridgeline",
                                            "root": s.tokenizer_path, "parent": None, "created": int(s.started),
                                            "max_model_len": s.model_limits.context_length}]}

    def completions(self, body: dict) -> dict | EventStream:
        self._check(body, "/v1/completions", COMPLETION_FIELDS)
        limits = self.service.model_limits
        prompts, texts = self._completion_prompts(body)
        n = _sample_count(body, len(prompts), limits)
        echo = bool(body.get("echo"))
        max_tokens = body.get("max_tokens")
        params, stop = self._sampling(body, ("max_tokens", COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens),
                                      ("logprobs", body.get("logprobs")))
        want_lp = body.get("logprobs") is not None
        if body.get("prompt_logprobs") is not None:
            _only_own_logprobs(fields.top_logprob_count(body["prompt_logprobs"], "prompt_logprobs", limits),
                               "prompt_logprobs")
        if echo and want_lp:
            _only_own_logprobs(params.num_top_logprobs, "logprobs", "with echo=true")
        requests = [fields.fit_context(EngineRequest(ids, params, stop), "prompt", limits) for ids in prompts]
        outputs = self.service.sample([r for r in requests for _ in range(n)], [body.get("seed")])
        skip, keep = body.get("skip_special_tokens", True), body.get("include_stop_str_in_output", False)
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        choices = []
        for p, (req, text) in enumerate(zip(requests, texts)):
            scored = None  # each prompt token's logprob given the ones before it (the first has none)
            if body.get("prompt_logprobs") is not None or (echo and want_lp):
                scored = [lp for lp, _, _ in self.service.prompt_logprobs(req.prompt_token_ids, 0)]
            prompt_text = text if text is not None else self.tokenizer.decode(req.prompt_token_ids,
                                                                               skip_special_tokens=skip)
            for k in range(n):
                out = outputs[p * n + k]
                choice: dict[str, Any] = {"index": p * n + k, "text": self.service.response_text(out, skip, keep),
                                          "logprobs": None, "finish_reason": out.stop_reason,
                                          "stop_reason": _stop_reason(out, req)}
                if want_lp:
                    tokens, lps, tops = list(out.response_ids), list(out.logprobs), _tops(out)
                    if echo:
                        tokens = req.prompt_token_ids + tokens
                        lps = scored + lps
                        tops = [None if lp is None else [] for lp in scored] + tops
                    choice["logprobs"] = self._completion_logprobs(tokens, lps, tops, as_ids)
                if echo:
                    choice["text"] = prompt_text + choice["text"]
                if body.get("return_token_ids"):
                    choice["token_ids"] = out.response_ids
                    choice["prompt_token_ids"] = req.prompt_token_ids
                if body.get("prompt_logprobs") is not None:
                    # vLLM's shape: per prompt token {token id: {logprob, rank, decoded_token}}, the first None
                    choice["prompt_logprobs"] = [
                        None if lp is None else {str(t): {"logprob": lp, "rank": None,
                                                          "decoded_token": self.tokenizer.decode([t])}}
                        for lp, t in zip(scored, req.prompt_token_ids)]
                choices.append(choice)
        answer = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                  "model": self.service.served_model_name, "choices": choices,
                  "usage": _usage(sum(len(r.prompt_token_ids) for r in requests), outputs)}
        return _completion_events(answer, _usage_wanted(body)) if body.get("stream") else answer

    def chat_completions(self, body: dict) -> dict | EventStream:
        """`n` samples of the chat-templated messages, in one batch."""
        self._check(body, "/v1/chat/completions", CHAT_FIELDS)
        prompt = self._render_chat(body)
        want_lp = fields.flag(body["logprobs"], "logprobs") if body.get("logprobs") is not None else False
        top = body.get("top_logprobs")
        if top is not None and not want_lp:
            raise RequestError("top_logprobs needs logprobs=true. Fix: add logprobs=true, or drop top_logprobs",
                               "top_logprobs")
        limit = next(((k, body[k]) for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None),
                     ("max_tokens", self.service.chat_max_tokens))
        # logprobs=true with no top_logprobs still returns each sampled token's logprob
        params, stop = self._sampling(body, limit, ("top_logprobs", top))
        request = fields.fit_context(EngineRequest(prompt, params, stop), "messages", self.service.model_limits)
        outputs = self.service.sample([request] * _sample_count(body, 1, self.service.model_limits),
                                      [body.get("seed")])
        skip, keep = body.get("skip_special_tokens", True), body.get("include_stop_str_in_output", False)
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        choices = []
        for i, out in enumerate(outputs):
            choice: dict[str, Any] = {
                "index": i, "message": {"role": "assistant", "content": self.service.response_text(out, skip, keep)},
                "logprobs": self._chat_logprobs(out, as_ids) if want_lp else None,
                "finish_reason": out.stop_reason, "stop_reason": _stop_reason(out, request)}
            if body.get("return_token_ids"):
                choice["token_ids"] = out.response_ids
            choices.append(choice)
        answer = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                  "model": self.service.served_model_name, "choices": choices, "usage": _usage(len(prompt), outputs)}
        if body.get("return_token_ids"):
            answer["prompt_token_ids"] = prompt  # vLLM's field: with `token_ids`, the exact tokens sampled from
        return _chat_events(answer, _usage_wanted(body)) if body.get("stream") else answer

    def tokenize(self, body: dict) -> dict:
        """vLLM's /tokenize: a text (`prompt`, special tokens added by default) or a chat
        (`messages`, rendered as /v1/chat/completions renders them)."""
        self._check(body, "/tokenize", TOKENIZE_FIELDS, model_required=False)
        if ("prompt" in body) == ("messages" in body):
            raise RequestError("/tokenize: send either prompt (a text) or messages (a chat), one of the two", "prompt")
        if "messages" in body:
            ids = self._render_chat(body)
        else:
            chat_only = sorted(k for k in ("chat_template", "chat_template_kwargs", "add_generation_prompt",
                                           "continue_final_message") if k in body)
            if chat_only:
                raise RequestError(f"/tokenize: {chat_only[0]} applies to messages, not to a prompt", chat_only[0])
            if not isinstance(body["prompt"], str):
                raise RequestError(f"prompt must be a text, got {fields.short(body['prompt'])}", "prompt")
            ids = self.service.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
        strs = self.tokenizer.convert_ids_to_tokens(ids) if body.get("return_token_strs") else None
        return {"count": len(ids), "max_model_len": self.service.model_limits.context_length, "tokens": ids,
                "token_strs": strs}

    def detokenize(self, body: dict) -> dict:
        """vLLM's /detokenize: the text of token ids, special tokens included."""
        self._check(body, "/detokenize", DETOKENIZE_FIELDS, model_required=False)
        tokens = body.get("tokens")
        ids = [] if tokens == [] else fields.token_ids(tokens, "tokens", self.service.model_limits)
        return {"prompt": self.tokenizer.decode(ids)}

    # -- requests -------------------------------------------------------------------------------
    def _check(self, body: dict, route: str, known: set[str], *, model_required: bool = True) -> None:
        """What every request must satisfy: the served model named, no field this server would not
        act on, flags that are flags, stream options only with stream=true."""
        unknown = sorted(k for k in body if k not in known and k not in _NEUTRAL)
        if unknown:
            raise RequestError(f"{route}: fields this server does not act on: {unknown}. Fix: remove them (the fields "
                               "it takes: docs/engines.md, OpenAI clients)", unknown[0])
        applied = sorted(k for k in body if k in _NEUTRAL and body[k] not in (None, *_NEUTRAL[k]))
        if applied:
            raise RequestError(f"{route}: {applied[0]}={fields.short(body[applied[0]])}: this server does not apply "
                               f"{applied[0]}. Fix: remove it", applied[0])
        served = self.service.served_model_name
        if body.get("model") is None and model_required:
            raise RequestError(f"{route}: the field `model` is required; this server serves {served!r}. Fix: "
                               f"model={served!r}", "model")
        if body.get("model") is not None and body["model"] != served:
            raise RequestError(f"{route}: model {body['model']!r} is not served here; this server serves {served!r} "
                               f"(GET /v1/models). Fix: model={served!r}", "model")
        for key in _FLAGS:
            if body.get(key) is not None:
                fields.flag(body[key], key)
        if body.get("stream_options") is not None:
            _usage_wanted(body)

    def _sampling(self, body: dict, max_tokens: tuple[str, Any], top_logprobs: tuple[str, Any]) -> \
            tuple[SamplingParams, tuple[int, ...]]:
        limits = self.service.model_limits
        fields.seed(body.get("seed"), "seed")
        params = fields.sampling(body, max_tokens=max_tokens, prefix="", top_logprobs=top_logprobs, limits=limits)
        return params, fields.stop_token_ids(body.get("stop_token_ids"), "stop_token_ids", limits)

    def _completion_prompts(self, body: dict) -> tuple[list[list[int]], list[str | None]]:
        """`prompt`: a text, a list of texts, token ids or a list of them -> (token ids per prompt,
        its text where it came as one). Texts get the tokenizer's special tokens (vLLM's
        `add_special_tokens`, default true)."""
        prompt = body.get("prompt")
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(t, str) for t in prompt)):
            texts = [prompt] if isinstance(prompt, str) else prompt
            special = body.get("add_special_tokens", True)
            prompts = [self.service.encode(t, add_special_tokens=special) for t in texts]
            if not all(prompts):
                raise RequestError("prompt: an empty text has no token to continue from", "prompt")
            return prompts, list(texts)
        prompts, _ = fields.token_batch(prompt, "prompt", self.service.model_limits,
                                         other="a text, a list of texts, ")
        return prompts, [None] * len(prompts)

    def _render_chat(self, body: dict) -> list[int]:
        """The messages through the chat template (vLLM's fields: the assistant turn opened unless
        `add_generation_prompt=false` or `continue_final_message=true`), then tokenized without
        adding special tokens (the template writes them) unless `add_special_tokens`."""
        messages = _messages(body.get("messages"))
        template_kwargs = body.get("chat_template_kwargs")
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise RequestError(f"chat_template_kwargs must be an object, got {fields.short(template_kwargs)}",
                               "chat_template_kwargs")
        template_kwargs = dict(template_kwargs or {})
        given = [k for k, v in (("chat_template", body.get("chat_template")),
                                ("chat_template_kwargs.chat_template", template_kwargs.get("chat_template")))
                 if v is not None]
        if given and not self.service.trust_request_chat_template:
            # a template is a program the server runs (loops, string growth): one request of 150 bytes
            # took 2 GB. vLLM refuses them the same way unless started with this flag
            raise RequestError(f"{given[0]}: this server renders chats with the model's own template only; a "
                               "template sent with the request is refused unless the server is started with "
                               "--trust-request-chat-template. Fix: drop it", given[0])
        if body.get("chat_template") is not None:
            if not isinstance(body["chat_template"], str):
                raise RequestError(f"chat_template must be a text, got {fields.short(body['chat_template'])}",
                                   "chat_template")
            template_kwargs["chat_template"] = body["chat_template"]
        cont = bool(body.get("continue_final_message"))
        if cont and body.get("add_generation_prompt"):
            raise RequestError("continue_final_message=true continues the last message, add_generation_prompt=true "
                               "opens a new one: set one of them", "continue_final_message")
        options = {"add_generation_prompt": body.get("add_generation_prompt", not cont), "continue_final_message": cont}
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, **{**template_kwargs, **options})
        except (TemplateError, ValueError, TypeError) as e:
            raise RequestError(f"the chat template cannot render these messages: {e}", "messages") from e
        return self.service.encode(text, add_special_tokens=body.get("add_special_tokens", False))

    # -- answers --------------------------------------------------------------------------------
    def _token_key(self, token: int, as_ids: bool) -> str:
        return f"token_id:{token}" if as_ids else self.tokenizer.decode([token])

    def _completion_logprobs(self, tokens: list[int], logprobs: list[float | None], tops: list[TopLogprobs | None],
                             as_ids: bool) -> dict[str, Any]:
        """vLLM's completion logprobs: per token its text (or "token_id:ID"), its logprob, the top N
        and itself keyed by token (None where no logprob: an echoed first prompt token), and its
        offset in the text."""
        keys, offsets, top_maps, at = [], [], [], 0
        for token, logprob, top in zip(tokens, logprobs, tops):
            key = self._token_key(token, as_ids)
            keys.append(key)
            offsets.append(at)
            at += len(self.tokenizer.decode([token]))
            top_maps.append(None if logprob is None or top is None else
                            {**{self._token_key(t, as_ids): lp for t, lp in top}, key: logprob})
        return {"text_offset": offsets, "token_logprobs": logprobs, "tokens": keys, "top_logprobs": top_maps}

    def _chat_logprobs(self, out: EngineOutput, as_ids: bool) -> dict[str, Any]:
        """OpenAI's `logprobs.content`: per sampled token its text, logprob, UTF-8 bytes and the top
        `top_logprobs` alternatives."""
        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = self._token_key(token, as_ids)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top]}
                            for t, lp, top in zip(out.response_ids, out.logprobs, _tops(out))]}


def _messages(value: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages for the template: content parts of type text joined by newlines (as
    vLLM flattens them for text models); any other part refused, naming it."""
    if not isinstance(value, list) or not value:
        raise RequestError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects, got "
                           f"{fields.short(value)}", "messages")
    messages = []
    for i, message in enumerate(value):
        key = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"{key} must be an object with a role and a content, got {fields.short(message)}", key)
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise RequestError(f"{key}.content[{j}]: this server reads text parts only "
                                       f"({{\"type\": \"text\", \"text\": ...}}), got {fields.short(part)}",
                                       f"{key}.content")
                texts.append(part["text"])
            message = {**message, "content": "\n".join(texts)}
        elif content is not None and not isinstance(content, str):
            raise RequestError(f"{key}.content must be a text or a list of text parts, got {fields.short(content)}",
                               f"{key}.content")
        messages.append(message)
    return messages


def _sample_count(body: dict, prompts: int, limits: fields.ModelLimits) -> int:
    """`n`: samples per prompt, at most `limits.max_sequences` sequences in all."""
    return fields.sequence_count(fields.whole(body.get("n", 1), "n", 1), prompts, "n", limits)


def _usage_wanted(body: dict) -> bool:
    """`stream_options` (only with stream=true, as vLLM): whether the last event carries the usage."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not body.get("stream"):
        raise RequestError("stream_options applies to stream=true only. Fix: drop it, or set stream=true",
                           "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise RequestError(f"stream_options must be {{\"include_usage\": true/false}}, got {fields.short(options)}",
                           "stream_options")
    if options.get("continuous_usage_stats"):
        raise RequestError("stream_options.continuous_usage_stats: this server sends the usage once, in the last "
                           "event (include_usage). Fix: drop it", "stream_options.continuous_usage_stats")
    return fields.flag(options.get("include_usage", False), "stream_options.include_usage")


def _event(answer: dict, obj: str, choices: list[dict], usage: bool) -> dict[str, Any]:
    event = {"id": answer["id"], "object": obj, "created": answer["created"], "model": answer["model"],
             "choices": choices}
    if usage:
        event["usage"] = None  # OpenAI's shape: null on every event but the last
    return event


def _completion_events(answer: dict, usage: bool) -> EventStream:
    """A /v1/completions answer as vLLM streams it: per choice, its text (with its logprobs), then
    its finish reason; the usage last when asked."""
    events = []
    for c in answer["choices"]:
        extra = {k: c[k] for k in ("token_ids", "prompt_token_ids", "prompt_logprobs") if k in c}
        events.append(_event(answer, "text_completion", [{"index": c["index"], "text": c["text"],
                                                          "logprobs": c["logprobs"], "finish_reason": None,
                                                          "stop_reason": None, **extra}], usage))
        events.append(_event(answer, "text_completion", [{"index": c["index"], "text": "", "logprobs": None,
                                                          "finish_reason": c["finish_reason"],
                                                          "stop_reason": c["stop_reason"]}], usage))
    if usage:
        events.append({**_event(answer, "text_completion", [], False), "usage": answer["usage"]})
    return EventStream(events)


def _chat_events(answer: dict, usage: bool) -> EventStream:
    """A /v1/chat/completions answer as vLLM streams it (`chat.completion.chunk`): per choice the
    role, the content (with its logprobs), then the finish reason; the usage last when asked."""
    obj, events = "chat.completion.chunk", []
    for c in answer["choices"]:
        i = c["index"]
        events.append(_event(answer, obj, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}], usage))
        content = {"index": i, "delta": {"content": c["message"]["content"]}, "logprobs": c["logprobs"],
                   "finish_reason": None}
        if "token_ids" in c:
            content["token_ids"] = c["token_ids"]
        events.append(_event(answer, obj, [content], usage))
        events.append(_event(answer, obj, [{"index": i, "delta": {}, "logprobs": None,
                                            "finish_reason": c["finish_reason"], "stop_reason": c["stop_reason"]}],
                             usage))
    if "prompt_token_ids" in answer and events:
        events[0]["prompt_token_ids"] = answer["prompt_token_ids"]
    if usage:
        events.append({**_event(answer, obj, [], False), "usage": answer["usage"]})
    return EventStream(events)


def _only_own_logprobs(count: int, key: str, when: str = "") -> None:
    if count:
        raise RequestError(f"{key}={count}{' ' + when if when else ''}: this server scores each prompt token, not "
                           f"its top alternatives. Fix: {key}=0 (each prompt token's own logprob)", key)


def _tops(out: EngineOutput) -> list[TopLogprobs]:
    """The top alternatives of each sampled token (none asked: empty lists)."""
    return out.top_logprobs if out.top_logprobs is not None else [[] for _ in out.response_ids]


def _stop_reason(out: EngineOutput, request: EngineRequest) -> str | int | None:
    """vLLM's `stop_reason`: the stop string, or the stop token id, that ended the choice; None
    for the end-of-sequence token and for the length limit."""
    if out.stop_reason != "stop":
        return None
    if out.matched_stop is not None:
        return out.matched_stop
    last = out.response_ids[-1] if out.response_ids else None
    return last if last in request.stop_token_ids else None


def _usage(prompt_tokens: int, outputs: list[EngineOutput]) -> dict[str, int]:
    completion_tokens = sum(len(o.response_ids) for o in outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
