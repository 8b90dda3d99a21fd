"""Device placement, caught without a GPU: the tensor work of a GRPO/PPO step — policy, reference
and critic forwards and backwards, the optimizer steps, the engine's prefill and decode, the weight
sync — runs on a stand-in accelerator (the `meta` device under `StrictDevices`, see
tests/device_check.py for why not FakeTensorMode), so a tensor left on the CPU fails the test with
the op and the shapes named. The numbers of the same code are tested on the CPU elsewhere."""

from __future__ import annotations

import pytest
import torch

from device_check import META, DevicePlacementError, StrictDevices
from ridgeline.config import load_config
from ridgeline.distributed.weight_sync import InProcessWeightSync
from ridgeline.inference.hf_engine import HFEngine
from ridgeline.inference.types import EngineRequest, SamplingParams
from ridgeline.training.batch import build_training_batch
from ridgeline.training.build import build_critic, build_policy_worker, build_ref_worker
from ridgeline.training.logprobs import response_logprobs
from ridgeline.training.parallel import SingleProcess

ON_META = SingleProcess(META)


def _cfg(tmp_path, *overrides: str):
    """The tiny preset as PPO (GAE with a critic) with a KL loss (so a reference), in fp32 (autocast
    has no `meta` device type), micro-batches of 3 over 6 rows."""
    return load_config(["+experiment=tiny", f"trainer.export_path={tmp_path}", "trainer.mixed_precision=fp32",
                        "trainer.algorithm.advantage_estimator=gae", "trainer.critic.model.path=tiny://llama",
                        "trainer.algorithm.use_kl_loss=true", "trainer.train_batch_size=2",
                        "trainer.policy_mini_batch_size=2", "trainer.critic_mini_batch_size=2",
                        "generator.n_samples_per_prompt=3", "trainer.micro_train_batch_size_per_gpu=3",
                        "trainer.micro_forward_batch_size_per_gpu=3", *overrides])


def _batch(tokenizer, grouped: bool):
    """6 host rows: two GRPO groups of 3 sharing their prompt (the shared-prompt forward), or six
    distinct prompts of ragged lengths (the plain or the packed forward)."""
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, len(tokenizer), (n,), generator=gen).tolist()  # noqa: E731
    if grouped:
        prompts = [p for p in (ids(5), ids(4)) for _ in range(3)]
    else:
        prompts = [ids(n) for n in (7, 3, 5, 2, 6, 4)]
    lengths = (5, 1, 3, 4, 2, 5)
    batch = build_training_batch(prompts, [ids(n) for n in lengths], [[1] * n for n in lengths],
                                 rewards=[float(i % 2) for i in range(6)], uids=list("aaabbb"),
                                 rollout_logprobs=[[-1.0] * n for n in lengths], pad_id=tokenizer.pad_token_id)
    shape = batch.response_mask.shape
    for name in ("advantages", "returns", "values", "old_logprobs", "ref_logprobs"):
        setattr(batch, name, torch.randn(shape, generator=gen) * batch.response_mask)
    return batch


def _on(module: torch.nn.Module) -> set[str]:
    return {t.device.type for t in list(module.parameters()) + list(module.buffers())}


@pytest.mark.parametrize("grouped, packing", [(True, False), (False, False), (False, True)],
                         ids=["shared-prompt", "plain", "packed"])
def test_a_step_of_every_worker_runs_on_the_accelerator(tmp_path, tiny_tokenizer, grouped, packing):
    cfg = _cfg(tmp_path, f"trainer.use_sample_packing={str(packing).lower()}")
    policy = build_policy_worker(cfg, tiny_tokenizer, ON_META, training_batches=1)
    ref = build_ref_worker(cfg, tiny_tokenizer, parallel=ON_META)
    critic = build_critic(cfg, tiny_tokenizer, training_batches=1, parallel=ON_META)
    assert _on(policy.model) == _on(ref.model) == _on(critic.model) == {"meta"}
    batch = _batch(tiny_tokenizer, grouped)
    with StrictDevices():
        ref_lp = ref.compute_logprobs(batch)
        old_lp = policy.compute_logprobs(batch)
        values = critic.compute_values(batch)
        critic_metrics = critic.train(batch)
        policy_metrics = policy.train(batch)
    # results come back on the host, in the batch's shape
    for result in (ref_lp, old_lp, values):
        assert result.device.type == "cpu" and result.shape == batch.response_mask.shape
    # one optimizer step each (ones stand in for the host reads: finite loss, finite norm)
    assert policy_metrics["policy/policy_update_steps"] == 1.0 and policy_metrics["policy/skipped_steps"] == 0.0
    assert critic_metrics["critic/critic_update_steps"] == 1.0 and critic_metrics["critic/skipped_steps"] == 0.0
    # the moments live where the parameters do
    for worker in (policy, critic):
        moments = [v for s in worker.optimizer.state.values() for k, v in s.items() if k != "step"]
        assert moments and {v.device.type for v in moments} == {"meta"}
    assert _on(policy.model) == {"meta"}


