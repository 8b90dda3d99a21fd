"""Seconds per training step of the asynchronous modes against the synchronous loop, where
generation mostly waits: every environment step waits `--latency` seconds (bench/waiting_env.py:
a reward that comes back over the network), so while the generation thread waits the core is free
for the trainer. On one core that is the only overlap there is to measure; with cores (or GPUs) of
its own an engine overlaps its compute too.

Each mode trains the same `--steps` steps (`--preset tiny`: the tiny Llama; `quickstart`:
SmolLM2-135M with the quickstart's settings; `--model` for another). Two figures per mode, from
`timing/step` (which in the async modes holds the waits for a batch and for the generation thread
to reach a weight update): the steady state, the median over steps 2..N-2 (after the pipeline
fills, before it drains: in the last S steps nothing is left to generate), and the whole run's
mean (fill included, what a run of N steps sees); each the median over `--runs` alternating runs,
and its ratio async / sync (below 1: faster). Writes
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
    "sync": ["+experiment={preset}"],
    "one_step_off_policy": ["+experiment=[{preset},one_step_off_policy]"],
    "fully_async_2": ["+experiment=[{preset},fully_async]", "trainer.fully_async.max_staleness_steps=2"],
}


def step_seconds(run_dir: Path) -> list[float]:
    """Each step's `timing/step`."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["timing/step"] for r in rows if "policy/policy_loss" in r]


def run(mode: str, args, out: Path) -> dict:
    batch = args.batch or {"tiny": 16, "quickstart": 8}[args.preset]
    overrides = [*(o.format(preset=args.preset) for o in MODES[mode]), f"trainer.export_path={out}",
                 "trainer.run_name=bench", "trainer.logger=jsonl", "trainer.eval_before_train=false",
                 "trainer.eval_interval=-1",
                 f"data.prepare.num_train={batch * args.steps}", "data.prepare.num_val=8",
                 f"trainer.train_batch_size={batch}", f"trainer.policy_mini_batch_size={batch}",
                 *([f"generator.sampling_params.max_generate_length={args.tokens}"] if args.tokens else []),
                 f"environment.env_modules=[{BENCH / 'waiting_env.py'}]",
                 f"+environment.skyrl_gym.arithmetic.latency_s={args.latency}",
                 *([f"trainer.policy.model.path={args.model}"] if args.model else [])]
    start = time.perf_counter()
    Trainer.from_config(load_config(overrides)).train()
    wall = time.perf_counter() - start
    seconds = step_seconds(out / "bench")
    return {"mode": mode, "steps": len(seconds), "steady_step_s": statistics.median(seconds[1:-2]),
            "step_s": statistics.mean(seconds), "first_step_s": seconds[0], "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency", type=float, default=0.05, help="seconds each environment step waits")
    parser.add_argument("--steps", type=int, default=8, help="at least 5")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=None, help="prompts per step (x 8 samples; default: the "
                        "preset's, tiny 16, quickstart 8)")
    parser.add_argument("--tokens", type=int, default=None, help="max_generate_length (default: the preset's)")
    parser.add_argument("--model", default=None, help="trainer.policy.model.path (default: the preset's)")
    parser.add_argument("--preset", default="tiny", choices=("tiny", "quickstart"),
                        help="tiny: the tiny Llama; quickstart: SmolLM2-135M, bf16 where the CPU has AMX")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.runs):
        for mode in MODES:
            with tempfile.TemporaryDirectory() as tmp:
                result = run(mode, args, Path(tmp))
            results[mode].append(result)
            print(f"run {r + 1} {mode:>20}: steady {result['steady_step_s']:.3f} s/step, mean {result['step_s']:.3f} "
                  f"(first step {result['first_step_s']:.2f} s, wall {result['wall_s']:.1f} s)", flush=True)
    steady = {m: statistics.median(x["steady_step_s"] for x in rs) for m, rs in results.items()}
    median = {m: statistics.median(x["step_s"] for x in rs) for m, rs in results.items()}
    summary = {"steps": args.steps, "runs": args.runs, "batch": args.batch,
               "preset": args.preset, "model": args.model, "latency": args.latency, "cpus": os.cpu_count(),
               "steady_step_s": steady, "steady_ratio_vs_sync": {m: steady[m] / steady["sync"] for m in steady},
               "step_s": median, "ratio_vs_sync": {m: median[m] / median["sync"] for m in median},
               "results": results}
    for mode in MODES:
        print(f"{mode:>20}: steady {steady[mode]:.3f} s/step (ratio vs sync {steady[mode] / steady['sync']:.2f}), "
              f"mean {median[mode]:.3f} s/step (ratio {median[mode] / median['sync']:.2f})")
    out = BENCH / "results" / f"async_overlap-{time.strftime('%Y-%m-%dT%H%M%SZ', time.gmtime())}.json"
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"written {out}")


if __name__ == "__main__":
    main()
