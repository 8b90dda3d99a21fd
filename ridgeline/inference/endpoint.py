"""`generator.enable_http_endpoint` (SkyRL's keys): while a run trains, its engine answers
OpenAI-compatible HTTP requests on `generator.http_endpoint_host:http_endpoint_port`, so agent code
(an environment, a tool, another process) can sample from the policy being trained.

The routes are `ridgeline serve`'s OpenAI ones (`EngineService.openai_routes`: /health, /v1/models,
/v1/completions, /v1/chat/completions, /tokenize, /detokenize), served from a background thread of the training process
over the run's own engine, which the trainer's generator keeps using. `SharedEngine` makes that
safe: every engine call holds one lock, so the endpoint's requests and the generator's batches
never interleave inside an engine (the embedded engine, vLLM's `LLM` and SGLang's `Engine` are not
thread-safe), and a request never sees half-synced weights: it waits while the engine sleeps (a
colocated engine while the trainer trains) and while the trainer holds it for a weight sync, and is
answered by the new weights.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
from dataclasses import dataclass
from typing import Iterable, Iterator, TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerBase

from ridgeline.errors import UserError
from ridgeline.inference.server import EngineService, make_http_server
from ridgeline.inference.types import (WAKE_TAGS, EngineError, EngineOutput, EngineRequest, InferenceEngine,
                                       MemoryTag, wake_order)

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema import RidgelineConfig

log = logging.getLogger(__name__)


class EndpointError(UserError, RuntimeError):
    """The endpoint cannot listen where the config says."""


@dataclass(frozen=True)
class EndpointSettings:
    host: str
    port: int
    model_name: str       # generator.model_name: the `model` every request must name
    model_path: str       # trainer.policy.model.path
    chat_max_tokens: int  # a chat request's max_tokens when it sets none
    context_length: int | None = None  # prompt + response tokens of a request (None: the engine judges)
    tokenizer_path: str | None = None  # what /v1/models gives as `root` (None: model_path)

    @classmethod
    def from_config(cls, cfg: RidgelineConfig) -> "EndpointSettings":
        """The context is the run's own, what vLLM and SGLang engines are built with: max(prompt
        lengths) + max(generation lengths), or the engine's length kwarg when
        generator.engine_init_kwargs sets it; remote servers judge themselves."""
        from ridgeline.inference.library_engine import engine_init_kwargs, max_model_len
        from ridgeline.models.loading import policy_spec, tokenizer_folder

        g = cfg.generator
        length_key = {"vllm": "max_model_len", "sglang": "context_length"}.get(str(g.backend))
        context = None   # remote servers judge themselves
        if g.run_engines_locally:
            given = engine_init_kwargs(cfg)
            context = int(given[length_key] if length_key is not None and length_key in given else max_model_len(cfg))
        return cls(host=str(g.http_endpoint_host), port=int(g.http_endpoint_port), model_name=str(g.model_name),
                   model_path=str(cfg.trainer.policy.model.path),
                   chat_max_tokens=int(g.sampling_params.max_generate_length), context_length=context,
                   tokenizer_path=tokenizer_folder(policy_spec(cfg)))

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def _address_error(host: str, port: int, err: OSError) -> EndpointError:
    if err.errno == errno.EADDRINUSE:
        return EndpointError(f"generator.http_endpoint_port={port}: {host}:{port} is already in use (another server, or "
                             "another run's endpoint). Fix: stop that process or choose a free port, e.g. "
                             f"generator.http_endpoint_port={port + 10}.")
    if err.errno == errno.EACCES:
        return EndpointError(f"generator.http_endpoint_port={port}: listening on a port below 1024 needs privileges. "
                             "Fix: a port above 1023, e.g. generator.http_endpoint_port=8000.")
    return EndpointError(f"generator.http_endpoint_host={host}: cannot listen on {host}:{port} ({err.strerror or err}). "
                         "Fix: an IPv4 address of this machine, e.g. 127.0.0.1 (this machine only) or 0.0.0.0 "
                         "(every interface).")


def check_address(host: str, port: int) -> None:
    """Refuse before any model loads when host:port cannot be listened on (the server binds it
    only once the engine exists); the same options as the server's socket."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            raise _address_error(host, port, err) from err


