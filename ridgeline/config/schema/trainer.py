"""``trainer.*``: the models, their optimizers and sharding, placement, checkpoints, logging."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ridgeline.config.fields import Report, Section, one_of, setting, show
from ridgeline.config.schema.algorithm import AlgorithmConfig

LOGGERS: tuple[str, ...] = ("wandb", "console", "tensorboard", "mlflow", "jsonl")
SP_NOTE = "sequence parallelism is not built: FSDP2 shards the parameters, every rank holds whole sequences"


# lora.init_method values built (ridgeline.models.lora.PEFT_INIT maps them to peft's init_lora_weights),
# and why peft's other initialisations are not
LORA_INIT_METHODS: tuple[str, ...] = ("kaiming", "gaussian", "orthogonal")
LORA_INIT_REFUSED: dict[str, str] = {
    **dict.fromkeys(("pissa", "olora", "loftq", "corda"), "peft then rewrites the base weights (it subtracts the "
                    "initial adapters from them), while Ridgeline's reference (the base with adapters off), adapter "
                    "checkpoints and merged exports rely on an untouched base"),
    **dict.fromkeys(("eva", "lora_ga"), "it needs a pass over training data before training, which is not built"),
    **dict.fromkeys(("xavier", "normal", "zero"), "it is one of SkyRL's Megatron initialisations, which peft does "
                    "not have"),
}


@dataclass
class LoraConfig(Section):
    """LoRA adapters through peft (docs/lora.md), `trainer.critic.model.lora` and the base of the
    policy's: rank 0 = off (full fine-tuning). With rank > 0 only the adapters train (and the
    critic's value head); checkpoints hold the adapters and exports the merged model."""
    # LoRA rank r of the adapters; 0 = no LoRA (the whole model trains)
    rank: int = setting(0)
    alpha: float = setting(16.0)                  # the update is scaled by alpha / rank
    # dropout on the adapters' input (peft's lora_dropout)
    dropout: float = setting(0.0)
    target_modules: Any = setting("all-linear")   # or a list of module names, e.g. [q_proj, v_proj]
    # SkyRL keys. exclude_modules: null, or module names (a list) / a regex (a string) left without
    # adapters (peft's exclude_modules). init_method: the adapters' initialisation (peft's
    # init_lora_weights): kaiming (peft's default, B = 0), gaussian or orthogonal.
    exclude_modules: Any = setting(None)
    # how the adapters start (kaiming, gaussian or orthogonal), every one with B @ A = 0 so training starts from
    # the base model
    init_method: str = setting("kaiming")

    def check(self, at: str, report: Report) -> None:
        if self.rank < 0:
            report.add(f"{at}.rank={show(self.rank)} must be 0 (LoRA off: every weight trains) or a positive adapter "
                       f"rank. Fix: {at}.rank=0, or e.g. {at}.rank=16.")
        if self.alpha <= 0:
            report.add(f"{at}.alpha={show(self.alpha)} must be greater than 0: the adapters' update is scaled by alpha "
                       f"/ rank. Fix: e.g. {at}.alpha=16 (or twice the rank).")
        if not 0 <= self.dropout < 1:
            report.add(f"{at}.dropout={show(self.dropout)} must be in [0, 1): the probability of dropping an adapter "
                       f"input. Fix: {at}.dropout=0.0 (or e.g. 0.05).")
        key, targets = f"{at}.target_modules", self.target_modules
        names = [targets] if isinstance(targets, str) else targets if isinstance(targets, list) else None
        if names is None or not all(isinstance(t, str) for t in names):
            report.add(f"{key}={show(targets)} has the wrong type: expected 'all-linear' or a list of module names. "
                       f"Fix: {key}=all-linear, or e.g. {key}=[q_proj,v_proj].")
        elif not names or not all(t.strip() for t in names):
            report.add(f"{key}={show(targets)} names no module to adapt. Fix: {key}=all-linear (every linear layer "
                       f"but the output head), or a list such as {key}=[q_proj,k_proj,v_proj,o_proj].")
        key, exclude = f"{at}.exclude_modules", self.exclude_modules
        if exclude is not None and not ((isinstance(exclude, str) and exclude.strip()) or (
                isinstance(exclude, list) and exclude and all(isinstance(m, str) and m.strip() for m in exclude))):
            report.add(f"{key}={show(exclude)} must be null, a list of module names or a regex (a string) of modules "
                       f"left without adapters (peft's exclude_modules). Fix: e.g. {key}=[lm_head,k_proj].")
        key, init = f"{at}.init_method", self.init_method
        if init not in LORA_INIT_METHODS:
            why = LORA_INIT_REFUSED.get(init.split("_niter_")[0], "it is not one of peft's initialisations Ridgeline "
                                        "builds")
            report.add(f"{key}={show(init)} is not supported: {why}. Fix: {key}=kaiming (SkyRL's default: peft's "
                       f"init_lora_weights=True, B = 0), or {one_of(LORA_INIT_METHODS[1:])}.")
        elif init == "orthogonal" and self.rank > 0 and self.rank % 2:
            report.add(f"{key}=orthogonal needs an even {at}.rank (peft builds A and B from the two halves of an "
                       f"orthogonal matrix), got {self.rank}. Fix: {at}.rank={self.rank + 1}, or {key}=kaiming.")


