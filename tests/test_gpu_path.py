"""Issue 36: the GPU path's defects found by reading it, each shown on this CPU where it can be
(a stand-in for what only a GPU does: an IPC tensor that refuses to be shared again, a recorded
call order, a mock of torch.cuda's memory calls). The GPU runs are in tests/gpu/."""

from __future__ import annotations

import pytest
import torch

from ridgeline.inference.ipc_transport import IPCReceiver, IPCSender


# -- 1. SGLang takes the colocated handoff: each batch a copy this process owns ---------------------

class _RefusesReceived:
    """SGLang's update_weights_from_tensor as torch makes it behave on a GPU: it pickles the batch
    to its scheduler, and a tensor this process received by IPC cannot be shared again ("Consider
    cloning before sending"). On this CPU a received bucket lives in shared memory, which marks it."""

    def __init__(self):
        self.loaded: dict[str, torch.Tensor] = {}

    def update_weights_from_tensor(self, batch, flush_cache):
        for name, tensor in batch:
            if tensor.is_shared():
                raise RuntimeError("Attempted to send CUDA tensor received from another process; this is not "
                                   "currently supported. Consider cloning before sending.")
            self.loaded[name] = tensor
        return True, ""


def test_sglang_loads_views_of_a_received_bucket_as_copies_of_its_own():
    from ridgeline.inference.sglang_engine import SGLangEngine

    engine = object.__new__(SGLangEngine)  # no sglang here: its Engine is the stand-in above
    engine.dtype, engine.update_batch_bytes, engine._weight_sessions = torch.bfloat16, 64, False
    engine.engine = _RefusesReceived()
    weights = [("a", torch.randn(4, 4)), ("b", torch.randn(16)), ("c", torch.arange(3))]
    sender = IPCSender(torch.bfloat16, threshold_bytes=1024, device="cpu")
    with sender.start(weights, version=1) as transfer:
        buckets = (transfer.bucket(i) for i in range(transfer.count))
        received = IPCReceiver().weights(buckets)
        first = next(received)
        assert first[1].is_shared()  # what the engine is handed is the trainer's memory
        engine.update_weights(iter([first, *received]))
    assert set(engine.engine.loaded) == {"a", "b", "c"}
    for name, value in weights:
        expected = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert torch.equal(engine.engine.loaded[name], expected), name


# -- 11. a colocated engine sleeps at level 2: the full weight sync after the wake refills it -------

