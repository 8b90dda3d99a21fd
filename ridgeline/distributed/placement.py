"""Where every worker of a multi-process run goes: a pure plan from `trainer.placement.*` and
`generator.num_inference_engines`, turned into Ray placement groups by `ridgeline.distributed.ray_runtime`.

The keys are SkyRL's and mean the same thing:

- `<role>_num_nodes x <role>_num_gpus_per_node` ranks for role policy, ref and critic (the
  data-parallel FSDP ranks of that model). On a machine with no GPU the same keys count CPU
  worker processes, one bundle of one CPU each.
- `generator.num_inference_engines` engines of tensor x pipeline x data parallel devices each
  (`generator.inference_engine_{tensor,pipeline,data}_parallel_size`, SkyRL's count;
  `ridgeline.inference.parallelism`): each data-parallel rank is an engine process of tensor x
  pipeline devices. The embedded hf engine computes on the first device of its block.
- `colocate_all`: policy, ref, critic and the engines share ONE pool of bundles (each bundle =
  one device holds a policy rank, a ref rank, a critic rank and an engine's shard, which take
  turns: engines sleep while the trainer trains). It needs every role to have the policy's
  number of ranks and `num_inference_engines x devices per engine` = the policy's ranks.
- `colocate_policy_ref` (without colocate_all): policy and ref share a pool; ref must have the
  policy's number of ranks. Engines get their own pool.
- Otherwise every role gets its own pool.

An actor alone on a bundle takes all of it (1 GPU, or 1 CPU); actors sharing a bundle each ask
for `COLOCATED_SHARE` of it (Ray only needs the shares to fit, it does not meter them), so up to
four roles fit on one device, as in SkyRL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ridgeline.errors import UserError
from ridgeline.inference.parallelism import EngineParallelism

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema.trainer import PlacementConfig

COLOCATED_SHARE = 0.2
ROLES = ("policy", "ref", "critic")


class PlacementConfigError(UserError, ValueError):
    """The placement keys contradict each other; the message names the keys and the fix."""


@dataclass(frozen=True)
class Pool:
    """One placement group: `bundles` bundles of one device, shared by `roles`."""

    name: str
    roles: tuple[str, ...]
    bundles: int
    num_nodes: int

    @property
    def colocated(self) -> bool:
        return len(self.roles) > 1


@dataclass(frozen=True)
class PlacementPlan:
    device: str                          # "GPU" or "CPU": what one bundle holds
    ranks: dict[str, int]                # role -> data-parallel ranks (policy, and ref/critic when used)
    num_engines: int                     # engine processes: num_inference_engines x data-parallel replicas
    engine_devices: int                  # devices per engine process (tensor x pipeline parallel)
    pools: tuple[Pool, ...] = field(default_factory=tuple)

    def pool_of(self, role: str) -> Pool:
        for pool in self.pools:
            if role in pool.roles:
                return pool
        raise KeyError(role)

    def actor_share(self, role: str) -> float:
        """The fraction of one bundle's device an actor of `role` asks for."""
        return COLOCATED_SHARE if self.pool_of(role).colocated else 1.0

    def actor_resources(self, role: str) -> dict[str, float]:
        """What an actor of `role` asks of its bundle: its share of the bundle's GPU (Ray then
        sets CUDA_VISIBLE_DEVICES to that GPU, which the actor sees as cuda:0) and of its CPU."""
        share = self.actor_share(role)
        return {"num_gpus": share, "num_cpus": share} if self.device == "GPU" else {"num_cpus": share}

    @property
    def total_bundles(self) -> int:
        return sum(p.bundles for p in self.pools)

    def describe(self) -> str:
        unit = "GPU" if self.device == "GPU" else "CPU worker"
        parts = [f"{p.name}: {p.bundles} x {unit} on {p.num_nodes} node(s) for {'+'.join(p.roles)}"
                 for p in self.pools]
        return "; ".join(parts)


