"""Starting or joining Ray, and reserving the plan's placement groups with a clear error when the
cluster cannot hold them.

Ray is imported lazily: `trainer.strategy=single` never needs it (install the `ray` extra:
`pip install -e ".[ray]"`).

Local start vs. joining a cluster:
- `RAY_ADDRESS` unset: `ray.init(address="local")` starts a private instance on this machine (never
  the cluster a `ray start` left here, which a bare `ray.init()` would join) with as many
  logical CPUs as the plan needs (Ray's CPU counts are bookkeeping, not pinning; on a machine
  with fewer cores the workers share them) and the machine's GPUs. Before it starts, the
  settings in `LOCAL_RAY_ENV` are put in the environment unless already set: they keep the
  instance on 127.0.0.1 without token authentication or usage reporting (the raylet and workers
  inherit them from this process).
- `RAY_ADDRESS=host:6379` (or `auto`): join that cluster; its nodes were started with `ray start`,
  and whatever they need must be set there (see docs/distributed.md).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ridgeline.distributed.placement import PlacementPlan, Pool

log = logging.getLogger(__name__)

# What a private local instance needs on a machine like our CI (and what a laptop user wants):
# no cluster token (there is no cluster), no usage stats sent out, no multi-node mode.
LOCAL_RAY_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}


_started_locally = False  # this process started the running Ray instance (not RAY_ADDRESS)


class PlacementError(RuntimeError):
    """A placement group could not be reserved in time: names the pool, its roles and resources."""


def import_ray():
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("trainer.strategy=fsdp2 runs its workers as Ray actors, but Ray is not installed. "
                          "Fix: pip install -e \".[ray]\" (or pip install 'ray>=2.40'), or trainer.strategy=single"
                          ) from exc
    return ray


def init_ray(bundles: int, worker_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Start a local Ray instance for a plan of `bundles` bundles (each takes a CPU, and a GPU on a
    GPU plan: the instance gets this machine's GPUs), or join `RAY_ADDRESS`; a running instance in
    this process is reused (a local one we started is restarted when too small). Returns what was
    done, for the log. The plan's device comes after, from what the cluster has."""
    global _started_locally
    ray = import_ray()
    env_vars = dict(worker_env or {})
    num_cpus = max(os.cpu_count() or 1, bundles + 1)
    if ray.is_initialized():
        if not (_started_locally and num_cpus and ray.cluster_resources().get("CPU", 0) < num_cpus):
            return {"mode": "reused"}
        # our own instance from an earlier run in this process, too small for this plan: its
        # workers are gone (Trainer.close), so start a bigger one
        ray.shutdown()
    address = os.environ.get("RAY_ADDRESS")
    runtime_env = {"env_vars": env_vars} if env_vars else None
    if address:
        log.info("joining the Ray cluster at RAY_ADDRESS=%s", address)
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        _started_locally = False  # a cluster of its own: never restarted by this process
        return {"mode": "joined", "address": address}
    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)
    log.info("starting a local Ray instance (%d logical CPUs and this machine's GPUs) for %d bundle(s)", num_cpus,
             bundles)
    # address="local": a new instance even when this machine runs another one that `ray start` (or
    # a test cluster) recorded in /tmp/ray/ray_current_cluster, which a bare ray.init() would join
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, runtime_env=runtime_env,
             log_to_driver=True, configure_logging=False)
    _started_locally = True
    return {"mode": "local", "num_cpus": num_cpus}


def bundle_resources(plan: PlacementPlan) -> dict[str, float]:
    if plan.device == "GPU":
        return {"GPU": 1.0, "CPU": 1.0}
    return {"CPU": 1.0}


def reserve_pools(plan: PlacementPlan, timeout_s: float) -> dict[str, Any]:
    """One Ray placement group per pool (PACK: as few nodes as possible), waited for together.
    On timeout every group is removed and PlacementError names the pool that did not fit and
    what the cluster has free."""
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group

    groups = {pool.name: placement_group([bundle_resources(plan)] * pool.bundles, strategy="PACK",
                                         name=f"ridgeline_{pool.name}_{os.getpid()}")
              for pool in plan.pools}
    try:
        refs = {name: g.ready() for name, g in groups.items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        if len(ready) < len(refs):
            done = set(ready)
            name = next(n for n, ref in refs.items() if ref not in done)
            pool = next(p for p in plan.pools if p.name == name)
            raise PlacementError(_placement_message(plan, pool, timeout_s, ray))
    except BaseException:
        for g in groups.values():
            try:
                remove_placement_group(g)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        raise
    return groups


def _placement_message(plan: PlacementPlan, pool: Pool, timeout_s: float, ray) -> str:
    resource = "GPU" if plan.device == "GPU" else "CPU"
    try:
        free = ray.available_resources().get(resource, 0.0)
        total = ray.cluster_resources().get(resource, 0.0)
        have = f"the cluster has {free:g} of {total:g} {resource} free"
    except Exception:  # noqa: BLE001
        have = "the cluster's free resources could not be read"
    keys = ("generator.num_inference_engines x inference_engine_{tensor,pipeline,data}_parallel_size"
            if pool.roles == ("engine",)
            else " / ".join(f"trainer.placement.{r}_num_nodes x {r}_num_gpus_per_node" for r in pool.roles
                            if r != "engine"))
    return (f"could not place pool '{pool.name}' ({'+'.join(pool.roles)}): {pool.bundles} bundle(s) of 1 "
            f"{resource} within {timeout_s:g} s (trainer.placement.timeout_s); {have}. The counts come from "
            f"{keys}. Fix: lower those counts, add nodes to the cluster, or share devices with "
            "trainer.placement.colocate_all=true")
