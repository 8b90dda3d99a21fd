"""LoRA adapters through peft: on the policy (`trainer.policy.model.lora.*`) and on the critic's
backbone (`trainer.critic.model.lora.*`), in one process and on FSDP2 ranks (docs/lora.md).

With `lora.rank > 0` the model (the policy, or the critic's backbone: its value head stays a plain
layer that trains fully) is wrapped by `peft.get_peft_model`: the base weights stay frozen in
float32 and only the adapters (A, B per targeted layer, float32) train. What the rest of Ridgeline
needs from an adapted model is `AdapterLayout`, read off the module tree (so it holds for a model
sharded by FSDP2 too, whose tensor names are unchanged) and applied to state dicts (a process's
own, or the full weights gathered from the shards):

- `merged`: the weights W + scaling * B @ A under the plain model's names, computed per layer into
  new tensors, exactly peft's `get_delta_weight` (so bit for bit `merge_and_unload`). The training
  weights are never merged in place (peft's `merge_adapter` / `unmerge_adapter`): W + D - D is not
  W in floating point, and one merge per weight sync would drift the frozen base over a run.
- `save` / `read`: the adapters as peft writes them (`adapter_model.safetensors`,
  `adapter_config.json`), so a checkpoint also loads with `PeftModel.from_pretrained`.

Plus `merged_copy` (a plain model an embedded engine starts from) and `load_merged` (a base model
with saved adapters merged in: exports and eval of a checkpoint).
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
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Literal, Mapping, TypeGuard, overload

import torch
from safetensors.torch import load_file, save_file

# peft is imported where it is used: importing it loads transformers' model zoo (~3 s of every
# start-up here), which runs without LoRA never need (the config check imports this module).
if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel

    from ridgeline.config.schema import RidgelineConfig, TrainerConfig
    from ridgeline.config.schema.trainer import LoraConfig as LoraSection
    from peft.tuners.lora import LoraLayer
    from transformers import PreTrainedModel

    # a transformers model, or peft's LoRA wrapper of one (`wrap`): what a policy (or a critic's
    # backbone) is once built; peft's wrapper forwards every attribute to the model it wraps
    MaybeAdapted = PreTrainedModel | PeftModel

log = logging.getLogger(__name__)

ADAPTER_WEIGHTS = "adapter_model.safetensors"   # peft's file names (peft.utils.constants)
ADAPTER_CONFIG = "adapter_config.json"

# `lora.init_method` -> peft's `init_lora_weights`. SkyRL's "kaiming" is peft's default (True: A
# kaiming-uniform, B = 0); "gaussian" draws A from N(0, 1/rank), B = 0; "orthogonal" makes B @ A = 0
# from two orthogonal halves (even ranks). All three leave the base weights untouched and start as
# the base model; peft's initialisations that rewrite the base (pissa, olora, ...) or need a data
# pass (eva, ...) are refused by validation (ridgeline.config.schema.trainer.LORA_INIT_REFUSED).
PEFT_INIT: dict[str, bool | str] = {"kaiming": True, "gaussian": "gaussian", "orthogonal": "orthogonal"}

Role = Literal["policy", "critic"]


@dataclass(frozen=True)
class LoraSettings:
    """`trainer.<role>.model.lora` (validated by ridgeline.config.schema.trainer.LoraConfig)."""
    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    # "all-linear" (every linear layer but the output head, peft's shorthand) or module names
    target_modules: str | tuple[str, ...] = "all-linear"
    # modules left without adapters: names (exact or suffix), or one regex (a string); None = none
    exclude_modules: str | tuple[str, ...] | None = None
    init_method: str = "kaiming"   # a key of PEFT_INIT
    # peft's task: a causal LM (the policy), or None for the critic's backbone (a base model: no LM head)
    task_type: str | None = "CAUSAL_LM"
    key: str = "trainer.policy.model.lora"   # the config section, named in errors

    def peft_config(self) -> LoraConfig:
        from peft import LoraConfig
        # passed only when set: peft before 0.14 has no exclude_modules
        exclude = {} if self.exclude_modules is None else {"exclude_modules": _plain(self.exclude_modules)}
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=_plain(self.target_modules), init_lora_weights=PEFT_INIT[self.init_method],
                          bias="none", task_type=self.task_type, **exclude)

    def identity(self) -> dict[str, Any]:
        """What a resumed run must share with the checkpoint's (fingerprint.json)."""
        out: dict[str, Any] = {"rank": self.rank, "alpha": self.alpha, "target_modules": _plain(self.target_modules)}
        if self.exclude_modules is not None:
            out["exclude_modules"] = _plain(self.exclude_modules)
        return out


