"""Sample packing: packed logprobs, entropy and gradients equal the padded path's."""

import copy

import pytest
import torch
from omegaconf import OmegaConf

from ridgeline.config import base_config
from ridgeline.models.forward import enable_activation_checkpointing
from ridgeline.models.loading import ModelSpec
from ridgeline.models.value_model import load_value_model
from ridgeline.training.batch import build_training_batch
from ridgeline.training.critic_worker import CriticTrainConfig, CriticWorker
from ridgeline.training.forward_path import (PLAIN, ForwardOptions, ForwardPath, choose_forward_path,
                                             decoder_forward_count, micro_logprobs)
from ridgeline.training.logprobs import response_logprobs
from ridgeline.training.optim import LRSchedule, build_scheduler
from ridgeline.training.packing import (PAD_SEGMENT, block_causal_mask, pack_inputs, packed_response_logprobs,
                                        packing_stats, plan_packs)
from ridgeline.training.worker import PolicyTrainConfig, PolicyWorker, RefWorker

CPU = torch.device("cpu")

TEMPERATURE = 0.7


def _ragged_batch(vocab: int, prompt_lengths=(7, 3, 5, 1, 6), response_lengths=(5, 0, 2, 4, 1),
                  prompt_width: int = 7, response_width: int = 5, seed: int = 0):
    """[prompt | response] rows: prompts left-padded to `prompt_width`, responses right-padded to
    `response_width` (a 0 is an empty response); pad tokens are random so leaks would show."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(prompt_lengths)
    sequences = torch.randint(3, vocab, (batch, prompt_width + response_width), generator=gen)
    attention = torch.zeros_like(sequences)
    for i, (p, r) in enumerate(zip(prompt_lengths, response_lengths)):
        attention[i, prompt_width - p:prompt_width + r] = 1
    return sequences, attention, response_width


def _run(model, fn, sequences, attention, width, **kwargs):
    """(logprobs, entropy, flat parameter gradient) of loss = sum masked logprobs + 0.01 entropy."""
    model.zero_grad()
    lp, ent = fn(model, sequences, attention, width, TEMPERATURE, with_entropy=True, **kwargs)
    mask = attention[:, -width:].to(lp.dtype)
    ((lp * mask).sum() + 0.01 * (ent * mask).sum()).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return lp.detach(), ent.detach(), grads


def _padded(model, sequences, attention, width):
    return _run(model, response_logprobs, sequences, attention, width, share_prompts=False)


def _packed(model, sequences, attention, width, **kwargs):
    return _run(model, packed_response_logprobs, sequences, attention, width, **kwargs)


def _assert_equal(packed, padded, attention, width, atol=1e-5):
    mask = attention[:, -width:].bool()
    for name, a, b in zip(("logprobs", "entropy"), packed[:2], padded[:2]):
        assert (a[mask] - b[mask]).abs().max() <= atol, name
        assert (a[~mask] == 0).all(), f"{name}: masked positions must be 0"
    assert torch.allclose(packed[2], padded[2], atol=atol, rtol=1e-4), (packed[2] - padded[2]).abs().max()


@pytest.mark.parametrize("max_tokens", [None, 12, 1])
def test_packed_equals_padded_values_and_gradients(tiny_model, tiny_tokenizer, max_tokens):
    sequences, attention, width = _ragged_batch(len(tiny_tokenizer))
    padded = _padded(tiny_model, sequences, attention, width)
    packed = _packed(tiny_model, sequences, attention, width, max_tokens_per_pack=max_tokens)
    _assert_equal(packed, padded, attention, width)


@pytest.mark.parametrize("implementation", ["eager", None])
def test_other_mask_paths_equal_padded(tiny_model, tiny_tokenizer, implementation):
    """eager gets the additive 4D mask; None exercises the position-ids-only path (what flash
    attention gets), here with transformers building the packed mask from the restarts."""
    sequences, attention, width = _ragged_batch(len(tiny_tokenizer))
    padded = _padded(tiny_model, sequences, attention, width)
    if implementation == "eager":
        tiny_model.set_attn_implementation("eager")
        packed = _packed(tiny_model, sequences, attention, width)
    else:
        import ridgeline.training.packing as packing
        saved = packing.EXPLICIT_MASK_IMPLEMENTATIONS
        packing.EXPLICIT_MASK_IMPLEMENTATIONS = ()
        try:
            packed = _packed(tiny_model, sequences, attention, width, max_tokens_per_pack=14)
        finally:
            packing.EXPLICIT_MASK_IMPLEMENTATIONS = saved
    _assert_equal(packed, padded, attention, width)


def test_single_row_and_float64(tiny_model, tiny_tokenizer):
    model = tiny_model.double()
    sequences, attention, width = _ragged_batch(len(tiny_tokenizer), prompt_lengths=(4,), response_lengths=(3,))
    _assert_equal(_packed(model, sequences, attention, width), _padded(model, sequences, attention, width),
                  attention, width, atol=1e-6)


def test_no_attention_across_sequences(tiny_model, tiny_tokenizer):
    sequences, attention, width = _ragged_batch(len(tiny_tokenizer))
    with torch.no_grad():
        before, _ = packed_response_logprobs(tiny_model, sequences, attention, width)
        changed = sequences.clone()
        changed[0] = (changed[0] + 1) % len(tiny_tokenizer)   # every token of row 0 (packed first)
        after, _ = packed_response_logprobs(tiny_model, changed, attention, width)
    assert torch.equal(before[1:], after[1:])
    assert not torch.equal(before[0], after[0])


def test_plan_packs_and_stats():
    assert [(p.rows, p.length) for p in plan_packs([3, 0, 4, 9, 2], 8)] == [([0, 2], 7), ([3], 9), ([4], 2)]
    assert [p.rows for p in plan_packs([3, 4], None)] == [[0, 1]]
    mask = block_causal_mask(torch.tensor([0, 0, 1]), "sdpa", torch.float32)[0, 0]
    assert mask.tolist() == [[True, False, False], [True, True, False], [False, False, True]]
    stats = packing_stats(torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]]))
    assert stats == {"real_tokens": 5.0, "padded_tokens": 8.0, "padding_fraction": 0.375}


# ----------------------------------------------------------------------------- batched packs


def test_pack_inputs_layout():
    """Two packs of <= 5 tokens in one [2, 5] forward: rows 0+2 (3 + 2 tokens), row 3 (4 tokens,
    one tail pad); row 1 is empty. Positions restart per row; each scored response token is
    predicted by the packed token just before it."""
    sequences = torch.tensor([[0, 11, 12, 13, 0], [0, 0, 0, 0, 0], [0, 0, 21, 22, 0], [31, 32, 33, 34, 0]])
    attention = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 0, 0, 0], [0, 0, 1, 1, 0], [1, 1, 1, 1, 0]])
    packed = pack_inputs(sequences, attention, response_width=2, max_tokens_per_pack=5)
    assert packed.input_ids.tolist() == [[11, 12, 13, 21, 22], [31, 32, 33, 34, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    assert packed.segments.tolist() == [[0, 0, 0, 2, 2], [3, 3, 3, 3, PAD_SEGMENT]]
    # response columns 3, 4: row 0 scores 13 (col 3), row 2 scores 22 (col 3; 21 sits in the
    # prompt), row 3 scores 34 (col 3)
    assert packed.targets.tolist() == [13, 22, 34]
    assert packed.predictors.tolist() == [1, 3, 7]
    assert packed.slots.tolist() == [0, 4, 6]


def test_batched_packs_mask_is_block_causal_with_self_attending_tail():
    mask = block_causal_mask(torch.tensor([[0, 0, 1], [2, PAD_SEGMENT, PAD_SEGMENT]]), "sdpa", torch.float32)
    assert mask.shape == (2, 1, 3, 3)
    assert mask[1, 0].tolist() == [[True, False, False], [False, True, False], [False, True, True]]
    additive = block_causal_mask(torch.tensor([[0, 1]]), "eager", torch.float32)[0, 0]
    assert additive.tolist() == [[0.0, torch.finfo(torch.float32).min], [torch.finfo(torch.float32).min, 0.0]]


@pytest.mark.parametrize("max_tokens", [None, 12])
def test_eager_batched_packs_equal_padded(tiny_model, tiny_tokenizer, max_tokens):
    sequences, attention, width = _ragged_batch(len(tiny_tokenizer))
    padded = _padded(tiny_model, sequences, attention, width)
    tiny_model.set_attn_implementation("eager")
    _assert_equal(_packed(tiny_model, sequences, attention, width, max_tokens_per_pack=max_tokens),
                  padded, attention, width)


# ----------------------------------------------------------------------------- forward path choice


def _training_batch(tokenizer, prompt_lengths, response_lengths, uids, seed=0):
    """A TrainingBatch with random tokens, advantages, old and reference logprobs (off-policy, so
    clipping and the KL term are active)."""
    gen = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, len(tokenizer), (n,), generator=gen).tolist()  # noqa: E731
    shared: dict[str, list[int]] = {}
    prompts = [shared.setdefault(u, ids(p)) for u, p in zip(uids, prompt_lengths)]
    responses = [ids(r) for r in response_lengths]
    batch = build_training_batch(prompts, responses, [[1] * r for r in response_lengths],
                                 rewards=[float(i % 2) for i in range(len(uids))], uids=list(uids),
                                 rollout_logprobs=None, pad_id=tokenizer.pad_token_id)
    shape = batch.response_mask.shape
    batch.advantages = torch.randn(shape, generator=gen) * batch.response_mask
    batch.old_logprobs = (torch.randn(shape, generator=gen) * 0.3 - 2.0) * batch.response_mask
    batch.ref_logprobs = (torch.randn(shape, generator=gen) * 0.3 - 2.0) * batch.response_mask
    batch.returns = torch.rand(shape, generator=gen) * batch.response_mask
    batch.values = (torch.rand(shape, generator=gen) - 0.5) * batch.response_mask
    return batch


# distinct prompts, ragged lengths (one empty response): micro-batches of 3 take the packed path
RAGGED = dict(prompt_lengths=(7, 3, 5, 1, 6, 4), response_lengths=(5, 0, 2, 4, 1, 3), uids="abcdef")
# GRPO groups of 3: every micro-batch of 3 shares its prompt
GROUPED = dict(prompt_lengths=(5,) * 6, response_lengths=(5, 1, 3, 4, 2, 5), uids="aaabbb")


def _sgd(model, lr: float = 0.5):
    """SGD, not AdamW: Adam's first step is lr * sign(grad), so a weight whose gradient is ~1e-9
    moves by +-lr on float noise alone; SGD moves weights by lr * grad, which the test bounds."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return optimizer, build_scheduler(optimizer, LRSchedule("constant", 0, 0))


