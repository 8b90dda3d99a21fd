"""The fields of `ridgeline serve`'s requests, checked before anything reaches the engine: every
bad value is refused with a `RequestError` naming the field (answered 400), never coerced, never
left to fail inside the engine.

The limits are vLLM's and SGLang's: temperature >= 0, 0 < top_p <= 1, top_k -1 / 0 (off) or >= 1,
0 <= min_p <= 1, repetition_penalty > 0, at most `max_logprobs` top logprobs (vLLM's default 20),
token ids of the model's vocabulary, and a prompt that fits the context, whose
`max_new_tokens` / `max_tokens` is then cut to what is left of it (SGLang's rule). What a request
costs the engine beyond that is bounded here too: sequences per request (n x prompts: n=2,000,000
took +1.7 GB and 50 s), stop strings in number and total length (every new token is checked
against each: 3 M of them starved every other client), stop token ids in number.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ridgeline.inference.types import EngineRequest, SamplingParams

SEED_RANGE = (-2**63, 2**64)  # what torch's generators take


class RequestError(ValueError):
    """A request the server refuses: answered 400, naming `param`, the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


@dataclass(frozen=True)
class ModelLimits:
    """What a request may ask of the served model."""

    vocab_size: int               # token ids 0 .. vocab_size - 1
    context_length: int | None    # prompt + response tokens; None: the engine judges alone
    max_logprobs: int = 20        # top logprobs per token (vLLM's --max-logprobs default)
    max_sequences: int = 16384    # sequences one request generates: n x its prompts (a remote training
                                  # batch comes as one /generate: 1024 prompts x 16 samples fit)
    max_stop_strings: int = 64    # stop strings of one request (OpenAI's API takes 4)
    max_stop_chars: int = 4096    # their total length in characters
    max_stop_token_ids: int = 1024


def sequence_count(n: int, prompts: int, key: str, limits: ModelLimits) -> int:
    """`n` samples of `prompts` prompts: at most `max_sequences` in all (`key` names the field)."""
    if n * prompts > limits.max_sequences:
        raise RequestError(f"{key}: {n} sample(s) of {prompts} prompt(s) is {n * prompts} sequences, more than this "
                           f"server's limit of {limits.max_sequences} per request. Fix: split it into several "
                           "requests", key)
    return n


