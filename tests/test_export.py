"""Hugging Face exports: periodic ones during training (`trainer.hf_save_interval`) and
`ridgeline export CHECKPOINT OUT`; both load with transformers and give the trainer's logprobs."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ridgeline import cli
from ridgeline.config import load_config
from ridgeline.data import encode_chat_prompt
from ridgeline.entrypoints import export
from ridgeline.models.loading import ModelSpec
from ridgeline.models.value_model import load_value_model, response_values
from ridgeline.trainer.trainer import Trainer
from ridgeline.training.logprobs import response_logprobs

CRITIC = ["trainer.critic.model.path=tiny://llama", "trainer.algorithm.advantage_estimator=gae",
          "trainer.critic_mini_batch_size=16", "trainer.algorithm.use_kl_loss=false"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Two steps with a critic; an export and a checkpoint after each."""
    out = tmp_path_factory.mktemp("export")
    cfg = load_config(["+experiment=tiny", f"trainer.export_path={out}", "data.prepare.num_train=32",
                       "data.prepare.num_val=4", "trainer.eval_before_train=false", "trainer.hf_save_interval=1",
                       "trainer.ckpt_interval=1", *CRITIC])
    trainer = Trainer.from_config(cfg)
    trainer.train()
    return trainer


def sequences(tokenizer):
    """Two [prompt | response] rows, the prompt left-padded."""
    rows = [encode_chat_prompt(tokenizer, [{"role": "user", "content": text}]) for text in ("1+2=", "13+24=")]
    width = max(map(len, rows))
    response = tokenizer.encode("37<|im_end|>")
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r + response for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * (len(r) + len(response)) for r in rows])
    return ids, mask, len(response)


def assert_same_logprobs(folder, trainer):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.encode("12+3=") == trainer.tokenizer.encode("12+3=")
    assert tokenizer.chat_template == trainer.tokenizer.chat_template
    assert model.config.use_cache and model.generation_config.eos_token_id == trainer.tokenizer.eos_token_id
    ids, mask, width = sequences(tokenizer)
    trainer.workers.policy.model.eval()
    with torch.no_grad():
        ours, _ = response_logprobs(trainer.workers.policy.model, ids, mask, width)
        theirs, _ = response_logprobs(model, ids, mask, width)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()


@pytest.mark.integration
def test_periodic_exports_load_with_transformers(run):
    exports = Path(run.cfg.trainer.exports_dir)  # SkyRL's layout, <run_dir>/global_step_<N> with exports_per_run
    assert sorted(p.name for p in exports.glob("global_step_*")) == ["global_step_1", "global_step_2"]
    assert sorted(p.name for p in (exports / "global_step_2").iterdir()) == ["critic", "policy"]
    assert_same_logprobs(exports / "global_step_2" / "policy", run)
    critic = load_value_model(ModelSpec(str(exports / "global_step_2" / "critic")))
    ids, mask, width = sequences(run.tokenizer)
    run.workers.critic.model.eval()
    with torch.no_grad():
        assert torch.allclose(response_values(critic, ids, mask, width),
                              response_values(run.workers.critic.model, ids, mask, width), atol=1e-5, rtol=0)


def test_export_command_writes_the_same_folders_from_a_checkpoint(run, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="ridgeline")
    export.add_parser(parser.add_subparsers(dest="command"))
    ckpt_path = run.cfg.trainer.ckpt_path
    args = parser.parse_args(["export", ckpt_path, str(tmp_path / "out")])  # a ckpt_path: its latest
    assert export.run(args) == 0
    assert "global_step_2" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["critic", "policy"]
    assert_same_logprobs(tmp_path / "out" / "policy", run)
    # an explicit checkpoint folder works too; an occupied OUT or a missing checkpoint is refused
    assert export.run(parser.parse_args(["export", f"{ckpt_path}/global_step_1", str(tmp_path / "one")])) == 0
    # refusals go through the command's one error path: exit 2, one message each
    assert cli.main(["export", f"{ckpt_path}/global_step_1", str(tmp_path / "out")]) == 2
    assert cli.main(["export", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "already exists and is not empty" in err and "does not exist" in err
