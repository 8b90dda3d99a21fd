"""The typed Ridgeline config: one dataclass per section, with SkyRL-Train 0.3.1's keys and defaults.

``RidgelineConfig`` is the whole tree (``data``, ``trainer``, ``generator``, ``environment``); each
section's fields carry the type and default of a key, its comment says what the key does, and its
``check`` holds the rules between its keys. The rules that span sections are below.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf

from ridgeline.config.fields import (
    Report, Section, divisor_text, field_type, is_free_form, section_fields, section_type, show,
)
from ridgeline.config.schema.algorithm import AlgorithmConfig
from ridgeline.config.schema.environment import DataConfig, EnvironmentConfig
from ridgeline.config.schema.generator import GeneratorConfig
from ridgeline.config.schema.supervised import DPOConfig, SFTConfig
from ridgeline.config.schema.trainer import TrainerConfig, check_rope

__all__ = ["RidgelineConfig", "AlgorithmConfig", "DataConfig", "EnvironmentConfig", "GeneratorConfig",
           "TrainerConfig", "SFTConfig", "DPOConfig", "base_config", "leaf_fields", "all_keys", "free_form_keys"]


@dataclass
class RidgelineConfig(Section):
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    # Ridgeline extensions: `ridgeline sft` / `ridgeline dpo` (docs/sft_dpo.md)
    sft: SFTConfig = field(default_factory=SFTConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)

    def check(self, at: str, report: Report) -> None:
        self.data.check("data", report)
        self.trainer.check("trainer", report)
        self.generator.check("generator", report)
        self.environment.check("environment", report)
        self.sft.check("sft", report)
        self.dpo.check("dpo", report)
        g, t = self.generator, self.trainer
        if (g.rope_scaling, g.rope_theta) != (t.rope_scaling, t.rope_theta):  # else reported once, as the trainer's
            check_rope("generator", g.rope_scaling, g.rope_theta, report)
        self._batches(report)
        self._placement(report)
        self._rollout_budget(report)

    # a step's prompts are split into mini-batches, then over ranks, then into micro-batches
    def _batches(self, report: Report) -> None:
        t = self.trainer
        self._batch_role("policy", report)
        if t.critic.model.path is not None:
            self._batch_role("critic", report)

    def _batch_role(self, role: str, report: Report) -> None:
        t = self.trainer
        tbs = t.train_batch_size
        mkey, mini = f"trainer.{role}_mini_batch_size", getattr(t, f"{role}_mini_batch_size")
        if min(tbs, mini) < 1:
            return
        if mini > tbs:
            report.add(f"{mkey}={mini} is larger than trainer.train_batch_size={tbs}: a mini-batch is a slice of the "
                       f"{tbs} prompts of one step. Fix: choose a mini-batch size that divides {tbs} "
                       f"({divisor_text(tbs)}).")
            return
        if tbs % mini:
            report.add(f"{mkey}={mini} does not divide trainer.train_batch_size={tbs}: each step splits the {tbs} "
                       f"prompts into mini-batches of {mini} for optimizer steps. Fix: choose a mini-batch size that "
                       f"divides {tbs} ({divisor_text(tbs)}).")
        # A mini-batch of samples that does not split evenly over the data-parallel ranks is padded
        # (training.batch.rank_shares: copies marked as padding, in no loss and no count), and a
        # micro-batch size that does not divide a rank's share leaves a smaller last micro-batch:
        # the losses divide by the whole mini-batch's counts, so the update is the same either way.

    def _placement(self, report: Report) -> None:
        t, g = self.trainer, self.generator
        ranks = t.placement.policy_num_nodes * t.placement.policy_num_gpus_per_node
        if t.algorithm.loss_reduction == "prompt_mean" and t.strategy in ("fsdp2", "fsdp") and ranks > 1:
            # a prompt's rows may sit on several ranks, and the ranks share sums, not uids
            report.add(f"trainer.algorithm.loss_reduction=prompt_mean is built for one training process, and "
                       f"trainer.strategy={t.strategy} runs {ranks} policy ranks. Fix: token_mean or sequence_mean, "
                       f"or trainer.strategy=single.")
        dp = g.inference_engine_data_parallel_size
        if dp > 1 and t.strategy == "single" and g.backend != "hf" and g.run_engines_locally:
            key = "generator.inference_engine_data_parallel_size"
            report.add(f"{key}={dp} runs {dp} engine processes per engine, but trainer.strategy=single runs one "
                       f"engine inside the trainer's process. Fix: trainer.strategy=fsdp2 (engines as Ray actors), or "
                       f"{key}=1.")
        if t.strategy not in ("fsdp2", "fsdp"):
            return
        from ridgeline.distributed.placement import PlacementConfigError, plan_placement
        from ridgeline.inference.parallelism import EngineParallelism
        from ridgeline.models.device import device_kind
        from ridgeline.models.lora import reference_is_base
        # a LoRA policy's reference is its own base on the policy ranks: no reference ranks
        use_ref = t.algorithm.uses_reference and not reference_is_base(t)
        try:
            plan = plan_placement(t.placement, num_engines=g.num_inference_engines,
                                  engine=EngineParallelism.from_config(g), use_ref=use_ref,
                                  use_critic=t.critic.model.path is not None,
                                  # `auto` is planned once Ray says what the cluster has (the same
                                  # rules, ray_workers.cluster_device); `cuda` is GPUs already
                                  device="GPU" if _device_kind(t.device, device_kind) == "cuda" else "CPU",
                                  remote_engines=not g.run_engines_locally)
        except PlacementConfigError as exc:
            report.add(str(exc))
            return
        for role, ranks in plan.ranks.items():
            key, size = f"trainer.{role}.fsdp_config.fsdp_size", getattr(t, role).fsdp_config.fsdp_size
            if size > 0 and ranks % size:
                report.add(f"{key}={size} must divide the {ranks} {role} ranks (hybrid sharding: shard groups of "
                           f"{size} ranks, replicated). Fix: {key}=-1 (shard over all ranks), or a divisor of {ranks} "
                           f"({divisor_text(ranks)}).")

    def _rollout_budget(self, report: Report) -> None:
        a, n = self.trainer.algorithm, self.generator.n_samples_per_prompt
        ds = "trainer.algorithm.dynamic_sampling"
        if a.dynamic_sampling.type is not None and n == 1:
            report.add(f"{ds}.type={a.dynamic_sampling.type} keeps only prompt groups whose rewards differ, and a "
                       "group of generator.n_samples_per_prompt=1 never does. Fix: generator.n_samples_per_prompt=8 "
                       f"(or more than 1), or {ds}.type=null.")
        buf, max_len = a.overlong_buffer_len, self.generator.sampling_params.max_generate_length
        if buf is not None and not 1 <= buf <= max_len:
            report.add(f"trainer.algorithm.overlong_buffer_len={show(buf)} must be null (off) or a whole number of "
                       f"tokens from 1 to generator.sampling_params.max_generate_length={max_len}: responses longer "
                       "than max_generate_length - overlong_buffer_len lose reward. "
                       f"Fix: e.g. trainer.algorithm.overlong_buffer_len={max(1, max_len // 4)}.")


def _device_kind(name: str, kind) -> str:
    """`trainer.device`'s kind, or "auto" for a name the trainer section's own check refuses."""
    try:
        return kind(name)
    except ValueError:
        return "auto"


# --------------------------------------------------------------------------- the schema as data


@functools.lru_cache(maxsize=1)
def base_config() -> DictConfig:
    """Every key with its default, typed (``RidgelineConfig``), read-only."""
    cfg = OmegaConf.structured(RidgelineConfig)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def leaf_fields(cls: type = RidgelineConfig, prefix: str = "") -> Iterator[tuple[str, type, dataclasses.Field]]:
    """(dotted key, owning section, field) for every key that holds a value (free-form maps included)."""
    for f in section_fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        sub = section_type(field_type(cls, f.name))
        if sub is not None:
            yield from leaf_fields(sub, key)
        else:
            yield key, cls, f


@functools.lru_cache(maxsize=1)
def all_keys() -> tuple[str, ...]:
    """Every key of the schema, sections included."""
    keys: list[str] = []

    def rec(cls: type, prefix: str) -> None:
        for f in section_fields(cls):
            key = f"{prefix}.{f.name}" if prefix else f.name
            keys.append(key)
            sub = section_type(field_type(cls, f.name))
            if sub is not None:
                rec(sub, key)

    rec(RidgelineConfig, "")
    return tuple(keys)


@functools.lru_cache(maxsize=1)
def free_form_keys() -> tuple[str, ...]:
    """The maps whose keys are the user's (engine kwargs, per-env settings, data.prepare, ...)."""
    return tuple(key for key, cls, f in leaf_fields() if is_free_form(field_type(cls, f.name)))


def default_of(key: str) -> Any:
    """The default of ``key`` as the schema writes it (an interpolation stays a string)."""
    node: Any = base_config()
    for part in key.split("."):
        node = node._get_node(part)
    return OmegaConf.to_container(node, resolve=False) if OmegaConf.is_config(node) else node._value()
