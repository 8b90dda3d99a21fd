"""``environment.*`` (the env of each row, per-env settings) and ``data.*`` (the prompt files)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional

from ridgeline.config.fields import Report, Section, one_of, setting, show
from ridgeline.envs.registry import DEFAULT_ENV_CLASS, SKYRL_GYM_DEFAULTS


@dataclass
class SandboxConfig(Section):
    """Ridgeline extension: how model-written code runs (the code env, ``ridgeline.envs.sandbox``)."""

    # Programs run under bubblewrap; where it cannot run, envs that run code refuse to start unless
    # this is true: then they run with only rlimits and an audit hook (a warning in the run's log).
    allow_weak_isolation: bool = setting(False)
    # Top-level modules a program may import besides the stdlib, each bound read-only into the sandbox.
    packages: List[str] = setting(["numpy"])

    def check(self, at: str, report: Report) -> None:
        from ridgeline.envs.sandbox.bubblewrap import package_paths

        for name in self.packages:
            try:
                package_paths(name)
            except ValueError as exc:
                report.add(str(exc))


@dataclass
class EnvironmentConfig(Section):
    # the env of rows without an env_class (a row's own wins, as in SkyRL); data.prepare writes it
    # into the rows it prepares (ridgeline.trainer.builders.prepare_data)
    env_class: str = setting(DEFAULT_ENV_CLASS)
    # Per-environment settings by env name (free-form, e.g. skyrl_gym.text2sql.db_path=...) and,
    # as in SkyRL 0.3.1, max_env_workers: environment calls (step, init) running at once; 0 runs
    # them one by one in the generator's thread, without a time limit. SkyRL's defaults for its
    # search, text2sql and llm_as_a_judge envs are the defaults here (SKYRL_GYM_DEFAULTS).
    skyrl_gym: Dict[str, Any] = setting(SKYRL_GYM_DEFAULTS)
    # Ridgeline extension: seconds one environment call may take before its trajectory scores 0.
    step_timeout_s: float = setting(60.0)
    # Ridgeline extension: modules (dotted names or .py files) imported at start, so that the
    # environments they register (ridgeline.envs.register or skyrl_gym.register) can be named in
    # env_class; skyrl_gym:<id> names skyrl-gym's own env where Ridgeline has one of that name.
    env_modules: List[str] = setting([])
    # Ridgeline extension: null, or "my_pkg.module:function" / "file.py:function" with signature
    # score(response_text, extras) -> float, or TRL's reward_func(completions, prompts, **columns)
    # -> list[float]; every prompt then becomes a single-turn episode scored by it, whatever its env_class.
    reward_fn: Optional[str] = setting(None)
    # Ridgeline extension: the share of one generation call's trajectories whose environment (or
    # reward function) may raise, hang or return a bad output before the run stops with the first
    # such error and its row; each of those trajectories scores 0. 1.0: never stop.
    max_env_error_fraction: float = setting(0.1)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)

    def check(self, at: str, report: Report) -> None:
        from ridgeline.envs import load_env_module
        from ridgeline.envs.reward_fn import SIGNATURES, load_reward_fn

        self.sandbox.check(f"{at}.sandbox", report)
        key, workers = f"{at}.skyrl_gym.max_env_workers", self.skyrl_gym.get("max_env_workers")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            report.add(f"{key}={show(workers)} must be a whole number >= 0 (0: environment calls run one by one, "
                       f"without a time limit). Fix: {key}=32.")
        if self.step_timeout_s <= 0:
            report.add(f"{at}.step_timeout_s={show(self.step_timeout_s)} must be a positive number of seconds. "
                       f"Fix: e.g. {at}.step_timeout_s=60.")
        self._check_code_limits(at, report)
        for module in self.env_modules:
            try:
                load_env_module(module)
            except Exception as exc:  # the user's module: any failure is a config problem
                report.add(f"{at}.env_modules lists {module!r}, which could not be imported ({type(exc).__name__}: "
                           f"{exc}). Fix: a dotted module on the Python path or a path to a .py file.")
        if self.reward_fn is not None:
            try:
                load_reward_fn(self.reward_fn)
            except Exception as exc:
                report.add(f"{at}.reward_fn={self.reward_fn} could not be loaded ({type(exc).__name__}: {exc}). "
                           f"Fix: 'my_pkg.module:function' or '/path/to/file.py:function', a function "
                           f"{SIGNATURES}.")
        if not 0.0 <= self.max_env_error_fraction <= 1.0:
            report.add(f"{at}.max_env_error_fraction={show(self.max_env_error_fraction)} must be a share between 0 "
                       f"and 1 (1.0: never stop for environment errors). Fix: {at}.max_env_error_fraction=0.1.")


    # a sandboxed program needs ~0.1-0.3 s just to start (bubblewrap, then Python), and its CPU
    # limit is whole seconds: a shorter limit times every test case out, so every reward is 0
    CODE_MIN_TIMEOUT_S: ClassVar[float] = 1.0

    def _check_code_limits(self, at: str, report: Report) -> None:
        code = self.skyrl_gym.get("code")
        if not isinstance(code, dict):
            return
        fixes = {"timeout_s": "10 (the default)", "total_timeout_s": "60, or no total_timeout_s (no limit per step)"}
        for name in fixes:
            value = code.get(name)
            if value is None and name == "total_timeout_s":
                continue  # its default: no limit per step
            key = f"{at}.skyrl_gym.code.{name}"
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or value < self.CODE_MIN_TIMEOUT_S):
                report.add(f"{key}={show(value)} must be a number of seconds >= {self.CODE_MIN_TIMEOUT_S:g}: a "
                           "sandboxed program takes ~0.1-0.3 s just to start, so a shorter limit fails every test "
                           f"case and every reward is 0. Fix: e.g. {key}={fixes[name]}.")


@dataclass
class DataConfig(Section):
    # datasets `data.prepare.dataset` can name
    PREPARE_DATASETS: ClassVar[tuple[str, ...]] = ("arithmetic", "code", "gsm8k", "multiply", "text2sql")

    # the training prompts: parquet / json / jsonl files, dataset folders or hub name:split (docs/data.md)
    train_data: List[str] = setting(["${oc.env:HOME}/data/gsm8k/train.parquet"])
    # the evaluation prompts, in the same forms
    val_data: List[str] = setting(["${oc.env:HOME}/data/gsm8k/validation.parquet"])
    # Ridgeline extension: null, or {dataset: arithmetic|gsm8k|..., output_dir: PATH, ...options}.
    # When set, the trainer writes the dataset files into output_dir before loading data if
    # they are missing.
    prepare: Optional[Dict[str, Any]] = setting(None)

    def check(self, at: str, report: Report) -> None:
        if not self.train_data:
            report.add(f"{at}.train_data=[] lists no training files. Fix: e.g. "
                       f"{at}.train_data=[$HOME/data/gsm8k/train.parquet].")
        if self.prepare is None:
            return
        dataset = self.prepare.get("dataset")
        if dataset not in self.PREPARE_DATASETS:
            report.add(f"{at}.prepare.dataset={show(dataset)} is not a dataset Ridgeline can prepare: it must be "
                       f"{one_of(self.PREPARE_DATASETS)}. Fix: e.g. +{at}.prepare.dataset=gsm8k, or {at}.prepare=null "
                       "to prepare nothing.")
        out = self.prepare.get("output_dir")
        if not isinstance(out, str) or not out:
            report.add(f"{at}.prepare.output_dir={show(out)} must be a folder path: the prepared files are written "
                       f"there. Fix: e.g. +{at}.prepare.output_dir=$HOME/data/gsm8k.")
