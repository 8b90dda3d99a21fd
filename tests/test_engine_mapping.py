"""Config -> vLLM / SGLang arguments, as pure functions, plus the errors raised before an engine
starts. Runs without vllm or sglang installed (the engines import them lazily); the real vLLM
engine is exercised by tests/vllm/test_vllm_engine.py (`make test-vllm`)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass

import pytest
import torch

from ridgeline.config import load_config
from ridgeline.inference import sglang_engine
from ridgeline.inference.sglang_engine import (
    SGLangEngine,
    matched_stop_string as sglang_matched_stop,
    native_top_logprobs,
    release_tags,
    resume_tags,
    sglang_engine_kwargs,
    sglang_logprobs_warning,
    sglang_sampling_params,
)
from ridgeline.inference.types import EngineError, SamplingParams, wake_order
from ridgeline.inference.library_engine import (
    LibraryEngine,
    check_context_fits,
    engine_torch_dtype,
    eos_token_ids,
    max_model_len,
    tensor_batches,
)
from ridgeline.inference.vllm_engine import (
    VLLMEngine,
    matched_stop_string as vllm_matched_stop,
    top_logprobs as vllm_top_logprobs,
    vllm_engine_env,
    vllm_engine_kwargs,
    vllm_logprobs_mode,
    vllm_sampling_params,
)
from ridgeline.inference.vllm_worker import RidgelineWorkerExtension, pack_tensors, unpack_tensors

MODEL = "Qwen/Qwen2.5-1.5B-Instruct"  # the default path; a hub id passes through unchanged
EXTENSION = "ridgeline.inference.vllm_worker.RidgelineWorkerExtension"


def installed(package: str) -> bool:
    """A real install, not the namespace package pytest makes of the tests/vllm folder."""
    spec = importlib.util.find_spec(package)
    return spec is not None and spec.origin is not None


def config(*overrides: str):
    return load_config(["trainer.strategy=single", "generator.backend=vllm", "trainer.logger=console", *overrides])


@pytest.fixture(scope="module")
def default_cfg():
    return config()


# ------------------------------------------------------------------------------------ vLLM


def test_vllm_kwargs_of_the_default_config(default_cfg):
    assert vllm_engine_kwargs(default_cfg) == {
        "model": MODEL, "dtype": "bfloat16", "tensor_parallel_size": 4, "pipeline_parallel_size": 1,
        "enable_expert_parallel": False, "gpu_memory_utilization": 0.8,
        "enable_prefix_caching": True, "enable_chunked_prefill": True, "max_num_batched_tokens": 8192,
        "max_num_seqs": 1024, "enforce_eager": False, "seed": 42, "max_model_len": 512 + 1024,
        "enable_sleep_mode": True, "logprobs_mode": "processed_logprobs", "skip_tokenizer_init": True,
        "worker_extension_cls": EXTENSION,
    }


def test_vllm_kwargs_follow_the_config_and_engine_init_kwargs_win():
    cfg = config("generator.model_dtype=float32", "generator.inference_engine_tensor_parallel_size=2",
                 "generator.gpu_memory_utilization=0.5", "generator.enable_prefix_caching=false",
                 "generator.enable_chunked_prefill=false", "generator.max_num_batched_tokens=4096",
                 "generator.max_num_seqs=64", "generator.enforce_eager=true", "trainer.seed=7",
                 "trainer.placement.colocate_all=false", "trainer.max_prompt_length=100",
                 "generator.sampling_params.max_generate_length=50",
                 "+generator.engine_init_kwargs.max_num_seqs=32",
                 "+generator.engine_init_kwargs.kv_cache_dtype=fp8")
    assert vllm_engine_kwargs(cfg) == {
        "model": MODEL, "dtype": "float32", "tensor_parallel_size": 2, "pipeline_parallel_size": 1,
        "enable_expert_parallel": False, "gpu_memory_utilization": 0.5, "enable_prefix_caching": False, "enable_chunked_prefill": False, "max_num_batched_tokens": 4096,
        "max_num_seqs": 32, "enforce_eager": True, "seed": 7,
        "max_model_len": 150, "enable_sleep_mode": False, "logprobs_mode": "processed_logprobs",
        "skip_tokenizer_init": True, "worker_extension_cls": EXTENSION, "kv_cache_dtype": "fp8",
    }


def test_vllm_parallel_sizes_and_the_engine_process_environment():
    """SkyRL's keys: pipeline size as is, expert parallelism as vLLM's switch (ep = tp), no data-parallel
    size (each data-parallel rank is an engine of its own); vllm_v1_disable_multiproc (default true)
    keeps vLLM's engine core in the engine's process."""
    cfg = config("generator.inference_engine_tensor_parallel_size=2", "generator.inference_engine_pipeline_parallel_size=2",
                 "generator.inference_engine_expert_parallel_size=2", "generator.inference_engine_data_parallel_size=1",
                 "trainer.strategy=fsdp2", "trainer.placement.colocate_all=false")
    kwargs = vllm_engine_kwargs(cfg)
    assert (kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"], kwargs["enable_expert_parallel"]) == (2, 2, True)
    assert "data_parallel_size" not in vllm_engine_kwargs(config("generator.inference_engine_data_parallel_size=2",
                                                                 "trainer.strategy=fsdp2",
                                                                 "trainer.placement.colocate_all=false"))
    assert vllm_engine_env(cfg) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert vllm_engine_env(config("generator.vllm_v1_disable_multiproc=false")) == {}


def test_vllm_engine_sets_its_environment_in_its_own_process_before_vllm_starts(monkeypatch):
    seen = {}

    class Stop(Exception):
        pass

    def from_config(cls, cfg, tokenizer=None):  # LibraryEngine.from_config: where vLLM would start
        seen["env"] = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        raise Stop

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setattr(LibraryEngine, "from_config", classmethod(from_config))
    with pytest.raises(Stop):
        VLLMEngine.from_config(config())
    assert seen["env"] == "0"


def test_sglang_parallel_sizes():
    cfg = config("generator.inference_engine_tensor_parallel_size=4", "generator.inference_engine_pipeline_parallel_size=2",
                 "generator.inference_engine_expert_parallel_size=4", "generator.backend=sglang",
                 "trainer.placement.colocate_all=false")
    kwargs = sglang_engine_kwargs(cfg)
    assert (kwargs["tp_size"], kwargs["pp_size"], kwargs["ep_size"]) == (4, 2, 4) and "dp_size" not in kwargs


def test_max_model_len_fits_every_call_whatever_the_turns():
    # later turns are capped by max_input_length, the first by max_prompt_length; eval may
    # generate longer than training
    cfg = config("trainer.max_prompt_length=100", "generator.max_input_length=300", "generator.max_turns=4",
                 "generator.sampling_params.max_generate_length=50",
                 "generator.eval_sampling_params.max_generate_length=80")
    assert max_model_len(cfg) == 300 + 80
    assert max_model_len(config("trainer.max_prompt_length=100", "generator.max_input_length=60")) == 100 + 1024


def test_tiny_models_are_written_to_a_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("RIDGELINE_CACHE", str(tmp_path))
    kwargs = vllm_engine_kwargs(config("trainer.policy.model.path=tiny://llama-h64"))
    assert kwargs["model"] == str(tmp_path / "tiny" / "llama-h64-seed42")
    assert (tmp_path / "tiny" / "llama-h64-seed42" / "config.json").is_file()
    assert eos_token_ids(kwargs["model"]) == (2,)  # <|im_end|>, from config.json / generation_config.json


@pytest.mark.parametrize("temperature, top_k, top_p, min_p, penalty, mode, warns", [
    (1.0, -1, 1.0, 0.0, 1.0, "processed_logprobs", False),   # no filtering: processed = our contract
    (0.7, -1, 1.0, 0.0, 1.0, "processed_logprobs", False),   # ... also after temperature
    (0.0, -1, 1.0, 0.0, 1.0, "processed_logprobs", False),   # greedy reports the unscaled distribution
    (1.0, 50, 1.0, 0.0, 1.0, "raw_logprobs", False),         # temperature 1: raw = our contract
    (1.0, -1, 0.9, 0.0, 1.0, "raw_logprobs", False),
    (1.0, -1, 1.0, 0.05, 1.0, "raw_logprobs", False),        # vLLM applies min_p before its processed logprobs
    (0.0, 20, 0.9, 0.0, 1.0, "raw_logprobs", False),
    (0.7, 50, 1.0, 0.0, 1.0, "raw_logprobs", True),          # neither mode fits: unscaled, with a warning
    (0.6, -1, 0.95, 0.0, 1.0, "raw_logprobs", True),
    # processed logprobs include a repetition penalty, our contract does not: treated like filtering
    (1.0, -1, 1.0, 0.0, 1.2, "raw_logprobs", False),
    (0.0, -1, 1.0, 0.0, 1.2, "raw_logprobs", False),
    (0.7, -1, 1.0, 0.0, 1.2, "raw_logprobs", True),
])
def test_logprobs_mode_rule(temperature, top_k, top_p, min_p, penalty, mode, warns):
    chosen, warning = vllm_logprobs_mode(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                                        repetition_penalty=penalty))
    assert chosen == mode
    assert (warning is not None) == warns
    if warns:
        assert "raw_logprobs" in warning and "unscaled" in warning and f"temperature={temperature:g}" in warning


def test_logprobs_mode_reaches_the_kwargs_with_its_warning(caplog):
    filtered = ["generator.sampling_params.temperature=0.7", "generator.sampling_params.top_k=50"]
    with caplog.at_level(logging.WARNING, logger="ridgeline.inference.vllm_engine"):
        assert vllm_engine_kwargs(config(*filtered))["logprobs_mode"] == "raw_logprobs"
    assert "unscaled" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ridgeline.inference.vllm_engine"):
        kwargs = vllm_engine_kwargs(config(*filtered, "+generator.engine_init_kwargs.logprobs_mode=processed_logprobs"))
    assert kwargs["logprobs_mode"] == "processed_logprobs"  # the user's choice, without the warning
    assert "unscaled" not in caplog.text


def test_vllm_sampling_params():
    params = SamplingParams(max_generate_length=64, temperature=0.8, top_p=0.9, top_k=-1, min_p=0.05)
    assert vllm_sampling_params(params, (7, 2, 7), seed=123) == {
        "max_tokens": 64, "temperature": 0.8, "top_p": 0.9, "top_k": 0, "min_p": 0.05, "repetition_penalty": 1.0,
        "logprobs": 0, "stop_token_ids": [2, 7], "seed": 123, "detokenize": False, "skip_special_tokens": True,
    }
    assert vllm_sampling_params(SamplingParams(top_k=20), (), None)["top_k"] == 20
    assert vllm_sampling_params(SamplingParams(), (), None)["seed"] is None


def test_vllm_sampling_params_with_stop_strings_penalty_and_top_logprobs():
    params = SamplingParams(max_generate_length=8, repetition_penalty=1.3, stop=("</sql>", "</solution>"), logprobs=5)
    assert vllm_sampling_params(params, (2,), seed=1) == {
        "max_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.3,
        "logprobs": 5, "stop_token_ids": [2], "seed": 1, "detokenize": True, "skip_special_tokens": True,
        "stop": ["</sql>", "</solution>"], "include_stop_str_in_output": True,  # SkyRL's setting: kept
    }


def test_vllm_loads_its_tokenizer_only_for_stop_strings_and_raises_max_logprobs(default_cfg):
    assert vllm_engine_kwargs(default_cfg)["skip_tokenizer_init"] is True
    assert "max_logprobs" not in vllm_engine_kwargs(config("generator.sampling_params.logprobs=20"))
    kwargs = vllm_engine_kwargs(config("generator.eval_sampling_params.stop=['</answer>']",
                                       "generator.eval_sampling_params.logprobs=32"))
    assert kwargs["skip_tokenizer_init"] is False and kwargs["max_logprobs"] == 32
    assert vllm_engine_kwargs(config("generator.sampling_params.stop=['x']"))["skip_tokenizer_init"] is False


@dataclass
class _Logprob:  # vllm.logprobs.Logprob's fields
    logprob: float
    rank: int


def test_vllm_top_logprobs_and_matched_stop_string():
    # top 2 (ranks 1, 2) plus the sampled token at rank 7
    step = {11: _Logprob(-0.5, 1), 4: _Logprob(-3.0, 7), 9: _Logprob(-1.5, 2)}
    assert vllm_top_logprobs(step, 2) == [(11, -0.5), (9, -1.5)]
    assert vllm_top_logprobs({11: _Logprob(-0.5, 1), 9: _Logprob(-1.5, 2)}, 2) == [(11, -0.5), (9, -1.5)]
    assert vllm_matched_stop("</sql>") == "</sql>"
    assert vllm_matched_stop(2) is None and vllm_matched_stop(None) is None  # a stop token id, or eos / length


def test_context_longer_than_the_model_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 1024, "eos_token_id": [5, 6]}))
    with pytest.raises(EngineError, match=r"1536 tokens.*holds 1024.*engine_init_kwargs.max_model_len=1024"):
        check_context_fits(config(), "max_model_len", str(tmp_path))
    check_context_fits(config("generator.sampling_params.max_generate_length=512",
                              "generator.eval_sampling_params.max_generate_length=512"), "max_model_len", str(tmp_path))
    check_context_fits(config("+generator.engine_init_kwargs.max_model_len=1024"), "max_model_len", str(tmp_path))
    check_context_fits(config(), "max_model_len", MODEL)  # a hub id: the engine judges
    assert eos_token_ids(str(tmp_path)) == (5, 6)


def test_engine_dtype():
    assert engine_torch_dtype("bfloat16") is torch.bfloat16 and engine_torch_dtype("half") is torch.float16
    with pytest.raises(EngineError, match="generator.model_dtype"):
        engine_torch_dtype("auto")


def test_vllm_missing_package_error(default_cfg):
    if installed("vllm"):
        pytest.skip("vllm is installed here")
    with pytest.raises(EngineError, match=r"pip install 'ridgeline\[vllm\]'.*generator\.backend=hf"):
        VLLMEngine.from_config(default_cfg)


def test_tensor_batches_cast_and_split():
    named = [("a", torch.ones(4, dtype=torch.float32)), ("ids", torch.arange(3)), ("b", torch.ones(2, 2))]
    batches = list(tensor_batches(named, torch.bfloat16, max_bytes=10))
    assert [[n for n, _ in b] for b in batches] == [["a"], ["ids"], ["b"]]
    assert [b[0][1].dtype for b in batches] == [torch.bfloat16, torch.int64, torch.bfloat16]
    assert [[n for n, _ in b] for b in tensor_batches(named, torch.float32)] == [["a", "ids", "b"]]


# ------------------------------------------------------------------------- vLLM worker


def test_packed_tensors_round_trip():
    named = [("w", torch.randn(3, 5).to(torch.bfloat16)), ("ids", torch.arange(4)), ("s", torch.tensor(2.5)),
             ("empty", torch.empty(0, 3)), ("t", torch.randn(4, 6)[:, ::2])]  # non-contiguous
    packed = pack_tensors(named)
    assert all(isinstance(raw, bytes) for *_, raw in packed)
    # vLLM's msgpack transport turns tuples into lists: accepted either way
    for (name, tensor), (back_name, back) in zip(named, unpack_tensors([list(p) for p in packed])):
        assert back_name == name and back.dtype == tensor.dtype and torch.equal(back, tensor)


class _FakeModel:
    def __init__(self):
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights):
        self.loaded.extend(weights)


class _FakeRunner:
    def __init__(self):
        self.model = _FakeModel()

    def get_model(self):
        return self.model


class _FakeWorker(RidgelineWorkerExtension):
    """A worker of a vLLM without `reload_weights` (< 0.13): loads with `model.load_weights`."""

    def __init__(self, rank: int):
        self.rank = rank
        self.model_runner = _FakeRunner()


def test_worker_stages_batches_then_loads_the_whole_set():
    worker = _FakeWorker(rank=0)
    assert worker.ridgeline_stage_weights(pack_tensors([("a", torch.ones(2))])) == 1
    assert worker.ridgeline_load_weights(pack_tensors([("b", torch.zeros(3))])) == 2
    assert [n for n, _ in worker.model_runner.model.loaded] == ["a", "b"]
    assert worker.ridgeline_load_weights(pack_tensors([("c", torch.zeros(1))])) == 1  # the stage was emptied


def test_worker_receiver_takes_rank_offset_plus_worker_rank(monkeypatch):
    import ridgeline.inference.weight_transport as weight_sync

    made = []

    class FakeReceiver:
        def __init__(self, spec):
            self.spec, self.version, self.closed = spec, 0, False
            made.append(self)

        def receive(self):
            self.version = 3
            return [("w", torch.ones(2))]

        def close(self):
            self.closed = True

    monkeypatch.setattr(weight_sync, "WeightReceiver", FakeReceiver)
    worker = _FakeWorker(rank=1)  # the engine's second tensor-parallel worker
    spec = {"port": 29500, "rank": 3, "world_size": 6, "backend": "gloo", "host": "127.0.0.1", "timeout_s": 5.0,
            "group_name": "g"}
    assert worker.ridgeline_init_receiver(json.dumps(spec)) == 4
    assert made[0].spec == weight_sync.GroupSpec(**{**spec, "rank": 4})
    assert worker.ridgeline_weights_version() == 0
    assert worker.ridgeline_receive_weights() == 3
    assert [n for n, _ in worker.model_runner.model.loaded] == ["w"]
    worker.ridgeline_init_receiver(json.dumps(spec))  # a new group replaces the old one
    assert made[0].closed and len(made) == 2
    worker.ridgeline_close_receiver()
    assert made[1].closed and worker.ridgeline_weights_version() == 0


def test_worker_receive_before_init_is_an_error():
    with pytest.raises(RuntimeError, match="ridgeline_init_receiver"):
        _FakeWorker(rank=0).ridgeline_receive_weights()


# ---------------------------------------------------------------------------------- SGLang


def test_sglang_kwargs_of_the_default_config(default_cfg):
    assert sglang_engine_kwargs(default_cfg, cuda=True) == {
        "model_path": MODEL, "dtype": "bfloat16", "tp_size": 4, "pp_size": 1, "ep_size": 1, "mem_fraction_static": 0.8,
        "disable_radix_cache": False, "max_running_requests": 1024, "chunked_prefill_size": 8192,
        "disable_cuda_graph": False, "random_seed": 42, "context_length": 1536, "enable_memory_saver": True,
        "skip_tokenizer_init": True,
    }


def test_sglang_kwargs_on_a_cpu_add_its_cpu_backend_settings(default_cfg):
    """SGLang's CPU backend: torch_native attention, no overlap schedule, a capped KV cache, and no
    memory saver (CUDA-only: it fails at start); the user's engine_init_kwargs still win."""
    gpu = sglang_engine_kwargs(default_cfg, cuda=True)
    cpu = sglang_engine_kwargs(default_cfg, cuda=False)
    assert cpu == {**gpu, "enable_memory_saver": False, "device": "cpu", "attention_backend": "torch_native",
                   "disable_overlap_schedule": True, "max_total_tokens": 32768}
    mine = sglang_engine_kwargs(config("+generator.engine_init_kwargs.max_total_tokens=4096"), cuda=False)
    assert mine["max_total_tokens"] == 4096 and mine["device"] == "cpu"
    assert sglang_engine_kwargs(default_cfg) == (gpu if torch.cuda.is_available() else cpu)


