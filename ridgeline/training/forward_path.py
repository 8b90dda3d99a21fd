"""Which forward a micro-batch takes: the one place the policy, reference and critic workers (and
the FSDP forward-count check) ask.

Three paths compute the same numbers (values and gradients, up to float reassociation):
- `plain`: the padded `[B, P+R]` block, one decoder forward.
- `shared_prompt`: each distinct prompt once, its KV fanned out to the rows of its GRPO group,
  then the responses on that cache (`response_logprobs(share_prompts=True)`): two decoder
  forwards (one when R == 1).
- `packed`: real tokens only, block-diagonal causal packs (`ridgeline.training.packing`): one
  decoder forward over `[packs, longest pack]`.

The rule, with `trainer.use_sample_packing` on:
1. rows that share a prompt (and a KV cache is available) take `shared_prompt`;
2. every other micro-batch is `packed`, in packs of at most `max_tokens_per_pack` tokens, by
   default the micro-batch's longest row.
With it off, step 2 is `plain`. The critic has no shared-prompt forward: `packed` or `plain`.

Why (one CPU core, OMP_NUM_THREADS=1, medians; the tables are in docs/benchmarks.md):
- Shared prompts beat packing wherever they apply on the quickstart: the prompt (~47 tokens) is
  most of a row, so running it once per group of 8 removes far more work than dropping padding.
  SmolLM2-135M, bf16 autocast, the quickstart batch (8 prompts x 8 samples, responses of 3-17
  tokens: 10% padding) in micro-batches of 16, forward+backward: shared prompts 13.2 s, packed
  23.6 s, plain 22.8 s. Step 1 keeps the quickstart on exactly the path (and speed) it had.
- Packs of at most the longest row L never run more work than padding: at most B packs of at most
  L tokens, so attention (packs * T^2 <= B * W^2) and the per-token work (packs * T <= B * W) are
  bounded by the padded forward's, and all packs run in one forward (no per-pack overhead). On
  `bench/packing.py` (llama-small, 32 rows, long-tailed responses, 59% padding) forward+backward
  took padded 1.13 s, packs <= L 0.59 s, packs <= 1024 tokens 0.84 s, one pack 2.17 s (its dense
  T x T mask); through the policy worker (micro-batches of 8) packing made `compute_logprobs`
  2.1x and `train` 2.3x faster. With little padding packing is a wash (10%: 23.6 vs 22.8 s
  above; 0-8% on llama-small: 0.72-1.08x of padded, within this machine's noise), so there is no
  padding threshold below which it is switched off.
- The choice between shared prompts and the rest depends only on which rows share a prompt,
  never on lengths, and packed and plain both run one decoder forward, so data-parallel ranks that
  keep GRPO groups whole run the same number of forwards (`decoder_forward_count`) even when their
  lengths differ. A length-based choice between shared prompts and packing (e.g. packing groups
  whose responses are mostly padding) would let ranks disagree.
- Where ranks' micro-batches do differ in sharing (step-wise samples: only a group's first turns
  share a prompt; a rank's padding row copies a row of its own), `agreed_forward_options` has them
  agree: the shared-prompt forward only where every rank's micro-batch takes it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from ridgeline.models.value_model import ValueModel, response_values
from ridgeline.training.batch import TrainingBatch
from ridgeline.training.logprobs import prompt_groups, response_logprobs
from ridgeline.training.packing import packed_response_hidden, packed_response_logprobs, scatter_response
from ridgeline.training.parallel import DataParallel, check_uniform_forwards

if TYPE_CHECKING:
    from ridgeline.models.lora import MaybeAdapted

class ForwardPath(enum.Enum):
    PLAIN = "plain"
    SHARED_PROMPT = "shared_prompt"
    PACKED = "packed"


@dataclass(frozen=True)
class ForwardOptions:
    """How the workers run their forwards (the trainer fills it from the config).

    sample_packing: `trainer.use_sample_packing`; micro-batches whose rows do not share a prompt
    run packed instead of padded.
    max_tokens_per_pack: real tokens per pack; None (the default) is the micro-batch's longest
    row, the largest cap that never does more work than the padded forward (module docstring).
    A larger cap packs more rows per pack (fewer, longer packs: a bigger dense mask)."""
    sample_packing: bool = False
    max_tokens_per_pack: int | None = None
    # False: never the shared-prompt forward (ranks that must agree, `agreed_forward_options`)
    share_prompts: bool = True

    def pack_cap(self, attention_mask: torch.Tensor) -> int:
        """`max_tokens_per_pack` with None resolved to the micro-batch's longest row."""
        if self.max_tokens_per_pack is not None:
            return self.max_tokens_per_pack
        return int(attention_mask.sum(-1).max())


