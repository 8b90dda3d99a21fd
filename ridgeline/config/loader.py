"""Compose a Ridgeline config the way the `ridgeline` command does: Hydra + validation.

``load_config(["+experiment=quickstart", "trainer.epochs=2"])`` composes the base config
(``ppo_base_config``: the schema's defaults) with the preset and overrides, drops Hydra's own node,
and returns the validated, typed result.
"""

from __future__ import annotations

import difflib
import json
import logging
import re
import tempfile
import typing
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict

from ridgeline.config.fields import show
from ridgeline.config.schema import RidgelineConfig, all_keys, base_config, free_form_keys
from ridgeline.config.support import (
    DEPRECATED_KEYS, LATER_VALUES, VALUE_RENAMES, later_key, later_key_notice, later_key_refusal, rename_origin,
    renamed_key,
)
from ridgeline.config.validate import (
    ConfigError,
    check_tree,
    config_problems,
    configures_unbuilt,
    suggest_key,
    typed_keys,
    under_free_form,
)

__all__ = ["CONFIG_DIR", "CONFIG_NAME", "load_config", "config_yaml", "saved_config", "save_config", "saved_values", "default_backend", "list_experiments", "preset_summaries"]

log = logging.getLogger(__name__)

CONFIG_DIR: Path = Path(__file__).resolve().parent
CONFIG_NAME = "ppo_base_config"
EXPERIMENT_GROUP = "experiment"


def default_backend() -> str:
    """Default inference backend: "vllm" when a CUDA GPU is present, "hf" otherwise."""
    try:
        import torch
    except ImportError:
        return "hf"
    return "vllm" if torch.cuda.is_available() else "hf"


OmegaConf.register_new_resolver("ridgeline.default_backend", default_backend, replace=True)


def _register_base_config() -> None:
    """Hydra's primary config: the schema's defaults, untyped (the validator types them, reporting
    every problem at once where Hydra would stop at the first), and Hydra's own settings: no output
    folders, no change of working directory, Python logging left to Ridgeline."""
    node = typing.cast(dict[str, Any], OmegaConf.to_container(base_config(), resolve=False))
    node["defaults"] = ["_self_", {"override hydra/job_logging": "none"}, {"override hydra/hydra_logging": "none"}]
    node["hydra"] = {"run": {"dir": "."}, "output_subdir": None, "job": {"chdir": False}}
    ConfigStore.instance().store(name=CONFIG_NAME, node=node)


_register_base_config()


def list_experiments() -> list[str]:
    """Names of the presets usable as ``+experiment=NAME``."""
    return sorted(p.stem for p in (CONFIG_DIR / EXPERIMENT_GROUP).glob("*.yaml"))


def preset_summaries() -> dict[str, str]:
    """Preset name -> what it trains: the first sentence of the comment its file opens with,
    without parentheses (citations), at most 100 characters."""
    out = {}
    for name in list_experiments():
        text = (CONFIG_DIR / EXPERIMENT_GROUP / f"{name}.yaml").read_text(encoding="utf-8")
        block = []
        for line in text.splitlines():
            if not line.startswith("#"):
                break
            if "@package" not in line:
                block.append(line[1:].strip())
        summary = re.sub(r"\s*\([^()]*\)", "", " ".join(block))
        # the first sentence or clause, past the first 20 characters ("Dr. GRPO", "Quickstart: ...")
        ends = [m.start() for m in re.finditer(r"[.:;] ", summary) if m.start() >= 20]
        summary = summary[:ends[0]] if ends else summary.rstrip(".")
        out[name] = summary if len(summary) <= 100 else summary[:99].rstrip() + "…"
    return out


def load_config(overrides: list[str] | None = None, run_config: Path | None = None) -> RidgelineConfig:
    """Compose the base config with Hydra ``overrides``, validate it and return it.

    ``run_config``: a run's saved ``config.yaml`` (``ridgeline eval --checkpoint``), applied over
    the base config and any preset, under the overrides' keys.

    Raises :class:`ConfigError` naming every problem found (bad override syntax, unknown keys,
    wrong types, clashing batch sizes, features not built yet, ...). The result is the schema's
    ``RidgelineConfig`` (interpolations resolved); a value of the wrong type set later is refused.
    """
    return _load(overrides, run_config)[1]


