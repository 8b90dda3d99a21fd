"""What the engines built on another library (vLLM, SGLang) share: config helpers, the context
length rule, the model config overrides, weight batches, and a base class for `from_config` and the
asleep check. The context-length rule is explained in `ridgeline.inference.vllm_engine`'s docstring.

Model config overrides (`trainer.policy.model_config_kwargs` with `generator.rope_scaling` /
`rope_theta`): the engine loads the model folder as it is (tiny:// and random:// models are written
without overrides) and receives the config attributes the overrides change, as
`config_overrides.changed_attributes` computes them on the folder's config (on transformers 5 the RoPE
ones arrive as one `rope_parameters` dict): vLLM's `hf_overrides`, SGLang's
`json_model_override_args`. Both patch the config with `config.update(...)`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TYPE_CHECKING

import torch

from ridgeline.inference.types import WAKE_TAGS, EngineError, MemoryTag, wake_order

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema import RidgelineConfig

# Weights cross from this process to vLLM's engine core and workers in batches of at most this many bytes
# (each batch is one collective_rpc message, held in memory twice while in flight).
UPDATE_BATCH_BYTES = 512 * 1024 * 1024


def missing_package_error(backend: str, package: str, cause: BaseException) -> EngineError:
    return EngineError(
        f"generator.backend={backend} needs the `{package}` package, which cannot be imported here "
        f"({type(cause).__name__}: {cause}). Fix: pip install 'ridgeline[{backend}]' (on a CUDA "
        f"machine), or use the embedded engine: generator.backend=hf")


def model_dtype_name(model_dtype: str) -> str:
    """`generator.model_dtype` (bf16, bfloat16, fp32, ...) as the name both engines accept."""
    from ridgeline.models.loading import DTYPES

    if model_dtype not in DTYPES:
        raise EngineError(f"generator.model_dtype={model_dtype!r} is not a dtype Ridgeline knows. "
                          f"Fix: one of {', '.join(sorted(DTYPES))}")
    return str(DTYPES[model_dtype]).removeprefix("torch.")


def engine_torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of an engine's `dtype` kwarg; Ridgeline casts synced weights to it, so
    "auto" (the engine picks from the checkpoint) is refused."""
    from ridgeline.models.loading import DTYPES

    dtype = DTYPES.get(name, getattr(torch, name, None))
    if not isinstance(dtype, torch.dtype):
        raise EngineError(f"engine dtype {name!r} is not a torch dtype (Ridgeline casts weight updates to it). "
                          "Fix: drop dtype from generator.engine_init_kwargs and set generator.model_dtype")
    return dtype


def max_model_len(cfg: RidgelineConfig) -> int:
    """Longest sequence one engine call can hold (see the module docstring)."""
    g = cfg.generator
    longest_input = max(int(cfg.trainer.max_prompt_length), int(g.max_input_length))
    longest_output = max(int(g.sampling_params.max_generate_length), int(g.eval_sampling_params.max_generate_length))
    return longest_input + longest_output


def engine_init_kwargs(cfg: RidgelineConfig) -> dict[str, Any]:
    """A copy of `generator.engine_init_kwargs` (the user's map of engine kwargs)."""
    return dict(cfg.generator.engine_init_kwargs)


def uses_stop_strings(cfg: RidgelineConfig) -> bool:
    """Whether training or eval sampling has stop strings (`generator.*sampling_params.stop`): vLLM
    and SGLang match them on detokenized text, so the engine must then load the tokenizer."""
    g = cfg.generator
    return any(bool(block.stop) for block in (g.sampling_params, g.eval_sampling_params))


def policy_model_folder(cfg: RidgelineConfig) -> str:
    from ridgeline.models.loading import engine_model_folder, engine_spec

    return engine_model_folder(engine_spec(cfg))


