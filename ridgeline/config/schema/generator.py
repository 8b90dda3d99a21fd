"""``generator.*``: the inference engines, sampling, chat template, multi-turn rollouts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Optional
from urllib.parse import urlsplit

from ridgeline.config.fields import Report, Section, one_of, setting, show


@dataclass
class SamplingConfig(Section):
    # the most tokens a response (one turn) may have; a longer one ends with stop reason "length"
    max_generate_length: int = setting(1024)
    # SkyRL keys. repetition_penalty: > 0, 1.0 = off; tokens of the prompt and of the response so
    # far get their logit divided by it when positive, multiplied otherwise (vLLM's rule). Rollout
    # logprobs stay those of the unpenalized distribution (docs/engines.md).
    repetition_penalty: float = setting(1.0)
    # sampling temperature; 0 = greedy
    temperature: float = setting(1.0)
    # nucleus sampling: sample from the smallest set of tokens holding this much probability; 1.0 = off
    top_p: float = setting(1.0)
    # drop tokens whose probability is below min_p x the most likely token's; 0 = off
    min_p: float = setting(0.0)
    # sample from the k most likely tokens; -1 = off
    top_k: int = setting(-1)
    # null, or N >= 0: the engine also returns the N most likely tokens of each position with their
    # logprobs (the sampled token's logprob is returned in every case).
    logprobs: Optional[int] = setting(None, example="5")
    # null, or a list of stop strings: a response ends with the token that completes one, the
    # string kept in it, stop reason "stop", e.g. stop=['</sql>','</solution>'].
    stop: Optional[List[str]] = setting(None, example="['</answer>']")

    def check(self, at: str, report: Report) -> None:
        if self.max_generate_length < 1:
            report.add(f"{at}.max_generate_length={show(self.max_generate_length)} must be a positive whole number "
                       f"(at least 1). Fix: e.g. {at}.max_generate_length=1024.")
        if self.temperature < 0:
            report.add(f"{at}.temperature={show(self.temperature)} must be 0 or more (0 means greedy decoding). "
                       f"Fix: e.g. {at}.temperature=1.0.")
        if not 0 < self.top_p <= 1:
            report.add(f"{at}.top_p={show(self.top_p)} must be in (0, 1]: it is the probability mass kept when "
                       f"sampling. Fix: e.g. {at}.top_p=1.0 (no nucleus cut).")
        if not 0 <= self.min_p < 1:
            report.add(f"{at}.min_p={show(self.min_p)} must be in [0, 1). Fix: e.g. {at}.min_p=0.0 (off).")
        if self.top_k != -1 and self.top_k < 1:
            report.add(f"{at}.top_k={show(self.top_k)} must be -1 (off) or at least 1. Fix: e.g. {at}.top_k=-1.")
        if self.repetition_penalty <= 0:
            report.add(f"{at}.repetition_penalty={show(self.repetition_penalty)} must be greater than 0 (1.0 is off; "
                       f"above 1 discourages repeating tokens). Fix: e.g. {at}.repetition_penalty=1.0.")
        if self.logprobs is not None and self.logprobs < 0:
            report.add(f"{at}.logprobs={show(self.logprobs)} must be null or a whole number N >= 0: the engine then "
                       f"also returns the N most likely tokens of each position. Fix: {at}.logprobs=null or e.g. "
                       f"{at}.logprobs=5.")
        if self.stop is not None and not all(self.stop):
            report.add(f"{at}.stop={show(self.stop)} must be null or a list of non-empty stop strings. Fix: e.g. "
                       f"\"{at}.stop=['</answer>']\" (quoted for the shell).")


@dataclass
class EvalSamplingConfig(SamplingConfig):
    # as generator.sampling_params.max_generate_length, for evaluation
    max_generate_length: int = setting("${generator.sampling_params.max_generate_length}")


@dataclass
class ChatTemplateConfig(Section):
    """SkyRL keys: the chat template every prompt (and multi-turn observation) is rendered with. source
    "file" + name_or_path: a Jinja file replacing the model's template; source "name" + a name of
    SkyRL's (qwen3_with_thinking, qwen3_without_thinking: ridgeline/models/chat_templates/); a null
    name_or_path keeps the model's own."""
    # name: name_or_path is a template name of SkyRL's; file: name_or_path is a Jinja file
    source: str = setting("name", choices=("name", "file"))
    # the template (see source); null keeps the model's own
    name_or_path: Optional[str] = setting(None)

    def check(self, at: str, report: Report) -> None:
        key, path = f"{at}.name_or_path", self.name_or_path
        if self.source == "file" and not (path is not None and Path(path).is_file()):
            report.add(f"{key}={show(path)}: {at}.source=file needs the path of a Jinja template file that exists. "
                       f"Fix: {key}=/path/to/template.jinja")
        elif self.source == "name" and path is not None:
            from ridgeline.models.chat_templates import chat_template_names
            if path not in chat_template_names():
                report.add(f"{key}={show(path)} is not a named chat template: the names are "
                           f"{one_of(chat_template_names())}. Fix: one of those, {at}.source=file with a template "
                           "file, or name_or_path=null for the model's own.")


