"""What `ridgeline doctor` knows and says: the machine's facts (gathered once) and one check's
verdict. Below the doctor's modules (`doctor`, `doctor_inputs`, `doctor_sglang`), which all read
and write them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

OK, WARN, FAIL, NOT_CHECKED = "ok", "warn", "FAIL", "not checked"


@dataclass
class SGLangInstall:
    """What importing SGLang's engine in a child process showed."""

    version: str | None   # sglang.__version__; None when the import failed
    error: str | None     # the import's last error line; None when it imports
    cpu_backend: bool     # imported with SGLANG_USE_CPU_ENGINE=1 (no CUDA here)
    seconds: float


@dataclass
class Gpu:
    name: str
    memory_gb: float
    capability: tuple[int, int]


@dataclass
class Package:
    version: str | None  # None: importable but installed without metadata
    distribution: str | None


@dataclass
class MachineFacts:
    python: tuple[int, int, int]
    torch: str | None  # None: torch does not import
    cuda_build: str | None  # torch.version.cuda; None on the CPU wheel
    cuda_available: bool = False
    cpu_fast_bf16: bool = False
    gpus: list[Gpu] = field(default_factory=list)
    packages: dict[str, Package | None] = field(default_factory=dict)  # None: not installed
    disk: dict[str, tuple[str, float]] = field(default_factory=dict)  # label -> (folder, free GB)
    ray_address: str | None = None
    ray_cluster: dict[str, Any] | None = None  # {"nodes", "cpus", "gpus"} or {"error"}
    remote: dict[str, str | None] = field(default_factory=dict)  # server URL -> None (answers) or the error
    sandbox: str | None = None  # the code sandbox: "" when bubblewrap works, else why not; None: not probed
    sglang: SGLangInstall | None = None  # SGLang's engine imported in a child process (generator.backend=sglang)


@dataclass
class Check:
    name: str
    status: str  # ok | warn | FAIL | not checked
    detail: str
