"""How one inference engine spreads over devices: SkyRL 0.3.1's
`generator.inference_engine_{tensor,pipeline,data,expert}_parallel_size`, read once for the engine
mappings (`vllm_engine_kwargs`, `sglang_engine_kwargs`), the placement plan and validation.

Devices: an engine takes tensor x pipeline x data devices, SkyRL's count for its placement groups
and colocation check (expert parallelism reuses those devices).

Data parallelism: each data-parallel rank is an engine process of its own (a replica of tensor x
pipeline devices) and the requests are split over all replicas. SkyRL does the same (one engine
actor per data-parallel rank, its client spreads requests over every actor) but also joins the
ranks into vLLM's data-parallel group, which matters only for expert parallelism; Ridgeline's vLLM
engine is the offline `vllm.LLM`, which refuses `data_parallel_size > 1` in one process (vLLM since
vllm-project/vllm#27282, late 2025), so no engine is given a data-parallel size and expert
parallelism over data-parallel ranks is refused by validation.

Expert parallelism: SkyRL requires ep = dp x tp; with dp = 1 that is ep = tp, the MoE experts
sharded over the tensor-parallel ranks (vLLM's `enable_expert_parallel`, SGLang's `ep_size`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import dataclass

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema import GeneratorConfig



@dataclass(frozen=True)
class EngineParallelism:
    """One engine's parallel sizes (each at least 1)."""

    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    expert: int = 1

    @classmethod
    def from_config(cls, generator: GeneratorConfig) -> "EngineParallelism":
        """From the `generator` section."""
        g = generator
        return cls(tensor=int(g.inference_engine_tensor_parallel_size),
                   pipeline=int(g.inference_engine_pipeline_parallel_size),
                   data=int(g.inference_engine_data_parallel_size),
                   expert=int(g.inference_engine_expert_parallel_size))

    @property
    def replica_devices(self) -> int:
        """Devices of one engine process (one data-parallel rank): tensor x pipeline."""
        return self.tensor * self.pipeline

    @property
    def devices(self) -> int:
        """Devices of one engine, all its data-parallel replicas: tensor x pipeline x data (SkyRL's count)."""
        return self.replica_devices * self.data
