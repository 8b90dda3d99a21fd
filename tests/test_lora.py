"""LoRA on the policy (trainer.policy.model.lora.*, docs/lora.md), on the tiny preset: config
errors; only the adapters train; the reference is the frozen base without a second copy; the engine
runs the merged weights and the probe agrees; checkpoints hold adapters and resume exactly; exports
are merged Hugging Face folders; a real `ridgeline train` run with LoRA."""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from ridgeline import cli
from ridgeline.config import ConfigError, load_config
from ridgeline.data import encode_chat_prompt
from ridgeline.distributed.weight_sync import (StaleWeightsError, check_probe, probe_logprobs, probe_tokens,
                                               probe_tolerance)
from ridgeline.models.forward import activation_checkpointing_on
from ridgeline.models.loading import ModelSpec, load_model
from ridgeline.models.lora import LoraSettings, adapter_layout, wrap
from ridgeline.models.value_model import load_value_model
from ridgeline.trainer import checkpoint
from ridgeline.trainer.trainer import Trainer
from ridgeline.training.build import load_training_model
from ridgeline.training.batch import build_training_batch
from ridgeline.training.build import build_policy_worker
from ridgeline.training.critic_worker import CriticWorker
from ridgeline.training.logprobs import response_logprobs
from ridgeline.training.worker import batch_logprobs
from ridgeline.training.parallel import SingleProcess

LORA = "trainer.policy.model.lora"
CRITIC_LORA = "trainer.critic.model.lora"
WITH_CRITIC = ["trainer.critic.model.path=tiny://llama", "trainer.algorithm.advantage_estimator=gae",
               "trainer.critic_mini_batch_size=8"]   # PPO on the tiny preset


def tiny(out, *extra):
    """Two steps of the tiny preset with LoRA rank 8 (alpha 16: scaling 2) and the KL loss, so a
    reference model is needed."""
    return load_config(["+experiment=tiny", f"trainer.export_path={out}", "data.prepare.num_train=32",
                        "data.prepare.num_val=4", "trainer.eval_before_train=false", "trainer.logger=jsonl",
                        f"{LORA}.rank=8", *extra])


def live_models() -> set[int]:
    """Causal LMs alive in this process (not their inner decoders, also PreTrainedModels)."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance on every object touches deprecated torch aliases
        warnings.simplefilter("ignore")
        return {id(m) for m in gc.get_objects() if isinstance(m, PreTrainedModel) and hasattr(m, "lm_head")}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished LoRA run: a checkpoint after each of its 2 steps, an HF export after step 2.
    `models_before` holds the models alive before it was built."""
    out = tmp_path_factory.mktemp("lora")
    before = live_models()
    trainer = Trainer.from_config(tiny(out, "trainer.ckpt_interval=1", "trainer.hf_save_interval=2"))
    trainer.models_before = before
    trainer.train()
    return trainer


def base_model(trainer) -> PreTrainedModel:
    """The tiny base model as a run without LoRA loads it (eager attention, as the training
    workers load it for short rows: bit-equal comparisons need the same kernels)."""
    return load_training_model(trainer.cfg, ModelSpec("tiny://llama", seed=trainer.cfg.trainer.seed), torch.float32,
                               trainer.tokenizer, torch.device("cpu"))


def probe_batch(tokenizer):
    """Four rows, two prompts sharing their responses' group (the shared-prompt path runs too)."""
    prompts = [encode_chat_prompt(tokenizer, [{"role": "user", "content": t}]) for t in ("1+2=", "13+24=")]
    responses = [tokenizer.encode(t) for t in ("3<|im_end|>", "37<|im_end|>", "4", "36<|im_end|>")]
    return build_training_batch([prompts[0], prompts[0], prompts[1], prompts[1]], responses,
                                [[1] * len(r) for r in responses], [1.0, 0.0, 0.0, 1.0], ["a", "a", "b", "b"],
                                None, tokenizer.pad_token_id)


def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """The merged weights of a LoRA model under the plain model's names (tied names included)."""
    return dict(adapter_layout(model).merged(model.state_dict()))


