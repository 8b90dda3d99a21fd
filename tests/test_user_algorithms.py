"""Users plug in their own estimator / loss: by import path (`my_pkg.my_module:my_function`), or
registered by name in a module `trainer.algorithm.algorithm_modules` lists (SkyRL's custom main
file), written in Ridgeline's or SkyRL's calling convention."""

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from omegaconf import OmegaConf

from conftest import REPO
from ridgeline.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, reduce_loss
from ridgeline.config import ConfigError, base_config, load_config
from ridgeline.training.batch import build_training_batch
from ridgeline.training.build import loss_config, skyrl_max_seq_len
from ridgeline.training.optim import LRSchedule, build_optimizer, build_scheduler
from ridgeline.training.worker import PolicyTrainConfig, PolicyWorker
from skyrl_commands import SKYRL_COMMANDS


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rl_algos.py").write_text(textwrap.dedent('''
        import torch

        def constant_advantage(*, token_level_rewards, response_mask, **_):
            adv = torch.ones_like(token_level_rewards) * response_mask
            return adv, adv.clone()

        NOT_A_FUNCTION = 3
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rl_algos"
    sys.modules.pop("my_rl_algos", None)


def test_registry_resolves_an_import_path(user_module):
    fn = ADVANTAGE_ESTIMATORS.get(f"{user_module}:constant_advantage")
    adv, _ = fn(token_level_rewards=torch.zeros(1, 3), response_mask=torch.tensor([[1.0, 1.0, 0.0]]), index=["a"])
    assert adv.tolist() == [[1.0, 1.0, 0.0]]


def test_config_accepts_a_user_estimator_and_runs_a_step(user_module, tmp_path):
    from ridgeline.trainer.trainer import Trainer
    cfg = load_config(["+experiment=tiny", f"trainer.export_path={tmp_path}", "data.prepare.num_train=16",
                       "trainer.eval_before_train=false",
                       f"trainer.algorithm.advantage_estimator={user_module}:constant_advantage"])
    trainer = Trainer.from_config(cfg)
    trainer.run.global_step = 1
    metrics = trainer.train_step(next(trainer.train_data.batches(16, seed=0, epoch=0)))
    assert metrics["policy/raw_grad_norm"] > 0


@pytest.mark.parametrize("path,reason", [("no_such_module_xyz:fn", "ModuleNotFoundError"),
                                         ("my_rl_algos:missing", "AttributeError"),
                                         ("my_rl_algos:NOT_A_FUNCTION", "TypeError")])
def test_config_names_the_import_failure(user_module, path, reason):
    with pytest.raises(ConfigError, match=reason):
        load_config(["+experiment=tiny", f"trainer.algorithm.advantage_estimator={path}"])


