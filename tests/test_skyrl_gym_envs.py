"""skyrl-gym envs run unchanged: a user's BaseTextEnv registered with skyrl_gym.register trains
through the real trainer, skyrl-gym's own multi-turn env runs through the generator token for token
as Ridgeline's twin, the name rules, and rows whose env cannot be built stop the run before any
model loads."""

from __future__ import annotations

import json
import logging
import sys
import textwrap

import pytest

skyrl_gym = pytest.importorskip("skyrl_gym", reason="skyrl-gym is not installed (pip install 'ridgeline[skyrl-gym]')")

from ridgeline import envs  # noqa: E402
from ridgeline.config import load_config  # noqa: E402
from ridgeline.generation.env_steps import EnvRunner  # noqa: E402
from ridgeline.generation.generator import Generator  # noqa: E402
from ridgeline.generation.types import GeneratorInput, TrajectoryID  # noqa: E402
from ridgeline.inference.hf_engine import HFEngine  # noqa: E402
from ridgeline.inference.types import SamplingParams  # noqa: E402
from ridgeline.tracking.trackers import read_metrics  # noqa: E402
from ridgeline.trainer.builders import EnvironmentCheckError  # noqa: E402

# A user env exactly as SkyRL's docs write one: BaseTextEnv, BaseTextEnvStepOutput, skyrl_gym.register.
USER_ENV = textwrap.dedent('''
    from typing import Any, Dict

    from omegaconf import DictConfig
    from skyrl_gym.envs import register
    from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


    class DigitsEnv(BaseTextEnv):
        """1.0 for the ground truth in the answer, `partial` for any digit, else 0; two turns."""

        def __init__(self, env_config: DictConfig, extras: Dict[str, Any] = {}):
            super().__init__()
            assert "reward_spec" in extras, "reward_spec field is required"
            assert "ground_truth" in extras["reward_spec"], "ground_truth is required in reward_spec field"
            self.ground_truth = str(extras["reward_spec"]["ground_truth"])
            self.max_turns = extras["max_turns"]
            self.partial = env_config.get("partial", 0.5)

        def step(self, action: str) -> BaseTextEnvStepOutput:
            self.turns += 1
            if self.ground_truth in action:
                reward = 1.0
            else:
                reward = self.partial if any(c.isdigit() for c in action) else 0.0
            done = self.turns >= self.max_turns or reward == 1.0
            observations = [] if done else [{"role": "user", "content": "again"}]
            return BaseTextEnvStepOutput(observations=observations, reward=reward, done=done, metadata={})

        def get_metrics(self) -> Dict[str, Any]:
            return {"digit_turns": self.turns, "solved": False, "turn_list": [self.turns]}

        @staticmethod
        def aggregate_metrics(metrics):
            # the class's own combination (skyrl-gym calls it per env class): a mean, a max and a count
            # from the non-numeric turn_list, which the default aggregation would drop
            turns = [t for m in metrics for t in m["turn_list"]]
            return {"digit_turns": sum(turns) / len(turns), "max_digit_turns": max(turns), "episodes": len(turns),
                    "solved": sum(m["solved"] for m in metrics) / len(metrics)}


    class BrokenEnv(BaseTextEnv):
        def __init__(self, env_config: DictConfig, extras: Dict[str, Any] = {}):
            super().__init__()
            raise ConnectionError("cannot reach the task server")

        def step(self, action: str) -> BaseTextEnvStepOutput:
            return BaseTextEnvStepOutput(observations=[], reward=1.0, done=True, metadata={})


    register(id="{digits}", entry_point=DigitsEnv)
    register(id="{broken}", entry_point=BrokenEnv)
''')


@pytest.fixture()
def user_env(tmp_path, request):
    """A module registering `<test>_digits` and `<test>_broken` in skyrl-gym; deregistered after."""
    stem = request.node.name.replace("[", "_").replace("]", "_").replace("-", "_")
    ids = {"digits": f"{stem}_digits", "broken": f"{stem}_broken"}
    path = tmp_path / f"{stem}_envs.py"
    path.write_text(USER_ENV.replace("{digits}", ids["digits"]).replace("{broken}", ids["broken"]))
    yield path, ids
    for env_id in ids.values():
        skyrl_gym.registry.pop(env_id, None)


def _rows(path, env_class, n=32, drop_ground_truth_at=None):
    with path.open("w") as f:
        for i in range(n):
            a, b = i % 5, (i * 3) % 5
            spec = {"method": "rule"} if i == drop_ground_truth_at else {"method": "rule", "ground_truth": str(a + b)}
            f.write(json.dumps({"data_source": "sums", "env_class": env_class, "reward_spec": spec, "extra_info": {},
                                "prompt": [{"role": "user", "content": f"{a} + {b} ="}]}) + "\n")
    return path


