"""torch.profiler traces of the policy's training steps: SkyRL 0.4's `trainer.policy.torch_profiler_config`.

`torch.profiler.schedule(skip_first, wait, warmup, active, repeat)` counts calls of the policy's
`train` (one per trainer step); each finished window is written by torch's own trace handler as a
Chrome trace, `<save_path>/rank<R>.<time>.pt.trace.json[.gz]` (chrome://tracing, Perfetto,
TensorBoard's profiler plugin).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["ProfilerSettings", "StepProfiler"]


@dataclass(frozen=True)
class ProfilerSettings:
    """The keys of `trainer.policy.torch_profiler_config` a rank needs (save_path resolved)."""
    save_path: Path
    activities: tuple[str, ...]
    skip_first: int
    wait: int
    warmup: int
    active: int
    repeat: int
    record_shapes: bool
    profile_memory: bool
    with_stack: bool
    with_flops: bool
    with_modules: bool
    use_gzip: bool


class StepProfiler:
    """One rank's profiler: `step()` after each training step; started on the first."""

    def __init__(self, settings: ProfilerSettings, rank: int):
        self.settings, self.rank = settings, rank
        self._profile: torch.profiler.profile | None = None

    def _start(self) -> torch.profiler.profile:
        s = self.settings
        kinds = {"cpu": torch.profiler.ProfilerActivity.CPU, "cuda": torch.profiler.ProfilerActivity.CUDA}
        # CUDA activity only where CUDA runs (a CPU machine records the CPU side)
        activities = [kinds[a] for a in s.activities if a == "cpu" or torch.cuda.is_available()]
        s.save_path.mkdir(parents=True, exist_ok=True)
        profile = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(skip_first=s.skip_first, wait=s.wait, warmup=s.warmup,
                                             active=s.active, repeat=s.repeat),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(s.save_path), worker_name=f"rank{self.rank}",
                                                                   use_gzip=s.use_gzip),
            record_shapes=s.record_shapes, profile_memory=s.profile_memory, with_stack=s.with_stack,
            with_flops=s.with_flops, with_modules=s.with_modules)
        profile.start()
        return profile

    def begin(self) -> None:
        """Called as a training step starts: the profiler runs from the first one."""
        if self._profile is None:
            self._profile = self._start()

    def step(self) -> None:
        """Called as a training step ends: the schedule moves on (a finished window is written)."""
        if self._profile is not None:
            self._profile.step()

    def close(self) -> None:
        if self._profile is not None:
            self._profile.stop()
            self._profile = None
