"""What crosses the inference-engine boundary: token ids in, token ids and logprobs out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generator, Iterable, Literal, Protocol, TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema.generator import SamplingConfig

StopReason = Literal["stop", "length"]
MemoryTag = Literal["weights", "kv_cache"]
# What an engine's `wake_up` takes back, in the order it must: the weights first (so a weight sync
# can land while the trainer still holds its memory), the KV cache last (vLLM's and SGLang's tags)
WAKE_TAGS: tuple[MemoryTag, ...] = ("weights", "kv_cache")


def wake_order(tags: Iterable[str]) -> tuple[MemoryTag, ...]:
    """`tags` checked against `WAKE_TAGS` and put in wake order."""
    if isinstance(tags, str):
        raise TypeError(f"wake_up takes a tuple of memory tags, e.g. ({tags!r},), not the string {tags!r}")
    tags = tuple(tags)
    unknown = sorted(set(tags) - set(WAKE_TAGS))
    if unknown:
        raise ValueError(f"unknown engine memory tag(s) {unknown}: wake_up takes {list(WAKE_TAGS)}")
    return tuple(t for t in WAKE_TAGS if t in tags)


T = TypeVar("T")
Steps = Generator[None, None, T]
"""Work done in steps: the generator yields after each engine step (a decode step of a batch) and
returns its result, so a server can interleave several requests' steps (ridgeline.inference.scheduler)."""


def run_steps(steps: Steps[T]) -> T:
    """Run stepped work to its end in one go; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


@dataclass(frozen=True)
class SamplingParams:
    """The `generator.sampling_params` keys. temperature 0 means greedy decoding.

    Returned logprobs are those of the temperature-scaled distribution *before* the repetition
    penalty and top-k / top-p / min-p filtering, i.e. exactly what the trainer recomputes from the
    same weights (docs/engines.md, "Logprob contract").

    repetition_penalty: vLLM's and transformers' rule: every token of the prompt or of the response
    so far has its logit divided by the penalty when positive, multiplied by it otherwise; 1 = off.
    stop: stop strings, matched on the response text (special tokens skipped) after each token; the
    response ends with the token that completes one, the string kept (SkyRL's
    `include_stop_str_in_output=True`), stop reason "stop".
    logprobs: SkyRL's key; N >= 1 also returns the N most likely tokens of every position with their
    logprobs (`EngineOutput.top_logprobs`). The sampled token's logprob is returned in every case."""

    max_generate_length: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    logprobs: int | None = None

    @property
    def num_top_logprobs(self) -> int:
        """How many top logprobs per token an engine returns (0: none)."""
        return self.logprobs or 0

    @classmethod
    def from_config(cls, cfg: SamplingConfig) -> "SamplingParams":
        return cls(
            max_generate_length=int(cfg.max_generate_length),
            temperature=float(cfg.temperature),
            top_p=float(cfg.top_p),
            top_k=int(cfg.top_k),
            min_p=float(cfg.min_p),
            repetition_penalty=float(cfg.repetition_penalty),
            stop=() if cfg.stop is None else tuple(str(s) for s in cfg.stop),
            logprobs=None if cfg.logprobs is None else int(cfg.logprobs),
        )


@dataclass(frozen=True)
class EngineRequest:
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    stop_token_ids: tuple[int, ...] = ()  # in addition to the engine's eos


TopLogprobs = list[tuple[int, float]]
"""One position's most likely tokens: (token id, logprob) pairs, most likely first."""


@dataclass
class EngineOutput:
    """One response. `matched_stop` is the stop string that ended it (None when an eos / stop token
    or the length limit did); `top_logprobs` holds one `TopLogprobs` per response token when the
    request asked for `logprobs=N >= 1`, else None."""

    response_ids: list[int]
    logprobs: list[float]
    stop_reason: StopReason
    metrics: dict[str, float] = field(default_factory=dict)
    matched_stop: str | None = None
    top_logprobs: list[TopLogprobs] | None = None


class InferenceEngine(Protocol):
    """One interface for the embedded engine, vLLM, SGLang and remote servers.

    `update_weights` takes tensors held by the caller's process (a colocated engine, or an engine
    process that received them over the weight-sync group or through IPC handles); `score` gives
    teacher-forced logprobs, which the stale-weights probe compares with the trainer's.

    Sleep / wake (colocated engines hand their device memory to the trainer while it trains): `sleep`
    releases the weights and the KV cache; `wake_up(("weights",))`, then the weight sync, then
    `wake_up(("kv_cache",))`, so memory never holds the trainer's state and a full KV cache at
    once. An engine refuses `generate` / `score` until both are back."""

    dtype: torch.dtype

    def generate(self, requests: list[EngineRequest], seed: int | None = None) -> list[EngineOutput]: ...

    def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """Logprob of each of `response_ids` after `prompt_ids` and the response tokens before it."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load these (Hugging Face-named) weights; also drops any cached prefixes. Weights that are
        asleep are woken first (the KV cache stays asleep)."""
        ...

    def reset_prefix_cache(self) -> None: ...

    def sleep(self, level: int = 1) -> None:
        """Free the device for training: level 1 keeps the weights (offloaded), level 2 drops them
        (the next `update_weights` brings them back)."""
        ...

    def wake_up(self, tags: tuple[MemoryTag, ...] = WAKE_TAGS) -> None:
        """Take back the memory of `tags` (see `WAKE_TAGS`); tags that are awake are left alone."""
        ...

    def close(self) -> None: ...


class EngineError(RuntimeError):
    """An engine could not be built, reached, or did not answer as its API promises."""