def test_reduce_loss_dispatches_by_mode():
    values = torch.tensor([[1.0, 3.0], [2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert reduce_loss(values, mask, "token_mean").item() == pytest.approx(2.0)          # (1+3+2)/3
    assert reduce_loss(values, mask, "sequence_mean").item() == pytest.approx(2.0)       # (2 + 2)/2
    assert reduce_loss(values, mask, "seq_mean_token_sum_norm").item() == pytest.approx(1.5)  # (4/2 + 2/2)/2


# ------------------------------------------------------------------------------ registered by name
EXAMPLES = REPO / "examples" / "custom_algorithms"
COMMANDS = SKYRL_COMMANDS
SKYRL_SCRIPTS = {  # SkyRL script -> (the example module that registers its name, the key naming it)
    "algorithms/custom_advantage_estimator/run_custom_adv_est.sh": ("custom_adv_est.py", "advantage_estimator"),
    "algorithms/custom_policy_loss/run_custom_policy_loss.sh": ("custom_policy_loss.py", "policy_loss_type"),
}


@pytest.fixture()
def fresh_registries():
    """Names and modules a test registers or imports are gone afterwards (registries are per process)."""
    before = {registry: set(registry.names()) for registry in (ADVANTAGE_ESTIMATORS, POLICY_LOSSES)}
    modules = set(sys.modules)
    yield
    for registry, names in before.items():
        for name in set(registry.names()) - names:
            registry.unregister(name)
    for name in set(sys.modules) - modules:
        if name.startswith("ridgeline_user_"):  # a user's file, imported by path: runs again next time
            sys.modules.pop(name)


@pytest.mark.parametrize("script", sorted(SKYRL_SCRIPTS))
def test_skyrl_custom_algorithm_scripts_pass_with_their_module_named(script, fresh_registries):
    module, key = SKYRL_SCRIPTS[script]
    with pytest.raises(ConfigError) as info:  # SkyRL's overrides alone: the name is unknown
        load_config(COMMANDS[script])
    (problem,) = info.value.problems
    name = {"advantage_estimator": "simple_baseline", "policy_loss_type": "reinforce"}[key]
    assert problem.startswith(f"trainer.algorithm.{key}={name} is not a registered ")
    assert "trainer.algorithm.algorithm_modules names no module of yours" in problem
    assert "Fix: register it in your own module with @register_" in problem and "algorithm_modules=[" in problem
    # one added override: the Ridgeline counterpart of SkyRL's main file
    cfg = load_config([*COMMANDS[script], f"trainer.algorithm.algorithm_modules=[{EXAMPLES / module}]"])
    assert getattr(cfg.trainer.algorithm, key) == name


def test_a_module_that_does_not_import_is_named(fresh_registries, tmp_path):
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError) as info:
        load_config(["+experiment=tiny", f"trainer.algorithm.algorithm_modules=[{tmp_path / 'broken.py'}]",
                     "trainer.algorithm.advantage_estimator=mine"])
    (problem,) = info.value.problems  # no second problem for the name the module would have registered
    assert problem.startswith("trainer.algorithm.algorithm_modules lists ") and "RuntimeError: boom" in problem


def test_the_same_file_named_twice_registers_once(fresh_registries):
    module = str(EXAMPLES / "custom_adv_est.py")
    load_config(["+experiment=tiny", f"trainer.algorithm.algorithm_modules=[{module},{module}]",
                 f"environment.env_modules=[{module}]", "trainer.algorithm.advantage_estimator=simple_baseline"])
    assert "simple_baseline" in ADVANTAGE_ESTIMATORS


def test_registry_takes_skyrls_direct_form_and_unregisters():
    def fn(**_):
        return None
    assert POLICY_LOSSES.register("direct_form_xyz", fn) is fn
    assert POLICY_LOSSES.get("direct_form_xyz") is fn
    POLICY_LOSSES.unregister("direct_form_xyz")
    assert "direct_form_xyz" not in POLICY_LOSSES


# ------------------------------------------------------------------------------ SkyRL's conventions, unchanged
SKYRL_STYLE = '''
import torch
from ridgeline.algorithms import register_policy_loss, reduce_loss


@register_policy_loss("skyrl_style_is")
def skyrl_style_is(log_probs, old_log_probs, advantages, config, loss_mask=None, rollout_logprobs=None, **kwargs):
    # SkyRL's order and keywords; reduce_loss with SkyRL's positional max_seq_len from config
    per_token = -torch.exp(log_probs - old_log_probs) * advantages
    return reduce_loss(per_token, loss_mask, "seq_mean_token_sum_norm", config.max_seq_len), 0.25


@register_policy_loss("skyrl_style_mean")
def skyrl_style_mean(log_probs, old_log_probs, advantages, config, loss_mask=None):
    # no reduce_loss: a plain mean over the micro-batch, as SkyRL's reinforce example
    return (-log_probs * advantages).mean(), 0.0
'''


def _policy_step(model, loss: str, micro: int, batch, algorithm_section, max_seq_len: int):
    cfg = PolicyTrainConfig(mini_batch_trajectories=batch.batch_size, micro_batch_size=micro, micro_forward_batch_size=micro,
                            policy_loss=loss, loss_reduction=algorithm_section.loss_reduction,
                            algorithm=algorithm_section, max_seq_len=max_seq_len, max_grad_norm=1e9)
    opt = build_optimizer(model, lr=0.0, betas=(0.9, 0.999), weight_decay=0.0)
    metrics = PolicyWorker(model, cfg, opt, build_scheduler(opt, LRSchedule("constant", 0, 0))).train(batch)
    return torch.cat([p.grad.flatten() for p in model.parameters()]), metrics


@pytest.fixture()
def skyrl_batch(tiny_tokenizer):
    torch.manual_seed(1)
    rows, prompt, width = 8, 5, 4
    sequences = torch.randint(3, len(tiny_tokenizer), (rows, prompt + width))
    batch = build_training_batch(prompt_ids=[s[:prompt].tolist() for s in sequences],
                                 response_ids=[s[prompt:].tolist() for s in sequences],
                                 loss_masks=[[1] * width] * rows, rewards=[0.0] * rows,
                                 uids=[str(i) for i in range(rows)], rollout_logprobs=None,
                                 pad_id=tiny_tokenizer.pad_token_id)
    batch.advantages = torch.randn(rows, width)
    batch.old_logprobs = torch.randn(rows, width) * 0.2 - 3.0
    return batch


def test_a_loss_written_for_skyrl_runs_unchanged(tmp_path, fresh_registries, tiny_model, skyrl_batch):
    """SkyRL's signature, its (loss, clip ratio) return and its reduce_loss(..., max_seq_len) call:
    the same gradient as the built-in importance_sampling, and its clip ratio logged as SkyRL's."""
    (tmp_path / "skyrl_losses.py").write_text(SKYRL_STYLE)
    cfg = load_config(["+experiment=[tiny,on_policy_distillation]", "trainer.ref.model.path=tiny://llama-small",
                       f"trainer.algorithm.algorithm_modules=[{tmp_path / 'skyrl_losses.py'}]",
                       "trainer.algorithm.policy_loss_type=skyrl_style_is"])
    section, max_seq_len = loss_config(cfg), skyrl_max_seq_len(cfg)
    ours, _ = _policy_step(copy.deepcopy(tiny_model), "importance_sampling", 4, skyrl_batch, section, max_seq_len)
    theirs, metrics = _policy_step(copy.deepcopy(tiny_model), "skyrl_style_is", 4, skyrl_batch, section, max_seq_len)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-8)
    assert metrics["policy/ppo_clip_ratio"] == pytest.approx(0.25)


def test_a_loss_without_reduce_loss_accumulates_as_skyrl(tmp_path, fresh_registries, tiny_model, skyrl_batch,
                                                         caplog):
    """A micro-batch mean is divided by the step's micro-batches (SkyRL's loss / accumulation_steps):
    one micro-batch of 8 or four of 2 give the same gradient, not four times it."""
    (tmp_path / "skyrl_losses.py").write_text(SKYRL_STYLE)
    load_config(["+experiment=tiny", f"trainer.algorithm.algorithm_modules=[{tmp_path / 'skyrl_losses.py'}]",
                 "trainer.algorithm.policy_loss_type=skyrl_style_mean"])
    section = OmegaConf.merge(base_config().trainer.algorithm, {"loss_reduction": "token_mean"})
    whole, _ = _policy_step(copy.deepcopy(tiny_model), "skyrl_style_mean", 8, skyrl_batch, section, 16)
    with caplog.at_level("WARNING"):
        split, _ = _policy_step(copy.deepcopy(tiny_model), "skyrl_style_mean", 2, skyrl_batch, section, 16)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-8)
    assert "does not call ridgeline.algorithms.reduce_loss" in caplog.text


