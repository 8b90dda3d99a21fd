"""`ridgeline serve [overrides] [--host H] [--port N] [--api-key K] [--served-model-name NAME]
[--trust-request-chat-template]`: the
embedded engine of the configured policy model behind an HTTP server (ridgeline.inference.server),
serving it on the OpenAI routes under `--served-model-name` (default: `generator.model_name` when
the config sets one, else the model's name: `default_served_name`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import argparse
import logging
import os
import sys

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema import RidgelineConfig

API_KEY_ENV = "RIDGELINE_ENGINE_API_KEY"


def add_parser(sub) -> None:
    from ridgeline.inference.server import ServeLimits

    d = ServeLimits()
    p = sub.add_parser("serve", help="serve the embedded engine over HTTP (SGLang-style and OpenAI routes)",
                       description="ridgeline serve +experiment=quickstart --port 8001  (overrides pick the "
                                   "model: trainer.policy.model.path, generator.model_dtype, ...). Safe by default: "
                                   "127.0.0.1 only; beyond it an API key is required (docs/security.md).")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for `ridgeline train`")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for other machines, "
                        "which needs --api-key)")
    p.add_argument("--port", type=int, default=8001, help="port to listen on (0: any free port)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require `Authorization: Bearer KEY` on every route but /health (default: ${API_KEY_ENV})")
    p.add_argument("--max-body-mb", type=float, default=d.max_body_bytes / 2**20,
                   help="largest request body in MiB; larger ones are refused unread (default %(default)g)")
    p.add_argument("--max-running-requests", type=int, default=d.max_running_requests,
                   help="generations the engine advances together, step by step (default %(default)d)")
    p.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                   help="requests waiting beyond those; more are refused with 503 (default %(default)d)")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s,
                   help="seconds from a request's arrival to its answer; past it the request is dropped with "
                        "503 (default %(default)g)")
    p.add_argument("--context-length", type=int, default=None,
                   help="prompt + response tokens of one sequence (default: the model's max_position_embeddings); "
                        "longer prompts are refused, max_new_tokens is cut to what is left")
    p.add_argument("--served-model-name", default=None,
                   help="the name OpenAI clients give as `model` (GET /v1/models lists it; default: "
                        "generator.model_name when set, else the hub id or folder as given, the GGUF file's "
                        "name, or tiny-NAME / random-NAME)")
    p.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                   help="most top logprobs a request may ask per token (default %(default)d)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat template a request sends (chat_template, chat_template_kwargs.chat_template; "
                        "vLLM's flag). Off by default: a template is a program the server runs, and one request can "
                        "take gigabytes of memory")


def _limits(args: argparse.Namespace):
    from ridgeline.inference.server import ServeLimits

    checks = {"--max-body-mb": args.max_body_mb > 0, "--max-running-requests": args.max_running_requests >= 1,
              "--max-queued-requests": args.max_queued_requests >= 1, "--request-timeout": args.request_timeout > 0,
              "--max-logprobs": args.max_logprobs >= 0,
              "--context-length": args.context_length is None or args.context_length >= 1}
    bad = [flag for flag, ok in checks.items() if not ok]
    if bad:
        raise ValueError(f"{', '.join(bad)} must be positive (counts at least 1). Fix: see `ridgeline serve --help`")
    return ServeLimits(max_body_bytes=int(args.max_body_mb * 2**20), max_running_requests=args.max_running_requests,
                       max_queued_requests=args.max_queued_requests, request_timeout_s=args.request_timeout,
                       max_logprobs=args.max_logprobs)


def default_served_name(spec) -> str:
    """The name a model is served under when nothing names it: a hub id or a folder as given
    (vLLM's rule; AutoTokenizer loads it), a GGUF file's name without `.gguf`, the last part of a
    `pkg://` path, `tiny-NAME` / `random-NAME` for the built-in models. Never a `scheme://` id a
    client library could not load or would take for a URL."""
    if spec.gguf_file:
        return spec.gguf_file.rsplit("/", 1)[-1].removesuffix(".gguf")
    scheme, sep, rest = spec.path.partition("://")
    if not sep:
        return spec.path
    name = rest.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
    return name if scheme == "pkg" else f"{scheme}-{name}"


def served_name(args: argparse.Namespace, cfg, spec) -> str:
    """--served-model-name, else generator.model_name when the config changed it from its default
    (the policy's path), else `default_served_name`."""
    if args.served_model_name is not None:
        if not args.served_model_name.strip():
            raise ValueError("--served-model-name is empty. Fix: a name clients will send as `model`, e.g. "
                             "--served-model-name policy")
        return args.served_model_name
    if cfg.generator.model_name != spec.path:
        return str(cfg.generator.model_name)
    return default_served_name(spec)


def run(args: argparse.Namespace) -> int:
    from ridgeline.config import ConfigError, load_config
    from ridgeline.inference.http_app import ExposureError, check_exposure
    from ridgeline.inference.server import EngineService, make_http_server

    try:
        limits = _limits(args)
        # before any model loads: a server that would expose its weight and memory routes is refused
        check_exposure(args.host, args.api_key, steering=True)
    except (ValueError, ExposureError) as err:
        print(f"ridgeline serve: {err}", file=sys.stderr)
        return 2
    try:
        # one process, the embedded engine on one device: the base config's 4-GPU tensor parallelism
        # would only earn a note that it is not used (a user's own setting still gets it)
        cfg = load_config(["trainer.strategy=single", "generator.backend=hf",
                           "generator.inference_engine_tensor_parallel_size=1", *args.overrides])
    except ConfigError as err:
        print(f"ridgeline: invalid configuration\n{err}", file=sys.stderr)
        return 2
    from ridgeline.inference.build import build_hf_engine
    from ridgeline.models.loading import configure_chat_template, load_tokenizer, policy_spec, tokenizer_folder
    from ridgeline.training.build import seed_everything

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    seed_everything(cfg.trainer.seed)
    spec = policy_spec(cfg)
    try:
        name = served_name(args, cfg, spec)
    except ValueError as err:
        print(f"ridgeline serve: {err}", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(spec)
    configure_chat_template(tokenizer, cfg.generator)
    engine = build_hf_engine(cfg, tokenizer)
    service = EngineService(engine, tokenizer, spec.path, served_model_name=name,
                            tokenizer_path=tokenizer_folder(spec),
                            chat_max_tokens=cfg.generator.sampling_params.max_generate_length,
                            context_length=args.context_length or engine.context_length, vocab_size=engine.vocab_size,
                            weight_shapes={n: tuple(p.shape) for n, p in engine.model.named_parameters()},
                            trust_request_chat_template=args.trust_request_chat_template,
                            steps=engine.generate_steps, limits=limits)
    server = make_http_server(service, args.host, args.port, args.api_key)
    host, port = server.server_address[:2]
    # the line a launcher waits for (tests and scripts parse it)
    print(f"ridgeline serve: {service.model_path} ({engine.dtype}) as model {name!r} listening on "
          f"http://{host}:{port}", flush=True)
    print(f"ridgeline serve: OpenAI clients: base_url=\"http://{host}:{port}/v1\", model=\"{name}\" (the "
          f"tokenizer: AutoTokenizer.from_pretrained(\"{service.tokenizer_path}\"), or POST /tokenize)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        service.close()
    return 0
