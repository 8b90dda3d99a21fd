"""vLLM as Ridgeline's inference engine (`generator.backend=vllm`): the offline `vllm.LLM`, token
ids in and token ids + logprobs out (no tokenizer inside vLLM, `skip_tokenizer_init=True`, unless
stop strings need one).

Config -> `vllm.LLM(**vllm_engine_kwargs(cfg))`:

| Ridgeline key                                          | vllm.LLM kwarg           |
|--------------------------------------------------------|--------------------------|
| trainer.policy.model.path (+ gguf_file; tiny:// saved) | model                    |
| generator.model_dtype                                  | dtype                    |
| generator.inference_engine_tensor_parallel_size       | tensor_parallel_size     |
| generator.inference_engine_pipeline_parallel_size     | pipeline_parallel_size   |
| generator.inference_engine_expert_parallel_size > 1   | enable_expert_parallel   |
| generator.gpu_memory_utilization                       | gpu_memory_utilization   |
| generator.enable_prefix_caching                        | enable_prefix_caching    |
| generator.enable_chunked_prefill                       | enable_chunked_prefill   |
| generator.max_num_batched_tokens                       | max_num_batched_tokens   |
| generator.max_num_seqs                                 | max_num_seqs             |
| generator.enforce_eager                                | enforce_eager            |
| trainer.seed                                           | seed                     |
| prompt + generation lengths (`max_model_len`, below)   | max_model_len            |
| trainer.placement.colocate_all                         | enable_sleep_mode        |
| generator.sampling_params (`vllm_logprobs_mode`)       | logprobs_mode            |
| generator.*sampling_params.logprobs above 20           | max_logprobs             |
| no generator.*sampling_params.stop (`uses_stop_strings`) | skip_tokenizer_init    |
| trainer.policy.model_config_kwargs, generator.rope_*   | hf_overrides (when set)  |
| (fixed)                                                | worker_extension_cls     |
| generator.engine_init_kwargs                           | merged last: the user wins |

`generator.inference_engine_data_parallel_size` is no kwarg: each data-parallel rank is an engine
of its own (`ridgeline.inference.parallelism`). `generator.vllm_v1_disable_multiproc` (SkyRL's
default true) sets VLLM_ENABLE_V1_MULTIPROCESSING=0 in the engine's process before vLLM starts
(`vllm_engine_env`), as SkyRL's engine actor does: the engine core then runs in that process
(tensor-parallel workers stay processes of their own); false leaves vLLM's default, the engine core
in a child process.

Context length: every engine call's input is at most the longer of `trainer.max_prompt_length`
(first turn: longer prompts are dropped) and `generator.max_input_length` (later turns: the
generator ends a trajectory whose next input would exceed it), and every call adds at most
`max_generate_length` tokens (training or eval, whichever is longer). So
`max_model_len = max(max_prompt_length, max_input_length) + max(max_generate_length)` holds for
any `generator.max_turns`; multiplying by the turns would only shrink the KV cache for nothing.
SkyRL leaves vLLM's default (the model's whole context); Ridgeline sizes it to what it can send
and refuses, naming the keys, when that exceeds the model's context.

Stop strings: vLLM matches them on detokenized text (`detokenize=True`), so with
`generator.sampling_params.stop` or `eval_sampling_params.stop` set the engine loads the model
folder's tokenizer; without them it runs token-only.

This module imports vLLM only inside `VLLMEngine`, so the mapping functions work (and are
tested) without it; `sglang_engine` shares the engine-independent helpers below.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterable, Iterator, Sequence, TYPE_CHECKING

import torch

from ridgeline.inference.library_engine import (
    UPDATE_BATCH_BYTES,
    LibraryEngine,
    engine_init_kwargs,
    engine_torch_dtype,
    max_model_len,
    missing_package_error,
    model_dtype_name,
    policy_model_folder,
    tensor_batches,
    uses_stop_strings,
    with_config_overrides,
)
from ridgeline.inference.launch import WORKER_EXTENSION
from ridgeline.inference.parallelism import EngineParallelism
from ridgeline.inference.types import (
    EngineError,
    EngineOutput,
    EngineRequest,
    SamplingParams,
    StopReason,
    TopLogprobs,
)
from ridgeline.seeding import request_seeds

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema import RidgelineConfig

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- vLLM mapping (pure)

VLLM_MAX_LOGPROBS = 20  # vLLM's default `max_logprobs`: a request may ask for at most this many


def vllm_logprobs_mode(params: SamplingParams) -> tuple[str, str | None]:
    """vLLM's `logprobs_mode` closest to Ridgeline's contract (logprobs of the temperature-scaled
    distribution before the repetition penalty and top-k / top-p / min-p), and a warning when none
    matches.

    vLLM 0.32 offers "raw_logprobs" (before penalties and temperature) and "processed_logprobs"
    (after penalties, temperature AND min-p / top-k / top-p). So, with "modified" meaning any of
    top_k / top_p / min_p / repetition_penalty != 1:

    | sampling_params                           | mode                | matches the contract |
    |-------------------------------------------|---------------------|----------------------|
    | not modified                              | processed_logprobs  | exactly              |
    | modified, temperature 1 (or 0 = greedy)   | raw_logprobs        | exactly              |
    | modified, any other temperature           | raw_logprobs        | no: unscaled, warned |

    Greedy requests report the unscaled distribution in both modes, as the contract says."""
    modified = params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0 or params.repetition_penalty != 1.0
    if not modified:
        return "processed_logprobs", None
    if params.temperature in (0.0, 1.0):
        return "raw_logprobs", None
    return "raw_logprobs", (
        f"generator.sampling_params has temperature={params.temperature:g} together with top_k/top_p/min_p "
        "filtering or a repetition_penalty: vLLM returns logprobs either before temperature or after "
        "temperature, penalty and filtering, never Ridgeline's temperature-scaled unmodified ones. Using "
        "logprobs_mode=raw_logprobs: rollout logprobs are unscaled (temperature 1) and differ from the "
        "trainer's recomputation (use_tis, off-policy metrics). Fix: sample with temperature=1, or without "
        "top_k/top_p/min_p/repetition_penalty")


def vllm_engine_kwargs(cfg: RidgelineConfig) -> dict[str, Any]:
    """`vllm.LLM(**kwargs)` for this run (mapping table in the module docstring)."""
    g = cfg.generator
    mode, warning = vllm_logprobs_mode(SamplingParams.from_config(g.sampling_params))
    if warning and "logprobs_mode" not in engine_init_kwargs(cfg):
        log.warning(warning)
    parallel = EngineParallelism.from_config(g)
    kwargs: dict[str, Any] = {
        "model": policy_model_folder(cfg),
        "dtype": model_dtype_name(g.model_dtype),
        "tensor_parallel_size": parallel.tensor,
        "pipeline_parallel_size": parallel.pipeline,
        # vLLM's expert-parallel group is tensor x data ranks; data is 1 in one engine, so ep = tp
        "enable_expert_parallel": parallel.expert > 1,
        "gpu_memory_utilization": float(g.gpu_memory_utilization),
        "enable_prefix_caching": bool(g.enable_prefix_caching),
        "enable_chunked_prefill": bool(g.enable_chunked_prefill),
        "max_num_batched_tokens": int(g.max_num_batched_tokens),
        "max_num_seqs": int(g.max_num_seqs),
        "enforce_eager": bool(g.enforce_eager),
        "seed": int(cfg.trainer.seed),
        "max_model_len": max_model_len(cfg),
        "enable_sleep_mode": bool(cfg.trainer.placement.colocate_all),
        "logprobs_mode": mode,
        "skip_tokenizer_init": not uses_stop_strings(cfg),
        "worker_extension_cls": WORKER_EXTENSION,
    }
    most_logprobs = max(int(block.logprobs or 0) for block in (g.sampling_params, g.eval_sampling_params))
    if most_logprobs > VLLM_MAX_LOGPROBS:
        kwargs["max_logprobs"] = most_logprobs
    return {**with_config_overrides(kwargs, cfg, "hf_overrides"), **engine_init_kwargs(cfg)}


def vllm_engine_env(cfg: RidgelineConfig) -> dict[str, str]:
    """Environment variables the engine's process sets before vLLM starts (module docstring)."""
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if cfg.generator.vllm_v1_disable_multiproc else {}


