"""Token logprobs (and entropy) straight from hidden states, the LM head applied a vocabulary chunk
at a time: the fused linear + log-softmax of the training forward.

The plain way, `logits = head(h).float(); log_softmax(logits / T)[target]`, materialises `[N, V]`
logits (49k wide for SmolLM2) and then about eight more tensors that size for the temperature,
logsumexp, gather, softmax and entropy, forward and backward. On a CPU those passes, and the page
faults of allocating each 50 MB temporary afresh, cost more than the head's matmul: 3 of 18 s of a
quickstart training step (torch profiler, docs/benchmarks.md). Here nothing larger than `[N, chunk]`
exists:

  forward   for each vocabulary chunk c: z_c = (h W_c^T) / T, in the compute dtype then fp32; keep a
            running max m, s = sum exp(z - m) and (for the entropy) t = sum exp(z - m) z; pick the
            target's logit. log Z = m + log s, logprob = z_target - log Z, entropy = log Z - t / s.
  backward  recompute z_c; with p = exp(z - log Z),
              d logprob / d z_k = [k = target] - p_k,     d entropy / d z_k = -p_k (z_k - log Z + H),
            g_z = g_lp (onehot - p) + g_H d H / d z, g_logits = g_z / T;
            grad h += g_logits W_c, grad W_c = g_logits^T h (each chunk of grad W written once).

The head's matmul runs one extra time (recomputed in backward), which the saved passes repay many
times over. Numerics follow the plain path: the matmul in the autocast dtype (bf16 under autocast),
everything after it in fp32, the gradients cast back through the compute dtype.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

# elements of one [N, chunk] fp32 block: 8 MB, so a chunk's logits stay in cache between passes
CHUNK_ELEMENTS = 1 << 21
MIN_CHUNK = 1024


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype `F.linear(hidden, weight)` would compute in here: autocast's when it is on."""
    device = hidden.device.type
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device):  # the devices autocast knows
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def chunk_size(rows: int, vocab: int) -> int:
    return min(vocab, max(MIN_CHUNK, CHUNK_ELEMENTS // max(1, rows)))


class OutputEmbeddings(Protocol):
    """What the head's logprobs read of a model: a transformers causal LM, peft's wrapper of one."""

    def get_output_embeddings(self) -> nn.Module | None: ...


def fused_head_weight(model: OutputEmbeddings) -> torch.Tensor | None:
    """W of a plain bias-free linear output embedding with no logit post-processing (Gemma-2's
    soft cap, logit scales), whose head is exactly `h W^T`; None for any other head."""
    head = model.get_output_embeddings()
    config = getattr(model, "config", None)
    post = any(getattr(config, key, None) for key in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
    return head.weight if isinstance(head, nn.Linear) and head.bias is None and not post else None


def supports_fused_head(model: OutputEmbeddings) -> bool:
    return fused_head_weight(model) is not None


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 after a bf16/fp16/fp32 matmul (as the plain path's `.float()`), fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, start: int, stop: int, temperature: float) -> torch.Tensor:
    """z = h W[start:stop]^T / T; `h` and `w` already in the compute dtype."""
    z = (h @ w[start:stop].T).to(accumulation_dtype(h.dtype))
    if temperature > 0 and temperature != 1.0:
        z.div_(temperature)
    return z


class _ChunkedHeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                with_entropy: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # one cast of the head to the compute dtype (what autocast's F.linear does), kept for backward
        h, w = hidden.to(dtype), weight.to(dtype)
        rows, vocab = h.shape[0], weight.shape[0]
        chunk = chunk_size(rows, vocab)
        device, acc = h.device, accumulation_dtype(dtype)
        running_max = torch.full((rows,), float("-inf"), device=device, dtype=acc)
        sum_exp = torch.zeros(rows, device=device, dtype=acc)        # s = sum e^(z-m)
        sum_exp_shift = torch.zeros(rows, device=device, dtype=acc)  # u = sum e^(z-m) (z-m)
        target_logit = torch.zeros(rows, device=device, dtype=acc)
        for start in range(0, vocab, chunk):
            stop = min(vocab, start + chunk)
            z = _chunk_logits(h, w, start, stop, temperature)
            inside = (targets >= start) & (targets < stop)
            picked = z.gather(1, (targets - start).clamp(0, stop - start - 1)[:, None]).squeeze(1)
            target_logit = torch.where(inside, picked, target_logit)
            new_max = torch.maximum(running_max, z.max(dim=1).values)
            rescale = torch.exp(running_max - new_max)          # 0 on the first chunk
            shift = z.sub_(new_max[:, None])                    # z - m, in place
            e = torch.exp(shift)
            if with_entropy:
                # move u to the new max: e^(z-m') (z-m') = r e^(z-m) (z-m + m-m'), r = e^(m-m')
                moved = torch.where(sum_exp > 0, sum_exp_shift + (running_max - new_max) * sum_exp, 0.0)
                sum_exp_shift = rescale * moved + (e * shift).sum(1)
            sum_exp = sum_exp * rescale + e.sum(1)
            running_max = new_max
        log_z = running_max + torch.log(sum_exp)
        logprobs = target_logit - log_z
        # H = log Z - E_p[z] = log s - u / s
        entropy = torch.log(sum_exp) - sum_exp_shift / sum_exp if with_entropy else torch.zeros_like(log_z)
        ctx.save_for_backward(hidden, w, targets, log_z, entropy)
        ctx.weight_dtype = weight.dtype
        ctx.temperature, ctx.with_entropy, ctx.dtype, ctx.chunk = temperature, with_entropy, dtype, chunk
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor):
        hidden, w, targets, log_z, entropy = ctx.saved_tensors
        temperature, dtype, chunk = ctx.temperature, ctx.dtype, ctx.chunk
        h = hidden.to(dtype)
        rows, vocab = h.shape[0], w.shape[0]
        scale = 1.0 / temperature if temperature > 0 and temperature != 1.0 else 1.0
        acc = accumulation_dtype(dtype)
        g_lp = grad_logprobs.to(acc)[:, None]
        g_ent = grad_entropy.to(acc)[:, None] if ctx.with_entropy else None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros(rows, h.shape[1], device=h.device, dtype=acc) if need_h else None
        grad_weight = torch.empty(w.shape, dtype=ctx.weight_dtype, device=w.device) if need_w else None
        for start in range(0, vocab, chunk):
            stop = min(vocab, start + chunk)
            log_p = _chunk_logits(h, w, start, stop, temperature).sub_(log_z[:, None])
            p = torch.exp(log_p)
            if g_ent is None:
                g_z = p.mul_(-g_lp)                              # -g_lp p
            else:                                                # -p (g_lp + g_H (log p + H))
                g_z = log_p.add_(entropy[:, None]).mul_(g_ent).add_(g_lp).mul_(p).neg_()
            # + g_lp at each row's target when it falls in this chunk; a masked scatter rather than
            # `nonzero()`, which would wait for the GPU once per chunk
            in_chunk = (targets >= start) & (targets < stop)
            column = (targets - start).clamp(0, stop - start - 1)[:, None]
            g_z.scatter_add_(1, column, torch.where(in_chunk[:, None], g_lp, torch.zeros_like(g_lp)))
            if scale != 1.0:
                g_z.mul_(scale)
            g_logits = g_z.to(dtype)
            if grad_hidden is not None:
                grad_hidden += g_logits @ w[start:stop]
            if grad_weight is not None:
                grad_weight[start:stop] = g_logits.T @ h
        return (grad_hidden.to(hidden.dtype) if grad_hidden is not None else None, grad_weight, None, None, None, None)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature) at `targets` (`logits` [..., V], `targets` [...]), and
    the entropy of that distribution when asked. The plain (materialised-logits)
    computation: the reference `lm_head_logprobs` is tested against, and its path for other heads."""
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    log_z = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, targets[..., None]).squeeze(-1) - log_z
    entropy = None
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = log_z - (probs * logits).sum(-1)
    return logprobs, entropy


def lm_head_logprobs(model: OutputEmbeddings, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                     with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(head(hidden) / temperature) at `targets` ([..., H] and [...]), and the entropy of
    that distribution when asked: the numbers of `logprobs.token_logprobs(head(hidden).float(), ...)`
    without the `[..., V]` logits (module docstring). Models whose head is more than `h W^T`
    take that plain path."""
    weight = fused_head_weight(model)
    if weight is None:
        head = model.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(model).__name__} has no output embedding (LM head) to score tokens with")
        return token_logprobs(head(hidden).float(), targets, temperature, with_entropy)
    shape = targets.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    logprobs, entropy = _ChunkedHeadLogprobs.apply(flat_hidden, weight, targets.reshape(-1), float(temperature),
                                                   bool(with_entropy), compute_dtype(flat_hidden, weight))
    return logprobs.view(shape), entropy.view(shape) if with_entropy else None
