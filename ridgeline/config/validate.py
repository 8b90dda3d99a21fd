"""Checks a composed config against the typed schema before anything heavy runs.

:func:`validate_config` merges a composed config into ``RidgelineConfig`` key by key, so that every
problem is found in one pass (OmegaConf alone stops at the first), then runs the sections' rules,
and returns the typed config. Problems come as one :class:`ConfigError` whose message lists them,
one paragraph each: the full dotted key, the bad value, why it cannot work, and how to fix it.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import re
import typing
from typing import Any, Iterable

from omegaconf import DictConfig, ListConfig, Node, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ridgeline.config.fields import Report, Section, field_type, one_of, section_fields, section_type, show
from ridgeline.config.schema import RidgelineConfig, all_keys, default_of, free_form_keys, leaf_fields
from ridgeline.config.support import UNREAD_KEYS
from ridgeline.errors import UserError

__all__ = ["ConfigError", "validate_config", "config_problems", "check_config", "check_tree", "typed_keys", "suggest_key", "under_free_form",
           "configures_unbuilt"]

# sections of SkyRL's training backends that are not built here: one sentence for the whole section
# (trainer.strategy names the backend), never an "unknown key" per setting
UNBUILT_STRATEGY_SECTIONS = {"megatron_config": "megatron", "deepspeed_config": "deepspeed"}

# keys that SkyRL 0.3.1's example entry points add for an agent harness of their own (a generator
# class in the example's folder) that is not built here: key prefix -> the sentence naming it, said
# once for all of its keys instead of an "unknown key" each
UNBUILT_EXAMPLE_KEYS = {
    "generator.miniswe_": "SkyRL's mini-swe-agent example generator (examples/mini_swe_agent: the minisweagent "
                          "package's agent in SWE-bench docker sandboxes), which is not built here",
    "terminal_bench_config": "SkyRL's Terminal-Bench example generator (examples/terminal_bench: the harbor "
                             "package's agents in docker sandboxes), which is not built here",
    # SkyRL 0.4's examples/train/rlm: its own generator spawning child agents
    "generator.enable_child_agents": "SkyRL's RLM example generator (examples/train/rlm: recursive child agents), "
                                     "which is not built here",
    "generator.train_child_trajectories": "SkyRL's RLM example generator (examples/train/rlm: recursive child "
                                          "agents), which is not built here",
}


def configures_unbuilt(key: str) -> bool:
    """Whether `key` is a setting of a backend or example harness not built here (named once by
    validation for all of its keys)."""
    return any(part in UNBUILT_STRATEGY_SECTIONS for part in key.split(".")) or key.startswith(
        tuple(UNBUILT_EXAMPLE_KEYS))


log = logging.getLogger(__name__)

S = typing.TypeVar("S", bound=Section)

_MISSING = object()  # a value that could not be resolved (already reported)


class ConfigError(UserError, ValueError):
    """A config Ridgeline cannot run. ``problems`` holds one paragraph per problem."""

    headline = "invalid configuration"

    def __init__(self, problems: str | Iterable[str]):
        if isinstance(problems, str):
            problems = [problems]
        self.problems: list[str] = list(problems)
        super().__init__(format_problems(self.problems))


def format_problems(problems: list[str]) -> str:
    if len(problems) == 1:
        return "Invalid Ridgeline config:\n\n- " + problems[0]
    head = f"Invalid Ridgeline config ({len(problems)} problems):"
    return head + "".join("\n\n- " + p for p in problems)


# --------------------------------------------------------------------------- API


def validate_config(cfg: DictConfig | RidgelineConfig) -> RidgelineConfig:
    """The typed config of ``cfg`` (a ``RidgelineConfig``: missing keys at their defaults,
    interpolations resolved); raises one :class:`ConfigError` listing every problem."""
    typed, problems = check_config(cfg)
    if problems:
        raise ConfigError(problems)
    return typed


def config_problems(cfg: DictConfig | RidgelineConfig) -> list[str]:
    """Every problem of ``cfg``, one paragraph each (empty when it is fine)."""
    return check_config(cfg)[1]


def check_config(cfg: DictConfig | RidgelineConfig) -> tuple[RidgelineConfig, list[str]]:
    """(the typed config, every problem of ``cfg``). Where a key is refused, the config holds a
    stand-in there (its default, or the zero of its type): it is for the rules, not for a run."""
    _tree, typed, problems = check_tree(cfg)
    return typed, problems


def check_tree(cfg: DictConfig | RidgelineConfig) -> tuple[DictConfig, RidgelineConfig, list[str]]:
    """``check_config`` with the typed OmegaConf tree it was built from (interpolations kept: what
    ``--cfg job`` prints)."""
    report = Report()
    tree = OmegaConf.structured(RidgelineConfig)
    unbuilt: dict[str, list[str]] = {}  # backend -> its sections in the config
    if isinstance(cfg, RidgelineConfig):  # a config already typed, perhaps changed since: checked again
        cfg = OmegaConf.structured(cfg)
    if not isinstance(cfg, DictConfig):
        report.refuse("", "The config is not a map of sections. Fix: load it with ridgeline.config.load_config().")
        return tree, RidgelineConfig(), report.problems
    _merge(cfg, tree, RidgelineConfig, "", report, unbuilt)
    values = _resolve(tree, "", report)
    _unbuilt_sections(values, unbuilt, report)
    _field_rules(values, report)
    typed = _instance(RidgelineConfig, values, "", report)
    typed.check("", report)
    return tree, typed, report.problems


def typed_keys(cfg: DictConfig) -> tuple[RidgelineConfig, list[str]]:
    """(``cfg``'s keys and types as a ``RidgelineConfig``, the keys refused): only the keys and their
    types are checked, not the rules between them (a run's saved config, read back for its models)."""
    report = Report()
    tree = OmegaConf.structured(RidgelineConfig)
    _merge(cfg, tree, RidgelineConfig, "", report, {})
    return _instance(RidgelineConfig, _resolve(tree, "", report), "", report), report.problems


# --------------------------------------------------------------------------- 1. keys and types


def _merge(raw: DictConfig, typed: DictConfig, cls: type, prefix: str, report: Report,
           unbuilt: dict[str, list[str]]) -> None:
    """Copy ``raw`` into the typed tree one key at a time; every unknown key and wrong type is reported."""
    names = {f.name for f in section_fields(cls)}
    for k in raw.keys():
        key = f"{prefix}.{str(k)}" if prefix else str(k)
        node = typing.cast(Node, raw._get_node(k))
        value = node._value() if node._is_interpolation() or not OmegaConf.is_config(node) else \
            OmegaConf.to_container(node, resolve=False)
        if k not in names:
            example = next((p for p in UNBUILT_EXAMPLE_KEYS if key.startswith(p)), None)
            if example is not None:  # keys of one harness are named together, whatever their prefix
                example = next(p for p in UNBUILT_EXAMPLE_KEYS
                               if UNBUILT_EXAMPLE_KEYS[p] == UNBUILT_EXAMPLE_KEYS[example])
            if key in UNREAD_KEYS:
                log.warning("%s=%s is ignored: %s", key, show(value), UNREAD_KEYS[key])
            elif k in UNBUILT_STRATEGY_SECTIONS:
                unbuilt.setdefault(UNBUILT_STRATEGY_SECTIONS[str(k)], []).append(key)
            elif example is not None:
                unbuilt.setdefault(example, []).append(key)
            else:
                report.refuse(key, _unknown_key(key, value))
            continue
        tp = field_type(cls, str(k))
        sub = section_type(tp)
        if sub is not None:
            if isinstance(node, DictConfig) and not node._is_none() and not node._is_interpolation():
                _merge(node, typed[k], sub, key, report, unbuilt)
            else:
                fields = [f.name for f in section_fields(sub)]
                report.refuse(key, f"{key}={show(value)} replaces a section with {_type_name(value)}: {key} holds "
                                   f"the keys {', '.join(fields)}. Fix: set its keys one at a time, e.g. "
                                   f"{key}.{fields[0]}=VALUE.")
            continue
        if _is_interpolation(value):
            typed[k] = value  # typed when resolved
            continue
        if tp is bool and not isinstance(value, bool):  # OmegaConf would read 1 or "yes" as true
            report.refuse(key, _wrong_type(key, value, tp, cls, str(k)))
            continue
        try:
            typed[k] = value
        except OmegaConfBaseException:
            report.refuse(key, _wrong_type(key, value, tp, cls, str(k)))


def _unknown_key(key: str, value: Any) -> str:
    if key.startswith("trainer.ref.model.lora"):
        return (f"{key}={show(value)}: the reference model has no adapters: it is frozen, and with "
                "trainer.policy.model.lora.rank > 0 it is the LoRA policy's base model. Fix: remove it.")
    guess = suggest_key(key)
    if guess:
        fix = (f"did you mean {guess}? Fix: rename it, e.g. {guess}={show(value)}"
               if not isinstance(value, dict) else f"did you mean {guess}? Fix: rename it")
    else:
        fix = f"Fix: remove it. Free-form settings go under {', '.join(free_form_keys())}"
    return f"{key}={show(value)} is not a Ridgeline config key: {fix}."


def _wrong_type(key: str, value: Any, tp: Any, cls: type, name: str) -> str:
    meta = next(f.metadata for f in section_fields(cls) if f.name == name)
    default = default_of(key)
    example = meta.get("example") or (None if default is None else show(default))
    got = _type_name(value)
    if isinstance(value, list):
        elem = _list_element(tp)
        wrong = [v for v in value if elem is not None and not isinstance(v, elem)]
        if wrong:
            got = f"a list holding {one_of(wrong)}"
    fix = f"{key}=<{_placeholder(tp)}>"
    if example is not None:
        text = f"{key}={example}"
        quoted = f'"{text}" (quoted for the shell)' if re.search(r"[\[\]'<> ]", example) else text
        fix += f", e.g. {'the default ' if not meta.get('example') else ''}{quoted}"
    return f"{key}={show(value)} has the wrong type: expected {_type_words(tp)}, got {got}. Fix: {fix}."


_WORDS = {bool: ("a boolean", "booleans", "true|false"), int: ("an integer", "integers", "integer"),
          float: ("a number", "numbers", "number"), str: ("a string", "strings", "string")}


def _type_words(tp: Any) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        return "null or " + _type_words(next(a for a in args if a is not type(None)))
    if typing.get_origin(tp) in (list, typing.List):
        return f"a list of {_WORDS[args[0]][1]}" if args and args[0] in _WORDS else "a list"
    if typing.get_origin(tp) in (dict, typing.Dict):
        return "a map"
    return _WORDS[tp][0] if tp in _WORDS else str(tp)


def _placeholder(tp: Any) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union:
        return _placeholder(next(a for a in args if a is not type(None)))
    if typing.get_origin(tp) in (list, typing.List):
        return "list"
    if typing.get_origin(tp) in (dict, typing.Dict):
        return "map"
    return _WORDS[tp][2] if tp in _WORDS else "value"


def _list_element(tp: Any) -> type | None:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union:
        return _list_element(next(a for a in args if a is not type(None)))
    if typing.get_origin(tp) in (list, typing.List) and args and args[0] in _WORDS:
        return float if args[0] is float else args[0]
    return None


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
                       (list, "a list"), (dict, "a map")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


# sections that hold the same keys for different things: a key missing from one of them is not the
# same-named key of its sibling (trainer.ref.model.lora.alpha is not the critic's LoRA alpha)
_SIBLINGS = re.compile(r"(?<=\.)(policy|ref|critic|sampling_params|eval_sampling_params)(?=\.)")


def suggest_key(key: str) -> str | None:
    """The schema key a mistyped or misplaced dotted ``key`` most likely means: only one of the same
    meaning (a misspelt name, or the same name in another place), never another setting."""
    keys = all_keys()
    if key in keys:
        return None
    parent, _, leaf = key.rpartition(".")
    # same name, other place (e.g. trainer.n_samples_per_prompt -> generator.n_samples_per_prompt),
    # but not the same name of a sibling model or sampling section
    same_leaf = [k for k in keys if k.rpartition(".")[2] == leaf
                 and _SIBLINGS.sub("*", k) != _SIBLINGS.sub("*", key)]
    if len(same_leaf) == 1:
        return same_leaf[0]
    if same_leaf:
        return difflib.get_close_matches(key, same_leaf, n=1, cutoff=0.0)[0]
    # a misspelt name in its own section: the names themselves must be close (compared whole, the
    # shared section prefix made `lora.init_method` look like `lora.rank` and `sampling_params.stop`
    # like `top_p`, which mean something else), and neither may extend the other by a word
    # (`zero_variance_filter_tol` is a setting of its own, not `zero_variance_filter`)
    siblings = {k.rpartition(".")[2]: k for k in keys if k.rpartition(".")[0] == parent}
    close = [c for c in difflib.get_close_matches(leaf, list(siblings), n=3, cutoff=0.8)
             if not (c.startswith(leaf + "_") or leaf.startswith(c + "_"))]
    return siblings[close[0]] if close else None


def under_free_form(key: str) -> bool:
    return any(key == f or key.startswith(f + ".") for f in free_form_keys())


# --------------------------------------------------------------------------- 2. resolution


_PURE_REF = re.compile(r"^\$\{([A-Za-z_][\w.]*)\}$")


def _resolve(node: Any, prefix: str, report: Report) -> Any:
    """A plain copy of ``node`` with interpolations resolved; failures become problems."""
    if isinstance(node, DictConfig):
        return {str(k): _resolve_child(node, k, f"{prefix}.{str(k)}" if prefix else str(k), report) for k in node.keys()}
    if isinstance(node, ListConfig):
        items = [_resolve_child(node, i, f"{prefix}[{i}]", report) for i in range(len(node))]
        return _MISSING if any(v is _MISSING for v in items) else items
    return node


def _resolve_child(parent: Any, k: Any, key: str, report: Report) -> Any:
    try:
        value = parent[k]
    except Exception as exc:  # interpolation / missing-value / type-of-the-result errors
        raw = None
        try:
            raw = parent._get_node(k)._value()
        except Exception:
            pass
        report.refuse(key.split("[")[0], _resolution_problem(key, raw, exc))
        return _MISSING
    if isinstance(value, (DictConfig, ListConfig)):
        return None if value._is_none() else _resolve(value, key, report)
    return value


def _resolution_problem(key: str, raw: Any, exc: Exception) -> str:
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    reason = re.sub(r"^\w+ raised while resolving interpolation: ", "", reason).strip("\"'")
    if raw == "???":
        return f"{key} has no value (???): the config requires it. Fix: give it one, e.g. {key}=VALUE."
    env = re.search(r"Environment variable '(\w+)' not found", reason)
    if env is None and raw is not None:
        env = re.search(r"oc\.env:([A-Za-z_]\w*)", str(raw))
    fix = (f"set the environment variable {env.group(1)}, or give {key.split('[')[0]} a literal value on the "
           "command line" if env else f"give {key} a value that resolves, or fix the interpolation")
    return f"{key}={show(raw)} could not be resolved: {reason}. Fix: {fix}."


# --------------------------------------------------------------------------- 3. single values


def _get(tree: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _MISSING
        tree = tree[part]
    return tree


def _unbuilt_sections(values: dict, unbuilt: dict[str, list[str]], report: Report) -> None:
    """One sentence per backend (or example harness) not built whose keys the config sets."""
    strategy = _get(values, "trainer.strategy")
    for name, sections in unbuilt.items():
        if name in UNBUILT_EXAMPLE_KEYS:
            one = len(sections) == 1
            report.refuse(sections[0], f"{', '.join(sections)} {'is a setting' if one else 'are settings'} of "
                                       f"{UNBUILT_EXAMPLE_KEYS[name]}. Fix: remove {'it' if one else 'them'}, and name "
                                       "an environment for the run (environment.env_class).",
                          first=True)
        elif str(strategy).lower() != name:  # else trainer.strategy's own "not planned" sentence covers them
            report.refuse(sections[0], f"{', '.join(sections)} configure {name}, which is not planned "
                                       f"(trainer.strategy={show(strategy)}). Fix: remove them.", first=True)


def _field_rules(values: dict, report: Report) -> None:
    """Each key against its field's ``choices`` and ``not_built`` (the latter named first)."""
    for key, _cls, f in leaf_fields():
        value = _get(values, key)
        if value is _MISSING or key in report.bad:
            continue
        choices, built, note = f.metadata["choices"], f.metadata["built"], f.metadata["not_built"]
        default = default_of(key)
        if note and (value not in built if built else value != default):
            if built:
                fix = f"{key}={show(built[0])}" if len(built) == 1 else f"set {key} to {one_of(built)}"
            else:
                fix = f"leave it at its default ({key}={show(default)})"
            at_default = " (the default)" if value == default else ""
            # the note is the sentence naming what is not built (or not planned)
            report.refuse(key, f"{key}={show(value)}{at_default}: {note}. Fix: {fix}.",
                          first=True)
        elif choices and value not in choices:
            strs = [c for c in choices if isinstance(c, str)]
            close = difflib.get_close_matches(str(value), strs, n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]}?" if close else ""
            report.refuse(key, f"{key}={show(value)} is not a valid choice: it must be {one_of(choices)}.{hint} "
                               f"Fix: e.g. {key}={show(close[0] if close else default)}.")


# --------------------------------------------------------------------------- 4. rules between keys


def _instance(cls: type[S], values: Any, prefix: str, report: Report) -> S:
    """``cls`` built from resolved ``values``; a key refused above holds a stand-in (its default, or
    the zero of its type) so that the rules can run, and their problems naming it are left out."""
    values = values if isinstance(values, dict) else {}
    kwargs: dict[str, Any] = {}
    for f in section_fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = field_type(cls, f.name)
        sub = section_type(tp)
        if sub is not None:
            kwargs[f.name] = _instance(sub, values.get(f.name), key, report)
            continue
        value = values.get(f.name, _MISSING)
        kwargs[f.name] = value if value is not _MISSING and key not in report.bad else _stand_in(f, tp)
    return cls(**kwargs)


def _stand_in(f: dataclasses.Field, tp: Any) -> Any:
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if not _is_interpolation(default):
        return default
    zeros = {bool: False, int: 0, float: 0.0, str: ""}
    if typing.get_origin(tp) in (list, typing.List):
        return []
    return zeros.get(tp)
