#!/usr/bin/env bash
# GRPO's quickstart task trained with your own advantage estimator (custom_adv_est.py:
# simple_baseline) and policy loss (custom_policy_loss.py: reinforce), named like built-ins once
# their modules are listed in trainer.algorithm.algorithm_modules. Extra arguments are Hydra overrides.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
exec ridgeline train +experiment=quickstart trainer.run_name=custom_algorithms \
  "trainer.algorithm.algorithm_modules=[$HERE/custom_adv_est.py,$HERE/custom_policy_loss.py]" \
  trainer.algorithm.advantage_estimator=simple_baseline trainer.algorithm.policy_loss_type=reinforce "$@"
