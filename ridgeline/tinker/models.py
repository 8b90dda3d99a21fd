"""What the Tinker server runs: base models (loaded once each), training clients on them (a LoRA
adapter of the request's rank on a copy of the base, or every weight with rank 0), and samplers
(the embedded engine on saved weights).

Training follows the Tinker API: `forward_backward` adds the gradient of the summed loss of its
datums (one forward/backward per datum, so memory is one sequence's; a sum accumulates exactly),
`optim_step` applies AdamW with the call's AdamParams and clears the gradients. A sampler's
engine takes the merged weights of a checkpoint and must pass the stale-weights probe of training
(`ridgeline.distributed.weight_sync`: the engine's logprobs on a fixed probe equal the trained
model's within the fp32 tolerance) before it samples.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
from dataclasses import dataclass, replace
from typing import cast

import numpy as np
import torch
from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ridgeline.distributed.weight_sync import (ProbeTolerance, check_probe, probe_logprobs, probe_tokens,
                                                 probe_tolerance)
from ridgeline.inference.hf_engine import HFEngine
from ridgeline.inference.request_fields import RequestError
from ridgeline.inference.types import EngineRequest, SamplingParams
from ridgeline.models.loading import ModelSpec, load_model, load_tokenizer, tokenizer_folder
from ridgeline.models.lora import LoraSettings, is_lora, merged_copy, wrap
from ridgeline.tinker.checkpoints import ModelMeta
from ridgeline.tinker.losses import BoundLoss, bind
from ridgeline.tinker.wire import Datum, ForwardBackward, Sequence
from ridgeline.training.optim import param_groups

log = logging.getLogger(__name__)

LORA_PROBE_TOLERANCE = 1e-4   # max |logprob diff| of an fp32 engine on merged adapters (Sampler.from_model)
LORA_ALPHA = 32.0   # the adapters' scale is alpha / rank; Tinker's requests carry only the rank
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def target_modules(train_attn: bool, train_mlp: bool) -> str | list[str]:
    """peft's target_modules for Tinker's LoraConfig flags (Llama-family module names)."""
    if train_attn and train_mlp:
        return "all-linear"
    if not (train_attn or train_mlp):
        raise RequestError("lora_config: train_attn and train_mlp are both false: nothing would train "
                           "(an adapter on the output head alone is not served)", "lora_config.train_attn")
    return list(_ATTN if train_attn else _MLP)


@dataclass
class Base:
    name: str
    tokenizer: PreTrainedTokenizerBase
    tokenizer_folder: str        # what a client's AutoTokenizer.from_pretrained loads (get_tokenizer)
    model: PreTrainedModel       # float32, frozen; copied by every client and sampler
    engine_dtype: torch.dtype = torch.float32   # the samplers' (--sampler-dtype)

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])


def model_spec(name: str, seed: int) -> ModelSpec:
    """A served name as a model spec; `<folder or pkg://...>/<file>.gguf` is a GGUF file in its folder."""
    folder, sep, file = name.rpartition("/")
    if sep and file.endswith(".gguf"):
        return ModelSpec(path=folder, gguf_file=file, seed=seed, config_key="--model")
    return ModelSpec(path=name, seed=seed, config_key="--model")


class BaseModels:
    """The base models this server serves, by name (a hub id or folder, pkg://, tiny://, random://),
    each loaded on first use. Names not served are refused: a request never names a path to read."""

    def __init__(self, names: list[str], seed: int, engine_dtype: torch.dtype = torch.float32):
        self.names, self.seed, self.engine_dtype = list(names), seed, engine_dtype
        self._loaded: dict[str, Base] = {}
        self._lock = threading.Lock()

    def get(self, name: str, field: str = "base_model") -> Base:
        if name not in self.names:
            raise RequestError(f"{field} {name!r} is not served here (served: {', '.join(self.names)}; start the "
                               "server with --model NAME)", field)
        with self._lock:
            if name not in self._loaded:
                spec = model_spec(name, self.seed)
                tokenizer = load_tokenizer(spec)
                model = load_model(spec, torch.float32, tokenizer).eval()
                model.requires_grad_(False)
                self._loaded[name] = Base(name, tokenizer, tokenizer_folder(spec), model, self.engine_dtype)
            return self._loaded[name]


def build(base: Base, meta: ModelMeta) -> PreTrainedModel | PeftModel:
    """The trainable model of `meta` on `base`: a copy, with LoRA adapters when the rank is > 0."""
    model = copy.deepcopy(base.model)
    if meta.lora_rank > 0:
        settings = LoraSettings(rank=meta.lora_rank, alpha=LORA_ALPHA, target_modules=(
            meta.target_modules if isinstance(meta.target_modules, str) else tuple(meta.target_modules)),
            key="lora_config")
        return wrap(model, settings, seed=meta.seed)
    return model.requires_grad_(True)


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def load_trainable(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    own = trainable(model)
    if set(own) != set(tensors):
        missing, extra = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
        raise RequestError(f"path: the checkpoint's tensors do not fit this model (missing {missing[:3]}, "
                           f"unexpected {extra[:3]})", "path")
    with torch.no_grad():
        for name, p in own.items():
            p.copy_(tensors[name])


def _token_logprobs(model: torch.nn.Module, tokens: np.ndarray, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets[i] | tokens[:i+1]) for every position, [N] float32."""
    ids = torch.as_tensor(tokens, dtype=torch.long)[None]
    logits = model(input_ids=ids, use_cache=False).logits[0].float()
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)


