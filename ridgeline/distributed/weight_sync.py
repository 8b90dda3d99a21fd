"""Cross-process weight sync: the transport (ridgeline.inference.weight_transport, re-exported
here) and a cheap probe that checks the engines really use the weights they were sent."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, NamedTuple, Protocol

import torch
from torch import nn

from ridgeline.inference.weight_transport import (DEFAULT_CHUNK_BYTES, GroupSpec, SyncHeader, SyncStats,
                                                  TensorBroadcaster, TensorMeta, WeightReceiver, WeightSender,
                                                  WeightSyncError)
from ridgeline.inference.types import InferenceEngine
from ridgeline.training.logprobs import response_logprobs
from ridgeline.training.worker import PolicyWorker

if TYPE_CHECKING:
    from ridgeline.models.lora import MaybeAdapted

__all__ = [
    "DEFAULT_CHUNK_BYTES", "GroupSpec", "SyncHeader", "SyncStats", "TensorBroadcaster", "TensorMeta",
    "WeightReceiver", "WeightSender", "WeightSyncError", "StaleWeightsError", "PROBE_TEXT", "ProbeTolerance",
    "PROBE_TOLERANCE", "probe_tolerance", "probe_tokens", "probe_logprobs", "check_probe", "probe_engines", "sync_report",
    "WeightSync", "InProcessWeightSync", "RemoteWeightSync",
]

log = logging.getLogger(__name__)


class WeightSync(Protocol):
    """Brings the engines the policy's current weights after an optimizer step: in one process
    (`InProcessWeightSync`), from policy rank 0 to engine actors (ray_workers.RayWeightSync), or to
    remote servers (`RemoteWeightSync`). Engines in other processes are probed after every sync."""

    def sync(self, version: int) -> dict[str, float]:
        """Send weight version `version` (the global step); the `weight_sync/*` metrics."""
        ...


class InProcessWeightSync:
    """An engine in this process (`trainer.strategy=single`): it copies (casting to its dtype) the
    policy's parameters in place, device to device; no transport, so no probe is needed."""

    def __init__(self, policy: PolicyWorker, engine: InferenceEngine):
        self.policy, self.engine = policy, engine

    def sync(self, version: int) -> dict[str, float]:
        self.engine.update_weights(self.policy.named_weights())
        return {}


class StaleWeightsError(RuntimeError):
    """An engine's logprobs on the probe differ from the trainer's beyond the tolerance."""

    def __init__(self, message: str, max_abs_diff: float):
        super().__init__(message)
        self.max_abs_diff = max_abs_diff



# -- probe -------------------------------------------------------------------------------------

PROBE_TEXT = "Probe: 12 + 30 = 42. The quick brown fox jumps over the lazy dog."

class ProbeTolerance(NamedTuple):
    """How far an engine's probe logprobs may be from the trainer's: `statistic` ("max" or
    "mean") of the per-token |difference|, at most `value`."""
    statistic: str
    value: float


# Identical weights in fp32 through the same implementation differ only by reduction order
# (<1e-6; pass a looser tolerance for an engine with other kernels, e.g. vLLM in fp32), so fp32
# engines are held to the max difference. An engine in bf16/fp16 rounds every weight and
# activation: per-token logprobs move by up to 0.2 on SmolLM2-135M (mean 0.053; 8e-3 max on the
# tiny Llama), while weights that never landed, landed under wrong names, or arrived garbled move
# them by O(1) (measured on SmolLM2: one decoder layer zeroed -> mean 1.77; 10% noise on every
# weight -> mean 1.70). So low precision is held to the MEAN difference, with a 5x margin over
# rounding and 7x under corruption. It cannot see a one-step-old policy; the version counter does.
PROBE_TOLERANCE: dict[torch.dtype, ProbeTolerance] = {
    torch.float32: ProbeTolerance("max", 1e-5),
    torch.float16: ProbeTolerance("mean", 0.25),
    torch.bfloat16: ProbeTolerance("mean", 0.25),
}


def probe_tolerance(engine_dtype: torch.dtype) -> ProbeTolerance:
    return PROBE_TOLERANCE.get(engine_dtype, ProbeTolerance("mean", 0.25))