def test_sglang_kwargs_follow_the_config_and_engine_init_kwargs_win():
    cfg = config("generator.enable_prefix_caching=false", "generator.enable_chunked_prefill=false",
                 "generator.enforce_eager=true", "generator.inference_engine_tensor_parallel_size=2",
                 "generator.gpu_memory_utilization=0.6", "generator.max_num_seqs=128", "generator.model_dtype=float16",
                 "trainer.placement.colocate_all=false", "trainer.seed=3",
                 "+generator.engine_init_kwargs.context_length=4096",
                 "+generator.engine_init_kwargs.attention_backend=flashinfer")
    assert sglang_engine_kwargs(cfg, cuda=True) == {
        "model_path": MODEL, "dtype": "float16", "tp_size": 2, "pp_size": 1, "ep_size": 1, "mem_fraction_static": 0.6,
        "disable_radix_cache": True, "max_running_requests": 128, "chunked_prefill_size": -1,
        "disable_cuda_graph": True, "random_seed": 3, "context_length": 4096, "enable_memory_saver": False,
        "skip_tokenizer_init": True, "attention_backend": "flashinfer",
    }


def test_sglang_sampling_params():
    params = SamplingParams(max_generate_length=32, temperature=0.0, top_p=0.95, top_k=-1, min_p=0.0)
    assert sglang_sampling_params(params, (2, 9)) == {
        "max_new_tokens": 32, "temperature": 0.0, "top_p": 0.95, "top_k": -1, "min_p": 0.0,
        "repetition_penalty": 1.0, "stop_token_ids": [2, 9], "skip_special_tokens": True, "no_stop_trim": True,
    }
    assert sglang_sampling_params(SamplingParams(top_k=40), (), seed=11)["top_k"] == 40
    assert sglang_sampling_params(SamplingParams(), (), seed=11)["sampling_seed"] == 11
    with_stop = sglang_sampling_params(SamplingParams(repetition_penalty=1.1, stop=("</sql>",), logprobs=3), ())
    assert with_stop["stop"] == ["</sql>"] and with_stop["repetition_penalty"] == 1.1
    assert with_stop["no_stop_trim"] is True  # SkyRL's setting: the stop string stays in the text


