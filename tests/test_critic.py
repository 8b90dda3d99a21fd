"""The critic: GAE, the clipped value loss, the value model's alignment, and the critic worker."""

from dataclasses import replace

import pytest
import torch

from ridgeline.algorithms import ADVANTAGE_ESTIMATORS, compute_gae_advantages, value_loss, whiten_advantages
from ridgeline.models.loading import ModelSpec, load_model
from ridgeline.models.value_model import ValueModel, load_value_model, response_values
from ridgeline.training.batch import build_training_batch
from ridgeline.training.critic_worker import CriticTrainConfig, CriticWorker
from ridgeline.training.logprobs import response_logprobs
from ridgeline.training.optim import LRSchedule, build_optimizer, build_scheduler

# ----------------------------------------------------------------------------- GAE


def _gae(rewards, values, mask=None, gamma=1.0, lambd=0.95):
    rewards = torch.tensor(rewards)
    mask = torch.ones_like(rewards) if mask is None else torch.tensor(mask)
    return compute_gae_advantages(token_level_rewards=rewards, response_mask=mask, values=torch.tensor(values),
                                  gamma=gamma, lambd=lambd, index=["a"] * rewards.shape[0])


def test_gae_is_registered():
    assert ADVANTAGE_ESTIMATORS.get("gae") is compute_gae_advantages


def test_gae_by_hand_gamma_one():
    # r = [0, 0, 1], V = [0.5, 0.6, 0.7], gamma = 1, lambd = 0.95, V past the end = 0:
    #   delta_2 = 1 + 0   - 0.7 = 0.3      A_2 = 0.3
    #   delta_1 = 0 + 0.7 - 0.6 = 0.1      A_1 = 0.1 + 0.95 * 0.3   = 0.385
    #   delta_0 = 0 + 0.6 - 0.5 = 0.1      A_0 = 0.1 + 0.95 * 0.385 = 0.46575
    #   returns = A + V = [0.96575, 0.985, 1.0]
    advantages, returns = _gae([[0.0, 0.0, 1.0]], [[0.5, 0.6, 0.7]])
    assert returns.tolist()[0] == pytest.approx([0.96575, 0.985, 1.0], abs=1e-6)
    # whitened over the 3 tokens: mean 0.3835833, unbiased std 0.0828841
    raw = torch.tensor([0.46575, 0.385, 0.3])
    assert advantages[0].tolist() == pytest.approx(((raw - raw.mean()) / (raw.std() + 1e-6)).tolist(), abs=1e-5)
    assert advantages[0].tolist() == pytest.approx([0.99135, 0.01709, -1.00844], abs=1e-4)
    assert not advantages.requires_grad and advantages.dtype == torch.float32


def test_gae_by_hand_discounted():
    # r = [0, 0.5, 1], V = [0.2, 0.4, 0.5], gamma = 0.9, lambd = 0.8 (gamma * lambd = 0.72):
    #   delta_2 = 1                 - 0.5 = 0.5     A_2 = 0.5
    #   delta_1 = 0.5 + 0.9 * 0.5   - 0.4 = 0.55    A_1 = 0.55 + 0.72 * 0.5  = 0.91
    #   delta_0 = 0   + 0.9 * 0.4   - 0.2 = 0.16    A_0 = 0.16 + 0.72 * 0.91 = 0.8152
    #   returns = [1.0152, 1.31, 1.0]
    advantages, returns = _gae([[0.0, 0.5, 1.0]], [[0.2, 0.4, 0.5]], gamma=0.9, lambd=0.8)
    assert returns.tolist()[0] == pytest.approx([1.0152, 1.31, 1.0], abs=1e-6)
    raw = torch.tensor([[0.8152, 0.91, 0.5]])
    assert torch.allclose(advantages, whiten_advantages(raw, torch.ones(1, 3)), atol=1e-5)


