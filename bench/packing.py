"""Sample packing vs padding on the tiny `llama-small` model, with RL-like ragged lengths (prompts
20-60 tokens, responses long-tailed 4..max). Prints median seconds of --repeats runs and real
tokens / second each way (the padded path also runs the padding, shown as padded tokens / second).

1. The logprob functions: forward+backward of the response logprobs (with entropy), padded vs
   packed in one pack, in packs of <= --max-tokens, and in packs of <= the longest row (the
   workers' default cap). All packs of a micro-batch run in one batched forward.
2. Through the worker (`trainer.use_sample_packing` off vs on): `PolicyWorker.compute_logprobs`
   (forward only) and `PolicyWorker.train` (one optimizer step: forward, backward, AdamW) with
   micro-batches of --micro rows, on the ragged batch (distinct prompts: packed) and on GRPO groups
   of 8 with the quickstart's shapes (shared prompts: the shared-prompt path both ways).

    OMP_NUM_THREADS=1 python bench/packing.py [--rows 32] [--max-response 256] [--micro 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
from collections import Counter

import torch
from common import median_seconds
from omegaconf import OmegaConf

from ridgeline.config import base_config
from ridgeline.models.tiny import build_char_tokenizer, build_tiny_model
from ridgeline.training.batch import TrainingBatch, build_training_batch
from ridgeline.training.forward_path import ForwardOptions, choose_forward_path
from ridgeline.training.logprobs import response_logprobs
from ridgeline.training.optim import LRSchedule, build_optimizer, build_scheduler
from ridgeline.training.packing import packed_response_logprobs, packing_stats
from ridgeline.training.worker import PolicyTrainConfig, PolicyWorker


def ragged_lengths(rows: int, max_response: int, rng: random.Random) -> tuple[list[int], list[int]]:
    prompts = [rng.randint(20, 60) for _ in range(rows)]
    # Long-tailed response lengths (most stop early, a few run to the cap), as in RL rollouts.
    responses = [min(max_response, 4 + int(rng.expovariate(1 / (max_response / 4)))) for _ in range(rows)]
    return prompts, responses


def ragged_batch(rows: int, vocab: int, max_response: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    prompts, responses = ragged_lengths(rows, max_response, random.Random(seed))
    width_p, width_r = max(prompts), max(responses)
    sequences = torch.randint(3, vocab, (rows, width_p + width_r), generator=torch.Generator().manual_seed(seed))
    attention = torch.zeros_like(sequences)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        attention[i, width_p - p:width_p + r] = 1
    return sequences, attention, width_r


def worker_batch(prompt_lengths: list[int], response_lengths: list[int], uids: list[str], vocab: int,
                 seed: int = 0) -> TrainingBatch:
    """A training batch of random tokens; rows with the same uid get the same prompt."""
    rng = random.Random(seed)
    prompts: dict[str, list[int]] = {}
    prompt_ids = [prompts.setdefault(u, [rng.randrange(3, vocab) for _ in range(p)])
                  for u, p in zip(uids, prompt_lengths)]
    response_ids = [[rng.randrange(3, vocab) for _ in range(r)] for r in response_lengths]
    batch = build_training_batch(prompt_ids, response_ids, [[1] * r for r in response_lengths],
                                 rewards=[float(i % 2) for i in range(len(uids))], uids=uids,
                                 rollout_logprobs=None, pad_id=0)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(seed))
    return batch


def grouped_quickstart_batch(rows: int, vocab: int, seed: int = 0) -> TrainingBatch:
    """GRPO groups of 8 shaped like the quickstart: prompts 44-48 tokens, responses 3-17."""
    rng = random.Random(seed)
    groups = [(str(g), rng.randint(44, 48)) for g in range(max(1, rows // 8))]
    uids = [u for u, _ in groups for _ in range(8)]
    prompts = [p for _, p in groups for _ in range(8)]
    responses = [rng.choice([3, 4, 17, 17]) for _ in uids]
    return worker_batch(prompts, responses, uids, vocab, seed)


def bench_functions(model, sequences: torch.Tensor, attention: torch.Tensor, width: int, args) -> None:
    stats = packing_stats(attention)
    longest = int(attention.sum(-1).max())

    def step(fn, **kwargs) -> None:
        model.zero_grad(set_to_none=True)
        lp, ent = fn(model, sequences, attention, width, 0.7, with_entropy=True, **kwargs)
        mask = attention[:, -width:]
        ((lp * mask).sum() + 0.01 * (ent * mask).sum()).backward()

    runs = {
        "padded": lambda: step(response_logprobs, share_prompts=False),
        "packed (1 pack)": lambda: step(packed_response_logprobs),
        f"packed (<= {args.max_tokens} tok)": lambda: step(packed_response_logprobs,
                                                           max_tokens_per_pack=args.max_tokens),
        f"packed (<= {longest}: longest)": lambda: step(packed_response_logprobs, max_tokens_per_pack=longest),
    }
    for name, fn in runs.items():
        seconds = median_seconds(fn, args.repeats)
        print(f"  {name:28s} {seconds:7.3f} s  real tok/s {stats['real_tokens'] / seconds:8.0f}  "
              f"padded tok/s {stats['padded_tokens'] / seconds:8.0f}")


def bench_worker(model, batch: TrainingBatch, name: str, args) -> None:
    """compute_logprobs and one optimizer step, sample packing off and on; the paths it takes."""
    stats = packing_stats(batch.attention_mask)
    print(f"{name}: rows={batch.batch_size} width={batch.sequences.shape[1]} real={stats['real_tokens']:.0f} "
          f"padding={stats['padding_fraction']:.1%} micro={args.micro}")
    algorithm = OmegaConf.merge(base_config().trainer.algorithm, {"loss_reduction": "token_mean"})
    seconds: dict[tuple[str, bool], float] = {}
    for packing in (False, True):
        options = ForwardOptions(sample_packing=packing)
        config = PolicyTrainConfig(mini_batch_trajectories=batch.batch_size, micro_batch_size=args.micro,
                                   micro_forward_batch_size=args.micro, temperature=0.7, algorithm=algorithm,
                                   forward_options=options)
        optimizer = build_optimizer(model, lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0)
        worker = PolicyWorker(model, config, optimizer, build_scheduler(optimizer, LRSchedule("constant", 0, 0)))
        model.train()
        paths = Counter(choose_forward_path(model, m.sequences, m.attention_mask, m.response_width, options).value
                        for m in batch.chunks(args.micro))
        seconds["logprobs", packing] = median_seconds(lambda: worker.compute_logprobs(batch), args.repeats)
        seconds["train", packing] = median_seconds(lambda: worker.train(batch), args.repeats)
        label = "on " if packing else "off"
        for phase in ("logprobs", "train"):
            s = seconds[phase, packing]
            print(f"  packing {label} {phase:8s} {s:7.3f} s  real tok/s {stats['real_tokens'] / s:8.0f}  "
                  f"padded tok/s {stats['padded_tokens'] / s:8.0f}  paths {dict(paths)}")
    print(f"  speed-up (off / on): logprobs {seconds['logprobs', False] / seconds['logprobs', True]:.2f}x  "
          f"train {seconds['train', False] / seconds['train', True]:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--max-response", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=1024, help="max_tokens_per_pack of the bounded run")
    parser.add_argument("--micro", type=int, default=8, help="worker micro-batch rows")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model("llama-small", tokenizer, seed=0).train()
    sequences, attention, width = ragged_batch(args.rows, len(tokenizer), args.max_response)
    stats = packing_stats(attention)
    print(f"functions: rows={args.rows} width={sequences.shape[1]} real={stats['real_tokens']:.0f} "
          f"padded={stats['padded_tokens']:.0f} padding={stats['padding_fraction']:.1%}")
    bench_functions(model, sequences, attention, width, args)

    prompts, responses = ragged_lengths(args.rows, args.max_response, random.Random(0))
    ragged = worker_batch(prompts, responses, [str(i) for i in range(args.rows)], len(tokenizer))
    bench_worker(model, ragged, "worker, ragged distinct prompts", args)
    bench_worker(model, grouped_quickstart_batch(args.rows, len(tokenizer)), "worker, GRPO groups of 8 "
                 "(quickstart shapes)", args)


if __name__ == "__main__":
    main()
