"""Sample packing: the response tokens of `[prompt | response]` rows run without padding.

`packed_response_logprobs` has exactly the contract of `ridgeline.training.logprobs.response_logprobs`
(`[B, R]` logprobs and entropy lining up with `sequences[:, P:]`), and `packed_response_hidden` is
the model-agnostic part the critic reuses. Instead of running the padded `[B, P+R]` block they lay
the real tokens (attention_mask == 1) of the rows end to end in a few rows ("packs") of at most
`max_tokens_per_pack` tokens, and run all packs in ONE decoder forward of shape `[packs, longest
pack]` (the packs' tails are padding). One forward per micro-batch whatever the lengths, so FSDP
ranks holding different lengths still run the same number of forwards (each forward all-gathers
the shards), and no per-pack Python overhead. Inside a pack the position ids restart at 0 for every
sequence and attention is block-diagonal causal (a token sees the earlier tokens of its own
sequence only), so every real token sees exactly the keys, values and positions it sees in the
padded forward: on every real response position the values and the gradients equal the padded
path's up to float reassociation. Positions the padded path fills with padding garbage
(attention_mask == 0) are 0.

How the block-diagonal attention reaches the model depends on its attention implementation:
- sdpa / eager: we build the mask ourselves and pass it as a 4D `[packs, 1, T, T]` attention mask,
  which transformers' `masking_utils` returns as-is (bool "may attend" for sdpa, additive 0 / min
  for eager). Dense T x T per pack: `max_tokens_per_pack` bounds it.
- anything else (flash_attention_*, flex): attention_mask=None and the restarting position ids
  only, all sequences in a single row (transformers detects packed sequences only at batch size
  1); transformers builds its own packed mask from the restarts (`find_packed_sequence_indices`),
  or, for flash attention, runs the varlen kernel with no mask at all, so there is no dense mask
  for a cap to bound.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from ridgeline.models.forward import model_device
from ridgeline.training.lm_head import lm_head_logprobs

if TYPE_CHECKING:
    from ridgeline.models.lora import MaybeAdapted

EXPLICIT_MASK_IMPLEMENTATIONS = ("sdpa", "eager")
PAD_SEGMENT = -1  # segment of the padding at the tail of a pack: one causal block of its own


@dataclass
class Pack:
    """One packed row: `rows` of the batch laid end to end, `length` real tokens in all."""
    rows: list[int]
    length: int


@dataclass(frozen=True)
class PackedInputs:
    """Decoder inputs of a packed micro-batch and where its outputs go back to.

    `input_ids`, `position_ids`, `segments` are `[packs, T]` (segments: the batch row of each
    token, PAD_SEGMENT on tail padding). `predictors` indexes the flattened `[packs * T]` outputs
    at the tokens whose output predicts a scored response token, `targets` are those tokens, and
    `slots` their flat `[B * R]` places in the response-shaped result."""
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segments: torch.Tensor
    predictors: torch.Tensor
    targets: torch.Tensor
    slots: torch.Tensor

    def to(self, device: torch.device) -> "PackedInputs":
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def packing_stats(attention_mask: torch.Tensor) -> dict[str, float]:
    """Token counts of a padded `[B, W]` batch: `real_tokens` (what a packed forward runs),
    `padded_tokens` (B * W, what the padded forward runs), and `padding_fraction` = 1 - real /
    padded. Tokens per second both ways = real_tokens / seconds and padded_tokens / seconds."""
    real = int(attention_mask.sum())
    padded = attention_mask.numel()
    return {"real_tokens": float(real), "padded_tokens": float(padded),
            "padding_fraction": 1.0 - real / padded if padded else 0.0}


def plan_packs(lengths: list[int], max_tokens_per_pack: int | None) -> list[Pack]:
    """Greedy, order-preserving packing: rows go into the current pack while it stays within
    `max_tokens_per_pack` real tokens (None: a single pack). A row longer than the bound gets a
    pack of its own; sequences are never split, since a split would need the KV of its head.
    Rows with no real token are left out."""
    packs: list[Pack] = []
    for row, n in enumerate(lengths):
        if n == 0:
            continue
        if packs and (max_tokens_per_pack is None or packs[-1].length + n <= max_tokens_per_pack):
            packs[-1].rows.append(row)
            packs[-1].length += n
        else:
            packs.append(Pack(rows=[row], length=n))
    return packs


def block_causal_mask(segment_ids: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """`[packs, 1, T, T]` mask for packs whose token t belongs to sequence `segment_ids[..., t]`
    (`[T]` or `[packs, T]`): query q may attend key k iff k <= q and both are in the same sequence.
    Bool (True = attend) for sdpa; additive (0 / finfo.min) for eager, which adds the mask to the
    scores. Tail padding shares one segment, so its queries see at least themselves (no row of
    the softmax is empty, which would give NaN)."""
    length = segment_ids.shape[-1]
    index = torch.arange(length, device=segment_ids.device)
    allowed = (segment_ids[..., :, None] == segment_ids[..., None, :]) & (index[None, :] <= index[:, None])
    allowed = allowed.view(-1, 1, length, length)
    if implementation == "sdpa":
        return allowed
    additive = torch.zeros(allowed.shape, dtype=dtype, device=segment_ids.device)
    return additive.masked_fill(~allowed, torch.finfo(dtype).min)


def pack_inputs(sequences: torch.Tensor, attention_mask: torch.Tensor, response_width: int,
                max_tokens_per_pack: int | None) -> PackedInputs:
    """Lay the real tokens of the `[B, P+R]` rows out in packs (`plan_packs`): row b's tokens
    go to pack k at offsets start_b .. start_b + len_b - 1, with position ids 0 .. len_b - 1.
    A response token is scored when its row has a real token before it; it is predicted by the
    packed token just before it (the previous real token of the same row). A host-side plan: the
    layout has data-dependent sizes, so it is built on the CPU and moved to the model's device."""
    sequences, attention_mask = sequences.cpu(), attention_mask.cpu()
    batch, width = sequences.shape
    device = sequences.device
    mask = attention_mask.bool()
    lengths = mask.sum(-1)
    row_lengths = lengths.tolist()
    packs = plan_packs(row_lengths, max_tokens_per_pack)
    if not packs:
        raise ValueError("sample packing needs at least one real token (attention_mask is all 0)")
    pack_width = max(p.length for p in packs)
    row_start = [0] * batch  # flat offset of each row's first token
    for k, pack in enumerate(packs):
        offset = k * pack_width
        for row in pack.rows:
            row_start[row] = offset
            offset += row_lengths[row]
    positions = mask.cumsum(-1) - 1                                            # [B, W] within-row
    destination = torch.tensor(row_start, device=device)[:, None] + positions  # [B, W] flat packed
    size = len(packs) * pack_width
    input_ids = torch.zeros(size, dtype=sequences.dtype, device=device)  # tail padding: any id
    position_ids = torch.zeros(size, dtype=torch.long, device=device)
    segments = torch.full((size,), PAD_SEGMENT, dtype=torch.long, device=device)
    rows = torch.arange(batch, device=device)[:, None].expand(batch, width)
    real = destination[mask]
    input_ids[real] = sequences[mask]
    position_ids[real] = positions[mask]
    segments[real] = rows[mask]
    prompt_width = width - response_width
    column = torch.arange(width, device=device)[None, :]
    scored = mask & (column >= prompt_width) & (positions > 0)
    shape = (len(packs), pack_width)
    return PackedInputs(input_ids=input_ids.view(shape), position_ids=position_ids.view(shape),
                        segments=segments.view(shape), predictors=destination[scored] - 1,
                        targets=sequences[scored],
                        slots=(rows * response_width + column - prompt_width)[scored])