class SharedEngine:
    """An `InferenceEngine` used by the training loop and by the endpoint's request threads.

    Every call holds one re-entrant lock. `generate` and `score` from a thread other than the one
    that put the engine to sleep wait until it is fully awake again (that thread gets the engine's
    own refusal instead: a bug of the loop must fail, not hang). `hold()` keeps other threads out for
    a whole phase, e.g. a weight sync. After `close`, waiting and new calls fail."""

    def __init__(self, engine: InferenceEngine):
        self.engine = engine
        self.dtype: torch.dtype = engine.dtype
        self._lock = threading.RLock()
        self._awake = threading.Condition(self._lock)
        self._asleep: set[MemoryTag] = set()
        self._sleeper: int | None = None   # the thread that put it to sleep
        self._closed = False

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        with self._lock:
            yield

    def _wait_until_usable(self) -> None:
        """Called with the lock held."""
        while self._asleep and threading.get_ident() != self._sleeper and not self._closed:
            self._awake.wait()
        if self._closed:
            raise EngineError("the run's engine is closed (the training run ended)")

    def generate(self, requests: list[EngineRequest], seed: int | None = None) -> list[EngineOutput]:
        with self._lock:
            self._wait_until_usable()
            return self.engine.generate(requests, seed=seed)

    def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        with self._lock:
            self._wait_until_usable()
            return self.engine.score(prompt_ids, response_ids)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        with self._lock:
            self.engine.update_weights(named_tensors)
            self._asleep.discard("weights")  # the protocol: sleeping weights are woken first

    def reset_prefix_cache(self) -> None:
        with self._lock:
            self.engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        with self._lock:
            self.engine.sleep(level)
            self._asleep, self._sleeper = set(WAKE_TAGS), threading.get_ident()

    def wake_up(self, tags: tuple[MemoryTag, ...] = WAKE_TAGS) -> None:
        with self._lock:
            self.engine.wake_up(tags)
            self._asleep -= set(wake_order(tags))
            if not self._asleep:
                self._awake.notify_all()

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._awake.notify_all()
                self.engine.close()


class HttpEndpoint:
    """The OpenAI routes over `engine`, from a background thread of this process.

    Built (and bound: a taken port fails here) before the run; `engine` is then the `SharedEngine`
    the trainer and its generator must use. `start()` serves, `close()` stops serving, frees the
    port and closes the engine; requests still waiting for it fail."""

    def __init__(self, engine: InferenceEngine, tokenizer: PreTrainedTokenizerBase, settings: EndpointSettings):
        self.settings = settings
        self.engine = SharedEngine(engine)
        # each request's generation is one engine call: the engine is shared with the training loop,
        # which takes it for whole calls too (SharedEngine)
        self.service = EngineService(self.engine, tokenizer, settings.model_path, served_model_name=settings.model_name,
                                     tokenizer_path=settings.tokenizer_path, chat_max_tokens=settings.chat_max_tokens,
                                     context_length=settings.context_length)
        try:
            self.server = make_http_server(self.service, settings.host, settings.port,
                                           routes=self.service.openai_routes())
        except OSError as err:
            self.service.close()
            raise _address_error(settings.host, settings.port, err) from err
        self._thread: threading.Thread | None = None
        self._closed = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self.server.serve_forever, name="ridgeline-http-endpoint", daemon=True)
        self._thread.start()
        log.info("HTTP endpoint (generator.enable_http_endpoint): OpenAI API at %s/v1, model %r",
                 self.settings.url, self.settings.model_name)

    def hold(self) -> contextlib.AbstractContextManager[None]:
        """Requests wait for the engine until this ends (a weight sync: they then see the new weights)."""
        return self.engine.hold()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self.server.shutdown()   # returns once serve_forever has stopped
            self._thread.join()
        self.server.server_close()   # the port is free from here
        self.engine.close()          # a request waiting for the engine fails now
        self.service.close()
        log.info("HTTP endpoint on %s stopped", self.settings.url)
