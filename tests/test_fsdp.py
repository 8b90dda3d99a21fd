"""FSDP2 on two CPU ranks (gloo) reproduces the single-process policy worker exactly: per-step
losses, grad norms and the weights after three AdamW steps; the gathered full state dict loads
into a plain HF model with identical logprobs. Plus the launcher's failure handling."""

import os
import time

import pytest
import torch
from omegaconf import OmegaConf

from ridgeline.config import base_config
from ridgeline.distributed.launch import RankError, run_ranks
from ridgeline.models.tiny import build_char_tokenizer, build_tiny_model
from ridgeline.training.batch import TrainingBatch, build_training_batch
from ridgeline.training.optim import LRSchedule, build_optimizer, build_scheduler
from ridgeline.training.worker import PolicyTrainConfig, PolicyWorker

ROWS, MICRO, STEPS, WORLD = 8, 2, 3, 2


def _batch(tok) -> TrainingBatch:
    """8 rows, consecutive pairs sharing a prompt (so every micro-batch of 2 takes the
    shared-prompt path on every rank), ragged prompts and responses, some masked tokens."""
    g = torch.Generator().manual_seed(0)
    vocab = len(tok)
    prompts, responses, masks = [], [], []
    for i in range(ROWS):
        if i % 2 == 0:
            prompt = torch.randint(3, vocab, (4 + i // 2,), generator=g).tolist()
        length = 3 + int(torch.randint(0, 4, (1,), generator=g))
        prompts.append(prompt)
        responses.append(torch.randint(3, vocab, (length,), generator=g).tolist())
        masks.append([0 if (i + t) % 5 == 0 else 1 for t in range(length)])
    batch = build_training_batch(prompts, responses, masks, rewards=[float(i % 2) for i in range(ROWS)],
                                 uids=[str(i // 2) for i in range(ROWS)], rollout_logprobs=None,
                                 pad_id=tok.pad_token_id)
    batch.advantages = torch.randn(batch.response_mask.shape, generator=g) * batch.response_mask
    # off-policy old logprobs: ratios away from 1, so clipping is active
    batch.old_logprobs = (torch.randn(batch.response_mask.shape, generator=g) * 0.3 - 4.0) * batch.response_mask
    batch.ref_logprobs = (torch.randn(batch.response_mask.shape, generator=g) * 0.3 - 4.0) * batch.response_mask
    # engine logprobs near pi_old: the engine/trainer metrics must reduce exactly over the ranks
    batch.rollout_logprobs = (batch.old_logprobs + torch.randn(batch.response_mask.shape, generator=g) * 0.1) \
        * batch.response_mask
    return batch


def _worker(model, mini: int, parallel=None):
    """The one PolicyWorker class: in one process (a world of one), or on an FSDP2 rank."""
    algorithm = OmegaConf.merge(base_config().trainer.algorithm, {"loss_reduction": "token_mean"})
    cfg = PolicyTrainConfig(mini_batch_trajectories=mini, micro_batch_size=MICRO, micro_forward_batch_size=MICRO,
                            loss_reduction="token_mean", algorithm=algorithm, max_grad_norm=0.5,
                            use_kl_loss=True, kl_loss_coef=0.1, use_entropy_loss=True, entropy_loss_coef=0.01)
    opt = build_optimizer(model, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.01)
    return PolicyWorker(model, cfg, opt, build_scheduler(opt, LRSchedule("constant_with_warmup", 2, 0)), parallel)


def _full_params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rank_train(batch: TrainingBatch, fsdp_size: int | None):
    """One rank: its contiguous half of the rows, the sharded tiny Llama, three steps."""
    import torch.distributed as dist
    from ridgeline.distributed.fsdp import FSDPGroup

    rank, world = dist.get_rank(), dist.get_world_size()
    tok = build_char_tokenizer()
    group = FSDPGroup(torch.device("cpu"), fsdp_size=fsdp_size)
    model = group.place(build_tiny_model("llama", tok, seed=0))
    local = batch.select(slice(rank * ROWS // world, (rank + 1) * ROWS // world))
    worker = _worker(model, mini=ROWS, parallel=group)  # global: each rank trains its share
    metrics = [worker.train(local) for _ in range(STEPS)]
    logprobs = worker.compute_logprobs(batch)  # every rank the whole batch: a sharded forward
    state = worker.full_state_dict()
    return metrics, state, logprobs


def _rank_mismatched_forwards(batch: TrainingBatch):
    """Rank 0's micro-batch shares a prompt (two decoder forwards on its own), rank 1's does not
    (one): the ranks agree on the unshared forward (mismatched all-gathers would deadlock)."""
    import torch.distributed as dist
    from ridgeline.distributed.fsdp import FSDPGroup

    group = FSDPGroup(torch.device("cpu"))
    model = group.place(build_tiny_model("llama", build_char_tokenizer(), seed=0))
    return _worker(model, mini=2, parallel=group).compute_logprobs(batch.select(torch.tensor(MISMATCHED[dist.get_rank()])))


MISMATCHED = {0: [0, 1], 1: [1, 2]}  # rows 0 and 1 share a prompt, rows 1 and 2 do not


def _rank_all(batch: TrainingBatch):
    # everything in one spawn: spawning costs more than training here
    return {"fsdp": _rank_train(batch, None), "hsdp": _rank_train(batch, 1),
            "mismatch": _rank_mismatched_forwards(batch)}


@pytest.fixture(scope="module")
def runs():
    tok = build_char_tokenizer()
    batch = _batch(tok)
    model = build_tiny_model("llama", tok, seed=0)
    worker = _worker(model, mini=ROWS)
    reference = [worker.train(batch) for _ in range(STEPS)]
    ranks = run_ranks(_rank_all, WORLD, batch, timeout_s=240)
    return tok, batch, model, worker, reference, ranks


@pytest.mark.parametrize("layout", ["fsdp", "hsdp"])
@pytest.mark.integration
def test_two_ranks_reproduce_single_process_losses_grad_norms_and_weights(runs, layout):
    _, _, model, _, reference, ranks = runs
    expected = _full_params(model)
    for rank, (metrics, state, _) in enumerate(r[layout] for r in ranks):
        for step, (got, want) in enumerate(zip(metrics, reference)):
            assert got.keys() == want.keys()
            for key in ("policy/policy_loss", "policy/policy_kl", "policy/raw_grad_norm",
                        "policy/policy_entropy", "policy/ppo_clip_ratio", "policy/policy_lr",
                        "policy/rollout_train_prob_diff_mean", "policy/rollout_train_prob_diff_std",
                        "rollout/logprob_abs_diff_mean", "rollout/logprob_abs_diff_max"):
                assert got[key] == pytest.approx(want[key], abs=1e-5), (rank, step, key)
            # SkyRL's final_loss is a mean over a rank's micro-batches of what each back-propagated:
            # a rank runs 1/WORLD of them, each carrying WORLD times the share of the mini-batch loss
            assert got["policy/final_loss"] == pytest.approx(WORLD * want["policy/final_loss"], abs=1e-5)
        if rank == 0:
            assert state.keys() == expected.keys()
            worst = max(float((state[k] - expected[k]).abs().max()) for k in expected)
            assert worst < 1e-5, worst
        else:
            assert state == {}
    # the clip was active: the reported norm is the pre-clip global norm, above max_grad_norm
    assert reference[0]["policy/raw_grad_norm"] > 0.5


def test_full_state_dict_loads_into_a_fresh_model_with_identical_logprobs(runs):
    tok, batch, _, worker, _, ranks = runs
    fresh = build_tiny_model("llama", tok, seed=1)
    fresh.load_state_dict(ranks[0]["fsdp"][1])
    want = worker.compute_logprobs(batch)
    got = _worker(fresh, mini=ROWS).compute_logprobs(batch)
    assert torch.allclose(got, want, atol=1e-5)
    for rank in ranks:  # and the sharded model's own logprobs, on every rank
        assert torch.allclose(rank["fsdp"][2], want, atol=1e-5)


def test_ranks_whose_micro_batches_share_prompts_unevenly_agree_on_one_forward(runs):
    tok, batch, _, _, _, ranks = runs
    for rank, result in enumerate(rank["mismatch"] for rank in ranks):
        rows = batch.select(torch.tensor(MISMATCHED[rank]))
        want = _worker(build_tiny_model("llama", tok, seed=0), mini=2).compute_logprobs(rows)
        assert torch.allclose(result, want, atol=1e-5)


def _fail_on_rank_one():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    return os.environ["OMP_NUM_THREADS"]


def _hang_on_rank_one():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        time.sleep(600)
    return dist.get_rank()


@pytest.mark.integration
def test_run_ranks_raises_the_failing_ranks_exception_and_never_hangs():
    with pytest.raises(RankError, match="boom on rank one") as info:
        run_ranks(_fail_on_rank_one, 2)
    assert info.value.rank == 1 and isinstance(info.value.__cause__, ValueError)
    assert "_fail_on_rank_one" in str(info.value)  # the rank's traceback
    # rank one never finishes: returning at all is run_ranks' time limit at work (no clock asserts)
    with pytest.raises(RankError, match="did not finish"):
        run_ranks(_hang_on_rank_one, 2, timeout_s=10)