def config_yaml(overrides: list[str], *, resolve: bool = False, package: str | None = None) -> str:
    """The config ``overrides`` make (or its node ``package``) as YAML, as ``--cfg job`` prints it:
    interpolations as written unless ``resolve``."""
    tree = _load(overrides, None)[0]
    node = tree if package is None else OmegaConf.select(tree, package, default=None)
    if node is None:
        raise ConfigError([f"--package {package}: the config has no such node. Fix: a dotted path of the "
                           "config, e.g. --package trainer.algorithm"])
    if not OmegaConf.is_config(node):
        return f"{package}: {node}\n"
    return OmegaConf.to_yaml(node, resolve=resolve)


def _load(overrides: list[str] | None, run_config: Path | None) -> tuple[DictConfig, RidgelineConfig]:
    """``load_config``'s work: (the typed OmegaConf tree, the ``RidgelineConfig``)."""
    overrides = list(overrides or [])
    if run_config is not None:
        with tempfile.TemporaryDirectory(prefix="ridgeline-run-config-") as folder:
            return _load([*overrides, *_run_config_overrides(Path(run_config), Path(folder))], None)
    problems: list[str] = []
    usable = _check_overrides(overrides, problems)
    try:
        cfg = _compose(usable)
    except ConfigError as exc:  # a problem the pre-checks could not see
        problems.extend(exc.problems)
        # still report what is wrong with the rest: compose again without the presets
        rest = [o for o in usable if o.lstrip("+").split("=", 1)[0] != EXPERIMENT_GROUP]
        if rest != usable:
            try:
                cfg = _compose(rest)
            except ConfigError:
                raise ConfigError(problems) from None
            _strip_hydra(cfg)
            # only what is wrong with the user's own keys: the cross-field rules would judge the base
            # config's defaults (4 GPUs, colocated engines) that the missing preset was there to replace
            own = {o.lstrip("+").split("=", 1)[0] for o in rest}
            problems.extend(p for p in config_problems(cfg) if re.split(r"[=: ]", p, maxsplit=1)[0] in own)
        raise ConfigError(problems) from None
    _strip_hydra(cfg)
    tree, typed, found = check_tree(cfg)
    problems.extend(found)
    if problems:
        raise ConfigError(problems)
    return tree, typed


def save_config(cfg: RidgelineConfig, path: Path) -> None:
    """Write ``cfg`` as a run's ``config.yaml`` (every key, values resolved): what ``saved_config``,
    ``ridgeline eval --checkpoint`` and a resume read back."""
    OmegaConf.save(OmegaConf.structured(cfg), path, resolve=True)


def saved_values(path: Path) -> dict[str, Any]:
    """A run's saved ``config.yaml`` as written, a plain nested map (to compare with another run's)."""
    values = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    if not isinstance(values, dict):
        raise ConfigError(f"{path} holds no map of config sections. Fix: a run's config.yaml, as the run wrote it.")
    return {str(k): v for k, v in values.items()}


def saved_config(path: Path) -> RidgelineConfig:
    """A run's saved ``config.yaml`` (a checkpoint's, a run folder's) as the schema's config: a key
    the run's version did not have yet takes its default; a key this version no longer reads is
    left out, with one warning naming it."""
    saved = OmegaConf.load(path)
    if not isinstance(saved, DictConfig):
        raise ConfigError(f"{path} holds no map of config sections. Fix: a run's config.yaml, as the run wrote it.")
    typed, problems = typed_keys(saved)
    for problem in problems:
        log.warning("%s: %s", path, problem)
    return typed


# --------------------------------------------------------------------------- Hydra
RUN_CONFIG_GROUP = "run_config"


def _run_config_overrides(run_config: Path, folder: Path) -> list[str]:
    """A saved run config as a config group of its own on Hydra's search path (`folder`): the
    overrides that select it, after any preset, so the run's values replace the preset's."""
    from omegaconf import OmegaConf

    saved = OmegaConf.load(run_config)
    (folder / RUN_CONFIG_GROUP).mkdir()
    (folder / RUN_CONFIG_GROUP / "saved.yaml").write_text("# @package _global_\n" + OmegaConf.to_yaml(saved),
                                                         encoding="utf-8")
    return [f"hydra.searchpath=[file://{folder}]", f"+{RUN_CONFIG_GROUP}=saved"]



def _compose(overrides: list[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException, MissingConfigException
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    # called from inside a running Hydra app: compose here, then give the app its state back
    outer = get_gh_backup() if GlobalHydra.instance().is_initialized() else None
    if outer is not None:
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONFIG_DIR)):
            return compose(config_name=CONFIG_NAME, overrides=overrides)
    except MissingConfigException as exc:
        raise ConfigError(_missing_config_problem(exc, overrides)) from None
    except HydraException as exc:
        raise ConfigError(_hydra_problem(exc, overrides)) from None
    finally:
        if outer is not None:
            restore_gh_from_backup(outer)


