"""Training side: batch layout, shared-prompt logprobs, and exact micro-batch accumulation."""

import copy

import pytest
import torch

from omegaconf import OmegaConf

from ridgeline.config import base_config
from ridgeline.models.forward import EAGER_ATTENTION_MAX_TOKENS, enable_activation_checkpointing, prefer_eager_attention
from ridgeline.training.batch import build_training_batch
from ridgeline.training.logprobs import response_logprobs
from ridgeline.training.optim import LRSchedule, build_optimizer, build_scheduler
from ridgeline.training.worker import PolicyTrainConfig, PolicyWorker

CPU = torch.device("cpu")


def test_batch_layout_left_pads_prompts_and_right_pads_responses():
    batch = build_training_batch(prompt_ids=[[5, 6, 7], [8]], response_ids=[[9, 2], [10, 11, 2]],
                                 loss_masks=[[1, 1], [1, 0, 1]], rewards=[1.0, 0.5], uids=["a", "b"],
                                 rollout_logprobs=[[-0.1, -0.2], [-0.3, -0.4, -0.5]], pad_id=2)
    assert batch.sequences.tolist() == [[5, 6, 7, 9, 2, 2], [2, 2, 8, 10, 11, 2]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert batch.response_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch.loss_mask.tolist() == [[1, 1, 0], [1, 0, 1]]
    # the outcome reward sits on the last response token
    assert batch.rewards.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.5]]
    assert batch.rollout_logprobs[1].tolist() == pytest.approx([-0.3, -0.4, -0.5])
    sub = batch.select(slice(1, 2))
    assert sub.uids == ["b"] and sub.sequences.shape == (1, 6)


def _grouped_batch(vocab: int, groups: int = 3, n: int = 4, prompt: int = 7, response: int = 5):
    torch.manual_seed(0)
    prompts = torch.randint(3, vocab, (groups, prompt))
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[0, :2] = 0  # a shorter, left-padded prompt
    sequences = torch.cat([prompts.repeat_interleave(n, 0), torch.randint(3, vocab, (groups * n, response))], 1)
    attention = torch.cat([prompt_mask.repeat_interleave(n, 0), torch.ones(groups * n, response, dtype=torch.long)], 1)
    attention[1, -2:] = 0  # a response that stopped early
    return sequences, attention, response


def test_shared_prompt_forward_equals_plain_forward_values_and_gradients(tiny_model, tiny_tokenizer):
    sequences, attention, width = _grouped_batch(len(tiny_tokenizer))
    results = {}
    for share in (False, True):
        tiny_model.zero_grad()
        lp, entropy = response_logprobs(tiny_model, sequences, attention, width, 0.7, with_entropy=True,
                                        share_prompts=share)
        (lp * attention[:, -width:]).sum().add(entropy.sum()).backward()
        grads = torch.cat([p.grad.flatten() for p in tiny_model.parameters()])
        results[share] = (lp.detach(), entropy.detach(), grads)
    mask = attention[:, -width:].bool()
    assert torch.allclose(results[True][0][mask], results[False][0][mask], atol=1e-5)
    assert torch.allclose(results[True][1][mask], results[False][1][mask], atol=1e-5)
    assert torch.allclose(results[True][2], results[False][2], atol=1e-5, rtol=1e-4)


def _worker(model, micro: int, mini: int, reduction: str, loss: str = "regular") -> PolicyWorker:
    algorithm = OmegaConf.merge(base_config().trainer.algorithm, {"loss_reduction": reduction})
    cfg = PolicyTrainConfig(mini_batch_trajectories=mini, micro_batch_size=micro, micro_forward_batch_size=micro,
                            policy_loss=loss, loss_reduction=reduction, algorithm=algorithm, max_grad_norm=1e9,
                            use_entropy_loss=True, entropy_loss_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1)
    opt = build_optimizer(model, lr=0.0, betas=(0.9, 0.999), weight_decay=0.0)
    return PolicyWorker(model, cfg, opt, build_scheduler(opt, LRSchedule("constant", 0, 0)))