def lora_tensors(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


# ------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("overrides, key", [
    ([f"{LORA}.rank=-1"], f"{LORA}.rank"),
    ([f"{LORA}.alpha=0"], f"{LORA}.alpha"),
    ([f"{LORA}.dropout=1.0"], f"{LORA}.dropout"),
    ([f"{LORA}.dropout=-0.1"], f"{LORA}.dropout"),
    ([f"{LORA}.target_modules=[]"], f"{LORA}.target_modules"),
    ([f"{LORA}.rank=8", "trainer.update_ref_every_epoch=true"], "trainer.update_ref_every_epoch"),
    (["+trainer.ref.model.lora.rank=8"], "trainer.ref.model.lora"),
    # the critic's keys are the policy's, with the same rules, and need a critic
    ([f"{CRITIC_LORA}.alpha=-1", *WITH_CRITIC], f"{CRITIC_LORA}.alpha"),
    ([f"{CRITIC_LORA}.init_method=pissa", *WITH_CRITIC], f"{CRITIC_LORA}.init_method"),
    ([f"{CRITIC_LORA}.rank=8"], f"{CRITIC_LORA}.rank"),
    ([f"+{CRITIC_LORA}.lora_sync_path=/tmp/x", *WITH_CRITIC], f"{CRITIC_LORA}.lora_sync_path"),  # the policy's key only
])
def test_bad_lora_settings_are_config_errors_naming_the_key_and_the_fix(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(["+experiment=tiny", *overrides])
    assert len(err.value.problems) == 1, err.value.problems
    assert err.value.problems[0].startswith(key) and "Fix: " in err.value.problems[0]


def test_lora_defaults_and_a_list_of_targets_are_accepted():
    cfg = load_config(["+experiment=tiny", f"{LORA}.rank=4", f"{LORA}.target_modules=[q_proj,v_proj]"])
    assert dataclasses.asdict(cfg.trainer.policy.model.lora) == {"rank": 4, "alpha": 16.0, "dropout": 0.0,
                                                   "target_modules": ["q_proj", "v_proj"], "exclude_modules": None,
                                                   "init_method": "kaiming",
                                                   "lora_sync_path": "/tmp/skyrl_lora_sync"}
    assert load_config(["+experiment=tiny"]).trainer.policy.model.lora.rank == 0  # off by default


def test_adapting_a_tied_output_head_is_refused(tiny_model):
    with pytest.raises(ValueError, match=r"adapts lm_head, whose weight is tied to \['model.embed_tokens.weight'\]"), \
            pytest.warns(UserWarning, match="tie_word_embeddings=True"):  # peft only warns
        wrap(tiny_model, LoraSettings(rank=4, target_modules=("q_proj", "lm_head")), seed=0)


def test_merged_weights_are_peft_merge_bit_for_bit_for_linear_and_embedding_adapters(tiny_tokenizer):
    """`AdapterLayout.merged` (the weights engines and exports get, also from gathered shards) on an
    untied model whose embeddings, output head and q_proj carry adapters."""
    from ridgeline.models.architectures import seeded_model
    from ridgeline.models.tiny import tiny_config

    config = tiny_config("llama", tiny_tokenizer)
    config.tie_word_embeddings = False
    model = wrap(seeded_model(config, 0), LoraSettings(rank=4, alpha=4.0, target_modules=("embed_tokens", "lm_head",
                                                                                           "q_proj")), seed=0)
    with torch.no_grad():  # B A = 0 would make the comparison trivial
        gen = torch.Generator().manual_seed(3)
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
    merged = merged_state_dict(model)
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(merged[name], tensor), name
    moved = {n for n, t in merged.items() if not torch.equal(t, seeded_model(config, 0).state_dict()[n])}
    assert moved == {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.weight",
                     "model.layers.1.self_attn.q_proj.weight"}


# ------------------------------------------------------------------------------------ training
@pytest.mark.integration
def test_only_the_adapters_train_and_the_base_weights_stay_bit_identical(run):
    model = run.workers.policy.model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    # all-linear on 2 Llama layers: q, k, v, o, gate, up, down -> 7 x 2 layers x (A, B)
    assert len(trainable) == 28 and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if n in trainable)
    optimized = {id(p) for g in run.workers.policy.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for n, p in model.named_parameters() if n in trainable}
    # the base never moved: a checkpoint-free comparison with a freshly built base model
    fresh = base_model(run).state_dict()
    merged_names = merged_state_dict(model)
    base = {n.replace("base_model.model.", "").replace(".base_layer", ""): p
            for n, p in model.named_parameters() if "lora_" not in n}
    assert set(base) | {"lm_head.weight"} == set(fresh) == set(merged_names)
    for name, p in base.items():
        assert torch.equal(p, fresh[name]), name
    # the adapters did: B starts at 0 and A at its seeded draw, both trained for 2 steps
    b = [p for n, p in model.named_parameters() if ".lora_B." in n]
    assert all(float(p.detach().abs().max()) > 0 for p in b)
    rows = [r for r in run.history if "policy/policy_loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["policy/policy_update_steps"] == 1.0 for r in rows)
    assert rows[0]["policy/policy_kl"] == 0.0 < rows[1]["policy/policy_kl"]  # the base is the reference


def test_activation_checkpointing_gives_the_adapters_the_same_gradients(tmp_path, tiny_tokenizer):
    grads = {}
    for checkpointing in (False, True):
        cfg = tiny(tmp_path, f"trainer.gradient_checkpointing={str(checkpointing).lower()}")
        tokenizer = tiny_tokenizer
        worker = build_policy_worker(cfg, tokenizer, training_batches=1)
        model = worker.model
        assert activation_checkpointing_on(model) is checkpointing
        with torch.no_grad():  # a trained-looking adapter, so A gets gradient too (B = 0 blocks it)
            gen = torch.Generator().manual_seed(1)
            for n, p in model.named_parameters():
                if ".lora_B." in n:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        batch = probe_batch(tokenizer)
        model.train()
        lp, _ = response_logprobs(model, batch.sequences, batch.attention_mask, batch.response_width)
        (lp * batch.response_mask).sum().backward()
        grads[checkpointing] = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert len(grads[True]) == 28
    for name, g in grads[False].items():
        assert g is not None and float(g.abs().max()) > 0, name
        assert torch.allclose(grads[True][name], g, atol=1e-6, rtol=1e-5), name


# ------------------------------------------------------------------------------------ reference
def test_the_reference_is_the_base_model_without_a_second_copy(run):
    assert run.workers.ref.model is run.workers.policy.model
    # the run made two models: the policy's (under its adapters) and the engine's merged copy
    assert live_models() - run.models_before == {id(run.workers.policy.model.get_base_model()), id(run.engine.model)}
    batch = probe_batch(run.tokenizer)
    ref = run.workers.ref.compute_logprobs(batch)
    fresh = batch_logprobs(base_model(run), batch, 64, 1.0, None, SingleProcess())
    assert torch.equal(ref, fresh)  # fp32: the adapter-disabled forward is the base's, bit for bit
    policy = run.workers.policy.compute_logprobs(batch)
    assert float((policy - ref).abs().max()) > 1e-3  # while the policy itself has moved
    assert sum(p.requires_grad for p in run.workers.policy.model.parameters()) == 28  # the ref froze nothing


# ------------------------------------------------------------------------------------ engine
def test_the_engine_runs_the_merged_weights_and_the_probe_passes(run):
    reference = copy.deepcopy(run.workers.policy.model).merge_and_unload().state_dict()  # peft's own merge
    engine = run.engine.model.state_dict()
    assert set(engine) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(engine[name], tensor), name
    tokenizer = run.tokenizer
    trainer_lp = probe_logprobs(run.workers.policy.model, tokenizer)  # with the adapters
    engine_lp = torch.tensor(run.engine.score(*probe_tokens(tokenizer)))
    tolerance = probe_tolerance(run.engine.dtype)
    assert tolerance.statistic == "max" and check_probe(trainer_lp, engine_lp, tolerance, version=2) < 1e-5
    # the probe does see weights without the adapters: the base model fails it
    base_lp = probe_logprobs(base_model(run), tokenizer)
    with pytest.raises(StaleWeightsError):
        check_probe(trainer_lp, base_lp, tolerance, version=2)


# ------------------------------------------------------------------------------------ checkpoints
def test_a_checkpoint_holds_the_adapters_and_their_optimizer_state(run):
    folder = run.checkpointer.last
    assert folder.name == "global_step_2"
    policy = folder / "policy"
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= {p.name for p in policy.iterdir()}
    assert not list(policy.glob("model*.safetensors"))
    saved = load_file(str(policy / "adapter_model.safetensors"))
    assert len(saved) == 28 and all(".lora_A." in k or ".lora_B." in k for k in saved)
    live = {n.replace(".default", ""): p for n, p in run.workers.policy.model.named_parameters() if "lora_" in n}
    assert all(torch.equal(saved[k], live[k]) for k in saved)
    config = json.loads((policy / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["bias"], config["task_type"]) == (8, 16.0, "none", "CAUSAL_LM")
    # peft writes "all-linear" out: every linear layer of the 2 blocks, not the output head
    assert sorted(config["target_modules"]) == sorted(f"model.layers.{i}.{m}" for i in (0, 1) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj"))
    optim = torch.load(folder / "policy_optim.pt", weights_only=True)["optimizer"]
    shapes = sorted(tuple(s["exp_avg"].shape) for s in optim["state"].values())
    assert shapes == sorted(tuple(p.shape) for p in live.values())
    fingerprint = json.loads((folder / "fingerprint.json").read_text())
    assert fingerprint[LORA] == {"rank": 8, "alpha": 16.0, "target_modules": "all-linear"}


def test_resume_from_a_checkpoint_is_exact(run, tmp_path):
    ckpt = run.checkpointer.last.parent / "global_step_1"
    resumed = Trainer.from_config(tiny(tmp_path, "trainer.resume_mode=from_path", f"trainer.resume_path={ckpt}"))
    assert resumed.run.global_step == 1
    resumed.train()
    for a, b in ((run.workers.policy.model, resumed.workers.policy.model), (run.engine.model, resumed.engine.model)):
        for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(p, q), name
    sa, sb = run.workers.policy.optimizer.state_dict(), resumed.workers.policy.optimizer.state_dict()
    assert all(torch.equal(v, sb["state"][i][k]) for i, s in sa["state"].items() for k, v in s.items())

    def rows(trainer):
        kept = [{k: v for k, v in r.items() if not k.startswith(("timing/", "throughput/", "memory/"))
                 and not k.endswith("_seconds")}
                for r in trainer.history if r["step"] >= 2]
        return [r for r in kept if len(r) > 1]  # not the timing-only rows of checkpoints and exports
    assert rows(resumed) == rows(run) and len(rows(run)) == 2  # step 2 and the final eval, exactly


def test_resuming_a_lora_checkpoint_without_lora_is_refused(run, tmp_path):
    cfg = load_config(["+experiment=tiny", f"trainer.export_path={tmp_path}", "data.prepare.num_train=32",
                       "data.prepare.num_val=4", "trainer.resume_mode=from_path",
                       f"trainer.resume_path={run.checkpointer.last}"])
    with pytest.raises(checkpoint.CheckpointError, match=r"trainer.policy.model.lora: \{.*'rank': 8.*\} -> None"):
        Trainer.from_config(cfg)  # the run's identity says so before any model loads
    cfg.trainer.resume_ignore_config_changes = True
    with pytest.raises(checkpoint.CheckpointError, match="holds LoRA adapters.*Fix: "):
        Trainer.from_config(cfg)  # and the weights do when told to go on


# ------------------------------------------------------------------------------------ exports
def test_exports_are_merged_weights_that_plain_transformers_loads(run, tmp_path):
    assert checkpoint.export_checkpoint(run.cfg.trainer.ckpt_path, tmp_path / "out") == run.checkpointer.last
    merged = merged_state_dict(run.workers.policy.model)
    batch = probe_batch(run.tokenizer)
    run.workers.policy.model.eval()
    with torch.no_grad():
        ours = run.workers.policy.model(input_ids=batch.sequences, attention_mask=batch.attention_mask).logits
    run.workers.policy.model.train()
    for folder in (run.run_dir / "final_model", Path(run.cfg.trainer.exports_dir) / "global_step_2" / "policy",
                   tmp_path / "out" / "policy"):
        assert not list(folder.glob("adapter_*")), folder
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        assert type(model).__name__ == "LlamaForCausalLM" and model.config.use_cache
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, merged[name]), (folder, name)
        with torch.no_grad():
            theirs = model(input_ids=batch.sequences, attention_mask=batch.attention_mask).logits
        real = batch.attention_mask.bool()  # pad positions' logits are kernel-dependent (eager vs SDPA)
        assert torch.allclose(theirs[real], ours[real], atol=1e-5, rtol=0), (folder, float((theirs - ours)[real].abs().max()))


def test_eval_scores_a_lora_checkpoint_as_the_trainer_did(run, tmp_path):
    from ridgeline.entrypoints.eval import evaluate_model
    from ridgeline.tracking.dumps import read_eval_dump

    adapters = evaluate_model(run.cfg, checkpoint=run.checkpointer.last, output=tmp_path / "adapters")
    exported = evaluate_model(run.cfg, checkpoint=run.run_dir / "final_model", output=tmp_path / "final")
    samples = [read_eval_dump(report.output) for report in (adapters, exported)]
    assert samples[0] == samples[1] and len(samples[0]) > 0
    final_eval = next(r for r in reversed(run.history) if "eval/all/pass_at_1" in r)
    scores = {k: v for k, v in adapters.metrics.items() if k.startswith("eval/")}
    assert scores and scores == {k: v for k, v in final_eval.items() if k.startswith("eval/")}


# ------------------------------------------------------------------------------------ a real run
def test_ridgeline_train_with_lora_learns_through_the_adapters(tmp_path):
    assert cli.main(["train", "+experiment=tiny", f"trainer.export_path={tmp_path}", "data.prepare.num_train=48",
                     "trainer.eval_before_train=false", "trainer.logger=jsonl", f"{LORA}.rank=8",
                     f"{LORA}.alpha=16", f"{LORA}.dropout=0.05", "trainer.gradient_checkpointing=true"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "tiny" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "policy/policy_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        for key in ("policy/policy_loss", "policy/final_loss", "policy/policy_kl", "policy/raw_grad_norm",
                    "reward/avg_raw_reward", "policy/policy_entropy"):
            assert torch.isfinite(torch.tensor(r[key])), (r["step"], key)
        assert r["policy/raw_grad_norm"] > 0 and r["policy/skipped_steps"] == 0
    # the final model is the merged policy: its adapted weights moved away from the base, the rest did not
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny" / "final_model", dtype=torch.float32)
    fresh = load_model(ModelSpec("tiny://llama", seed=42), torch.float32).state_dict()
    moved = {n for n, t in final.state_dict().items() if not torch.equal(t, fresh[n])}
    assert moved == {n for n in fresh if n.endswith("proj.weight")}  # all-linear: q k v o gate up down


# ------------------------------------------------------------------------------------ the critic
@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
    """PPO on the tiny preset with a full fine-tuned policy and a LoRA critic (rank 4, alpha 8),
    two steps, a checkpoint after each."""
    out = tmp_path_factory.mktemp("lora_critic")
    trainer = Trainer.from_config(critic_lora(out, "trainer.ckpt_interval=1"))
    trainer.train()
    return trainer


def critic_lora(out, *extra):
    return load_config(["+experiment=tiny", f"trainer.export_path={out}", "data.prepare.num_train=32",
                        "data.prepare.num_val=4", "trainer.eval_before_train=false", "trainer.logger=jsonl",
                        *WITH_CRITIC, f"{CRITIC_LORA}.rank=4", f"{CRITIC_LORA}.alpha=8", *extra])


def test_the_critic_trains_its_adapters_and_its_whole_value_head(ppo_run):
    critic = ppo_run.workers.critic
    trainable = {n for n, p in critic.model.named_parameters() if p.requires_grad}
    assert {n for n in trainable if "lora_" not in n} == {"value_head.weight", "value_head.bias"}
    assert len(trainable) == 30 and all(n.startswith("backbone.base_model.model.layers.") for n in trainable
                                        if "lora_" in n)  # all-linear: 7 x 2 layers x (A, B) on the backbone
    optimized = {id(p) for g in critic.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for n, p in critic.model.named_parameters() if n in trainable}
    assert all(p.dtype == torch.float32 for n, p in critic.model.named_parameters() if n in trainable)
    fresh = load_value_model(ModelSpec("tiny://llama", seed=ppo_run.cfg.trainer.seed), torch.float32, ppo_run.tokenizer)
    frozen = {critic.adapters.plain_name(n): p for n, p in critic.model.named_parameters() if n not in trainable}
    assert set(frozen) == {n for n, _ in fresh.backbone.named_parameters(prefix="backbone")}
    assert all(torch.equal(p, fresh.state_dict()[n]) for n, p in frozen.items())  # the base never moved
    assert not torch.equal(critic.model.head.weight, fresh.head.weight)  # the head did, as a whole layer
    assert ppo_run.workers.policy.adapters is None  # the policy trains in full beside it
    rows = [r for r in ppo_run.history if "critic/value_loss" in r]
    assert len(rows) == 2 and all(r["critic/raw_grad_norm"] > 0 and r["critic/skipped_steps"] == 0 for r in rows)


@pytest.mark.integration
def test_a_lora_critic_checkpoint_holds_adapters_and_head_and_resumes_exactly(ppo_run, tmp_path):
    folder = ppo_run.checkpointer.last
    critic = folder / "critic"
    assert {p.name for p in critic.glob("*.safetensors")} == {"adapter_model.safetensors", "value_head.safetensors"}
    config = json.loads((critic / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["task_type"]) == (4, 8.0, None)
    assert json.loads((folder / "fingerprint.json").read_text())[CRITIC_LORA] == {
        "rank": 4, "alpha": 8.0, "target_modules": "all-linear"}
    resumed = Trainer.from_config(critic_lora(tmp_path, "trainer.resume_mode=from_path",
                                              f"trainer.resume_path={folder.parent / 'global_step_1'}"))
    resumed.train()
    for a, b in ((ppo_run.workers.critic.model, resumed.workers.critic.model),
                 (ppo_run.workers.policy.model, resumed.workers.policy.model)):
        for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(p, q), name

    def step_2(trainer) -> dict:
        row = next(r for r in trainer.history if r["step"] == 2 and "critic/value_loss" in r)
        return {k: v for k, v in row.items() if k.startswith(("critic/", "policy/"))}
    assert step_2(resumed) == step_2(ppo_run)
    with pytest.raises(checkpoint.CheckpointError, match=r"trainer.critic.model.lora: .*'rank': 4.* -> .*'rank': 2"):
        Trainer.from_config(critic_lora(tmp_path / "other", f"{CRITIC_LORA}.rank=2", "trainer.resume_mode=from_path",
                                        f"trainer.resume_path={folder}"))


def test_a_lora_critic_exports_as_a_merged_value_model(ppo_run, tmp_path):
    batch = probe_batch(ppo_run.tokenizer)
    want = ppo_run.workers.critic.compute_values(batch)
    checkpoint.export_checkpoint(ppo_run.checkpointer.last, tmp_path / "out")  # `ridgeline export`
    for folder in (ppo_run.run_dir / "final_critic", tmp_path / "out" / "critic"):
        assert not list(folder.glob("adapter_*")), folder
        exported = load_value_model(ModelSpec(str(folder)), torch.float32)
        assert not any("lora_" in n for n, _ in exported.named_parameters())
        got = CriticWorker(exported, ppo_run.workers.critic.config, ppo_run.workers.critic.optimizer,
                           ppo_run.workers.critic.scheduler).compute_values(batch)
        assert torch.allclose(got, want, atol=1e-5), (folder, float((got - want).abs().max()))