def _policy_worker(model, packing: bool, loss: str = "regular"):
    algorithm = OmegaConf.merge(base_config().trainer.algorithm, {"loss_reduction": "token_mean"})
    cfg = PolicyTrainConfig(mini_batch_trajectories=6, micro_batch_size=3, micro_forward_batch_size=3, temperature=0.7,
                            policy_loss=loss,
                            algorithm=algorithm, max_grad_norm=1e9, use_entropy_loss=True, entropy_loss_coef=0.01,
                            use_kl_loss=True, kl_loss_coef=0.1, forward_options=ForwardOptions(sample_packing=packing))
    return PolicyWorker(model, cfg, *_sgd(model))


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.flatten() for t in tensors])


@pytest.mark.parametrize("layout, loss", [(RAGGED, "regular"), (GROUPED, "regular"), (RAGGED, "gspo"),
                                          (RAGGED, "cispo"), (RAGGED, "sapo"), (RAGGED, "dual_clip"),
                                          (RAGGED, "clip_cov"), (RAGGED, "kl_cov")],
                         ids=["ragged", "grouped", "gspo", "cispo", "sapo", "dual_clip", "clip_cov", "kl_cov"])
def test_policy_worker_step_packed_equals_padded(tiny_model, tiny_tokenizer, layout, loss):
    """A worker's logprobs, losses, gradients and the weights after one optimizer step, with
    sample packing on and off: equal to 1e-5 in fp32 (measured: logprobs 4.8e-7, gradients
    3.4e-8, weights 1.9e-8 on the ragged batch; the grouped one takes the shared-prompt path both
    ways and is bit-identical). Every policy loss, since the packed path leaves 0 where the padded
    one leaves padding garbage: a loss that read unmasked positions would show here."""
    batch = _training_batch(tiny_tokenizer, **layout)
    mask = batch.response_mask.bool()
    results = {}
    for packing in (False, True):
        model = copy.deepcopy(tiny_model)
        worker = _policy_worker(model, packing, loss)
        logprobs = worker.compute_logprobs(batch)
        metrics = worker.train(batch)
        results[packing] = (logprobs, metrics, _flat(p.grad for p in model.parameters()),
                            _flat(p.detach() for p in model.parameters()))
    (lp_off, m_off, g_off, w_off), (lp_on, m_on, g_on, w_on) = results[False], results[True]
    assert (lp_on[mask] - lp_off[mask]).abs().max() <= 1e-5
    assert (lp_on[~mask] == 0).all() and (lp_off[~mask] == 0).all()
    for key in ("policy/policy_loss", "policy/final_loss", "policy/policy_kl", "policy/policy_entropy"):
        assert m_on[key] == pytest.approx(m_off[key], abs=1e-5), key
    assert (g_on - g_off).abs().max() <= 1e-5
    assert (w_on - w_off).abs().max() <= 1e-5
    assert (w_on - _flat(p.detach() for p in tiny_model.parameters())).abs().max() > 1e-3  # it did step