def engine_config_overrides(cfg: RidgelineConfig) -> dict[str, Any]:
    """The config attributes the engine's overrides change (module docstring); {} without any."""
    from transformers import AutoConfig

    from ridgeline.models.config_overrides import changed_attributes
    from ridgeline.models.loading import engine_spec

    spec = engine_spec(cfg)
    if not spec.config_overrides:
        return {}
    return changed_attributes(AutoConfig.from_pretrained(policy_model_folder(cfg)), spec.config_overrides)


def with_config_overrides(kwargs: dict[str, Any], cfg: RidgelineConfig, kwarg: str,
                          encode: Callable[[dict[str, Any]], Any] = lambda d: d) -> dict[str, Any]:
    """`kwargs` plus the engine's config overrides under `kwarg` (hf_overrides, json_model_override_args);
    refused when generator.engine_init_kwargs sets that kwarg too, as one would silently replace the other."""
    overrides = engine_config_overrides(cfg)
    if not overrides:
        return kwargs
    if kwarg in engine_init_kwargs(cfg):
        raise EngineError(f"generator.engine_init_kwargs.{kwarg} and the model config overrides "
                          f"(trainer.policy.model_config_kwargs, generator.rope_scaling / rope_theta: {overrides}) "
                          f"both set the engine's {kwarg}. Fix: keep one of them")
    return {**kwargs, kwarg: encode(overrides)}


def eos_token_ids(folder: str, tokenizer=None) -> tuple[int, ...]:
    """End-of-sequence ids the engine must stop on: `eos_token_id` of the folder's
    generation_config.json and config.json, plus the tokenizer's (the embedded engine's rule).

    Passed as explicit stop ids because with `skip_tokenizer_init` neither engine knows the
    tokenizer's eos token."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = Path(folder) / name
        if not path.is_file():
            continue
        value = json.loads(path.read_text()).get("eos_token_id")
        ids.update(value if isinstance(value, list) else [value] if value is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(int(i) for i in ids))


def model_context_length(folder: str, overrides: dict[str, Any] | None = None) -> int | None:
    """`max_position_embeddings` from the folder's config.json (text_config for multimodal
    configs) with `overrides` (engine_config_overrides) applied; None for a hub id or a config
    without it (the engine then judges alone). RoPE scaling lengthens it as vLLM counts it: YaRN to
    factor x original_max_position_embeddings, linear and dynamic to factor x the length."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    return context_length_of({**json.loads(path.read_text()), **(overrides or {})})


def context_length_of(config: dict[str, Any]) -> int | None:
    """A model config's context as vLLM counts it (see `model_context_length`); None without
    `max_position_embeddings`."""
    value = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    if not value:
        return None
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    factor = rope.get("factor")
    kind = rope.get("rope_type", rope.get("type"))
    if factor and kind == "yarn":
        return int(factor * (rope.get("original_max_position_embeddings") or value))
    if factor and kind in ("linear", "dynamic"):
        return int(factor * value)
    return int(value)


def check_context_fits(cfg: RidgelineConfig, length_key: str, folder: str) -> None:
    """Refuse a derived context longer than the model's, naming the keys that made it, unless the
    user set the engine's length kwarg themselves (then the engine decides)."""
    if length_key in engine_init_kwargs(cfg):
        return
    model_len, wanted = model_context_length(folder, engine_config_overrides(cfg)), max_model_len(cfg)
    if model_len is None or wanted <= model_len:
        return
    raise EngineError(
        f"the engine context would be {wanted} tokens = max(trainer.max_prompt_length, "
        f"generator.max_input_length) + max(generator.sampling_params / eval_sampling_params "
        f".max_generate_length), but the model holds {model_len} (max_position_embeddings). Fix: lower "
        f"those lengths, or set +generator.engine_init_kwargs.{length_key}={model_len} to cut rollouts there")


