"""World-size-1 FSDP2 on NCCL equals the single path, on one GPU: the same PolicyWorker class, once in
a world of one (`SingleProcess(cuda:0)`) and once as the only rank of an NCCL group
(`FSDPGroup(cuda:0)`, a spawned process), trains the same batch for three steps in fp32; losses,
grad norms and the weights after the steps agree to 1e-5 (the sharded run adds only FSDP2's
all-gather / reduce-scatter of a world of one, and the all-reduces of the workers' seam)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from ridgeline.config import base_config
from ridgeline.distributed.launch import run_ranks
from ridgeline.models.tiny import build_char_tokenizer, build_tiny_model
from ridgeline.training.batch import TrainingBatch, build_training_batch
from ridgeline.training.optim import LRSchedule, build_optimizer, build_scheduler
from ridgeline.training.parallel import SingleProcess
from ridgeline.training.worker import PolicyTrainConfig, PolicyWorker

pytestmark = pytest.mark.gpu

ROWS, MICRO, STEPS = 8, 2, 3
KEYS = ("policy/policy_loss", "policy/final_loss", "policy/policy_kl", "policy/raw_grad_norm", "policy/policy_entropy")


def _batch() -> TrainingBatch:
    """8 host rows in GRPO pairs (the shared-prompt forward), ragged lengths, off-policy old
    logprobs so clipping is active, and reference logprobs for the KL term."""
    tok = build_char_tokenizer()
    g = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for i in range(ROWS):
        if i % 2 == 0:
            prompt = torch.randint(3, len(tok), (4 + i // 2,), generator=g).tolist()
        prompts.append(prompt)
        responses.append(torch.randint(3, len(tok), (3 + i % 3,), generator=g).tolist())
    batch = build_training_batch(prompts, responses, [[1] * len(r) for r in responses],
                                 rewards=[float(i % 2) for i in range(ROWS)], uids=[str(i // 2) for i in range(ROWS)],
                                 rollout_logprobs=None, pad_id=tok.pad_token_id)
    shape = batch.response_mask.shape
    batch.advantages = torch.randn(shape, generator=g) * batch.response_mask
    batch.old_logprobs = (torch.randn(shape, generator=g) * 0.3 - 4.0) * batch.response_mask
    batch.ref_logprobs = (torch.randn(shape, generator=g) * 0.3 - 4.0) * batch.response_mask
    return batch


def _train(parallel, model: torch.nn.Module, batch: TrainingBatch):
    algorithm = OmegaConf.merge(base_config().trainer.algorithm, {"loss_reduction": "token_mean"})
    cfg = PolicyTrainConfig(mini_batch_trajectories=ROWS, micro_batch_size=MICRO, micro_forward_batch_size=MICRO,
                            algorithm=algorithm, max_grad_norm=0.5, use_kl_loss=True, kl_loss_coef=0.1,
                            use_entropy_loss=True, entropy_loss_coef=0.01)
    optimizer = build_optimizer(model, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.01)
    worker = PolicyWorker(model, cfg, optimizer, build_scheduler(optimizer, LRSchedule("constant_with_warmup", 2, 0)),
                          parallel)
    metrics = [worker.train(batch) for _ in range(STEPS)]
    state = {k: v.detach().float().cpu() for k, v in worker.full_state_dict().items()}
    return metrics, state


def _fsdp_rank(batch: TrainingBatch):
    """The only rank of an NCCL group (run_ranks set cuda:0 current)."""
    from ridgeline.distributed.fsdp import FSDPGroup

    group = FSDPGroup(torch.device("cuda", 0))
    model = group.place(build_tiny_model("llama", build_char_tokenizer(), seed=0))
    return _train(group, model, batch)


def test_world_size_one_fsdp2_on_nccl_equals_the_single_path():
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 matmuls on both sides (the spawned rank's default too)
    batch = _batch()
    device = torch.device("cuda", 0)
    single = _train(SingleProcess(device), build_tiny_model("llama", build_char_tokenizer(), seed=0).to(device), batch)
    (sharded,) = run_ranks(_fsdp_rank, 1, batch, backend="nccl", timeout_s=300)
    for step, (got, want) in enumerate(zip(sharded[0], single[0])):
        for key in KEYS:
            assert got[key] == pytest.approx(want[key], abs=1e-5), (step, key)
    assert sharded[1].keys() == single[1].keys()
    worst = max(float((sharded[1][k] - single[1][k]).abs().max()) for k in single[1])
    print(f"\nFSDP2 world of one on NCCL vs one process on {torch.cuda.get_device_name()}: weights max |diff| "
          f"{worst:.2g} after {STEPS} steps")
    assert worst < 1e-5