class _Recorded:
    """The trainer's engine, with its sleep and wake calls recorded."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))
        self.engine.sleep(level)

    def wake_up(self, tags=("weights", "kv_cache")) -> None:
        self.calls.append(("wake_up", tuple(tags)))
        self.engine.wake_up(tags)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_a_colocated_engine_sleeps_at_level_2_and_the_sync_refills_every_weight(tmp_path):
    """The colocated step on this CPU (the trainer's GPU-only flag switched on): the embedded engine
    drops its weights (level 2, nothing copied to the host), wakes them, takes the policy's new
    weights (every one: a dropped weight left unfilled refuses to generate), wakes its cache and
    generates."""
    from ridgeline.config import load_config
    from ridgeline.inference.types import EngineRequest, SamplingParams
    from ridgeline.trainer.trainer import Trainer

    cfg = load_config(["+experiment=tiny", f"trainer.export_path={tmp_path}", "data.prepare.num_train=16",
                       "trainer.eval_before_train=false"])
    trainer = Trainer.from_config(cfg)
    engine = trainer.engine
    trainer.colocated, trainer.engine = True, _Recorded(engine)
    trainer.run.global_step = 1
    trainer.train_step(next(trainer.train_data.batches(cfg.trainer.train_batch_size, seed=0, epoch=0)))
    assert trainer.engine.calls == [("sleep", 2), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",))]
    policy = dict(trainer.workers.policy.model.named_parameters())
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, policy[name].detach().to(p.dtype)), name
    assert engine.generate([EngineRequest([5, 6, 7], SamplingParams(max_generate_length=3))], seed=0)


# -- 10. finiteness: one all-reduced flag per optimizer step, not a check before every backward -----

class _CountingGroup:
    """A world of one whose all-reduces are counted."""

    def __init__(self, parallel):
        self.parallel, self.calls = parallel, []

    def all_max(self, values):
        self.calls.append(("all_max", len(values)))
        return self.parallel.all_max(values)

    def all_sum(self, values):
        self.calls.append(("all_sum", len(values)))
        return self.parallel.all_sum(values)

    def __getattr__(self, name):
        return getattr(self.parallel, name)


def _policy_step_all_reduces(tmp_path, micro: int) -> tuple[list, dict]:
    from ridgeline.config import load_config
    from ridgeline.trainer.trainer import Trainer

    cfg = load_config(["+experiment=tiny", f"trainer.export_path={tmp_path}", "data.prepare.num_train=16",
                       "trainer.eval_before_train=false", f"trainer.micro_train_batch_size_per_gpu={micro}"])
    trainer = Trainer.from_config(cfg)
    policy = trainer.workers.policy
    counting = _CountingGroup(policy.parallel)
    train = policy.train

    def counted_train(batch):
        policy.parallel = counting
        try:
            return train(batch)
        finally:
            policy.parallel = counting.parallel
    policy.train = counted_train
    trainer.run.global_step = 1
    metrics = trainer.train_step(next(trainer.train_data.batches(cfg.trainer.train_batch_size, seed=0, epoch=0)))
    return counting.calls, metrics


def test_a_policy_step_agrees_on_finiteness_once_whatever_its_micro_batches(tmp_path):
    """The tiny preset's one optimizer step in 2 and in 8 micro-batches: the same all-reduces (one
    finiteness flag per optimizer step), and the same step up to float summation order."""
    two, two_metrics = _policy_step_all_reduces(tmp_path / "two", 64)
    eight, eight_metrics = _policy_step_all_reduces(tmp_path / "eight", 16)
    # the forward-path agreement reduces one value per micro-batch in one call: compare the calls
    assert [name for name, _ in two] == [name for name, _ in eight]
    assert eight.count(("all_max", 1)) == 2  # the finiteness flag, and the rollout mismatch's maximum
    assert two_metrics["policy/policy_update_steps"] == 1.0 and two_metrics["policy/skipped_steps"] == 0.0
    for key in ("policy/policy_loss", "policy/raw_grad_norm", "policy/policy_entropy"):
        assert abs(two_metrics[key] - eight_metrics[key]) <= 1e-4 * max(1.0, abs(two_metrics[key])), key


# -- 5. checkpoints: the driver opens no CUDA context; the ranks save their own generators ----------

def test_the_checkpoint_asks_for_cuda_generators_only_in_a_process_that_uses_cuda(monkeypatch):
    """A Ray driver on a GPU node sees CUDA but never initialised it: asking for every GPU's
    generator would open a context on each. Here torch.cuda is a stand-in that says so."""
    from ridgeline.trainer import checkpoint

    def opens_a_context():
        raise AssertionError("get_rng_state_all opened a CUDA context on every GPU of the driver")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", opens_a_context)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: opens_a_context())
    state = checkpoint._rng_state()
    assert "cuda" not in state
    checkpoint._set_rng_state(state)
    # a process that computes on CUDA (one process on a GPU) keeps saving and restoring its own
    saved = [torch.arange(4, dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: saved)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    state = checkpoint._rng_state()
    assert state["cuda"] is saved
    checkpoint._set_rng_state(state)
    assert restored == [saved]


def test_a_rank_saves_and_restores_its_own_generators():
    from types import SimpleNamespace

    from ridgeline.distributed.ray_workers import TrainingRank

    rank = object.__new__(TrainingRank)  # its methods, without Ray or a model
    rank._worker = SimpleNamespace(parallel=SimpleNamespace(device=torch.device("cpu")))
    rank._group = rank._worker.parallel   # what setup() sets: the rank's FSDP group
    state = rank.rng_state()
    drawn = torch.rand(3)
    rank.set_rng_state(state)
    assert torch.equal(torch.rand(3), drawn)
    assert set(state) == {"torch"}  # a CPU rank has no CUDA generator


# -- 6, 7, 9: who decides the device ----------------------------------------------------------------

def test_gpu_or_cpu_workers_follow_the_clusters_gpus_not_the_drivers():
    import pytest

    from ridgeline.distributed.placement import PlacementConfigError
    from ridgeline.distributed.ray_workers import cluster_device
    from ridgeline.inference.weight_transport import usable_backend

    assert not torch.cuda.is_available()  # this driver has no GPU...
    assert cluster_device("auto", 8.0) == "GPU"  # ...and plans GPU workers on a cluster that has them
    assert cluster_device("cuda", 8.0) == cluster_device("cuda:3", 1.0) == "GPU"
    assert cluster_device("auto", 0.0) == cluster_device("cpu", 8.0) == "CPU"
    with pytest.raises(PlacementConfigError, match="trainer.device=cuda asks for GPU workers, but the Ray cluster"):
        cluster_device("cuda", 0.0)
    assert usable_backend("nccl", gpus=True) == "nccl"  # the plan's GPUs, not this machine's
    assert usable_backend("nccl", gpus=False) == "gloo"


def test_the_config_check_of_an_fsdp2_run_does_not_ask_the_drivers_gpus():
    import pytest

    from ridgeline.config import load_config
    from ridgeline.config.validate import ConfigError

    base = ["+experiment=tiny", "trainer.strategy=fsdp2", "trainer.placement.colocate_all=false",
            "trainer.placement.policy_num_gpus_per_node=2", "trainer.placement.ref_num_gpus_per_node=2"]
    assert load_config([*base, "trainer.device=cuda"]).trainer.device == "cuda"  # no CUDA here: fine
    with pytest.raises(ConfigError, match=r"trainer.device=cuda:1 names one GPU, but trainer.strategy=fsdp2 gives "
                                          r"each rank the GPU Ray \(or LOCAL_RANK\) assigns it"):
        load_config([*base, "trainer.device=cuda:1"])
    with pytest.raises(ConfigError, match="trainer.device=cuda but CUDA is not available here"):
        load_config(["+experiment=tiny", "trainer.device=cuda"])  # one process: this machine's GPU


class _FakeCuda:
    """torch.cuda as a process seeing `count` GPUs would answer, recording set_device."""

    def __init__(self, monkeypatch, count: int):
        self.current = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: self.current.append(torch.device("cuda", d)
                                                                                    if isinstance(d, int) else d))


def test_a_rank_takes_its_own_gpu_whatever_index_trainer_device_names(monkeypatch):
    from ridgeline.distributed.fsdp import rank_device

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    cuda = _FakeCuda(monkeypatch, count=1)  # a Ray actor sees its one GPU as cuda:0
    assert rank_device("cuda:3") == torch.device("cuda", 0)
    assert cuda.current == [torch.device("cuda", 0)]


def test_one_process_on_cuda_n_makes_it_the_current_device(monkeypatch):
    from omegaconf import OmegaConf

    from ridgeline.models.device import use_device
    from ridgeline.training.build import single_process

    cuda = _FakeCuda(monkeypatch, count=2)
    assert use_device("cuda:1") == torch.device("cuda", 1)
    assert single_process(OmegaConf.create({"trainer": {"device": "cuda:1"}})).device == torch.device("cuda", 1)
    assert cuda.current == [torch.device("cuda", 1)] * 2
    assert use_device("cpu") == torch.device("cpu") and len(cuda.current) == 2


# -- 2. colocated engines of several GPUs are refused (documented in docs/gpu.md) -------------------

def test_colocated_engines_of_several_gpus_are_refused_before_anything_starts():
    import pytest

    from ridgeline.config import load_config
    from ridgeline.config.validate import ConfigError
    from ridgeline.distributed.placement import PlacementConfigError, plan_placement
    from ridgeline.inference.parallelism import EngineParallelism

    eight = ["generator.backend=vllm", "trainer.placement.policy_num_gpus_per_node=8",
             "trainer.placement.ref_num_gpus_per_node=8"]
    refusal = (r"colocate_all=true on GPUs pairs each engine with one policy rank's GPU .* each engine here takes "
               r"2 GPUs \(inference_engine_tensor_parallel_size=2\): colocated engines of several GPUs are not built. "
               r"Fix: generator.inference_engine_tensor_parallel_size=1 .* = 8 \(the policy's GPUs\), or "
               r"trainer.placement.colocate_all=false")
    tp2 = [*eight, "generator.num_inference_engines=4", "generator.inference_engine_tensor_parallel_size=2"]
    with pytest.raises(ConfigError, match=refusal):  # GPUs named: the config check knows
        load_config([*tp2, "trainer.device=cuda"])
    cfg = load_config(tp2)  # `auto`: the driver plans once Ray says what the cluster has...
    placement = cfg.trainer.placement
    with pytest.raises(PlacementConfigError, match=refusal):  # ...and a GPU cluster refuses it there
        plan_placement(placement, num_engines=4, engine=EngineParallelism(tensor=2), use_ref=True, use_critic=False,
                       device="GPU")
    # CPU workers keep them (the embedded engine computes on the first device of its block)
    plan_placement(placement, num_engines=4, engine=EngineParallelism(tensor=2), use_ref=True, use_critic=False,
                   device="CPU")
    # engines of one GPU each, data parallel included, pair with the policy's GPUs
    load_config([*eight, "trainer.device=cuda", "generator.num_inference_engines=4",
                 "generator.inference_engine_tensor_parallel_size=1", "generator.inference_engine_data_parallel_size=2"])


# -- 3. a rank sharing its GPU with an engine gives the memory back after every call ---------------

def test_a_colocated_gpu_rank_offloads_frees_gradients_and_cached_memory_after_each_call(monkeypatch):
    """torch.cuda's memory calls are stand-ins that record; the rank is the real TrainingRank around
    a stand-in worker whose device is said to be a GPU (its model's moves are recorded)."""
    import gc
    from types import SimpleNamespace

    from ridgeline.distributed.ray_workers import TrainingRank

    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("gc.collect") or 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: calls.append("ipc_collect"))
    layer = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    gpu = torch.device("cuda", 0)

    class Model:
        def to(self, device):
            calls.append(f"params to {torch.device(device).type}")

    class Worker(SimpleNamespace):  # what the rank reads of a trained worker, and its calls
        def train(self, batch):
            layer(torch.ones(1, 2)).sum().backward()
            calls.append("train")
            return {"policy/policy_loss": 1.0}

        def compute_logprobs(self, batch):
            calls.append("compute_logprobs")
            return torch.zeros(1, 1)

    rank = object.__new__(TrainingRank)
    rank._worker = Worker(optimizer=optimizer, model=Model(), parallel=SimpleNamespace(device=gpu, cpu_offload=False))
    rank._group = rank._worker.parallel   # what setup() sets: the rank's FSDP group
    rank.ipc_transfer = None
    monkeypatch.setattr("ridgeline.distributed.ray_workers.TrainedWorker", Worker)  # it has an optimizer
    rank.shares_gpu = False  # engines on GPUs of their own: the rank keeps its GPU
    assert rank.train(None) == {"policy/policy_loss": 1.0} and calls == ["train"]
    calls.clear()
    rank.shares_gpu = True
    rank.train(None)
    handed_back = ["params to cpu", "gc.collect", "empty_cache", "ipc_collect"]
    assert calls == ["params to cuda", "train", *handed_back]
    assert all(p.grad is None for p in layer.parameters())
    calls.clear()
    rank.compute_logprobs(None)
    rank.finish_ipc()
    assert calls == ["params to cuda", "compute_logprobs", *handed_back, *handed_back]
    calls.clear()
    rank.worker.parallel.cpu_offload = True  # FSDP2 keeps them on the host already: nothing to move
    rank.compute_logprobs(None)
    assert calls == ["compute_logprobs", "gc.collect", "empty_cache", "ipc_collect"]


