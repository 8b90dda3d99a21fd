"""Overrides of a model's Hugging Face config, applied when the model is built: SkyRL's
`trainer.{policy,ref,critic}.model_config_kwargs` and `rope_scaling` / `rope_theta` (`trainer.*`
for the training models, `generator.*` for the engines).

transformers is no guide for the edge cases: `AutoConfig.from_pretrained(path, **kwargs)` drops a
kwarg that names no attribute of the config without a word, and transformers 5 keeps RoPE in
`config.rope_parameters`, so there a `rope_theta=` kwarg alone is dropped too and `rope_scaling=`
loses the model's theta. Here each override is set on the config itself, RoPE ones through
`rope_parameters` (transformers 5) or `rope_theta` / `rope_scaling` (4.x), and one that would not
act is refused with the config key that asked for it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Mapping, Sequence, Union

from transformers import PretrainedConfig

from ridgeline.errors import UserError

# a value of a config attribute, as OmegaConf hands it over
JSONValue = Union[None, bool, int, float, str, list, dict]

ROPE_ATTRIBUTES = ("rope_parameters", "rope_scaling", "rope_theta")


class ConfigOverrideError(UserError, ValueError):
    """An override that cannot act on this model's config; the message names its config key."""


@dataclass(frozen=True)
class ConfigOverride:
    key: str            # the Ridgeline config key asking for it, named in errors
    attribute: str      # the Hugging Face config attribute it sets
    value: JSONValue


def overrides_of(model_config_kwargs: Mapping[str, JSONValue], kwargs_key: str, rope_scaling: JSONValue,
                 rope_theta: JSONValue, rope_section: str) -> tuple[ConfigOverride, ...]:
    """One role's overrides in the order they apply: its `model_config_kwargs`, then the non-null
    `rope_scaling` / `rope_theta` of `rope_section` (trainer or generator), which win as in SkyRL."""
    overrides = [ConfigOverride(f"{kwargs_key}.{name}", name, value) for name, value in model_config_kwargs.items()]
    if rope_scaling is not None:
        overrides.append(ConfigOverride(f"{rope_section}.rope_scaling", "rope_scaling", rope_scaling))
    if rope_theta is not None:
        overrides.append(ConfigOverride(f"{rope_section}.rope_theta", "rope_theta", rope_theta))
    return tuple(overrides)


def apply_overrides(config: PretrainedConfig, overrides: Sequence[ConfigOverride]) -> None:
    """Set each override on `config` in place, in order (ConfigOverrideError when one cannot act)."""
    for override in overrides:
        if override.attribute in ROPE_ATTRIBUTES:
            _set_rope(config, override)
        elif hasattr(config, override.attribute):
            setattr(config, override.attribute, copy.deepcopy(override.value))
        else:
            raise ConfigOverrideError(
                f"{override.key}={override.value!r}: {type(config).__name__} has no attribute {override.attribute!r} "
                "(transformers would drop it without a word). Fix: remove it, or name an attribute of the model's "
                "config.json")


def changed_attributes(config: PretrainedConfig, overrides: Sequence[ConfigOverride]) -> dict[str, JSONValue]:
    """The top-level config attributes `overrides` change, with their new values: what an engine
    that patches a config with `config.update(...)` (vLLM's hf_overrides, SGLang's
    json_model_override_args) needs to build the same model. `config` is left as it is."""
    if not overrides:
        return {}
    patched = copy.deepcopy(config)
    apply_overrides(patched, overrides)
    before, after = config.to_dict(), patched.to_dict()
    return {name: value for name, value in after.items() if before.get(name) != value}


def _set_rope(config: PretrainedConfig, override: ConfigOverride) -> None:
    if hasattr(config, "rope_parameters"):      # transformers 5: one standardized dict
        _set_rope_parameters(config, override)
    elif hasattr(config, "rope_theta") and override.attribute != "rope_parameters":   # transformers 4.x
        setattr(config, override.attribute, copy.deepcopy(override.value))
        from transformers.modeling_rope_utils import rope_config_validation
        _checked(override, rope_config_validation, config)
    else:
        raise ConfigOverrideError(f"{override.key}={override.value!r}: {type(config).__name__} has no rotary "
                                  "position embedding (RoPE) parameters to override. Fix: remove it")


def _set_rope_parameters(config: PretrainedConfig, override: ConfigOverride) -> None:
    """SkyRL's meaning on transformers 5's `rope_parameters`: `rope_scaling` replaces the scaling
    (rope_type, factor, ...) and keeps the model's theta; `rope_theta` replaces the theta and keeps
    the scaling; `rope_parameters` (a model_config_kwargs entry) replaces the whole dict."""
    current = dict(config.rope_parameters or {})
    value = copy.deepcopy(override.value)
    if override.attribute == "rope_parameters":
        config.rope_parameters = value
    elif any(isinstance(v, dict) for v in current.values()):   # e.g. {sliding_attention: {...}, full_attention: {...}}
        raise ConfigOverrideError(
            f"{override.key}={override.value!r}: {type(config).__name__} has RoPE parameters per layer type "
            f"({', '.join(current)}), which one {override.attribute} cannot address. Fix: set the whole dict "
            "with model_config_kwargs.rope_parameters instead")
    elif override.attribute == "rope_theta":
        try:
            theta = float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else None
        except ValueError:
            theta = None
        if theta is None:
            raise ConfigOverrideError(f"{override.key}={override.value!r}: rope_theta must be a number. "
                                      "Fix: e.g. 1000000.0")
        config.rope_parameters = {**current, "rope_theta": theta}
    else:
        if not isinstance(value, dict):
            raise ConfigOverrideError(f"{override.key}={override.value!r}: {override.attribute} must be a dict such "
                                      "as {rope_type: linear, factor: 2.0}. Fix: give it as a dict")
        scaling = dict(value)
        if "type" in scaling:   # the legacy spelling of rope_type
            scaling.setdefault("rope_type", scaling.pop("type"))
        config.rope_parameters = {"rope_theta": current.get("rope_theta"), **scaling}
    _checked(override, config.standardize_rope_params)
    _checked(override, config.validate_rope)


def _checked(override: ConfigOverride, check, *args) -> None:
    try:
        check(*args)
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigOverrideError(f"{override.key}={override.value!r} is not valid RoPE for this model: {err}. "
                                  "Fix: see the rope_parameters of transformers' RoPE types (default, linear, "
                                  "dynamic, yarn, longrope, llama3)") from None
