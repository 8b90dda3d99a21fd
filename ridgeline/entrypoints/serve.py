"""`ridgeline serve [overrides] [--host H] [--port N] [--api-key K]`: the embedded engine of the
configured policy model behind an HTTP server (ridgeline.inference.server), serving it as
`generator.model_name` on the OpenAI routes."""

from __future__ import annotations

import argparse
import logging
import os
import sys

API_KEY_ENV = "RIDGELINE_ENGINE_API_KEY"


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the embedded engine over HTTP (SGLang-style and OpenAI routes)",
                       description="ridgeline serve +experiment=quickstart --port 8001  (overrides pick the "
                                   "model: trainer.policy.model.path, generator.model_dtype, ...)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for `ridgeline train`")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for other machines)")
    p.add_argument("--port", type=int, default=8001, help="port to listen on (0: any free port)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require `Authorization: Bearer KEY` (default: ${API_KEY_ENV})")


def run(args: argparse.Namespace) -> int:
    from ridgeline.config import ConfigError, load_config

    try:
        cfg = load_config(["trainer.strategy=single", "generator.backend=hf", *args.overrides])
    except ConfigError as err:
        print(f"ridgeline: invalid configuration\n{err}", file=sys.stderr)
        return 2
    from ridgeline.inference.build import build_hf_engine
    from ridgeline.inference.server import EngineService, make_http_server
    from ridgeline.models.loading import configure_chat_template, load_tokenizer, policy_spec
    from ridgeline.training.build import seed_everything

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    seed_everything(cfg.trainer.seed)
    spec = policy_spec(cfg)
    tokenizer = load_tokenizer(spec)
    configure_chat_template(tokenizer, cfg.generator)
    service = EngineService(build_hf_engine(cfg, tokenizer), tokenizer, spec.path,
                            served_model_name=cfg.generator.model_name,
                            chat_max_tokens=cfg.generator.sampling_params.max_generate_length)
    server = make_http_server(service, args.host, args.port, args.api_key)
    host, port = server.server_address[:2]
    # the line a launcher waits for (tests and scripts parse it)
    print(f"ridgeline serve: {service.model_path} ({service.engine.dtype}) listening on http://{host}:{port}",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