def test_sglang_loads_its_tokenizer_only_for_stop_strings_and_warns_about_penalized_logprobs(default_cfg, caplog):
    assert sglang_engine_kwargs(default_cfg)["skip_tokenizer_init"] is True
    with caplog.at_level(logging.WARNING, logger="ridgeline.inference.sglang_engine"):
        kwargs = sglang_engine_kwargs(config("generator.sampling_params.stop=['</sql>']",
                                             "generator.sampling_params.repetition_penalty=1.2"))
    assert kwargs["skip_tokenizer_init"] is False
    assert "repetition_penalty=1.2" in caplog.text and "after the penalty" in caplog.text
    assert sglang_logprobs_warning(SamplingParams()) is None


def test_sglang_top_logprobs_and_matched_stop_string():
    meta = {"output_top_logprobs": [[[-0.1, 5, None], [-2.5, 7, None]], [[-0.3, 8, None], [-1.4, 5, None]]]}
    assert native_top_logprobs(meta, 2, 2) == [[(5, -0.1), (7, -2.5)], [(8, -0.3), (5, -1.4)]]
    assert native_top_logprobs({}, 0, 2) is None
    with pytest.raises(EngineError, match="top_logprobs_num=2"):
        native_top_logprobs({}, 2, 2)
    assert sglang_matched_stop({"type": "stop", "matched": "</sql>"}) == "</sql>"
    assert sglang_matched_stop({"type": "stop", "matched": 2}) is None  # a stop token
    assert sglang_matched_stop({"type": "length", "length": 8}) is None