def test_grouped_rows_keep_the_shared_prompt_path(tiny_model, tiny_tokenizer):
    """Packing on: micro-batches whose rows share a prompt still take the shared-prompt forward
    (faster on the quickstart), bit for bit what packing off computes; the others are packed."""
    on = ForwardOptions(sample_packing=True)
    grouped = _training_batch(tiny_tokenizer, **GROUPED)
    ragged = _training_batch(tiny_tokenizer, **RAGGED)
    choose = lambda b, o: choose_forward_path(tiny_model, b.sequences, b.attention_mask,  # noqa: E731
                                              b.response_width, o)
    assert choose(grouped, on) is ForwardPath.SHARED_PROMPT
    assert choose(grouped, PLAIN) is ForwardPath.SHARED_PROMPT
    assert choose(ragged, on) is ForwardPath.PACKED
    assert choose(ragged, PLAIN) is ForwardPath.PLAIN
    with torch.no_grad():
        assert torch.equal(micro_logprobs(tiny_model, grouped, 0.7, on, CPU)[0],
                           micro_logprobs(tiny_model, grouped, 0.7, PLAIN, CPU)[0])
    enable_activation_checkpointing(tiny_model.train())  # no KV cache: no shared prompts in training
    assert choose(grouped, on) is ForwardPath.PACKED
    assert choose(grouped, PLAIN) is ForwardPath.PLAIN