def whole(value: Any, key: str, low: int | None = None, high: int | None = None) -> int:
    """An integer (not a bool, not a float) in [low, high)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{key} must be a whole number, got {value!r}", key)
    if (low is not None and value < low) or (high is not None and value >= high):
        bounds = f">= {low}" if high is None else f"from {low} to {high - 1}" if low is not None else f"< {high}"
        raise RequestError(f"{key} must be a whole number {bounds}, got {value}", key)
    return value


def number(value: Any, key: str, low: float, high: float = math.inf, *, low_open: bool = False) -> float:
    """A finite number in [low, high] ((low, high] with `low_open`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{key} must be a finite number, got {value!r}", key)
    if value < low or (low_open and value == low) or value > high:
        bounds = f"{'greater than' if low_open else 'at least'} {low:g}" + ("" if high == math.inf else
                                                                            f" and at most {high:g}")
        raise RequestError(f"{key} must be {bounds}, got {value:g}", key)
    return float(value)


def flag(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise RequestError(f"{key} must be true or false, got {value!r}", key)
    return value


def seed(value: Any, key: str) -> int | None:
    return None if value is None else whole(value, key, *SEED_RANGE)


def token_ids(value: Any, key: str, limits: ModelLimits) -> list[int]:
    """A non-empty list of token ids of the model's vocabulary."""
    if not isinstance(value, list) or not value:
        raise RequestError(f"{key} must be a non-empty list of token ids, got {short(value)}", key)
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < limits.vocab_size:
            raise RequestError(f"{key}[{i}]={t!r} is not a token id of this model (0 .. {limits.vocab_size - 1})", key)
    return value


def token_batch(value: Any, key: str, limits: ModelLimits, *, other: str = "") -> tuple[list[list[int]], bool]:
    """A list of token ids or a list of such lists -> (batch, was_single). `other`: the other forms
    the field takes, for the message."""
    if isinstance(value, list) and value and all(isinstance(row, list) for row in value):
        return [token_ids(row, f"{key}[{i}]", limits) for i, row in enumerate(value)], False
    if isinstance(value, list) and value and not any(isinstance(t, list) for t in value):
        return [token_ids(value, key, limits)], True
    raise RequestError(f"{key} must be {other}a non-empty list of token ids or a list of such lists, got "
                       f"{short(value)}", key)


def stop_token_ids(value: Any, key: str, limits: ModelLimits) -> tuple[int, ...]:
    if isinstance(value, list) and len(value) > limits.max_stop_token_ids:
        raise RequestError(f"{key} has {len(value)} token ids, more than this server's limit of "
                           f"{limits.max_stop_token_ids}", key)
    return () if value is None or value == [] else tuple(token_ids(value, key, limits))


def stop_strings(value: Any, key: str, limits: ModelLimits) -> tuple[str, ...]:
    """A `stop` field (null, a string or a list of strings, as both APIs take it), at most
    `max_stop_strings` of them, `max_stop_chars` in all."""
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"{key} must be a non-empty string or a list of non-empty strings, got {short(value)}", key)
    if len(stops) > limits.max_stop_strings:
        raise RequestError(f"{key} has {len(stops)} stop strings, more than this server's limit of "
                           f"{limits.max_stop_strings}", key)
    chars = sum(map(len, stops))
    if chars > limits.max_stop_chars:
        raise RequestError(f"{key}: the stop strings have {chars} characters in all, more than this server's limit "
                           f"of {limits.max_stop_chars}", key)
    return tuple(stops)


def sampling(fields: dict[str, Any], *, max_tokens: tuple[str, Any], prefix: str, top_logprobs: tuple[str, Any],
             limits: ModelLimits) -> SamplingParams:
    """The sampling fields both APIs share -> `SamplingParams`. `max_tokens` and `top_logprobs` are
    (field name, value): the APIs name them differently; `prefix` goes before every field name."""
    def get(key: str, default: Any) -> tuple[Any, str]:
        value = fields.get(key)
        return default if value is None else value, prefix + key

    top_key, top = top_logprobs
    return SamplingParams(
        max_generate_length=whole(max_tokens[1], max_tokens[0], 0),
        temperature=number(*get("temperature", 1.0), 0.0),
        top_p=number(*get("top_p", 1.0), 0.0, 1.0, low_open=True),
        top_k=whole(*get("top_k", -1), -1),
        min_p=number(*get("min_p", 0.0), 0.0, 1.0),
        repetition_penalty=number(*get("repetition_penalty", 1.0), 0.0, low_open=True),
        stop=stop_strings(fields.get("stop"), prefix + "stop", limits),
        logprobs=top_logprob_count(top, top_key, limits) or None)


def top_logprob_count(value: Any, key: str, limits: ModelLimits) -> int:
    """How many top logprobs per token (`logprobs`, `top_logprobs`, `top_logprobs_num`); null is 0."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limits.max_logprobs:
        raise RequestError(f"{key}: the number of top logprobs must be a whole number from 0 to "
                           f"{limits.max_logprobs} (--max-logprobs), got {value!r}", key)
    return value


def fit_context(request: EngineRequest, key: str, limits: ModelLimits) -> EngineRequest:
    """Refuse a prompt longer than the context; cut the response length to what is left of it."""
    if limits.context_length is None:
        return request
    prompt, params = len(request.prompt_token_ids), request.sampling_params
    if prompt > limits.context_length:
        raise RequestError(f"{key} has {prompt} tokens, more than this model's context of {limits.context_length} "
                           "tokens; shorten it", key)
    room = limits.context_length - prompt
    if params.max_generate_length <= room:
        return request
    return dataclasses.replace(request, sampling_params=dataclasses.replace(params, max_generate_length=room))


def short(value: Any) -> str:
    """`value` as a message quotes it: at most 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