def _tiny(tmp_path, data, module, *extra):
    return load_config(["+experiment=tiny", f"trainer.export_path={tmp_path}", "data.prepare=null",
                        f"data.train_data=[{data}]", "data.val_data=[]", f"environment.env_modules=[{module}]",
                        "trainer.eval_before_train=false", "generator.max_turns=2", *extra])


def test_a_users_skyrl_gym_env_trains_through_the_real_trainer(tmp_path, user_env):
    from ridgeline.entrypoints.run import run_training

    module, ids = user_env
    data = _rows(tmp_path / "train.jsonl", ids["digits"])
    cfg = _tiny(tmp_path, data, module, f"+environment.skyrl_gym.{ids['digits']}.partial=0.25",
                "generator.sampling_params.temperature=1.0")
    summary = run_training(cfg)
    steps = [r for r in read_metrics(tmp_path / "tiny" / "metrics.jsonl") if "policy/policy_loss" in r]
    assert summary["steps"] == 2 and len(steps) == 2
    for step in steps:
        assert step["generate/env_errors"] == 0
        assert step["reward/avg_raw_reward"] > 0            # digits earn 0.25, right sums 1.0 (per turn)
        assert 1.0 <= step["environment/digit_turns"] <= 2.0  # get_metrics, averaged over the episodes
        assert step["environment/solved"] == 0.0             # a bool counts as 0/1, as skyrl-gym aggregates
        # the class's own aggregate_metrics makes the numbers, as in SkyRL
        assert step["environment/episodes"] == cfg.trainer.train_batch_size * cfg.generator.n_samples_per_prompt
        assert step["environment/max_digit_turns"] in (1.0, 2.0) and "environment/turn_list" not in step


def _mt_input(env_class, n=4):
    return GeneratorInput(prompts=[[{"role": "user", "content": "What is 3 + 4?"}]] * n, env_classes=[env_class] * n,
                          env_extras=[{"data_source": "t", "reward_spec": {"method": "rule", "ground_truth": "7"},
                                       "extra_info": {}}] * n,
                          trajectory_ids=[TrajectoryID("u", i) for i in range(n)],
                          sampling_params=SamplingParams(max_generate_length=4, temperature=1.0))


@pytest.mark.parametrize("conversation", [True, False])
def test_skyrl_gyms_own_multi_turn_env_runs_token_for_token_as_ridgelines_twin(tiny_model, tiny_tokenizer,
                                                                                 conversation):
    engine = HFEngine(tiny_model, tiny_tokenizer)
    gen = Generator(engine, tiny_tokenizer, max_turns=3, conversation_mode=conversation,
                    runner=EnvRunner(max_workers=0))
    theirs = gen.generate(_mt_input("skyrl_gym:gsm8k_multi_turn"), seed=3)
    ours = gen.generate(_mt_input("gsm8k_multi_turn"), seed=3)
    # four sampled characters cannot hold "#### 7": every episode takes all three turns
    assert theirs.metrics["generate/avg_turns"] == 3.0 and theirs.metrics["generate/env_errors"] == 0
    assert theirs.metrics["environment/avg_steps"] == 3.0  # skyrl-gym's get_metrics and its class's aggregate
    assert all(0 in mask for mask in theirs.loss_masks)   # its observations are in the sequence, masked
    assert all(isinstance(r, list) for r in theirs.rewards)
    assert theirs.response_ids == ours.response_ids
    assert theirs.loss_masks == ours.loss_masks
    assert theirs.rewards == ours.rewards
    env_metrics = [{k: v for k, v in out.metrics.items() if k.startswith("environment/")} for out in (theirs, ours)]
    assert env_metrics[0] == env_metrics[1] == {"environment/avg_steps": 3.0}


class _UserRidgelineEnv(envs.SingleTurnEnv):
    def score(self, action: str) -> float:
        return 1.0


