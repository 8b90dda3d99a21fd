"""A Ray cluster of two nodes on this machine (`ray.cluster_utils.Cluster`: a head and a second
node that joins it, one logical CPU each), and runs that lose an engine, a training rank, a node,
an actor's answer or their driver (docs/distributed.md, "Faults"). Behind the `cluster` marker
(`make test-cluster`): every test starts Ray processes and most train the tiny preset.

The training runs are the tiny preset's GRPO with a KL loss, colocated: 2 policy ranks, 2
reference ranks and 2 engines sharing 2 one-CPU bundles; with `policy_num_nodes=2` Ray must put
one bundle on each node, so every role spans both nodes and the weight sync crosses them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray

from ridgeline.config import load_config
from ridgeline.distributed.ray_calls import Actor, ActorCalls, Call, LostWorkerError
from ridgeline.distributed.ray_runtime import LOCAL_RAY_ENV

pytestmark = [pytest.mark.cluster, pytest.mark.needs_memory_gib(6)]

REPO = Path(__file__).resolve().parents[1]
TINY = ["+experiment=tiny", "data.prepare.num_train=48", "trainer.logger=jsonl", "trainer.ckpt_interval=1",
        "trainer.policy.optimizer_config.scheduler=linear", "trainer.strategy=fsdp2",
        "trainer.placement.ref_num_gpus_per_node=1", "generator.num_inference_engines=2"]
ONE_NODE = ["trainer.placement.policy_num_nodes=1", "trainer.placement.policy_num_gpus_per_node=2",
            "trainer.placement.ref_num_nodes=1", "trainer.placement.ref_num_gpus_per_node=2"]
TWO_NODES = ["trainer.placement.policy_num_nodes=2", "trainer.placement.policy_num_gpus_per_node=1",
             "trainer.placement.ref_num_nodes=2", "trainer.placement.ref_num_gpus_per_node=1"]
RESUME = ["trainer.resume_mode=latest"]  # the tiny preset starts over by default
MARK = "RIDGELINE_CLUSTER_TEST"  # names this test's cluster in its processes' environment
COMPARED = ("reward/avg_raw_reward", "policy/policy_loss", "policy/final_loss", "policy/policy_kl",
            "policy/raw_grad_norm", "policy/policy_entropy", "policy/rollout_train_prob_diff_mean",
            "generate/avg_num_tokens", "policy/policy_lr", "weight_sync/probe_abs_diff")


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: r[k] for k in ("step", *COMPARED)} for r in rows if "policy/policy_loss" in r]


def _stop_ray() -> None:
    if ray.is_initialized():
        ray.shutdown()


# ------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def one_node_run(tmp_path_factory):
    """The reference: the same ranks and engines on one node (a private local Ray instance)."""
    from ridgeline.entrypoints.run import run_training
    out = tmp_path_factory.mktemp("one_node")
    _stop_ray()
    address = os.environ.pop("RAY_ADDRESS", None)  # the cluster's, when it is up already
    try:
        run_training(load_config(TINY + ONE_NODE + [f"trainer.export_path={out}"]))
    finally:
        _stop_ray()
        if address is not None:
            os.environ["RAY_ADDRESS"] = address
    return _rows(out / "tiny")


@pytest.fixture(scope="module")
def cluster():
    """A head node and a second node that joins it, one logical CPU each; this process joins as a
    driver. Node deaths are noticed within ~2 s (health checks every 0.5 s, 3 misses)."""
    from ray.cluster_utils import Cluster

    _stop_ray()
    with pytest.MonkeyPatch.context() as patch:
        for key, value in LOCAL_RAY_ENV.items():  # what a private instance gets (no token, no usage stats)
            if key not in os.environ:
                patch.setenv(key, value)
        # every process of this cluster inherits it: the fault tests touch only those (other Ray
        # instances may run on this machine)
        patch.setenv(MARK, f"{os.getpid()}-{time.time_ns()}")
        # Cluster records its head in /tmp/ray/ray_current_cluster, where every bare ray.init() on
        # this machine would find and join it (other users' runs included), and deletes the file
        # on shutdown (anyone's): this cluster is reached by its address only
        patch.setattr(ray._private.utils, "write_ray_address", lambda *args, **kwargs: None)
        patch.setattr(ray._common.utils, "reset_ray_address", lambda *args, **kwargs: None)
        c = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "include_dashboard": False,
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3}})
        try:
            c.worker = c.add_node(num_cpus=1)
            c.wait_for_nodes()
            patch.setenv("RAY_ADDRESS", c.address)
            ray.init(address=c.address)
            yield c
        finally:
            _stop_ray()
            c.shutdown()


@pytest.fixture(scope="module")
def two_node_run(cluster, tmp_path_factory):
    """Three steps of the same run on the two nodes, checkpointing each step; (rows, run folder, log)."""
    from ridgeline.entrypoints.run import run_training
    out = tmp_path_factory.mktemp("two_nodes")
    records: list[str] = []
    handler, logger = _Collect(records), logging.getLogger("ridgeline")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # under pytest the root logger stays at WARNING
    try:
        run_training(load_config(TINY + TWO_NODES + [f"trainer.export_path={out}"]))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return _rows(out / "tiny"), out / "tiny", records


class _Collect(logging.Handler):
    """Keeps the messages of Ridgeline's loggers (the run's own logging setup replaces the root's handlers)."""

    def __init__(self, records: list[str]):
        super().__init__()
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


