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

Without CUDA (`cuda=False`, the default on a machine without a GPU) the mapping adds what SGLang's
CPU backend needs (`SGLANG_CPU_KWARGS`): `device="cpu"`, `attention_backend="torch_native"`,
`disable_overlap_schedule=True` and a KV cache of `CPU_KV_CACHE_TOKENS` tokens (uncapped, SGLang
sizes it from host RAM: 15 GB on a 24 GB machine), with `enable_memory_saver` off (its
`torch_memory_saver` is CUDA-only and fails at start). The engine sets `SGLANG_USE_CPU_ENGINE=1`
before SGLang is imported (read once, at import). On a CPU without AMX SGLang needs no
`sgl_kernel` call in plain decoding (`make setup-sglang` installs a stand-in module; docs/engines.md).

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

Weight updates (`update_weights_from_tensor` in batches, `update_weights_from_distributed` from an
update group) sit between `begin_weight_update()` and `end_weight_update()`: SGLang 0.5.23 refuses
them outside such a session; releases before it have neither call, and get none
(`_weight_update_session`).

Sleep (`enable_memory_saver`): level 1 releases the KV cache, and the weights too only when they
can come back (`+generator.engine_init_kwargs.enable_weights_cpu_backup=true` keeps a host copy);
level 2 releases everything (weights, KV cache, CUDA graphs), and the next `update_weights`
brings the weights back. `wake_up(("weights",))` resumes SGLang's "weights", `wake_up(("kv_cache",))`
its "kv_cache" and "cuda_graph" (what generation needs besides the weights), each only if released
(`resume_tags`); weights are resumed before they are loaded.
On SGLang's CPU backend the same calls run, with the same tags, and free nothing (there is no
device memory; the engine logs so once). A release first waits until SGLang's scheduler is idle
(`_wait_until_idle`): SGLang asserts it, and the failed assertion takes the scheduler down.

