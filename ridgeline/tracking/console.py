"""The console tracker: one compact table row per logged step.

Only a handful of headline columns are shown (everything else goes to `metrics.jsonl` and the
other trackers). A column appears once its metric has been logged; the header is printed again
every `header_every` rows and whenever a new column appears, so an eval-only row at step 0 and
the training rows after it both read well.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Mapping, TextIO

from ridgeline.tracking.scalars import as_float

# (header, metric keys tried in order): the first key present in a row fills the cell.
CONSOLE_COLUMNS: list[tuple[str, tuple[str, ...]]] = [
    ("reward", ("reward/avg_raw_reward",)),
    ("acc", ("reward/accuracy",)),
    ("eval@1", ("eval/all/pass_at_1",)),
    ("len", ("generate/avg_num_tokens",)),
    ("loss", ("policy/policy_loss",)),
    ("kl", ("policy/policy_kl", "loss/avg_kl")),
    ("entropy", ("policy/policy_entropy",)),
    ("clip", ("policy/ppo_clip_ratio",)),
    ("gnorm", ("policy/raw_grad_norm",)),
    ("lr", ("policy/policy_lr",)),
    ("v_loss", ("critic/value_loss",)),
    ("lp_diff", ("rollout/logprob_abs_diff_mean",)),
    ("s/step", ("timing/step",)),
    ("s/eval", ("timing/eval",)),
    ("tok/s", ("throughput/tokens_per_second",)),
]
CELL_WIDTH = 9
STEP_WIDTH = 6


def format_value(value: Any) -> str:
    """A number in at most CELL_WIDTH characters: 4 significant digits, whole numbers from 1e4,
    scientific notation for very small and very large magnitudes."""
    number = as_float(value)
    if number is None:
        return "-" if value is None else str(value)[:CELL_WIDTH]
    if not math.isfinite(number):
        return str(number)
    if number == 0 or 1e-3 <= abs(number) < 1e4:
        return f"{number:.4g}"
    if 1e4 <= abs(number) < 1e8:
        return f"{number:.0f}"  # e.g. tokens per second: whole numbers read faster than 1.2e+04
    return f"{number:.2e}"


class ConsoleTracker:
    """Prints `step | reward | acc | ...` rows to `stream` (stdout by default)."""

    def __init__(self, stream: TextIO | None = None, header_every: int = 20,
                 columns: list[tuple[str, tuple[str, ...]]] | None = None):
        self.stream = stream
        self.header_every = header_every
        self.columns = columns or CONSOLE_COLUMNS
        self._seen: set[str] = set()          # headers of columns logged at least once
        self._printed: list[str] = []         # the columns of the last header printed
        self._rows_since_header = 0

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        cells = {}
        for header, keys in self.columns:
            key = next((k for k in keys if k in metrics), None)
            if key is not None:
                cells[header] = metrics[key]
                self._seen.add(header)
        if not cells:
            return  # nothing headline-worthy in this call (e.g. only timing of a side task)
        visible = [h for h, _ in self.columns if h in self._seen]
        out = self.stream or sys.stdout  # looked up per call so capture (pytest, wandb) still works
        if visible != self._printed or self._rows_since_header >= self.header_every:
            print(self._line("step", visible, {h: h for h in visible}), file=out)
            self._printed, self._rows_since_header = visible, 0
        print(self._line(str(step), visible, {h: format_value(cells.get(h)) for h in visible}), file=out,
              flush=True)
        self._rows_since_header += 1

    @staticmethod
    def _line(first: str, headers: list[str], cells: dict[str, str]) -> str:
        return first.rjust(STEP_WIDTH) + " " + " ".join(cells[h].rjust(CELL_WIDTH) for h in headers)

    def close(self) -> None:
        pass