class TrainedModel:
    """One training client: its model, AdamW over its trainable tensors, its step count."""

    def __init__(self, model_id: str, base: Base, meta: ModelMeta):
        self.model_id, self.base, self.meta = model_id, base, meta
        self.model = build(base, meta)
        self.model.eval()  # no dropout: the training forward computes the sampler's distribution
        groups = param_groups(self.model, 1.0)
        self._decays = [group["weight_decay"] > 0 for group in groups]
        self.optimizer = torch.optim.AdamW(groups, lr=1e-4)

    @property
    def is_lora(self) -> bool:
        return self.meta.lora_rank > 0

    def check(self, request: ForwardBackward) -> tuple[BoundLoss, list[dict[str, torch.Tensor]]]:
        """The request's loss and each datum's inputs as tensors; a bad one is a 400 naming it."""
        loss = bind(request.loss_fn, request.loss_fn_config)
        return loss, [self._inputs(i, d, loss.inputs) for i, d in enumerate(request.data)]

    def forward_backward(self, request: ForwardBackward, loss: BoundLoss, checked: list[dict[str, torch.Tensor]]
                         ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Per datum its target logprobs; the summed loss (`loss:sum`); gradients accumulated unless
        `forward_only`."""
        outputs, total = [], 0.0
        for datum, inputs in zip(request.data, checked):
            with torch.set_grad_enabled(not request.forward_only):
                lp = _token_logprobs(self.model, datum.tokens, inputs["target_tokens"].long())
                value = loss(lp, inputs)
                if not request.forward_only:
                    if not math.isfinite(value.item()):
                        raise RequestError("the loss is not finite on this batch (no gradient was added); check "
                                           "the advantages and logprobs sent", "data")
                    value.backward()
            total += float(value.detach())
            outputs.append({"logprobs": lp.detach().numpy()})
        return outputs, {"loss:sum": total}

    def _inputs(self, i: int, datum: Datum, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        for name in ("target_tokens", *names):
            if name not in datum.inputs:
                raise RequestError(f"data[{i}].loss_fn_inputs.{name} is missing (this loss takes target_tokens, "
                                   f"{', '.join(names)})", f"data[{i}].loss_fn_inputs.{name}")
        targets = datum.inputs["target_tokens"]
        if targets.dtype.kind != "i" or targets.min() < 0 or targets.max() >= self.base.vocab_size:
            raise RequestError(f"data[{i}].loss_fn_inputs.target_tokens must be int64 token ids in [0, "
                               f"{self.base.vocab_size})", f"data[{i}].loss_fn_inputs.target_tokens")
        if datum.tokens.min() < 0 or datum.tokens.max() >= self.base.vocab_size:
            raise RequestError(f"data[{i}].model_input: token ids must be in [0, {self.base.vocab_size})",
                               f"data[{i}].model_input")
        if datum.tokens.size > self.base.context_length:
            raise RequestError(f"data[{i}].model_input: {datum.tokens.size} tokens > the model's context length "
                               f"{self.base.context_length}", f"data[{i}].model_input")
        out = {"target_tokens": torch.as_tensor(targets.astype(np.int64))}
        for name in names:
            values = datum.inputs[name].astype(np.float32)
            if not np.isfinite(values).all():
                raise RequestError(f"data[{i}].loss_fn_inputs.{name} holds a non-finite value",
                                   f"data[{i}].loss_fn_inputs.{name}")
            out[name] = torch.as_tensor(values)
        return out

    def optim_step(self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                   grad_clip_norm: float) -> dict[str, float]:
        """One AdamW step with these hyperparameters (decay on matrices only, Ridgeline's groups);
        a non-finite gradient norm skips the step (counted in `optim/skipped`)."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip_norm if grad_clip_norm > 0 else math.inf)
        skipped = not math.isfinite(float(norm))
        if not skipped:
            for group, decays in zip(self.optimizer.param_groups, self._decays):
                group.update(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay if decays else 0.0)
            self.optimizer.step()
            self.meta = replace(self.meta, steps=self.meta.steps + 1)
        self.optimizer.zero_grad(set_to_none=True)
        return {"optim/grad_norm": float(norm), "optim/lr": lr, "optim/skipped": float(skipped),
                "optim/step": float(self.meta.steps)}

    def engine_model(self) -> PreTrainedModel:
        """Plain weights for an engine: the adapters merged in (peft's formula, the training copy untouched)."""
        if is_lora(self.model):
            return merged_copy(cast(PeftModel, self.model))
        return cast(PreTrainedModel, self.model)


@dataclass
class Sampler:
    """An engine on one checkpoint's weights."""

    base: Base
    engine: HFEngine
    source: str   # the tinker path or base model it samples

    @classmethod
    def from_model(cls, trained: TrainedModel, source: str) -> "Sampler":
        """An engine with `trained`'s weights, checked by the stale-weights probe."""
        engine = HFEngine(trained.base.model, trained.base.tokenizer, dtype=trained.base.engine_dtype)
        engine.update_weights(trained.engine_model().state_dict().items())
        prompt, response = probe_tokens(trained.base.tokenizer)
        tolerance = probe_tolerance(engine.dtype)
        if trained.is_lora and tolerance.statistic == "max":
            # W x + s B (A x) against the merged (W + s B A) x: another summation order, which on
            # SmolLM2 after one RL step moved a probe logprob by 1.45e-5 (past fp32's 1e-5); weights
            # that never landed move them by O(1)
            tolerance = ProbeTolerance("max", LORA_PROBE_TOLERANCE)
        check_probe(probe_logprobs(trained.model, prompt_ids=prompt, response_ids=response),
                    torch.tensor(engine.score(prompt, response)), tolerance)
        return cls(trained.base, engine, source)

    @classmethod
    def from_base(cls, base: Base) -> "Sampler":
        return cls(base, HFEngine(base.model, base.tokenizer, dtype=base.engine_dtype), base.name)

    def sample(self, prompt: list[int], num_samples: int, params: SamplingParams, stop_ids: tuple[int, ...],
               seed: int, prompt_logprobs: bool) -> tuple[list[Sequence], list[float] | None]:
        requests = [EngineRequest(prompt, params, stop_ids)] * num_samples
        outs = self.engine.generate(requests, seed=seed) if num_samples else []
        seqs = [Sequence(o.response_ids, o.logprobs, o.stop_reason == "stop") for o in outs]
        scored = None
        if prompt_logprobs:
            scored = [float("nan")] + self.engine.score(prompt[:1], prompt[1:])
        return seqs, scored