The mapping functions are tested in the default suite; the engine itself, on SGLang 0.5.23's CPU
backend, by `make test-sglang` (tests/sglang).
"""

from __future__ import annotations

import json
import logging
import os
import time
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Sequence, TYPE_CHECKING

import torch

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

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema import RidgelineConfig

log = logging.getLogger(__name__)

# engine_init_kwargs that name an attention kernel, checked against the GPU before building
ATTENTION_BACKEND_KEYS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")
# SGLang's memory tags (sglang.srt.constants.GPU_MEMORY_ALL_TYPES in 0.5.23)
KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
# KV cache size on a CPU, in tokens, each 2 x layers x kv heads x head_dim values: 0.75 GB for
# SmolLM2-135M in bf16 (1.5 GB in fp32); a 64-row CPU batch of 512-token sequences fits
CPU_KV_CACHE_TOKENS = 32768
# What SGLang's CPU backend needs (module docstring); generator.engine_init_kwargs overrides each
SGLANG_CPU_KWARGS: dict[str, Any] = {"device": "cpu", "attention_backend": "torch_native",
                                     "disable_overlap_schedule": True, "max_total_tokens": CPU_KV_CACHE_TOKENS}
# SGLang picks its CPU platform from this variable, read once when it is imported
SGLANG_CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
# How long a release waits for SGLang's scheduler to finish its last batch (`_wait_until_idle`)
IDLE_TIMEOUT_S = 60.0


# ---------------------------------------------------------------- mapping (pure)


def sglang_engine_kwargs(cfg: RidgelineConfig, cuda: bool | None = None) -> dict[str, Any]:
    """`sglang.Engine(**kwargs)` for this run (mapping table in the module docstring); `cuda`:
    whether the engine runs on a GPU (default: whether this process sees one)."""
    g = cfg.generator
    if cuda is None:
        cuda = torch.cuda.is_available()
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
        # torch_memory_saver is CUDA-only: SGLang fails at start with it on a CPU
        "enable_memory_saver": bool(cfg.trainer.placement.colocate_all) and cuda,
        "skip_tokenizer_init": not uses_stop_strings(cfg),
        **({} if cuda else SGLANG_CPU_KWARGS),
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


def native_output(answer: dict, top_n: int = 0) -> EngineOutput:
    """One item of SGLang's generate answer (`Engine.generate` or `POST /generate`, asked with
    `return_logprob`) -> EngineOutput; `top_n`: the request's `top_logprobs_num`. `output_ids` is in
    every answer of 0.5.x; older servers that loaded their tokenizer answer text without it, and the
    ids come from the logprob entries, (logprob, token id, text) per token."""
    try:
        meta = answer["meta_info"]
        entries = meta["output_token_logprobs"]
        logprobs = [float(e[0]) for e in entries]
        ids = [int(t) for t in answer["output_ids"]] if "output_ids" in answer else [int(e[1]) for e in entries]
        finish = meta.get("finish_reason")
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise EngineError(f"SGLang's generate answer lacks output_ids / meta_info.output_token_logprobs "
                          f"(was return_logprob honoured?): {e!r}") from e
    if len(logprobs) != len(ids):
        raise EngineError(f"SGLang returned {len(logprobs)} logprobs for {len(ids)} sampled tokens")
    return EngineOutput(response_ids=ids, logprobs=logprobs, stop_reason=stop_reason(finish),
                        matched_stop=matched_stop_string(finish), top_logprobs=native_top_logprobs(meta, top_n, len(ids)))


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

    kwargs_from_config = staticmethod(sglang_engine_kwargs)
    model_key, length_key, sleep_kwarg = "model_path", "context_length", "enable_memory_saver"

    def __init__(self, engine_kwargs: dict[str, Any], *, eos_token_ids: Sequence[int] = ()):
        kwargs = dict(engine_kwargs)
        check_attention_backends(kwargs)  # a config problem is reported before a missing package
        on_cpu = str(kwargs.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu"
        if on_cpu:
            os.environ.update(SGLANG_CPU_ENV)  # before the import below: SGLang reads it once
        try:
            from sglang import Engine
        except ImportError as e:
            raise missing_package_error("sglang", "sglang", e) from e
        self.dtype: torch.dtype = engine_torch_dtype(str(kwargs.get("dtype", "bfloat16")))
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        if on_cpu and kwargs.get("enable_memory_saver"):
            log.warning("SGLang runs on the CPU here: built without its memory saver (CUDA-only)")
            kwargs["enable_memory_saver"] = False
        self.engine_kwargs = kwargs
        # On a GPU, release / resume free memory only with the memory saver; on SGLang's CPU backend
        # they run as well (same calls, same tags) and free nothing: there is no device memory
        self._device_sleeps = not on_cpu
        self._can_sleep = on_cpu or bool(kwargs.get("enable_memory_saver", False))
        self._said_cpu_sleep = False
        self._weights_cpu_backup = bool(kwargs.get("enable_weights_cpu_backup", False))
        self._seeded = bool(kwargs.get("enable_deterministic_inference", False))
        self._detokenizes = not kwargs.get("skip_tokenizer_init", False)
        # SGLang >= 0.5.2x loads weights only inside begin/end_weight_update (a release feature,
        # not a Ridgeline implementation, hence looked up on the class)
        self._weight_sessions = callable(getattr(Engine, "begin_weight_update", None))
        self.update_batch_bytes = 512 * 1024 * 1024
        self.engine = Engine(**kwargs)
        self._released: list[str] = []  # SGLang's memory tags released right now

    # -- generation ----------------------------------------------------------------------------
    def generate(self, requests: list[EngineRequest], seed: int | None = None) -> list[EngineOutput]:
        self._check_awake("generate")
        if not requests:
            return []
        if not self._detokenizes and any(r.sampling_params.stop for r in requests):
            # SGLang matches stop strings on text, which skip_tokenizer_init turns off: it would ignore them
            raise EngineError("a request has stop strings, but this SGLang engine was built without its tokenizer "
                              "(skip_tokenizer_init, as no generator.sampling_params.stop / eval_sampling_params.stop "
                              "is set). Fix: set generator.sampling_params.stop in the config, so the engine loads it")
        seeds = request_seeds(seed if self._seeded else None, len(requests))
        params = [sglang_sampling_params(r.sampling_params, self.eos_token_ids + tuple(r.stop_token_ids), s)
                  for r, s in zip(requests, seeds)]
        outputs = self.engine.generate(input_ids=[list(r.prompt_token_ids) for r in requests],
                                       sampling_params=params, return_logprob=True,
                                       top_logprobs_num=[r.sampling_params.num_top_logprobs for r in requests])
        return [native_output(o, r.sampling_params.num_top_logprobs) for o, r in zip(outputs, requests)]

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
        Tensors stay on their device: SGLang hands CUDA tensors to its scheduler by IPC handle, so
        each batch is a copy this process owns (the colocated handoff gives views of another
        process's buffer, which torch refuses to share on); the copy lives until SGLang loaded it."""
        self.wake_up(("weights",))   # Ridgeline's tag (MemoryTag), not SGLang's WEIGHTS
        batches = tensor_batches(named_tensors, self.dtype, self.update_batch_bytes, device=None, copy=True)
        with self._weight_update_session():
            batch = next(batches, None)
            while batch is not None:
                following = next(batches, None)
                self._checked("update_weights_from_tensor",
                              self.engine.update_weights_from_tensor(batch, flush_cache=following is None))
                batch = following

    @contextmanager
    def _weight_update_session(self) -> Iterator[None]:
        """`begin_weight_update()` ... `end_weight_update()` around weight loads, where SGLang has them
        (module docstring). The session is closed on a failed load too, so the next sync can open one."""
        if not self._weight_sessions:
            yield
            return
        self._checked("begin_weight_update", self.engine.begin_weight_update())
        try:
            yield
        except BaseException:
            self.engine.end_weight_update()  # the load's own error is the one to report
            raise
        self._checked("end_weight_update", self.engine.end_weight_update())

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
        self.wake_up(("weights",))   # Ridgeline's tag (MemoryTag), not SGLang's WEIGHTS
        dtype_names = [str(d).removeprefix("torch.") for d in dtypes]
        with self._weight_update_session():
            self._checked("update_weights_from_distributed", self.engine.update_weights_from_distributed(
                names=list(names), dtypes=dtype_names, shapes=[list(s) for s in shapes],
                group_name=group_name, flush_cache=flush_cache))

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._checked("destroy_weights_update_group", self.engine.destroy_weights_update_group(group_name=group_name))

    @staticmethod
    def _checked(what: str, result: Any) -> None:
        """SGLang's weight calls answer (success, message)."""
        if isinstance(result, tuple) and len(result) >= 2 and not result[0]:
            raise EngineError(f"SGLang {what} failed: {result[1]}")

    # -- sleep ---------------------------------------------------------------------------------
    def _release(self, level: int) -> None:
        if not self._device_sleeps and not self._said_cpu_sleep:
            log.info("SGLang runs on the CPU: sleep()/wake_up() call release/resume_memory_occupation, which "
                     "free nothing there (no device memory); generation waits for wake_up() all the same")
            self._said_cpu_sleep = True
        self._wait_until_idle()
        self._released = release_tags(level, self._weights_cpu_backup)
        self.engine.release_memory_occupation(tags=self._released)

    def _wait_until_idle(self) -> None:
        """SGLang asserts that its scheduler is idle when memory is released, and a scheduler still
        closing the batch a `generate` just returned from is not: the assertion kills it, and the
        process with it. A cache flush asserts nothing and answers whether it found the scheduler
        idle (then flushes, as releasing the KV cache does anyway): flush until it does."""
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while getattr(self.engine.flush_cache(), "success", True) is False:
            if time.monotonic() > deadline:
                raise EngineError(f"SGLang's scheduler was still busy {IDLE_TIMEOUT_S:g} s after the last request: "
                                  "its memory cannot be released")
            time.sleep(0.01)

    def _resume(self, tags: tuple[str, ...]) -> None:
        todo = resume_tags(tags, self._released)
        if todo:
            self.engine.resume_memory_occupation(tags=todo)
            self._released = [t for t in self._released if t not in todo]

    def close(self) -> None:
        engine = self.__dict__.pop("engine", None)
        if engine is not None:
            engine.shutdown()
