"""Ways to reduce a per-token loss matrix [B, T] to the scalar that is backpropagated.

Every reduction takes optional global normalisers. With gradient accumulation the
trainer splits a mini-batch into micro-batches and sums their losses; if each
micro-batch divided by its *own* token or sequence count, that sum would weight
micro-batches unequally. Passing the mini-batch's counts makes the sum of the
micro-batch losses equal the mini-batch loss exactly.

Losses call `reduce_loss(values, mask, mode)` without normalisers (SkyRL's and the issue's
signature); the worker wraps each optimizer step in `loss_normalizers(num_tokens, num_sequences,
max_seq_len=...)` and `reduce_loss` picks the mini-batch counts up from there. So a user's loss is
exact under gradient accumulation without knowing it is being accumulated.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import Tensor

from ridgeline.algorithms.registry import LOSS_REDUCTIONS, register_loss_reduction


def _safe_denominator(count: Tensor) -> Tensor:
    # An all-padding batch has a zero count; its masked sum is zero too, so dividing
    # by 1 yields 0 rather than NaN. Unlike clamp(min=1), positive fractional counts
    # (weighted masks) are left alone; for 0/1 masks the two are identical.
    return torch.where(count > 0, count, torch.ones_like(count))


def _as_count(value: float | Tensor | None, default: Tensor, like: Tensor) -> Tensor:
    if value is None:
        return _safe_denominator(default)
    # checked on the host when it is a number (the workers' normalisers are): no device sync
    negative = bool((value < 0).any()) if isinstance(value, Tensor) else value < 0
    if negative:
        raise ValueError(f"normaliser must be non-negative, got {value}")
    return _safe_denominator(torch.as_tensor(value, dtype=like.dtype, device=like.device))


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """mean of `values` over positions where `mask` is set: sum(v * m) / sum(m).

    With `dim` the mean is taken along that axis only. Where the mask is empty the
    result is 0.
    """
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / _safe_denominator(mask.sum())
    return (values * mask).sum(dim) / _safe_denominator(mask.sum(dim))


@register_loss_reduction("token_mean")
def token_mean(
    values: Tensor,
    mask: Tensor,
    *,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    max_seq_len: int | None = None,
) -> Tensor:
    """L = sum_{i,t} v_{i,t} m_{i,t} / N_tok,   N_tok = sum_{i,t} m_{i,t} by default.

    Every response token weighs the same, so long responses dominate (DAPO's choice).
    `num_sequences` and `max_seq_len` are accepted and ignored so all reductions share one call.
    """
    mask = mask.to(values.dtype)
    denom = _as_count(num_tokens, mask.sum(), values)
    return (values * mask).sum() / denom


@register_loss_reduction("token_sum")
def token_sum(values: Tensor, mask: Tensor, *, num_tokens: float | None = None, num_sequences: float | None = None,
              max_seq_len: int | None = None) -> Tensor:
    """L = sum_{i,t} v_{i,t} m_{i,t}: the Tinker API's reduction (a weighted sum, no normaliser)."""
    return (values * mask.to(values.dtype)).sum()


@register_loss_reduction("token_mean_legacy")
def token_mean_legacy(
    values: Tensor,
    mask: Tensor,
    *,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    max_seq_len: int | None = None,
) -> Tensor:
    """L = (1 / K) sum_{i,t} v_{i,t} m_{i,t} / sum_{i,t} m_{i,t}   over the micro-batch given,

    K the optimizer step's micro-batches (all ranks; 1 outside a `loss_normalizers` block): the
    mean of the micro-batches' own token means, SkyRL 0.3.1's `token_mean` (0.4's
    `token_mean_legacy`). It equals `token_mean` when every micro-batch holds as many loss tokens;
    otherwise a token of a short micro-batch weighs more. The mini-batch normalisers are ignored.
    """
    mask = mask.to(values.dtype)
    norms = _NORMALIZERS.get()
    micro_batches = norms.micro_batches if norms is not None else 1
    return (values * mask).sum() / _safe_denominator(mask.sum()) / micro_batches


@register_loss_reduction("prompt_mean")
def prompt_mean(
    values: Tensor,
    mask: Tensor,
    *,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    max_seq_len: int | None = None,
) -> Tensor:
    """L = sum_i sum_t v_{i,t} m_{i,t} / (P * N_p(i))   (SkyRL 0.4's `prompt_mean`)

    P the prompts of the mini-batch, N_p(i) the loss tokens of all the responses to row i's prompt
    in it: the token mean within each prompt group, averaged over the prompts, so every prompt
    weighs the same whatever its responses' lengths. The divisors P * N_p(i) of the rows passed
    in come from the enclosing `loss_normalizers` block (`prompt_divisors`, which the policy
    worker sets per micro-batch from the rows' uids); a call without them is an error, since the
    groups cannot be read from the tensors.
    """
    norms = _NORMALIZERS.get()
    if norms is None or norms.prompt_divisors is None:
        raise ValueError("loss_reduction=prompt_mean needs the prompt group of every row: call it inside "
                         "loss_normalizers(..., prompt_divisors=...) (the policy worker does)")
    divisors = norms.prompt_divisors.to(device=values.device, dtype=values.dtype)
    if divisors.shape != values.shape[:1]:
        raise ValueError(f"prompt_mean: {divisors.shape[0] if divisors.dim() else 0} row divisors for "
                         f"{values.shape[0]} rows")
    mask = mask.to(values.dtype)
    return ((values * mask).sum(-1) / _safe_denominator(divisors)).sum()


@register_loss_reduction("sequence_mean")
def sequence_mean(
    values: Tensor,
    mask: Tensor,
    *,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    max_seq_len: int | None = None,
) -> Tensor:
    """L = (1 / N_seq) sum_i [ sum_t v_{i,t} m_{i,t} / sum_t m_{i,t} ],   N_seq = B by default.

    Each response weighs the same regardless of length (the original GRPO objective).
    A row with no response tokens contributes 0 but still counts in the default B.
    `num_tokens` and `max_seq_len` are accepted and ignored.
    """
    mask = mask.to(values.dtype)
    per_row = masked_mean(values, mask, dim=-1)
    default = torch.tensor(float(values.shape[0]), dtype=values.dtype, device=values.device)
    return per_row.sum() / _as_count(num_sequences, default, values)


@register_loss_reduction("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(
    values: Tensor,
    mask: Tensor,
    *,
    num_tokens: float | None = None,
    num_sequences: float | None = None,
    max_seq_len: int | None = None,
) -> Tensor:
    """L = (1 / N_seq) sum_i [ sum_t v_{i,t} m_{i,t} / T ],   N_seq = B by default.

    Dr. GRPO's length-unbiased normaliser: every row is divided by the same constant T instead
    of its own length. T = `max_seq_len`, which the policy worker sets to SkyRL's constant
    `generator.max_input_length + generator.sampling_params.max_generate_length` (so the loss, and
    its scale, are SkyRL's and the same at every step); without it (a direct call) T =
    values.shape[-1], the padded width of the tensor passed in. `num_tokens` is accepted and
    ignored.
    """
    if max_seq_len is not None and max_seq_len < 1:
        raise ValueError(f"max_seq_len must be a positive number of tokens, got {max_seq_len}")
    mask = mask.to(values.dtype)
    width = max_seq_len if max_seq_len is not None else max(values.shape[-1], 1)
    per_row = (values * mask).sum(-1) / width
    default = torch.tensor(float(values.shape[0]), dtype=values.dtype, device=values.device)
    return per_row.sum() / _as_count(num_sequences, default, values)


@dataclass
class LossNormalizers:
    """What the losses of one optimizer step divide by, set by the worker around the step.

    num_tokens / num_sequences: the mini-batch's loss tokens and rows (summed over the ranks);
    max_seq_len: seq_mean_token_sum_norm's constant; micro_batches: how many micro-batch losses
    (over all ranks) add up to the step's loss. `reductions` counts the `reduce_loss` calls made
    inside the block, so a caller can tell whether a loss normalised itself by these counts
    (see `ridgeline.algorithms.calling`)."""

    num_tokens: float | None = None
    num_sequences: float | None = None
    max_seq_len: int | None = None
    micro_batches: int = 1
    reductions: int = 0
    # prompt_mean's divisor P * N_p(i) for each row of the micro-batch being computed (set per micro-batch)
    prompt_divisors: Tensor | None = None


_NORMALIZERS: ContextVar[LossNormalizers | None] = ContextVar("loss_normalizers", default=None)


@contextmanager
def loss_normalizers(num_tokens: float | None, num_sequences: float | None, *, max_seq_len: int | None = None,
                     micro_batches: int = 1, prompt_divisors: Tensor | None = None) -> Iterator[LossNormalizers]:
    """Within the block, `reduce_loss` divides by these mini-batch counts instead of the counts of
    the micro-batch it is given (explicit arguments to `reduce_loss` still win)."""
    norms = LossNormalizers(num_tokens, num_sequences, max_seq_len, micro_batches, prompt_divisors=prompt_divisors)
    token = _NORMALIZERS.set(norms)
    try:
        yield norms
    finally:
        _NORMALIZERS.reset(token)


def current_normalizers() -> LossNormalizers | None:
    """The enclosing `loss_normalizers` block's settings, or None outside any."""
    return _NORMALIZERS.get()


def reduce_loss(values: Tensor, mask: Tensor, mode: str = "token_mean", max_seq_len: int | None = None, *,
                num_tokens: float | None = None, num_sequences: float | None = None) -> Tensor:
    """Reduce a per-token loss [B, T] with the registered reduction `mode` (`token_mean`,
    `token_mean_legacy`, `sequence_mean`, `seq_mean_token_sum_norm`, `prompt_mean`, or one a user
    registered).

    The call is SkyRL's, `reduce_loss(loss, loss_mask, loss_reduction, max_seq_len)`, so a loss
    written for SkyRL runs unchanged. Normalisers (and `max_seq_len`) not given here come from an
    enclosing `loss_normalizers(...)` block, else from `values`/`mask` themselves."""
    norms = _NORMALIZERS.get()
    if norms is None:
        norms = LossNormalizers()
    else:
        norms.reductions += 1
    return LOSS_REDUCTIONS.get(mode)(
        values, mask,
        num_tokens=norms.num_tokens if num_tokens is None else num_tokens,
        num_sequences=norms.num_sequences if num_sequences is None else num_sequences,
        max_seq_len=norms.max_seq_len if max_seq_len is None else max_seq_len)