def test_sglang_sleep_levels():
    assert release_tags(1, weights_cpu_backup=False) == ["kv_cache"]
    assert release_tags(1, weights_cpu_backup=True) == ["kv_cache", "weights"]
    assert release_tags(2, weights_cpu_backup=False) == ["kv_cache", "weights", "cuda_graph"]
    with pytest.raises(EngineError, match="level must be 1 or 2"):
        release_tags(3, weights_cpu_backup=False)


def test_sglang_resumes_what_a_wake_up_tag_needs_and_only_what_is_released():
    everything = ["kv_cache", "weights", "cuda_graph"]
    assert resume_tags(("weights",), everything) == ["weights"]
    assert resume_tags(("kv_cache",), everything) == ["kv_cache", "cuda_graph"]  # generation needs its graphs
    assert resume_tags(("kv_cache", "weights"), everything) == ["weights", "kv_cache", "cuda_graph"]
    # level 1 without a host copy of the weights released only the KV cache
    assert resume_tags(("weights",), ["kv_cache"]) == []
    assert resume_tags(("weights", "kv_cache"), ["kv_cache"]) == ["kv_cache"]
    with pytest.raises(ValueError, match="unknown engine memory tag"):
        resume_tags(("cuda_graph",), everything)


class _Released(LibraryEngine):
    """The base class's sleep bookkeeping over an engine that records what it releases and resumes."""

    def __init__(self, device_sleeps: bool, can_sleep: bool = True):
        self._device_sleeps, self._can_sleep, self.calls = device_sleeps, can_sleep, []

    def _release(self, level: int) -> None:
        self.calls.append(("release", level))

    def _resume(self, tags) -> None:
        self.calls.append(("resume", tags))