def test_name_resolution_and_shadowing(tmp_path, caplog):
    extras = {"reward_spec": {"method": "rule", "ground_truth": "7"}, "extra_info": {}}
    # skyrl-gym's own gsm8k does not shadow Ridgeline's (they score the same); asked for, it runs
    assert not isinstance(envs.make("gsm8k", extras=extras), envs.SkyRLGymEnv)
    explicit = envs.make("skyrl_gym:gsm8k", extras=extras)
    assert isinstance(explicit, envs.SkyRLGymEnv) and type(explicit.inner).__name__ == "GSM8kEnv"
    assert explicit.step("#### 7").reward == 1.0
    # skyrl-gym-only built-ins resolve without a prefix
    assert isinstance(envs.make("aime", extras={"reward_model": {"ground_truth": "7"}}), envs.SkyRLGymEnv)

    # a user's skyrl_gym.register of a Ridgeline built-in's name wins, with one log line
    module = tmp_path / "shadow_envs.py"
    module.write_text(USER_ENV.replace("{digits}", "arithmetic").replace("{broken}", "shadow_broken"))
    try:
        envs.load_env_module(module)
        with caplog.at_level(logging.INFO, logger="ridgeline.envs.skyrl_gym_env"):
            env = envs.make("arithmetic", extras={**extras, "reward_spec": {"ground_truth": "7"}})
            envs.make("arithmetic", extras=extras)
        assert isinstance(env, envs.SkyRLGymEnv) and type(env.inner).__name__ == "DigitsEnv"
        assert [r.message for r in caplog.records].count(
            "env_class 'arithmetic': the skyrl_gym.register-ed "
            f"{skyrl_gym.registry['arithmetic'].entry_point!r} is used, not Ridgeline's built-in 'arithmetic'") == 1

        # user code registering one name in both registries is refused
        envs.register("shadow_broken", _UserRidgelineEnv, overwrite=True)
        with pytest.raises(ValueError, match="'shadow_broken' is registered twice by user code"):
            envs.make("shadow_broken", extras=extras)
    finally:
        skyrl_gym.registry.pop("arithmetic", None)
        skyrl_gym.registry.pop("shadow_broken", None)
    assert not isinstance(envs.make("arithmetic", extras=extras), envs.SkyRLGymEnv)


def test_without_skyrl_gym_the_message_names_the_env_and_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "skyrl_gym", None)  # import skyrl_gym now fails
    with pytest.raises(envs.SkyRLGymNotInstalled,
                       match=r"env_class 'skyrl_gym:gsm8k' is a skyrl-gym env.*pip install 'ridgeline\[skyrl-gym\]'"):
        envs.make("skyrl_gym:gsm8k", extras={})
    with pytest.raises(envs.UnknownEnvError, match=r"unknown env 'search'.*pip install 'ridgeline\[skyrl-gym\]'"):
        envs.make("search", extras={})
    # Ridgeline's own envs need no skyrl-gym
    assert envs.make("gsm8k", extras={"reward_spec": {"ground_truth": "7"}}).step("#### 7").reward == 1.0


@pytest.mark.parametrize("case", ["unknown", "failing_constructor", "missing_field"])
def test_rows_whose_env_cannot_be_built_stop_the_run_before_any_model_loads(tmp_path, user_env, monkeypatch, case):
    from ridgeline.trainer import trainer as trainer_module

    module, ids = user_env
    env_class = {"unknown": "no_such_env", "failing_constructor": ids["broken"], "missing_field": ids["digits"]}[case]
    data = _rows(tmp_path / "train.jsonl", env_class, drop_ground_truth_at=5 if case == "missing_field" else None)
    loaded = []
    monkeypatch.setattr(trainer_module, "build_policy_worker", lambda *a, **k: loaded.append(1))
    with pytest.raises(EnvironmentCheckError) as info:
        trainer_module.Trainer.from_config(_tiny(tmp_path, data, module))
    message = str(info.value)
    row = 5 if case == "missing_field" else 0
    where = f"data.train_data: {data} row {row}"
    assert message.startswith(f"{where}, column 'env_class': unknown env" if case == "unknown"
                              else f"{where}: environment {env_class!r} could not be built")
    assert {"unknown": "unknown env 'no_such_env'", "failing_constructor": "cannot reach the task server",
            "missing_field": "ground_truth is required in reward_spec field"}[case] in message
    assert loaded == []  # no model was built, so no step ran