# clip_cov / kl_cov pick tokens by a covariance over the micro-batch they see: not split-invariant
@pytest.mark.parametrize("loss", ["regular", "dual_clip", "gspo", "cispo", "sapo", "rollout_is", "dppo"])
@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "seq_mean_token_sum_norm", "prompt_mean"])
def test_micro_batch_accumulation_gives_the_full_mini_batch_gradient(tiny_model, tiny_tokenizer, reduction, loss):
    sequences, attention, width = _grouped_batch(len(tiny_tokenizer))
    rows = sequences.shape[0]
    batch = build_training_batch(
        prompt_ids=[s[:-width][a[:-width].bool()].tolist() for s, a in zip(sequences, attention)],
        response_ids=[s[-width:][a[-width:].bool()].tolist() for s, a in zip(sequences, attention)],
        loss_masks=[[1] * int(a[-width:].sum()) for a in attention], rewards=[float(i % 2) for i in range(rows)],
        uids=[str(i // 4) for i in range(rows)], rollout_logprobs=None, pad_id=tiny_tokenizer.pad_token_id)
    batch.advantages = torch.randn(batch.response_mask.shape) * batch.response_mask
    # off-policy: old and reference logprobs away from the current ones, so ratios, clipping and the
    # KL term are all active
    batch.old_logprobs = (torch.randn(batch.response_mask.shape) * 0.3 - 2.0) * batch.response_mask
    batch.ref_logprobs = (torch.randn(batch.response_mask.shape) * 0.3 - 2.0) * batch.response_mask
    # the engine's: what rollout_is and dppo weigh against (the other losses do not read it)
    batch.rollout_logprobs = (batch.old_logprobs + torch.randn(batch.response_mask.shape) * 0.1) * batch.response_mask
    grads = {}
    for micro in (rows, 5, 1):  # 5 does not divide 12: uneven micro-batches must still be exact
        model = copy.deepcopy(tiny_model)
        worker = _worker(model, micro=micro, mini=rows, reduction=reduction, loss=loss)
        worker.train(batch)  # lr 0: the step leaves weights alone, gradients stay readable
        grads[micro] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.allclose(grads[5], grads[rows], atol=1e-6, rtol=1e-4)
    assert torch.allclose(grads[1], grads[rows], atol=1e-6, rtol=1e-4)


def test_final_loss_and_prob_ratio_are_skyrls(tiny_model, tiny_tokenizer):
    """SkyRL's policy/final_loss is the mean over micro-batches of what each back-propagated (its
    share of policy loss + KL term - entropy bonus): the mini-batch's total loss / micro-batches.
    policy/rollout_train_prob_diff_* are the mean and (n - 1) std of exp(rollout - old) on the
    loss tokens."""
    sequences, attention, width = _grouped_batch(len(tiny_tokenizer))
    rows = sequences.shape[0]
    batch = build_training_batch(
        prompt_ids=[s[:-width][a[:-width].bool()].tolist() for s, a in zip(sequences, attention)],
        response_ids=[s[-width:][a[-width:].bool()].tolist() for s, a in zip(sequences, attention)],
        loss_masks=[[1] * int(a[-width:].sum()) for a in attention], rewards=[0.0] * rows,
        uids=[str(i // 4) for i in range(rows)], rollout_logprobs=None, pad_id=tiny_tokenizer.pad_token_id)
    batch.loss_mask[0, 0] = 0  # a token the loss leaves out
    batch.advantages = torch.randn(batch.response_mask.shape) * batch.response_mask
    batch.old_logprobs = (torch.randn(batch.response_mask.shape) * 0.3 - 2.0) * batch.response_mask
    batch.ref_logprobs = (torch.randn(batch.response_mask.shape) * 0.3 - 2.0) * batch.response_mask
    batch.rollout_logprobs = (batch.old_logprobs + torch.randn(batch.response_mask.shape) * 0.1) * batch.response_mask
    metrics = {}
    for micro in (rows, 4):  # one micro-batch, then three
        metrics[micro] = _worker(copy.deepcopy(tiny_model), micro=micro, mini=rows, reduction="token_mean").train(batch)
    whole = metrics[rows]
    # token_mean: the entropy term's reduction is the token-weighted entropy the worker reports
    total = whole["policy/policy_loss"] + 0.1 * whole["policy/policy_kl"] - 0.01 * whole["policy/policy_entropy"]
    assert whole["policy/final_loss"] == pytest.approx(total, abs=1e-6)
    assert metrics[4]["policy/final_loss"] == pytest.approx(total / 3, abs=1e-6)
    assert metrics[4]["policy/policy_loss"] == pytest.approx(whole["policy/policy_loss"], abs=1e-6)
    mask = batch.loss_mask.bool()
    q = (batch.rollout_logprobs.double() - batch.old_logprobs.double())[mask].exp()
    for m in metrics.values():
        assert m["policy/rollout_train_prob_diff_mean"] == pytest.approx(q.mean().item(), abs=1e-9)
        assert m["policy/rollout_train_prob_diff_std"] == pytest.approx(q.std().item(), abs=1e-9)


def test_warmup_schedule_is_linear_then_constant_from_lr_0_as_skyrl(tiny_model):
    """SkyRL's constant_with_warmup (transformers' own): the first optimizer step trains at lr 0,
    the full lr is reached at step `warmup` (Ridgeline's own schedule, before issue 18, started
    at lr / warmup)."""
    opt = build_optimizer(tiny_model, lr=1.0, betas=(0.9, 0.999), weight_decay=0.0)
    sched = build_scheduler(opt, LRSchedule("constant_with_warmup", num_warmup_steps=4, num_training_steps=6))
    lrs = []
    for _ in range(6):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]


def test_matrices_decay_and_vectors_do_not_with_the_fused_kernel(tiny_model):
    tiny_model.model.norm.weight.requires_grad_(False)  # frozen: in no group
    opt = build_optimizer(tiny_model, lr=0.1, betas=(0.9, 0.999), weight_decay=0.5)
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.5 and plain["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decayed["params"]) and all(p.dim() == 1 for p in plain["params"])
    trainable = {id(p) for p in tiny_model.parameters() if p.requires_grad}
    assert {id(p) for g in opt.param_groups for p in g["params"]} == trainable
    assert opt.defaults["fused"] is True  # torch's fused AdamW runs on CPU
    # with zero gradients only the decay moves a weight: lr * wd * w for matrices, nothing for vectors
    matrix, vector = decayed["params"][0], plain["params"][0]
    before_m, before_v = matrix.detach().clone(), vector.detach().clone()
    for p in trainable_params(tiny_model):
        p.grad = torch.zeros_like(p)
    opt.step()
    torch.testing.assert_close(matrix, before_m * (1 - 0.1 * 0.5))
    assert torch.equal(vector, before_v)


def trainable_params(model):
    return [p for p in model.parameters() if p.requires_grad]


def test_gradient_checkpointing_falls_back_to_the_plain_forward(tiny_model, tiny_tokenizer):
    sequences, attention, width = _grouped_batch(len(tiny_tokenizer))
    tiny_model.train()
    plain, _ = response_logprobs(tiny_model, sequences, attention, width, share_prompts=False)
    enable_activation_checkpointing(tiny_model)
    checkpointed, _ = response_logprobs(tiny_model, sequences, attention, width)  # share_prompts=True
    checkpointed.sum().backward()
    mask = attention[:, -width:].bool()
    assert torch.allclose(checkpointed[mask], plain[mask].detach(), atol=1e-5)


def test_short_rows_on_cpu_switch_sdpa_to_eager_with_the_same_numbers(tiny_model, tiny_tokenizer):
    sequences, attention, width = _grouped_batch(len(tiny_tokenizer))
    assert tiny_model.config._attn_implementation == "sdpa"
    sdpa, _ = response_logprobs(tiny_model, sequences, attention, width, share_prompts=False)
    assert not prefer_eager_attention(tiny_model, EAGER_ATTENTION_MAX_TOKENS + 1, CPU)   # long rows keep SDPA
    assert tiny_model.config._attn_implementation == "sdpa"
    assert prefer_eager_attention(tiny_model, EAGER_ATTENTION_MAX_TOKENS, CPU)
    assert tiny_model.config._attn_implementation == "eager"
    eager, _ = response_logprobs(tiny_model, sequences, attention, width, share_prompts=False)
    mask = attention[:, -width:].bool()
    assert torch.allclose(eager[mask], sdpa[mask], atol=1e-5)
    assert not prefer_eager_attention(tiny_model, 8, CPU)                                  # already eager
