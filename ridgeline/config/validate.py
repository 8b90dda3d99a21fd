"""Checks a composed Ridgeline config before anything heavy runs.

:func:`validate_config` gathers every problem it finds and raises one :class:`ConfigError` whose
message lists them, one paragraph each: the full dotted key, the bad value, why it cannot work,
and how to fix it.
"""

from __future__ import annotations

import difflib
import functools
import re
from pathlib import Path
from typing import Any, Iterable, Iterator

from omegaconf import DictConfig, ListConfig, OmegaConf

from ridgeline.config import support

__all__ = ["ConfigError", "validate_config", "config_problems", "base_config", "BASE_CONFIG_FILE"]

BASE_CONFIG_FILE = Path(__file__).resolve().parent / "ppo_base_config.yaml"

# maps whose contents are free-form: keys below them are not checked against the base config
FREE_FORM: tuple[str, ...] = ("generator.engine_init_kwargs", "generator.chat_template_kwargs", "environment.skyrl_gym",
                               "data.prepare")

CHOICES: dict[str, tuple[Any, ...]] = {
    "trainer.strategy": ("fsdp2", "fsdp", "single", "deepspeed", "megatron"),
    "trainer.resume_mode": ("none", None, "latest", "from_path"),   # null: SkyRL's spelling of none
    "trainer.mixed_precision": ("auto", "bf16", "fp32"),
    "trainer.nonfinite_loss": ("skip", "stop"),
    "trainer.algorithm.loss_reduction": ("token_mean", "sequence_mean", "seq_mean_token_sum_norm"),
    "trainer.algorithm.kl_estimator_type": (None, "k1", "k2", "k3", "abs"),
    "trainer.algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "trainer.algorithm.dynamic_sampling.type": (None, "filter", "replace"),
    "generator.backend": ("hf", "vllm", "sglang"),
    "generator.model_dtype": ("bfloat16", "float16", "float32"),
    "generator.override_existing_update_group": ("auto", "enable", "disable"),
    "generator.weight_sync_backend": ("nccl", "gloo"),
    "generator.chat_template.source": ("name", "file"),
}
# sections of SkyRL's training backends that are not built here: one sentence for the whole section
# (trainer.strategy names the backend), never an "unknown key" per setting
UNBUILT_STRATEGY_SECTIONS = {"megatron_config": "megatron", "deepspeed_config": "deepspeed"}
# generator.engine_init_kwargs the embedded engine takes (vllm/sglang take any of theirs)
HF_ENGINE_KWARGS: tuple[str, ...] = ("attn_implementation",)
# built-in estimators that ignore critic values (a user's estimator may read them)
CRITIC_FREE_ESTIMATORS: tuple[str, ...] = ("grpo", "rloo", "reinforce++")
LOGGERS: tuple[str, ...] = ("wandb", "console", "tensorboard", "mlflow", "jsonl")
LORA = "trainer.policy.model.lora"
LORA_TARGETS = f"{LORA}.target_modules"

_PLURAL = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}
_MISSING = object()  # key absent, or its value could not be resolved (already reported)
_PURE_REF = re.compile(r"^\$\{([A-Za-z_][\w.]*)\}$")


class ConfigError(ValueError):
    """A config Ridgeline cannot run. ``problems`` holds one paragraph per problem."""

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


# --------------------------------------------------------------------------- base config


@functools.lru_cache(maxsize=1)
def _base() -> DictConfig:
    cfg = OmegaConf.load(BASE_CONFIG_FILE)
    for node in ("defaults", "hydra"):
        cfg.pop(node, None)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def base_config() -> DictConfig:
    """The defaults of ``ppo_base_config.yaml`` (without Hydra's nodes), read-only."""
    return _base()


@functools.lru_cache(maxsize=1)
def _base_tree() -> dict:
    return OmegaConf.to_container(_base(), resolve=False)


def _walk_leaves(tree: dict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) for every leaf of a plain nested dict; free-form maps are leaves."""
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v and key not in FREE_FORM:
            yield from _walk_leaves(v, key)
        else:
            yield key, v


@functools.lru_cache(maxsize=1)
def _base_leaves() -> dict[str, Any]:
    return dict(_walk_leaves(_base_tree()))


def _base_default(key: str) -> Any:
    """The base default of ``key`` with a pure ``${other.key}`` reference followed."""
    value = _base_leaves()[key]
    seen = set()
    while isinstance(value, str) and (m := _PURE_REF.match(value)) and m.group(1) not in seen:
        seen.add(m.group(1))
        value = _base_leaves().get(m.group(1), value)
    return value


def _all_keys() -> list[str]:
    keys: list[str] = []

    def rec(tree: dict, prefix: str) -> None:
        for k, v in tree.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            keys.append(key)
            if isinstance(v, dict) and key not in FREE_FORM:
                rec(v, key)

    rec(_base_tree(), "")
    return keys


def suggest_key(key: str) -> str | None:
    """The base-config key a mistyped or misplaced dotted ``key`` most likely means."""
    all_keys = _all_keys()
    if key in all_keys:
        return None
    parent, _, leaf = key.rpartition(".")
    # same name, other place (e.g. trainer.n_samples_per_prompt -> generator.n_samples_per_prompt)
    same_leaf = [k for k in all_keys if k.rpartition(".")[2] == leaf]
    if len(same_leaf) == 1:
        return same_leaf[0]
    if same_leaf:
        close = difflib.get_close_matches(key, same_leaf, n=1, cutoff=0.0)
        return close[0]
    # a misspelt name in its own section: the names themselves must be close (compared whole, the
    # shared section prefix made `lora.init_method` look like `lora.rank` and `sampling_params.stop`
    # like `top_p`, which mean something else)
    siblings = {k.rpartition(".")[2]: k for k in all_keys if k.rpartition(".")[0] == parent}
    close = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.8)
    return siblings[close[0]] if close else None


def under_free_form(key: str) -> bool:
    return any(key == f or key.startswith(f + ".") for f in FREE_FORM)


# --------------------------------------------------------------------------- formatting helpers


def _show(value: Any) -> str:
    """A value as it would be written on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value) if (value == "" or value.strip() != value or " " in value) else value
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    return str(value)


def _one_of(values: Iterable[Any]) -> str:
    items = [_show(v) for v in values]
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " or " + items[-1]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n > 0 else []


def _divisor_text(n: int) -> str:
    divs = _divisors(n)
    if len(divs) > 8:
        return ", ".join(str(d) for d in divs[:5]) + ", ... or " + str(divs[-1])
    return _one_of(divs)


# (type, how a message names a value of it, the placeholder a fix shows); bool before int, as
# bool is an int subclass.
_TYPE_WORDS: tuple[tuple[type, str, str], ...] = (
    (bool, "a boolean", "true|false"), (int, "an integer", "integer"), (float, "a number", "number"),
    (str, "a string", "string"), (list, "a list", "list"), (dict, "a map", "map"),
)


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return next((name for kind, name, _ in _TYPE_WORDS if isinstance(value, kind)), type(value).__name__)


# --------------------------------------------------------------------------- resolution