def _check_overrides(overrides: list[str], problems: list[str]) -> list[str]:
    """Report overrides Hydra would refuse (all of them, not just the first); return the rest, with
    SkyRL's other names (0.3.1's deprecated spellings, 0.4's typed-config keys) read as the keys here."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Override
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    known = _known_keys()
    usable: list[str] = []
    parsed: list[tuple[str, Override]] = []
    for text in overrides:
        try:
            parsed.append((text, parser.parse_override(_json_value(text))))
        except HydraException as exc:
            problems.append(
                f"The override {text!r} cannot be parsed: {_parse_reason(exc)}. "
                "Fix: write it as key=value (e.g. trainer.epochs=2); quote values with spaces or "
                "special characters, e.g. 'trainer.run_name=\"my run\"'.")
    given = {ov.key_or_group: ov.value() for _, ov in parsed if not ov.is_delete()}
    unbuilt: dict[str, list[str]] = {}   # feature -> its settings, refused in one sentence
    no_effect: dict[str, str] = {}       # setting -> why it changes nothing here, said in one line
    for text, ov in parsed:
        text = _json_value(text)
        key = ov.key_or_group
        if key in VALUE_RENAMES and not ov.is_delete():
            target = VALUE_RENAMES[key].get(ov.value())
            if target is None:
                continue  # its SkyRL 0.4 default: asks for nothing
            text, key = f"{target[0]}={target[1]}", target[0]
            ov = parser.parse_override(text)
        renamed = renamed_key(key)
        if renamed is not None and renamed in given:
            if not ov.is_delete() and given[renamed] == ov.value():
                continue  # both names of one setting, agreeing: the config of either release reads the same
            pair = ("SkyRL 0.3.1's deprecated spelling and the key that replaced it" if key in DEPRECATED_KEYS
                    else f"{rename_origin(key)} and Ridgeline's")
            problems.append(f"{key}={show(ov.value())} and {renamed}={show(given[renamed])} are the same setting "
                            f"({pair}) and disagree. Fix: keep one of them.")
            continue
        if renamed is not None and key in DEPRECATED_KEYS and ov.value() is None:
            continue  # SkyRL 0.3.1's deprecated key at its default (unset): the key that replaced it keeps its value
        if renamed is not None:
            # read as the key here, without a line per key on every run (both releases' names are SkyRL's)
            log.debug("%s is %s for %s", key, rename_origin(key), renamed)
            # '+' (SkyRL's scripts add their example keys) would ask Hydra to add a key that exists here
            bare = text.lstrip("+")
            text = ("~" if bare.startswith("~") else "") + renamed + bare.lstrip("~")[len(key):]
            ov = parser.parse_override(text)
            key = renamed
        if not ov.is_delete() and isinstance(ov.value(), str) and (key, ov.value()) in LATER_VALUES:
            unbuilt.setdefault(LATER_VALUES[key, ov.value()], []).append(f"{key}={show(ov.value())}")
            continue
        later = later_key(key) if key not in known else None
        if later is not None and not ov.is_delete():
            value = ov.value()
            if value != later.default:
                setting = f"{key}={show(value) if not isinstance(value, dict) else show(dict(value))}"
                if later.feature:
                    unbuilt.setdefault(later.feature, []).append(setting)
                else:
                    no_effect[setting] = later.why
            continue
        if key == EXPERIMENT_GROUP or key.startswith("hydra") or ov.package is not None:
            if key == EXPERIMENT_GROUP and not (ov.is_add() or ov.is_force_add()):
                problems.append(
                    f"The override {text!r} selects a preset without '+': presets are not part "
                    f"of the base config. Fix: +experiment={ov.value()}.")
                continue
            usable.append(text)
            continue
        if ov.is_delete():
            problems.append(
                f"The override {text!r} deletes {key}: Ridgeline reads every key of the base "
                f"config. Fix: set it to a value instead, e.g. {key}=VALUE.")
            continue
        if key in free_form_keys() and isinstance(ov.value(), dict) and not ov.is_force_add():
            # a whole free-form map (SkyRL writes chat_template_kwargs={reasoning_effort:low} without '+'):
            # its keys are the user's, so it replaces the map ('++': Hydra then takes keys it has not seen)
            usable.append("++" + text.lstrip("+"))
            continue
        if ov.is_add() and under_free_form(key):
            # '+' inside a free-form map may meet a key SkyRL's defaults already hold there
            # (environment.skyrl_gym.text2sql.db_path): add or override, as without the '+'
            usable.append("+" + text)
            continue
        if ov.is_add() or ov.is_force_add() or key in known:
            usable.append(text)
            continue
        if under_free_form(key):
            # Inside a free-form map (per-env settings, engine kwargs) a key may or may not exist
            # yet (a preset may have created it): SkyRL's scripts set them without '+', so set it
            # either way ('++': add or override)
            usable.append("++" + text)
            continue
        if configures_unbuilt(key):
            # a setting of Megatron / DeepSpeed or of an example's own harness: added, so that
            # validation names the feature once for all of its settings instead of one "unknown key" each
            usable.append("++" + text)
            continue
        # a CHANGE of a key the base config does not have: Hydra would refuse it
        value = show(ov.value()) if not isinstance(ov.value(), dict) else "..."
        guess = suggest_key(key)
        if guess:
            problems.append(f"{key}={value} is not a Ridgeline config key: did you mean {guess}? "
                            f"Fix: {guess}={value}.")
        else:
            problems.append(
                f"{key}={value} is not a Ridgeline config key. Fix: remove it. Free-form "
                f"settings go under {', '.join(free_form_keys())} (add them with '+', e.g. "
                "+generator.engine_init_kwargs.attention_backend=flashinfer).")
    problems.extend(later_key_refusal(settings, feature) for feature, settings in unbuilt.items())
    if no_effect:
        log.warning("%s", later_key_notice(no_effect))
    return usable


def _json_value(text: str) -> str:
    """`text` with a JSON map or list value (SkyRL 0.4 reads `key={"a": 1}` as JSON) written in Hydra's
    grammar, which does not quote map keys; any other override unchanged."""
    key, sep, raw = text.partition("=")
    if not sep or not raw.lstrip().startswith(("{", "[")):
        return text
    try:
        value = json.loads(raw)
    except ValueError:
        return text  # Hydra's own syntax ({a: 1}, [x, y]) or a mistake Hydra names
    return f"{key}={_hydra_literal(value)}"


def _hydra_literal(value: object) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_hydra_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_hydra_literal(v) for v in value) + "]"
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return json.dumps(value)  # true / false / null / numbers


def _parse_reason(exc: Exception) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines()
             if ln.strip() and not ln.startswith(("See ", "Error parsing override"))]
    return "; ".join(lines) or "invalid syntax"


def _known_keys() -> set[str]:
    return set(all_keys())


def _missing_config_problem(exc: Exception, overrides: list[str]) -> str:
    msg = str(exc).splitlines()[0]
    available = list_experiments()
    asked = [o.split("=", 1)[1] for o in overrides
             if o.lstrip("+").startswith(EXPERIMENT_GROUP + "=")]
    guess = difflib.get_close_matches(asked[0], available, n=1) if asked else []
    hint = f" Did you mean +experiment={guess[0]}?" if guess else ""
    names = ", ".join(available) if available else "(none installed)"
    return (f"{msg}.{hint} Presets are the files in {CONFIG_DIR / EXPERIMENT_GROUP}: {names}. "
            "Fix: +experiment=NAME with one of those names: example_gsm8k is SkyRL's GSM8K quickstart "
            "(run_gsm8k.sh: GRPO on Qwen2.5-0.5B-Instruct), quickstart a first run on this CPU (ridgeline train "
            "--help says what each preset is).")


def _hydra_problem(exc: Exception, overrides: list[str]) -> str:
    cause = exc.__cause__
    full_key = getattr(cause, "full_key", None)
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if full_key and under_free_form(str(full_key)):
        # the override that set it: the key itself, or the map holding it (key={a: 1})
        text = next((o for o in overrides if str(full_key) == o.lstrip("+").split("=", 1)[0]
                     or str(full_key).startswith(o.lstrip("+").split("=", 1)[0] + ".")), f"{full_key}=VALUE")
        return (f"{text}: {str(full_key).rsplit('.', 1)[0]} is a free-form map, so new keys in it need "
                f"a '+'. Fix: +{text}.")
    if full_key:
        guess = suggest_key(str(full_key))
        hint = f" Did you mean {guess}?" if guess else ""
        return (f"{full_key}: {first} ({str(cause).splitlines()[0]}).{hint} Fix: use a key of the "
                "base config, or '+key=value' to add one inside a free-form map.")
    return f"Hydra could not compose the config: {str(exc).strip()} Fix: correct that override."


# --------------------------------------------------------------------------- clean-up


def _strip_hydra(cfg: DictConfig) -> None:
    if "hydra" in cfg:
        with open_dict(cfg):
            cfg.pop("hydra")