@dataclass
class PolicyLoraConfig(LoraConfig):
    """`trainer.policy.model.lora`: the policy's reference model is then the frozen base (no second
    copy) and engines get the merged weights."""
    # SkyRL's folder for adapter files vLLM loads
    lora_sync_path: str = setting("/tmp/skyrl_lora_sync", not_built="syncing adapter files is not built: engines "
                                  "here receive the merged weights (W + scaling * B @ A) at every weight sync, so "
                                  "there is no adapter folder to place")


@dataclass
class PolicyModelConfig(Section):
    # the policy model: a hub id, a folder, pkg://, tiny:// or random:// (docs/config.md)
    path: str = setting("Qwen/Qwen2.5-1.5B-Instruct")
    gguf_file: Optional[str] = setting(None)  # Ridgeline extension: a GGUF file inside the folder `path` names
    lora: PolicyLoraConfig = field(default_factory=PolicyLoraConfig)

    def check(self, at: str, report: Report) -> None:
        if not self.path.strip():
            report.add(f"{at}.path is empty. Fix: a hub id or a local folder, e.g. "
                       f"{at}.path=Qwen/Qwen2.5-0.5B-Instruct.")
        self.lora.check(f"{at}.lora", report)


@dataclass
class RefModelConfig(Section):
    # SkyRL key: the reference model, the policy's by default; another model must share the
    # policy's tokenizer
    path: str = setting("${trainer.policy.model.path}")

    def check(self, at: str, report: Report) -> None:
        if not self.path.strip():
            report.add(f"{at}.path is empty. Fix: leave it at its default (${{trainer.policy.model.path}}: the "
                       "policy's model), or name another model that shares the policy's tokenizer.")


@dataclass
class CriticModelConfig(Section):
    path: Optional[str] = setting(None)       # null: no critic
    gguf_file: Optional[str] = setting(None)  # Ridgeline extension
    # SkyRL keys: adapters on the value model's backbone; its value head trains fully
    lora: LoraConfig = field(default_factory=LoraConfig)

    def check(self, at: str, report: Report) -> None:
        self.lora.check(f"{at}.lora", report)


@dataclass
class OptimizerConfig(Section):
    # AdamW's peak learning rate
    lr: float = setting(1.0e-6)
    # AdamW's (beta1, beta2)
    adam_betas: List[float] = setting([0.9, 0.999])
    # AdamW's decoupled weight decay, applied to matrices only (biases and norm scales do not decay)
    weight_decay: float = setting(1e-2)
    # the gradient norm is clipped to this before each optimizer step
    max_grad_norm: float = setting(1.0)
    # with engines sharing the GPU (colocate_all), AdamW's moments wait on the host between optimizer steps
    offload_after_step: bool = setting(True)
    # SkyRL 0.3.1: optimizer steps of linear warmup for this model (0: trainer.num_warmup_steps
    # applies; both set and different is refused) and the learning-rate schedule, a name of
    # transformers' get_scheduler (constant_with_warmup, constant, linear, cosine,
    # cosine_with_restarts, polynomial, inverse_sqrt) over the run's optimizer steps
    num_warmup_steps: int = setting(0)
    # the learning-rate schedule, a name of transformers' get_scheduler (constant_with_warmup, cosine, linear,
    # ...)
    scheduler: str = setting("constant_with_warmup")

    def check(self, at: str, report: Report) -> None:
        if self.lr <= 0:
            report.add(f"{at}.lr={show(self.lr)} must be greater than 0: the optimizer would not move the weights. "
                       f"Fix: e.g. {at}.lr={show(type(self)().lr)}.")
        for name in ("num_warmup_steps", "weight_decay", "max_grad_norm"):
            value = getattr(self, name)
            if value < 0:
                report.add(f"{at}.{name}={show(value)} must not be negative. "
                           f"Fix: e.g. {at}.{name}={show(getattr(type(self)(), name))}.")
        betas = self.adam_betas
        if len(betas) != 2 or any(not 0 <= b < 1 for b in betas):
            report.add(f"{at}.adam_betas={show(betas)} must be two numbers in [0, 1) (beta1, beta2). "
                       f"Fix: e.g. {at}.adam_betas=[0.9,0.999].")


@dataclass
class CriticOptimizerConfig(OptimizerConfig):
    lr: float = setting(5.0e-6)


# SkyRL 0.4's dtype names for fsdp_config.mixed_precision -> torch dtype names
FSDP_DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32")


@dataclass
class MixedPrecisionConfig(Section):
    """SkyRL 0.4 keys: FSDP2's MixedPrecisionPolicy of one role's ranks (trainer.strategy=fsdp2 / fsdp):
    param_dtype is the dtype the sharded parameters are gathered in for forward/backward,
    reduce_dtype the dtype gradients are reduce-scattered in. Master weights stay fp32."""
    # FSDP2 gathers the parameters in this dtype for compute on GPU ranks (the sharded master weights stay fp32)
    param_dtype: str = setting("bf16", choices=FSDP_DTYPES)
    # FSDP2 reduce-scatters the gradients in this dtype
    reduce_dtype: str = setting("fp32", choices=FSDP_DTYPES)
    # FSDP1's buffer dtype; FSDP2 (SkyRL's fsdp2 too) keeps buffers in their own dtype
    buffer_dtype: str = setting("fp32", choices=("fp32",), not_built="a buffer dtype is not built: FSDP2 (SkyRL's "
                                "fsdp2 too) keeps buffers in the model's own dtype; only FSDP1 had one")


