"""Environments: turn a model response into reward (SkyRL-gym style).

Importing this package registers the built-in envs: "gsm8k", "gsm8k_multi_turn", "text2sql" and
"multiply", which score exactly as skyrl-gym 0.4.0 (and SkyRL-Train's multiply example) do;
Ridgeline's lenient variants "gsm8k_lenient", "gsm8k_multi_turn_lenient", "text2sql_lenient" and
"multiply_lenient"; and "arithmetic" and "code". skyrl-gym's envs (its own and those user code
registers with ``skyrl_gym.register``) run through :class:`SkyRLGymEnv` (skyrl_gym_env.py).
Standard library only (math-verify and pandas are imported when first needed), so it is cheap
to import in worker processes.
"""

from .base import Env, SingleTurnEnv, StepOutput
from .feedback import FeedbackEnv, Grade
from .reward_fn import RewardFunctionEnv, load_reward_fn, reward_fn_env
from .tools import ToolCall, ToolCallError, ToolEnv, ToolGroup, ToolResult, tool
from .registry import DEFAULT_ENV_CLASS, UnknownEnvError, check_env_name, load_env_module, make, register, registered_envs
from .skyrl_gym_env import PREFIX as SKYRL_GYM_PREFIX, SkyRLGymEnv, SkyRLGymNotInstalled

# Imported for their side effect: registering the built-in envs.
from . import arithmetic as _arithmetic  # noqa: E402,F401  isort: skip
from . import code as _code  # noqa: E402,F401  isort: skip
from . import gsm8k as _gsm8k  # noqa: E402,F401  isort: skip
from . import multiply as _multiply  # noqa: E402,F401  isort: skip
from . import text2sql as _text2sql  # noqa: E402,F401  isort: skip
from . import text2sql_lenient as _text2sql_lenient  # noqa: E402,F401  isort: skip

__all__ = [
    "DEFAULT_ENV_CLASS",
    "Env",
    "FeedbackEnv",
    "Grade",
    "RewardFunctionEnv",
    "ToolCall",
    "ToolCallError",
    "ToolEnv",
    "ToolGroup",
    "ToolResult",
    "load_reward_fn",
    "reward_fn_env",
    "tool",
    "SingleTurnEnv",
    "SKYRL_GYM_PREFIX",
    "SkyRLGymEnv",
    "SkyRLGymNotInstalled",
    "StepOutput",
    "UnknownEnvError",
    "check_env_name",
    "load_env_module",
    "make",
    "register",
    "registered_envs",
]
