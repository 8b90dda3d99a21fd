"""Turning next-token logits into a sampled token and its logprob. Pure tensor functions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ridgeline.inference.types import SamplingParams


def filter_logits(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply top-k, then top-p (nucleus), then min-p to temperature-scaled logits [B, V].

    Filtered entries become -inf. The most likely token always survives, so a row never ends
    with nothing to sample."""
    logits = scaled
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # mass of the tokens strictly before each one; keep a token while that mass is < top_p
        before = probs.cumsum(-1) - probs
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        threshold = params.min_p * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def penalize_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """The repetition penalty of vLLM and transformers on logits [B, V].

    `seen` [B, V] (bool) marks the tokens of each row's prompt and response so far (presence, not
    counts). Their logits move towards 0 when penalty > 1: positive ones are divided by it, the
    others multiplied. Unseen tokens keep their logits."""
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


@dataclass(frozen=True)
class NextTokens:
    """One sampling step of B rows: the sampled ids [B], their logprobs [B] and, when asked for,
    the N most likely ids [B, N] with their logprobs [B, N], all under the reported distribution."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
                seen: torch.Tensor | None = None) -> NextTokens:
    """Sample one token per row from logits [B, V].

    The sample is drawn from the repetition-penalized (over `seen` [B, V]), temperature-scaled,
    top-k / top-p / min-p filtered logits. The reported logprobs are log_softmax(logits /
    temperature) of the raw logits (temperature 0 reports the plain temperature-1 distribution):
    neither the penalty nor the filters, matching the trainer's recomputation."""
    logits = logits.float()
    sampling = logits
    if params.repetition_penalty != 1.0:
        if seen is None:
            raise ValueError("sample_next: repetition_penalty != 1 needs `seen`, the tokens of each row so far")
        sampling = penalize_repetition(logits, seen, params.repetition_penalty)
    if params.temperature <= 0.0:
        reported = torch.log_softmax(logits, -1)
        tokens = sampling.argmax(-1)
    else:
        reported = torch.log_softmax(logits / params.temperature, -1)
        tokens = sample_from_logits(filter_logits(sampling / params.temperature, params), generator)
    chosen = reported.gather(-1, tokens[:, None]).squeeze(-1)
    if params.num_top_logprobs == 0:
        return NextTokens(tokens, chosen)
    top = reported.topk(min(params.num_top_logprobs, reported.shape[-1]), dim=-1)
    return NextTokens(tokens, chosen, top.indices, top.values)


def sample_from_logits(logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform draw per row and a binary search in the cumulative mass.

    torch.multinomial draws an exponential variate for every vocabulary entry (~50 ms for
    64 x 49k on this CPU, a fifth of a decode step); this costs one number per row. With
    `right=True` the first index whose cumulative mass exceeds u is returned, so a token of
    zero probability (filtered to -inf) is never picked."""
    cdf = logits.softmax(-1).cumsum(-1)
    u = torch.rand((logits.shape[0], 1), generator=generator, device=logits.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)