def probe_tokens(tokenizer, text: str = PROBE_TEXT, response_tokens: int = 8) -> tuple[list[int], list[int]]:
    """A fixed, deterministic (prompt, response) split of `text`'s token ids."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    n = max(1, min(response_tokens, len(ids) // 2))
    return ids[:-n], ids[-n:]


@torch.no_grad()
def probe_logprobs(model: MaybeAdapted, tokenizer=None, prompt_ids: list[int] | None = None,
                   response_ids: list[int] | None = None, device: torch.device | None = None) -> torch.Tensor:
    """Teacher-forced fp32 logprobs of `response_ids` after `prompt_ids` (the fixed probe of
    `tokenizer` when not given) — the same computation on the trainer's policy and on an engine's
    model (`HFEngine.model`), so any difference comes from the weights or their dtype. Runs on
    `device` (default: the parameters'), returns on the host."""
    if prompt_ids is None or response_ids is None:
        if tokenizer is None:
            raise ValueError("probe_logprobs needs a tokenizer or explicit prompt_ids and response_ids")
        prompt_ids, response_ids = probe_tokens(tokenizer)
    seq = torch.tensor([list(prompt_ids) + list(response_ids)], dtype=torch.long)
    mask = torch.ones_like(seq)
    was_training = model.training
    model.eval()  # no dropout in the probe; restored below so the trainer's mode is untouched
    try:
        lp, _ = response_logprobs(model, seq, mask, len(response_ids), device=device)
    finally:
        model.train(was_training)
    return lp[0].float().cpu()


def check_probe(trainer_lp: torch.Tensor, engine_lp: torch.Tensor, tolerance: float | ProbeTolerance,
                version: int | None = None) -> float:
    """Return the tolerance's statistic of |difference| (a bare float tolerance means the max);
    raise `StaleWeightsError` when it exceeds the tolerance (see `probe_tolerance`)."""
    if not isinstance(tolerance, ProbeTolerance):
        tolerance = ProbeTolerance("max", float(tolerance))
    if trainer_lp.shape != engine_lp.shape:
        raise StaleWeightsError(f"probe shapes differ: trainer {tuple(trainer_lp.shape)} vs engine "
                                f"{tuple(engine_lp.shape)}", float("inf"))
    diffs = (trainer_lp.float() - engine_lp.float()).abs()
    if not diffs.numel():
        return 0.0
    diff = float(diffs.max() if tolerance.statistic == "max" else diffs.mean())
    if not diff <= tolerance.value:  # also catches NaN
        at = f" after weight sync version {version}" if version is not None else ""
        raise StaleWeightsError(f"engine logprobs differ from the trainer's on the probe{at}: {tolerance.statistic} "
                                f"|diff| {diff:.3g} > tolerance {tolerance.value:g}; the engine is not running the "
                                f"trainer's weights", diff)
    return diff


def probe_engines(trainer_lp: torch.Tensor, engine_lps, tolerance: ProbeTolerance, version: int | None) -> float:
    """The worst engine's probe difference (`check_probe` on each: `StaleWeightsError` past the tolerance)."""
    return max(check_probe(trainer_lp, torch.as_tensor(lp), tolerance, version) for lp in engine_lps)


def sync_report(version: int, nbytes: int, seconds: float, worst: float, probe_seconds: float, engines: str,
                tolerance: ProbeTolerance) -> dict[str, float]:
    """The `weight_sync/*` metrics of one sync, logged once at start (INFO) and then at DEBUG."""
    mb = nbytes / 1e6
    per_mb = seconds / mb if mb else 0.0
    level = logging.INFO if version <= 1 else logging.DEBUG
    log.log(level, "weight sync v%d: %.1f MB in %.3f s (%.2f ms/MB) to %s, probe %s |diff| %.2g", version, mb,
            seconds, 1e3 * per_mb, engines, tolerance.statistic, worst)
    return {"weight_sync/seconds": seconds, "weight_sync/megabytes": mb, "weight_sync/seconds_per_mb": per_mb,
            "weight_sync/probe_abs_diff": worst, "weight_sync/probe_seconds": probe_seconds}


class RemoteWeightSync:
    """Remote engines (`generator.run_engines_locally=false`): `push(version)` sends the policy's
    weights to every server (from this process, or from policy rank 0 on Ray) and returns
    {"bytes", "seconds"}; then every server scores the probe and must agree with
    `trainer_probe()`, since a server that silently kept old weights would otherwise go unnoticed
    for the whole run. `engine` is the driver's `RemoteEngine` (`score_all`, `urls`, `retried`)."""

    def __init__(self, engine, tokenizer, push: Callable[[int], dict[str, float]], trainer_probe: Callable[[], torch.Tensor]):
        self.engine, self.push, self.trainer_probe = engine, push, trainer_probe
        self.probe_ids = probe_tokens(tokenizer)
        self.tolerance = probe_tolerance(engine.dtype)

    def sync(self, version: int) -> dict[str, float]:
        stats = self.push(version)
        t0 = time.perf_counter()
        worst = probe_engines(self.trainer_probe(), self.engine.score_all(*self.probe_ids), self.tolerance, version)
        metrics = sync_report(version, int(stats["bytes"]), stats["seconds"], worst, time.perf_counter() - t0,
                              f"{len(self.engine.urls)} remote engine(s)", self.tolerance)
        return {**metrics, "remote/retries": float(self.engine.retried)}
