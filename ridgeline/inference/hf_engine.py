"""The embedded engine (`generator.backend=hf`): batched sampling with a KV cache on transformers.

It runs in the trainer's process and keeps its own copy of the weights in `generator.model_dtype`,
so the policy can train in fp32 master weights while rollouts run in bf16; `update_weights`
copies (and casts) the policy's tensors in place after each step.

Decoding loop: prompts are left-padded, each distinct prompt is prefilled once and its cache
fanned out to its samples (GRPO sends `n_samples_per_prompt` copies of each prompt), then one
token per step for every live row; rows that finished (an eos / stop token, or a stop string:
`stop_strings`) are dropped from the batch and the cache. With a repetition penalty each row
carries a [V] mask of the tokens of its prompt and response so far.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Iterable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ridgeline.inference.sampling import sample_next
from ridgeline.inference.stop_strings import StopStringMatcher
from ridgeline.inference.types import (
    WAKE_TAGS,
    EngineOutput,
    EngineRequest,
    MemoryTag,
    SamplingParams,
    StopReason,
    Steps,
    TopLogprobs,
    run_steps,
    wake_order,
)
from ridgeline.models.forward import cache_kwargs, forward_last_logits, positions_from_mask
from ridgeline.tracking.progress import progress


class HFEngine:
    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *,
                 dtype: torch.dtype = torch.float32, max_num_seqs: int = 1024,
                 attn_implementation: str | None = None, device: torch.device | None = None):
        """`model` is copied (the trainer keeps training its own) and cast to `dtype`, on `device`
        (default: where `model` is)."""
        self.device = device or next(model.parameters()).device
        self.model = copy.deepcopy(model)
        module: torch.nn.Module = self.model   # nn.Module.to (in place): transformers' wrapped `to` confuses mypy
        module.to(device=self.device, dtype=dtype)
        self.model.eval()
        self.model.requires_grad_(False)
        self.dtype = dtype
        if attn_implementation is not None:
            self.model.set_attn_implementation(attn_implementation)
        self.max_num_seqs = max_num_seqs
        self.tokenizer = tokenizer  # stop strings are matched on decoded text
        self.pad_id = tokenizer.pad_token_id
        eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        eos_ids.add(tokenizer.eos_token_id)
        self.eos_ids = tuple(sorted(i for i in eos_ids if i is not None))
        self._params = dict(self.model.named_parameters())
        self._shapes = {name: p.shape for name, p in self._params.items()}
        self._asleep: set[str] = set()    # memory tags released by `sleep`
        self._dropped = False             # sleep(level=2) dropped the weights' values
        self._unfilled: set[str] = set()  # woken after a drop, not yet refilled by update_weights

    # -- weights -----------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (and cast) each tensor into the parameter of that name, in place; weights that are
        asleep are woken first."""
        self.wake_up(("weights",))
        for name, tensor in named_tensors:
            if name not in self._params:
                continue  # tied weights appear once under their first name
            self._params[name].copy_(tensor)
            self._unfilled.discard(name)

    def reset_prefix_cache(self) -> None:
        """Nothing to drop: the embedded engine shares a prompt's cache within one batch only."""

    def close(self) -> None:
        """Nothing to release beyond the model, which the garbage collector frees."""

    @torch.inference_mode()
    def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """Teacher-forced logprobs of `response_ids` (temperature 1, fp32 softmax), computed as the
        trainer computes them: one plain forward, logits of the response positions only."""
        self._check_ready("score")
        if not response_ids:
            return []
        seq = torch.tensor([list(prompt_ids) + list(response_ids)], device=self.device)
        mask = torch.ones_like(seq)
        out = forward_last_logits(self.model, len(response_ids) + 1, input_ids=seq, attention_mask=mask,
                                  position_ids=positions_from_mask(mask), use_cache=False)
        logprobs = torch.log_softmax(out.logits[0, :-1].float(), -1)
        return logprobs.gather(-1, seq[0, -len(response_ids):, None]).squeeze(-1).tolist()

    # -- sleep ---------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Release the device for training. Level 1 moves the weights to host memory (pinned, for
        a fast way back; on a CPU they already are there), level 2 drops their values and keeps
        names, shapes and dtypes: after `wake_up(("weights",))` the next `update_weights` refills
        them. The engine has no KV cache between calls (each `generate` builds its own), so
        releasing "kv_cache" only marks the engine unusable until it is woken."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if level == 2 and not self._dropped:
            self._drop_weights()
        elif "weights" not in self._asleep and not self._dropped:
            self._offload_weights()
        self._asleep = set(WAKE_TAGS)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed blocks back to the device, for the trainer

    def wake_up(self, tags: tuple[MemoryTag, ...] = WAKE_TAGS) -> None:
        """Take back `tags`: "weights" returns them to the device (after level 2: allocated, to be
        refilled by `update_weights`), "kv_cache" makes the engine usable again."""
        for tag in wake_order(tags):
            if tag == "weights" and tag in self._asleep:
                self._restore_weights()
            self._asleep.discard(tag)

    def _offload_weights(self) -> None:
        if self.device.type == "cpu":
            return
        for p in self._params.values():
            host = torch.empty(p.shape, dtype=p.dtype, pin_memory=self.device.type == "cuda")
            host.copy_(p.data)
            p.data = host

    def _drop_weights(self) -> None:
        # the Parameter objects stay (tied weights keep sharing one), only their storage goes: an
        # empty tensor where it was (`.data` cannot point at a meta tensor), shapes kept aside
        for p in self._params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._dropped = True
        self._unfilled.clear()

    def _restore_weights(self) -> None:
        if self._dropped:
            for name, p in self._params.items():
                p.data = torch.empty(self._shapes[name], dtype=p.dtype, device=self.device)
            self._dropped = False
            self._unfilled = set(self._params)
            return
        if self.device.type == "cpu":
            return
        for p in self._params.values():
            p.data = p.data.to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the pinned host copies may go once the copies landed

    def _check_ready(self, what: str) -> None:
        if self._asleep:
            raise RuntimeError(f"HFEngine.{what} called while asleep ({' and '.join(sorted(self._asleep))} "
                               "released); call wake_up() first")
        if self._unfilled:
            raise RuntimeError(f"HFEngine.{what}: sleep(level=2) dropped the weights and {len(self._unfilled)} of "
                               f"them were not loaded since (e.g. {min(self._unfilled)}); call update_weights with "
                               "the policy's full weights first")

    # -- generation --------------------------------------------------------------------------
    @property
    def context_length(self) -> int:
        """Longest prompt + response the model holds: `max_position_embeddings`, lengthened by its
        RoPE scaling as vLLM counts it."""
        from ridgeline.inference.library_engine import context_length_of

        return context_length_of(self.model.config.to_dict()) or int(self.model.config.max_position_embeddings)

    @property
    def vocab_size(self) -> int:
        """Token ids the model embeds: 0 .. vocab_size - 1."""
        embeddings = self.model.get_input_embeddings()
        if not isinstance(embeddings, torch.nn.Embedding):
            raise TypeError(f"{type(self.model).__name__}: its input embedding is a {type(embeddings).__name__}, "
                            "not an nn.Embedding: the embedded engine cannot tell its vocabulary size")
        return int(embeddings.num_embeddings)

    def generate(self, requests: list[EngineRequest], seed: int | None = None) -> list[EngineOutput]:
        return run_steps(self.generate_steps(requests, seed))

    @torch.inference_mode()
    def generate_steps(self, requests: list[EngineRequest], seed: int | None = None) -> Steps[list[EngineOutput]]:
        """`generate`, yielding after every forward pass (prefill or decode step) so that a server
        can advance other requests in between; the result is the same as `generate`'s (the request
        keeps its own random generator and KV cache)."""
        self._check_ready("generate")
        generator = None  # greedy decoding draws nothing
        if any(r.sampling_params.temperature > 0 for r in requests):
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed if seed is not None else torch.seed())
        outputs: list[EngineOutput | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            groups[(req.sampling_params, req.stop_token_ids)].append(i)
        with progress(len(requests), "generate") as bar:
            for (params, stop_ids), indices in groups.items():
                stop = torch.tensor(sorted(set(self.eos_ids) | set(stop_ids)), device=self.device)
                for start in range(0, len(indices), self.max_num_seqs):
                    chunk = indices[start:start + self.max_num_seqs]
                    prompts = [requests[i].prompt_token_ids for i in chunk]
                    batch = yield from self._generate_batch(prompts, params, stop, generator)
                    for i, out in zip(chunk, batch):
                        outputs[i] = out
                    bar.update(len(chunk))
        return outputs  # type: ignore[return-value]

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams, stop: torch.Tensor,
                        generator: torch.Generator | None) -> Steps[list[EngineOutput]]:
        unique: dict[tuple[int, ...], int] = {}
        row_to_unique = [unique.setdefault(tuple(p), len(unique)) for p in prompts]
        width = max(len(p) for p in unique)
        input_ids = torch.full((len(unique), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(unique), width), dtype=torch.long)
        for p, u in unique.items():
            input_ids[u, width - len(p):] = torch.tensor(p)
            attention[u, width - len(p):] = 1
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        positions = positions_from_mask(attention)
        out = forward_last_logits(self.model, 1, input_ids=input_ids, attention_mask=attention,
                                  position_ids=positions, use_cache=True)
        cache, logits = out.cache, out.logits[:, -1]
        yield

        # fan each prompt's cache out to its samples
        fan = torch.tensor(row_to_unique, device=self.device)
        cache.reorder_cache(fan)
        logits, attention = logits[fan], attention[fan]
        next_pos = positions[fan, -1] + 1
        live = torch.arange(len(prompts), device=self.device)  # batch slot -> row
        seen = None  # repetition penalty: [live rows, V], the tokens of each row's prompt and response
        if params.repetition_penalty != 1.0:
            seen = torch.zeros((len(unique), logits.shape[-1]), dtype=torch.bool, device=self.device)
            for p, u in unique.items():
                seen[u, torch.tensor(p, device=self.device)] = True
            seen = seen[fan]
        matcher = StopStringMatcher(self.tokenizer, params.stop, len(prompts)) if params.stop else None

        responses: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        tops: list[list[TopLogprobs]] = [[] for _ in prompts]
        reasons: list[StopReason] = ["length"] * len(prompts)
        matched: list[str | None] = [None] * len(prompts)
        for step in range(params.max_generate_length):
            sampled = sample_next(logits, params, generator, seen)
            tokens = sampled.tokens
            finished = torch.isin(tokens, stop).tolist()
            for slot, (row, tok, lp) in enumerate(zip(live.tolist(), tokens.tolist(), sampled.logprobs.tolist())):
                responses[row].append(tok)
                logprobs[row].append(lp)
                if finished[slot]:
                    reasons[row] = "stop"
                elif matcher is not None and (hit := matcher.push(row, tok)) is not None:
                    reasons[row], matched[row], finished[slot] = "stop", hit, True
            if sampled.top_ids is not None and sampled.top_logprobs is not None:
                for row, ids, lps in zip(live.tolist(), sampled.top_ids.tolist(), sampled.top_logprobs.tolist()):
                    tops[row].append(list(zip(ids, lps)))
            if step == params.max_generate_length - 1 or all(finished):
                break
            if seen is not None:
                seen[torch.arange(len(tokens), device=self.device), tokens] = True
            if any(finished):
                keep = torch.tensor([not f for f in finished], device=self.device).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                tokens, attention, next_pos, live = tokens[keep], attention[keep], next_pos[keep], live[keep]
                seen = None if seen is None else seen[keep]
            attention = torch.cat([attention, attention.new_ones((attention.shape[0], 1))], dim=-1)
            out = forward_last_logits(self.model, 1, input_ids=tokens[:, None], attention_mask=attention,
                                      position_ids=next_pos[:, None], use_cache=True, **cache_kwargs(cache))
            logits = out.logits[:, -1]
            next_pos = next_pos + 1
            yield
        return [EngineOutput(response_ids=r, logprobs=lp, stop_reason=s, matched_stop=m,
                             top_logprobs=top if params.num_top_logprobs else None)
                for r, lp, s, m, top in zip(responses, logprobs, reasons, matched, tops)]