@dataclass
class FSDPConfig(Section):
    # keep the sharded parameters, gradients and optimizer state on the host (GPU ranks)
    cpu_offload: bool = setting(False)
    # free each layer's gathered parameters after its forward (ZeRO-3) rather than keep them for backward
    reshard_after_forward: bool = setting(True)
    fsdp_size: int = setting(-1)   # -1: shard over all ranks; N: shard groups of N ranks, replicated
    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)


@dataclass
class TorchProfilerConfig(Section):
    """SkyRL 0.4 keys: torch.profiler traces of the policy's training steps (one trace per rank
    listed in `ranks`; in one process, rank 0). torch.profiler.schedule(skip_first, wait, warmup,
    active, repeat) counts policy training steps; traces go to save_path (default
    ${trainer.run_dir}/profiler) as Chrome traces (`export_type`: chrome_trace)."""
    # profile the policy's training steps with torch.profiler
    enable: bool = setting(False)
    # the ranks that profile
    ranks: List[int] = setting([0])
    # folder of the traces; null: <trainer.run_dir>/profiler
    save_path: Optional[str] = setting(None)
    activities: List[str] = setting(["cpu", "cuda"])   # cuda is recorded only where CUDA is present
    # training steps not profiled at the start
    skip_first: int = setting(10)
    # steps of each cycle the profiler idles (torch.profiler.schedule's wait)
    wait: int = setting(0)
    # steps of each cycle traced but discarded (schedule's warmup)
    warmup: int = setting(1)
    # steps of each cycle recorded (schedule's active)
    active: int = setting(1)
    # cycles recorded (schedule's repeat; 0 = until training ends)
    repeat: int = setting(1)
    # record the operators' input shapes
    record_shapes: bool = setting(True)
    # record tensor memory allocation and release
    profile_memory: bool = setting(False)
    # record the Python stack of each operator
    with_stack: bool = setting(True)
    # estimate the FLOPs of matrix multiplications and convolutions
    with_flops: bool = setting(False)
    # record the nn.Module hierarchy of each operator
    with_modules: bool = setting(False)
    # the trace format written
    export_type: str = setting("chrome_trace", built=("chrome_trace",),
                               not_built="other trace formats are not built: traces are written as Chrome traces")
    use_gzip: bool = setting(False)   # chrome traces written as .json.gz

    def check(self, at: str, report: Report) -> None:
        for name in ("skip_first", "wait", "warmup", "repeat"):
            if getattr(self, name) < 0:
                report.add(f"{at}.{name}={show(getattr(self, name))} must be >= 0 (policy training steps). "
                           f"Fix: e.g. {at}.{name}={show(getattr(TorchProfilerConfig(), name))}.")
        if self.active < 1:
            report.add(f"{at}.active={show(self.active)} must be >= 1: the steps each trace records. "
                       f"Fix: {at}.active=1.")
        bad = [a for a in self.activities if a not in ("cpu", "cuda")]
        if bad or not self.activities:
            report.add(f"{at}.activities={show(self.activities)} must list cpu and/or cuda (torch.profiler's "
                       f"ProfilerActivity). Fix: {at}.activities=[cpu,cuda].")


@dataclass
class RefFSDPConfig(FSDPConfig):
    cpu_offload: bool = setting(True)


