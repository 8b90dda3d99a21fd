"""Small builders the trainer and `ridgeline eval` share: data preparation, environments, the
critic, the generator, and generator inputs. The policy and reference workers' builders live in
`ridgeline.training.build` (the Ray ranks build them too) and are re-exported here."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TYPE_CHECKING


from ridgeline import envs
from ridgeline.data import PromptDataset, PromptRow
from ridgeline.data.prepare_run import prepare_dataset
from ridgeline.data.sources import is_data_file
from ridgeline.envs import sandbox
from ridgeline.envs.registry import SKYRL_GYM_DEFAULTS
from ridgeline.envs.reward_fn import load_reward_fn, reward_fn_env
from ridgeline.errors import UserError
from ridgeline.generation.env_steps import EnvCallFailure, EnvRunner
from ridgeline.generation.generator import Generator, build_env
from ridgeline.generation.truncation import TruncationPolicy
from ridgeline.generation.types import GeneratorInput, TrajectoryID
from ridgeline.inference.types import InferenceEngine, SamplingParams
from ridgeline.models.loading import (cpu_has_fast_bf16, critic_spec, engine_dtype, is_built_locally, located_folder,
                                      model_config, ref_spec)
from ridgeline.models.source import ModelLoadError, gguf_key
from ridgeline.training.build import (build_critic, build_policy_worker, build_ref_worker, forward_options, needs_ref,
                                     policy_spec,
                                     policy_train_config, seed_everything, training_autocast_dtype,
                                     training_precision)

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema import (AlgorithmConfig, DataConfig, EnvironmentConfig, GeneratorConfig,
                                         RidgelineConfig)

__all__ = ["EnvironmentCheckError", "build_critic", "check_environments", "check_model_paths",
           "forward_options", "build_generator", "build_policy_worker", "build_ref_worker",
           "cpu_has_fast_bf16", "engine_dtype", "generator_input", "load_environments", "needs_ref",
           "policy_spec", "policy_train_config", "prepare_data", "seed_everything",
           "training_autocast_dtype", "training_precision", "truncation_policy"]

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------- builders
def prepare_data(data: DataConfig, env: EnvironmentConfig) -> None:
    """`data.prepare` (Ridgeline extension): write the dataset files first when they are missing or
    `data.prepare` changed since they were written (`ridgeline.data.prepare_run`). The rows name
    `data.prepare.env_class` when given, else `environment.env_class` when the config chose one
    (`chosen_env_class`), else the dataset's own env: the config's env is the one the prepared rows
    name, so `environment.env_class=shout` on a preset trains on shout."""
    if data.prepare is None:
        return
    spec = dict(data.prepare)
    chosen = chosen_env_class(env)
    if chosen is not None:
        spec.setdefault("env_class", chosen)
    # files only: a dataset folder or hub name (sources.py) is not something a preparer writes
    wanted = [Path(p) for p in list(data.train_data) + list(data.val_data) if is_data_file(p)]
    prepare_dataset(spec, wanted)


def chosen_env_class(env: EnvironmentConfig) -> str | None:
    """`environment.env_class` when the config (a preset, the command line) chose it; None at
    SkyRL's default (gsm8k), which every SkyRL config carries whether it means it or not."""
    value = env.env_class
    return None if value == envs.DEFAULT_ENV_CLASS else value


def load_environments(env_cfg: EnvironmentConfig) -> str | None:
    """Set the code sandbox from `environment.sandbox`, import `environment.env_modules` (their
    envs register themselves) and register `environment.reward_fn` as the env `reward_fn`; returns
    the env name every row must use instead of its own env_class (the reward function's), or None."""
    sandbox.configure(sandbox.SandboxSettings(allow_weak_isolation=bool(env_cfg.sandbox.allow_weak_isolation),
                                              packages=tuple(env_cfg.sandbox.packages)))
    for module in env_cfg.env_modules:
        envs.load_env_module(module)
    if env_cfg.reward_fn is None:
        return None
    envs.register("reward_fn", reward_fn_env(load_reward_fn(env_cfg.reward_fn)), overwrite=True)
    log.info("environment.reward_fn=%s scores every prompt (rows' env_class is ignored)", env_cfg.reward_fn)
    return "reward_fn"


