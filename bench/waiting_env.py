"""The arithmetic env whose every step first waits `latency_s` seconds (registered over `arithmetic`
in the process that loads this module, since the prepared rows name that env), a
stand-in for a reward that comes back over the network (an LLM judge, a tool or sandbox API). It
spends no CPU while it waits, so a generation thread that waits on it leaves the core to the
trainer: what an asynchronous mode overlaps (bench/async_overlap.py)."""

from __future__ import annotations

import time
from typing import Any

from ridgeline.envs import register
from ridgeline.envs.arithmetic import ArithmeticEnv


class WaitingArithmeticEnv(ArithmeticEnv):
    name = "arithmetic"

    def __init__(self, extras: dict[str, Any] | None = None, *, latency_s: float = 0.5, **settings: Any) -> None:
        super().__init__(extras, **settings)
        self.latency_s = float(latency_s)

    def step(self, action: str):
        time.sleep(self.latency_s)
        return super().step(action)


register("arithmetic", WaitingArithmeticEnv, overwrite=True)
