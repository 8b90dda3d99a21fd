"""Users plug in their own estimator / loss by import path (`my_pkg.my_module:my_function`)."""

import sys
import textwrap

import pytest
import torch

from ridgeline.algorithms import ADVANTAGE_ESTIMATORS, reduce_loss
from ridgeline.config import ConfigError, load_config


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