def _count_decoder_forwards(model, fn) -> int:
    calls = []
    handle = model.get_decoder().register_forward_hook(lambda *_: calls.append(1))
    try:
        fn()
    finally:
        handle.remove()
    return len(calls)


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("name, expected", [("ragged", 1), ("grouped", 2)])
@pytest.mark.parametrize("response_width", [5, 1])
def test_decoder_forward_count_predicts_the_forwards(tiny_model, tiny_tokenizer, packing, name, expected,
                                                     response_width):
    """What FSDP's same-forwards check needs: the count `decoder_forward_count` predicts is the
    number of decoder forwards `micro_logprobs` runs, on every path (packed: one, whatever the
    number of packs; shared prompts: two, one when R == 1)."""
    layout = {"ragged": RAGGED, "grouped": GROUPED}[name]
    layout = {**layout, "response_lengths": tuple(min(r, response_width) for r in layout["response_lengths"])}
    batch = _training_batch(tiny_tokenizer, **layout)
    options = ForwardOptions(sample_packing=packing, max_tokens_per_pack=6)
    for micro in batch.chunks(3):
        predicted = decoder_forward_count(tiny_model, micro, options)
        assert predicted == (expected if response_width > 1 else 1)
        assert predicted == _count_decoder_forwards(tiny_model, lambda: micro_logprobs(tiny_model, micro, 1.0, options, CPU))


def test_pack_cap_defaults_to_the_longest_row():
    attention = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    assert ForwardOptions(sample_packing=True).pack_cap(attention) == 3
    assert ForwardOptions(sample_packing=True, max_tokens_per_pack=64).pack_cap(attention) == 64


def test_ref_worker_packed_equals_padded(tiny_model, tiny_tokenizer):
    batch = _training_batch(tiny_tokenizer, **RAGGED)
    mask = batch.response_mask.bool()
    off = RefWorker(copy.deepcopy(tiny_model), 3, 0.7, None).compute_logprobs(batch)
    on = RefWorker(copy.deepcopy(tiny_model), 3, 0.7, None, ForwardOptions(sample_packing=True)).compute_logprobs(batch)
    assert (on[mask] - off[mask]).abs().max() <= 1e-5


@pytest.mark.parametrize("layout", [RAGGED, GROUPED], ids=["ragged", "grouped"])
def test_critic_worker_packed_equals_padded(tiny_tokenizer, layout):
    """The critic packs every micro-batch (it has no shared-prompt forward): values, the value
    loss, the gradients and the weights after one step equal the padded critic's to 1e-5."""
    batch = _training_batch(tiny_tokenizer, **layout)
    mask = batch.response_mask.bool()
    results = {}
    for packing in (False, True):
        model = load_value_model(ModelSpec("tiny://llama", seed=0), tokenizer=tiny_tokenizer)
        cfg = CriticTrainConfig(mini_batch_trajectories=6, micro_batch_size=3, micro_forward_batch_size=3,
                                forward_options=ForwardOptions(sample_packing=packing))
        worker = CriticWorker(model, cfg, *_sgd(model))
        values = worker.compute_values(batch)
        metrics = worker.train(batch)
        results[packing] = (values, metrics["critic/value_loss"], _flat(p.grad for p in model.parameters()),
                            _flat(p.detach() for p in model.parameters()))
    (v_off, l_off, g_off, w_off), (v_on, l_on, g_on, w_on) = results[False], results[True]
    assert (v_on[mask] - v_off[mask]).abs().max() <= 1e-5
    assert (v_on[~mask] == 0).all()
    assert l_on == pytest.approx(l_off, abs=1e-5)
    assert (g_on - g_off).abs().max() <= 1e-5
    assert (w_on - w_off).abs().max() <= 1e-5