def test_the_engine_prefills_decodes_and_takes_synced_weights_on_the_accelerator(tmp_path, tiny_tokenizer):
    cfg = _cfg(tmp_path)
    policy = build_policy_worker(cfg, tiny_tokenizer, ON_META, training_batches=1)
    engine = HFEngine(policy.model, tiny_tokenizer, dtype=torch.bfloat16, device=META)
    assert _on(engine.model) == {"meta"} and engine.device == META
    params = SamplingParams(max_generate_length=4, temperature=0.0)
    requests = [EngineRequest([5, 6, 7], params), EngineRequest([5, 6, 7], params), EngineRequest([8, 9], params)]
    with StrictDevices():
        outputs = engine.generate(requests, seed=0)  # prefill (shared prompt fanned out) + decode steps
        InProcessWeightSync(policy, engine).sync(1)   # the policy's parameters copied and cast in place
    assert len(outputs) == 3  # their tokens are the stand-in's ones: what counts is that no op mixed devices
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}


def test_a_tensor_left_on_the_host_is_caught(tiny_model, tiny_tokenizer):
    """The detector itself: a forward whose inputs stay on the host while the model is on the
    accelerator fails with the op named, as it would on a GPU."""
    model = tiny_model.to(META)
    sequences = torch.tensor([[5, 6, 7, 8, 9]])
    with StrictDevices(), pytest.raises(DevicePlacementError, match="embedding"):
        # device=cpu: the function is told to compute where the model is not
        response_logprobs(model, sequences, torch.ones_like(sequences), 2, device=torch.device("cpu"))


def test_trainer_device_auto_is_the_cpu_without_cuda_and_cuda_is_refused_by_name(tmp_path):
    from ridgeline.config.validate import ConfigError
    from ridgeline.models.device import resolve_device

    assert resolve_device("auto") == torch.device("cpu")  # this machine has no GPU
    with pytest.raises(ValueError, match="trainer.device=cuda but CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="not a device"):
        resolve_device("cuda:x")
    with pytest.raises(ConfigError, match="trainer.device=cuda:1 but CUDA is not available"):
        load_config(["+experiment=tiny", f"trainer.export_path={tmp_path}", "trainer.device=cuda:1"])
    cfg = load_config(["+experiment=tiny", f"trainer.export_path={tmp_path}"])
    assert cfg.trainer.device == "auto"


def test_offload_after_step_parks_the_optimizer_state_on_the_host_between_steps(tmp_path, tiny_tokenizer):
    """`optimizer_config.offload_after_step` acts on a GPU shared with the engines: AdamW's moments
    wait on the host between training phases and are back next to the parameters for each step."""
    from ridgeline.training.build import offloads_optimizer

    cfg = _cfg(tmp_path)
    opt = cfg.trainer.policy.optimizer_config
    assert offloads_optimizer(cfg, opt, torch.device("cuda", 0))            # colocate_all and engines in the job
    assert not offloads_optimizer(cfg, opt, torch.device("cpu"))            # nothing to free on a CPU
    remote = load_config(["+experiment=tiny", f"trainer.export_path={tmp_path}", "generator.run_engines_locally=false"])
    assert not offloads_optimizer(remote, remote.trainer.policy.optimizer_config, torch.device("cuda", 0))

    policy = build_policy_worker(cfg, tiny_tokenizer, ON_META, training_batches=1)
    policy.offload_optimizer = True
    seen: list[set[str]] = []
    step = policy.optimizer.step

    def step_and_look(*args, **kwargs):
        seen.append({v.device.type for s in policy.optimizer.state.values() for k, v in s.items() if k != "step"})
        return step(*args, **kwargs)

    policy.optimizer.step = step_and_look
    batch = _batch(tiny_tokenizer, grouped=True)
    with StrictDevices():
        policy.train(batch)
        policy.train(batch)
    moments = [v for s in policy.optimizer.state.values() for k, v in s.items() if k != "step"]
    assert moments and {v.device.type for v in moments} == {"cpu"}   # parked after the phase
    assert seen == [set(), {"meta"}]  # no state before the first step; on the device for the second