PLAIN = ForwardOptions()


def choose_forward_path(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                        response_width: int, options: ForwardOptions, can_share_prompts: bool = True
                        ) -> ForwardPath:
    """The path `options` picks for these rows (module docstring). `can_share_prompts` is False
    for models without a shared-prompt forward (the critic)."""
    if (can_share_prompts and options.share_prompts
            and prompt_groups(model, sequences, attention_mask, response_width) is not None):
        return ForwardPath.SHARED_PROMPT
    return ForwardPath.PACKED if options.sample_packing else ForwardPath.PLAIN


def decoder_forward_count(model: nn.Module, micro: TrainingBatch, options: ForwardOptions) -> int:
    """How many decoder forwards `micro_logprobs(model, micro, ..., options)` runs (FSDP ranks must
    all run the same number: each forward all-gathers the sharded layers). Call with the model in
    the train/eval mode the forward will run in: activation checkpointing disables the shared path
    in training only."""
    path = choose_forward_path(model, micro.sequences, micro.attention_mask, micro.response_width, options)
    if path is ForwardPath.SHARED_PROMPT and micro.response_width > 1:
        return 2
    return 1


def agreed_forward_options(parallel: DataParallel, model: nn.Module, micros: list[TrainingBatch],
                           options: ForwardOptions) -> list[ForwardOptions]:
    """Collective: the options each of `micros` runs with, so that every data-parallel rank runs
    the same decoder forwards (under FSDP2 each forward all-gathers the sharded layers): a
    micro-batch takes the shared-prompt forward only where it does so on every rank, elsewhere
    the packed / plain one, which any rows can take. Then `check_uniform_forwards` (the ranks must
    also hold the same number of micro-batches). Call with the model in the mode the forwards run
    in (activation checkpointing disables the shared path in training). A world of one keeps
    every micro-batch's own path."""
    shared = [choose_forward_path(model, m.sequences, m.attention_mask, m.response_width, options)
              is ForwardPath.SHARED_PROMPT for m in micros]
    if parallel.world_size > 1 and micros:
        check_uniform_forwards(parallel, [1] * len(micros))  # same number of micro-batches first
        unshared = parallel.all_max([0.0 if s else 1.0 for s in shared])
        shared = [s and u == 0.0 for s, u in zip(shared, unshared)]
    agreed = [options if s else replace(options, share_prompts=False) for s in shared]
    check_uniform_forwards(parallel, [decoder_forward_count(model, m, o) for m, o in zip(micros, agreed)])
    return agreed


def micro_logprobs(model: MaybeAdapted, micro: TrainingBatch, temperature: float, options: ForwardOptions,
                   device: torch.device, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_logprobs` of the host micro-batch `micro` on the path `options` picks, computed on
    `device`: `[B, R]` logprobs (and entropy) there, equal on every real response token whichever
    path runs. Padded response positions hold padding garbage on the padded paths and 0 on the
    packed one: mask them. The path and its layout are planned on the host (data-dependent sizes)."""
    path = choose_forward_path(model, micro.sequences, micro.attention_mask, micro.response_width, options)
    if path is ForwardPath.PACKED:
        return packed_response_logprobs(model, micro.sequences, micro.attention_mask, micro.response_width,
                                        temperature, with_entropy, options.pack_cap(micro.attention_mask), device)
    return response_logprobs(model, micro.sequences, micro.attention_mask, micro.response_width, temperature,
                             with_entropy, share_prompts=path is ForwardPath.SHARED_PROMPT, device=device)


def micro_values(model: ValueModel, micro: TrainingBatch, options: ForwardOptions, device: torch.device) -> torch.Tensor:
    """`response_values` of the host micro-batch `micro` on `device`, packed when
    `options.sample_packing` (the critic has no shared-prompt forward): `[B, R]` float32, equal on
    every real response token. The packed path reads the same hidden states the padded one reads
    at columns P-1 .. P+R-2."""
    path = choose_forward_path(model, micro.sequences, micro.attention_mask, micro.response_width, options,
                               can_share_prompts=False)
    if path is ForwardPath.PLAIN:
        return response_values(model, micro.sequences, micro.attention_mask, micro.response_width, device)
    packed, hidden = packed_response_hidden(model.backbone, micro.sequences, micro.attention_mask,
                                            micro.response_width, options.pack_cap(micro.attention_mask), device)
    return scatter_response(packed, model.values_from_hidden(hidden), micro.batch_size, micro.response_width)
