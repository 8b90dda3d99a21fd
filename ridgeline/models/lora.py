"""LoRA adapters on the policy, through peft (`trainer.policy.model.lora.*`, docs/lora.md).

With `lora.rank > 0` the policy model is wrapped by `peft.get_peft_model`: the base weights stay
frozen in float32 and only the adapters (A, B per targeted layer, float32) train. What the rest of
Ridgeline needs from a LoRA policy is here:

- `merged_named_parameters` / `merged_state_dict`: the weights W + scaling * B @ A under the base
  model's own names, computed per layer into new tensors. The training weights are never merged in
  place (peft's `merge_adapter` / `unmerge_adapter`): W + D - D is not W in floating point, and one
  merge per weight sync would drift the frozen base over a run.
- `merged_copy`: a plain transformers model holding the merged weights (what an embedded engine
  starts from).
- `save_adapter` / `load_adapter`: the adapters as peft writes them (`adapter_model.safetensors`,
  `adapter_config.json`), so a checkpoint also loads with `PeftModel.from_pretrained`.
- `save_merged`: the weights of a Hugging Face folder of the merged model, loadable by plain transformers;
  `load_merged`: a base model with saved adapters merged in (exports and eval of a checkpoint).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from ridgeline.models.loading import save_hf_weights

# peft is imported where it is used: importing it loads transformers' model zoo (~3 s of every
# start-up here), which runs without LoRA never need.
if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel
    from peft.tuners.lora import LoraLayer

log = logging.getLogger(__name__)

ADAPTER_WEIGHTS = "adapter_model.safetensors"   # peft's file names (peft.utils.constants)
ADAPTER_CONFIG = "adapter_config.json"

# `lora.init_method` -> peft's `init_lora_weights`. SkyRL's "kaiming" is peft's default (True: A
# kaiming-uniform, B = 0); "gaussian" draws A from N(0, 1/rank), B = 0; "orthogonal" makes B @ A = 0
# from two orthogonal halves (even ranks). All three leave the base weights untouched and start as
# the base model; peft's initialisations that rewrite the base (pissa, olora, ...) or need a data
# pass (eva, ...) are refused by validation (ridgeline.config.schema.trainer.LORA_INIT_REFUSED).
PEFT_INIT: dict[str, bool | str] = {"kaiming": True, "gaussian": "gaussian", "orthogonal": "orthogonal"}


@dataclass(frozen=True)
class LoraSettings:
    """`trainer.policy.model.lora` (validated by ridgeline.config.schema.trainer.LoraConfig)."""
    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    # "all-linear" (every linear layer but the output head, peft's shorthand) or module names
    target_modules: str | tuple[str, ...] = "all-linear"
    # modules left without adapters: names (exact or suffix), or one regex (a string); None = none
    exclude_modules: str | tuple[str, ...] | None = None
    init_method: str = "kaiming"   # a key of PEFT_INIT

    def peft_config(self) -> LoraConfig:
        from peft import LoraConfig
        # passed only when set: peft before 0.14 has no exclude_modules
        exclude = {} if self.exclude_modules is None else {"exclude_modules": _plain(self.exclude_modules)}
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=_plain(self.target_modules), init_lora_weights=PEFT_INIT[self.init_method],
                          bias="none", task_type="CAUSAL_LM", **exclude)


def _plain(modules: str | tuple[str, ...]) -> str | list[str]:
    return modules if isinstance(modules, str) else list(modules)


def lora_settings(cfg: Any) -> LoraSettings | None:
    """The LoRA settings of a run config; None when `trainer.policy.model.lora.rank` is 0 (off)."""
    lora = cfg.trainer.policy.model.lora
    if int(lora.rank) == 0:
        return None
    targets, exclude = lora.target_modules, lora.get("exclude_modules")
    return LoraSettings(rank=int(lora.rank), alpha=float(lora.alpha), dropout=float(lora.dropout),
                        target_modules=targets if isinstance(targets, str) else tuple(targets),
                        exclude_modules=exclude if exclude is None or isinstance(exclude, str) else tuple(exclude),
                        init_method=str(lora.get("init_method", "kaiming")))


def is_lora(model: torch.nn.Module) -> bool:
    peft = sys.modules.get("peft")  # no peft imported: no model is a PeftModel
    return peft is not None and isinstance(model, peft.PeftModel)


def wrap(model: PreTrainedModel, settings: LoraSettings, *, seed: int) -> PeftModel:
    """`model` with LoRA adapters: base weights frozen, adapters trainable in float32 (created in the
    float32 base's dtype; peft's `autocast_adapter_dtype` would lift them to float32 over a bf16
    base). B @ A = 0 for every `init_method` (PEFT_INIT), so the wrapped model starts as the base
    model. The adapters are drawn from `seed` on a forked RNG: they do not depend on, or move, the
    caller's random stream. Adapted modules named in `exclude_modules` stay plain. Call after
    activation checkpointing is set up: peft then makes the embeddings' output require grad, so
    checkpointed blocks see an input that requires grad even though every base weight is frozen."""
    from peft import get_peft_model
    with torch.random.fork_rng(devices=[]), _quiet_peft():
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, settings.peft_config(), autocast_adapter_dtype=True)
    _refuse_tied_targets(peft_model)
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in peft_model.parameters())
    log.info("LoRA rank %d, alpha %g, %s init on %s (excluding %s): %.2fM of %.1fM parameters train (%.2f%%)",
             settings.rank, settings.alpha, settings.init_method, settings.target_modules, settings.exclude_modules,
             sum(p.numel() for p in trainable) / 1e6, total / 1e6,
             100 * sum(p.numel() for p in trainable) / total)
    return peft_model


def _refuse_tied_targets(model: PeftModel) -> None:
    """An adapted weight tied to another (the output head of a model with tied embeddings) would be
    one tensor for training but two once merged: engines take tied weights once, so the update
    would reach only one of its uses."""
    names: dict[int, list[str]] = {}
    for name, p in model.get_base_model().named_parameters(remove_duplicate=False):
        names.setdefault(p.data_ptr(), []).append(name)
    for path, layer in _lora_layers(model).items():
        shared = names[layer.get_base_layer().weight.data_ptr()]
        if len(shared) > 1:
            raise ValueError(f"trainer.policy.model.lora.target_modules adapts {path}, whose weight is tied to "
                             f"{[n for n in shared if not n.startswith(path + '.')]} (tied input/output "
                             "embeddings). Fix: leave it out of target_modules (all-linear already does).")


@contextlib.contextmanager
def _quiet_peft() -> Iterator[None]:
    """peft reads transformers' deprecated `is_gradient_checkpointing` when it wraps a model."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def adapters_disabled(model: PeftModel):
    """Context in which `model` computes the frozen base model (peft's `disable_adapter`: every
    LoRA layer runs its base layer alone, so the numbers are the base model's bit for bit)."""
    return model.disable_adapter()


