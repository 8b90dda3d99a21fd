"""`ridgeline doctor`'s SGLang checks (`generator.backend=sglang`): the install, the backend it
will run on, the attention backend for the GPU, and the known issues.

- install: `import sglang.srt.entrypoints.engine` (what `sglang.Engine` needs) in a child process,
  bounded (importing SGLang is slow and can crash a process), with `SGLANG_USE_CPU_ENGINE=1` on a
  machine without CUDA as the engine sets it; FAIL when it does not import, WARN off 0.5.x (the
  adapter follows 0.5.23's ServerArgs and routes).
- backend: CUDA GPUs, or SGLang's CPU backend (torch_native attention; correct, slow: tests and
  small models; its memory release frees nothing; `make setup-sglang` builds such an install).
- attention backend by compute capability (`gpu_support`): FA3 only on SM 8.0-9.0, FlashInfer on
  other SM >= 8.0; a configured one that does not fit GPU 0 FAILs.
- known issues: `RAY_RUNTIME_ENV_HOOK` set (SkyRL's README exports uv's hook: Ray then rebuilds
  the project's uv environment in every worker, whose pins are not SGLang's), and a
  `generator.weight_sync_timeout` shorter than `SGLANG_MIN_WEIGHT_SYNC_TIMEOUT_S` where weights
  reach SGLang over an update group (servers, or engine actors on Ray).

`probe_sglang_install` gathers the facts; the checks are pure functions of them (tests feed
made-up installs and GPUs)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Mapping, TYPE_CHECKING

from ridgeline.entrypoints.doctor_facts import FAIL, NOT_CHECKED, OK, WARN, Check, MachineFacts, SGLangInstall
from ridgeline.inference.gpu_support import attention_backend_problem, fitting_attention_backend, format_capability

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema import RidgelineConfig

IMPORT_TIMEOUT_S = 180.0
# An SGLang scheduler joins the update group, and enters each broadcast, only between its batches:
# under a long batch (or a slow first start) a 60 s bound (SkyRL's default) runs out
SGLANG_MIN_WEIGHT_SYNC_TIMEOUT_S = 180.0
_PROBE = "import sglang, sglang.srt.entrypoints.engine; print(sglang.__version__)"


def probe_sglang_install(cuda: bool, python: str = sys.executable, timeout_s: float = IMPORT_TIMEOUT_S) -> SGLangInstall:
    """Import SGLang's engine in a child `python` (on its CPU backend without `cuda`)."""
    from ridgeline.inference.sglang_engine import SGLANG_CPU_ENV

    env = {**os.environ, **({} if cuda else SGLANG_CPU_ENV)}
    t0 = time.perf_counter()
    try:
        done = subprocess.run([python, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return SGLangInstall(None, f"importing sglang took over {timeout_s:g} s", not cuda, time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return SGLangInstall(lines[-1].strip(), None, not cuda, seconds)
    errors = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
    return SGLangInstall(None, errors[-1] if errors else f"exit status {done.returncode}", not cuda, seconds)


def sglang_engine_checks(attention: str | None, facts: MachineFacts) -> list[Check]:
    """An in-process SGLang engine here: the package and its import (`facts.sglang`), the backend
    it runs on, and `attention` (generator.engine_init_kwargs.attention_backend) on GPU 0."""
    name = "generator.backend"
    setup = ("make setup-sglang (SGLang's CPU backend in .venv-sglang, docs/engines.md)" if not facts.gpus
             else "pip install -e \".[sglang]\"")
    package, install = facts.packages.get("sglang"), facts.sglang
    if package is None:
        return [Check(name, FAIL, f"generator.backend=sglang needs the sglang package, which is not installed. "
                      f"Fix: {setup}, or generator.backend=hf")]
    if install is None:
        return [Check(name, NOT_CHECKED, f"sglang {package.version or '?'} is installed; its import was not tried"),
                attention_check(attention, facts)]
    if install.error is not None:
        return [Check(name, FAIL, f"generator.backend=sglang: sglang does not import here "
                      f"({'CPU backend, SGLANG_USE_CPU_ENGINE=1' if install.cpu_backend else 'CUDA'}): "
                      f"{install.error}. Fix: {setup}")]
    checks = []
    if facts.gpus:
        checks.append(Check(name, OK, f"sglang {install.version} on {len(facts.gpus)} GPU(s) "
                            f"(its engine imports in {install.seconds:.0f} s)"))
    else:
        checks.append(Check(name, OK, f"sglang {install.version} on SGLang's CPU backend (no CUDA GPU: device=cpu, "
                            "torch_native attention, SGLANG_USE_CPU_ENGINE=1): correct but slow, for tests and "
                            "small models; sleep frees nothing there"))
    if not str(install.version).startswith("0.5."):
        checks.append(Check("sglang version", WARN, f"sglang {install.version}: Ridgeline's adapter follows 0.5.23 "
                            "(ServerArgs names, routes, begin/end_weight_update); other releases may differ. "
                            "Fix: pip install sglang==0.5.23"))
    checks.append(attention_check(attention, facts))
    return checks


def attention_check(attention: str | None, facts: MachineFacts) -> Check:
    """The attention backend on GPU 0: the configured one must fit its compute capability; unset,
    the one that fits is shown (FA3 on SM 8.0-9.0, FlashInfer on other SM >= 8.0)."""
    cap = facts.gpus[0].capability if facts.gpus else None
    if attention:
        problem = attention_backend_problem(str(attention), cap)
        if problem:
            return Check("attention backend", FAIL, problem)
        if str(attention) == "flashinfer" and facts.packages.get("flashinfer") is None:
            other = fitting_attention_backend(cap) if cap else "torch_native"
            return Check("attention backend", FAIL, "attention_backend=flashinfer needs the flashinfer package, which "
                         "is not installed. Fix: pip install flashinfer-python, or "
                         f"generator.engine_init_kwargs.attention_backend={'triton' if other == 'flashinfer' else other}")
        return Check("attention backend", OK, f"{attention} on {format_capability(cap) if cap else 'the CPU'}")
    if cap is None:
        return Check("attention backend", OK, "torch_native (SGLang's CPU backend)")
    fits = fitting_attention_backend(cap)
    return Check("attention backend", OK, f"not set (SGLang picks one); {fits} fits GPU 0 ({format_capability(cap)}): "
                 f"+generator.engine_init_kwargs.attention_backend={fits}")


def sglang_known_issues(cfg: RidgelineConfig, environ: Mapping[str, str]) -> list[Check]:
    """The known SGLang problems a config and environment run into (module docstring)."""
    checks = []
    hook = environ.get("RAY_RUNTIME_ENV_HOOK")
    if hook:
        checks.append(Check("RAY_RUNTIME_ENV_HOOK", WARN, f"set ({hook}): Ray rebuilds the uv environment in every "
                            "worker, whose pins are not SGLang's (its own torch and transformers). "
                            "Fix: unset RAY_RUNTIME_ENV_HOOK"))
    group_sync = not cfg.generator.run_engines_locally or cfg.trainer.strategy != "single"
    timeout = float(cfg.generator.weight_sync_timeout)
    if group_sync and timeout < SGLANG_MIN_WEIGHT_SYNC_TIMEOUT_S:
        checks.append(Check("weight sync timeout", WARN, f"generator.weight_sync_timeout={timeout:g} s: an SGLang "
                            "scheduler joins the update group and receives each tensor only between its batches, "
                            "so a long batch or a slow start runs past it. "
                            f"Fix: generator.weight_sync_timeout={SGLANG_MIN_WEIGHT_SYNC_TIMEOUT_S:g}"))
    return checks