def vllm_sampling_params(params: SamplingParams, stop_token_ids: Sequence[int],
                         seed: int | None) -> dict[str, Any]:
    """`vllm.SamplingParams(**kwargs)` for one request.

    `logprobs=N` returns the sampled token's logprob and the N most likely (0: the sampled one
    only). vLLM keeps a stop token in the output ids (only text drops it), so responses end with
    their eos / stop token like the embedded engine's. Stop strings are matched on text without
    special tokens and kept in it (`include_stop_str_in_output`, as SkyRL sets it); the ids end
    with the token that completed one. top_k -1 (Ridgeline's "off") becomes 0, vLLM 0.32's own
    "off"."""
    out: dict[str, Any] = {
        "max_tokens": int(params.max_generate_length),
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k) if params.top_k > 0 else 0,
        "min_p": float(params.min_p),
        "repetition_penalty": float(params.repetition_penalty),
        "logprobs": params.num_top_logprobs,
        "stop_token_ids": sorted(set(int(i) for i in stop_token_ids)),
        "seed": seed,
        "detokenize": bool(params.stop),  # text only where stop strings are looked for
        "skip_special_tokens": True,
    }
    if params.stop:
        out["stop"] = list(params.stop)
        out["include_stop_str_in_output"] = True
    return out


def top_logprobs(step: dict, n: int) -> TopLogprobs:
    """The `n` most likely tokens of one position from vLLM's {token id: Logprob}, which holds the
    top n (ranks 1..n) and the sampled token (at its own rank) when it is not among them."""
    ranked = sorted((lp.rank, int(tok), float(lp.logprob)) for tok, lp in step.items()
                    if lp.rank is not None and lp.rank <= n)
    return [(tok, lp) for _, tok, lp in ranked]


