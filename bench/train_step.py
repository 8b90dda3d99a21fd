"""Training throughput of the policy worker against this machine's own matmul rate, in fp32 and bf16.

    OMP_NUM_THREADS=1 python bench/train_step.py [--repeats 3] [--workloads quickstart,distinct]

First the matmul rate: `torch.mm` at 2048^3 and at a prefill-shaped 2048 x 576 x 1536, fp32 and
bf16, measured in this run. Then one optimizer step of the real `PolicyWorker.train` on SmolLM2-135M
(forward, backward, AdamW; the quickstart's settings: its micro-batch, entropy on) for:
  quickstart: its batch, 8 prompts x 8 samples, ~47-token prompts, 17 response tokens (the
              shared-prompt forward: each distinct prompt runs once);
  distinct  : 16 distinct prompts (sums and GSM8K questions, 45-150 tokens) x 64 response tokens
              (the plain forward, or packed with --packing).
Reported per workload and dtype:
  tokens/s      real (unpadded) prompt + response tokens of the batch per second;
  model FLOP/s  6 x parameters x tokens/s + attention: what a plain forward+backward over every
                row needs (the issue's formula; the shared-prompt forward skips part of it, so this
                can overstate what the hardware did);
  computed      FLOP/s of the work actually run (`computed_flops`): distinct prompts once, logits
                only at response positions, padding included; and its share of the bf16 / fp32
                matmul rate. The target is computed bf16 >= 40% of the bf16 matmul rate.
Writes bench/results/train_step-<time>.json and a line in docs/benchmarks.md.
"""

from __future__ import annotations

from ridgeline.allocator import reexec_with_tcmalloc

if __name__ == "__main__":
    reexec_with_tcmalloc()  # measure what `ridgeline train` runs on (RIDGELINE_ALLOCATOR=system: glibc's)

import argparse
import statistics
import time

import torch
from common import SMOLLM2, median_seconds, sum_prompts, write_result
from generation import mixed_questions

from ridgeline.config import load_config
from ridgeline.data import encode_chat_prompt
from ridgeline.models.loading import load_tokenizer
from ridgeline.training.batch import TrainingBatch, build_training_batch
from ridgeline.training.build import build_policy_worker
from ridgeline.training.forward_path import ForwardPath, choose_forward_path


def matmul_rate(m: int, k: int, n: int, dtype: torch.dtype, repeats: int = 5) -> float:
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    seconds = median_seconds(lambda: torch.mm(a, b), repeats, warmup=2)
    return 2 * m * k * n / seconds


def model_shape(model) -> dict[str, int]:
    c = model.config
    vocab, hidden = model.get_output_embeddings().weight.shape
    body = sum(p.numel() for name, p in model.named_parameters()
               if ".layers." in name and p.dim() == 2)  # the decoder layers' matmul weights
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return {"body": body, "head": vocab * hidden, "layers": c.num_hidden_layers, "attn_dim": c.num_attention_heads * head_dim,
            "params": sum(p.numel() for p in model.parameters())}


def attention_flops(shape: dict[str, int], query_contexts: int) -> int:
    """Forward QK^T and AV for every query over its causal context: 2 matmuls x 2 FLOPs x attn_dim
    per (query, key) pair, per layer. `query_contexts` = sum over queries of their context length."""
    return 4 * shape["layers"] * shape["attn_dim"] * query_contexts


def row_lengths(batch: TrainingBatch) -> list[int]:
    return batch.attention_mask.sum(-1).tolist()


