"""trainer.strategy=fsdp2 on this CPU: FSDP2 ranks and hf engines as Ray actors (a local Ray
instance on 127.0.0.1), weight sync over gloo with the stale-weights probe, checkpoints and
resume through the ranks. Plus the pure parts: placement plans, rank shares, config checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray  # the ray extra is part of `make test`: a missing install fails here, it does not skip
import torch
from omegaconf import OmegaConf

from ridgeline.config import load_config
from ridgeline.config import ConfigError, base_config, config_problems
from ridgeline.distributed.placement import PlacementConfigError, bundle_index, plan_placement
from ridgeline.inference.parallelism import EngineParallelism
from ridgeline.models.tiny import build_char_tokenizer
from ridgeline.training.batch import rank_shares


# a decaying schedule: the ranks must get the run's length (its rates are compared with one process')
TINY = ["+experiment=tiny", "data.prepare.num_train=48", "trainer.logger=jsonl",
        "trainer.policy.optimizer_config.scheduler=linear"]
# two policy ranks (+ two reference ranks beside them) and one engine of its own
FSDP2 = ["trainer.strategy=fsdp2", "trainer.placement.colocate_all=false",
         "trainer.placement.policy_num_gpus_per_node=2", "trainer.placement.ref_num_gpus_per_node=2"]


ONE = EngineParallelism()  # one device per engine


def _placement(**kw):
    base = OmegaConf.to_container(base_config().trainer.placement)
    return OmegaConf.create({**base, **kw})


# ------------------------------------------------------------------------------------ pure parts
def test_colocate_all_puts_every_role_and_the_engines_in_one_pool():
    plan = plan_placement(_placement(policy_num_gpus_per_node=2, ref_num_gpus_per_node=2), num_engines=2,
                          engine=ONE, use_ref=True, use_critic=False, device="CPU")
    assert [(p.name, p.roles, p.bundles) for p in plan.pools] == [("colocated", ("policy", "ref", "engine"), 2)]
    assert plan.actor_share("policy") == plan.actor_share("engine") == 0.2
    assert [bundle_index(plan, "engine", i) for i in range(2)] == [0, 1]


def test_separate_pools_and_policy_ref_sharing():
    plan = plan_placement(_placement(colocate_all=False, policy_num_gpus_per_node=2, ref_num_gpus_per_node=2),
                          num_engines=3, engine=ONE, use_ref=True, use_critic=False, device="CPU")
    assert [(p.name, p.bundles) for p in plan.pools] == [("policy_ref", 2), ("engines", 3)]
    assert plan.actor_share("engine") == 1.0 and plan.total_bundles == 5
    plan = plan_placement(_placement(colocate_all=False, colocate_policy_ref=False, policy_num_nodes=2,
                                     policy_num_gpus_per_node=2, ref_num_gpus_per_node=1),
                          num_engines=1, engine=ONE, use_ref=True, use_critic=False, device="GPU")
    assert [(p.name, p.bundles, p.num_nodes) for p in plan.pools] == [("policy", 4, 2), ("ref", 1, 1), ("engines", 1, 1)]


def test_colocation_counts_engines_times_tensor_parallelism():
    """SkyRL's rule: num_inference_engines x inference_engine_tensor_parallel_size devices, here 2 x 4
    on 8 policy GPUs; each engine takes the first bundle of its block."""
    # (colocated engines of several devices run on CPU workers only: on GPUs they are refused, see
    # tests/test_gpu_path.py)
    plan = plan_placement(_placement(policy_num_gpus_per_node=8), num_engines=2, engine=EngineParallelism(tensor=4), use_ref=False,
                          use_critic=False, device="CPU")
    assert [(p.name, p.bundles) for p in plan.pools] == [("colocated", 8)]
    assert [bundle_index(plan, "engine", i) for i in range(2)] == [0, 4]
    # on GPUs an actor asks for its share of its bundle's GPU (Ray then shows it that one GPU)
    gpus = plan_placement(_placement(policy_num_gpus_per_node=8), num_engines=8, engine=ONE, use_ref=False,
                          use_critic=False, device="GPU")
    assert gpus.actor_resources("policy") == {"num_gpus": 0.2, "num_cpus": 0.2}
    cpu = plan_placement(_placement(colocate_all=False), num_engines=1, engine=ONE, use_ref=False,
                         use_critic=False, device="CPU")
    assert cpu.actor_resources("policy") == {"num_cpus": 1.0}
    assert load_config(["trainer.placement.policy_num_gpus_per_node=8", "trainer.placement.ref_num_gpus_per_node=8",
                        "generator.num_inference_engines=2"]).generator.inference_engine_tensor_parallel_size == 4


def test_an_engine_takes_tensor_x_pipeline_x_data_devices_one_process_per_data_parallel_rank():
    """SkyRL's count: 2 engines x (tensor 2 x pipeline 1 x data 2) = 8 devices; each of the 2 x 2
    engine processes (one per data-parallel rank) takes a block of tensor x pipeline = 2 bundles."""
    engine = EngineParallelism(tensor=2, pipeline=1, data=2)
    plan = plan_placement(_placement(policy_num_gpus_per_node=8), num_engines=2, engine=engine, use_ref=False,
                          use_critic=False, device="CPU")
    assert [(p.name, p.bundles) for p in plan.pools] == [("colocated", 8)]
    assert (plan.num_engines, plan.engine_devices) == (4, 2)
    assert [bundle_index(plan, "engine", i) for i in range(4)] == [0, 2, 4, 6]
    plan = plan_placement(_placement(colocate_all=False), num_engines=3, engine=EngineParallelism(tensor=1, pipeline=2),
                          use_ref=False, use_critic=False, device="GPU")
    assert plan.pool_of("engine").bundles == 6 and (plan.num_engines, plan.engine_devices) == (3, 2)
    with pytest.raises(PlacementConfigError, match=r"num_inference_engines=1 x 8 device\(s\) per engine "
                       r"\(inference_engine_tensor_parallel_size=2 x inference_engine_pipeline_parallel_size=2 x "
                       r"inference_engine_data_parallel_size=2\) = 8. Fix: generator.num_inference_engines=2"):
        plan_placement(_placement(policy_num_gpus_per_node=16), num_engines=1,
                       engine=EngineParallelism(tensor=2, pipeline=2, data=2), use_ref=False, use_critic=False,
                       device="CPU")


def test_the_config_check_counts_pipeline_and_data_parallel_devices():
    """2 engines x tensor 2 x data 2 on 8 colocated policy GPUs passes; pipeline 2 more does not."""
    eight = ["trainer.strategy=fsdp2", "generator.backend=vllm", "trainer.placement.policy_num_gpus_per_node=8",
             "trainer.placement.ref_num_gpus_per_node=8", "generator.num_inference_engines=2",
             "generator.inference_engine_tensor_parallel_size=2", "generator.inference_engine_data_parallel_size=2"]
    load_config(eight)
    with pytest.raises(ConfigError, match=r"generator.num_inference_engines=2 x 8 device\(s\) per engine"):
        load_config([*eight, "generator.inference_engine_pipeline_parallel_size=2"])


def test_colocation_with_unequal_counts_names_the_keys():
    with pytest.raises(PlacementConfigError, match=r"num_inference_engines=1 x 1 .* Fix: generator.num_inference_engines=4"):
        plan_placement(_placement(), num_engines=1, engine=ONE, use_ref=False, use_critic=False, device="CPU")
    with pytest.raises(PlacementConfigError, match="colocate_policy_ref=true .* ref has 4 ranks and policy 2"):
        plan_placement(_placement(colocate_all=False, policy_num_gpus_per_node=2), num_engines=1, engine=ONE,
                       use_ref=True, use_critic=False, device="CPU")


def test_rank_shares_give_each_rank_its_share_of_every_mini_batch():
    # 12 rows (a trajectory each), mini-batches of 4, 2 ranks: rank 0 holds the first half of each mini-batch
    shares = rank_shares(torch.arange(12), 4, 2)
    assert [s.rows.tolist() for s in shares] == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]]
    assert not any(bool(s.padding.any()) for s in shares)
    # a short last mini-batch of 3 rows is padded with a copy of its last row, marked, instead of losing one
    shares = rank_shares(torch.arange(11), 4, 2)
    assert [s.rows.tolist() for s in shares] == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 10]]
    assert [s.padding.tolist() for s in shares] == [[False] * 6, [False] * 5 + [True]]
    assert [s.rows.tolist() for s in rank_shares(torch.arange(11), 4, 1)] == [list(range(11))]


def _problems(overrides: list[str]) -> list[str]:
    try:
        load_config(overrides)
    except ConfigError as exc:
        return exc.problems
    return []


def test_config_checks_for_fsdp2():
    assert _problems(TINY + FSDP2) == []
    problems = _problems(TINY + ["trainer.strategy=fsdp2", "trainer.micro_train_batch_size_per_gpu=8"])
    assert any("trainer.placement.colocate_all=true" in p and "num_inference_engines=4" in p for p in problems)
    problems = _problems(TINY + FSDP2 + ["trainer.policy.fsdp_config.fsdp_size=3"])
    assert any("fsdp_size=3 must divide the 2 policy ranks" in p for p in problems)
    # a mini-batch that does not split over the ranks is padded (rank_shares), a micro-batch size that
    # does not divide a rank's share leaves a smaller last micro-batch: both run, with the same update
    assert _problems(TINY + FSDP2 + ["trainer.placement.policy_num_gpus_per_node=3",
                                     "trainer.placement.ref_num_gpus_per_node=3",
                                     "trainer.micro_train_batch_size_per_gpu=5"]) == []
    problems = _problems(TINY + FSDP2 + ["trainer.algorithm.advantage_estimator=gae", "trainer.critic_mini_batch_size=8",
                                         "trainer.critic.model.path=tiny://llama", "trainer.placement.colocate_all=true",
                                         "generator.num_inference_engines=2"])
    assert any("critic has 4 ranks" in p and "colocate_all=true" in p for p in problems)
    assert any(p.startswith("trainer.placement.actor_call_timeout_s=0 must be a positive number of seconds")
               for p in _problems(TINY + FSDP2 + ["trainer.placement.actor_call_timeout_s=0"]))


def test_a_lost_worker_is_one_message_naming_actor_node_step_and_resume():
    """What `ActorCalls` raises for a lost actor, and what the trainer adds (tests/test_cluster.py
    runs the real faults on a two-node cluster)."""
    from ridgeline.distributed.ray_calls import Actor, LostWorkerError, lost_cause
    from ridgeline.errors import UserError

    engine = Actor("engine 1", "3f2a9c01d4", "10.0.0.2")
    assert str(engine) == "engine 1 on node 3f2a9c01 (10.0.0.2)" and str(Actor("engine 1")) == "engine 1"
    # node_id "" (unknown) is never looked up: a dead actor of a live node is its process's death
    cause = lost_cause(ray, ray.exceptions.ActorDiedError(), Actor("engine 1"))
    assert cause == "the actor's process died (killed, crashed or out of memory)"
    assert lost_cause(ray, ValueError("the actor's own"), engine) is None
    err = LostWorkerError(str(engine), f"{cause} in generate (ActorDiedError)")
    assert isinstance(err, UserError)  # the command prints it as one message, exit code 2
    err.at_step(2, "The newest checkpoint is runs/ckpts/global_step_1: the same command resumes from it")
    assert str(err) == ("engine 1 on node 3f2a9c01 (10.0.0.2) during step 2: the actor's process died (killed, "
                        "crashed or out of memory) in generate (ActorDiedError). The newest checkpoint is "
                        "runs/ckpts/global_step_1: the same command resumes from it")


# ------------------------------------------------------------------------------------ Ray runs
def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _training_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "policy/policy_loss" in r]


COMPARED = ("reward/avg_raw_reward", "policy/policy_loss", "policy/policy_kl", "policy/raw_grad_norm",
            "policy/policy_entropy", "policy/rollout_train_prob_diff_mean", "generate/avg_num_tokens",
            "policy/policy_lr")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three steps of the tiny preset (GRPO with a KL loss: policy, ref and engine) in one process
    and as 2 policy ranks + 2 ref ranks + 1 engine on Ray, checkpointing every step."""
    from ridgeline.entrypoints.run import run_training
    single, multi = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("ray")
    run_training(load_config(TINY + [f"trainer.export_path={single}"]))
    summary = run_training(load_config(TINY + FSDP2 + [f"trainer.export_path={multi}", "trainer.ckpt_interval=1"]))
    return _metrics(single / "tiny"), _metrics(multi / "tiny"), summary, multi