def _resolve(node: Any, prefix: str, problems: list[str]) -> Any:
    """A plain copy of ``node`` with interpolations resolved; failures become problems."""
    if isinstance(node, DictConfig):
        out: dict = {}
        for k in node.keys():
            key = f"{prefix}.{k}" if prefix else str(k)
            out[str(k)] = _resolve_child(node, k, key, problems)
        return out
    if isinstance(node, ListConfig):
        items = [_resolve_child(node, i, f"{prefix}[{i}]", problems) for i in range(len(node))]
        return _MISSING if any(v is _MISSING for v in items) else items
    return node


def _resolve_child(parent: Any, k: Any, key: str, problems: list[str]) -> Any:
    try:
        value = parent[k]
    except Exception as exc:  # interpolation / missing-value errors
        raw = None
        try:
            raw = parent._get_node(k)._value()
        except Exception:
            pass
        problems.append(_resolution_problem(key, raw, exc))
        return _MISSING
    if isinstance(value, (DictConfig, ListConfig)):
        if value._is_none():
            return None
        return _resolve(value, key, problems)
    return value


def _resolution_problem(key: str, raw: Any, exc: Exception) -> str:
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    reason = re.sub(r"^\w+ raised while resolving interpolation: ", "", reason).strip("\"'")
    if raw == "???":
        return (f"{key} has no value (???): the config requires it. "
                f"Fix: give it one, e.g. {key}=VALUE.")
    env = re.search(r"Environment variable '(\w+)' not found", reason)
    if env is None and raw is not None:
        env = re.search(r"oc\.env:([A-Za-z_]\w*)", str(raw))
    fix = (f"set the environment variable {env.group(1)}, or give {key.split('[')[0]} a literal value on the "
           "command line" if env else
           f"give {key} a value that resolves, or fix the interpolation")
    return f"{key}={_show(raw)} could not be resolved: {reason}. Fix: {fix}."


def _get(tree: Any, key: str) -> Any:
    node = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


# --------------------------------------------------------------------------- the checks