def check_model_paths(cfg: RidgelineConfig) -> None:
    """Every model the run loads (the policy, the reference when a KL term needs it, the critic when
    set) located before any of them loads: a ModelLoadError naming the key (`trainer.ref.model.path`,
    ...) for a path that is no model folder and no hub model (ridgeline.models.source)."""
    specs = [policy_spec(cfg), *([ref_spec(cfg)] if needs_ref(cfg) else []), critic_spec(cfg)]
    for spec in filter(None, specs):
        if is_built_locally(spec):
            if spec.gguf_file:  # it would be ignored: the model is built from its name, no file is read
                raise ModelLoadError(
                    f"{gguf_key(spec.config_key)}={spec.gguf_file} is set, but {spec.config_key}={spec.path} builds "
                    "its model in memory from a config (tiny://, random://): there is no GGUF file to read, and the "
                    f"run would ignore it. Fix: remove {gguf_key(spec.config_key)}, or set {spec.config_key} to the "
                    "folder holding the .gguf file")
            model_config(spec)  # an unknown tiny:// or random:// name
        else:
            located_folder(spec)


class EnvironmentCheckError(UserError, ValueError):
    """An environment named by the config or a dataset row cannot be built or started (raised
    before any model loads)."""


def check_environments(env: EnvironmentConfig, data: DataConfig, max_turns: int,
                       datasets: Mapping[str, PromptDataset], env_override: str | None) -> None:
    """Before any model loads, refuse what would give a run of zero rewards with every trajectory in
    `generate/env_errors`: an `environment.env_class` (the rows' default) or an
    `environment.skyrl_gym.<name>` settings block naming an env that neither Ridgeline nor skyrl-gym
    knows (a misspelled name), and a row whose env cannot be built and started (an unknown
    env_class, settings its constructor refuses, a row missing what its env reads, e.g. the ground
    truth, a constructor, init or close that hangs past `environment.step_timeout_s`): each env is
    built and `init`-ed (then closed) as the generator will, naming the env, the file and the row.

    One build per distinct (env_class, shape of the row's extras: keys and value types, nested):
    rows of one shape carry the same fields, so a large dataset costs a handful of builds.
    `datasets`: config key (`data.train_data`) -> its rows; `max_turns`: `generator.max_turns`;
    `data`: read for `data.prepare`, which the unused env_class note names in its advice.
    """
    env_settings = per_env_settings(env)
    _check_env_names(env, env_settings, env_override)
    note = unused_env_class_note(env, datasets, prepared=data.prepare is not None)
    if note is not None:
        log.warning("%s", note)
    # on a worker thread under the step time limit, so an env that hangs stops the check, not the run
    timeout_s = float(env.step_timeout_s)
    runner = EnvRunner(max_workers=1, timeout_s=timeout_s)
    seen: set[tuple[str, object]] = set()
    for key, rows in datasets.items():
        for i, row in enumerate(rows):
            env_class = env_override or row.env_class
            shape = (env_class, _shape(row.extras))
            if shape in seen:
                continue
            seen.add(shape)
            outcome = runner.run([_start_and_stop(env_class, row, env_settings, max_turns)], desc="env check")[0]
            file, index = rows.origin(i)
            if isinstance(outcome, EnvCallFailure):   # a timeout: building it, init or close hung
                raise EnvironmentCheckError(
                    f"{key}: {file} row {index}: environment {env_class!r} did not start and stop within "
                    f"environment.step_timeout_s={timeout_s:g} s ({outcome.message}). Fix: the env (a hanging "
                    "constructor, init or close), or a longer environment.step_timeout_s")
            if isinstance(outcome, envs.UnknownEnvError):
                column = "" if env_override else ", column 'env_class'"
                raise EnvironmentCheckError(f"{key}: {file} row {index}{column}: {outcome}") from outcome
            if isinstance(outcome, _Unscorable):
                raise EnvironmentCheckError(
                    f"{key}: {file} row {index}: environment {env_class!r} can never reward this row: {outcome}; "
                    "every answer would score 0. Fix: the row's ground truth, or the env's settings "
                    f"(environment.skyrl_gym.{env_class}: the database it reads), before training")
            if outcome is not None:
                raise EnvironmentCheckError(
                    f"{key}: {file} row {index}: environment {env_class!r} could not be built and started "
                    f"({type(outcome).__name__}: {outcome}). Fix: the row (the columns its env reads) or the env's "
                    f"settings (environment.skyrl_gym.{env_class}), before training") from outcome


class _Unscorable(Exception):
    """What `Env.unscorable` said about a row."""


def _start_and_stop(env_class: str, row: PromptRow, env_settings: Mapping[str, Any],
                    max_turns: int) -> Callable[[], Exception | None]:
    """The env of `row` built, `init`-ed, asked whether the row can be scored at all, and closed as
    the generator will: None, or what it raised (`_Unscorable` for a row no answer can score)."""
    def call() -> Exception | None:
        try:
            env = build_env(env_class, row.extras, env_settings, max_turns)
            try:
                env.init(row.prompt)
                problem = env.unscorable()
            finally:
                env.close()
        except Exception as exc:
            return exc
        return _Unscorable(problem) if problem else None
    return call


