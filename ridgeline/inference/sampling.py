"""Turning next-token logits into a sampled token and its logprob. Pure tensor functions."""

from __future__ import annotations

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


def sample_next(logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from logits [B, V]; return (tokens [B], logprobs [B]).

    The logprob is taken from log_softmax(logits / temperature) without filtering (temperature 0
    reports the plain temperature-1 distribution), matching the trainer's recomputation."""
    logits = logits.float()
    if params.temperature <= 0.0:
        tokens = logits.argmax(-1)
        logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
        return tokens, logprobs
    scaled = logits / params.temperature
    logprobs_all = torch.log_softmax(scaled, -1)
    filtered = filter_logits(scaled, params)
    tokens = sample_from_logits(filtered, generator)
    return tokens, logprobs_all.gather(-1, tokens[:, None]).squeeze(-1)


def sample_from_logits(logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Inverse-CDF sampling: one uniform draw per row and a binary search in the cumulative mass.

    torch.multinomial draws an exponential variate for every vocabulary entry (~50 ms for
    64 x 49k on this CPU, a fifth of a decode step); this costs one number per row. With
    `right=True` the first index whose cumulative mass exceeds u is returned, so a token of
    zero probability (filtered to -inf) is never picked."""
    cdf = logits.softmax(-1).cumsum(-1)
    u = torch.rand((logits.shape[0], 1), generator=generator, device=logits.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)