def tensor_batches(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                   max_bytes: int = UPDATE_BATCH_BYTES,
                   device: str | None = "cpu", copy: bool = False) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """(name, tensor) pairs cast to the engine dtype (floating tensors only), detached,
    contiguous and on `device` (None: where they are), in batches of at most `max_bytes` (a
    larger tensor goes alone). `copy`: every tensor is a fresh copy, never the caller's memory (an
    engine that re-sends the batch to another process needs that: torch refuses to share again a
    CUDA tensor this process received by IPC, as the colocated weight handoff's views are)."""
    batch: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        t = tensor.detach().to(device=device or tensor.device,
                               dtype=dtype if tensor.is_floating_point() else tensor.dtype,
                               copy=copy, memory_format=torch.contiguous_format)
        if batch and size + t.nbytes > max_bytes:
            yield batch
            batch, size = [], 0
        batch.append((name, t))
        size += t.nbytes
    if batch:
        yield batch




class LibraryEngine:
    """Base of `VLLMEngine` and `SGLangEngine`: subclasses name their config mapping, the kwarg
    holding the model folder and the one holding the context length, and how they release
    (`_release(level)`) and take back (`_resume(tags)`) device memory."""

    model_key: str = "model"
    length_key: str = "max_model_len"
    sleep_kwarg: str = "enable_sleep_mode"   # the engine kwarg that lets sleep free device memory
    _asleep_tags: tuple[MemoryTag, ...] = ()  # Ridgeline's tags (WAKE_TAGS) released right now
    _device_sleeps: bool = False   # this platform has device memory to free (not a CPU)
    # the engine's release / resume calls work: built with `sleep_kwarg` on a device, or an engine
    # whose calls also run (freeing nothing) on a CPU (SGLang's)
    _can_sleep: bool = False

    engine_kwargs: dict[str, Any]   # what the engine was built with (after the subclass's adjustments)

    @staticmethod
    def kwargs_from_config(cfg: RidgelineConfig) -> dict[str, Any]:
        """The engine's kwargs for `cfg` (the subclass's pure config mapping)."""
        raise NotImplementedError

    def __init__(self, engine_kwargs: dict[str, Any], *, eos_token_ids: Iterable[int] = ()):
        raise NotImplementedError

    @classmethod
    def from_config(cls, cfg: RidgelineConfig, tokenizer=None):
        """The engine `cfg` asks for; the tokenizer (if given) adds its eos token to the stop ids."""
        kwargs = cls.kwargs_from_config(cfg)
        check_context_fits(cfg, cls.length_key, kwargs[cls.model_key])
        return cls(kwargs, eos_token_ids=eos_token_ids(kwargs[cls.model_key], tokenizer))

    def sleep(self, level: int = 1) -> None:
        """Free the device for training (level 1 keeps the weights in host memory where the engine
        can, level 2 drops them: the next `update_weights` brings them back). On a CPU there is
        nothing to free: the engine refuses work until `wake_up`, and calls its release / resume
        only where they run there (SGLang's, freeing nothing)."""
        if level not in (1, 2):
            raise EngineError(f"sleep level must be 1 or 2, got {level}")
        if self._asleep_tags:
            return
        if self._device_sleeps and not self._can_sleep:
            raise EngineError(f"{type(self).__name__}.sleep needs {self.sleep_kwarg}, which this engine was built "
                              "without. Fix: trainer.placement.colocate_all=true (or "
                              f"+generator.engine_init_kwargs.{self.sleep_kwarg}=true)")
        if self._can_sleep:
            self._release(level)
        self._asleep_tags = WAKE_TAGS

    def wake_up(self, tags: tuple[MemoryTag, ...] = WAKE_TAGS) -> None:
        """Take back the memory of `tags` that is released, weights before the KV cache."""
        todo = tuple(t for t in wake_order(tags) if t in self._asleep_tags)
        if todo and self._can_sleep:
            self._resume(todo)
        self._asleep_tags = tuple(t for t in self._asleep_tags if t not in todo)

    def _release(self, level: int) -> None:
        raise NotImplementedError

    def _resume(self, tags: tuple[MemoryTag, ...]) -> None:
        raise NotImplementedError

    def _check_awake(self, what: str) -> None:
        if self._asleep_tags:
            raise EngineError(f"{type(self).__name__}.{what} called while asleep ({' and '.join(self._asleep_tags)} "
                              "released); call wake_up() first")