def _check_env_names(env: EnvironmentConfig, env_settings: Mapping[str, Any], env_override: str | None) -> None:
    """`environment.env_class` and each `environment.skyrl_gym.<name>` must name a known env; SkyRL's
    default blocks (search, text2sql, llm_as_a_judge) are there whether or not their env is installed
    or registered (llm_as_a_judge is an example's own env)."""
    named = {f"environment.skyrl_gym.{name}": name for name in env_settings if name not in SKYRL_GYM_DEFAULTS}
    if env_override is None:  # with environment.reward_fn the rows' env (and its default) is not used
        named = {"environment.env_class": env.env_class, **named}
    for key, name in named.items():
        try:
            envs.check_env_name(name)
        except Exception as exc:
            raise EnvironmentCheckError(f"{key}: {exc}") from exc


def unused_env_class_note(env: EnvironmentConfig, datasets: Mapping[str, PromptDataset], *,
                          prepared: bool) -> str | None:
    """A chosen `environment.env_class` that no row uses changes nothing: a row's own env_class wins,
    as in SkyRL (environment.env_class is the env of rows without one). The sentence that says so,
    with the ways to make it apply (logged at start, a doctor warning), or None. `prepared`: the
    files are written by `data.prepare`."""
    chosen = chosen_env_class(env)
    if chosen is None or env.reward_fn is not None:
        return None
    if any(row.env_class == chosen for data in datasets.values() for row in data):
        return None
    named = sorted({row.env_class for data in datasets.values() for row in data})
    files = sorted({file for data in datasets.values() for file in data.files})
    how = (f"+data.prepare.env_class={chosen} (or delete the prepared files)" if prepared
           else f"an env_class column saying {chosen} in the data")
    return (f"environment.env_class={chosen} applies to no row: every row of {', '.join(files)} names its own "
            f"env_class ({', '.join(named)}), and a row's env_class wins, as in SkyRL (environment.env_class is the "
            f"env of rows without one). To train on {chosen}: {how}")


def _shape(value: Any) -> object:
    """A row's structure without its values: nested keys and value types."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _shape(v)) for k, v in value.items()))
    return type(value).__name__


def per_env_settings(env: EnvironmentConfig) -> dict[str, dict[str, Any]]:
    """`environment.skyrl_gym` by env name, without `max_env_workers` (SkyRL keeps it beside them)."""
    return {name: dict(value) for name, value in env.skyrl_gym.items() if name != "max_env_workers"}


def build_generator(g: GeneratorConfig, env: EnvironmentConfig, engine: InferenceEngine, tokenizer) -> Generator:
    """The agent loop over `engine`, from `generator.*` and `environment.*`."""
    return Generator(
        engine, tokenizer,
        env_settings=per_env_settings(env),
        max_turns=g.max_turns, max_input_length=g.max_input_length, conversation_mode=g.use_conversation_multi_turn,
        append_eos_after_stop_str=g.append_eos_token_after_stop_str_in_multi_turn,
        runner=EnvRunner(int(env.skyrl_gym["max_env_workers"]), env.step_timeout_s),
        max_observation_chars=g.max_observation_chars, max_env_error_fraction=env.max_env_error_fraction)


def generator_input(rows: list[PromptRow], n: int, params: SamplingParams, *, uid_prefix: str, mode: str,
                    env_override: str | None = None, global_step: int = 0) -> GeneratorInput:
    """`n` consecutive trajectories per row; the row's trajectories share the uid
    `<uid_prefix>-<row index>` (one GRPO group / one eval prompt)."""
    ids = [TrajectoryID(uid=f"{uid_prefix}-{i}", repetition=k) for i in range(len(rows)) for k in range(n)]
    picked = [row for row in rows for _ in range(n)]
    return GeneratorInput(prompts=[r.prompt for r in picked],
                          env_classes=[env_override or r.env_class for r in picked],
                          env_extras=[r.extras for r in picked], trajectory_ids=ids,
                          sampling_params=params, global_step=global_step, mode=mode)


def truncation_policy(g: GeneratorConfig, alg: AlgorithmConfig) -> TruncationPolicy:
    """What truncated trajectories cost (`generation.truncation`), from `generator.*` and the DAPO
    keys of `trainer.algorithm`."""
    return TruncationPolicy(zero_reward_on_non_stop=bool(g.zero_reward_on_non_stop),
                            apply_overlong_filtering=bool(g.apply_overlong_filtering),
                            overlong_buffer_len=None if alg.overlong_buffer_len is None else int(alg.overlong_buffer_len),
                            overlong_buffer_penalty_factor=float(alg.overlong_buffer_penalty_factor),
                            max_generate_length=int(g.sampling_params.max_generate_length))