def model_flops(shape: dict[str, int], batch: TrainingBatch) -> int:
    """Forward+backward (3x forward) of a plain forward over each row's real tokens: 6N per token
    (N = all parameters, the LM head included) plus causal attention."""
    lengths = row_lengths(batch)
    return 6 * shape["params"] * sum(lengths) + 3 * attention_flops(shape, sum(n * (n + 1) // 2 for n in lengths))


def computed_flops(shape: dict[str, int], batch: TrainingBatch, micro: int, path_of) -> int:
    """Forward+backward FLOPs of the matmuls the worker actually runs, per micro-batch path: the
    decoder body over the tokens it is given (padding included, except when packed), the LM head at
    response positions only, causal attention over the given width."""
    total, width_r = 0, batch.response_width
    for m in batch.chunks(micro):
        rows, width = m.sequences.shape
        width_p = width - width_r
        if path_of(m) is ForwardPath.SHARED_PROMPT:
            prompts = torch.unique(m.sequences[:, :width_p], dim=0).shape[0]
            tokens = prompts * width_p + rows * (width_r - 1)
            contexts = prompts * width_p * (width_p + 1) // 2 + rows * sum(width_p + j + 1 for j in range(width_r - 1))
        elif path_of(m) is ForwardPath.PACKED:  # real tokens only (attention counted per row)
            lengths = row_lengths(m)
            tokens, contexts = sum(lengths), sum(n * (n + 1) // 2 for n in lengths)
        else:
            tokens = rows * width
            contexts = rows * width * (width + 1) // 2
        total += 3 * (2 * shape["body"] * tokens + 2 * shape["head"] * rows * width_r + attention_flops(shape, contexts))
    return total


def quickstart_batch(tokenizer) -> TrainingBatch:
    prompts = sum_prompts(tokenizer, 8)
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(100, 1000, (17,), generator=g).tolist() for _ in range(64)]
    return with_advantages(build_training_batch([p for p in prompts for _ in range(8)], responses, [[1] * 17] * 64,
                                                [float(i % 2) for i in range(64)], [str(i // 8) for i in range(64)],
                                                None, tokenizer.pad_token_id))


def distinct_batch(tokenizer, rows: int = 16, response: int = 64) -> TrainingBatch:
    prompts = [encode_chat_prompt(tokenizer, [{"role": "user", "content": q}]) for q in mixed_questions(rows, seed=3)]
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(100, 1000, (response,), generator=g).tolist() for _ in range(rows)]
    return with_advantages(build_training_batch(prompts, responses, [[1] * response] * rows, [1.0] * rows,
                                                [str(i) for i in range(rows)], None, tokenizer.pad_token_id))


def with_advantages(batch: TrainingBatch) -> TrainingBatch:
    g = torch.Generator().manual_seed(1)
    batch.advantages = torch.randn(batch.batch_size, 1, generator=g) * batch.loss_mask
    return batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workloads", default="quickstart,distinct")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--packing", action="store_true", help="trainer.use_sample_packing=true")
    args = ap.parse_args()

    rates = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        rates[name] = {"2048^3": matmul_rate(2048, 2048, 2048, dtype), "2048x576x1536": matmul_rate(2048, 576, 1536, dtype)}
        print(f"matmul {name}: " + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in rates[name].items()), flush=True)

    tokenizer = load_tokenizer(SMOLLM2)
    batches = {"quickstart": quickstart_batch(tokenizer), "distinct": distinct_batch(tokenizer)}
    results: dict = {"matmul_flops": rates, "workloads": {}}
    for dtype in args.dtypes.split(","):
        overrides = ["+experiment=quickstart", f"trainer.mixed_precision={dtype}",
                     f"trainer.use_sample_packing={str(args.packing).lower()}"]
        worker = build_policy_worker(load_config(overrides), tokenizer, training_batches=1)
        shape = model_shape(worker.model)
        micro = worker.config.micro_batch_size
        options = worker.config.forward_options
        for workload in args.workloads.split(","):
            batch = batches[workload]
            worker.train(batch)  # warm-up (and the optimizer's state)
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                worker.train(batch)
                times.append(time.perf_counter() - t0)
            seconds = statistics.median(times)
            paths = sorted({choose_forward_path(worker.model, m.sequences, m.attention_mask, batch.response_width,
                                                options).name.lower() for m in batch.chunks(micro)})
            computed = computed_flops(shape, batch, micro, lambda m: choose_forward_path(
                worker.model, m.sequences, m.attention_mask, batch.response_width, options))
            peak = rates[dtype]["2048^3"]
            r = {"seconds": seconds, "runs_s": times, "tokens": sum(row_lengths(batch)), "paths": paths,
                 "tokens_per_s": sum(row_lengths(batch)) / seconds,
                 "model_flops_per_s": model_flops(shape, batch) / seconds,
                 "computed_flops_per_s": computed / seconds, "computed_share_of_matmul": computed / seconds / peak}
            results["workloads"][f"{workload}/{dtype}"] = r
            print(f"{workload:10s} {dtype}: {seconds:6.2f} s/step, {r['tokens_per_s']:6.0f} tokens/s, "
                  f"model {r['model_flops_per_s'] / 1e9:5.0f} GFLOP/s, computed {r['computed_flops_per_s'] / 1e9:5.0f} "
                  f"GFLOP/s = {100 * r['computed_share_of_matmul']:3.0f}% of {dtype} matmul ({', '.join(paths)})",
                  flush=True)
        del worker
    summary = "; ".join(f"{k} {v['seconds']:.2f} s, {v['tokens_per_s']:.0f} tok/s, computed "
                        f"{100 * v['computed_share_of_matmul']:.0f}% of matmul" for k, v in results["workloads"].items())
    bf16 = rates["bf16"]["2048^3"] / 1e9
    write_result("train_step", {"args": vars(args), **results},
                 f"SmolLM2-135M policy step; bf16 matmul {bf16:.0f} GFLOP/s; {summary}")


if __name__ == "__main__":
    main()