@dataclass
class GeneratorConfig(Section):
    # generator.engine_init_kwargs the embedded engine takes (vllm/sglang take any of theirs)
    HF_ENGINE_KWARGS: ClassVar[tuple[str, ...]] = ("attn_implementation",)

    # SkyRL key: the model name the HTTP endpoint (enable_http_endpoint) and `ridgeline serve` serve;
    # OpenAI requests must name it as `model` (another name is refused).
    model_name: str = setting("${trainer.policy.model.path}")
    # the dtype the inference engines run the model in
    model_dtype: str = setting("bfloat16", choices=("bfloat16", "float16", "float32"))
    # the run starts its own engines; false: it uses the servers of remote_inference_engine_urls
    run_engines_locally: bool = setting(True)
    # inference engines the run starts (each one tensor x pipeline x data parallel devices)
    num_inference_engines: int = setting(1)
    # Ridgeline: the default is "vllm" on a machine with a CUDA GPU and "hf" otherwise
    # (resolver registered by ridgeline.config).
    backend: str = setting("${ridgeline.default_backend:}", choices=("hf", "vllm", "sglang"))
    # delta: SkyRL 0.4's checkpoint-delta sync (generator.inference_engine.delta_weight_sync.*)
    weight_sync_backend: str = setting("nccl", choices=("nccl", "gloo", "delta"), built=("nccl", "gloo"),
                                       not_built="SkyRL 0.4's delta weight sync (checkpoint deltas through a shared "
                                       "folder or an object store) is not built: weights go to the engines over "
                                       "nccl or gloo")
    # seconds a weight sync to the engines may take before the run stops with an error
    weight_sync_timeout: int = setting(60)
    # Engines colocated with the policy on GPUs (trainer.strategy=fsdp2 with
    # trainer.placement.colocate_all=true) take the weights as CUDA IPC handles of flat buffers of at
    # most this many GiB (a tensor larger than that gets a buffer of its own); each policy rank holds
    # one such buffer on its GPU at a time. > 0.
    weight_transfer_threshold_cuda_ipc_GB: float = setting(1.0)
    # devices an engine shards its model over (tensor parallelism; the note below)
    inference_engine_tensor_parallel_size: int = setting(4)
    # SkyRL 0.3.1: an engine takes tensor x pipeline x data parallel devices; each data-parallel rank
    # is an engine process of its own (requests are split over all of them). Expert parallelism
    # (MoE) needs data 1 and expert = tensor: the experts are sharded over the tensor-parallel ranks.
    # vllm and sglang engines only (the hf engine refuses other values than 1). docs/engines.md
    inference_engine_pipeline_parallel_size: int = setting(1)
    # ranks an engine shards a MoE model's experts over (the note above)
    inference_engine_expert_parallel_size: int = setting(1)
    # data-parallel engine processes per engine (the note above)
    inference_engine_data_parallel_size: int = setting(1)
    # responses sampled per training prompt (a GRPO group)
    n_samples_per_prompt: int = setting(5)
    async_engine: bool = setting(True)            # vllm engine mode; the hf engine is always synchronous
    batched: bool = setting(True)                 # vllm/sglang request batching; the hf engine batches on its own
    # the most tokens a trajectory's context may reach (prompt plus turns); a multi-turn episode ends when the
    # next turn would not fit
    max_input_length: int = setting("${trainer.max_prompt_length}")
    enable_prefix_caching: bool = setting(True)   # vllm/sglang KV-cache option
    enable_chunked_prefill: bool = setting(True)  # vllm option
    max_num_batched_tokens: int = setting(8192)   # vllm scheduler option
    enforce_eager: bool = setting(False)          # vllm option (CUDA graphs off)
    # SkyRL 0.3.1: vLLM's engine core runs in the engine's own process
    # (VLLM_ENABLE_V1_MULTIPROCESSING=0, set there), not in a child process; vllm engines only
    vllm_v1_disable_multiproc: bool = setting(True)
    # SkyRL 0.3.1: vLLM LoRA layers sharded over tensor-parallel ranks
    fully_sharded_loras: bool = setting(False, not_built="adapter-only weight sync is not built: engines get the "
                                        "policy's merged weights, never LoRA adapters (docs/lora.md), so there are no "
                                        "LoRA layers for vLLM to shard")
    gpu_memory_utilization: float = setting(0.8)  # vllm/sglang KV-cache budget
    max_num_seqs: int = setting(1024)             # vllm/sglang scheduler option
    # host:port of each server when run_engines_locally=false
    remote_inference_engine_urls: List[str] = setting(["127.0.0.1:8001"])
    # Ridgeline extensions for remote engines (run_engines_locally=false): seconds one HTTP request
    # may take, and retries (with doubling backoff from 0.5 s) after a connection error. A bearer
    # token, if the servers want one, comes from the RIDGELINE_ENGINE_API_KEY environment variable.
    remote_request_timeout_s: float = setting(600.0)
    # retries of a remote request after a connection error (see remote_request_timeout_s)
    remote_max_retries: int = setting(3)
    # SkyRL keys: with enable_http_endpoint the run's engine also answers OpenAI-compatible requests
    # (/v1/chat/completions, /v1/completions, /v1/models, /health) on http://host:port while it trains
    # (and while `ridgeline eval` runs), for agent code to sample from the policy being trained.
    enable_http_endpoint: bool = setting(False)
    # the address the HTTP endpoint listens on
    http_endpoint_host: str = setting("127.0.0.1")
    # the port the HTTP endpoint listens on
    http_endpoint_port: int = setting(8000)
    # the most model turns of one episode (1: single turn)
    max_turns: int = setting(1)
    # Ridgeline extension: the characters one environment step's observation messages may hold
    # (content, role and other fields, plus 32 a message for the template's markup); longer ones
    # are cut before they are tokenized and counted in generate/observations_truncated. init may
    # lengthen a prompt by as much. null: no cap (SkyRL has none).
    max_observation_chars: Optional[int] = setting(100_000)
    # remote servers: replace a weight-update group an earlier trainer left on them (auto: when the server
    # reports one), or refuse (disable)
    override_existing_update_group: str = setting("auto", choices=("auto", "enable", "disable"))
    # extra keyword arguments for the engine's constructor (vLLM's LLM, SGLang's Engine; the hf engine takes
    # attn_implementation)
    engine_init_kwargs: Dict[str, Any] = setting({})
    sampling_params: SamplingConfig = field(default_factory=SamplingConfig)
    # multi-turn: observations are appended as chat messages rendered by the template (false: as plain text
    # after the response)
    use_conversation_multi_turn: bool = setting(False)
    chat_template: ChatTemplateConfig = field(default_factory=ChatTemplateConfig)
    # template variables (e.g. enable_thinking: false), fixed for every rendering of the run
    chat_template_kwargs: Dict[str, Any] = setting({})
    # SkyRL key: with use_conversation_multi_turn and a response that ended on a stop string, append
    # the eos token after it (loss mask 0, logprob 0.0) so the assistant message is closed.
    append_eos_token_after_stop_str_in_multi_turn: bool = setting(True)
    eval_sampling_params: EvalSamplingConfig = field(default_factory=EvalSamplingConfig)
    # responses sampled per evaluation prompt
    eval_n_samples_per_prompt: int = setting(1)
    # a response that did not end on a stop (stop reason "length") gets reward 0
    zero_reward_on_non_stop: bool = setting(False)
    # DAPO's overlong filtering: a truncated response's tokens are masked out of the loss
    apply_overlong_filtering: bool = setting(False)
    # SkyRL key: every turn of a multi-turn trajectory trains as a sample of its own (the ids the
    # engine was given for it as prompt, its sampled ids as response); advantages, rewards and
    # metrics stay the trajectory's (ridgeline.generation.step_wise, docs/multi_turn.md).
    step_wise_trajectories: bool = setting(False)
    # SkyRL keys: RoPE overrides of the engines' model config (vLLM hf_overrides, SGLang
    # json_model_override_args, the embedded engine's model); the trainer's by default.
    rope_scaling: Optional[Dict[str, Any]] = setting("${trainer.rope_scaling}")
    # the engines' RoPE base; by default trainer.rope_theta
    rope_theta: Optional[float] = setting("${trainer.rope_theta}")

    def check(self, at: str, report: Report) -> None:
        for name in ("n_samples_per_prompt", "eval_n_samples_per_prompt", "max_input_length", "max_turns",
                     "num_inference_engines", "inference_engine_tensor_parallel_size",
                     "inference_engine_pipeline_parallel_size", "inference_engine_data_parallel_size",
                     "inference_engine_expert_parallel_size"):
            value = getattr(self, name)
            if value < 1:
                report.add(f"{at}.{name}={show(value)} must be a positive whole number (at least 1). "
                           f"Fix: e.g. {at}.{name}={show(getattr(GeneratorConfig(), name))}.")
        if self.max_observation_chars is not None and self.max_observation_chars < 1:
            report.add(f"{at}.max_observation_chars={show(self.max_observation_chars)} must be a positive number of "
                       f"characters, or null for no cap. Fix: e.g. {at}.max_observation_chars=100000.")
        for name, example in (("weight_sync_timeout", 60), ("remote_request_timeout_s", 600)):
            value = getattr(self, name)
            if value <= 0:
                report.add(f"{at}.{name}={show(value)} must be a positive number of seconds. "
                           f"Fix: e.g. {at}.{name}={example}.")
        key = f"{at}.weight_transfer_threshold_cuda_ipc_GB"
        if self.weight_transfer_threshold_cuda_ipc_GB <= 0:
            report.add(f"{key}={show(self.weight_transfer_threshold_cuda_ipc_GB)} must be a positive number of GiB "
                       f"(the largest CUDA IPC bucket of a colocated weight sync). Fix: e.g. {key}=1.0.")
        if self.remote_max_retries < 0:
            report.add(f"{at}.remote_max_retries={show(self.remote_max_retries)} must be 0 or more. "
                       f"Fix: e.g. {at}.remote_max_retries=3.")
        self.sampling_params.check(f"{at}.sampling_params", report)
        self.eval_sampling_params.check(f"{at}.eval_sampling_params", report)
        self.chat_template.check(f"{at}.chat_template", report)
        if self.step_wise_trajectories and not self.use_conversation_multi_turn:
            report.add(f"{at}.step_wise_trajectories=true needs {at}.use_conversation_multi_turn=true (SkyRL refuses "
                       "it too): with observations appended as raw text to the same assistant message, each turn's "
                       "stop token is taken out of the context before the next turn, so a turn's sample would not "
                       f"end with what the model sampled. Fix: {at}.use_conversation_multi_turn=true (observations "
                       f"as chat turns), or {at}.step_wise_trajectories=false.")
        self._engines(at, report)
        if self.enable_http_endpoint:
            self._http_endpoint(at, report)

    def _library_engine_parallelism(self, at: str, report: Report) -> None:
        """vllm / sglang engines: expert parallelism is over the tensor-parallel ranks (each
        data-parallel rank is an engine of its own, ridgeline.inference.parallelism)."""
        g = f"{at}.inference_engine"
        tp, dp = self.inference_engine_tensor_parallel_size, self.inference_engine_data_parallel_size
        ep = self.inference_engine_expert_parallel_size
        if ep > 1 and dp > 1:
            report.add(f"{g}_expert_parallel_size={ep} with {g}_data_parallel_size={dp}: expert parallelism over "
                       "data-parallel ranks needs vLLM's data-parallel group, which Ridgeline's engines (one engine "
                       f"process per data-parallel rank) do not form. Fix: {g}_data_parallel_size=1 and "
                       f"{g}_expert_parallel_size={g}_tensor_parallel_size.")
        elif ep > 1 and ep != tp:
            report.add(f"{g}_expert_parallel_size={ep} must equal {g}_tensor_parallel_size={tp} (SkyRL's rule: expert = "
                       "data x tensor, and data is 1): the experts are sharded over the tensor-parallel ranks. Fix: "
                       f"{g}_expert_parallel_size={tp}, or 1 to turn expert parallelism off.")

    def _http_endpoint(self, at: str, report: Report) -> None:
        """Where the endpoint listens and the name it serves (a port taken by another process is
        refused when the run starts, before any model loads)."""
        key, port, host = f"{at}.http_endpoint_port", self.http_endpoint_port, self.http_endpoint_host
        if not 1 <= port <= 65535:
            report.add(f"{key}={show(port)} is not a TCP port the endpoint can listen on (1-65535; 0 would pick a "
                       f"random one that agents cannot know). Fix: e.g. {key}=8000.")
        if not host.strip():
            report.add(f"{at}.http_endpoint_host is empty: the endpoint needs an address to listen on. Fix: "
                       f"{at}.http_endpoint_host=127.0.0.1 (this machine only) or 0.0.0.0 (every interface).")
        if not self.model_name.strip():
            report.add(f"{at}.model_name is empty: requests to the endpoint name the model they ask for. Fix: leave "
                       f"it at its default (trainer.policy.model.path) or give a name, e.g. {at}.model_name=policy.")
        if not self.run_engines_locally:
            local = {"127.0.0.1", "localhost", "0.0.0.0", host}
            for url in self.remote_inference_engine_urls:
                parsed = urlsplit(url if "://" in url else f"http://{url}")
                if parsed.hostname in local and parsed.port == port:
                    report.add(f"{key}={port} is the port of the remote engine {url} ({at}.remote_inference_engine_urls"
                               f"): the endpoint cannot listen where that server does. Fix: another port, e.g. "
                               f"{key}={port + 10}.")

    def _engines(self, at: str, report: Report) -> None:
        # pipeline / data / expert parallel sizes other than 1
        changed = {f"{at}.inference_engine_{kind}_parallel_size": size for kind in ("pipeline", "data", "expert")
                   if (size := getattr(self, f"inference_engine_{kind}_parallel_size")) > 1}
        key = f"{at}.vllm_v1_disable_multiproc"
        if not self.vllm_v1_disable_multiproc and not (self.backend == "vllm" and self.run_engines_locally):
            where = "on remote servers" if not self.run_engines_locally else f"{at}.backend={show(self.backend)}"
            report.add(f"{key}=false runs a vLLM engine core in a child process, but the engines here are {where}, "
                       f"which have no vLLM engine core. Fix: {key}=true (the default).")
        if not self.run_engines_locally:
            urls = self.remote_inference_engine_urls
            if not urls or not all(u.strip() for u in urls):
                report.add(f"{at}.remote_inference_engine_urls={show(urls)} must list the servers when "
                           f"{at}.run_engines_locally=false. Fix: e.g. "
                           f"{at}.remote_inference_engine_urls=['127.0.0.1:8001','10.0.0.2:8001'].")
            for key, size in changed.items():
                report.add(f"{key}={size} sizes engines Ridgeline starts, but {at}.run_engines_locally=false uses "
                           f"servers started elsewhere, with their own parallelism. Fix: {key}=1, and start the "
                           "servers with the parallelism they need.")
            return
        if self.backend != "hf":
            self._library_engine_parallelism(at, report)
            return
        for key, size in changed.items():
            report.add(f"{key}={size}: the embedded hf engine runs on one device. Fix: {key}=1, or a vllm / sglang "
                       f"engine ({at}.backend=vllm or sglang).")
        # inference_engine_tensor_parallel_size is not refused here whatever its value (SkyRL's default 4
        # included): the run says once at start that the hf engine runs on one device (support.unacted_settings)
        unknown = sorted(set(self.engine_init_kwargs) - set(self.HF_ENGINE_KWARGS))
        if unknown:
            report.add(f"{at}.engine_init_kwargs has {', '.join(unknown)}, which the embedded hf engine does not take "
                       f"(it takes {one_of(self.HF_ENGINE_KWARGS)}). Fix: remove the +{at}.engine_init_kwargs.* "
                       f"overrides, or use {at}.backend=vllm or sglang, whose engines receive them as is.")