@pytest.mark.integration
def test_ray_run_with_two_policy_ranks_reproduces_the_single_process_run(runs):
    single, multi, summary, _ = runs
    assert summary["steps"] == 3
    a, b = _training_rows(single), _training_rows(multi)
    assert len(a) == len(b) == 3
    assert [r["policy/policy_lr"] for r in b] == pytest.approx([1e-2 * 2 / 3, 1e-2 / 3, 0.0], abs=1e-15)
    for x, y in zip(a, b):
        for key in COMPARED:
            assert y[key] == pytest.approx(x[key], abs=1e-5), key
        # SkyRL's final_loss is per micro-batch: each rank runs half the micro-batches of one process
        assert y["policy/final_loss"] == pytest.approx(2 * x["policy/final_loss"], abs=1e-5)


@pytest.mark.integration
def test_ray_run_logs_the_weight_sync_and_its_probe(runs):
    _, multi, _, _ = runs
    for row in _training_rows(multi):
        assert row["weight_sync/megabytes"] > 0
        assert 0 < row["weight_sync/seconds_per_mb"] < 10
        assert row["weight_sync/probe_abs_diff"] <= 1e-5  # fp32 engine: the same weights, max over tokens


@pytest.mark.integration
def test_ray_checkpoint_is_a_loadable_hf_model_and_resumes_exactly(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from ridgeline.entrypoints.run import run_training
    _, multi, summary, out = runs
    ckpt = out / "tiny" / "ckpts" / "global_step_2"
    model = AutoModelForCausalLM.from_pretrained(ckpt / "policy")
    assert sum(p.numel() for p in model.parameters()) > 0
    assert (ckpt / "ref").exists() is False  # the reference never changed
    run_training(load_config(TINY + FSDP2 + [f"trainer.export_path={tmp_path}", "trainer.resume_mode=from_path",
                                             f"trainer.resume_path={ckpt}"]))
    resumed = [r for r in _training_rows(_metrics(tmp_path / "tiny")) if r["step"] == 3]
    expected = [r for r in _training_rows(multi) if r["step"] == 3]
    assert len(resumed) == 1
    for key in COMPARED + ("policy/final_loss",):
        assert resumed[0][key] == pytest.approx(expected[0][key], abs=1e-6), key


PPO = ["trainer.algorithm.advantage_estimator=gae", "trainer.critic.model.path=tiny://llama",
       "trainer.critic_mini_batch_size=8", "trainer.algorithm.use_kl_loss=false", "data.prepare.num_train=32",
       "trainer.micro_train_batch_size_per_gpu=16"]


@pytest.mark.integration
def test_ppo_with_a_sharded_critic_reproduces_the_single_process_run(tmp_path):
    """GAE with a critic of 2 FSDP2 ranks beside 2 policy ranks: the same values, value loss and
    policy numbers as one process; the checkpoint's critic loads as a value model."""
    from ridgeline.entrypoints.run import run_training
    from ridgeline.models.loading import ModelSpec
    from ridgeline.models.value_model import load_value_model
    single, multi = tmp_path / "single", tmp_path / "ray"
    run_training(load_config(TINY + PPO + [f"trainer.export_path={single}"]))
    run_training(load_config(TINY + PPO + FSDP2 + ["trainer.placement.critic_num_gpus_per_node=2",
                                                   f"trainer.export_path={multi}", "trainer.ckpt_interval=2"]))
    a, b = _training_rows(_metrics(single / "tiny")), _training_rows(_metrics(multi / "tiny"))
    assert len(a) == len(b) == 2
    for x, y in zip(a, b):
        for key in COMPARED[:-1] + ("critic/value_loss", "critic/values_mean", "critic/raw_grad_norm",
                                    "critic/values_clipfrac", "loss/avg_raw_advantages"):
            if key in x:
                assert y[key] == pytest.approx(x[key], abs=1e-5), key
    critic = load_value_model(ModelSpec(str(multi / "tiny" / "ckpts" / "global_step_2" / "critic")))
    final = load_value_model(ModelSpec(str(multi / "tiny" / "final_critic")))
    for p, q in zip(critic.parameters(), final.parameters()):
        assert torch.equal(p, q)  # the last checkpoint is the final critic


@pytest.mark.integration
def test_synced_engines_hold_the_trainers_weights_bit_for_bit():
    """Colocated: 2 policy ranks, 2 ref ranks and 2 bf16 engines sharing 2 CPU bundles. After the
    policy's weights change, a sync gives both engines exactly `weight.to(bfloat16)`; without a
    sync the probe sees the stale engines. The reference refresh copies the policy exactly."""
    from ridgeline.distributed.ray_workers import build_ray_workers
    from ridgeline.distributed.weight_sync import StaleWeightsError

    cfg = load_config(TINY + ["trainer.strategy=fsdp2", "trainer.placement.policy_num_gpus_per_node=2",
                              "generator.num_inference_engines=2", "generator.model_dtype=bfloat16",
                              "trainer.placement.ref_num_gpus_per_node=2"])
    assert config_problems(cfg) == []
    workers = build_ray_workers(cfg, build_char_tokenizer(), training_batches=1)  # tiny:// models use the char tokenizer
    try:
        assert [p.name for p in workers.plan.pools] == ["colocated"]
        state = workers.policy.full_state_dict()
        g = torch.Generator().manual_seed(0)
        moved = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}
        workers.policy.call("load_full_state_dict", ray.put(moved))
        with pytest.raises(StaleWeightsError):
            workers.weight_sync.probe()
        metrics = workers.weight_sync.sync(1)
        assert metrics["weight_sync/probe_abs_diff"] < 0.25
        trained = workers.policy.full_state_dict()
        for engine in workers.engine.actors:
            engine_state = ray.get(engine.state_dict.remote())
            for name, value in engine_state.items():
                assert engine_state[name].dtype == torch.bfloat16
                assert torch.equal(value, trained[name].to(torch.bfloat16)), name
        # update_ref_every_epoch on Ray: the reference ranks take the policy's weights exactly
        workers.ref.load_from(workers.policy)
        ref_state = workers.ref.full_state_dict()
        assert ref_state.keys() == trained.keys()
        assert all(torch.equal(ref_state[k], trained[k]) for k in trained)
    finally:
        workers.shutdown()


@pytest.mark.integration
def test_a_pool_that_cannot_be_placed_names_the_resource():
    from ridgeline.distributed.placement import PlacementPlan, Pool
    from ridgeline.distributed.ray_runtime import PlacementError, init_ray, reserve_pools

    def plan(bundles: int) -> PlacementPlan:
        return PlacementPlan(device="CPU", ranks={"policy": bundles}, num_engines=1, engine_devices=1,
                             pools=(Pool("policy", ("policy",), bundles, 1),))
    init_ray(plan(1).total_bundles)  # a small instance, or the one of the runs above
    with pytest.raises(PlacementError, match=r"pool 'policy' \(policy\): 64 bundle\(s\) of 1 CPU within 2 s"):
        reserve_pools(plan(64), timeout_s=2)
