"""`RUN_DIR/run.json`: who the run is, when it started, on what, with which algorithm as resolved.

The trainer writes it when a run starts (`ridgeline.trainer.run_record.start_run_info`); the run
report reads it for its header and to tell the run's own eval dumps from other runs' (SkyRL's
`<export_path>/dumped_evals/` is shared by every run with that export path). A resumed run keeps
its run id and its first start time.

    {"run_id": "3f9c...", "run_dir": "/abs/runs/tiny", "started": 1798361234.5,
     "sessions": [1798361234.5, 1798362000.1],            # the start of each process (resumes)
     "placement": "one process on cpu",
     "hardware": {"cpu": "AMD EPYC 9654 96-Core Processor", "cpus": 2, "memory_gib": 7.7,
                  "gpus": ["NVIDIA H100 80GB HBM3"]},
     "algorithm": {"advantage_estimator": "grpo", "policy_loss": "regular", "kl": "KL loss (k3, coef 0.001)",
                   "loss_reduction": "token_mean", "critic": null},
     "versions": {"ridgeline": "0.1.0", "python": "3.12.3", "torch": "2.9.0", "transformers": "4.57.1"}}
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RUN_INFO_FILE = "run.json"


@dataclass(frozen=True)
class Hardware:
    cpu: str                     # the CPU's model name
    cpus: int                    # logical CPUs this process may run on
    memory_gib: float | None     # the machine's physical memory (None where the OS does not say)
    gpus: list[str] = field(default_factory=list)   # names of the CUDA devices this process sees


@dataclass(frozen=True)
class AlgorithmSummary:
    """The algorithm the run trains with, each name as the trainer resolved it (not the raw keys:
    `policy_loss_type: null` means `ppo_loss_type` names the loss)."""

    advantage_estimator: str
    policy_loss: str
    kl: str                      # e.g. "KL loss (k3, coef 0.001)", "KL in reward (k1, coef 0.01)", "none"
    loss_reduction: str
    critic: str | None           # the critic's model path, None without one


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    run_dir: str
    started: float               # unix time of the run's first start
    sessions: list[float]        # unix time of each process that ran it (a resume adds one)
    placement: str               # where it trains, in words ("one process on cpu", "fsdp2 on Ray: ...")
    hardware: Hardware
    algorithm: AlgorithmSummary
    versions: dict[str, str]


def cpu_model() -> str:
    """The CPU's model name: /proc/cpuinfo's `model name` on Linux, else what `platform` says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware")) and ":" in line:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def host_hardware(gpus: list[str]) -> Hardware:
    """This machine's CPU and memory, with the GPU names the caller found (torch knows them)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):  # not a POSIX system that reports it
        memory = None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return Hardware(cpu=cpu_model(), cpus=cpus, memory_gib=round(memory, 1) if memory else None, gpus=list(gpus))


def write_run_info(run_dir: str | Path, info: RunInfo) -> Path:
    """`run_dir/run.json`, replaced whole (written to a temp file, then renamed)."""
    path = Path(run_dir) / RUN_INFO_FILE
    tmp = path.with_name(f".{RUN_INFO_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(info), indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_run_info(run_dir: str | Path) -> RunInfo | None:
    """The run's `run.json`; None when there is none or it is not one (a hand-edited or older
    file: the report then says what it cannot tell)."""
    path = Path(run_dir) / RUN_INFO_FILE
    try:
        raw: Any = json.loads(path.read_text(encoding="utf-8"))
        return RunInfo(**{**raw, "hardware": Hardware(**raw["hardware"]),
                          "algorithm": AlgorithmSummary(**raw["algorithm"])})
    except (OSError, ValueError, TypeError, KeyError):
        return None