def plan_placement(placement: PlacementConfig, *, num_engines: int, engine: EngineParallelism, use_ref: bool, use_critic: bool,
                   device: str, remote_engines: bool = False) -> PlacementPlan:
    """The pools of a run. `placement` is the `trainer.placement` section; `num_engines` and
    `engine` the `generator.num_inference_engines` engines and how each spreads over devices;
    `device` "GPU" or "CPU"; `remote_engines`: the engines are servers elsewhere
    (`generator.run_engines_locally=false`), so none is placed. Raises PlacementConfigError naming
    the keys when colocation asks for counts that do not match."""
    p = placement
    wanted = {"policy": True, "ref": use_ref, "critic": use_critic}
    sizes = {"policy": (p.policy_num_nodes, p.policy_num_gpus_per_node), "ref": (p.ref_num_nodes, p.ref_num_gpus_per_node),
             "critic": (p.critic_num_nodes, p.critic_num_gpus_per_node)}
    nodes = {r: int(sizes[r][0]) for r in ROLES if wanted[r]}
    per_node = {r: int(sizes[r][1]) for r in ROLES if wanted[r]}
    for role in nodes:
        if nodes[role] < 1 or per_node[role] < 1:
            raise PlacementConfigError(
                f"trainer.placement.{role}_num_nodes={nodes[role]} x {role}_num_gpus_per_node="
                f"{per_node[role]}: each must be at least 1. Fix: e.g. trainer.placement.{role}_num_nodes=1 "
                f"trainer.placement.{role}_num_gpus_per_node=2")
    ranks = {r: nodes[r] * per_node[r] for r in nodes}
    if remote_engines:
        if p.colocate_all:
            raise PlacementConfigError(
                "trainer.placement.colocate_all=true shares the policy's devices with the engines, but "
                "generator.run_engines_locally=false makes them remote servers. Fix: "
                "trainer.placement.colocate_all=false")
        num_engines = 0
    elif num_engines < 1:
        raise PlacementConfigError(f"generator.num_inference_engines={num_engines} must be at least 1")
    engine_devices = num_engines * engine.devices
    pools: list[Pool] = []
    if p.colocate_all and device == "GPU" and engine.replica_devices > 1:
        # Colocated engines get their weights from the policy rank on their GPU by CUDA IPC (a handle
        # opens only on its own GPU), and Ray shows an actor sharing a bundle that bundle's GPU alone:
        # an engine of several GPUs would need one handoff per shard from several ranks. Not built.
        raise PlacementConfigError(
            f"trainer.placement.colocate_all=true on GPUs pairs each engine with one policy rank's GPU (its "
            f"weights arrive over CUDA IPC from that rank), but each engine here takes {engine.replica_devices} "
            f"GPUs ({_per_engine(engine, data=False)}): colocated engines of several GPUs are not built. Fix: "
            f"generator.inference_engine_tensor_parallel_size=1 generator.inference_engine_pipeline_parallel_size=1 "
            f"with num_inference_engines x inference_engine_data_parallel_size = {ranks['policy']} (the policy's "
            "GPUs), or trainer.placement.colocate_all=false (engines of any size on GPUs of their own)")
    if p.colocate_all:
        for role in ranks:
            if ranks[role] != ranks["policy"]:
                raise PlacementConfigError(
                    f"trainer.placement.colocate_all=true puts every role on the policy's devices, but "
                    f"{role} has {ranks[role]} ranks ({role}_num_nodes x {role}_num_gpus_per_node) and "
                    f"policy {ranks['policy']}. Fix: give trainer.placement.{role}_* the policy's values, "
                    "or trainer.placement.colocate_all=false")
        if engine_devices != ranks["policy"]:
            fix = (f"generator.num_inference_engines={ranks['policy'] // engine.devices}"
                   if ranks["policy"] % engine.devices == 0 else
                   f"engines whose devices (the product above) divide {ranks['policy']}")
            raise PlacementConfigError(
                f"trainer.placement.colocate_all=true shares the policy's {ranks['policy']} devices with the "
                f"engines, but generator.num_inference_engines={num_engines} x {engine.devices} device(s) per "
                f"engine ({_per_engine(engine)}) = {engine_devices}. Fix: {fix}, or "
                "trainer.placement.colocate_all=false")
        pools.append(Pool("colocated", tuple(ranks) + ("engine",), ranks["policy"], nodes["policy"]))
    else:
        if p.colocate_policy_ref and "ref" in ranks:
            if ranks["ref"] != ranks["policy"]:
                raise PlacementConfigError(
                    f"trainer.placement.colocate_policy_ref=true puts the reference on the policy's devices, "
                    f"but ref has {ranks['ref']} ranks and policy {ranks['policy']}. Fix: "
                    f"trainer.placement.ref_num_nodes={nodes['policy']} trainer.placement.ref_num_gpus_per_node="
                    f"{per_node['policy']}, or trainer.placement.colocate_policy_ref=false")
            pools.append(Pool("policy_ref", ("policy", "ref"), ranks["policy"], nodes["policy"]))
        else:
            pools.append(Pool("policy", ("policy",), ranks["policy"], nodes["policy"]))
            if "ref" in ranks:
                pools.append(Pool("ref", ("ref",), ranks["ref"], nodes["ref"]))
        if "critic" in ranks:
            pools.append(Pool("critic", ("critic",), ranks["critic"], nodes["critic"]))
        if num_engines:
            pools.append(Pool("engines", ("engine",), engine_devices, 1))
    return PlacementPlan(device=device, ranks=ranks, num_engines=num_engines * engine.data,
                         engine_devices=engine.replica_devices, pools=tuple(pools))


def _per_engine(engine: EngineParallelism, data: bool = True) -> str:
    """The keys one engine's device count comes from, with their values (the sizes above 1);
    `data=False`: one engine process's (tensor x pipeline)."""
    sizes = (("tensor", engine.tensor), ("pipeline", engine.pipeline)) + ((("data", engine.data),) if data else ())
    return " x ".join(f"inference_engine_{name}_parallel_size={size}" for name, size in sizes
                      if size != 1 or name == "tensor")


def bundle_index(plan: PlacementPlan, role: str, index: int) -> int:
    """The bundle of the `index`-th actor of `role` in its pool: ranks take bundles in order; an
    engine process takes the first bundle of its block of tensor x pipeline devices."""
    pool = plan.pool_of(role)
    slot = index * plan.engine_devices if role == "engine" else index
    if slot >= pool.bundles:
        raise ValueError(f"{role} {index} does not fit in pool {pool.name} of {pool.bundles} bundles")
    return slot
