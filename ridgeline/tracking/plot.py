"""Plot a run's `metrics.jsonl`: reward per step and held-out pass@1."""

from __future__ import annotations

from pathlib import Path

from ridgeline.tracking.trackers import read_metrics


def plot_rewards(metrics_path: str | Path, out_path: str | Path, title: str = "") -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [(r["step"], r["reward/avg_raw_reward"]) for r in rows if r.get("reward/avg_raw_reward") is not None]
    evals = [(r["step"], r["eval/all/pass_at_1"]) for r in rows if r.get("eval/all/pass_at_1") is not None]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    if train:
        ax.plot(*zip(*train), marker=".", label="train reward (mean, sampled)")
    if evals:
        ax.plot(*zip(*evals), marker="o", label="held-out pass@1 (greedy)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    out = Path(out_path)
    fig.savefig(out)
    plt.close(fig)
    return out
