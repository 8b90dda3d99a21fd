"""The colocated Ray path on one GPU (run by `make test-gpu`; skipped without CUDA): one FSDP2
policy rank (NCCL, a world of one) and its embedded engine in another process share the GPU, in
the order Ray runs them (tests/colocated_path.py: the actors' own classes, without Ray, which the
GPU image lacks). Memory is measured as the caching allocator's reservation, which is what the
other process on the GPU can or cannot have, not only as allocated tensors:

- the engine, asleep at level 2 before the rank starts, reserves at most 10% of what it reserved
  when built;
- after a training step the rank holds no gradients, its parameters and AdamW's moments wait on
  the host (at most 64 MiB allocated) and its cache reserves at most 128 MiB beyond its live
  tensors (issue 36: it kept its peak before);
- after the CUDA IPC handoff (gathered bucket by bucket) the rank reserves at most 128 MiB more
  than after set-up; the engine then passes the probe and generates.

Written without a GPU at hand; its CPU twin (tests/test_gpu_path.py) runs the same path here."""

from __future__ import annotations

import pytest
import torch

from colocated_path import colocated_overrides, run_colocated
from ridgeline.config import load_config
from ridgeline.distributed.weight_sync import check_probe, probe_tolerance
from ridgeline.inference.types import EngineRequest, SamplingParams

pytestmark = pytest.mark.gpu

MIB = 2**20
MODEL = "random://smollm2-135m"


def test_colocated_rank_and_engine_hand_the_gpu_back_and_forth(tmp_path, figures):
    cfg = load_config(colocated_overrides(tmp_path, "cuda", f"trainer.policy.model.path={MODEL}"))
    run = run_colocated(cfg, [EngineRequest([5, 6, 7, 8], SamplingParams(max_generate_length=8))] * 4)
    gib = {f"{who}_{stage.replace(' ', '_')}_{kind}_gib": value / 2**30
           for who, stages in (("engine", run.engine), ("rank", run.rank))
           for stage, kinds in stages.items() for kind, value in kinds.items()}
    print("\ncolocated FSDP2 rank + embedded engine on one GPU (GiB):",
          ", ".join(f"{k}={v:.3f}" for k, v in gib.items()))
    figures.record("colocated_fsdp2_rank_and_hf_engine", model=f"{MODEL} bf16 engine, fp32 rank", **gib)
    built, asleep = run.engine["built"]["reserved"], run.engine["asleep"]["reserved"]
    assert built > 0.9 * 134_515_008 * 2  # the bf16 weights were reserved by the engine
    assert asleep <= 0.10 * built, (asleep, built)
    assert run.order == ["engine built", "engine asleep", "rank set up"]
    trained = run.rank["trained"]
    assert run.grads_left == 0
    assert trained["allocated"] <= 64 * MIB, trained  # parameters and AdamW's moments wait on the host
    assert trained["reserved"] <= trained["allocated"] + 128 * MIB, trained
    assert run.rank["synced"]["reserved"] <= run.rank["set up"]["reserved"] + 128 * MIB, run.rank
    assert run.engine["awake"]["reserved"] >= 0.9 * 134_515_008 * 2
    check_probe(torch.tensor(run.trainer_probe), torch.tensor(run.engine_probe), probe_tolerance(torch.bfloat16),
                version=1)
    assert len(run.responses) == 4 and all(run.responses)