class _Checker:
    def __init__(self, cfg: DictConfig):
        self.problems: list[str] = []
        self.c = _resolve(cfg, "", self.problems)
        self.bad: set[str] = set()  # keys already reported; later checks skip them

    def add(self, key: str | None, text: str) -> None:
        self.problems.append(text)
        if key:
            self.bad.add(key)

    def val(self, key: str) -> Any:
        if key in self.bad:
            return _MISSING
        return _get(self.c, key)

    def num(self, key: str) -> int | float | None:
        v = self.val(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return None
        return v

    # 1. unknown and missing keys --------------------------------------------------------
    def structure(self) -> None:
        unbuilt: dict[str, list[str]] = {}  # strategy name -> sections of its settings in the config

        def rec(c: dict, b: dict, prefix: str) -> None:
            for k, v in c.items():
                key = f"{prefix}.{k}" if prefix else str(k)
                if k not in b and k in UNBUILT_STRATEGY_SECTIONS:
                    unbuilt.setdefault(UNBUILT_STRATEGY_SECTIONS[k], []).append(key)
                elif k not in b:
                    self._unknown(key, v)
                elif key in FREE_FORM:
                    continue
                elif isinstance(v, dict) and isinstance(b[k], dict):
                    rec(v, b[k], key)
            for k, bv in b.items():
                key = f"{prefix}.{k}" if prefix else str(k)
                if k not in c:
                    self.add(key, f"{key} is missing from the config (default {_show(bv)}): "
                                  "Ridgeline reads every key of the base config. Fix: do not "
                                  f"delete it; restore it with {key}={_show(bv)} or drop the "
                                  "override that removed it.")

        if not isinstance(self.c, dict):
            self.add(None, "The config is not a map of sections. Fix: load it with "
                           "ridgeline.config.load_config().")
            return
        rec(self.c, _base_tree(), "")
        strategy = self.val("trainer.strategy")
        for name, sections in unbuilt.items():
            if str(strategy).lower() == name.lower():
                continue  # trainer.strategy's own "not supported" sentence covers its settings
            self.add(sections[0], f"{', '.join(sections)} configure {name}, which is not built (trainer.strategy="
                                  f"{_show(strategy)}). Fix: remove them.")

    def _unknown(self, key: str, value: Any) -> None:
        if key.startswith("trainer.critic.model.lora") or key.startswith("trainer.ref.model.lora"):
            role = key.split(".")[1]
            self.add(key, f"{key}={_show(value)}: LoRA is built for the policy only ({LORA}.*); the {role} "
                          f"{'trains all its weights' if role == 'critic' else 'is the frozen base of a LoRA policy'}. "
                          "Fix: remove it.")
            return
        guess = suggest_key(key)
        if guess:
            fix = (f"did you mean {guess}? Fix: rename it, e.g. {guess}={_show(value)}"
                   if not isinstance(value, dict) else f"did you mean {guess}? Fix: rename it")
        else:
            fix = ("Fix: remove it. Free-form settings go under generator.engine_init_kwargs, "
                   "environment.skyrl_gym or data.prepare")
        self.add(key, f"{key}={_show(value)} is not a Ridgeline config key: {fix}.")

    # 2. types ---------------------------------------------------------------------------
    def types(self) -> None:
        for key in _base_leaves():
            value = self.val(key)
            if value is _MISSING:
                continue
            default = _base_default(key)
            expected = self._type_error(key, value, default)
            if expected:
                got = _type_name(value)
                if isinstance(value, list) and isinstance(default, list) and default:
                    wrong = [v for v in value if not _scalar_ok(v, default[0])]
                    if wrong:
                        got = f"a list holding {_one_of(wrong)}"
                self.add(key, f"{key}={_show(value)} has the wrong type: expected {expected}, "
                              f"got {got}. Fix: {key}=<{_placeholder(default)}>, "
                              f"e.g. the default {key}={_show(default)}.")
        # sections replaced by a scalar
        def rec(b: dict, prefix: str) -> None:
            for k, bv in b.items():
                key = f"{prefix}.{k}" if prefix else str(k)
                if isinstance(bv, dict) and bv and key not in FREE_FORM:
                    v = self.val(key)
                    if v is not _MISSING and not isinstance(v, dict):
                        self.add(key, f"{key}={_show(v)} replaces a section with "
                                      f"{_type_name(v)}: {key} holds the keys "
                                      f"{', '.join(bv)}. Fix: set its keys one at a time, "
                                      f"e.g. {key}.{next(iter(bv))}=VALUE.")
                    elif isinstance(v, dict):
                        rec(bv, key)
        rec(_base_tree(), "")

    def _type_error(self, key: str, value: Any, default: Any) -> str | None:
        if key == "trainer.logger":
            if isinstance(value, str):
                return None
            if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
                return None
            return "a tracker name or a non-empty list of tracker names"
        if key == LORA_TARGETS:
            if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                return None  # an empty list or name is refused by lora(), with its own fix
            return "'all-linear' or a list of module names"
        if key in FREE_FORM and default is not None:
            return None if isinstance(value, dict) else "a map"
        if value is None and None in CHOICES.get(key, ()):
            return None  # a choice that may be null (trainer.resume_mode: SkyRL's "none")
        if default is None:
            if key == "data.prepare" and value is not None and not isinstance(value, dict):
                return "null or a map {dataset: ..., output_dir: ...}"
            return None
        if isinstance(default, list):
            if not isinstance(value, list):
                return "a list"
            if default:
                bad = [v for v in value if not _scalar_ok(v, default[0])]
                if bad:
                    return f"a list of {_PLURAL.get(type(default[0]), 'values')}"
            return None
        if isinstance(default, dict):
            return None if isinstance(value, dict) else "a map"
        if _scalar_ok(value, default):
            return None
        return _type_name(default)

    # 3. choices and registries ----------------------------------------------------------
    def choices(self) -> None:
        for key, allowed in CHOICES.items():
            v = self.val(key)
            if v is _MISSING or v in allowed:
                continue
            self._not_one_of(key, v, allowed)
        logger = self.val("trainer.logger")
        if logger is not _MISSING:
            entries = [logger] if isinstance(logger, str) else list(logger)
            unknown = [e for e in entries if e not in LOGGERS]
            if unknown:
                self.add("trainer.logger",
                         f"trainer.logger={_show(logger)} names unknown tracker(s) "
                         f"{_one_of(unknown)}: trackers are {_one_of(LOGGERS)}. Fix: e.g. "
                         "trainer.logger=console, or a list such as trainer.logger=[console,jsonl].")
        self._registry_checks()

    def _not_one_of(self, key: str, v: Any, allowed: Iterable[Any]) -> None:
        allowed = list(allowed)
        strs = [a for a in allowed if isinstance(a, str)]
        close = difflib.get_close_matches(str(v), strs, n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]}?" if close else ""
        fix_value = close[0] if close else _base_default(key)
        self.add(key, f"{key}={_show(v)} is not a valid choice: it must be {_one_of(allowed)}."
                      f"{hint} Fix: e.g. {key}={_show(fix_value)}.")

    def _registry_checks(self) -> None:
        estimators, losses = _registries()
        key = "trainer.algorithm.advantage_estimator"
        v = self.val(key)
        if isinstance(v, str):
            self._registered(key, v, estimators, support.KNOWN_ADVANTAGE_ESTIMATORS,
                             "advantage estimator", "ADVANTAGE_ESTIMATORS")
        for key in ("trainer.algorithm.policy_loss_type", "trainer.algorithm.ppo_loss_type"):
            v = self.val(key)
            if isinstance(v, str):
                self._registered(key, v, losses, support.KNOWN_POLICY_LOSSES,
                                 "policy loss", "POLICY_LOSSES")

    def _registered(self, key: str, name: str, registry: Any, known: Iterable[str],
                    what: str, attr: str) -> None:
        if name in registry:
            return
        if ":" in name and hasattr(registry, "import_path"):
            try:
                registry.import_path(name)
                return
            except Exception as exc:  # the user's module: any failure is a config problem
                self.add(key, f"{key}={name} could not be imported ({type(exc).__name__}: {exc}). "
                              f"Fix: name a function as 'my_pkg.my_module:my_function' on the Python "
                              "path (PYTHONPATH or an installed package).")
                return
        built = sorted(registry.names())
        fix = f"Fix: {key}={built[0]}" if built else "Fix: register one"
        if name in known:
            self.add(key, f"{key}={name} is not supported yet: Ridgeline has not built the {name} "
                          f"{what}. Built: {_one_of(built)}. {fix}.")
        else:
            close = difflib.get_close_matches(name, list(built) + list(known), n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]}?" if close else ""
            self.add(key, f"{key}={name} is not a registered {what}.{hint} Registered: "
                          f"{_one_of(built)}. Fix: pick one of those, or register your own in "
                          f"ridgeline.algorithms.{attr} before the config is loaded.")

    # 4. numbers -------------------------------------------------------------------------
    def numbers(self) -> None:
        positive_ints = [
            "trainer.epochs", "trainer.update_epochs_per_batch", "trainer.train_batch_size",
            "trainer.policy_mini_batch_size", "trainer.critic_mini_batch_size",
            "trainer.micro_train_batch_size_per_gpu", "trainer.micro_forward_batch_size_per_gpu",
            "trainer.max_prompt_length", "trainer.eval_batch_size",
            "generator.n_samples_per_prompt", "generator.eval_n_samples_per_prompt",
            "generator.max_input_length", "generator.max_turns",
            "generator.num_inference_engines", "generator.inference_engine_tensor_parallel_size",
            "generator.inference_engine_pipeline_parallel_size", "generator.inference_engine_data_parallel_size",
            "generator.inference_engine_expert_parallel_size",
            "generator.sampling_params.max_generate_length",
            "generator.eval_sampling_params.max_generate_length",
        ]
        for key in positive_ints:
            v = self.num(key)
            if v is not None and v < 1:
                self.add(key, f"{key}={_show(v)} must be a positive whole number (at least 1). "
                              f"Fix: e.g. {key}={_show(_base_default(key))}.")
        for key in ("trainer.policy.optimizer_config.lr", "trainer.critic.optimizer_config.lr"):
            v = self.num(key)
            if v is not None and v <= 0:
                self.add(key, f"{key}={_show(v)} must be greater than 0: the optimizer would not "
                              f"move the weights. Fix: e.g. {key}={_show(_base_default(key))}.")
        for role in ("policy", "critic"):
            key = f"trainer.{role}.optimizer_config.num_warmup_steps"
            own, shared = self.num(key), self.num("trainer.num_warmup_steps")
            if own and shared and own != shared:
                self.add(key, f"{key}={_show(own)} and trainer.num_warmup_steps={_show(shared)} both set the "
                              f"{role}'s warmup. Fix: set one of them (the other 0).")
        for key in ("trainer.num_warmup_steps",
                    "trainer.policy.optimizer_config.num_warmup_steps",
                    "trainer.critic.optimizer_config.num_warmup_steps",
                    "trainer.policy.optimizer_config.weight_decay",
                    "trainer.policy.optimizer_config.max_grad_norm",
                    "trainer.critic.optimizer_config.weight_decay",
                    "trainer.critic.optimizer_config.max_grad_norm",
                    "trainer.algorithm.kl_loss_coef"):
            v = self.num(key)
            if v is not None and v < 0:
                self.add(key, f"{key}={_show(v)} must not be negative. "
                              f"Fix: e.g. {key}={_show(_base_default(key))}.")
        for key, example in (("generator.weight_sync_timeout", 60), ("generator.remote_request_timeout_s", 600),
                             ("environment.step_timeout_s", 60)):
            v = self.num(key)
            if v is not None and v <= 0:
                self.add(key, f"{key}={_show(v)} must be a positive number of seconds. Fix: e.g. {key}={example}.")
        key = "generator.weight_transfer_threshold_cuda_ipc_GB"
        v = self.num(key)
        if v is not None and v <= 0:
            self.add(key, f"{key}={_show(v)} must be a positive number of GiB (the largest CUDA IPC bucket of a "
                          f"colocated weight sync). Fix: e.g. {key}=1.0.")
        v = self.num("generator.remote_max_retries")
        if v is not None and v < 0:
            self.add("generator.remote_max_retries",
                     f"generator.remote_max_retries={_show(v)} must be 0 or more. Fix: e.g. "
                     "generator.remote_max_retries=3.")
        v = self.num("trainer.eval_interval")
        if v is not None and v != -1 and v < 1:
            self.add("trainer.eval_interval",
                     f"trainer.eval_interval={_show(v)} must be a positive number of steps, or -1 "
                     "to turn periodic evaluation off. Fix: trainer.eval_interval=-1 or e.g. 5.")
        self._checkpoints()
        for key in ("trainer.policy.optimizer_config.adam_betas",
                    "trainer.critic.optimizer_config.adam_betas"):
            v = self.val(key)
            if isinstance(v, list) and (len(v) != 2 or any(
                    isinstance(b, (int, float)) and not 0 <= b < 1 for b in v)):
                self.add(key, f"{key}={_show(v)} must be two numbers in [0, 1) (beta1, beta2). "
                              f"Fix: e.g. {key}=[0.9,0.999].")
        for block in ("generator.sampling_params", "generator.eval_sampling_params"):
            self._sampling(block)
        v = self.num("trainer.algorithm.eps_clip_low")
        if v is not None and not 0 <= v < 1:
            self.add("trainer.algorithm.eps_clip_low",
                     f"trainer.algorithm.eps_clip_low={_show(v)} must be in [0, 1): the ratio is "
                     "clipped below at 1 - eps_clip_low, which must stay positive. "
                     "Fix: e.g. trainer.algorithm.eps_clip_low=0.2.")
        v = self.num("trainer.algorithm.eps_clip_high")
        if v is not None and v < 0:
            self.add("trainer.algorithm.eps_clip_high",
                     f"trainer.algorithm.eps_clip_high={_show(v)} must be 0 or more: the ratio is "
                     "clipped above at 1 + eps_clip_high. "
                     "Fix: e.g. trainer.algorithm.eps_clip_high=0.2 (0.28 for clip-higher).")

    def _checkpoints(self) -> None:
        meaning = {"trainer.ckpt_interval": ("off", "a checkpoint every N steps", 10),
                   "trainer.hf_save_interval": ("off", "a Hugging Face export every N steps", 10),
                   "trainer.max_ckpts_to_keep": ("keep all", "keep the N newest checkpoints", 3)}
        for key, (minus_one, n, example) in meaning.items():
            v = self.num(key)
            if v is not None and v != -1 and v < 1:
                self.add(key, f"{key}={_show(v)} must be -1 ({minus_one}) or a whole number N >= 1 "
                              f"({n}). Fix: {key}=-1 or e.g. {key}={example}.")
        if self.val("trainer.resume_mode") == "from_path":
            path = self.val("trainer.resume_path")
            if path is None or (isinstance(path, str) and not path.strip()):
                self.add("trainer.resume_path",
                         "trainer.resume_mode=from_path loads the checkpoint named by "
                         "trainer.resume_path, but trainer.resume_path is null. Fix: "
                         "trainer.resume_path=<ckpt_path>/global_step_N, or "
                         "trainer.resume_mode=latest to take the newest checkpoint in trainer.ckpt_path.")

    def _sampling(self, block: str) -> None:
        key = f"{block}.temperature"
        v = self.num(key)
        if v is not None and v < 0:
            self.add(key, f"{key}={_show(v)} must be 0 or more (0 means greedy decoding). "
                          f"Fix: e.g. {key}=1.0.")
        key = f"{block}.top_p"
        v = self.num(key)
        if v is not None and not 0 < v <= 1:
            self.add(key, f"{key}={_show(v)} must be in (0, 1]: it is the probability mass kept "
                          f"when sampling. Fix: e.g. {key}=1.0 (no nucleus cut).")
        key = f"{block}.min_p"
        v = self.num(key)
        if v is not None and not 0 <= v < 1:
            self.add(key, f"{key}={_show(v)} must be in [0, 1). Fix: e.g. {key}=0.0 (off).")
        key = f"{block}.top_k"
        v = self.num(key)
        if v is not None and v != -1 and v < 1:
            self.add(key, f"{key}={_show(v)} must be -1 (off) or at least 1. Fix: e.g. {key}=-1.")
        key = f"{block}.repetition_penalty"
        v = self.num(key)
        if v is not None and v <= 0:
            self.add(key, f"{key}={_show(v)} must be greater than 0 (1.0 is off; above 1 discourages "
                          f"repeating tokens). Fix: e.g. {key}=1.0.")
        key = f"{block}.logprobs"
        v = self.val(key)
        if v is not _MISSING and v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            self.add(key, f"{key}={_show(v)} must be null or a whole number N >= 0: the engine then also "
                          f"returns the N most likely tokens of each position. Fix: {key}=null or e.g. {key}=5.")
        key = f"{block}.stop"
        v = self.val(key)
        if v is not _MISSING and v is not None and not (
                isinstance(v, list) and all(isinstance(s, str) and s for s in v)):
            example = repr(v) if isinstance(v, str) and v else "'</answer>'"
            self.add(key, f"{key}={_show(v)} must be null or a list of non-empty stop strings. "
                          f"Fix: e.g. \"{key}=[{example}]\" (quoted for the shell).")

    # 5. batch arithmetic ----------------------------------------------------------------
    def batches(self) -> None:
        tbs = self.num("trainer.train_batch_size")
        n = self.num("generator.n_samples_per_prompt")
        micro = self.num("trainer.micro_train_batch_size_per_gpu")
        strategy = self.val("trainer.strategy")
        self._batch_role("policy", tbs, n, micro, strategy)
        if self.val("trainer.critic.model.path") is not None:
            self._batch_role("critic", tbs, n, micro, strategy)

    def _batch_role(self, role: str, tbs: Any, n: Any, micro: Any, strategy: Any) -> None:
        mkey = f"trainer.{role}_mini_batch_size"
        mini = self.num(mkey)
        if not all(isinstance(x, int) and x >= 1 for x in (tbs, mini)):
            return
        if mini > tbs:
            self.add(mkey, f"{mkey}={mini} is larger than trainer.train_batch_size={tbs}: a "
                           f"mini-batch is a slice of the {tbs} prompts of one step. Fix: choose "
                           f"a mini-batch size that divides {tbs} ({_divisor_text(tbs)}).")
            return
        if tbs % mini:
            self.add(mkey, f"{mkey}={mini} does not divide trainer.train_batch_size={tbs}: each "
                           f"step splits the {tbs} prompts into mini-batches of {mini} for "
                           f"optimizer steps. Fix: choose a mini-batch size that divides {tbs} "
                           f"({_divisor_text(tbs)}).")
        if not all(isinstance(x, int) and x >= 1 for x in (n, micro)):
            return
        nodes_key = f"trainer.placement.{role}_num_nodes"
        gpus_key = f"trainer.placement.{role}_num_gpus_per_node"
        if strategy == "single":
            dp, dp_why = 1, "1 data-parallel rank (strategy single)"
        else:
            nodes, gpus = self.num(nodes_key), self.num(gpus_key)
            if not all(isinstance(x, int) and x >= 1 for x in (nodes, gpus)):
                return
            dp = nodes * gpus
            dp_why = (f"{dp} data-parallel ranks ({nodes_key}={nodes} x {gpus_key}={gpus}, "
                      f"strategy {strategy})")
        samples = mini * n
        if samples % dp:
            self.add(mkey, f"{mkey}={mini} x generator.n_samples_per_prompt={n} = {samples} "
                           f"samples per optimizer step cannot be split evenly over {dp_why}. "
                           f"Fix: make {mkey} x n_samples_per_prompt a multiple of {dp}, or change "
                           "the number of ranks.")
            return
        per_rank = samples // dp
        if per_rank % micro:
            self.add("trainer.micro_train_batch_size_per_gpu",
                     f"trainer.micro_train_batch_size_per_gpu={micro} does not divide the "
                     f"{per_rank} samples each rank trains on per {role} optimizer step "
                     f"({mkey}={mini} x generator.n_samples_per_prompt={n} / {dp_why}): "
                     "gradient accumulation needs whole micro-batches. Fix: choose a micro-batch "
                     f"size that divides {per_rank} ({_divisor_text(per_rank)}).")

    # learning-rate schedules ---------------------------------------------------------
    def schedules(self) -> None:
        """`optimizer_config.scheduler`: a transformers schedule that needs only warmup and training
        steps, with a warmup it acts on and (polynomial) an lr above its end."""
        from ridgeline.training.optim import LR_SCHEDULES, POLYNOMIAL_LR_END, UNBUILT_LR_SCHEDULES
        shared = self.num("trainer.num_warmup_steps")
        for role in ("policy", "critic"):
            key = f"trainer.{role}.optimizer_config.scheduler"
            name = self.val(key)
            if not isinstance(name, str):
                continue  # a wrong type was reported by types()
            if name in UNBUILT_LR_SCHEDULES:
                self.add(key, f"{key}={name} needs {UNBUILT_LR_SCHEDULES[name]}, which SkyRL 0.3.1 does not pass to "
                              f"transformers' get_scheduler either: the schedules built are {_one_of(LR_SCHEDULES)}. "
                              f"Fix: e.g. {key}=cosine.")
                continue
            if name not in LR_SCHEDULES:
                close = difflib.get_close_matches(name, LR_SCHEDULES, n=1, cutoff=0.6)
                hint = f" Did you mean {close[0]}?" if close else ""
                self.add(key, f"{key}={_show(name)} is not a learning-rate schedule: the schedules built are "
                              f"transformers' {_one_of(LR_SCHEDULES)}.{hint} "
                              f"Fix: e.g. {key}={close[0] if close else 'constant_with_warmup'}.")
                continue
            warmup = self.num(f"trainer.{role}.optimizer_config.num_warmup_steps") or shared
            if name == "constant" and warmup:
                self.add(key, f"{key}=constant has no warmup, so the {role}'s num_warmup_steps={_show(warmup)} would "
                              f"be ignored. Fix: {key}=constant_with_warmup, or num_warmup_steps=0.")
            lr = self.num(f"trainer.{role}.optimizer_config.lr")
            if name == "polynomial" and lr is not None and lr <= POLYNOMIAL_LR_END:
                self.add(key, f"{key}=polynomial decays to transformers' lr_end={POLYNOMIAL_LR_END:g}, which must be "
                              f"below trainer.{role}.optimizer_config.lr={_show(lr)}. Fix: a larger lr, or "
                              f"{key}=linear (decays to 0).")

    # placement of multi-process runs ---------------------------------------------------
    def placement(self) -> None:
        strategy = self.val("trainer.strategy")
        if strategy not in ("fsdp2", "fsdp"):
            return
        from ridgeline.distributed.placement import PlacementConfigError, plan_placement
        from ridgeline.inference.parallelism import EngineParallelism
        critic = self.val("trainer.critic.model.path")
        a = "trainer.algorithm"
        use_ref = self.val(f"{a}.use_kl_loss") is True or self.val(f"{a}.use_kl_in_reward") is True
        engine = EngineParallelism(*(self.num(f"generator.inference_engine_{kind}_parallel_size") or 1
                                     for kind in ("tensor", "pipeline", "data", "expert")))
        try:
            plan = plan_placement(self.val("trainer.placement"), num_engines=self.num("generator.num_inference_engines"),
                                  engine=engine, use_ref=use_ref,
                                  use_critic=critic is not None and critic is not _MISSING, device="CPU",
                                  remote_engines=self.val("generator.run_engines_locally") is False)
        except PlacementConfigError as exc:
            self.add("trainer.placement", str(exc))
            return
        except Exception:  # noqa: BLE001 - a wrong type was reported by types()
            return
        for role, ranks in plan.ranks.items():
            key = f"trainer.{role}.fsdp_config.fsdp_size"
            size = self.num(key)
            if isinstance(size, int) and size > 0 and ranks % size:
                self.add(key, f"{key}={size} must divide the {ranks} {role} ranks (hybrid sharding: shard "
                              f"groups of {size} ranks, replicated). Fix: {key}=-1 (shard over all ranks), or a "
                              f"divisor of {ranks} ({_divisor_text(ranks)}).")
        tbs, n = self.num("trainer.policy_mini_batch_size"), self.num("generator.n_samples_per_prompt")
        ref_ranks = plan.ranks.get("ref")
        if ref_ranks and isinstance(tbs, int) and isinstance(n, int) and (tbs * n) % ref_ranks:
            self.add("trainer.placement.ref_num_gpus_per_node",
                     f"the reference's {ref_ranks} ranks cannot split a mini-batch of trainer.policy_mini_batch_size"
                     f"={tbs} x generator.n_samples_per_prompt={n} = {tbs * n} samples evenly. Fix: give the "
                     "reference the policy's placement (trainer.placement.ref_* = policy_*).")

    def chat_template(self) -> None:
        source, path = self.val("generator.chat_template.source"), self.val("generator.chat_template.name_or_path")
        key = "generator.chat_template.name_or_path"
        if source == "file" and not (isinstance(path, str) and Path(path).is_file()):
            self.add(key, f"{key}={_show(path)}: generator.chat_template.source=file needs the path of a Jinja "
                          f"template file that exists. Fix: {key}=/path/to/template.jinja")
        elif source == "name" and path is not None:
            self.add(key, f"{key}={_show(path)} names a template of SkyRL's library, which is not built here. Fix: "
                          "generator.chat_template.source=file with the template's file, or name_or_path=null "
                          "for the model's own")

    def device(self) -> None:
        value = self.val("trainer.device")
        if not isinstance(value, str):
            return  # a wrong type was reported by types()
        from ridgeline.models.device import resolve_device
        try:
            resolve_device(value)
        except ValueError as exc:
            self.add("trainer.device", str(exc))

    # inference engines -----------------------------------------------------------------
    def engines(self) -> None:
        backend, local = self.val("generator.backend"), self.val("generator.run_engines_locally")
        kwargs = self.val("generator.engine_init_kwargs")
        # pipeline / data / expert parallel sizes other than 1 (positive: numbers() checked)
        sizes = {kind: self.num(f"generator.inference_engine_{kind}_parallel_size")
                 for kind in ("pipeline", "data", "expert")}
        changed = {f"generator.inference_engine_{kind}_parallel_size": v for kind, v in sizes.items()
                   if isinstance(v, int) and v > 1}
        key = "generator.vllm_v1_disable_multiproc"
        if self.val(key) is False and not (backend == "vllm" and local is not False):
            where = "on remote servers" if local is False else f"generator.backend={_show(backend)}"
            self.add(key, f"{key}=false runs a vLLM engine core in a child process, but the engines here are {where}, "
                          f"which have no vLLM engine core. Fix: {key}=true (the default).")
        if local is False:
            urls = self.val("generator.remote_inference_engine_urls")
            if not isinstance(urls, list) or not urls or not all(isinstance(u, str) and u.strip() for u in urls):
                self.add("generator.remote_inference_engine_urls",
                         f"generator.remote_inference_engine_urls={_show(urls)} must list the servers when "
                         "generator.run_engines_locally=false. Fix: e.g. "
                         "generator.remote_inference_engine_urls=['127.0.0.1:8001','10.0.0.2:8001'].")
            for key, v in changed.items():
                self.add(key, f"{key}={v} sizes engines Ridgeline starts, but generator.run_engines_locally=false uses "
                              f"servers started elsewhere, with their own parallelism. Fix: {key}=1, and start the "
                              "servers with the parallelism they need.")
            return
        if backend != "hf":
            self._library_engine_parallelism(sizes)
            return
        for key, v in changed.items():
            self.add(key, f"{key}={v}: the embedded hf engine runs on one device. Fix: {key}=1, or a "
                          "vllm / sglang engine (generator.backend=vllm or sglang).")
        tp = self.num("generator.inference_engine_tensor_parallel_size")
        if isinstance(tp, int) and tp not in (1, _base_default("generator.inference_engine_tensor_parallel_size")):
            self.add("generator.inference_engine_tensor_parallel_size",
                     f"generator.inference_engine_tensor_parallel_size={tp}: the embedded hf engine runs on one "
                     "device. Fix: generator.inference_engine_tensor_parallel_size=1, or a tensor-parallel "
                     "engine (generator.backend=vllm or sglang).")
        if isinstance(kwargs, dict):
            unknown = sorted(set(kwargs) - set(HF_ENGINE_KWARGS))
            if unknown:
                self.add("generator.engine_init_kwargs",
                         f"generator.engine_init_kwargs has {', '.join(unknown)}, which the embedded hf engine "
                         f"does not take (it takes {_one_of(HF_ENGINE_KWARGS)}). Fix: remove the "
                         f"+generator.engine_init_kwargs.* overrides, or use generator.backend=vllm or sglang, "
                         "whose engines receive them as is.")

    def _library_engine_parallelism(self, sizes: dict[str, int | None]) -> None:
        """vllm / sglang engines: expert parallelism is over the tensor-parallel ranks (each
        data-parallel rank is an engine of its own, ridgeline.inference.parallelism); data-parallel
        replicas need engine processes of their own."""
        g = "generator.inference_engine"
        tp, dp, ep = self.num(f"{g}_tensor_parallel_size"), sizes["data"], sizes["expert"]
        if isinstance(ep, int) and ep > 1 and isinstance(dp, int) and dp > 1:
            self.add(f"{g}_expert_parallel_size",
                     f"{g}_expert_parallel_size={ep} with {g}_data_parallel_size={dp}: expert parallelism over "
                     "data-parallel ranks needs vLLM's data-parallel group, which Ridgeline's engines (one engine "
                     f"process per data-parallel rank) do not form. Fix: {g}_data_parallel_size=1 and "
                     f"{g}_expert_parallel_size={g}_tensor_parallel_size.")
        elif isinstance(ep, int) and ep > 1 and isinstance(tp, int) and ep != tp:
            self.add(f"{g}_expert_parallel_size",
                     f"{g}_expert_parallel_size={ep} must equal {g}_tensor_parallel_size={tp} (SkyRL's rule: expert = "
                     "data x tensor, and data is 1): the experts are sharded over the tensor-parallel ranks. Fix: "
                     f"{g}_expert_parallel_size={tp}, or 1 to turn expert parallelism off.")
        if isinstance(dp, int) and dp > 1 and self.val("trainer.strategy") == "single":
            self.add(f"{g}_data_parallel_size",
                     f"{g}_data_parallel_size={dp} runs {dp} engine processes per engine, but trainer.strategy=single "
                     f"runs one engine inside the trainer's process. Fix: trainer.strategy=fsdp2 (engines as Ray "
                     f"actors), or {g}_data_parallel_size=1.")

    # 6. exclusive switches --------------------------------------------------------------
    def kl(self) -> None:
        if self.val("trainer.algorithm.use_kl_loss") is True and \
                self.val("trainer.algorithm.use_kl_in_reward") is True:
            self.add(None, "trainer.algorithm.use_kl_loss=true and "
                           "trainer.algorithm.use_kl_in_reward=true cannot both be on: the KL "
                           "penalty to the reference model is applied either as a loss term or "
                           "subtracted from the reward, not both. Fix: keep the KL loss "
                           "(trainer.algorithm.use_kl_in_reward=false), or move it into the "
                           "reward (trainer.algorithm.use_kl_loss=false).")

    def tis(self) -> None:
        cap = self.val("trainer.algorithm.tis_imp_ratio_cap")
        if self.val("trainer.algorithm.use_tis") is True and isinstance(cap, (int, float)) and cap <= 0:
            self.add("trainer.algorithm.tis_imp_ratio_cap",
                     f"trainer.algorithm.use_tis=true needs a positive trainer.algorithm.tis_imp_ratio_cap "
                     f"(got {cap}): it caps the importance weight exp(old - rollout logprob) of each "
                     "token. Fix: trainer.algorithm.tis_imp_ratio_cap=2.0 (a common choice), or "
                     "use_tis=false.")

    # algorithm features that need other settings ----------------------------------------
    def algorithm_features(self) -> None:
        a = "trainer.algorithm"
        critic_path = self.val("trainer.critic.model.path")
        if self.val(f"{a}.advantage_estimator") == "gae" and critic_path is None:
            self.add("trainer.critic.model.path",
                     f"{a}.advantage_estimator=gae needs a critic (value model), but "
                     "trainer.critic.model.path is null. Fix: trainer.critic.model.path=<the "
                     "policy's path, a common start>, or a critic-free estimator such as "
                     f"{a}.advantage_estimator=grpo.")
        estimator = self.val(f"{a}.advantage_estimator")
        if critic_path is not None and critic_path is not _MISSING and estimator in CRITIC_FREE_ESTIMATORS:
            self.add("trainer.critic.model.path",
                     f"trainer.critic.model.path={critic_path} builds and trains a critic, but "
                     f"{a}.advantage_estimator={estimator} never reads its values. Fix: "
                     f"{a}.advantage_estimator=gae to use the critic, or trainer.critic.model.path=null.")
        v = self.val("trainer.update_ref_every_epoch")
        if v is True and self.val(f"{a}.use_kl_loss") is not True and \
                self.val(f"{a}.use_kl_in_reward") is not True:
            self.add("trainer.update_ref_every_epoch",
                     "trainer.update_ref_every_epoch=true refreshes the reference model, but no "
                     f"KL option uses one ({a}.use_kl_loss and use_kl_in_reward are both off). "
                     f"Fix: {a}.use_kl_loss=true, or trainer.update_ref_every_epoch=false.")
        if self.val(f"{a}.use_kl_in_reward") is True and self.val(f"{a}.kl_ctrl.type") == "adaptive":
            for key in (f"{a}.kl_ctrl.kl_target", f"{a}.kl_ctrl.horizon"):
                v = self.num(key)
                if v is not None and v <= 0:
                    self.add(key, f"{key}={_show(v)} must be greater than 0 for the adaptive KL "
                                  f"controller. Fix: e.g. {key}={_show(_base_default(key))}.")
        ds = self.val(f"{a}.dynamic_sampling.type")
        if ds is not None and ds is not _MISSING:
            n = self.num("generator.n_samples_per_prompt")
            if n == 1:
                self.add(f"{a}.dynamic_sampling.type",
                         f"{a}.dynamic_sampling.type={ds} keeps only prompt groups whose rewards "
                         "differ, and a group of generator.n_samples_per_prompt=1 never does. "
                         "Fix: generator.n_samples_per_prompt=8 (or more than 1), or "
                         f"{a}.dynamic_sampling.type=null.")
            v = self.num(f"{a}.dynamic_sampling.max_sample_batches")
            if ds == "filter" and v is not None and v < 1:
                self.add(f"{a}.dynamic_sampling.max_sample_batches",
                         f"{a}.dynamic_sampling.max_sample_batches={_show(v)} must be at least 1: "
                         "it is how many batches filter may generate in one step. "
                         f"Fix: e.g. {a}.dynamic_sampling.max_sample_batches=30.")
            v = self.num(f"{a}.dynamic_sampling.min_replace_ratio")
            if ds == "replace" and v is not None and not 0 <= v <= 1:
                self.add(f"{a}.dynamic_sampling.min_replace_ratio",
                         f"{a}.dynamic_sampling.min_replace_ratio={_show(v)} must be in [0, 1]: the "
                         "share of groups with signal needed before the others are replaced. "
                         f"Fix: e.g. {a}.dynamic_sampling.min_replace_ratio=0.3.")
        buf = self.val(f"{a}.overlong_buffer_len")
        max_len = self.num("generator.sampling_params.max_generate_length")
        if buf is not None and buf is not _MISSING:
            if isinstance(buf, bool) or not isinstance(buf, int) or buf < 1 or \
                    (isinstance(max_len, int) and buf > max_len):
                self.add(f"{a}.overlong_buffer_len",
                         f"{a}.overlong_buffer_len={_show(buf)} must be null (off) or a whole number "
                         f"of tokens from 1 to generator.sampling_params.max_generate_length"
                         f"{'=' + str(max_len) if isinstance(max_len, int) else ''}: responses longer "
                         "than max_generate_length - overlong_buffer_len lose reward. "
                         f"Fix: e.g. {a}.overlong_buffer_len={max(1, (max_len or 4) // 4)}.")
        v = self.num(f"{a}.overlong_buffer_penalty_factor")
        if v is not None and v < 0:
            self.add(f"{a}.overlong_buffer_penalty_factor",
                     f"{a}.overlong_buffer_penalty_factor={_show(v)} must not be negative (it is "
                     f"the reward lost at full length). Fix: {a}.overlong_buffer_penalty_factor=1.0.")
        self._loss_settings()

    def _loss_settings(self) -> None:
        a = "trainer.algorithm"
        loss = self.val(f"{a}.policy_loss_type")
        if loss is None or loss is _MISSING:
            loss = self.val(f"{a}.ppo_loss_type")
        checks = {
            "dual_clip": [(f"{a}.clip_ratio_c", lambda v: v > 1, "greater than 1")],
            "cispo": [(f"{a}.cispo.cispo_eps_clip_low", lambda v: 0 <= v <= 1, "in [0, 1]"),
                      (f"{a}.cispo.cispo_eps_clip_high", lambda v: v >= 0, "0 or more")],
            "clip_cov": [(f"{a}.clip_cov.clip_ratio", lambda v: 0 < v <= 1, "in (0, 1]")],
            "kl_cov": [(f"{a}.kl_cov.kl_cov_frac", lambda v: 0 < v <= 1, "in (0, 1]"),
                       (f"{a}.kl_cov.ppo_kl_coef", lambda v: v >= 0, "0 or more")],
            "sapo": [(f"{a}.sapo.tau_pos", lambda v: v > 0, "greater than 0"),
                     (f"{a}.sapo.tau_neg", lambda v: v > 0, "greater than 0")],
        }
        for key, ok, words in checks.get(loss, []):
            v = self.num(key)
            if v is not None and not ok(v):
                self.add(key, f"{key}={_show(v)} must be {words} for the {loss} policy loss. "
                              f"Fix: e.g. {key}={_show(_base_default(key))}.")
        if loss == "clip_cov":
            lb, ub = self.num(f"{a}.clip_cov.clip_cov_lb"), self.num(f"{a}.clip_cov.clip_cov_ub")
            if lb is not None and ub is not None and lb >= ub:
                self.add(f"{a}.clip_cov.clip_cov_lb",
                         f"{a}.clip_cov.clip_cov_lb={_show(lb)} must be below clip_cov_ub={_show(ub)}: "
                         "tokens whose covariance lies between them are candidates for clipping. "
                         f"Fix: e.g. {a}.clip_cov.clip_cov_lb=1.0 {a}.clip_cov.clip_cov_ub=5.0.")

    # LoRA -----------------------------------------------------------------------------
    def lora(self) -> None:
        rank = self.num(f"{LORA}.rank")
        if rank is not None and rank < 0:
            self.add(f"{LORA}.rank", f"{LORA}.rank={_show(rank)} must be 0 (LoRA off: every weight trains) or a "
                                     f"positive adapter rank. Fix: {LORA}.rank=0, or e.g. {LORA}.rank=16.")
        alpha = self.num(f"{LORA}.alpha")
        if alpha is not None and alpha <= 0:
            self.add(f"{LORA}.alpha", f"{LORA}.alpha={_show(alpha)} must be greater than 0: the adapters' update is "
                                      f"scaled by alpha / rank. Fix: e.g. {LORA}.alpha=16 (or twice the rank).")
        dropout = self.num(f"{LORA}.dropout")
        if dropout is not None and not 0 <= dropout < 1:
            self.add(f"{LORA}.dropout", f"{LORA}.dropout={_show(dropout)} must be in [0, 1): the probability of "
                                        f"dropping an adapter input. Fix: {LORA}.dropout=0.0 (or e.g. 0.05).")
        targets = self.val(LORA_TARGETS)
        if (isinstance(targets, list) and (not targets or not all(t.strip() for t in targets))) or \
                (isinstance(targets, str) and not targets.strip()):
            self.add(LORA_TARGETS, f"{LORA_TARGETS}={_show(targets)} names no module to adapt. Fix: "
                                   f"{LORA_TARGETS}=all-linear (every linear layer but the output head), or a "
                                   f"list such as {LORA_TARGETS}=[q_proj,k_proj,v_proj,o_proj].")
        if not (isinstance(rank, int) and rank > 0):
            return
        strategy = self.val("trainer.strategy")
        if strategy in ("fsdp2", "fsdp"):
            self.add(f"{LORA}.rank", f"{LORA}.rank={rank} with trainer.strategy={strategy}: LoRA is built for one "
                                     "process only so far (the FSDP ranks would need the reference served by the "
                                     "policy ranks and the merged weights gathered for the engines). Fix: "
                                     f"trainer.strategy=single, or {LORA}.rank=0 for full fine-tuning.")
        a = "trainer.algorithm"
        uses_ref = self.val(f"{a}.use_kl_loss") is True or self.val(f"{a}.use_kl_in_reward") is True
        if self.val("trainer.update_ref_every_epoch") is True and uses_ref:
            self.add("trainer.update_ref_every_epoch",
                     f"trainer.update_ref_every_epoch=true with {LORA}.rank={rank}: with LoRA the reference "
                     "model is the frozen base the adapters sit on (the policy with its adapters off, no "
                     "second copy), so it cannot follow the policy. Fix: trainer.update_ref_every_epoch=false, "
                     f"or {LORA}.rank=0 to train (and refresh the reference from) the full model.")

    # 7. features not built yet ----------------------------------------------------------
    def not_yet(self) -> None:
        for key, allowed in support.SUPPORTED_VALUES.items():
            v = self.val(key)
            if v is _MISSING:
                continue
            entries = v if isinstance(v, list) else [v]
            refused = [e for e in entries if not _in(e, allowed)]
            if not refused:
                continue
            default = _base_default(key)
            at_default = " (the default)" if v == default else ""
            built = sorted(allowed, key=str)
            if key == "trainer.logger":
                fix = "trainer.logger=console (or [console,jsonl])"
            else:
                fix = f"{key}={_show(built[0])}" if len(built) == 1 else \
                    f"set {key} to {_one_of(built)}"
            self.add(key, f"{key}={_show(v)}{at_default} is not supported yet: "
                          f"{support.not_yet_note(key)}. Fix: {fix}.")
        for key, default in _base_leaves().items():
            if key in support.SUPPORTED_VALUES:
                continue
            note = support.not_yet_note(key)
            if note is None:
                continue
            v = self.val(key)
            if v is _MISSING or _same(v, default):
                continue
            if key == "generator.engine_init_kwargs":
                self.add(key, f"{key}={_show(v)} is not supported yet: {note}. Fix: remove the "
                              f"+{key}.* overrides (leave {key}={{}}).")
                continue
            self.add(key, f"{key}={_show(v)} is not supported yet: {note}. Fix: leave it at its "
                          f"default ({key}={_show(default)}).")

    # extension keys ---------------------------------------------------------------------
    def extensions(self) -> None:
        prep = self.val("data.prepare")
        if isinstance(prep, dict):
            ds = prep.get("dataset", _MISSING)
            if ds not in support.PREPARE_DATASETS:
                self.add("data.prepare.dataset",
                         f"data.prepare.dataset={_show(None if ds is _MISSING else ds)} is not a "
                         f"dataset Ridgeline can prepare: it must be "
                         f"{_one_of(sorted(support.PREPARE_DATASETS))}. Fix: e.g. "
                         "+data.prepare.dataset=gsm8k, or data.prepare=null to prepare nothing.")
            out = prep.get("output_dir", _MISSING)
            if not isinstance(out, str) or not out:
                self.add("data.prepare.output_dir",
                         f"data.prepare.output_dir={_show(None if out is _MISSING else out)} "
                         "must be a folder path: the prepared files are written there. "
                         "Fix: e.g. +data.prepare.output_dir=$HOME/data/gsm8k.")
        v = self.val("data.train_data")
        if isinstance(v, list) and not v:
            self.add("data.train_data", "data.train_data=[] lists no training files. Fix: e.g. "
                                        "data.train_data=[$HOME/data/gsm8k/train.parquet].")
        self._environment()
        v = self.val("trainer.policy.model.path")
        if isinstance(v, str) and not v.strip():
            self.add("trainer.policy.model.path",
                     "trainer.policy.model.path is empty. Fix: a hub id or a local folder, e.g. "
                     "trainer.policy.model.path=Qwen/Qwen2.5-0.5B-Instruct.")

    def _environment(self) -> None:
        key = "environment.skyrl_gym.max_env_workers"
        v = self.val(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            self.add(key, f"{key}={_show(None if v is _MISSING else v)} must be a whole number >= 0 (0: environment "
                          f"calls run one by one, without a time limit). Fix: {key}=32.")
        from ridgeline.envs import load_env_module
        from ridgeline.envs.reward_fn import load_reward_fn

        modules = self.val("environment.env_modules")
        for module in modules if isinstance(modules, list) else []:
            try:
                load_env_module(module)
            except Exception as exc:  # the user's module: any failure is a config problem
                self.add("environment.env_modules",
                         f"environment.env_modules lists {module!r}, which could not be imported "
                         f"({type(exc).__name__}: {exc}). Fix: a dotted module on the Python path or "
                         "a path to a .py file.")
        fn = self.val("environment.reward_fn")
        if isinstance(fn, str):
            try:
                load_reward_fn(fn)
            except Exception as exc:
                self.add("environment.reward_fn",
                         f"environment.reward_fn={fn} could not be loaded ({type(exc).__name__}: {exc}). "
                         "Fix: 'my_pkg.module:function' or '/path/to/file.py:function', a function "
                         "score(response_text, extras) -> float.")

    def run(self) -> list[str]:
        self.structure()
        self.types()
        self.not_yet()  # features this build does not have come first: they explain what follows
        self.choices()
        self.numbers()
        self.schedules()
        self.batches()
        self.kl()
        self.tis()
        self.algorithm_features()
        self.lora()
        self.placement()
        self.device()
        self.chat_template()
        self.engines()
        self.extensions()
        return self.problems


def _scalar_ok(value: Any, default: Any) -> bool:
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if isinstance(default, int):
        return isinstance(value, int)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    if isinstance(default, str):
        # Hydra reads `run_name=2024` as an integer; a number is a fine name
        return isinstance(value, (str, int, float))
    return True


def _placeholder(default: Any) -> str:
    return next((hint for kind, _, hint in _TYPE_WORDS if isinstance(default, kind)), "string")


def _in(value: Any, allowed: set) -> bool:
    # type-exact membership: True must not pass for 1
    return any(value == a and type(value) is type(a) for a in allowed)


def _same(value: Any, default: Any) -> bool:
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    return value == default


def _registries() -> tuple[Any, Any]:
    """The advantage-estimator and policy-loss registries of ridgeline.algorithms."""
    estimators = losses = None
    try:
        from ridgeline import algorithms
    except ImportError:
        algorithms = None
    if algorithms is not None:
        estimators = getattr(algorithms, "ADVANTAGE_ESTIMATORS", None)
        losses = getattr(algorithms, "POLICY_LOSSES", None)
    # while ridgeline.algorithms is incomplete, assume what is promised to be built
    return (estimators if estimators is not None else _Fixed({"grpo"}),
            losses if losses is not None else _Fixed({"regular", "dual_clip"}))


class _Fixed:
    def __init__(self, names: set[str]):
        self._names = names

    def names(self) -> list[str]:
        return sorted(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names


# --------------------------------------------------------------------------- API


def config_problems(cfg: DictConfig) -> list[str]:
    """Every problem of ``cfg``, one paragraph each (empty when it is fine)."""
    return _Checker(cfg).run()


def validate_config(cfg: DictConfig) -> None:
    """Raise one :class:`ConfigError` listing every problem of ``cfg``; return if none."""
    problems = config_problems(cfg)
    if problems:
        raise ConfigError(problems)