def packed_response_hidden(decoder: MaybeAdapted, sequences: torch.Tensor, attention_mask: torch.Tensor,
                           response_width: int, max_tokens_per_pack: int | None = None,
                           device: torch.device | None = None) -> tuple[PackedInputs, torch.Tensor]:
    """One packed forward of `decoder` (a transformers base model: `last_hidden_state` out) on
    `device` (default: its parameters'). Returns the layout and the last hidden states `[N, H]` at
    its `predictors`: the states the padded path reads at columns P-1 .. P+R-2 (LM head: logprobs;
    value head: values)."""
    implementation = getattr(decoder.config, "_attn_implementation", None) or "eager"
    explicit = implementation in EXPLICIT_MASK_IMPLEMENTATIONS
    packed = pack_inputs(sequences, attention_mask, response_width, max_tokens_per_pack if explicit else None)
    packed = packed.to(device or model_device(decoder))
    inputs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids, "use_cache": False}
    if explicit:
        dtype = next(decoder.get_input_embeddings().parameters()).dtype   # the embedding weight's
        inputs["attention_mask"] = block_causal_mask(packed.segments, implementation, dtype)
    hidden = decoder(**inputs).last_hidden_state                       # [packs, T, H]
    return packed, hidden.reshape(-1, hidden.shape[-1])[packed.predictors]


def scatter_response(packed: PackedInputs, values: torch.Tensor, batch: int, response_width: int) -> torch.Tensor:
    """`[B, R]` with `values[i]` at `packed.slots[i]` and 0 elsewhere; differentiable
    (out-of-place index_put)."""
    flat = values.new_zeros(batch * response_width)
    return flat.index_put((packed.slots,), values).view(batch, response_width)


def packed_response_logprobs(model: MaybeAdapted, sequences: torch.Tensor, attention_mask: torch.Tensor,
                             response_width: int, temperature: float = 1.0, with_entropy: bool = False,
                             max_tokens_per_pack: int | None = None, device: torch.device | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_logprobs(model, sequences, attention_mask, response_width, temperature,
    with_entropy, share_prompts=False)` computed on packed rows without padding.

    Equal (values and gradients, up to float reassociation) on every response position with
    attention_mask == 1 whose row has a real token before it; 0 elsewhere (where the padded path
    holds values computed from padding). `max_tokens_per_pack` bounds the real tokens of one
    pack (None: all rows in one pack); all packs run in one decoder forward."""
    packed, hidden = packed_response_hidden(model.get_decoder(), sequences, attention_mask, response_width,
                                            max_tokens_per_pack, device)
    # Only the predicting positions go through the (large) output embedding.
    logprobs, entropy = lm_head_logprobs(model, hidden, packed.targets, temperature, with_entropy)
    batch = sequences.shape[0]
    return (scatter_response(packed, logprobs, batch, response_width),
            scatter_response(packed, entropy, batch, response_width) if entropy is not None else None)