def test_an_estimator_gets_skyrls_keyword_arguments(fresh_registries, tmp_path):
    """The trainer passes config (the trainer.algorithm section) as SkyRL does."""
    seen = {}

    def record(*, token_level_rewards, response_mask, index, values, grpo_norm_by_std, gamma, lambd, config):
        seen.update(config=config, index=list(index))
        adv = token_level_rewards * response_mask
        return adv, adv.clone()

    ADVANTAGE_ESTIMATORS.register("records_its_arguments", record)
    from ridgeline.trainer.trainer import Trainer
    cfg = load_config(["+experiment=tiny", f"trainer.export_path={tmp_path}", "data.prepare.num_train=16",
                       "trainer.eval_before_train=false", "trainer.algorithm.advantage_estimator=records_its_arguments"])
    trainer = Trainer.from_config(cfg)
    trainer.run.global_step = 1
    trainer.train_step(next(trainer.train_data.batches(16, seed=0, epoch=0)))
    assert seen["config"].advantage_estimator == "records_its_arguments" and len(seen["index"]) == 16 * 8


def test_a_loss_with_an_unusable_signature_is_refused(fresh_registries):
    POLICY_LOSSES.register("two_args_only", lambda log_probs, advantages: (log_probs.sum(), {}))
    with pytest.raises(ConfigError) as info:
        load_config(["+experiment=tiny", "trainer.algorithm.policy_loss_type=two_args_only"])
    (problem,) = info.value.problems
    assert problem.startswith("trainer.algorithm.policy_loss_type=two_args_only: policy loss 'two_args_only' "
                              "cannot be called as") and "Fix:" in problem


@pytest.mark.integration
def test_a_fresh_process_building_the_policy_imports_the_modules(fresh_registries, tmp_path):
    """What a Ray rank does: it gets the config, not the driver's registries, and builds its policy
    worker, which imports trainer.algorithm.algorithm_modules before looking the loss up."""
    module = EXAMPLES / "custom_policy_loss.py"
    cfg = load_config(["+experiment=tiny", f"trainer.algorithm.algorithm_modules=[{module}]",
                       "trainer.algorithm.policy_loss_type=reinforce"])
    (tmp_path / "cfg.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    script = textwrap.dedent(f'''
        from ridgeline.config import saved_config
        from ridgeline.models.loading import load_tokenizer, policy_spec
        from ridgeline.training.build import build_policy_worker
        cfg = saved_config({str(tmp_path / "cfg.yaml")!r})
        worker = build_policy_worker(cfg, load_tokenizer(policy_spec(cfg)), training_batches=1)
        print(worker.policy_loss_fn.name, worker.policy_loss_fn.fn.__name__, worker.policy_loss_fn.by_keyword)
    ''')
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-3:] == ["reinforce", "reinforce_loss", "True"]