# -- 4. engines start alone, are waited for and put to sleep before any rank loads a model ---------

class _OrderRay:
    """`ray.get` over stand-in actors whose calls go into one log, in the order they run."""

    def __init__(self):
        self.log = []

    def get(self, calls):  # `ActorCalls.get`: labelled calls
        return [call.ref() for call in calls]


class _Method:
    def __init__(self, log, name, value=None):
        self.log, self.name, self.value = log, name, value

    def remote(self, *args):
        return lambda: self.log.append((self.name, *args)) or self.value


class _Engine:
    def __init__(self, log, index):
        self.dtype = _Method(log, f"engine {index} built", "bfloat16")
        self.sleep = _Method(log, f"engine {index} sleep")


def test_engines_are_built_and_asleep_before_the_ranks_start():
    from ridgeline.distributed.ray_workers import start_engines_first

    ray = _OrderRay()
    engines = [_Engine(ray.log, i) for i in range(2)]
    started = start_engines_first(ray, engines, ["engine 0", "engine 1"], True, lambda: ray.log.append(("ranks start",)) or "ranks")
    assert started == "ranks"
    assert ray.log == [("engine 0 built",), ("engine 1 built",), ("engine 0 sleep", 2), ("engine 1 sleep", 2),
                       ("ranks start",)]
    ray.log.clear()  # engines on GPUs of their own stay awake; remote engines have no actors
    start_engines_first(ray, engines, ["engine 0", "engine 1"], False, lambda: ray.log.append(("ranks start",)))
    assert ray.log == [("engine 0 built",), ("engine 1 built",), ("ranks start",)]