def matched_stop_string(stop_reason: int | str | None) -> str | None:
    """vLLM's `CompletionOutput.stop_reason`: the stop string that ended the request (a str), the
    stop token id (an int), or None (eos or the length limit)."""
    return stop_reason if isinstance(stop_reason, str) else None


def stop_reason(finish_reason: str | None) -> StopReason:
    """vLLM's finish_reason -> Ridgeline's; an aborted or failed request is an error."""
    if finish_reason in ("stop", "length"):
        return finish_reason  # type: ignore[return-value]
    raise EngineError(f"vLLM finished a request with finish_reason={finish_reason!r} (expected stop or length)")


# ---------------------------------------------------------------- the engine


class _DropChatTemplateWarmup(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Chat template warmup failed")


@contextlib.contextmanager
def _without_chat_template_warmup_warning() -> Iterator[None]:
    """vLLM 0.32's `LLM()` warms up chat templating even with skip_tokenizer_init and logs the
    failure with a full traceback; Ridgeline never sends chat messages to vLLM, so that one
    record is dropped."""
    renderer_log = logging.getLogger("vllm.renderers.base")
    drop = _DropChatTemplateWarmup()
    renderer_log.addFilter(drop)
    try:
        yield
    finally:
        renderer_log.removeFilter(drop)


class VLLMEngine(LibraryEngine):
    """`InferenceEngine` on an in-process `vllm.LLM` (its engine core runs in this process with
    `generator.vllm_v1_disable_multiproc`, the default, else in a child process).

    * generate: one `LLM.generate` over all requests (vLLM schedules and shares prefixes);
      per-request seeds from `seed`.
    * score: `prompt_logprobs=0` over prompt + response, one token generated.
    * update_weights: the tensors go to every worker through `collective_rpc` and the worker
      extension (`vllm_worker`), in batches that the worker loads as one set (vLLM's in-place
      `reload_weights`), then the prefix cache is reset.
    * sleep / wake_up(tags): `LLM.sleep(level)` / `LLM.wake_up(tags=[...])`, vLLM's tags being
      Ridgeline's ("weights", "kv_cache"; needs enable_sleep_mode, i.e.
      trainer.placement.colocate_all). Where vLLM has no sleep mode (its CPU platform) there is no
      device memory to free: both are bookkeeping only, like the embedded engine on CPU.
    """

    kwargs_from_config = staticmethod(vllm_engine_kwargs)
    model_key, length_key = "model", "max_model_len"

    @classmethod
    def from_config(cls, cfg: RidgelineConfig, tokenizer=None) -> "VLLMEngine":
        # this is the engine's process (an engine actor, or the one-process trainer): vLLM reads
        # its environment when it starts
        os.environ.update(vllm_engine_env(cfg))
        return super().from_config(cfg, tokenizer)

    def __init__(self, engine_kwargs: dict[str, Any], *, eos_token_ids: Sequence[int] = ()):
        try:
            # `from vllm import LLM` rather than `import vllm`: a folder named vllm on sys.path
            # (pytest puts tests/ there, which holds tests/vllm) imports as an empty namespace
            from vllm import LLM
            from vllm.platforms import current_platform
        except ImportError as e:  # also a broken install (CUDA-only torchvision on CPU, ...)
            raise missing_package_error("vllm", "vllm", e) from e
        kwargs = dict(engine_kwargs)
        self._can_sleep = bool(kwargs.get("enable_sleep_mode", False))
        self._device_sleeps = bool(current_platform.is_sleep_mode_available())
        if self._can_sleep and not self._device_sleeps:
            log.warning("vLLM has no sleep mode on this platform (%s): the engine is built without it and "
                        "sleep()/wake_up() free nothing (there is no device memory to hand to the trainer)",
                        current_platform.device_name)
            kwargs["enable_sleep_mode"] = self._can_sleep = False
        self.dtype: torch.dtype = engine_torch_dtype(str(kwargs.get("dtype", "bfloat16")))
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.engine_kwargs = kwargs
        self.update_batch_bytes = UPDATE_BATCH_BYTES
        with _without_chat_template_warmup_warning():
            self.llm = LLM(**kwargs)

    # -- generation ----------------------------------------------------------------------------
    def generate(self, requests: list[EngineRequest], seed: int | None = None) -> list[EngineOutput]:
        self._check_awake("generate")
        if not requests:
            return []
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)) for r in requests]
        params = [VLLMSamplingParams(**vllm_sampling_params(r.sampling_params, self._stop_ids(r), s))
                  for r, s in zip(requests, request_seeds(seed, len(requests)))]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [self._engine_output(o, r.sampling_params) for o, r in zip(outputs, requests)]

    def _stop_ids(self, request: EngineRequest) -> tuple[int, ...]:
        return self.eos_token_ids + tuple(request.stop_token_ids)

    @staticmethod
    def _engine_output(output, params: SamplingParams) -> EngineOutput:
        completion = output.outputs[0]
        ids = [int(t) for t in completion.token_ids]
        if completion.logprobs is None or len(completion.logprobs) != len(ids):
            raise EngineError("vLLM returned no logprob for some sampled tokens (logprobs was asked)")
        logprobs = [float(step[tok].logprob) for step, tok in zip(completion.logprobs, ids)]
        n = params.num_top_logprobs
        return EngineOutput(response_ids=ids, logprobs=logprobs, stop_reason=stop_reason(completion.finish_reason),
                            matched_stop=matched_stop_string(completion.stop_reason),
                            top_logprobs=[top_logprobs(step, n) for step in completion.logprobs] if n else None)

    def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """Teacher-forced logprobs of `response_ids`: vLLM's prompt logprobs of prompt + response
        (unscaled, in every logprobs_mode), generating one throwaway greedy token."""
        self._check_awake("score")
        if not prompt_ids:
            raise EngineError("score needs at least one prompt token (the first token has no logprob)")
        if not response_ids:
            return []
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        seq = [int(t) for t in list(prompt_ids) + list(response_ids)]
        params = VLLMSamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=seq)], params, use_tqdm=False)[0]
        per_position = out.prompt_logprobs
        if per_position is None or len(per_position) != len(seq):
            raise EngineError("vLLM returned no prompt logprobs for the scored sequence")
        return [float(per_position[i][seq[i]].logprob) for i in range(len(prompt_ids), len(seq))]

    # -- weights -------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named weights in every worker, then drop cached prefixes. While asleep
        the weights' memory is brought back first (the KV cache stays released until wake_up)."""
        self.wake_up(("weights",))
        from ridgeline.inference.vllm_worker import pack_tensors

        # all batches but the last are staged in the workers, the last one loads the whole set
        batches = tensor_batches(named_tensors, self.dtype, self.update_batch_bytes)
        batch = next(batches, None)
        while batch is not None:
            following = next(batches, None)
            method = "ridgeline_load_weights" if following is None else "ridgeline_stage_weights"
            self.llm.collective_rpc(method, args=(pack_tensors(batch),))
            batch = following
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        if self._device_sleeps and "kv_cache" in self._asleep_tags:
            return  # vLLM dropped every cached prefix when it went to sleep
        if self.llm.reset_prefix_cache() is False:
            raise EngineError("vLLM refused to reset its prefix cache (requests still running)")

    # -- sleep ---------------------------------------------------------------------------------
    def _release(self, level: int) -> None:
        """Level 1: weights offloaded to host memory, KV cache dropped. Level 2: both dropped."""
        self.llm.sleep(level=level)

    def _resume(self, tags: tuple[str, ...]) -> None:
        self.llm.wake_up(tags=list(tags))

    def close(self) -> None:
        llm = self.__dict__.pop("llm", None)
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
