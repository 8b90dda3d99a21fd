"""The chunked LM-head logprobs (`ridgeline.training.lm_head`) against the plain materialised-logits
computation: values and gradients, in fp64 to the last bits, across chunk boundaries."""

import pytest
import torch
from torch import nn

import ridgeline.training.lm_head as lm_head
from ridgeline.models.loading import ModelSpec, load_model, load_tokenizer
from ridgeline.training.lm_head import lm_head_logprobs, supports_fused_head, token_logprobs


class Head(nn.Module):
    """A model that is only an output embedding (what `lm_head_logprobs` looks at)."""

    def __init__(self, vocab: int, hidden: int, bias: bool = False):
        super().__init__()
        self.head = nn.Linear(hidden, vocab, bias=bias)

    def get_output_embeddings(self) -> nn.Linear:
        return self.head


@pytest.fixture
def small_chunks(monkeypatch):
    # 37 rows x chunks of >= 100 of a 1003-word vocabulary: 11 chunks, the last one short
    monkeypatch.setattr(lm_head, "CHUNK_ELEMENTS", 37 * 100)
    monkeypatch.setattr(lm_head, "MIN_CHUNK", 100)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_values_and_gradients_equal_the_plain_computation_in_fp64(small_chunks, temperature, with_entropy):
    torch.manual_seed(0)
    model = Head(1003, 16).double()
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 1003, (37,))
    targets[:3] = torch.tensor([0, 99, 1002])  # first, chunk-edge and last words
    w_lp, w_ent = torch.randn(37, dtype=torch.float64), torch.randn(37, dtype=torch.float64)

    def objective(lp, ent):
        return (lp * w_lp).sum() + ((ent * w_ent).sum() if with_entropy else 0.0)

    lp, ent = lm_head_logprobs(model, hidden, targets, temperature, with_entropy)
    grads = torch.autograd.grad(objective(lp, ent), (hidden, model.head.weight))
    ref_lp, ref_ent = token_logprobs(model.head(hidden), targets, temperature, with_entropy)
    ref_grads = torch.autograd.grad(objective(ref_lp, ref_ent), (hidden, model.head.weight))

    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    assert (ent is None) == (not with_entropy)
    if with_entropy:
        torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-11)


def test_keeps_the_batch_shape_and_matches_under_bf16_autocast(small_chunks):
    torch.manual_seed(1)
    model = Head(1003, 32)
    hidden = torch.randn(4, 9, 32, requires_grad=True)
    targets = torch.randint(0, 1003, (4, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = lm_head_logprobs(model, hidden, targets, 0.7, True)
        ref_lp, ref_ent = token_logprobs(model.head(hidden).float(), targets, 0.7, True)
    assert lp.shape == ent.shape == (4, 9) and lp.dtype == torch.float32
    # the same bf16 logits, then fp32: only the summation order differs
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=2e-4)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=2e-4)
    g = torch.autograd.grad(lp.sum() + ent.sum(), hidden)[0]
    ref_g = torch.autograd.grad(ref_lp.sum() + ref_ent.sum(), hidden)[0]
    # the plain path rounds dL/dhidden to bf16 once; the chunked one sums bf16 chunk products in fp32
    assert (g - ref_g).abs().max() < 0.02 * ref_g.abs().max()


def test_heads_with_a_bias_or_soft_cap_take_the_plain_path():
    biased = Head(50, 8, bias=True)
    assert not supports_fused_head(biased)
    hidden, targets = torch.randn(3, 8), torch.randint(0, 50, (3,))
    lp, _ = lm_head_logprobs(biased, hidden, targets, 1.0, False)
    torch.testing.assert_close(lp, token_logprobs(biased.head(hidden), targets, 1.0, False)[0])

    spec = ModelSpec("tiny://llama", seed=3)
    model = load_model(spec, torch.float32, load_tokenizer(spec))
    assert supports_fused_head(model)
    model.config.final_logit_softcapping = 30.0
    assert not supports_fused_head(model)
