"""Where metrics go: the console and a `metrics.jsonl` file (wandb, tensorboard and mlflow come with
issue 5 behind the same `Tracker` shape)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Protocol, TextIO

# What the console shows each step, in this order, when present (the jsonl file gets everything).
CONSOLE_KEYS = [
    ("reward/avg_raw_reward", "reward"), ("reward/accuracy", "acc"), ("eval/all/pass_at_1", "eval@1"),
    ("generate/avg_num_tokens", "len"), ("policy/policy_loss", "loss"), ("policy/kl_loss", "kl"),
    ("policy/policy_entropy", "ent"), ("policy/ppo_clip_ratio", "clip"), ("policy/grad_norm", "gnorm"),
    ("policy/policy_lr", "lr"), ("rollout/logprob_abs_diff_mean", "lp_diff"), ("timing/generate", "t_gen"), ("timing/logprobs", "t_lp"),
    ("timing/policy_train", "t_train"), ("timing/sync_weights", "t_sync"), ("timing/step", "t_step"),
    ("throughput/tokens_per_second", "tok/s"),
]


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


def _fmt(value: float) -> str:
    if isinstance(value, float) and (value == 0 or 1e-3 <= abs(value) < 1e4):
        return f"{value:.4g}"
    return f"{value:.3e}" if isinstance(value, float) else str(value)


class ConsoleTracker:
    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stdout

    def log(self, metrics: dict[str, float], step: int) -> None:
        parts = [f"{short}={_fmt(metrics[key])}" for key, short in CONSOLE_KEYS if key in metrics]
        evals = [f"{k}={_fmt(v)}" for k, v in metrics.items()
                 if k.startswith("eval/") and k != "eval/all/pass_at_1"]
        print(f"[step {step}] " + " ".join(parts + evals), file=self.stream, flush=True)

    def close(self) -> None:
        pass


class JsonlTracker:
    """One JSON object per log call: {"step": N, metric: value, ...}. Appends, so a resumed run
    keeps its history."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")

    def log(self, metrics: dict[str, float], step: int) -> None:
        row = {"step": step}
        row.update({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()})
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def build_trackers(names: list[str], run_dir: str | Path) -> list[Tracker]:
    """`metrics.jsonl` in the run folder is always written; `names` adds the others."""
    trackers: list[Tracker] = [JsonlTracker(Path(run_dir) / "metrics.jsonl")]
    for name in names:
        if name == "console":
            trackers.append(ConsoleTracker())
        elif name == "jsonl":
            continue  # already there
        else:
            raise ValueError(f"trainer.logger={name!r} is not supported yet; use console or jsonl")
    return trackers


def read_metrics(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
