"""A Ray worker killed for memory, as one message: which role, how full the node was, what the run
needs (`training.memory_estimate`) and which keys to shrink, instead of Ray's OOM report (the node's
top memory users, Ray's kill policy) and its traceback.

Ray's memory monitor kills a worker once the node passes `RAY_memory_usage_threshold` (0.95); the
driver's `ray.get` then raises `ray.exceptions.OutOfMemoryError`, or an actor error whose text carries
the raylet's report: `Memory on the node (IP: ..., ID: ...) was 22.80GB used / 24.00GB limit (0.95)`
(Ray 2.5x; older releases: `... where the task (...) was running was 22.80GB / 24.00GB (0.95)`) and
`task name=TrainingRank.train` / `name=EngineRank.__init__`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ridgeline.errors import UserError, exception_chain

_NODE = re.compile(r"Memory on the node \([^)]*\)(?: where the .*? was running)? was ([\d.]+)\s*GB(?: used)? / "
                   r"([\d.]+)\s*GB", re.S)
_TASK = re.compile(r"name=([A-Za-z_]\w*)")
_OOM_TEXT = ("killed due to memory pressure (OOM)", "running low on memory", "OutOfMemoryError")
ROLES = {"TrainingRank": "a training rank (policy, reference or critic: TrainingRank)",
         "EngineRank": "an inference engine (EngineRank)"}
RAY_FIX = ("fewer ranks on this machine (trainer.placement.policy_num_gpus_per_node, "
           "generator.num_inference_engines)")


class RayMemoryError(UserError):
    """Ray killed one of the run's workers because the node ran out of memory."""


@dataclass(frozen=True)
class MemoryKill:
    """What Ray's report says of a worker it killed for memory."""

    role: str                 # the actor class, e.g. TrainingRank; "" when the report does not name it
    used_gb: float | None     # the node's memory in use when it killed, GB
    limit_gb: float | None


def memory_kill(exc: BaseException) -> MemoryKill | None:
    """The `MemoryKill` in `exc` (or an exception it came from) when Ray killed a worker for memory."""
    from ray.exceptions import OutOfMemoryError

    for error in exception_chain(exc):
        text = str(error)
        if isinstance(error, OutOfMemoryError) or any(marker in text for marker in _OOM_TEXT):
            node, task = _NODE.search(text), _TASK.search(text)
            return MemoryKill(role=task.group(1) if task else "",
                              used_gb=float(node.group(1)) if node else None,
                              limit_gb=float(node.group(2)) if node else None)
    return None


def memory_kill_message(kill: MemoryKill, need: str | None) -> str:
    """One message: who was killed, how full the node was, the estimate `need` (None: not known),
    and the keys to shrink."""
    from ridgeline.training.memory_estimate import PEAK_FIX

    who = ROLES.get(kill.role, f"a worker ({kill.role})" if kill.role else "a worker")
    node = (f": the node had {kill.used_gb:.1f} of {kill.limit_gb:.1f} GB in use" if kill.used_gb is not None
            and kill.limit_gb is not None else "")
    return (f"Ray's memory monitor killed {who} because the node ran out of memory{node}. "
            + (f"{need}. " if need else "")
            + f"Fix: {PEAK_FIX}; or {RAY_FIX}; or a smaller model (trainer.policy.model.path)")
