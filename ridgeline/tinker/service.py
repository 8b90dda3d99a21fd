"""The Tinker API's state and calls: sessions, training clients (models), sampling sessions,
checkpoints and futures. Each public method is one route's handler: it takes the request body,
checks it through the SDK's own types (`wire.parse`), and answers a JSON object or, for the
results the SDK reads as protobuf, a `RawAnswer`. Model work (training, saving, sampling) is
queued on the `FutureStore` and answered by request id. The SDK (the `tinker` extra) is imported
in the handlers, as every extra's package is.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ridgeline.inference.http_app import RawAnswer
from ridgeline.inference.request_fields import RequestError
from ridgeline.inference.types import SamplingParams
from ridgeline.seeding import derive_seed
from ridgeline.tinker.checkpoints import CheckpointStore, ModelMeta, TinkerPath, check_name
from ridgeline.tinker.futures import FutureStore, Result
from ridgeline.tinker.limits import TinkerLimits
from ridgeline.tinker.models import BaseModels, Sampler, TrainedModel, load_trainable, target_modules
from ridgeline.tinker.wire import PROTO_MEDIA_TYPE, parse, parse_forward_backward, sample_response
from ridgeline.tinker.wire import forward_backward_output

if TYPE_CHECKING:
    from tinker import types

log = logging.getLogger(__name__)


@dataclass
class _SamplingSession:
    base_model: str
    model_path: str | None          # the checkpoint it samples, or None (a snapshot or the base)
    snapshot: bool = False          # a training client's weights at save time, held only in the engine cache


class TinkerService:
    def __init__(self, models: list[str], root: Path, *, seed: int = 0, limits: TinkerLimits = TinkerLimits(),
                 sampler_dtype: torch.dtype = torch.float32):
        self.limits, self.seed = limits, seed
        self.bases = BaseModels(models, seed, sampler_dtype)
        self.store = CheckpointStore(root)
        self.futures = FutureStore(max_queued=limits.max_queued_requests)
        self.models: dict[str, TrainedModel] = {}
        self.sessions: set[str] = set()
        # session id -> how its client ended it (ServiceClient.close / its `with` block): first wins
        self.finished: dict[str, str] = {}
        self.sampling: dict[str, _SamplingSession] = {}
        self._engines: OrderedDict[str, Sampler] = OrderedDict()
        self._lock = threading.Lock()
        self._sample_ids = itertools.count()

    # -- service ---------------------------------------------------------------------------------
    def health(self, body: dict) -> dict:
        return {"status": "ok"}

    def client_config(self, body: dict) -> dict:
        from tinker import types

        # plain API keys, no JWT exchange; forward_backward bodies uncompressed, one chunk at a time
        return types.ClientConfigResponse(pjwt_auth_enabled=False, proto_compress_fwdbwd=False,
                                          parallel_fwdbwd_chunks=False, use_pyqwest_transport=False,
                                          sample_use_retrieve_futures=False).model_dump()

    def dynamic_config(self, body: dict) -> dict:
        from tinker import types

        return types.ClientDynamicConfigResponse().model_dump()

    def capabilities(self, body: dict) -> dict:
        return {"supported_models": [{"model_name": name, "trainable": True, "sampleable": True}
                                     for name in self.bases.names]}

    def create_session(self, body: dict) -> dict:
        from tinker import types

        parse(types.CreateSessionRequest, body)
        session_id = f"session-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self.sessions.add(session_id)
        return {"type": "create_session", "session_id": session_id}

    def heartbeat(self, body: dict) -> dict | RawAnswer:
        from tinker import types

        session_id = parse(types.SessionHeartbeatRequest, body).session_id
        if session_id in self.finished:
            # 410 Gone: the SDK's heartbeat loop stops on it (it reports any other failure every minute)
            gone = {"error": f"session {session_id} was finished by its client ({self.finished[session_id]})"}
            return RawAnswer(json.dumps(gone).encode(), "application/json", status=410)
        self._session(session_id, "session_id")
        return {"type": "session_heartbeat"}

    def finish_session(self, body: dict) -> dict:
        """`ServiceClient.close(status)` and the end of its `with` block: the session ends with its
        first reason (success, errored, interrupted); nothing new starts in it, its heartbeat gets
        410. Models and samplers it made stay usable by id, as they are for a lost session."""
        session_id = str(body.get("session_id", ""))
        reason = body.get("reason")
        kind = reason.get("type") if isinstance(reason, dict) else None
        if kind not in ("success", "errored", "interrupted"):
            raise RequestError(f"reason.type must be success, errored or interrupted, got {kind!r}", "reason.type")
        with self._lock:
            if session_id not in self.sessions:
                raise RequestError(f"session_id {session_id!r} is not a session of this server", "session_id")
            self.finished.setdefault(session_id, kind)
        return {}

    def telemetry(self, body: dict) -> dict:
        return {"status": "accepted"}

    def _session(self, session_id: str, field: str) -> str:
        if session_id not in self.sessions:
            raise RequestError(f"{field} {session_id!r} is not a session of this server (create one first)", field)
        if session_id in self.finished:
            raise RequestError(f"{field} {session_id!r} was finished by its client ({self.finished[session_id]}): "
                               "create a new ServiceClient", field)
        return session_id

    # -- futures ---------------------------------------------------------------------------------
    def retrieve_future(self, body: dict) -> dict | RawAnswer:
        from tinker import types

        request = parse(types.FutureRetrieveRequest, body)
        result = self.futures.wait(request.request_id)
        if result is None:
            # still running: Tinker's "try again" as HTTP 408, which the SDK retries without a warning
            body = {"type": "try_again", "request_id": request.request_id, "queue_state": "active"}
            return RawAnswer(json.dumps(body).encode(), "application/json", status=408)
        if result.error is not None:
            return {"error": result.error, "category": result.category}
        if result.proto is not None:
            return RawAnswer(result.proto, PROTO_MEDIA_TYPE)
        return result.json or {}

    def _future(self, work, model_id: str | None = None, **extra) -> dict:
        return {"request_id": self.futures.submit(work), "model_id": model_id, **extra}

    # -- training clients ------------------------------------------------------------------------
    def _model(self, model_id: str, field: str = "model_id") -> TrainedModel:
        model = self.models.get(model_id)
        if model is None:
            raise RequestError(f"{field} {model_id!r} is not a training client of this server", field)
        return model

    def _add_model(self, model_id: str, meta: ModelMeta) -> str:
        base = self.bases.get(meta.base_model)
        with self._lock:
            if len(self.models) >= self.limits.max_models:
                raise RequestError(f"this server holds {self.limits.max_models} training clients already "
                                   "(--max-models)", "base_model")
            if model_id in self.models:
                raise RequestError(f"model_seq_id: training client {model_id} exists already", "model_seq_id")
            self.models[model_id] = None  # type: ignore[assignment]  # reserved while it builds
        try:
            self.models[model_id] = TrainedModel(model_id, base, meta)
        except BaseException:
            del self.models[model_id]
            raise
        return model_id

    def create_model(self, body: dict) -> dict:
        from tinker import types

        request = parse(types.CreateModelRequest, body)
        self._session(request.session_id, "session_id")
        self.bases.get(request.base_model)  # an unknown name is a 400 now, not a failed future
        lora = request.lora_config
        if lora is not None and lora.rank < 0:
            raise RequestError(f"lora_config.rank must be >= 0 (0: full-parameter), got {lora.rank}",
                               "lora_config.rank")
        if request.optimizer_config.type != "adamw":
            raise RequestError(f"optimizer_config.type {request.optimizer_config.type!r}: only adamw is served",
                               "optimizer_config.type")
        if lora is not None and lora.rank > 0 and lora.train_unembed:
            _note_once("lora_config.train_unembed: the output head gets no adapter here (peft's all-linear leaves it "
                       "out, and SmolLM2-like models tie it to the embeddings); attention and MLP layers train")
        meta = ModelMeta(base_model=request.base_model, lora_rank=0 if lora is None else lora.rank,
                         target_modules=("all-linear" if lora is None else
                                         target_modules(lora.train_attn, lora.train_mlp)),
                         seed=self.seed if lora is None or lora.seed is None else lora.seed)

        # the id the SDK derives itself for clients created from a checkpoint: (session, client number)
        model_id = f"{request.session_id}:train:{request.model_seq_id}"

        def work() -> Result:
            return Result(json={"type": "create_model", "model_id": self._add_model(model_id, meta)})
        return self._future(work)

    def get_info(self, body: dict) -> dict:
        from tinker import types

        request = parse(types.GetInfoRequest, body)
        model = self._model(request.model_id)
        return {"type": "get_info", "model_id": model.model_id, "model_name": model.meta.base_model,
                "is_lora": model.is_lora, "lora_rank": model.meta.lora_rank or None,
                "model_data": {"arch": type(model.base.model).__name__, "model_name": model.meta.base_model,
                               "tokenizer_id": model.base.tokenizer_folder}}

    def forward_backward(self, body: dict) -> dict:
        request = parse_forward_backward(body["raw"], self.limits.max_tokens_per_request)
        model = self._model(request.model_id)
        loss, checked = model.check(request)

        def work() -> Result:
            outputs, metrics = model.forward_backward(request, loss, checked)
            return Result(proto=forward_backward_output(outputs, metrics))
        return self._future(work, model.model_id)

    def optim_step(self, body: dict) -> dict:
        from tinker import types

        request = parse(types.OptimStepRequest, body)
        model = self._model(request.model_id)
        p = request.optim_params
        if not isinstance(p, types.AdamParams):
            raise RequestError("optim_params: only AdamParams are served", "optim_params")
        for name, value, ok in (("learning_rate", p.learning_rate, p.learning_rate >= 0),
                                ("beta1", p.beta1, 0 <= p.beta1 < 1), ("beta2", p.beta2, 0 <= p.beta2 < 1),
                                ("eps", p.eps, p.eps > 0), ("weight_decay", p.weight_decay, p.weight_decay >= 0),
                                ("grad_clip_norm", p.grad_clip_norm, p.grad_clip_norm >= 0)):
            if not ok:
                raise RequestError(f"adam_params.{name} = {value} is out of range", f"adam_params.{name}")

        def work() -> Result:
            return Result(json={"metrics": model.optim_step(p.learning_rate, (p.beta1, p.beta2), p.eps,
                                                            p.weight_decay, p.grad_clip_norm)})
        return self._future(work, model.model_id)

    # -- weights ---------------------------------------------------------------------------------
    def save_weights(self, body: dict) -> dict:
        from tinker import types

        request = parse(types.SaveWeightsRequest, body)
        model = self._model(request.model_id)
        path = TinkerPath(model.model_id, "weights", check_name(request.path or f"step-{model.meta.steps}", "path"))
        if request.ttl_seconds is not None:
            _note_once("ttl_seconds: checkpoints here never expire (they are folders under --root; delete them there)")

        def work() -> Result:
            self.store.save(path, model.meta, _plain(model), model.optimizer.state_dict(),
                            overwrite=request.overwrite)
            return Result(json={"type": "save_weights", "path": str(path)})
        return self._future(work, model.model_id)

    def save_weights_for_sampler(self, body: dict) -> dict:
        from tinker import types

        request = parse(types.SaveWeightsForSamplerRequest, body)
        model = self._model(request.model_id)
        if request.kind != "snapshot":
            raise RequestError(f"kind {request.kind!r}: only snapshot sampling clients are served", "kind")
        if request.path is None:
            if request.sampling_session_seq_id is None:
                raise RequestError("give path (a checkpoint) or sampling_session_seq_id (a snapshot)", "path")

            def snapshot() -> Result:
                session_id = f"{model.model_id}:snapshot:{next(self._sample_ids)}"
                sampler = Sampler.from_model(model, f"{model.model_id} after {model.meta.steps} steps")
                self.sampling[session_id] = _SamplingSession(model.meta.base_model, None, snapshot=True)
                self._keep_engine(session_id, sampler)
                return Result(json={"type": "save_weights_for_sampler", "sampling_session_id": session_id})
            return self._future(snapshot, model.model_id)
        path = TinkerPath(model.model_id, "sampler_weights", check_name(request.path, "path"))

        def work() -> Result:
            self.store.save(path, model.meta, _plain(model), None, overwrite=True)
            return Result(json={"type": "save_weights_for_sampler", "path": str(path)})
        return self._future(work, model.model_id)

    def load_weights(self, body: dict) -> dict:
        """Into an existing client (`model_id`), or a new one (`session_id`: create-via-load)."""
        from tinker import types

        request = parse(types.LoadWeightsRequest, body)
        path = TinkerPath.parse(request.path)
        if request.model_id is not None:
            model = self._model(request.model_id)
        else:
            if request.session_id is None:
                raise RequestError("give model_id (load into a client) or session_id (a new client)", "session_id")
            self._session(request.session_id, "session_id")
            if request.model_seq_id is None:
                raise RequestError("model_seq_id is missing (a new client's number in its session)", "model_seq_id")
            model = None
        meta, tensors, optimizer = self.store.load(path, optimizer=request.optimizer)
        if model is not None and (model.meta.base_model, model.meta.lora_rank, model.meta.target_modules) != (
                meta.base_model, meta.lora_rank, meta.target_modules):
            raise RequestError(f"path: {path} holds {meta.base_model} rank {meta.lora_rank} on {meta.target_modules}, "
                               f"this client is {model.meta.base_model} rank {model.meta.lora_rank} on "
                               f"{model.meta.target_modules}", "path")

        def work() -> Result:
            target = model
            if target is None:
                model_id = f"{request.session_id}:train:{request.model_seq_id}"
                target = self.models[self._add_model(model_id, meta if request.optimizer else replace(meta, steps=0))]
            load_trainable(target.model, tensors)
            if optimizer is not None:
                target.optimizer.load_state_dict(optimizer)
                target.meta = meta
            return Result(json={"type": "load_weights", "path": str(path), "model_id": target.model_id})
        return self._future(work, model.model_id if model else None)

    def list_checkpoints(self, body: dict) -> dict:
        model_id = check_name(str(body.get("model_id", "")), "model_id")
        return {"checkpoints": [{"checkpoint_id": f"{p.kind}/{p.name}",
                                 "checkpoint_type": "training" if p.kind == "weights" else "sampler",
                                 "time": when.isoformat(), "tinker_path": str(p), "size_bytes": size}
                                for p, when, size in self.store.list(model_id)]}

    # -- sampling --------------------------------------------------------------------------------
    def create_sampling_session(self, body: dict) -> dict:
        from tinker import types

        request = parse(types.CreateSamplingSessionRequest, body)
        self._session(request.session_id, "session_id")
        if request.model_path is not None:
            path = TinkerPath.parse(request.model_path, "model_path")
            meta, _, _ = self.store.load(path, optimizer=False)
            base_model = meta.base_model
        elif request.base_model is not None:
            base_model = request.base_model
        else:
            raise RequestError("give model_path (saved weights) or base_model", "model_path")
        self.bases.get(base_model)
        session_id = f"{request.session_id}:sample:{request.sampling_session_seq_id}"
        self.sampling[session_id] = _SamplingSession(base_model, request.model_path)
        return {"type": "create_sampling_session", "sampling_session_id": session_id}

    def get_sampler(self, body: dict) -> dict:
        sampler_id = str(body.get("sampler_id", ""))
        session = self.sampling.get(sampler_id)
        if session is None:
            raise RequestError(f"sampler_id {sampler_id!r} is not a sampling session of this server", "sampler_id")
        return {"sampler_id": sampler_id, "base_model": session.base_model, "model_path": session.model_path}

    def sample(self, body: dict) -> dict:
        from tinker import types

        request = parse(types.SampleRequest, body)
        if request.sampling_session_id is not None:
            session = self.sampling.get(request.sampling_session_id)
            if session is None:
                raise RequestError(f"sampling_session_id {request.sampling_session_id!r} is not a sampling session "
                                   "of this server", "sampling_session_id")
            key = request.sampling_session_id
        elif request.model_path is not None or request.base_model is not None:
            session = _SamplingSession(request.base_model or "", request.model_path)
            if request.model_path is not None:
                session.base_model = self.store.load(TinkerPath.parse(request.model_path, "model_path"),
                                                     optimizer=False)[0].base_model
            key = request.model_path or session.base_model
        else:
            raise RequestError("give sampling_session_id, model_path or base_model", "sampling_session_id")
        base = self.bases.get(session.base_model)
        prompt = self._prompt(request, base.vocab_size)
        params, stop_ids = self._sampling_params(request, len(prompt), base.context_length)
        unserved = [name for name, on in (("topk_prompt_logprobs", request.topk_prompt_logprobs),
                                          ("topk_sample_logprobs", request.topk_sample_logprobs),
                                          ("target_prompt_logprobs", request.target_prompt_logprobs is not None),
                                          ("prompt_alt_tokens_k", request.prompt_alt_tokens_k),
                                          ("prompt_logprobs_last_n", request.prompt_logprobs_last_n is not None),
                                          ("record_stability_info", request.record_stability_info)) if on]
        if unserved:
            raise RequestError(f"{unserved[0]} is not served by this server (see docs/tinker.md)", unserved[0])
        seed = request.sampling_params.seed
        seed = derive_seed(self.seed, "tinker-sample", key, request.seq_id or 0) if seed is None else seed
        n = request.num_samples

        def work() -> Result:
            sampler = self._sampler(key, session)
            seqs, prompt_lp = sampler.sample(prompt, n, params, stop_ids, seed, bool(request.prompt_logprobs))
            return Result(proto=sample_response(seqs, prompt_lp))
        request_id = self.futures.submit(work)
        return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(n)]}

    def _prompt(self, request: types.SampleRequest, vocab: int) -> list[int]:
        try:
            prompt = request.prompt.to_ints()
        except ValueError:
            raise RequestError("prompt: only token chunks are served (no images, no audio)", "prompt") from None
        if not prompt:
            raise RequestError("prompt is empty", "prompt")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise RequestError(f"prompt: token ids must be in [0, {vocab})", "prompt")
        return prompt

    def _sampling_params(self, request: types.SampleRequest, prompt_len: int,
                         context: int) -> tuple[SamplingParams, tuple[int, ...]]:
        sp, n = request.sampling_params, request.num_samples
        if not 1 <= n <= self.limits.max_samples_per_request:
            raise RequestError(f"num_samples must be in [1, {self.limits.max_samples_per_request}], got {n}",
                               "num_samples")
        room = context - prompt_len
        if room < 1:
            raise RequestError(f"prompt: {prompt_len} tokens leave no room in the context of {context}", "prompt")
        max_tokens = room if sp.max_tokens is None else sp.max_tokens
        if not 1 <= max_tokens <= room:
            raise RequestError(f"sampling_params.max_tokens must be in [1, {room}] (the context left after the "
                               f"prompt), got {max_tokens}", "sampling_params.max_tokens")
        if prompt_len + n * max_tokens > self.limits.max_tokens_per_request:
            raise RequestError(f"prompt + num_samples * max_tokens > {self.limits.max_tokens_per_request} tokens "
                               "(--max-tokens-per-request)", "sampling_params.max_tokens")
        if not (sp.temperature >= 0 and 0 < sp.top_p <= 1 and (sp.top_k == -1 or sp.top_k >= 1)):
            raise RequestError("sampling_params: need temperature >= 0, 0 < top_p <= 1, top_k -1 or >= 1",
                               "sampling_params")
        stop = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        strings = tuple(s for s in stop if isinstance(s, str))
        if not all(isinstance(s, (str, int)) and not isinstance(s, bool) for s in stop):
            raise RequestError("sampling_params.stop: strings or token ids", "sampling_params.stop")
        ids = tuple(s for s in stop if isinstance(s, int))
        params = SamplingParams(max_generate_length=max_tokens, temperature=sp.temperature, top_p=sp.top_p,
                                top_k=sp.top_k, stop=strings)
        return params, ids

    def _sampler(self, key: str, session: _SamplingSession) -> Sampler:
        """The engine of a sampling session (built from its checkpoint when not kept)."""
        if key in self._engines:
            self._engines.move_to_end(key)
            return self._engines[key]
        if session.snapshot:
            raise RequestError(f"sampling_session_id {key!r}: this snapshot's engine was dropped (the server keeps "
                               f"the last {self.limits.max_samplers}, --max-samplers); save the weights under a name "
                               "(save_weights_for_sampler(name)) to sample them later", "sampling_session_id")
        if session.model_path is not None:
            path = TinkerPath.parse(session.model_path, "model_path")
            meta, tensors, _ = self.store.load(path, optimizer=False)
            trained = TrainedModel(f"{path.model_id}-sampler", self.bases.get(meta.base_model), meta)
            load_trainable(trained.model, tensors)
            sampler = Sampler.from_model(trained, str(path))
        else:
            sampler = Sampler.from_base(self.bases.get(session.base_model))
        self._keep_engine(key, sampler)
        return sampler

    def _keep_engine(self, key: str, sampler: Sampler) -> None:
        self._engines[key] = sampler
        while len(self._engines) > self.limits.max_samplers:
            self._engines.popitem(last=False)


@functools.lru_cache(maxsize=None)
def _note_once(message: str) -> None:
    """A request option this server does not act on, said once in its log (the cache remembers)."""
    log.warning(message)


def _plain(model: TrainedModel):
    return {name: p.detach() for name, p in model.model.named_parameters() if p.requires_grad}