def _dapo_rows(path, n=32):
    """Rows as SkyRL's DAPO-Math / AIME files hold them (examples/train/algorithms/dapo/prepare_dapo_data.sh:
    BytedTsinghua-SIA's DAPO-Math-17k, cleaned): reward_model, ability, no reward_spec, no env_class."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "math_dapo", "ability": "MATH",
             "prompt": [{"role": "user", "content": f"Solve: {i} + {i}. Answer: $Answer"}],
             "reward_model": {"ground_truth": str(2 * i), "style": "rule-lighteval/MATH_v2"},
             "extra_info": {"index": str(i)}} for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_dapo_math_rows_train_with_skyrl_gyms_aime_env(tmp_path):
    """SkyRL passes every column of a row to its env: skyrl-gym's aime env reads extras['reward_model'];
    rows without reward_spec load, and the run trains 2 steps on the tiny model."""
    from ridgeline.entrypoints.run import run_training

    data = _dapo_rows(tmp_path / "dapo-math-17k-cleaned.parquet")
    cfg = load_config(["+experiment=tiny", f"trainer.export_path={tmp_path}", "data.prepare=null",
                       f"data.train_data=[{data}]", "data.val_data=[]", "environment.env_class=aime",
                       "trainer.eval_before_train=false"])
    summary = run_training(cfg)
    steps = [r for r in read_metrics(tmp_path / "tiny" / "metrics.jsonl") if "policy/policy_loss" in r]
    assert summary["steps"] == 2 and len(steps) == 2
    assert all(step["generate/env_errors"] == 0 for step in steps)


def test_skyrl_search_rows_build_with_skyrls_default_search_settings(tmp_path):
    """search/run_search.sh sets no environment.skyrl_gym.search.* keys: SkyRL's defaults (search_url,
    topk 3, timeout 30, log_requests) are Ridgeline's, so skyrl-gym's search env builds from the
    Search-R1 rows of SkyRL's dataset script (examples/train/search/searchr1_dataset.py)."""
    from ridgeline.trainer.builders import per_env_settings
    from ridgeline.generation.generator import build_env

    cfg = load_config(["trainer.strategy=single", "generator.backend=hf", "trainer.logger=console"])
    settings = per_env_settings(cfg.environment)
    assert settings["search"] == {"log_requests": False, "search_url": "http://127.0.0.1:8000/retrieve", "topk": 3,
                                  "timeout": 30}
    assert settings["llm_as_a_judge"] == {"model": "gpt-4o-mini", "base_url": None}
    extras = {"data_source": "searchR1_nq", "ability": "fact-reasoning", "reward_spec": {
        "method": "rule", "ground_truth": {"target": ["Paris"]}}, "extra_info": {"index": 0, "split": "train"}}
    env = build_env("search", extras, settings, max_turns=2)
    try:
        env.init([{"role": "user", "content": "Where is the Eiffel tower?"}])
    finally:
        env.close()


@pytest.mark.integration
def test_search_r1_rows_train_against_a_local_retriever(tmp_path):
    """Rows as SkyRL's Search-R1 dataset script writes them train 2 steps through skyrl-gym's search env,
    with SkyRL's default search settings (topk, timeout, log_requests) and a retriever on 127.0.0.1
    answering SkyRL's /retrieve protocol."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from ridgeline.entrypoints.run import run_training

    class Retriever(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            docs = [{"document": {"contents": f'"Doc {i}"\nabout {body["query"]}'}, "score": 1.0}
                    for i in range(body["topk"])]
            payload = json.dumps({"result": [docs]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Retriever)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    data = tmp_path / "train.jsonl"
    with data.open("w") as f:
        for i in range(32):
            f.write(json.dumps({
                "data_source": "searchR1_nq", "ability": "fact-reasoning", "env_class": "search",
                "prompt": [{"role": "user", "content": f"Answer with <search>query</search> or <answer>x</answer>: "
                                                       f"capital number {i}?"}],
                "reward_spec": {"method": "rule", "ground_truth": {"target": [f"city{i}"]}},
                "extra_info": {"index": i, "split": "train", "need_tools_kwargs": True}}) + "\n")
    try:
        cfg = load_config(["+experiment=tiny", f"trainer.export_path={tmp_path}", "data.prepare=null",
                           f"data.train_data=[{data}]", "data.val_data=[]", "trainer.eval_before_train=false",
                           "generator.max_turns=2", "generator.use_conversation_multi_turn=true",
                           f"environment.skyrl_gym.search.search_url=http://127.0.0.1:{server.server_port}/retrieve"])
        assert cfg.environment.skyrl_gym["search"]["topk"] == 3 and cfg.environment.skyrl_gym["search"]["timeout"] == 30
        summary = run_training(cfg)
    finally:
        server.shutdown()
    steps = [r for r in read_metrics(tmp_path / "tiny" / "metrics.jsonl") if "policy/policy_loss" in r]
    assert summary["steps"] == 2 and len(steps) == 2
    assert all(step["generate/env_errors"] == 0 for step in steps)


def test_livecodebench_rows_train_with_skyrl_gyms_lcb_env(tmp_path):
    """Rows as SkyRL's lcb_dataset.py writes them (tests as a JSON string in reward_spec.ground_truth, no
    env_class: run_lcb.sh sets environment.env_class=lcb) train 2 steps through skyrl-gym's lcb env."""
    from ridgeline.entrypoints.run import run_training

    data = tmp_path / "deepcoder_train.jsonl"
    tests = json.dumps([{"input": "3\n", "output": "6\n", "testtype": "stdin"}])
    with data.open("w") as f:
        for i in range(32):
            f.write(json.dumps({"data_source": "livecodebench", "ability": "code",
                                "prompt": [{"role": "user", "content": f"Read n, print 2n. ({i})"}],
                                "reward_spec": {"method": "rule", "ground_truth": tests},
                                "extra_info": {"split": "train", "index": i, "reference": None}}) + "\n")
    cfg = load_config(["+experiment=tiny", f"trainer.export_path={tmp_path}", "data.prepare=null",
                       f"data.train_data=[{data}]", "data.val_data=[]", "environment.env_class=lcb",
                       "trainer.eval_before_train=false"])
    summary = run_training(cfg)
    steps = [r for r in read_metrics(tmp_path / "tiny" / "metrics.jsonl") if "policy/policy_loss" in r]
    assert summary["steps"] == 2 and len(steps) == 2
    assert all(step["generate/env_errors"] == 0 for step in steps)