# -- merged weights ---------------------------------------------------------------------------
def _lora_layers(model: PeftModel) -> dict[str, LoraLayer]:
    """Module path in the base model (e.g. `model.layers.0.self_attn.q_proj`) -> its LoRA layer."""
    from peft.tuners.lora import LoraLayer
    return {name: m for name, m in model.get_base_model().named_modules() if isinstance(m, LoraLayer)}


def _merged(model: PeftModel, named: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Rename peft's `X.base_layer.W` to the base model's `X.W`, drop the adapter tensors, and put
    W + delta in place of every adapted weight (delta = peft's `get_delta_weight`, the exact term
    `merge_and_unload` adds: the result equals it bit for bit). New tensors; `model` is untouched."""
    layers = _lora_layers(model)
    adapter = model.active_adapter
    for name, tensor in named:
        path, rest = _inside(name, layers)
        if path is None:
            yield name, tensor.detach()
        elif rest.startswith("base_layer."):
            leaf = rest[len("base_layer."):]
            merged = tensor.detach()
            if leaf == "weight":
                merged = merged + layers[path].get_delta_weight(adapter).to(merged.dtype)
            yield f"{path}.{leaf}", merged
        # else: lora_A / lora_B / lora_embedding_*: adapter tensors, not part of the base model


def _inside(name: str, layers: dict[str, LoraLayer]) -> tuple[str | None, str]:
    """(path of the LoRA layer the tensor `name` belongs to, the rest of its name), or (None, name)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        path = ".".join(parts[:i])
        if path in layers:
            return path, ".".join(parts[i:])
    return None, name


@torch.no_grad()
def merged_named_parameters(model: PeftModel) -> Iterator[tuple[str, torch.Tensor]]:
    """The merged weights as an engine takes them: the base model's `named_parameters()` names
    (tied weights once), one tensor computed at a time."""
    yield from _merged(model, model.get_base_model().named_parameters())


@torch.no_grad()
def merged_state_dict(model: PeftModel) -> dict[str, torch.Tensor]:
    """The merged weights as the plain base model's `state_dict()` (tied names included)."""
    return dict(_merged(model, iter(model.get_base_model().state_dict().items())))


def merged_copy(model: PeftModel) -> PreTrainedModel:
    """A plain transformers model (no peft layers) with the merged weights; `model` is untouched."""
    plain = copy.deepcopy(model).merge_and_unload()
    plain.requires_grad_(False)
    return plain


def save_merged(model: PeftModel, folder: Path) -> None:
    """The model part of a Hugging Face folder of the merged model (`AutoModelForCausalLM.
    from_pretrained` loads it, no peft needed): the base model's config and the merged weights
    under its names."""
    save_hf_weights(model.get_base_model(), Path(folder), state_dict=merged_state_dict(model))


# -- adapters on disk ---------------------------------------------------------------------------
def is_adapter_folder(folder: Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def save_adapter(model: PeftModel, folder: Path) -> None:
    """`adapter_model.safetensors` + `adapter_config.json`, as `PeftModel.save_pretrained` writes
    them (without its README model card)."""
    from peft import get_peft_model_state_dict
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    save_file(state, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    model.peft_config[model.active_adapter].save_pretrained(str(folder))


def load_adapter(model: PeftModel, folder: Path) -> None:
    """Copy the adapters saved in `folder` into `model` in place (the optimizer keeps pointing at
    the same tensors). ValueError when they do not fit: another rank, alpha or set of targets."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    folder = Path(folder)
    saved = json.loads((folder / ADAPTER_CONFIG).read_text())
    ours = model.peft_config[model.active_adapter]
    for key, now in (("r", ours.r), ("lora_alpha", ours.lora_alpha)):
        if saved.get(key) != now:
            raise ValueError(f"the adapters in {folder} have {key}={saved.get(key)}, this model {now}")
    state = load_file(str(folder / ADAPTER_WEIGHTS))
    expected = set(get_peft_model_state_dict(model))
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(f"the adapters in {folder} target other modules: missing {missing[:3]}, "
                         f"unexpected {extra[:3]}")
    set_peft_model_state_dict(model, state)


def load_merged(base: PreTrainedModel, folder: Path) -> PreTrainedModel:
    """`base` with the adapters saved in `folder` merged into its weights by peft's own loader and
    `merge_and_unload`: a plain model for exports and evaluation (never the training model, whose
    base must not be merged into)."""
    from peft import PeftModel
    with _quiet_peft():
        return PeftModel.from_pretrained(base, str(folder), is_trainable=False).merge_and_unload()
