"""CUDA IPC weight handoff and engine sleep on one GPU (run by `make test-gpu`; skipped without
CUDA). The trainer (this process) hands a random Llama of SmolLM2-135M's shape to an engine
process on the same GPU through `IPCSender`; the engine's bf16 weights must equal the trainer's
cast bit for bit, its probe logprobs must agree with the trainer's, and the handoff's seconds
per GB is printed. Written without a GPU at hand: checked by reading, not yet run."""

from __future__ import annotations

import pytest
import torch

from ipc_engine import hand_over, llama_config, random_llama, start_engine, stop_engine
from ridgeline.distributed.weight_sync import check_probe, probe_logprobs, probe_tolerance
from ridgeline.inference.ipc_transport import GIB, IPCSender
from ridgeline.models.tiny import build_char_tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# SmolLM2-135M's shape (its config.json), random weights: 135M parameters, 270 MB in bf16
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rope_theta=100000.0,
                    rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def trainer():
    model = random_llama(llama_config(**SMOLLM2_135M), seed=0).to("cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # as a training step would move them
    return model


@pytest.mark.parametrize("threshold_gib,sleep_level", [(1.0, 0), (32 / 1024, 2)])
def test_cuda_ipc_handoff_is_bit_equal_and_passes_the_probe(trainer, threshold_gib, sleep_level, figures):
    """The default 1 GiB threshold (one bucket), and 32 MiB buckets into an engine whose weights
    sleep(level=2) dropped (woken first, refilled by the handoff)."""
    proc, to_child, to_parent = start_engine("cuda", llama_config(**SMOLLM2_135M))
    try:
        sender = IPCSender(torch.bfloat16, int(threshold_gib * GIB), torch.device("cuda", torch.cuda.current_device()))
        transfer = sender.start(trainer.named_parameters(), version=3)
        reply = hand_over(transfer, to_child, to_parent, ("engine", sleep_level))
    finally:
        stop_engine(proc, to_child)
    assert reply["version"] == 3
    for name, p in trainer.named_parameters():
        assert torch.equal(reply["tensors"][name], p.detach().to(torch.bfloat16).cpu()), name
    tok = build_char_tokenizer()
    diff = check_probe(probe_logprobs(trainer, tok), reply["probe"], probe_tolerance(torch.bfloat16), version=3)
    gb = transfer.nbytes / 1e9
    print(f"\nCUDA IPC handoff: {transfer.nbytes / 1e6:.0f} MB in {transfer.count} bucket(s) of <= "
          f"{threshold_gib:g} GiB: {reply['seconds']:.3f} s, {reply['seconds'] / gb:.3f} s/GB; probe mean |diff| "
          f"{diff:.3g}")
    figures.record(f"cuda_ipc_handoff_{threshold_gib:g}GiB", model="SmolLM2-135M shape, bf16",
                   megabytes=transfer.nbytes / 1e6, buckets=float(transfer.count), seconds=reply["seconds"],
                   seconds_per_gb=reply["seconds"] / gb, probe_mean_abs_diff=diff)


def test_engine_sleep_frees_its_gpu_memory_and_wake_restores_generation():
    """HFEngine.sleep(1) offloads the weights to pinned host memory and sleep(2) drops them: the
    device memory the engine held goes back (>= 90%), and after waking (and, for level 2, an
    update) it generates exactly as before."""
    from ridgeline.inference.hf_engine import HFEngine
    from ridgeline.inference.types import EngineRequest, SamplingParams

    tok = build_char_tokenizer()
    source = random_llama(llama_config(**SMOLLM2_135M), seed=0)
    requests = [EngineRequest(tok("The quick brown fox")["input_ids"], SamplingParams(max_generate_length=16))] * 4
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    engine = HFEngine(source.to("cuda"), tok, dtype=torch.bfloat16)
    source.to("cpu")
    held = torch.cuda.memory_allocated() - base
    before = [o.response_ids for o in engine.generate(requests, seed=0)]
    for level in (1, 2):
        engine.sleep(level)
        freed = held - (torch.cuda.memory_allocated() - base)
        assert freed >= 0.9 * held, (level, freed, held)
        engine.wake_up(("weights",))
        if level == 2:
            engine.update_weights(source.named_parameters())
        engine.wake_up(("kv_cache",))
        assert [o.response_ids for o in engine.generate(requests, seed=0)] == before