# ------------------------------------------------------------------------- bounded calls
class _Actor:
    def echo(self, x):
        return x

    def hang(self):
        threading.Event().wait()

    def die(self):
        os._exit(1)

    def fail(self):
        raise ValueError("the method's own error")


def test_bounded_calls_name_the_actor_that_hangs_dies_or_fails(cluster):
    if not ray.is_initialized():
        ray.init(address=cluster.address)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import tests/
    calls = ActorCalls(ray, timeout_s=3)
    a, b, c = (ray.remote(_Actor).options(num_cpus=0).remote() for _ in range(3))  # b will hang
    try:
        node_id, ip = ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
        first, second = Actor("a", node_id, ip), Actor("b", node_id, ip)
        started = ActorCalls(ray, timeout_s=300)  # the actors' processes start (slow on a loaded machine)
        assert started.get([Call(first, "echo", a.echo.remote(1)), Call(second, "echo", b.echo.remote(2)),
                            Call(second, "echo", c.echo.remote(3))]) == [1, 2, 3]
        with pytest.raises(LostWorkerError, match=rf"^b on node {node_id[:8]} \({ip}\) \(hang\): no answer "
                                                  r"within 3 s \(trainer.placement.actor_call_timeout_s\)"):
            calls.get([Call(first, "echo", a.echo.remote(1)), Call(second, "hang", b.hang.remote())])
        with pytest.raises(ValueError, match="the method's own error"):
            calls.get([Call(first, "fail", a.fail.remote())])
        # a peer's death is the cause, whichever of the two calls comes back first
        with pytest.raises(LostWorkerError, match=rf"^b on node \w+ \({ip}\): the actor's process died .* "
                                                  r"in die \(ActorDiedError\)"):
            calls.get([Call(first, "fail", a.fail.remote()), Call(second, "die", c.die.remote())])
    finally:
        for actor in (a, b, c):
            ray.kill(actor)


# --------------------------------------------------------------------------- two nodes
def test_two_nodes_place_one_rank_of_each_role_on_each_node_and_train_exactly_as_one(two_node_run, one_node_run):
    rows, _, records = two_node_run
    [nodes] = [r for r in records if r.startswith("Ray actors' nodes: ")]
    placed = dict(part.split(" on node ", 1) for part in nodes.removeprefix("Ray actors' nodes: ").split("; "))
    for role in ("policy rank", "ref rank", "engine"):
        assert placed[f"{role} 0"] != placed[f"{role} 1"], nodes  # one on each node
    assert len(rows) == len(one_node_run) == 3
    assert rows == one_node_run  # every compared number, bit for bit


# -------------------------------------------------------------------------------- faults
def _kill_when(title: str, after: Path, sig: int = signal.SIGKILL) -> threading.Thread:
    """A thread that, once `after` exists, sends `sig` to the first process of this test's cluster
    whose title is `title` (Ray names a worker process `ray::<Class>.<method>` while it runs that
    method)."""
    mark = f"{MARK}={os.environ[MARK]}".encode()

    def watch():
        while not after.exists():
            time.sleep(0.05)
        while True:
            for proc in Path("/proc").iterdir():
                try:
                    if (proc.name.isdigit() and (proc / "cmdline").read_bytes().startswith(title.encode())
                            and mark in (proc / "environ").read_bytes().split(b"\0")):
                        os.kill(int(proc.name), sig)
                        return
                except OSError:
                    continue
            time.sleep(0.02)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("title, lost", [("ray::EngineRank.generate", r"engine \d on node \w+ \([\d.]+\)"),
                                         ("ray::TrainingRank.train", r"(policy|ref) rank \d on node \w+ \([\d.]+\)")])
def test_a_killed_actor_stops_the_run_naming_it_and_the_same_command_resumes_exactly(
        title, lost, two_node_run, tmp_path):
    from ridgeline.entrypoints.run import run_training
    expected, _, _ = two_node_run
    args = TINY + TWO_NODES + [f"trainer.export_path={tmp_path}"]
    run_dir = tmp_path / "tiny"
    watcher = _kill_when(title, run_dir / "ckpts" / "global_step_1")
    with pytest.raises(LostWorkerError, match=lost + r" during step 2: the actor's process died .*"
                       r"The newest checkpoint is .*global_step_1: rerun the command with "
                       r"trainer.resume_mode=latest to resume from it"):
        run_training(load_config(args))
    watcher.join(timeout=1)
    assert _rows(run_dir) == expected[:1]
    run_training(load_config(args + RESUME))
    assert _rows(run_dir) == expected