JUDGE_ENV = '''
import os
import re

import skyrl_gym
from openai import OpenAI
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput


class JudgeEnv(BaseTextEnv):
    """An LLM-as-a-judge env in the shape of SkyRL's example (examples/train/llm_as_a_judge): the judge
    model and its OpenAI-compatible base_url from env_config, the gold answer from reward_spec."""

    def __init__(self, env_config, extras={}):
        super().__init__()
        self.ground_truth = extras["reward_spec"]["ground_truth"]
        self.client = OpenAI(base_url=env_config["base_url"], api_key=os.environ["OPENAI_API_KEY"])
        self.model = env_config["model"]
        self.calls = 0

    def step(self, action):
        reply = self.client.chat.completions.create(
            model=self.model, max_tokens=8, temperature=0.0,
            messages=[{"role": "user", "content": f"gold: {self.ground_truth}\\npredicted: {action}\\nScore 0 or 1:"}])
        text = reply.choices[0].message.content or ""
        score = 1.0 if re.search(r"Final Score: *1", text) else 0.0
        return BaseTextEnvStepOutput(observations=[], reward=score, done=True, metadata={"judge_chars": len(text)})


skyrl_gym.register(id="llm_as_a_judge", entry_point=JudgeEnv)
'''


@pytest.mark.integration
def test_llm_as_a_judge_rows_train_with_the_judge_on_a_local_ridgeline_serve(tmp_path, monkeypatch):
    """SkyRL's llm_as_a_judge example: its env is the example's own (registered here in an
    environment.env_modules file, as a user does), the judge model name is SkyRL's default
    (gpt-4o-mini, served under that name by `ridgeline serve`), only base_url points at the local server."""
    from conftest import serving

    from ridgeline.entrypoints.run import run_training

    module = tmp_path / "judge_env.py"
    module.write_text(JUDGE_ENV)
    data = tmp_path / "train.jsonl"
    with data.open("w") as f:
        for i in range(32):
            f.write(json.dumps({"data_source": "gsm8k", "env_class": "llm_as_a_judge",
                                "prompt": [{"role": "user", "content": f"{i} + {i} = ?"}],
                                "reward_spec": {"method": "rule", "ground_truth": f"#### {2 * i}"},
                                "extra_info": {"index": i}}) + "\n")
    monkeypatch.setenv("OPENAI_API_KEY", "local")
    with serving("--served-model-name", "gpt-4o-mini") as url:
        cfg = load_config(["+experiment=tiny", f"trainer.export_path={tmp_path}", "data.prepare=null",
                           f"data.train_data=[{data}]", "data.val_data=[]", "trainer.eval_before_train=false",
                           f"environment.env_modules=[{module}]",
                           f"environment.skyrl_gym.llm_as_a_judge.base_url={url}/v1"])
        assert cfg.environment.skyrl_gym["llm_as_a_judge"]["model"] == "gpt-4o-mini"   # SkyRL's default
        summary = run_training(cfg)
    steps = [r for r in read_metrics(tmp_path / "tiny" / "metrics.jsonl") if "policy/policy_loss" in r]
    assert summary["steps"] == 2 and len(steps) == 2
    # a judge call that failed (no server, a refused request) would be an env error of its episode
    assert all(step["generate/env_errors"] == 0 for step in steps)
