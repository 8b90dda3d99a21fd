"""A causal-LM forward that returns logits only for the last `keep` positions, fast.

transformers' own `logits_to_keep` slices the hidden states as a non-contiguous view; on CPU,
`F.linear` on such a 3-D view falls back to a batched matmul that first expands the output
embedding to one copy per row (576 x 49152 per row for SmolLM2: a 3.6 GB copy for 64 rows, 10 s of
a 17 s generate call). Making the slice contiguous keeps it a single matmul.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast

if TYPE_CHECKING:
    from ridgeline.models.lora import MaybeAdapted

log = logging.getLogger(__name__)

# The decoder's KV-cache argument and output field: transformers 5 renamed `past_key_values` to
# `cache` (the old name still works there but warns on every run and goes in 5.40); 4.x knows only
# the old name. Passing the installed library's own name keeps runs free of that warning.
CACHE_ARG = "cache" if "cache" in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)} else "past_key_values"


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """`{CACHE_ARG: cache}`: a KV cache handed to a decoder's forward under the installed name."""
    return {CACHE_ARG: cache}


def output_cache(out: Any) -> Any:
    """The KV cache a decoder's forward returned (None when it kept none)."""
    return getattr(out, CACHE_ARG, None)


@dataclass
class ForwardOutput:
    logits: torch.Tensor          # [B, keep, V]
    cache: Any = None             # the decoder's KV cache when `use_cache=True`


def model_device(model: torch.nn.Module) -> torch.device:
    """Where a model computes: the device of its parameters (of a sharded parameter's local shard
    under FSDP2). Functions that take inputs from anywhere move them there."""
    return next(model.parameters()).device


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that ignore left padding: the first real token of each row is position 0."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def forward_last_logits(model: PreTrainedModel, keep: int, **inputs: Any) -> ForwardOutput:
    """`model(**inputs)` restricted to the logits of the last `keep` positions."""
    out = model.get_decoder()(**inputs)
    hidden = out.last_hidden_state[:, -keep:].contiguous()
    logits = model.get_output_embeddings()(hidden)
    return ForwardOutput(logits=logits, cache=output_cache(out))


def enable_activation_checkpointing(model: MaybeAdapted, use_reentrant: bool = False) -> None:
    """Recompute each decoder layer's activations in backward; `use_reentrant` is passed to
    torch.utils.checkpoint (`trainer.gradient_checkpointing_use_reentrant`, SkyRL's key; the
    non-reentrant variant is PyTorch's recommendation). transformers 5 renamed gradient
    checkpointing to activation checkpointing; 4.x has only the old name."""
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def activation_checkpointing_on(model: torch.nn.Module) -> bool:
    flag = getattr(model, "is_activation_checkpointing", None)
    return bool(flag if flag is not None else getattr(model, "is_gradient_checkpointing", False))


# SDPA's CPU kernel has a fixed cost per (row, head) block that dominates at RL's short sequences:
# forward+backward of one bf16 attention call, SmolLM2's 9 heads, 16 rows of 16 response tokens over
# 62 keys, took 14.0 ms with SDPA and 3.7 ms eager; 4 rows x 256 tokens 5.6 vs 4.0 ms; 2 x 512
# tokens 9.6 vs 13.7 ms (SDPA ahead from there on, and eager's T x T scores grow quadratically).
# On the quickstart a policy step went from 14.8 s to 11.5 s.
EAGER_ATTENTION_MAX_TOKENS = 256


def prefer_eager_attention(model: PreTrainedModel, max_tokens: int, device: torch.device) -> bool:
    """Switch a model running SDPA that will compute on a CPU to eager attention when its sequences
    are at most EAGER_ATTENTION_MAX_TOKENS long (the training forward; values agree to float
    rounding). True when it switched."""
    config = getattr(model, "config", None)
    if device.type != "cpu" or max_tokens > EAGER_ATTENTION_MAX_TOKENS or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation("eager")
    return True


def flash_attention_available() -> bool:
    """FlashAttention-2 is a separate CUDA package (`pip install flash-attn`)."""
    import importlib.util
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def select_attention(model: PreTrainedModel, device: torch.device, max_tokens: int, flash_attn: bool) -> str:
    """The attention kernel of a training model (`trainer.flash_attn`, SkyRL's key): on CUDA,
    FlashAttention-2 when asked for and installed, else SDPA (PyTorch's fused kernels, which pick
    their own flash / memory-efficient backend); on a CPU, SDPA, or eager for short rows
    (`prefer_eager_attention`). Returns the implementation the model now runs."""
    if device.type == "cuda" and flash_attn and flash_attention_available():
        model.set_attn_implementation("flash_attention_2")
    elif device.type == "cuda" and flash_attn:
        log.info("trainer.flash_attn=true but the flash-attn package is not installed: PyTorch's SDPA runs instead "
                 "(pip install flash-attn, or trainer.flash_attn=false to silence this)")
    else:
        prefer_eager_attention(model, max_tokens, device)
    return getattr(model.config, "_attn_implementation", None) or "eager"