@dataclass
class PolicyConfig(Section):
    model: PolicyModelConfig = field(default_factory=PolicyModelConfig)
    # SkyRL key: overrides of the model's Hugging Face config when it is loaded (free-form; each
    # must name an attribute the config has), e.g. model_config_kwargs.attention_dropout=0.1
    model_config_kwargs: Dict[str, Any] = setting({})
    optimizer_config: OptimizerConfig = field(default_factory=OptimizerConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    # ranks one sequence is split over (Ulysses sequence parallelism); only 1 runs
    sequence_parallel_size: int = setting(1, not_built=SP_NOTE)
    # compile the policy with torch.compile
    use_torch_compile: bool = setting(False, not_built="torch.compile is not built (on one CPU core it costs "
                                      "minutes of compilation per shape; docs/benchmarks.md)")
    # record CUDA memory snapshots
    record_memory: bool = setting(False, not_built="CUDA memory snapshots are not built (memory/peak_gpu_gib is "
                                  "logged every step)")
    torch_profiler_config: TorchProfilerConfig = field(default_factory=TorchProfilerConfig)   # SkyRL 0.4

    def check(self, at: str, report: Report) -> None:
        self.model.check(f"{at}.model", report)
        self.optimizer_config.check(f"{at}.optimizer_config", report)
        self.torch_profiler_config.check(f"{at}.torch_profiler_config", report)


@dataclass
class CriticConfig(Section):
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    model_config_kwargs: Dict[str, Any] = setting({})   # SkyRL key: as the policy's
    optimizer_config: CriticOptimizerConfig = field(default_factory=CriticOptimizerConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    # as trainer.policy.sequence_parallel_size, for the critic
    sequence_parallel_size: int = setting(1, not_built=SP_NOTE)

    def check(self, at: str, report: Report) -> None:
        self.model.check(f"{at}.model", report)
        self.optimizer_config.check(f"{at}.optimizer_config", report)


@dataclass
class RefConfig(Section):
    model: RefModelConfig = field(default_factory=RefModelConfig)
    # SkyRL key: overrides of the reference's Hugging Face config (the policy's are not applied)
    model_config_kwargs: Dict[str, Any] = setting({})
    fsdp_config: RefFSDPConfig = field(default_factory=RefFSDPConfig)
    # as trainer.policy.sequence_parallel_size, for the reference
    sequence_parallel_size: int = setting(1, not_built=SP_NOTE)

    def check(self, at: str, report: Report) -> None:
        self.model.check(f"{at}.model", report)


@dataclass
class PlacementConfig(Section):
    # policy, reference, critic and inference engines share the same GPUs, taking turns (engines sleep while the
    # models train)
    colocate_all: bool = setting(True)
    # the reference shares the policy's GPUs
    colocate_policy_ref: bool = setting(True)
    # the critic shares the reward model's GPUs (SkyRL's; Ridgeline has no reward model)
    colocate_critic_reward: bool = setting(False)
    # nodes of the policy's ranks
    policy_num_nodes: int = setting(1)
    # policy ranks (one GPU each) per node
    policy_num_gpus_per_node: int = setting(4)
    # nodes of the critic's ranks
    critic_num_nodes: int = setting(1)
    # critic ranks (one GPU each) per node
    critic_num_gpus_per_node: int = setting(4)
    # nodes of the reference's ranks
    ref_num_nodes: int = setting(1)
    # reference ranks (one GPU each) per node
    ref_num_gpus_per_node: int = setting(4)
    # nodes of a reward model (SkyRL's; Ridgeline has none)
    reward_num_nodes: int = setting(1)
    # GPUs per node of a reward model (SkyRL's; Ridgeline has none)
    reward_num_gpus_per_node: int = setting(4)
    # Ridgeline extension: seconds to wait for Ray to reserve the placement groups (and for the
    # ranks of a group to meet) before failing with the resource that could not be placed.
    timeout_s: int = setting(180)
    # Ridgeline extension: seconds the driver waits on any one call to a Ray actor (a training step's
    # share, a generation, a weight sync, building an engine) before the run stops naming the actor
    # that does not answer (a hang, or a rank stuck in a collective with a lost peer). Raise it for
    # steps that take longer.
    actor_call_timeout_s: int = setting(3600)

    def check(self, at: str, report: Report) -> None:
        for name in ("timeout_s", "actor_call_timeout_s"):
            value = getattr(self, name)
            if value < 1:
                report.add(f"{at}.{name}={show(value)} must be a positive number of seconds (every wait on Ray is "
                           f"bounded). Fix: e.g. {at}.{name}={show(getattr(PlacementConfig(), name))}.")


ASYNC_MODES: tuple[str, ...] = ("sync", "one_step_off_policy", "fully_async")


@dataclass
class FullyAsyncConfig(Section):
    """SkyRL 0.3.1's knobs of its fully asynchronous trainer, read with `trainer.async_mode=fully_async`
    (docs/async.md). Ridgeline generates each step's batch on one policy version, exactly
    `max_staleness_steps` behind the trainer (fewer at the start), so the bound is exact."""
    # a batch scheduled at step i trains at step j with j - i <= max_staleness_steps
    max_staleness_steps: int = setting(4)
    # prompt groups (one prompt x n_samples_per_prompt) in flight at once; SkyRL's rule:
    # train_batch_size <= it <= train_batch_size * (max_staleness_steps + 1)
    num_parallel_generation_workers: int = setting(768)

    def check_mode(self, at: str, mode: str, batch: int, report: Report) -> None:
        """The knobs are SkyRL's fully async trainer's: refused when changed in another mode (they
        would do nothing), held to SkyRL's rule with it."""
        default = FullyAsyncConfig()
        if mode != "fully_async":
            for name in ("max_staleness_steps", "num_parallel_generation_workers"):
                value = getattr(self, name)
                if value != getattr(default, name):
                    report.add(f"{at}.{name}={show(value)} is read only by the fully asynchronous trainer (SkyRL's "
                               f"examples.fully_async.main_async), and trainer.async_mode={mode}. Fix: add "
                               f"trainer.async_mode=fully_async, or drop {at}.{name}.")
            return
        stale = self.max_staleness_steps
        if stale < 0:
            report.add(f"{at}.max_staleness_steps={show(stale)} must be 0 or more (steps a batch may lag the "
                       f"policy it trains). Fix: e.g. {at}.max_staleness_steps=1.")
            return
        workers = self.num_parallel_generation_workers
        if not batch <= workers <= batch * (stale + 1):
            report.add(f"{at}.num_parallel_generation_workers={show(workers)} must lie between trainer.train_batch_size"
                       f"={batch} and train_batch_size * (max_staleness_steps + 1) = {batch * (stale + 1)} (SkyRL's "
                       f"rule: fewer starve the trainer, more can never run). Fix: e.g. {at}."
                       f"num_parallel_generation_workers={batch * (stale // 2 + 1)}.")


@dataclass
class TrainerConfig(Section):
    # how the models train: single (one process) or fsdp2 / fsdp (FSDP2 ranks as Ray actors)
    strategy: str = setting("fsdp2", choices=("fsdp2", "fsdp", "single", "deepspeed", "megatron"),
                            built=("single", "fsdp2", "fsdp"),
                            not_built="Megatron and DeepSpeed are not planned: the backends here are single (one "
                            "process) and fsdp2 / fsdp (FSDP2 ranks as Ray actors: gloo on CPU workers, NCCL on GPUs)")
    # SkyRL 0.3.1 (its only backend); sequence parallelism itself is not built (*.sequence_parallel_size)
    sequence_parallel_backend: str = setting("ulysses", built=("ulysses",), not_built=SP_NOTE)
    # passes over the training data
    epochs: int = setting(1)
    # Ridgeline extension (SkyRL 0.3.1 has no step cap): null = epochs x the batches of an epoch;
    # N = exactly N steps, the learning-rate schedule spanning N, taking as many passes over the
    # data as N needs (transformers' TrainingArguments.max_steps: it takes the place of epochs).
    max_steps: Optional[int] = setting(None)
    # SkyRL 0.4 key: stop after N steps when epochs x the batches of an epoch is more (the run and its
    # learning-rate schedule span min(epochs x batches, N)); null = no cap. max_steps, when set, wins.
    max_training_steps: Optional[int] = setting(None)
    # passes of optimizer steps over each generated batch (PPO's epochs)
    update_epochs_per_batch: int = setting(1)
    # prompts per training step (each sampled generator.n_samples_per_prompt times)
    train_batch_size: int = setting(1024)
    # prompts per policy optimizer step (their samples are the mini-batch)
    policy_mini_batch_size: int = setting(256)
    # prompts per critic optimizer step
    critic_mini_batch_size: int = setting(256)
    # samples per forward/backward pass; gradients accumulate over a mini-batch's micro-batches
    micro_train_batch_size_per_gpu: int = setting(1)
    # samples per forward-only pass (old-policy, reference logprobs, critic values)
    micro_forward_batch_size_per_gpu: int = setting(1)
    # the reference model takes the policy's weights after each epoch
    update_ref_every_epoch: bool = setting(False)
    # optimizer steps of linear learning-rate warmup (policy and critic)
    num_warmup_steps: int = setting(0)
    # pack a micro-batch's rows into few long rows without padding for the training forward
    use_sample_packing: bool = setting(True)
    # prompts longer than this many tokens (after the chat template) are dropped from the data
    max_prompt_length: int = setting(512)
    gradient_checkpointing: bool = setting(True)   # activation recomputation: a memory option
    # SkyRL key: torch.utils.checkpoint's use_reentrant for activation checkpointing (policy, critic)
    gradient_checkpointing_use_reentrant: bool = setting(False)
    # seed of the run: data order, sampling, initialisation (every other seed is derived from it)
    seed: int = setting(42)
    # prompts per evaluation batch
    eval_batch_size: int = setting(1024)
    # evaluate data.val_data before the first step
    eval_before_train: bool = setting(True)
    # evaluate every N steps (and at the end); 0 or less: only before and after training
    eval_interval: int = setting(5)
    # Checkpoints and resume: docs/checkpointing.md. resume_mode null is SkyRL's spelling of none.
    resume_mode: Optional[str] = setting("latest", choices=("none", None, "latest", "from_path"))
    # the checkpoint folder resume_mode=from_path resumes from
    resume_path: Optional[str] = setting(None)
    # Ridgeline extension: resume even when the checkpoint's run had another policy/critic model,
    # other training data, seed or train_batch_size (a warning instead of an error).
    resume_ignore_config_changes: bool = setting(False)
    # folder of the run's checkpoints (global_step_N)
    ckpt_path: str = setting("${oc.env:HOME}/ckpts/")
    # newest checkpoints kept, older ones deleted; -1 (or 0) = keep all
    max_ckpts_to_keep: int = setting(-1)
    # write a checkpoint every N steps (and after the last); 0 or less: none
    ckpt_interval: int = setting(10)
    # Ridgeline extension: true = the first Ctrl-C lets the current step finish, writes a
    # checkpoint of it and exits (a second Ctrl-C aborts at once, writing nothing).
    ckpt_on_interrupt: bool = setting(False)
    # Hugging Face exports every N steps (and after the last) into ${trainer.export_path}/global_step_N
    hf_save_interval: int = setting(-1)
    # SkyRL's folder for exports and dumps (dumped_evals/, dumped_data/): docs/checkpointing.md
    export_path: str = setting("${oc.env:HOME}/exports/")
    # Ridgeline extension: true = exports and dumps (global_step_N/, dumped_evals/, dumped_data/)
    # go in the run's own folder (trainer.run_dir), so runs sharing an export_path keep theirs apart
    # (the presets set it); false = SkyRL's place, trainer.export_path, shared by its runs.
    exports_per_run: bool = setting(False)
    # SkyRL 0.4 key: folder of the infrastructure log, {log_path}/infra-YYMMDD_HHMMSS.log: engine
    # start-up, model loading and worker set-up (Ridgeline's ridgeline.inference / .models /
    # .distributed / .training loggers, at INFO and above); the console keeps its own output
    log_path: str = setting("/tmp/skyrl-logs")
    # the trackers' project (wandb, MLflow experiment)
    project_name: str = setting("skyrl")
    # the run's name in the trackers and its folder under export_path
    run_name: str = setting("test_run")
    logger: Any = setting("wandb")   # a tracker name or a list of them
    # write each step's training batch (decoded samples, rewards, advantages) under <export_path>/dumped_data
    dump_data_batch: bool = setting(False)
    # write each evaluation's samples and scores under <export_path>/dumped_evals
    dump_eval_results: bool = setting(True)
    # Ridgeline extension: what a NaN/inf loss of a micro-batch does (checked before backward):
    # skip = drop that optimizer step (counted in policy/skipped_steps, critic/skipped_steps)
    # and warn; stop = end the run with an error naming the step.
    nonfinite_loss: str = setting("skip", choices=("skip", "stop"))
    # Ridgeline extension: before any model loads, estimate the memory the run needs (weights,
    # gradients, AdamW states, reference, engine; docs/troubleshooting.md) and refuse a run on a
    # CPU whose weights and optimizer states alone exceed the memory available; false = start anyway.
    check_memory: bool = setting(True)
    # Ridgeline extension: folder for metrics.jsonl, the run report and the final model.
    run_dir: str = setting("${trainer.export_path}/${trainer.run_name}")
    # Ridgeline extension: autocast compute dtype of the training forward/backward
    # (auto | bf16 | fp32). Master weights stay float32. auto = bf16 where the device runs it
    # fast (CUDA with bf16 support, or a CPU with AMX), fp32 otherwise.
    mixed_precision: str = setting("auto", choices=("auto", "bf16", "fp32"))
    # Ridgeline extension: where this process trains and generates: auto (the GPU when CUDA is
    # available, else the CPU) | cpu | cuda (the current GPU; on a rank, the one LOCAL_RANK names)
    # | cuda:N (one process only: with fsdp2 each rank takes the GPU Ray or LOCAL_RANK gives it, and
    # the driver decides GPU or CPU workers from the Ray cluster's GPUs, not its own). SkyRL configs
    # never name it; auto does what they expect.
    device: str = setting("auto")
    # FlashAttention-2 for the training models on CUDA when the flash-attn package is installed;
    # PyTorch's SDPA otherwise (and on CPU, eager attention for rows of <= 256 tokens).
    flash_attn: bool = setting(True)
    # SkyRL key: true lets trainer.mixed_precision decide (auto: bf16 where fast); false means fp32
    # throughout: mixed_precision=auto then runs fp32, and mixed_precision=bf16 with it is refused.
    bf16: bool = setting(True)
    # SkyRL key: true loads the slow (Python) tokenizer (AutoTokenizer use_fast=false); refused at load
    # when transformers returns a fast one all the same (transformers 5 ignores use_fast).
    disable_fast_tokenizer: bool = setting(False)
    # SkyRL keys: RoPE overrides of the training models' Hugging Face config (policy, reference,
    # critic), e.g. rope_scaling={rope_type: yarn, factor: 4.0, original_max_position_embeddings: 32768};
    # null keeps the model's own. The engines take generator.rope_scaling / rope_theta.
    rope_scaling: Optional[Dict[str, Any]] = setting(None)
    # the policy, reference and critic's RoPE base; null keeps the model's own
    rope_theta: Optional[float] = setting(None)
    # Ridgeline extension (docs/async.md): sync = generate each batch with the current policy, then
    # train on it; one_step_off_policy = generate batch i+1 (on the policy of step i-1) while step i
    # trains; fully_async = SkyRL's fully async trainer, batches generated up to
    # fully_async.max_staleness_steps ahead of the trainer.
    async_mode: str = setting("sync", choices=ASYNC_MODES)

    placement: PlacementConfig = field(default_factory=PlacementConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    fully_async: FullyAsyncConfig = field(default_factory=FullyAsyncConfig)

    @property
    def exports_dir(self) -> str:
        """Where exports and dumps go: `run_dir` with `exports_per_run`, else `export_path`."""
        return self.run_dir if self.exports_per_run else self.export_path

    def check(self, at: str, report: Report) -> None:
        for name in ("epochs", "update_epochs_per_batch", "train_batch_size", "policy_mini_batch_size",
                     "critic_mini_batch_size", "micro_train_batch_size_per_gpu", "micro_forward_batch_size_per_gpu",
                     "max_prompt_length", "eval_batch_size"):
            value = getattr(self, name)
            if value < 1:
                report.add(f"{at}.{name}={show(value)} must be a positive whole number (at least 1). "
                           f"Fix: e.g. {at}.{name}={show(getattr(TrainerConfig(), name))}.")
        if self.max_training_steps is not None and self.max_training_steps < 1:
            report.add(f"{at}.max_training_steps={show(self.max_training_steps)} must be null (no cap) or a whole "
                       f"number of steps >= 1. Fix: e.g. {at}.max_training_steps=20.")
        if self.max_steps is not None and self.max_steps < 1:
            report.add(f"{at}.max_steps={show(self.max_steps)} must be null (train {at}.epochs passes over the data) "
                       f"or a whole number of steps >= 1. Fix: e.g. {at}.max_steps=20, or {at}.max_steps=null.")
        if self.num_warmup_steps < 0:
            report.add(f"{at}.num_warmup_steps={show(self.num_warmup_steps)} must not be negative. "
                       f"Fix: e.g. {at}.num_warmup_steps=0.")
        for role, optimizer in (("policy", self.policy.optimizer_config), ("critic", self.critic.optimizer_config)):
            own, shared = optimizer.num_warmup_steps, self.num_warmup_steps
            if own and shared and own != shared:
                report.add(f"{at}.{role}.optimizer_config.num_warmup_steps={show(own)} and {at}.num_warmup_steps="
                           f"{show(shared)} both set the {role}'s warmup. Fix: set one of them (the other 0).")
        for role in ("policy", "critic"):
            self._schedule(at, role, report)
        if self.eval_interval < -1:
            report.add(f"{at}.eval_interval={show(self.eval_interval)} must be a positive number of steps, or -1 / 0 "
                       f"to turn periodic evaluation off (SkyRL reads both). Fix: {at}.eval_interval=-1 or e.g. 5.")
        self._checkpoints(at, report)
        self._logger(at, report)
        self._device(at, report)
        self.policy.check(f"{at}.policy", report)
        self.critic.check(f"{at}.critic", report)
        self.ref.check(f"{at}.ref", report)
        self.placement.check(f"{at}.placement", report)
        check_rope(at, self.rope_scaling, self.rope_theta, report)
        if not self.bf16 and self.mixed_precision == "bf16":
            report.add(f"{at}.bf16=false asks for fp32 training and {at}.mixed_precision=bf16 for bf16 autocast: the "
                       f"two keys say the same thing and disagree. Fix: keep one of them ({at}.mixed_precision=auto "
                       f"follows {at}.bf16).")
        self.algorithm.check(f"{at}.algorithm", report)
        self.fully_async.check_mode(f"{at}.fully_async", self.async_mode, self.train_batch_size, report)
        self._critic_and_reference(at, report)
        self._lora(at, report)

    def _schedule(self, at: str, role: str, report: Report) -> None:
        """A transformers schedule that needs only warmup and training steps, with a warmup it acts on
        and (polynomial) an lr above its end."""
        from ridgeline.training.optim import LR_SCHEDULES, POLYNOMIAL_LR_END, UNBUILT_LR_SCHEDULES

        optimizer = getattr(self, role).optimizer_config
        key, name = f"{at}.{role}.optimizer_config.scheduler", optimizer.scheduler
        if name in UNBUILT_LR_SCHEDULES:
            report.add(f"{key}={name} needs {UNBUILT_LR_SCHEDULES[name]}, which SkyRL 0.3.1 does not pass to "
                       f"transformers' get_scheduler either: the schedules built are {one_of(LR_SCHEDULES)}. "
                       f"Fix: e.g. {key}=cosine.")
            return
        if name not in LR_SCHEDULES:
            close = difflib.get_close_matches(name, LR_SCHEDULES, n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]}?" if close else ""
            report.add(f"{key}={show(name)} is not a learning-rate schedule: the schedules built are transformers' "
                       f"{one_of(LR_SCHEDULES)}.{hint} Fix: e.g. {key}={close[0] if close else 'constant_with_warmup'}.")
            return
        warmup = optimizer.num_warmup_steps or self.num_warmup_steps
        if name == "constant" and warmup:
            report.add(f"{key}=constant has no warmup, so the {role}'s num_warmup_steps={show(warmup)} would be "
                       f"ignored. Fix: {key}=constant_with_warmup, or num_warmup_steps=0.")
        if name == "polynomial" and optimizer.lr <= POLYNOMIAL_LR_END:
            report.add(f"{key}=polynomial decays to transformers' lr_end={POLYNOMIAL_LR_END:g}, which must be below "
                       f"{at}.{role}.optimizer_config.lr={show(optimizer.lr)}. Fix: a larger lr, or {key}=linear "
                       "(decays to 0).")

    def _checkpoints(self, at: str, report: Report) -> None:
        meaning = {"ckpt_interval": ("off", "a checkpoint every N steps", 10),
                   "hf_save_interval": ("off", "a Hugging Face export every N steps", 10),
                   "max_ckpts_to_keep": ("keep all", "keep the N newest checkpoints", 3)}
        for name, (minus_one, n, example) in meaning.items():
            value = getattr(self, name)
            # 0 is SkyRL's other spelling of off (its loop acts only on values > 0); 0.4's scripts write it
            off = (-1, 0) if name != "max_ckpts_to_keep" else (-1,)
            if value not in off and value < 1:
                report.add(f"{at}.{name}={show(value)} must be {' or '.join(map(str, off))} ({minus_one}) or a whole "
                           f"number N >= 1 ({n}). "
                           f"Fix: {at}.{name}=-1 or e.g. {at}.{name}={example}.")
        if self.resume_mode == "from_path" and (self.resume_path is None or not self.resume_path.strip()):
            report.add(f"{at}.resume_mode=from_path loads the checkpoint named by {at}.resume_path, but "
                       f"{at}.resume_path is null. Fix: {at}.resume_path=<ckpt_path>/global_step_N, or "
                       f"{at}.resume_mode=latest to take the newest checkpoint in {at}.ckpt_path.")

    def _logger(self, at: str, report: Report) -> None:
        logger = self.logger
        entries = [logger] if isinstance(logger, str) else logger if isinstance(logger, list) else None
        if not entries or not all(isinstance(e, str) for e in entries):
            report.add(f"{at}.logger={show(logger)} has the wrong type: expected a tracker name or a non-empty list "
                       f"of tracker names. Fix: e.g. {at}.logger=console, or {at}.logger=[console,jsonl].")
            return
        unknown = [e for e in entries if e not in LOGGERS]
        if unknown:
            report.add(f"{at}.logger={show(logger)} names unknown tracker(s) {one_of(unknown)}: trackers are "
                       f"{one_of(LOGGERS)}. Fix: e.g. {at}.logger=console, or a list such as "
                       f"{at}.logger=[console,jsonl].")

    def _device(self, at: str, report: Report) -> None:
        from ridgeline.models.device import device_kind, resolve_device
        if self.strategy not in ("fsdp2", "fsdp"):
            try:
                resolve_device(self.device)  # one process: this machine must have it
            except ValueError as exc:
                report.add(str(exc))
            return
        # FSDP2 ranks run on the Ray cluster's nodes, whose GPUs this process need not see
        try:
            kind = device_kind(self.device)
        except ValueError as exc:
            report.add(str(exc))
            return
        if kind == "cuda" and str(self.device).strip().lower() != "cuda":
            report.add(f"{at}.device={self.device} names one GPU, but {at}.strategy={self.strategy} gives each rank "
                       f"the GPU Ray (or LOCAL_RANK) assigns it. Fix: {at}.device=cuda (or auto).")

    def _critic_and_reference(self, at: str, report: Report) -> None:
        a, critic = f"{at}.algorithm", self.critic.model.path
        estimator = self.algorithm.advantage_estimator
        if estimator == "gae" and critic is None:
            report.add(f"{a}.advantage_estimator=gae needs a critic (value model), but {at}.critic.model.path is "
                       f"null. Fix: {at}.critic.model.path=<the policy's path, a common start>, or a critic-free "
                       f"estimator such as {a}.advantage_estimator=grpo.")
        if critic is not None and estimator in AlgorithmConfig.CRITIC_FREE_ESTIMATORS:
            report.add(f"{at}.critic.model.path={critic} builds and trains a critic, but {a}.advantage_estimator="
                       f"{estimator} never reads its values. Fix: {a}.advantage_estimator=gae to use the critic, "
                       f"or {at}.critic.model.path=null.")
        if self.update_ref_every_epoch and not self.algorithm.uses_reference:
            report.add(f"{at}.update_ref_every_epoch=true refreshes the reference model, but no KL option uses one "
                       f"({a}.use_kl_loss and use_kl_in_reward are both off). Fix: {a}.use_kl_loss=true, or "
                       f"{at}.update_ref_every_epoch=false.")
        if self.algorithm.on_policy_distillation:
            key = f"{a}.on_policy_distillation=true"
            if self.ref.model.path == self.policy.model.path:
                report.add(f"{key} rewards the policy for agreeing with the teacher, {at}.ref.model.path, which is the "
                           f"policy's own model ({self.policy.model.path}): the student would learn to stay where it "
                           f"starts. Fix: {at}.ref.model.path=<the teacher: a model with the policy's tokenizer>.")
            if self.update_ref_every_epoch:
                report.add(f"{key} with {at}.update_ref_every_epoch=true would replace the teacher by the student "
                           f"after every epoch. Fix: {at}.update_ref_every_epoch=false.")

    def _lora(self, at: str, report: Report) -> None:
        critic = f"{at}.critic.model.lora"
        if self.critic.model.lora.rank > 0 and self.critic.model.path is None:
            report.add(f"{critic}.rank={self.critic.model.lora.rank} puts adapters on the critic, but "
                       f"{at}.critic.model.path is null (no critic). Fix: {critic}.rank=0, or "
                       f"{at}.critic.model.path=<a model> with {at}.algorithm.advantage_estimator=gae.")
        lora, rank = f"{at}.policy.model.lora", self.policy.model.lora.rank
        if rank > 0 and self.update_ref_every_epoch and self.algorithm.uses_reference:
            report.add(f"{at}.update_ref_every_epoch=true with {lora}.rank={rank}: with LoRA the reference model is "
                       "the frozen base the adapters sit on (the policy with its adapters off, no second copy), so it "
                       f"cannot follow the policy. Fix: {at}.update_ref_every_epoch=false, or {lora}.rank=0 to train "
                       "(and refresh the reference from) the full model.")


def check_rope(at: str, scaling: Optional[Dict[str, Any]], theta: Optional[float], report: Report) -> None:
    """`<at>.rope_scaling` / `<at>.rope_theta` (the trainer's, or the engines' when they differ)."""
    if scaling is not None and not isinstance(scaling.get("rope_type", scaling.get("type")), str):
        report.add(f"{at}.rope_scaling={show(scaling)} must be null or a map naming its rope_type, as the rope_scaling "
                   f"of a Hugging Face config. Fix: e.g. '{at}.rope_scaling={{rope_type: yarn, factor: 4.0, "
                   "original_max_position_embeddings: 32768}'.")
    if theta is not None and theta <= 0:
        report.add(f"{at}.rope_theta={show(theta)} must be null (the model's own) or the positive RoPE base frequency. "
                   f"Fix: e.g. {at}.rope_theta=1000000.")