# -- 8. the colocated sync gathers the weights bucket by bucket, never the whole model -------------

def test_a_bucket_reads_its_weights_only_when_it_is_packed():
    import pytest

    from ridgeline.inference.weight_transport import WeightSyncError

    weights = [(f"w{i}", torch.full((8,), float(i))) for i in range(4)]  # 32 bytes each
    specs = [(name, tuple(t.shape), t.dtype) for name, t in weights]
    reads = []

    def gathered(pairs):  # what a rank's GatheredState does: one all-gather per tensor read
        for name, tensor in pairs:
            reads.append(name)
            yield name, tensor
    sender = IPCSender(torch.bfloat16, threshold_bytes=128, device="cpu")  # two tensors per bucket
    with sender.start(gathered(weights), version=2, specs=specs) as transfer:
        assert (transfer.count, reads) == (2, [])
        first = transfer.bucket(0)
        assert reads == ["w0", "w1"] and [m.name for m in first.tensors] == ["w0", "w1"]
        received = dict(IPCReceiver().weights([first, transfer.bucket(1)]))
        assert reads == ["w0", "w1", "w2", "w3"]
        assert all(torch.equal(received[name], t.to(torch.bfloat16)) for name, t in weights)
    with sender.start(gathered(reversed(weights)), version=3, specs=specs) as transfer:
        with pytest.raises(WeightSyncError, match=r"bucket 0 expected w0 \(8,\) from the weights, got w3 \(8,\)"):
            transfer.bucket(0)


