"""Every wait of the driver (and of an actor) on Ray actors, bounded, with what was lost named.

A Ray `get` without a timeout waits forever on an actor that hangs (a stuck collective, a stopped
process); a dead actor or node surfaces as one of Ray's own exceptions with a traceback of Ray's
internals. `ActorCalls.get` waits on a set of labelled calls as they finish, so the first lost
actor is reported at once (its peers may be stuck in a collective with it), and raises
`LostWorkerError` naming the actor, its node and what it was doing; the trainer adds the step and
how to resume (`Trainer.train`). Errors an actor's own code raises pass through unchanged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ridgeline.errors import UserError

# after a call failed with an error of its own, how long the others get to show whether an actor
# died (a rank whose peer was killed fails its collective with "connection closed" before Ray
# reports the peer's death, which takes seconds on a loaded machine); the wait ends at the first
DEATH_GRACE_S = 30.0


class LostWorkerError(UserError, RuntimeError):
    """A Ray actor (training rank or engine) died, lost its node, or did not answer within
    `trainer.placement.actor_call_timeout_s`. `step` and `resume` are filled in by the trainer."""

    headline = "a worker of the run was lost"

    def __init__(self, what: str, cause: str):
        self.what, self.cause = what, cause
        self.step: int | None = None
        self.resume: str | None = None
        super().__init__(self._text())

    def at_step(self, step: int, resume: str) -> "LostWorkerError":
        """The step in progress (0: while starting) and how to continue."""
        self.step, self.resume = step, resume
        self.args = (self._text(),)
        return self

    def _text(self) -> str:
        where = "" if self.step is None else (" while starting" if self.step == 0 else f" during step {self.step}")
        return f"{self.what}{where}: {self.cause}" + (f". {self.resume}" if self.resume else "")


@dataclass(frozen=True)
class Actor:
    """An actor as messages name it: "engine 1 on node 3f2a9c01 (10.0.0.2)". Several nodes of one
    machine share an address; the node's id tells them apart (and says whether it is still up)."""
    name: str
    node_id: str = ""
    ip: str = ""

    def __str__(self) -> str:
        return f"{self.name} on node {self.node_id[:8]} ({self.ip})" if self.node_id else self.name


@dataclass(frozen=True)
class Call:
    """One remote call: the `actor` asked, the `method` it runs, `ref` the result's ObjectRef."""
    actor: Actor
    method: str
    ref: Any


def this_node() -> tuple[str, str]:
    """(node id, ip address) of the calling process's Ray node."""
    import ray

    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


def lost_cause(ray, err: BaseException, actor: Actor) -> str | None:
    """Why a call's actor is gone, or None when `err` is the actor's own error (it ran and raised)."""
    ex = ray.exceptions
    if isinstance(err, ex.RayTaskError):  # the method raised: not a lost worker
        return None
    if not isinstance(err, (ex.RayActorError, ex.NodeDiedError, ex.WorkerCrashedError, ex.ObjectLostError)):
        return None
    if isinstance(err, ex.NodeDiedError) or not _node_alive(ray, actor.node_id):
        return f"its node {actor.node_id[:8]} ({actor.ip}) died or left the cluster"
    return "the actor's process died (killed, crashed or out of memory)"


def _node_alive(ray, node_id: str) -> bool:
    """Whether the cluster still counts `node_id` as alive (True when unknown: no id, no answer)."""
    if not node_id:
        return True
    try:
        return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())
    except Exception:  # noqa: BLE001 - the GCS itself may be gone: say what the actor's error says
        return True


class ActorCalls:
    """Bounded waits on the run's actors: `timeout_s` for every call
    (`trainer.placement.actor_call_timeout_s`)."""

    def __init__(self, ray, timeout_s: float):
        self.ray, self.timeout_s = ray, float(timeout_s)

    def get(self, calls: list[Call]) -> list[Any]:
        """The calls' results in order, waiting on them as they finish: a lost actor raises
        `LostWorkerError` as soon as its call returns; so does a wait past `timeout_s`, naming the
        calls still running. An actor method's own exception is re-raised unchanged."""
        index = {c.ref: i for i, c in enumerate(calls)}
        results: list[Any] = [None] * len(calls)
        pending = [c.ref for c in calls]
        deadline = time.monotonic() + self.timeout_s
        while pending:
            left = deadline - time.monotonic()
            ready, pending = self.ray.wait(pending, num_returns=1, timeout=left) if left > 0 else ([], pending)
            if not ready:
                waiting = ", ".join(f"{calls[index[r]].actor} ({calls[index[r]].method})" for r in pending)
                raise LostWorkerError(waiting, f"no answer within {self.timeout_s:g} s "
                                      "(trainer.placement.actor_call_timeout_s): the actor hangs or is stuck in a "
                                      "collective with a lost peer")
            for ref in ready:
                try:
                    results[index[ref]] = self.ray.get(ref, timeout=max(deadline - time.monotonic(), 1.0))
                except Exception as err:  # noqa: BLE001 - sorted into lost / own below
                    raise self._failure(calls, index[ref], err, pending) from err
        return results

    def get_one(self, call: Call) -> Any:
        return self.get([call])[0]

    def _failure(self, calls: list[Call], failed: int, err: Exception, pending: list[Any]) -> Exception:
        """The error to raise for call `failed`: a lost actor's, or, when the call's own code raised,
        a lost peer's if one shows up within `DEATH_GRACE_S` (its death is the cause), else `err`."""
        ex = self.ray.exceptions
        if isinstance(err, ex.GetTimeoutError):
            call = calls[failed]
            return LostWorkerError(str(call.actor), f"its {call.method} result could not be fetched within "
                                   f"{self.timeout_s:g} s (trainer.placement.actor_call_timeout_s)")
        call = calls[failed]
        cause = lost_cause(self.ray, err, call.actor)
        if cause is not None:
            return LostWorkerError(str(call.actor), f"{cause} in {call.method} ({type(err).__name__})")
        index = {c.ref: i for i, c in enumerate(calls)}
        deadline = time.monotonic() + DEATH_GRACE_S
        while pending and time.monotonic() < deadline:
            ready, pending = self.ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            for ref in ready:
                try:
                    self.ray.get(ref, timeout=1.0)
                except Exception as other:  # noqa: BLE001
                    other_call = calls[index[ref]]
                    cause = lost_cause(self.ray, other, other_call.actor)
                    if cause is not None:
                        return LostWorkerError(str(other_call.actor),
                                               f"{cause} in {other_call.method} ({type(other).__name__})")
        return err
