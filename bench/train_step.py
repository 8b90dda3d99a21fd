"""Policy forward+backward on SmolLM2-135M for one quickstart batch (8 prompts x 8 samples, prompt
~45 tokens, 17 response tokens): plain vs shared-prompt forward, fp32 vs bf16 autocast, and the
micro-batch size. Prints medians of --repeats runs.

    OMP_NUM_THREADS=1 python bench/train_step.py [--repeats 3]
"""

from __future__ import annotations

import argparse

import torch
from common import load_smollm2, median_seconds, sum_prompts

from ridgeline.training.logprobs import response_logprobs
from ridgeline.training.worker import autocast_context


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, tokenizer = load_smollm2()
    model.train()
    prompts = sum_prompts(tokenizer, 8)
    width = max(len(p) for p in prompts)
    prompt_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(0)
    response = torch.randint(100, 1000, (64, 17))
    sequences = torch.cat([prompt_ids.repeat_interleave(8, 0), response], 1)
    attention = torch.cat([prompt_mask.repeat_interleave(8, 0), torch.ones_like(response)], 1)

    def fwd_bwd(share: bool, dtype, micro: int) -> None:
        model.zero_grad(set_to_none=True)
        for start in range(0, 64, micro):
            with autocast_context(dtype):
                lp, _ = response_logprobs(model, sequences[start:start + micro], attention[start:start + micro], 17,
                                          0.7, with_entropy=True, share_prompts=share)
            lp.sum().backward()

    for dtype in (torch.bfloat16, None):
        for share in (True, False):
            for micro in (64, 16):
                t = median_seconds(lambda: fwd_bwd(share, dtype, micro), args.repeats)
                print(f"{'bf16' if dtype else 'fp32'} share_prompts={share!s:5s} micro={micro:2d}: {t:6.2f} s")


if __name__ == "__main__":
    main()
