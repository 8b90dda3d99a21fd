"""The critic: a causal-LM backbone (the transformer without its LM head) plus a linear value head.

V(s_t) is read off the last hidden state at the position of the last token of the state, so the
value of "the state before response token t" sits at the same column P+t-1 whose logits give the
logprob of token t (see `ridgeline.training.logprobs`).

The backbone is loaded through `load_model`, so every path the policy accepts (hub id, folder,
GGUF, `pkg://`, `tiny://`, `random://`) also works for `trainer.critic.model.path`. The head lives
in the module under the name `trainer.algorithm.value_head_prefix` (state-dict keys `value_head.weight`,
`value_head.bias` by default) and is saved next to the backbone in `value_head.safetensors`; a
folder holding that file loads the trained head back, any other path starts a fresh one.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ridgeline.models.forward import enable_activation_checkpointing, model_device, positions_from_mask
from ridgeline.models.loading import ModelSpec, is_built_locally, load_model, model_folder
from ridgeline.models.lora import plain
from ridgeline.models.source import ModelLoadError

if TYPE_CHECKING:
    from ridgeline.models.lora import MaybeAdapted

log = logging.getLogger(__name__)

VALUE_HEAD_FILE = "value_head.safetensors"


class ValueModel(torch.nn.Module):
    """backbone(input) -> hidden [B, S, H] -> head -> values [B, S] (float32)."""

    def __init__(self, backbone: MaybeAdapted, head: torch.nn.Linear, value_head_prefix: str = "value_head"):
        super().__init__()
        if not value_head_prefix.isidentifier() or value_head_prefix == "backbone":
            raise ValueError(f"value_head_prefix must be a Python identifier other than 'backbone', "
                             f"got {value_head_prefix!r}")
        self.backbone: MaybeAdapted = backbone   # a LoRA critic's: wrapped by peft (ridgeline.models.lora.wrap)
        self.value_head_prefix = value_head_prefix
        setattr(self, value_head_prefix, head)

    @property
    def head(self) -> torch.nn.Linear:
        return getattr(self, self.value_head_prefix)

    @property
    def config(self):
        return self.backbone.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = positions_from_mask(attention_mask)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state
        # a copy, not a view of the head's [B, T, 1] output: FSDP2 hooks backward onto a root
        # module's output and warns that in-place ops on a view would bypass it
        return self.values_from_hidden(hidden).clone()

    def values_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head on backbone states `[..., H]` -> values `[...]` float32; the packed forward
        (`ridgeline.training.forward_path.micro_values`) runs the backbone itself and comes here.
        The head stays float32 even under bf16 autocast: it is tiny, and value targets need the
        precision (bf16 has ~3 significant digits)."""
        with _autocast_off(hidden.device.type):
            return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()

    def enable_activation_checkpointing(self, use_reentrant: bool = False) -> None:
        enable_activation_checkpointing(self.backbone, use_reentrant)

    def save_pretrained(self, folder: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """The backbone in Hugging Face format plus `value_head.safetensors`; `load_value_model`
        on the folder gives the same values back. `state_dict`: this module's weights to write
        instead of its own (the gathered full weights of a sharded critic; a LoRA critic's merged
        weights, under the plain backbone's names)."""
        folder = Path(folder)
        if state_dict is None:
            backbone, head = None, self.head.state_dict()
        else:
            backbone = {k[len("backbone."):]: v for k, v in state_dict.items() if k.startswith("backbone.")}
            prefix = f"{self.value_head_prefix}."
            head = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        plain(self.backbone).save_pretrained(folder, state_dict=backbone)  # a LoRA backbone: its merged weights
        save_value_head(folder, {f"{self.value_head_prefix}.{k}": v for k, v in head.items()})


def save_value_head(folder: str | Path, head: dict[str, torch.Tensor]) -> None:
    """`value_head.safetensors`: the head's tensors under the value model's names
    (`<value_head_prefix>.weight`, `.bias`)."""
    save_file({k: v.detach().contiguous().cpu() for k, v in head.items()}, str(Path(folder) / VALUE_HEAD_FILE))


def _autocast_off(device_type: str):
    if device_type not in ("cpu", "cuda"):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, enabled=False)


def response_values(model: ValueModel, sequences: torch.Tensor, attention_mask: torch.Tensor,
                    response_width: int, device: torch.device | None = None) -> torch.Tensor:
    """V(state before response token t) for the last `response_width` tokens of each
    `[prompt | response]` row: the head output at columns P-1 .. P+R-2, [B, R] float32.

    These are the columns whose logits give the response logprobs, so values, logprobs and the
    per-token masks all line up. Padded response columns hold meaningless values: mask them."""
    prompt_width = sequences.shape[1] - response_width
    if prompt_width < 1:
        raise ValueError("response_values needs at least one prompt column: the value of the first "
                         "response token is read at the last prompt position")
    device = device or model_device(model)  # the parameters' device unless the caller names it (FSDP offload)
    sequences, attention_mask = sequences.to(device), attention_mask.to(device)
    values = model(sequences, attention_mask, positions_from_mask(attention_mask))
    return values[:, prompt_width - 1:prompt_width - 1 + response_width]


def _fresh_head(hidden_size: int, seed: int) -> torch.nn.Linear:
    """N(0, 1/(H+1)) weights and a zero bias: initial values are near 0 whatever the backbone.
    Drawn from a private generator so the caller's RNG stream is left alone."""
    head = torch.nn.Linear(hidden_size, 1)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator) / (hidden_size + 1))
        head.bias.zero_()
    return head


def _saved_head_file(spec: ModelSpec) -> Path | None:
    if is_built_locally(spec):
        return None
    path = Path(model_folder(spec)) / VALUE_HEAD_FILE
    return path if path.is_file() else None


def load_value_model(spec: ModelSpec, dtype: torch.dtype = torch.float32,
                     tokenizer: PreTrainedTokenizerBase | None = None,
                     value_head_prefix: str = "value_head") -> ValueModel:
    """Backbone of `load_model(spec)` (its LM head dropped) plus a value head: the saved one if the
    model folder holds `value_head.safetensors`, else a fresh one seeded by `spec.seed`. The
    backbone has `dtype`; the head is float32."""
    backbone = load_model(spec, dtype=dtype, tokenizer=tokenizer).get_decoder()
    hidden_size = backbone.config.get_text_config().hidden_size
    head = _fresh_head(hidden_size, spec.seed)
    saved = _saved_head_file(spec)
    if saved is not None:
        state = load_file(str(saved))
        prefix = f"{value_head_prefix}."
        picked = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if set(picked) != {"weight", "bias"}:
            raise ModelLoadError(f"{spec.config_key}={spec.path}: {saved} holds {sorted(state)}, not {prefix}weight / "
                                 f"{prefix}bias (trainer.algorithm.value_head_prefix={value_head_prefix!r}). Fix: "
                                 "trainer.algorithm.value_head_prefix=<the prefix of its keys>")
        head.load_state_dict({k: v.float() for k, v in picked.items()})
        log.info("loaded value head from %s", saved)
    return ValueModel(backbone, head.to(backbone.device), value_head_prefix)
