"""Ridgeline's vLLM worker extension: weight loading inside vLLM's worker processes.

vLLM mixes the class named by ``worker_extension_cls`` into every worker (one per tensor-parallel
rank) and lets the engine's owner call its methods on all workers at once:

* in process: ``LLM.collective_rpc("ridgeline_load_weights", args=(pack_tensors(named),))``
  (what ``VLLMEngine.update_weights`` does). vLLM's msgpack transport of collective_rpc
  arguments does not rebuild tensors (they arrive as lists), so they travel packed: name, dtype,
  shape and raw bytes each, rebuilt with torch alone (no pickle, nothing executable);
* over HTTP, on a server started with ``VLLM_SERVER_DEV_MODE=1 vllm serve ...
  --worker-extension-cls ridgeline.inference.vllm_worker.RidgelineWorkerExtension``:
  ``POST /collective_rpc {"method": "ridgeline_init_receiver", "args": ["<json>"]}``. Arguments
  crossing HTTP must be plain strings, hence the JSON spec.

| method                              | what it does in each worker                                |
|-------------------------------------|------------------------------------------------------------|
| ``ridgeline_stage_weights(packed)`` | holds a batch of packed tensors for the next load            |
| ``ridgeline_load_weights(packed)``  | loads staged + packed tensors into the model; -> how many   |
| ``ridgeline_init_receiver(json)``   | joins Ridgeline's weight-sync group (``WeightReceiver``)     |
| ``ridgeline_receive_weights()``     | blocks for the trainer's next broadcast, loads it; -> version |
| ``ridgeline_weights_version()``     | version of the last weights received (0: none yet)           |
| ``ridgeline_close_receiver()``      | leaves the weight-sync group                                 |

Tensor parallelism: every worker of an engine holds its own receiver, so an engine with TP=N
takes N ranks of the weight-sync group. The ``rank`` in the spec is that of the engine's first
worker; worker ``i`` joins as ``rank + i`` (the spec's ``world_size`` counts every worker of every
engine, plus the trainer). With TP=1 the spec's rank is used as is.

This module is imported inside vLLM worker processes: it imports torch and the standard library only, and
Ridgeline's weight-sync module when a receiver is first built. vLLM refuses an extension whose
attribute names clash with the worker's own (``update_weights`` exists in 0.32), hence the
``ridgeline_`` prefix on every attribute.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Iterable

import torch


def pack_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[list[Any]]:
    """(name, tensor) pairs as msgpack-native [name, dtype name, shape, raw bytes] entries."""
    packed = []
    for name, tensor in named_tensors:
        t = tensor.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        packed.append([str(name), str(t.dtype).removeprefix("torch."), list(t.shape), raw])
    return packed


def unpack_tensors(packed: Iterable[Any]) -> list[tuple[str, torch.Tensor]]:
    """The inverse of `pack_tensors` (entries may arrive as tuples or lists)."""
    out = []
    for name, dtype_name, shape, raw in packed:
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"packed tensor {name!r} has an unknown dtype {dtype_name!r}")
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if len(raw) else torch.empty(0, dtype=torch.uint8)
        out.append((str(name), flat.view(dtype).reshape([int(d) for d in shape])))
    return out


def _refresh_tied_embeddings(model: torch.nn.Module) -> None:
    """Redo the post-load processing of unquantized embedding / LM-head layers that share their
    weight with another layer (tie_word_embeddings).

    vLLM's layer-wise reload processes only layers whose weights were loaded, and a tied LM head
    gets none (its weight arrives under the embedding's name). On vLLM's CPU backend that
    processing packs the LM head's GEMM weight, so without this the head keeps computing with
    the old embedding (measured: logprobs off by 3.6 after an embedding update). Elsewhere the
    unquantized processing does nothing, so this is cheap and safe; quantized layers are left
    alone (processing them twice would quantize twice)."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            owners.setdefault(id(weight), []).append(module)
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            if type(method).__name__ == "UnquantizedEmbeddingMethod":
                method.process_weights_after_loading(module)


class RidgelineWorkerExtension:
    """Mixed into each vLLM worker; ``self`` is the worker (``self.model_runner``, ``self.rank``)."""

    # -- in-process updates -------------------------------------------------------------------
    def ridgeline_stage_weights(self, packed: list[Any]) -> int:
        """Hold a batch of `pack_tensors` entries until the next `ridgeline_load_weights`, so a
        model sent in several messages is still loaded in one pass (see `_ridgeline_load`)."""
        staged = getattr(self, "_ridgeline_staged", None) or []
        staged.extend(unpack_tensors(packed))
        self._ridgeline_staged = staged
        return len(staged)

    def ridgeline_load_weights(self, packed: list[Any]) -> int:
        """Load the staged batches plus `packed` (Hugging Face names); returns how many tensors."""
        weights = (getattr(self, "_ridgeline_staged", None) or []) + unpack_tensors(packed)
        self._ridgeline_staged = None
        return self._ridgeline_load(weights)

    @torch.no_grad()
    def _ridgeline_load(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """Load a whole set of weights into this worker's model.

        Recent vLLM (0.32 here) post-processes weights after loading (its CPU backend repacks
        linear weights for oneDNN and drops their `weight_loader`), so a second plain
        `model.load_weights` fails or leaves a stale packed copy; the worker's `reload_weights`
        undoes that processing, loads, and redoes it, layer by layer. It expects every weight of a
        layer in one call, hence one call with the whole set. A vLLM without `reload_weights`
        loads with the model's `load_weights` (fused layers, tensor-parallel shards and tied
        weights are handled by it in both cases). The KV cache is untouched: the caller resets the
        prefix cache afterwards."""
        reload = getattr(self, "reload_weights", None)
        if callable(reload):
            # The reload warns "Failed to load weights" for every layer the set has no tensor
            # for by design (rotary caches, a tied LM head): expected here, so not shown.
            layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
            level = layerwise.level
            layerwise.setLevel(logging.ERROR)
            try:
                reload(weights_iterator=iter(weights), is_checkpoint_format=True)
            finally:
                layerwise.setLevel(level)
            _refresh_tied_embeddings(self.model_runner.get_model())
        else:
            self.model_runner.get_model().load_weights(weights=iter(weights))
        return len(weights)

    # -- updates broadcast by the trainer (remote or separate-process engines) -----------------
    def ridgeline_init_receiver(self, spec_json: str) -> int:
        """Join the weight-sync group described by ``spec_json`` (the fields of
        ``ridgeline.inference.weight_transport.GroupSpec`` as a JSON object); returns this worker's
        rank in that group. A receiver from an earlier group is closed first."""
        from ridgeline.inference.weight_transport import GroupSpec, WeightReceiver

        fields = json.loads(spec_json)
        fields["rank"] = int(fields["rank"]) + int(getattr(self, "rank", 0) or 0)
        self.ridgeline_close_receiver()
        self._ridgeline_receiver = WeightReceiver(GroupSpec(**fields))
        return fields["rank"]

    def ridgeline_receive_weights(self) -> int:
        """Receive the trainer's next broadcast, load it into the model, return its version."""
        receiver = getattr(self, "_ridgeline_receiver", None)
        if receiver is None:
            raise RuntimeError("ridgeline_receive_weights called before ridgeline_init_receiver: "
                               "join the weight-sync group first")
        named = receiver.receive()
        self._ridgeline_load(named)
        del named  # views into the receive buffer; free it before the next step
        return int(receiver.version)

    def ridgeline_weights_version(self) -> int:
        receiver = getattr(self, "_ridgeline_receiver", None)
        return 0 if receiver is None else int(receiver.version)

    def ridgeline_close_receiver(self) -> None:
        receiver = getattr(self, "_ridgeline_receiver", None)
        if receiver is not None:
            receiver.close()
        self._ridgeline_receiver = None
