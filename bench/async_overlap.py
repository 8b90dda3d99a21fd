"""Seconds per training step of the asynchronous modes against the synchronous loop, where
generation mostly waits: every environment step waits `--latency` seconds (bench/waiting_env.py:
a reward that comes back over the network), so while the generation thread waits the core is free
for the trainer. On one core that is the only overlap there is to measure; with cores (or GPUs) of
its own an engine overlaps its compute too.

Each mode trains the same `--steps` steps (tiny Llama by default, `--model` for another); the
figure is the training loop's seconds per step (the mean of `timing/step`, which in the async modes
holds the waits for a batch and for the generation thread to reach a weight update, the pipeline's
fill included), median over `--runs` alternating runs; the ratio is async / sync (below 1:
faster). Writes
bench/results/async_overlap-<time>.json.

    OMP_NUM_THREADS=1 python bench/async_overlap.py [--latency 0.05] [--steps 8] [--runs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from ridgeline.config import load_config  # noqa: E402
from ridgeline.trainer.trainer import Trainer  # noqa: E402

BENCH = Path(__file__).resolve().parent
MODES = {
    "sync": ["+experiment=tiny"],
    "one_step_off_policy": ["+experiment=[tiny,one_step_off_policy]"],
    "fully_async_2": ["+experiment=[tiny,fully_async]", "trainer.fully_async.max_staleness_steps=2"],
}


def step_seconds(run_dir: Path) -> list[float]:
    """Each step's `timing/step`."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["timing/step"] for r in rows if "policy/policy_loss" in r]


def run(mode: str, args, out: Path) -> dict:
    batch = args.batch
    overrides = [*MODES[mode], f"trainer.export_path={out}", "trainer.logger=jsonl", "trainer.eval_before_train=false",
                 f"data.prepare.num_train={batch * args.steps}", "data.prepare.num_val=8",
                 f"trainer.train_batch_size={batch}", f"trainer.policy_mini_batch_size={batch}",
                 f"environment.env_modules=[{BENCH / 'waiting_env.py'}]",
                 f"+environment.skyrl_gym.arithmetic.latency_s={args.latency}",
                 f"generator.sampling_params.max_generate_length={args.tokens}",
                 *([f"trainer.policy.model.path={args.model}"] if args.model else [])]
    start = time.perf_counter()
    Trainer.from_config(load_config(overrides)).train()
    wall = time.perf_counter() - start
    seconds = step_seconds(out / "tiny")
    return {"mode": mode, "steps": len(seconds), "step_s": statistics.mean(seconds),
            "steady_step_s": statistics.median(seconds[1:]), "first_step_s": seconds[0], "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency", type=float, default=0.05, help="seconds each environment step waits")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16, help="prompts per step (x 8 samples)")
    parser.add_argument("--tokens", type=int, default=4, help="max_generate_length")
    parser.add_argument("--model", default=None, help="trainer.policy.model.path (default: the tiny Llama)")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.runs):
        for mode in MODES:
            with tempfile.TemporaryDirectory() as tmp:
                result = run(mode, args, Path(tmp))
            results[mode].append(result)
            print(f"run {r + 1} {mode:>20}: {result['step_s']:.3f} s/step (first step "
                  f"{result['first_step_s']:.2f} s, wall {result['wall_s']:.1f} s)", flush=True)
    median = {m: statistics.median(x["step_s"] for x in rs) for m, rs in results.items()}
    summary = {"latency_s": args.latency, "steps": args.steps, "runs": args.runs, "batch": args.batch,
               "model": args.model or "tiny://llama", "cpus": os.cpu_count(),
               "step_s": median, "ratio_vs_sync": {m: median[m] / median["sync"] for m in median},
               "results": results}
    for mode in MODES:
        print(f"{mode:>20}: {median[mode]:.3f} s/step, ratio vs sync {median[mode] / median['sync']:.2f}")
    out = BENCH / "results" / f"async_overlap-{time.strftime('%Y-%m-%dT%H%M%SZ', time.gmtime())}.json"
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"written {out}")


if __name__ == "__main__":
    main()
