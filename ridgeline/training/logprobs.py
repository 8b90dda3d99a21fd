"""Per-token logprobs and entropy of the response part of `[prompt | response]` rows."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ridgeline.models.forward import (activation_checkpointing_on, cache_kwargs, model_device, output_cache,
                                      positions_from_mask)
from ridgeline.training.lm_head import lm_head_logprobs

if TYPE_CHECKING:
    from ridgeline.models.lora import MaybeAdapted


def prompt_groups(model: torch.nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                  response_width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(distinct `[prompt ids | prompt mask]` rows, index of each row's prompt among them) when the
    shared-prompt forward applies to these rows, else None: it needs a prompt, at least two rows
    with the same prompt, and a KV cache (under activation checkpointing transformers runs without
    one). The single statement of that condition: `response_logprobs` and the forward-path choice
    (`ridgeline.training.forward_path`) both ask it. A host-side plan: it runs on the CPU (the
    grouping has a data-dependent size) and the caller moves the result to the model's device."""
    prompt_width = sequences.shape[1] - response_width
    if prompt_width == 0 or (model.training and activation_checkpointing_on(model)):
        return None
    prompts = torch.cat([sequences[:, :prompt_width], attention_mask[:, :prompt_width]], dim=-1).cpu()
    unique, inverse = torch.unique(prompts, dim=0, return_inverse=True)
    return None if unique.shape[0] == sequences.shape[0] else (unique, inverse)


def response_logprobs(model: MaybeAdapted, sequences: torch.Tensor, attention_mask: torch.Tensor,
                      response_width: int, temperature: float = 1.0, with_entropy: bool = False,
                      share_prompts: bool = True, device: torch.device | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(token_t | prefix) for the last `response_width` tokens of each row, under
    softmax(logits / temperature) — the same distribution the engine sampled from.

    Position ids come from the attention mask so left padding does not shift positions; only the
    logits of response positions are materialised (the vocabulary is large, the response short).

    share_prompts: GRPO rows come in groups with the same prompt. The distinct prompts run once,
    their keys/values are fanned out to every row of the group, and only the response tokens run
    per row; gradients flow back through the fan-out, so the result (values and gradients) is that
    of the plain forward, with prompt compute divided by the group size. Under gradient
    checkpointing transformers runs without a KV cache, so the plain forward is used
    (`prompt_groups` says when the shared forward applies).

    The inputs may live anywhere: the plan is made on the CPU, the forward runs on `device` (default:
    the parameters' device; FSDP2 with CPU offload keeps parameters on the host and computes on the
    GPU, so its workers name the device), and the results stay there."""
    prompt_width = sequences.shape[1] - response_width
    groups = prompt_groups(model, sequences, attention_mask, response_width) if share_prompts else None
    device = device or model_device(model)
    sequences, attention_mask = sequences.to(device), attention_mask.to(device)
    positions = positions_from_mask(attention_mask)
    if groups is None:
        out = model.get_decoder()(input_ids=sequences, attention_mask=attention_mask, position_ids=positions,
                                  use_cache=False)
        hidden = out.last_hidden_state[:, -response_width - 1:-1]
    else:
        unique, inverse = (t.to(device) for t in groups)
        hidden = _shared_prompt_hidden(model, unique[:, :prompt_width], unique[:, prompt_width:], inverse,
                                       sequences[:, prompt_width:], attention_mask, positions[:, prompt_width:])
    # the LM head only at the response's predicting positions, a vocabulary chunk at a time
    return lm_head_logprobs(model, hidden, sequences[:, -response_width:], temperature, with_entropy)


def _shared_prompt_hidden(model: MaybeAdapted, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                          inverse: torch.Tensor, response_ids: torch.Tensor, attention_mask: torch.Tensor,
                          response_positions: torch.Tensor) -> torch.Tensor:
    """Last hidden states [B, R, H] at the positions predicting each response token: the prompt's
    last position (run once per distinct prompt, then fanned out), then the response positions
    0..R-2 attending to the fanned-out prompt cache."""
    decoder = model.get_decoder()
    out = decoder(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions_from_mask(prompt_mask),
                  use_cache=True)
    cache = output_cache(out)
    cache.reorder_cache(inverse)  # index_select per layer: differentiable
    first = out.last_hidden_state[inverse, -1:]   # [B, 1, H]
    if response_ids.shape[1] == 1:
        return first
    rest = decoder(input_ids=response_ids[:, :-1], attention_mask=attention_mask[:, :-1],
                   position_ids=response_positions[:, :-1], use_cache=True, **cache_kwargs(cache)).last_hidden_state
    return torch.cat([first, rest], dim=1)