def test_gathered_state_reads_one_parameter_at_a_time_and_plans_from_meta_tensors():
    from ridgeline.distributed.fsdp import GatheredState

    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight  # tied: one parameter, named once
    state = GatheredState(model, torch.device("cpu"))
    assert list(state) == ["0.weight"]
    assert state.specs()["0.weight"].is_meta and state.specs()["0.weight"].shape == (5, 3)
    assert torch.equal(state["0.weight"], model[0].weight) and not state["0.weight"].requires_grad


# -- the colocated path end to end (tests/gpu/test_colocated_gpu.py runs it on a GPU) --------------

@pytest.mark.integration
def test_the_colocated_path_runs_in_ray_s_order_and_hands_the_trained_weights_over(tmp_path):
    """One FSDP2 rank (gloo) and its embedded engine process on this CPU, through start-up, a step
    and the IPC sync (shared memory standing in for CUDA IPC): the engine is built and asleep
    before the rank loads its model, and after the handoff it passes the probe and generates."""
    from colocated_path import colocated_overrides, run_colocated

    from ridgeline.config import load_config
    from ridgeline.distributed.weight_sync import check_probe, probe_tolerance
    from ridgeline.inference.types import EngineRequest, SamplingParams

    cfg = load_config(colocated_overrides(tmp_path, "cpu"))
    run = run_colocated(cfg, [EngineRequest([5, 6, 7], SamplingParams(max_generate_length=3))])
    assert run.order == ["engine built", "engine asleep", "rank set up"]
    assert run.metrics["policy/policy_update_steps"] == 1.0 and run.version == 1
    check_probe(torch.tensor(run.trainer_probe), torch.tensor(run.engine_probe), probe_tolerance(torch.bfloat16),
                version=1)
    assert len(run.responses) == 1 and 1 <= len(run.responses[0]) <= 3


def test_a_lora_policy_plans_its_merged_buckets_from_meta_tensors(tmp_path):
    """A LoRA policy's engine weights (merged W + scaling B A, plain names) planned from `meta`
    tensors have the names, shapes and dtypes of those computed from the real weights, and the
    lazy source yields exactly them, one at a time."""
    from ridgeline.config import load_config
    from ridgeline.distributed.fsdp import GatheredState
    from ridgeline.models.tiny import build_char_tokenizer
    from ridgeline.training.build import build_policy_worker

    cfg = load_config(["+experiment=tiny", f"trainer.export_path={tmp_path}", "trainer.policy.model.lora.rank=8"])
    worker = build_policy_worker(cfg, build_char_tokenizer(), training_batches=1)
    with torch.no_grad():  # trained-looking adapters, so the merge changes the weights
        for name, p in worker.model.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.1)
    state = GatheredState(worker.model, torch.device("cpu"))
    planned = [(name, tuple(t.shape), t.dtype) for name, t in worker.engine_weights(state.specs())]
    real = list(worker.engine_weights(worker.model.state_dict()))
    assert planned == [(name, tuple(t.shape), t.dtype) for name, t in real]
    assert not any("lora" in name for name, _, _ in planned)
    for (name, value), (real_name, real_value) in zip(worker.engine_weights(state), real):
        assert name == real_name and torch.equal(value, real_value), name