def test_a_hanging_engine_stops_the_run_within_the_bound(two_node_run, tmp_path):
    """SIGSTOP an engine mid-generation: its call does not come back; the run stops after
    trainer.placement.actor_call_timeout_s naming it, and the stopped actor is killed on the way out."""
    from ridgeline.entrypoints.run import run_training
    expected, _, _ = two_node_run
    args = TINY + TWO_NODES + [f"trainer.export_path={tmp_path}"]
    run_dir = tmp_path / "tiny"
    watcher = _kill_when("ray::EngineRank.generate", run_dir / "ckpts" / "global_step_1", signal.SIGSTOP)
    with pytest.raises(LostWorkerError, match=r"engine \d on node .* \(generate\) during step 2: no answer within "
                                              r"60 s \(trainer.placement.actor_call_timeout_s\)"):
        run_training(load_config(args + ["trainer.placement.actor_call_timeout_s=60"]))
    watcher.join(timeout=1)
    run_training(load_config(args + RESUME))
    assert _rows(run_dir) == expected


def test_a_lost_node_stops_the_run_and_resumes_once_a_node_joins_again(cluster, two_node_run, tmp_path):
    """The second node's raylet and workers are killed mid-step 2; its actors' calls fail, the run
    stops naming one of them; a node joins again and the same command resumes exactly."""
    from ridgeline.entrypoints.run import run_training
    expected, _, _ = two_node_run
    args = TINY + TWO_NODES + [f"trainer.export_path={tmp_path}"]
    run_dir = tmp_path / "tiny"
    marker = run_dir / "ckpts" / "global_step_1"

    def remove_node():
        while not marker.exists():
            time.sleep(0.05)
        cluster.remove_node(cluster.worker, allow_graceful=False)
    thread = threading.Thread(target=remove_node, daemon=True)
    thread.start()
    lost = cluster.worker.node_id[:8]
    with pytest.raises(LostWorkerError, match=rf"(rank|engine) \d on node {lost} \([\d.]+\) during step 2: its node "
                                              rf"{lost} \([\d.]+\) died or left the cluster in \w+ \(\w+\). "
                                              r"The newest checkpoint is .*global_step_1"):
        run_training(load_config(args))
    thread.join(timeout=60)
    cluster.worker = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    run_training(load_config(args + RESUME))
    assert _rows(run_dir) == expected


def test_a_killed_driver_leaves_no_actors_or_placement_groups_behind(cluster, two_node_run, tmp_path):
    """kill -9 of `ridgeline train` once its actors are up: Ray ends the driver's job, its actors and
    its placement groups; the next run's pools (the whole cluster) are reserved at once."""
    from ridgeline.distributed.placement import PlacementPlan, Pool
    from ridgeline.distributed.ray_runtime import reserve_pools
    from ray.util.placement_group import remove_placement_group

    log = tmp_path / "driver.log"
    command = [sys.executable, "-m", "ridgeline.cli", "train", *TINY, *TWO_NODES, f"trainer.export_path={tmp_path}"]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "RAY_ADDRESS": cluster.address})
    try:
        while "Ray workers up" not in log.read_text():  # the driver's actors and groups exist
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    pools = (Pool("policy", ("policy",), 2, 1),)
    groups = reserve_pools(PlacementPlan(device="CPU", ranks={"policy": 2}, num_engines=0, engine_devices=1,
                                         pools=pools), timeout_s=60)
    assert all(g.bundle_count == 2 for g in groups.values())
    for g in groups.values():
        remove_placement_group(g)


def _marked_processes(mark: bytes) -> list[int]:
    """The processes whose environment holds `mark` (NAME=value)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and mark in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def test_a_killed_driver_of_a_private_ray_instance_takes_every_ray_process_along(tmp_path):
    """Without RAY_ADDRESS the run starts its own Ray instance: kill -9 of `ridgeline train` once
    its actors are up leaves no Ray process of it behind (Ray's head processes share the driver's fate)."""
    value = f"private-{os.getpid()}-{time.time_ns()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", MARK: value}
    env.pop("RAY_ADDRESS", None)
    log = tmp_path / "driver.log"
    command = [sys.executable, "-m", "ridgeline.cli", "train", *TINY, *ONE_NODE, f"trainer.export_path={tmp_path}"]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        while "Ray workers up" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        mark = f"{MARK}={value}".encode()
        assert len(_marked_processes(mark)) > 3  # the driver, Ray's head processes, the actors
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 120  # a hang guard: they go within seconds
    while (left := _marked_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    titles = []
    for pid in left:  # this test's own leftovers (the mark is its own): reported, then ended
        with contextlib.suppress(OSError):
            titles.append(Path(f"/proc/{pid}/cmdline").read_bytes()[:60])
            os.kill(pid, signal.SIGKILL)
    assert left == [], titles
