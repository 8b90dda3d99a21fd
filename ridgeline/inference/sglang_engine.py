"""SGLang as Ridgeline's inference engine (`generator.backend=sglang`): an in-process
`sglang.Engine`, token ids in and token ids + logprobs out (`skip_tokenizer_init=True` unless stop
strings need the tokenizer).

Config -> `sglang.Engine(**sglang_engine_kwargs(cfg))` (names checked against SGLang 0.5.23's
ServerArgs):

| Ridgeline key                                          | sglang.Engine kwarg                 |
|--------------------------------------------------------|-------------------------------------|
| trainer.policy.model.path (+ gguf_file; tiny:// saved) | model_path                          |
| generator.model_dtype                                  | dtype                               |
| generator.inference_engine_tensor_parallel_size       | tp_size                             |
| generator.inference_engine_pipeline_parallel_size     | pp_size                             |
| generator.inference_engine_expert_parallel_size       | ep_size                             |
| generator.gpu_memory_utilization                       | mem_fraction_static                 |
| generator.enable_prefix_caching                        | disable_radix_cache (negated)       |
| generator.max_num_seqs                                 | max_running_requests                |
| generator.enable_chunked_prefill, max_num_batched_tokens | chunked_prefill_size (-1 = off)   |
| generator.enforce_eager                                | disable_cuda_graph                  |
| trainer.seed                                           | random_seed                         |
| prompt + generation lengths (as vLLM's max_model_len)  | context_length                      |
| trainer.placement.colocate_all                         | enable_memory_saver                 |
| no generator.*sampling_params.stop (`uses_stop_strings`) | skip_tokenizer_init               |
| trainer.policy.model_config_kwargs, generator.rope_*   | json_model_override_args (when set) |
| generator.engine_init_kwargs                           | merged last: the user wins          |

`generator.inference_engine_data_parallel_size` is no kwarg (SGLang's `dp_size` stays 1): each
data-parallel rank is an engine of its own (`ridgeline.inference.parallelism`).

`disable_cuda_graph` is SGLang's older switch: 0.5.23 prefers cuda_graph_backend_{decode,prefill}
but still honours it (turning both phases off), and older 0.5 releases know only it.

Logprobs: SGLang returns the sampled token's logprob under the temperature-scaled distribution
before top-k / top-p / min-p (its sampler renormalises a copy of the probabilities), and the
unscaled one for greedy requests: exactly Ridgeline's contract, with no setting to choose (the
environment variable SGLANG_RETURN_ORIGINAL_LOGPROB=1 would make them unscaled: leave it unset).
The one exception is the repetition penalty: SGLang applies it to the logits its logprobs come
from, and counts only response tokens (vLLM and the embedded engine count the prompt's too), so a
`repetition_penalty != 1` makes rollout logprobs differ from the trainer's (a warning says so).
`logprobs=N` asks for `top_logprobs_num=N` (`meta_info["output_top_logprobs"]`).

Stop strings: SGLang matches them on detokenized text, which `skip_tokenizer_init` turns off, so
with `generator.sampling_params.stop` or `eval_sampling_params.stop` set the engine loads the model
folder's tokenizer. The stop string is kept (`no_stop_trim`, SkyRL's setting) and reported in
`finish_reason["matched"]`.

Sleep (`enable_memory_saver`): level 1 releases the KV cache, and the weights too only when they
can come back (`+generator.engine_init_kwargs.enable_weights_cpu_backup=true` keeps a host copy);
level 2 releases everything (weights, KV cache, CUDA graphs), and the next `update_weights`
brings the weights back. `wake_up(("weights",))` resumes SGLang's "weights", `wake_up(("kv_cache",))`
its "kv_cache" and "cuda_graph" (what generation needs besides the weights), each only if released
(`resume_tags`); weights are resumed before they are loaded.
On SGLang's CPU backend there is no device memory to free: sleep is bookkeeping only.

Only the mapping functions are tested here (no SGLang in the test environments); the engine's
calls follow SGLang 0.5.23's `Engine` (entrypoints/engine.py) and `io_struct.py`.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Iterable, Sequence

import torch
from omegaconf import DictConfig

from ridgeline.inference.types import (
    EngineError,
    EngineOutput,
    EngineRequest,
    SamplingParams,
    StopReason,
    TopLogprobs,
    wake_order,
)
from ridgeline.seeding import request_seeds
from ridgeline.inference.parallelism import EngineParallelism
from ridgeline.inference.library_engine import (
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

log = logging.getLogger(__name__)

# engine_init_kwargs that name an attention kernel, checked against the GPU before building
ATTENTION_BACKEND_KEYS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")
# SGLang's memory tags (sglang.srt.constants.GPU_MEMORY_ALL_TYPES in 0.5.23)
KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"


# ---------------------------------------------------------------- mapping (pure)


def sglang_engine_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """`sglang.Engine(**kwargs)` for this run (mapping table in the module docstring)."""
    g = cfg.generator
    warning = sglang_logprobs_warning(SamplingParams.from_config(g.sampling_params))
    if warning:
        log.warning(warning)
    parallel = EngineParallelism.from_config(g)
    kwargs: dict[str, Any] = {
        "model_path": policy_model_folder(cfg),
        "dtype": model_dtype_name(g.model_dtype),
        "tp_size": parallel.tensor,
        "pp_size": parallel.pipeline,
        "ep_size": parallel.expert,
        "mem_fraction_static": float(g.gpu_memory_utilization),
        "disable_radix_cache": not bool(g.enable_prefix_caching),
        "max_running_requests": int(g.max_num_seqs),
        "chunked_prefill_size": int(g.max_num_batched_tokens) if g.enable_chunked_prefill else -1,
        "disable_cuda_graph": bool(g.enforce_eager),
        "random_seed": int(cfg.trainer.seed),
        "context_length": max_model_len(cfg),
        "enable_memory_saver": bool(cfg.trainer.placement.colocate_all),
        "skip_tokenizer_init": not uses_stop_strings(cfg),
    }
    return {**with_config_overrides(kwargs, cfg, "json_model_override_args", json.dumps), **engine_init_kwargs(cfg)}


def sglang_logprobs_warning(params: SamplingParams) -> str | None:
    """Why SGLang's rollout logprobs will differ from the trainer's for these params, if they will."""
    if params.repetition_penalty == 1.0:
        return None
    return (f"generator.sampling_params.repetition_penalty={params.repetition_penalty:g}: SGLang returns "
            "logprobs after the penalty, so rollout logprobs differ from the trainer's recomputation (use_tis, "
            "off-policy metrics), and it penalizes response tokens only (vLLM and the hf engine count the "
            "prompt's too). Fix: repetition_penalty=1.0, or generator.backend=vllm")


def sglang_sampling_params(params: SamplingParams, stop_token_ids: Sequence[int],
                           seed: int | None = None) -> dict[str, Any]:
    """One request's `sampling_params` dict for `sglang.Engine.generate`.

    top_k -1 is SGLang's own "off"; temperature 0 is its greedy. `no_stop_trim` keeps a stop
    token at the end of `output_ids` like the embedded engine (SGLang only trims it when it
    detokenizes) and a stop string in the text (SkyRL's setting); stop strings are matched on text
    without special tokens. `sampling_seed` (only with a `seed`) is read by SGLang's
    deterministic-inference mode only."""
    out: dict[str, Any] = {
        "max_new_tokens": int(params.max_generate_length),
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k) if params.top_k > 0 else -1,
        "min_p": float(params.min_p),
        "repetition_penalty": float(params.repetition_penalty),
        "stop_token_ids": sorted(set(int(i) for i in stop_token_ids)),
        "skip_special_tokens": True,
        "no_stop_trim": True,
    }
    if params.stop:
        out["stop"] = list(params.stop)
    if seed is not None:
        out["sampling_seed"] = int(seed)
    return out


def stop_reason(finish_reason: dict | None) -> StopReason:
    """SGLang's `meta_info["finish_reason"]` ({"type": "stop" | "length" | "abort", ...})."""
    kind = (finish_reason or {}).get("type")
    if kind in ("stop", "length"):
        return kind  # type: ignore[return-value]
    raise EngineError(f"SGLang finished a request with finish_reason={finish_reason!r} (expected stop or length)")


def matched_stop_string(finish_reason: dict | None) -> str | None:
    """The stop string in SGLang's `finish_reason["matched"]` (a token id there means a stop token)."""
    matched = (finish_reason or {}).get("matched")
    return matched if isinstance(matched, str) else None


def native_top_logprobs(meta: dict, n: int, length: int) -> list[TopLogprobs] | None:
    """`meta_info["output_top_logprobs"]` (per position, (logprob, token id, text) entries) as
    Ridgeline's `top_logprobs`; None when `n` is 0. Shared with the remote client."""
    if n == 0:
        return None
    positions = meta.get("output_top_logprobs")
    if positions is None or len(positions) != length:
        raise EngineError(f"SGLang returned {'no' if positions is None else len(positions)} output_top_logprobs "
                          f"for {length} tokens (top_logprobs_num={n} was asked)")
    return [[(int(e[1]), float(e[0])) for e in entries[:n]] for entries in positions]


# Ridgeline's wake-up tags -> the SGLang memory they take back
RESUMED_BY: dict[str, tuple[str, ...]] = {"weights": (WEIGHTS,), "kv_cache": (KV_CACHE, CUDA_GRAPH)}


def resume_tags(tags: Sequence[str], released: Sequence[str]) -> list[str]:
    """SGLang tags for `resume_memory_occupation` when Ridgeline wakes `tags`: those that `tags`
    map to (`RESUMED_BY`) and that are released (SGLang refuses to resume memory it holds)."""
    wanted = {s for t in wake_order(tags) for s in RESUMED_BY[t]}
    return [t for t in (WEIGHTS, KV_CACHE, CUDA_GRAPH) if t in wanted and t in released]


def release_tags(level: int, weights_cpu_backup: bool) -> list[str]:
    """The memory `sleep(level)` releases (see the module docstring)."""
    if level == 1:
        return [KV_CACHE, WEIGHTS] if weights_cpu_backup else [KV_CACHE]
    if level == 2:
        return [KV_CACHE, WEIGHTS, CUDA_GRAPH]
    raise EngineError(f"sleep level must be 1 or 2, got {level}")


def gpu0_capability() -> tuple[int, int] | None:
    """Compute capability of CUDA device 0, None without one (a function so tests can fake it)."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(0))  # type: ignore[return-value]


def check_attention_backends(kwargs: dict[str, Any]) -> None:
    """Refuse an attention backend the GPU cannot run before SGLang starts (it would fail deep
    inside a scheduler process otherwise)."""
    from ridgeline.inference.gpu_support import attention_backend_problem

    for key in ATTENTION_BACKEND_KEYS:
        backend = kwargs.get(key)
        if not backend:
            continue
        problem = attention_backend_problem(str(backend), gpu0_capability())
        if problem:
            raise EngineError(f"generator.engine_init_kwargs.{key}: {problem}")


# ---------------------------------------------------------------- the engine


class SGLangEngine(LibraryEngine):
    """`InferenceEngine` on an in-process `sglang.Engine` (its scheduler runs in child processes).

    Per-request seeds reach SGLang only in its deterministic-inference mode
    (`+generator.engine_init_kwargs.enable_deterministic_inference=true`); otherwise sampling is
    seeded once per engine (`random_seed` <- trainer.seed)."""

    engine_kwargs = staticmethod(sglang_engine_kwargs)
    model_key, length_key, sleep_kwarg = "model_path", "context_length", "enable_memory_saver"

    def __init__(self, engine_kwargs: dict[str, Any], *, eos_token_ids: Sequence[int] = ()):
        kwargs = dict(engine_kwargs)
        check_attention_backends(kwargs)  # a config problem is reported before a missing package
        try:
            from sglang import Engine
        except ImportError as e:
            raise missing_package_error("sglang", "sglang", e) from e
        self.dtype: torch.dtype = engine_torch_dtype(str(kwargs.get("dtype", "bfloat16")))
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.engine_kwargs = kwargs
        self._can_sleep = bool(kwargs.get("enable_memory_saver", False))
        # SGLang's memory saver pauses CUDA allocations; on its CPU backend there is no device
        # memory to hand to the trainer, so sleep is bookkeeping there (like the embedded engine)
        self._device_sleeps = str(kwargs.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")) != "cpu"
        if self._can_sleep and not self._device_sleeps:
            log.warning("SGLang runs on the CPU here: built without its memory saver; sleep()/wake_up() free nothing")
            kwargs["enable_memory_saver"] = self._can_sleep = False
        self._weights_cpu_backup = bool(kwargs.get("enable_weights_cpu_backup", False))
        self._seeded = bool(kwargs.get("enable_deterministic_inference", False))
        self.update_batch_bytes = 512 * 1024 * 1024
        self.engine = Engine(**kwargs)
        self._released: list[str] = []  # SGLang's memory tags released right now

    # -- generation ----------------------------------------------------------------------------
    def generate(self, requests: list[EngineRequest], seed: int | None = None) -> list[EngineOutput]:
        self._check_awake("generate")
        if not requests:
            return []
        seeds = request_seeds(seed if self._seeded else None, len(requests))
        params = [sglang_sampling_params(r.sampling_params, self.eos_token_ids + tuple(r.stop_token_ids), s)
                  for r, s in zip(requests, seeds)]
        outputs = self.engine.generate(input_ids=[list(r.prompt_token_ids) for r in requests],
                                       sampling_params=params, return_logprob=True,
                                       top_logprobs_num=[r.sampling_params.num_top_logprobs for r in requests])
        return [self._engine_output(o, r.sampling_params) for o, r in zip(outputs, requests)]

    @staticmethod
    def _engine_output(output: dict, params: SamplingParams) -> EngineOutput:
        ids = [int(t) for t in output["output_ids"]]
        meta = output["meta_info"]
        # entries are (logprob, token_id, text-or-None)
        logprobs = [float(entry[0]) for entry in meta["output_token_logprobs"]]
        if len(logprobs) != len(ids):
            raise EngineError(f"SGLang returned {len(logprobs)} logprobs for {len(ids)} sampled tokens")
        finish = meta.get("finish_reason")
        return EngineOutput(response_ids=ids, logprobs=logprobs, stop_reason=stop_reason(finish),
                            matched_stop=matched_stop_string(finish),
                            top_logprobs=native_top_logprobs(meta, params.num_top_logprobs, len(ids)))

    def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """Teacher-forced logprobs of `response_ids` from SGLang's input logprobs, generating
        nothing. With `logprob_start_len = len(prompt) - 1`, `input_token_logprobs` covers the
        tokens from the last prompt token on: that one has no logprob (None, its logits are not
        computed) and the rest are the response tokens'."""
        self._check_awake("score")
        if not prompt_ids:
            raise EngineError("score needs at least one prompt token (the first token has no logprob)")
        if not response_ids:
            return []
        seq = [int(t) for t in list(prompt_ids) + list(response_ids)]
        out = self.engine.generate(input_ids=[seq], sampling_params=[{"max_new_tokens": 0, "temperature": 0.0}],
                                   return_logprob=True, logprob_start_len=len(prompt_ids) - 1)[0]
        entries = out["meta_info"]["input_token_logprobs"][1:]
        if len(entries) != len(response_ids):
            raise EngineError(f"SGLang returned {len(entries)} input logprobs for {len(response_ids)} response tokens")
        return [float(entry[0]) for entry in entries]

    # -- weights -------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """`update_weights_from_tensor` in batches (engine dtype), flushing the cache after the last.
        Tensors stay on their device: SGLang hands CUDA tensors to its workers by IPC handle."""
        self.wake_up((WEIGHTS,))
        batches = tensor_batches(named_tensors, self.dtype, self.update_batch_bytes, device=None)
        batch = next(batches, None)
        while batch is not None:
            following = next(batches, None)
            self._checked("update_weights_from_tensor",
                          self.engine.update_weights_from_tensor(batch, flush_cache=following is None))
            batch = following

    def reset_prefix_cache(self) -> None:
        result = self.engine.flush_cache()
        if getattr(result, "success", True) is False:
            raise EngineError(f"SGLang refused to flush its cache: {getattr(result, 'message', '')}")

    # NCCL weight updates straight from the trainer's ranks (SGLang's distributed update API)
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str = "nccl") -> None:
        self._checked("init_weights_update_group", self.engine.init_weights_update_group(
            master_address=master_address, master_port=int(master_port), rank_offset=int(rank_offset),
            world_size=int(world_size), group_name=group_name, backend=backend))

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str | torch.dtype],
                                        shapes: list[list[int]], group_name: str, flush_cache: bool = True) -> None:
        self.wake_up((WEIGHTS,))
        dtype_names = [str(d).removeprefix("torch.") for d in dtypes]
        self._checked("update_weights_from_distributed", self.engine.update_weights_from_distributed(
            names=list(names), dtypes=dtype_names, shapes=[list(s) for s in shapes],
            group_name=group_name, flush_cache=flush_cache))

    @staticmethod
    def _checked(what: str, result: Any) -> None:
        """SGLang's weight calls answer (success, message)."""
        if isinstance(result, tuple) and len(result) >= 2 and not result[0]:
            raise EngineError(f"SGLang {what} failed: {result[1]}")

    # -- sleep ---------------------------------------------------------------------------------
    def _release(self, level: int) -> None:
        self._released = release_tags(level, self._weights_cpu_backup)
        self.engine.release_memory_occupation(tags=self._released)

    def _resume(self, tags: tuple[str, ...]) -> None:
        todo = resume_tags(tags, self._released)
        if todo:
            self.engine.resume_memory_occupation(tags=todo)
            self._released = [t for t in self._released if t not in todo]

    def close(self) -> None:
        engine = self.__dict__.pop("engine", None)
        if engine is not None:
            engine.shutdown()