def test_gae_right_padding_does_not_leak():
    # Row 1 has 2 tokens; its padding column carries garbage reward 5 and value 9.
    #   delta_1 = 1 - 0.4 = 0.6              A_1 = 0.6
    #   delta_0 = 0 + 0.4 - 0.3 = 0.1        A_0 = 0.1 + 0.95 * 0.6 = 0.67   returns [0.97, 1.0]
    advantages, returns = _gae([[0.0, 0.0, 1.0], [0.0, 1.0, 5.0]], [[0.5, 0.6, 0.7], [0.3, 0.4, 9.0]],
                               mask=[[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert returns.tolist() == [pytest.approx([0.96575, 0.985, 1.0], abs=1e-6), pytest.approx([0.97, 1.0, 0.0])]
    raw = torch.tensor([[0.46575, 0.385, 0.3], [0.67, 0.6, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert torch.allclose(advantages, whiten_advantages(raw, mask), atol=1e-5)
    assert advantages[1, 2] == 0.0


def test_gae_with_gamma_and_lambda_one_returns_reward_to_go():
    # lambd = gamma = 1: the values telescope away, returns = Monte-Carlo reward-to-go.
    _, returns = _gae([[0.2, 0.0, 1.0]], [[3.0, -1.0, 0.5]], gamma=1.0, lambd=1.0)
    assert returns.tolist()[0] == pytest.approx([1.2, 1.0, 1.0], abs=1e-6)


def test_gae_without_values_names_the_critic_key():
    with pytest.raises(ValueError, match="trainer.critic.model.path"):
        compute_gae_advantages(token_level_rewards=torch.zeros(1, 2), response_mask=torch.ones(1, 2), gamma=1.0,
                               lambd=1.0)


# ----------------------------------------------------------------------------- value loss


def _value_loss_inputs():
    values = torch.tensor([[1.0, 2.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.5, 1.0, 0.0]])
    returns = torch.tensor([[2.0, 1.5, 1.0]])
    return values, old, returns


def test_value_loss_clipped_by_hand():
    # value_clip 0.2:
    #  t0: V - V_old = 0.5 -> V_clip = 0.7; (1 - 2)^2 = 1 < (0.7 - 2)^2 = 1.69 -> clipped, l = 0.845, no grad
    #  t1: V - V_old = 1.0 -> V_clip = 1.2; (2 - 1.5)^2 = 0.25 > (1.2 - 1.5)^2 = 0.09 -> l = 0.125, dl/dV = 0.5
    #  t2: V = V_old -> a tie, not counted as clipped; l = 0.5 * (0 - 1)^2 = 0.5, dl/dV = -1
    #  token_mean: (0.845 + 0.125 + 0.5) / 3 = 0.49
    values, old, returns = _value_loss_inputs()
    loss, metrics = value_loss(values, old, returns, torch.ones(1, 3), value_clip=0.2)
    assert loss.item() == pytest.approx(0.49)
    assert metrics == pytest.approx({"vf_clip_frac": 1 / 3, "values_mean": 1.0, "returns_mean": 1.5})
    loss.backward()
    assert values.grad.tolist()[0] == pytest.approx([0.0, 0.5 / 3, -1 / 3])


def test_value_loss_unclipped_and_masked():
    # no clipping: l = 0.5 * (V - R)^2 = [0.5, 0.125, 0.5]; token_mean over the 3 tokens = 0.375
    for clip in (None, 0.0):
        values, old, returns = _value_loss_inputs()
        loss, metrics = value_loss(values, old, returns, torch.ones(1, 3), value_clip=clip)
        assert loss.item() == pytest.approx(0.375) and metrics["vf_clip_frac"] == 0.0
        loss.backward()
        assert values.grad.tolist()[0] == pytest.approx([-1 / 3, 0.5 / 3, -1 / 3])
    # the masked-out third token drops out: clipped, (0.845 + 0.125) / 2; one of two tokens clipped
    values, old, returns = _value_loss_inputs()
    loss, metrics = value_loss(values, old, returns, torch.tensor([[1.0, 1.0, 0.0]]), value_clip=0.2,
                               loss_reduction="sequence_mean")
    assert loss.item() == pytest.approx(0.485) and metrics["vf_clip_frac"] == pytest.approx(0.5)


# ----------------------------------------------------------------------------- value model

SPEC = ModelSpec("tiny://llama", seed=0)


@pytest.fixture(scope="module")
def value_model(tiny_tokenizer):
    return load_value_model(SPEC, tokenizer=tiny_tokenizer)


def _batch(tokenizer, seed=0):
    """4 rows: prompts of lengths 6/4/6/3 (left padded), responses of lengths 4/2/3/4 (right padded),
    one loss-masked-out token; returns and old values drawn at random."""
    gen = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, len(tokenizer), (n,), generator=gen).tolist()  # noqa: E731
    prompts = [ids(6), ids(4), ids(6), ids(3)]
    responses = [ids(4), ids(2), ids(3), ids(4)]
    loss_masks = [[1] * len(r) for r in responses]
    loss_masks[0][1] = 0
    batch = build_training_batch(prompts, responses, loss_masks, rewards=[1.0, 0.0, 1.0, 0.0],
                                 uids=["a", "a", "b", "b"], rollout_logprobs=None, pad_id=tokenizer.pad_token_id)
    batch.returns = torch.rand(batch.response_mask.shape, generator=gen) * batch.response_mask
    batch.values = (torch.rand(batch.response_mask.shape, generator=gen) - 0.5) * batch.response_mask
    return batch


def test_value_head_is_named_by_prefix(tiny_tokenizer):
    model = load_value_model(SPEC, tokenizer=tiny_tokenizer, value_head_prefix="critic_head")
    keys = model.state_dict().keys()
    assert {"critic_head.weight", "critic_head.bias"} <= set(keys)
    assert not any("lm_head" in k for k in keys)
    assert model.critic_head.bias.item() == 0.0 and model.critic_head.weight.dtype == torch.float32
    again = load_value_model(SPEC, tokenizer=tiny_tokenizer, value_head_prefix="critic_head")
    assert torch.equal(model.critic_head.weight, again.critic_head.weight)  # seeded


def test_response_values_sit_at_the_logprob_positions(value_model, tiny_tokenizer):
    batch = _batch(tiny_tokenizer)
    width_r = batch.response_width
    width_p = batch.sequences.shape[1] - width_r
    with torch.no_grad():
        values = response_values(value_model, batch.sequences, batch.attention_mask, width_r)
        for row in (0, 1):  # 0: unpadded prompt, 1: left-padded prompt and right-padded response
            real = batch.sequences[row][batch.attention_mask[row].bool()]
            prompt_len = int(batch.attention_mask[row, :width_p].sum())
            hidden = value_model.backbone(input_ids=real[None]).last_hidden_state
            manual = value_model.head(hidden).squeeze(-1)[0]
            n = int(batch.response_mask[row].sum())
            # V(state before response token t) = head(hidden at the last token of that state)
            assert torch.allclose(values[row, :n], manual[prompt_len - 1:prompt_len - 1 + n], atol=1e-5)
        # those hidden states are the ones whose logits give the response logprobs
        lm = load_model(SPEC, tokenizer=tiny_tokenizer)
        positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
        hidden = lm.get_decoder()(input_ids=batch.sequences, attention_mask=batch.attention_mask,
                                  position_ids=positions).last_hidden_state[:, width_p - 1:width_p - 1 + width_r]
        logits = lm.lm_head(hidden).log_softmax(-1)
        manual_lp = logits.gather(-1, batch.sequences[:, width_p:, None]).squeeze(-1)
        lp, _ = response_logprobs(lm, batch.sequences, batch.attention_mask, width_r)
        mask = batch.response_mask.bool()
        assert torch.allclose(lp[mask], manual_lp[mask], atol=1e-5)
        assert torch.allclose(values[mask], value_model.head(hidden).squeeze(-1)[mask], atol=1e-5)


def test_save_and_load_round_trip(tiny_tokenizer, tmp_path):
    value_model = load_value_model(SPEC, tokenizer=tiny_tokenizer)
    with torch.no_grad():  # a trained head, not the fresh one a reload would draw again
        value_model.head.weight.add_(0.5)
        value_model.head.bias.fill_(0.25)
    batch = _batch(tiny_tokenizer)
    value_model.save_pretrained(tmp_path)
    loaded = load_value_model(ModelSpec(str(tmp_path)))
    with torch.no_grad():
        before = response_values(value_model, batch.sequences, batch.attention_mask, batch.response_width)
        after = response_values(loaded, batch.sequences, batch.attention_mask, batch.response_width)
    assert torch.equal(before, after)
    with pytest.raises(ValueError, match="value_head_prefix"):
        load_value_model(ModelSpec(str(tmp_path)), value_head_prefix="other_head")


# ----------------------------------------------------------------------------- critic worker


def _worker(tokenizer, lr=1e-3, **config):
    model = load_value_model(SPEC, tokenizer=tokenizer)
    optimizer = build_optimizer(model, lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    defaults = dict(mini_batch_trajectories=4, micro_batch_size=2, micro_forward_batch_size=3)
    return CriticWorker(model, CriticTrainConfig(**{**defaults, **config}), optimizer,
                        build_scheduler(optimizer, LRSchedule("constant", 0, 0)))


def test_compute_values_is_masked_and_chunk_independent(tiny_tokenizer):
    worker = _worker(tiny_tokenizer)
    batch = _batch(tiny_tokenizer)
    values = worker.compute_values(batch)
    with torch.no_grad():
        whole = response_values(worker.model, batch.sequences, batch.attention_mask, batch.response_width)
    assert torch.allclose(values, whole * batch.response_mask, atol=1e-6)
    assert (values[batch.response_mask == 0] == 0).all()


def test_critic_training_moves_values_toward_returns(tiny_tokenizer):
    worker = _worker(tiny_tokenizer, lr=3e-3, mini_batch_trajectories=2, value_clip=0.5)
    batch = _batch(tiny_tokenizer)
    mask = batch.loss_mask.bool()
    errors, losses = [], []
    for _ in range(4):
        batch.values = worker.compute_values(batch)
        errors.append(float((batch.values - batch.returns)[mask].square().mean()))
        metrics = worker.train(batch)
        losses.append(metrics["critic/value_loss"])
    assert errors[-1] < 0.5 * errors[0] and losses[-1] < losses[0]
    assert metrics["critic/critic_update_steps"] == 2.0 and metrics["critic/critic_lr"] == 3e-3
    assert set(metrics) >= {"critic/value_loss", "critic/values_clipfrac", "critic/raw_grad_norm", "critic/values_mean",
                            "critic/returns_mean"}
    with pytest.raises(ValueError, match="batch.values"):
        worker.train(replace(batch, values=None))


def test_critic_loss_is_skyrls_mean_over_micro_batches(tiny_tokenizer):
    """SkyRL's critic/critic_loss: the mean over micro-batches of what each back-propagated, so
    the mini-batch loss (critic/value_loss) / micro-batches per mini-batch."""
    batch = _batch(tiny_tokenizer)
    one = _worker(tiny_tokenizer, lr=0.0, mini_batch_trajectories=4, micro_batch_size=4).train(batch)
    two = _worker(tiny_tokenizer, lr=0.0, mini_batch_trajectories=4, micro_batch_size=2).train(batch)
    assert one["critic/critic_loss"] == pytest.approx(one["critic/value_loss"], abs=1e-7)
    assert two["critic/value_loss"] == pytest.approx(one["critic/value_loss"], abs=1e-6)
    assert two["critic/critic_loss"] == pytest.approx(one["critic/value_loss"] / 2, abs=1e-6)


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean", "prompt_mean"])
def test_gradient_accumulation_is_exact(tiny_tokenizer, reduction):
    batch = _batch(tiny_tokenizer)
    grads = []
    for micro in (4, 1):
        worker = _worker(tiny_tokenizer, micro_batch_size=micro, loss_reduction=reduction, value_clip=0.1)
        worker.model.train()
        worker.accumulate_gradients(batch)
        grads.append(torch.cat([p.grad.flatten() for p in worker.model.parameters()]))
    assert grads[0].abs().max() > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=0)


def test_token_mean_legacy_is_the_mean_of_micro_batch_means(tiny_tokenizer):
    """SkyRL 0.3.1's token_mean: each micro-batch's token mean, / the micro-batches (the critic's
    value_loss is then the same whatever the split only when the micro-batches hold as many tokens)."""
    batch = _batch(tiny_tokenizer)
    sums = {}
    for micro in (4, 2):
        worker = _worker(tiny_tokenizer, lr=0.0, micro_batch_size=micro, loss_reduction="token_mean_legacy")
        worker.model.train()
        sums[micro] = worker.accumulate_gradients(batch).loss
    values = _worker(tiny_tokenizer).compute_values(batch)
    half = [value_loss(values[rows], batch.values[rows], batch.returns[rows], batch.loss_mask[rows], 0.2)[0].item()
            for rows in (slice(0, 2), slice(2, 4))]
    assert sums[2] == pytest.approx(sum(half) / 2, abs=1e-5)


def test_activation_checkpointing_gives_the_same_gradient(tiny_tokenizer):
    batch = _batch(tiny_tokenizer)
    grads = []
    for checkpointing in (False, True):
        worker = _worker(tiny_tokenizer)
        if checkpointing:
            worker.model.enable_activation_checkpointing()
        worker.model.train()
        worker.accumulate_gradients(batch)
        grads.append(torch.cat([p.grad.flatten() for p in worker.model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=0)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_non_finite_gradient_skips_the_step(tiny_tokenizer):
    worker = _worker(tiny_tokenizer, value_clip=None)
    batch = _batch(tiny_tokenizer)
    batch.returns = batch.returns.masked_fill(batch.loss_mask.bool(), float("inf"))
    before = [p.detach().clone() for p in worker.model.parameters()]
    metrics = worker.train(batch)
    assert metrics["critic/skipped_steps"] == 1.0 and worker.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, worker.model.parameters()))


def test_value_model_is_a_module_not_an_lm(value_model):
    assert isinstance(value_model, ValueModel) and value_model.config.hidden_size == 64