@pytest.mark.parametrize("device_sleeps,can_sleep", [(True, True), (False, True), (False, False)])
def test_library_engines_wake_weights_then_kv_cache_each_once(device_sleeps, can_sleep):
    # (False, True): SGLang on a CPU, whose release / resume run there and free nothing;
    # (False, False): vLLM on a CPU, built without sleep mode: bookkeeping only
    engine = _Released(device_sleeps, can_sleep)
    engine.sleep(2)
    engine.sleep(1)  # already asleep: nothing more to release
    engine.wake_up(("weights",))
    with pytest.raises(EngineError, match=r"_Released.generate called while asleep \(kv_cache released\)"):
        engine._check_awake("generate")
    engine.wake_up()  # only the KV cache is still released
    engine._check_awake("generate")
    engine.wake_up()
    expected = [("release", 2), ("resume", ("weights",)), ("resume", ("kv_cache",))]
    assert engine.calls == (expected if can_sleep else [])


def test_a_gpu_engine_built_without_its_sleep_kwarg_refuses_to_sleep():
    with pytest.raises(EngineError, match="needs enable_sleep_mode.*colocate_all=true"):
        _Released(device_sleeps=True, can_sleep=False).sleep(1)


def test_wake_order_puts_weights_before_the_kv_cache():
    assert wake_order(["kv_cache", "weights"]) == ("weights", "kv_cache")
    assert wake_order(("kv_cache",)) == ("kv_cache",)
    assert wake_order(()) == ()


def test_fa3_on_a_blackwell_gpu_is_refused_before_sglang_starts(monkeypatch):
    monkeypatch.setattr(sglang_engine, "gpu0_capability", lambda: (10, 0))
    cfg = config("generator.backend=sglang", "+generator.engine_init_kwargs.attention_backend=fa3")
    with pytest.raises(EngineError, match=r"attention_backend.*fa3.*SM 10\.0.*attention_backend=flashinfer"):
        SGLangEngine.from_config(cfg)


def test_sglang_missing_package_error(monkeypatch):
    if installed("sglang"):
        pytest.skip("sglang is installed here")
    monkeypatch.setattr(sglang_engine, "gpu0_capability", lambda: (9, 0))  # fa3 fits an H100
    cfg = config("generator.backend=sglang", "+generator.engine_init_kwargs.attention_backend=fa3")
    with pytest.raises(EngineError, match=r"pip install 'ridgeline\[sglang\]'.*generator\.backend=hf"):
        SGLangEngine.from_config(cfg)