def _plain(modules: str | tuple[str, ...]) -> str | list[str]:
    return modules if isinstance(modules, str) else list(modules)


def lora_settings(cfg: RidgelineConfig, role: Role = "policy") -> LoraSettings | None:
    """The LoRA settings of `role` in a run config; None when its `lora.rank` is 0 (off)."""
    lora: LoraSection = cfg.trainer.policy.model.lora if role == "policy" else cfg.trainer.critic.model.lora
    if lora.rank == 0:
        return None
    targets, exclude = lora.target_modules, lora.exclude_modules
    return LoraSettings(rank=int(lora.rank), alpha=float(lora.alpha), dropout=float(lora.dropout),
                        target_modules=targets if isinstance(targets, str) else tuple(targets),
                        exclude_modules=exclude if exclude is None or isinstance(exclude, str) else tuple(exclude),
                        init_method=lora.init_method,
                        task_type="CAUSAL_LM" if role == "policy" else None, key=f"trainer.{role}.model.lora")


def reference_is_base(trainer: TrainerConfig) -> bool:
    """Whether the reference model is the LoRA policy's own frozen base (its adapters switched off,
    no model of its own): LoRA on the policy, and `trainer.ref.model.path` / `model_config_kwargs`
    at the policy's."""
    return (trainer.policy.model.lora.rank > 0 and trainer.ref.model.path == trainer.policy.model.path
            and trainer.ref.model_config_kwargs == trainer.policy.model_config_kwargs)


def is_lora(model: torch.nn.Module) -> TypeGuard[PeftModel]:
    peft = sys.modules.get("peft")  # no peft imported: no model is a PeftModel
    return peft is not None and isinstance(model, peft.PeftModel)


