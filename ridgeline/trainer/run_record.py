"""What the trainer writes about its run into `RUN_DIR/run.json` when it starts
(`ridgeline.tracking.run_info`): the algorithm as resolved from the typed config, the hardware
this process sees, the start time (a resume of the same run keeps the first one)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import platform
import subprocess
from pathlib import Path

import torch
import transformers

import ridgeline
from ridgeline.algorithms.kl import resolve_kl_estimator
from ridgeline.tracking.run_info import (AlgorithmSummary, RunInfo, host_hardware, read_run_info,
                                         write_run_info)

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema import RidgelineConfig


def algorithm_summary(cfg: RidgelineConfig) -> AlgorithmSummary:
    """The run's algorithm by the names the workers use (`AlgorithmConfig.loss_name`: a null
    `policy_loss_type` means `ppo_loss_type` names the loss; the KL estimator as the workers resolve it)."""
    alg = cfg.trainer.algorithm
    estimator = resolve_kl_estimator(alg.kl_estimator_type, alg.use_kl_estimator_k3, alg.use_abs_kl)
    if alg.use_kl_loss:
        kl = f"KL loss ({estimator}, coef {alg.kl_loss_coef:g})"
    elif alg.use_kl_in_reward:
        kl = (f"on-policy distillation (reward -{alg.kl_loss_coef:g} x {estimator} KL to the teacher)"
              if alg.on_policy_distillation else
              f"KL in reward ({estimator}, {alg.kl_ctrl.type} coef {alg.kl_loss_coef:g})")
    else:
        kl = "none"
    return AlgorithmSummary(advantage_estimator=alg.advantage_estimator, policy_loss=alg.loss_name, kl=kl,
                            loss_reduction=alg.loss_reduction, critic=cfg.trainer.critic.model.path)


def visible_gpus() -> list[str]:
    """The names of the CUDA devices this process sees (none on a CPU-only machine). A process
    that has not opened CUDA (a Ray driver: its ranks hold the models) does not open it for this:
    the names then come from `nvidia-smi`, the machine's GPUs."""
    if not torch.cuda.is_available():
        return []
    count = torch.cuda.device_count()
    if torch.cuda.is_initialized():
        return [torch.cuda.get_device_name(i) for i in range(count)]
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        listed = []
    names = [name.strip() for name in listed if name.strip()]
    return names or [f"CUDA device {i} (name unknown)" for i in range(count)]


def start_run_info(cfg: RidgelineConfig, run_dir: Path, run_id: str, placement: str, now: float) -> RunInfo:
    """Write `run_dir/run.json` for a process that started (or resumed) run `run_id` at unix time
    `now`; returns it. The same run id in the file (a resume in the run's own folder) keeps its
    first start time and adds this start to `sessions`; any other file is another run's and is
    replaced."""
    earlier = read_run_info(run_dir)
    same = earlier if earlier is not None and earlier.run_id == run_id else None
    info = RunInfo(run_id=run_id, run_dir=str(Path(run_dir).resolve()),
                   started=same.started if same else now,
                   sessions=[*(same.sessions if same else []), now], placement=placement,
                   hardware=host_hardware(visible_gpus()), algorithm=algorithm_summary(cfg),
                   versions={"ridgeline": ridgeline.__version__, "python": platform.python_version(),
                             "torch": torch.__version__, "transformers": transformers.__version__})
    write_run_info(run_dir, info)
    return info
