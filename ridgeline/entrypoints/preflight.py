"""`ridgeline doctor`'s cheap checks, run by every training command (and `ridgeline eval`) before
anything loads.

SkyRL scripts set `generator.backend=vllm` (or `sglang`, an `attention_backend`, Ray ranks);
on a machine that cannot run them the run used to fail minutes later, after data and model load,
with a traceback. `preflight(cfg)` looks at the machine the way `ridgeline doctor` does, without
importing an engine or probing a server (`doctor.machine_facts`: versions, GPUs, which packages are
installed), and refuses the config with the first FAIL of doctor's config checks: the same sentence,
naming the key and the fix. What only doctor checks (SGLang's import in a child process, remote
servers' /health, a Ray address, disk space, the code sandbox) stays with doctor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ridgeline.entrypoints.doctor import generator_checks, machine_facts, strategy_checks
from ridgeline.entrypoints.doctor_facts import FAIL, Check, MachineFacts
from ridgeline.errors import UserError

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema import RidgelineConfig


class PreflightError(UserError):
    """The config asks for something this machine cannot run (doctor's FAIL)."""


def preflight_failures(cfg: RidgelineConfig, facts: MachineFacts, uses_engine: bool = True,
                       uses_ranks: bool = True) -> list[Check]:
    """The FAILs of doctor's config checks for `cfg` on a machine of `facts`; the engine's only when
    the command builds one (`ridgeline sft` without an env eval builds none), the strategy's only
    when it starts training ranks (`ridgeline eval` starts none)."""
    checks = ((generator_checks(cfg, facts) if uses_engine else [])
              + (strategy_checks(cfg, facts) if uses_ranks else []))
    return [check for check in checks if check.status == FAIL]


def preflight_message(failures: list[Check]) -> str:
    """Doctor's sentence of the first FAIL; the others are counted, not repeated."""
    more = (f" ({len(failures) - 1} more problem(s): `ridgeline doctor` with the same overrides lists them)"
            if len(failures) > 1 else "")
    return failures[0].detail + more


def preflight(cfg: RidgelineConfig, uses_engine: bool = True, uses_ranks: bool = True) -> None:
    """Raise `PreflightError` when `cfg` cannot run on this machine (module docstring)."""
    failures = preflight_failures(cfg, machine_facts(), uses_engine, uses_ranks)
    if failures:
        raise PreflightError(preflight_message(failures))
