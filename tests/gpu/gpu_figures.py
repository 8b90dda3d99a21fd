"""Figures the GPU checks measure: printed as they come and, when the environment variable OUT
names a folder (the device tool's folder of files that come back), written to
`$OUT/gpu_figures.json` after every record, so a later failure keeps the earlier figures.

MFU (model FLOPs utilisation) = 6 * N * T / seconds / peak: N parameters, T tokens trained
(forward 2NT + backward 4NT), against the GPU's dense bf16 tensor-core peak. Ridgeline's training
forward runs each prompt once per group (shared prompts), so the work done is somewhat below 6NT
and this MFU reads a little high; it is the usual yardstick, not a profile.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Dense bf16 peaks (no 2:4 sparsity) from NVIDIA's data sheets, matched in this order against
# torch.cuda.get_device_name(): an SXM H100 reports "NVIDIA H100 80GB HBM3".
BF16_DENSE_PEAK_TFLOPS: tuple[tuple[str, str, float], ...] = (
    ("H100 PCIe", "H100 PCIe", 756.0),
    ("H100 NVL", "H100 NVL", 835.0),
    ("H100", "H100 SXM", 989.0),
    ("H200", "H200", 989.0),
    ("A100", "A100", 312.0),
)


@dataclass(frozen=True)
class Peak:
    label: str        # which row of the table matched
    tflops: float


def bf16_peak(device_name: str) -> Peak | None:
    """The table's row for this GPU, or None for a GPU it does not list (no MFU then)."""
    for needle, label, tflops in BF16_DENSE_PEAK_TFLOPS:
        if needle in device_name:
            return Peak(label, tflops)
    return None


def mfu(parameters: int, tokens: float, seconds: float, peak: Peak) -> float:
    """6 N T / seconds / peak, a fraction in [0, 1]."""
    return 6.0 * parameters * tokens / seconds / (peak.tflops * 1e12)


@dataclass
class Figures:
    device: str
    checks: dict[str, dict[str, float | str]] = field(default_factory=dict)

    def record(self, check: str, **values: float | str) -> None:
        self.checks.setdefault(check, {}).update(values)
        print(f"\n[{check}] on {self.device}")
        for key, value in values.items():
            print(f"  {key:<34} {value:.4g}" if isinstance(value, float) else f"  {key:<34} {value}")
        out = os.environ.get("OUT")
        if out:
            self.write(Path(out) / "gpu_figures.json")

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"device": self.device, "torch": torch.__version__,
                                    "cuda": torch.version.cuda, "checks": self.checks}, indent=2) + "\n")
