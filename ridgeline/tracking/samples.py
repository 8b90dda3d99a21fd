"""`run_dir/samples.jsonl`: a few sampled rollouts kept for the run report.

One line per sample: `{"step": 1, "prompt": "...", "response": "...", "reward": 1.0}`. The prompt
is text (a chat prompt is written as `role: content` lines); the reward is the trajectory's total.
The trainer writes samples at every step; the report's step browser shows them all.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

SAMPLES_FILE = "samples.jsonl"


def prompt_text(prompt: Any) -> str:
    """A prompt as text: strings as they are, chat messages as `role: content` lines."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence) and all(isinstance(m, dict) for m in prompt):
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in prompt)
    return str(prompt)


def _total(reward: Any) -> float:
    return float(sum(reward)) if isinstance(reward, (list, tuple)) else float(reward)


def spread(count: int, limit: int) -> list[int]:
    """`limit` indices spread evenly over range(count), so the picks cover different prompts
    rather than the n samples of the first one."""
    if count <= limit:
        return list(range(count))
    return sorted({round(i * (count - 1) / max(1, limit - 1)) for i in range(limit)})


def write_samples(path: str | Path, step: int, prompts: Sequence[Any], responses: Sequence[str],
                  rewards: Sequence[Any], limit: int = 4, overwrite: bool = False) -> int:
    """Append up to `limit` of the step's rollouts to `path` (normally `run_dir/samples.jsonl`);
    returns how many were written. `rewards` may hold per-token lists (they are summed).
    `overwrite=True` starts the file afresh: pass it at step 1, so a new run in an old folder
    does not mix its samples with the earlier run's (a resumed run never redoes step 1)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    picks = spread(min(len(prompts), len(responses), len(rewards)), limit)
    with path.open("w" if overwrite else "a", encoding="utf-8") as f:
        for i in picks:
            row = {"step": step, "prompt": prompt_text(prompts[i]), "response": str(responses[i]),
                   "reward": _total(rewards[i])}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return len(picks)
