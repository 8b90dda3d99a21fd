"""An engine process for IPC handoff tests (tests/test_ipc_transport.py on this CPU,
tests/gpu/test_ipc_gpu.py on a GPU): a spawned process holding a bf16 HFEngine that pulls the
trainer's buckets over a pair of queues, as an engine actor pulls them from its policy rank."""

from __future__ import annotations

import io
import os
import time

import torch
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from ridgeline.distributed.weight_sync import probe_tokens
from ridgeline.inference.ipc_transport import IPCReceiver, IPCTransfer
from ridgeline.models.tiny import build_char_tokenizer

REPLY_TIMEOUT_S = 180.0


def llama_config(**shape) -> dict:
    """LlamaConfig kwargs of a random Llama the char tokenizer can drive (tied embeddings)."""
    tok = build_char_tokenizer()
    return dict(vocab_size=max(len(tok), shape.pop("vocab_size", 0)), bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True, **shape)


def random_llama(config: dict, seed: int) -> LlamaForCausalLM:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(LlamaConfig(**config))


def _to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _pull(to_child, to_parent):
    """The engine's side of a handoff: ask the trainer for bucket after bucket."""
    index, count = 0, 1
    while index < count:
        to_parent.put(("bucket", index))
        bucket = to_child.get()
        count, index = bucket.count, index + 1
        yield bucket


def engine_main(device: str, config: dict, to_child, to_parent) -> None:
    """The engine process: a bf16 HFEngine on a random Llama seeded apart from the trainer's.
    Per command: ("raw", _) -> reply copies of the received tensors; ("engine", sleep_level) ->
    sleep at that level first (0: stay awake), wake the weights, load the handoff into the engine,
    wake the KV cache, reply its state dict and its probe logprobs. Every reply has the version
    and the seconds the handoff took."""
    from ridgeline.inference.hf_engine import HFEngine

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    engine = HFEngine(random_llama(config, seed=1).to(device), tok, dtype=torch.bfloat16)
    receiver = IPCReceiver()
    to_parent.put(("ready", b""))
    while (cmd := to_child.get()) is not None:
        kind, level = cmd
        reply = {}
        start = time.perf_counter()
        if kind == "raw":
            reply["tensors"] = {name: t.cpu().clone() for name, t in receiver.weights(_pull(to_child, to_parent))}
        else:
            if level:
                engine.sleep(level)
                engine.wake_up(("weights",))
            engine.update_weights(receiver.weights(_pull(to_child, to_parent)))
            engine.wake_up(("kv_cache",))
        reply["seconds"] = time.perf_counter() - start
        if kind == "engine":
            reply["tensors"] = {k: v.cpu().clone() for k, v in engine.model.state_dict().items()}
            reply["probe"] = torch.tensor(engine.score(*probe_tokens(tok)))
        reply["version"] = receiver.version
        to_parent.put(("done", _to_bytes(reply)))


def start_engine(device: str, config: dict):
    """A spawned `engine_main`: (process, to_child, to_parent)."""
    ctx = mp.get_context("spawn")
    to_child, to_parent = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=engine_main, args=(device, config, to_child, to_parent), daemon=True)
    proc.start()
    assert to_parent.get(timeout=REPLY_TIMEOUT_S)[0] == "ready"
    return proc, to_child, to_parent


def hand_over(transfer: IPCTransfer, to_child, to_parent, command: tuple[str, int]) -> dict:
    """Send `command`, serve the engine's bucket requests from `transfer`, close it; the reply."""
    to_child.put(command)
    with transfer:
        while True:
            kind, value = to_parent.get(timeout=REPLY_TIMEOUT_S)
            if kind == "bucket":
                to_child.put(transfer.bucket(value))
            else:
                return torch.load(io.BytesIO(value), weights_only=True)


def stop_engine(proc, to_child) -> None:
    to_child.put(None)
    proc.join(timeout=30)
    if proc.is_alive():
        proc.kill()
        proc.join()