@overload
def plain(model: MaybeAdapted) -> PreTrainedModel: ...
@overload
def plain(model: torch.nn.Module) -> torch.nn.Module: ...
def plain(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PeftModel (its adapted layers still in place), else `model`:
    what names the plain weights and writes a Hugging Face folder of them."""
    return model.get_base_model() if is_lora(model) else model


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
    _refuse_tied_targets(peft_model, settings.key)
    _refuse_unmergeable(peft_model, settings.key)
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in peft_model.parameters())
    log.info("%s: rank %d, alpha %g, %s init on %s (excluding %s): %.2fM of %.1fM parameters train (%.2f%%)",
             settings.key, settings.rank, settings.alpha, settings.init_method, settings.target_modules,
             settings.exclude_modules, sum(p.numel() for p in trainable) / 1e6, total / 1e6,
             100 * sum(p.numel() for p in trainable) / total)
    return peft_model


def _refuse_tied_targets(model: PeftModel, key: str) -> None:
    """An adapted weight tied to another (the output head of a model with tied embeddings) would be
    one tensor for training but two once merged: engines take tied weights once, so the update
    would reach only one of its uses."""
    names: dict[int, list[str]] = {}
    for name, p in model.get_base_model().named_parameters(remove_duplicate=False):
        names.setdefault(p.data_ptr(), []).append(name)
    for path, layer in _lora_layers(model).items():
        shared = names[layer.get_base_layer().weight.data_ptr()]
        if len(shared) > 1:
            raise ValueError(f"{key}.target_modules adapts {path}, whose weight is tied to "
                             f"{[n for n in shared if not n.startswith(path + '.')]} (tied input/output "
                             "embeddings). Fix: leave it out of target_modules (all-linear already does).")


def _refuse_unmergeable(model: PeftModel, key: str) -> None:
    """The merged weights are computed for linear and embedding adapters (`_merge_rule`); peft's
    other LoRA layers (convolutions, attention modules, parameter targets) have other formulas."""
    from peft.tuners.lora import Embedding, Linear
    other = {path: type(layer).__name__ for path, layer in _lora_layers(model).items()
             if type(layer) not in (Linear, Embedding)}
    if other:
        raise ValueError(f"{key}.target_modules adapts {dict(list(other.items())[:3])}: LoRA is built for linear "
                         "and embedding layers only. Fix: target linear layers (all-linear, or names such as "
                         "[q_proj,v_proj]).")


@contextlib.contextmanager
def _quiet_peft() -> Iterator[None]:
    """peft reads transformers' deprecated `is_gradient_checkpointing` when it wraps a model."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def adapters_disabled(model: MaybeAdapted) -> contextlib.AbstractContextManager[None]:
    """Context in which `model` computes the frozen base model (peft's `disable_adapter`: every
    LoRA layer runs its base layer alone, so the numbers are the base model's bit for bit)."""
    if not is_lora(model):
        raise ValueError(f"{type(model).__name__} has no LoRA adapters to switch off")
    return model.disable_adapter()


def _lora_layers(model: PeftModel) -> dict[str, LoraLayer]:
    """Module path in the base model (e.g. `model.layers.0.self_attn.q_proj`) -> its LoRA layer."""
    from peft.tuners.lora import LoraLayer
    return {name: m for name, m in model.get_base_model().named_modules() if isinstance(m, LoraLayer)}


# -- where the adapters sit, and what they merge to ----------------------------------------------
@dataclass(frozen=True)
class _Merge:
    """One adapted layer's update: delta = transpose(B @ A) * scaling (peft's `get_delta_weight` for
    `lora.Linear`, transposed for fan-in-fan-out weights; `lora.Embedding` always transposes)."""
    a: str            # tensor names relative to the base model
    b: str
    transpose: bool
    scaling: float

    def delta(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        product = b @ a
        return (product.T if self.transpose else product) * self.scaling


@dataclass(frozen=True)
class AdapterLayout:
    """Where a worker's model holds its LoRA adapters: the PeftModel at `peft_prefix` (empty for a
    LoRA policy, `backbone.` for a LoRA critic), its base model's tensors at `inner` (e.g.
    `backbone.base_model.model.`), named `outer` + base name in the plain model (`backbone.`)."""
    peft: PeftModel
    peft_prefix: str
    inner: str
    outer: str
    merges: dict[str, _Merge]   # adapted layer path in the base model -> its update
    adapter: str

    # names ------------------------------------------------------------------------------------
    def _split(self, name: str) -> tuple[str | None, str]:
        """(the adapted layer `name` belongs to, the rest of its name) for a tensor of the base model
        (a name relative to it), or (None, name)."""
        parts = name.split(".")
        for i in range(len(parts) - 1, 0, -1):
            path = ".".join(parts[:i])
            if path in self.merges:
                return path, ".".join(parts[i:])
        return None, name

    def plain_name(self, name: str) -> str | None:
        """The plain model's name of the worker model's tensor `name` (`X.base_layer.weight` -> `X.weight`);
        None for an adapter tensor, which the plain model does not have."""
        if not name.startswith(self.inner):
            return name   # outside the adapted model: the critic's value head
        path, rest = self._split(name[len(self.inner):])
        if path is None:
            return self.outer + rest
        if rest.startswith("base_layer."):
            return f"{self.outer}{path}.{rest[len('base_layer.'):]}"
        return None

    def is_adapter(self, name: str) -> bool:
        return name.startswith(self.inner) and self.plain_name(name) is None

    # merged weights ---------------------------------------------------------------------------
    @torch.no_grad()
    def merged(self, state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """`state` (the worker model's full weights) as the plain model's: adapter tensors dropped,
        every adapted weight W + delta in a new tensor, computed one at a time; the rest as it is."""
        for name, tensor in state.items():
            plain_name = self.plain_name(name)
            if plain_name is None:
                continue
            path, rest = self._split(name[len(self.inner):]) if name.startswith(self.inner) else (None, "")
            if path is not None and rest == "base_layer.weight":
                rule = self.merges[path]
                delta = rule.delta(state[self.inner + rule.a], state[self.inner + rule.b])
                tensor = tensor.detach() + delta.to(tensor.dtype)
            yield plain_name, tensor.detach()

    # adapter files ----------------------------------------------------------------------------
    def _file_key(self, name: str) -> str:
        """peft's name in adapter_model.safetensors: relative to the PeftModel, adapter name removed
        (`get_peft_model_state_dict`'s rule)."""
        return name[len(self.peft_prefix):].replace(f".{self.adapter}", "")

    def save(self, folder: Path, state: dict[str, torch.Tensor]) -> None:
        """`adapter_model.safetensors` + `adapter_config.json` of the adapter tensors in `state`, as
        `PeftModel.save_pretrained` writes them (without its README model card)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {self._file_key(k): v.detach().contiguous().cpu() for k, v in state.items() if self.is_adapter(k)}
        save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        self.peft.peft_config[self.adapter].save_pretrained(str(folder))

    def read(self, folder: Path, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The adapters saved in `folder` under the worker model's names (`names`: its adapter tensors).
        ValueError when they do not fit: another rank, alpha or set of targets."""
        folder = Path(folder)
        saved = json.loads((folder / ADAPTER_CONFIG).read_text())
        ours = self.peft.peft_config[self.adapter]
        for key, now in (("r", ours.r), ("lora_alpha", ours.lora_alpha)):
            if saved.get(key) != now:
                raise ValueError(f"the adapters in {folder} have {key}={saved.get(key)}, this model {now}")
        state = load_file(str(folder / ADAPTER_WEIGHTS))
        expected = {self._file_key(n): n for n in names if self.is_adapter(n)}
        if set(state) != set(expected):
            missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
            raise ValueError(f"the adapters in {folder} target other modules: missing {missing[:3]}, "
                             f"unexpected {extra[:3]}")
        return {expected[k]: v for k, v in state.items()}


def adapter_layout(model: torch.nn.Module) -> AdapterLayout | None:
    """The layout of the adapters in `model` (a PeftModel, or a module holding one: the critic);
    None without LoRA."""
    if sys.modules.get("peft") is None:
        return None
    from peft.tuners.lora import Embedding
    found = [(name, m) for name, m in model.named_modules() if is_lora(m)]
    if not found:
        return None
    if len(found) > 1:
        raise ValueError(f"{type(model).__name__} holds more than one PeftModel: {[n for n, _ in found]}")
    name, peft_model = found[0]
    peft_prefix = f"{name}." if name else ""
    base = peft_model.get_base_model()
    inner = next(f"{n}." for n, m in peft_model.named_modules() if m is base)
    adapter = peft_model.active_adapter
    merges = {}
    for path, layer in _lora_layers(peft_model).items():
        if isinstance(layer, Embedding):
            merges[path] = _Merge(f"{path}.lora_embedding_A.{adapter}", f"{path}.lora_embedding_B.{adapter}",
                                  True, layer.scaling[adapter])
        else:  # lora.Linear (wrap refuses the others)
            merges[path] = _Merge(f"{path}.lora_A.{adapter}.weight", f"{path}.lora_B.{adapter}.weight",
                                  bool(layer.fan_in_fan_out), layer.scaling[adapter])
    return AdapterLayout(peft=peft_model, peft_prefix=peft_prefix, inner=peft_prefix + inner, outer=peft_prefix,
                         merges=merges, adapter=adapter)


def merged_copy(model: PeftModel) -> PreTrainedModel:
    """A plain transformers model (no peft layers) with the merged weights; `model` is untouched."""
    plain_model = copy.deepcopy(model).merge_and_unload()
    plain_model.requires_grad_(False)
    return plain_model


# -- adapters on disk ---------------------------------------------------------------------------
def is_adapter_folder(folder: Path) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def load_merged(base: PreTrainedModel, folder: Path) -> PreTrainedModel:
    """`base` with the adapters saved in `folder` merged into its weights by peft's own loader and
    `merge_and_unload`: a plain model for exports and evaluation (never the training model, whose
    base must not be merged into)."""
    from peft import PeftModel
    with _quiet_peft():
        return PeftModel.from_pretrained(base, str(folder), is_trainable=False).merge_and_unload()
