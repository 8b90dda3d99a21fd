"""`ridgeline doctor`'s SGLang checks (ridgeline/entrypoints/doctor_sglang.py) on made-up installs
and machines, and the real import probe here (where sglang is not installed: make test-sglang runs
the doctor against a real install)."""

import pytest

from ridgeline.entrypoints.doctor import FAIL, NOT_CHECKED, OK, WARN, Package, all_checks, summary, verdict
from ridgeline.entrypoints.doctor_sglang import SGLANG_MIN_WEIGHT_SYNC_TIMEOUT_S, SGLangInstall, probe_sglang_install

from test_doctor import config, cpu_machine, gpu_machine, statuses

PACKAGE = Package("0.5.23", "sglang")
IMPORTS_ON_CPU = SGLangInstall("0.5.23", None, cpu_backend=True, seconds=12.0)
IMPORTS_ON_CUDA = SGLangInstall("0.5.23", None, cpu_backend=False, seconds=9.0)


def with_sglang(facts, install):
    facts.sglang = install
    return facts


def details(checks, name):
    return [(c.status, c.detail) for c in checks if c.name == name]


def test_sglang_on_a_cpu_runs_on_its_cpu_backend():
    facts, cfg = with_sglang(cpu_machine(sglang=PACKAGE), IMPORTS_ON_CPU), config("sglang")
    checks = all_checks(facts, cfg)
    [(status, detail)] = details(checks, "generator.backend")
    assert status == OK and detail.startswith("sglang 0.5.23 on SGLang's CPU backend (no CUDA GPU: device=cpu")
    assert details(checks, "attention backend") == [(OK, "torch_native (SGLang's CPU backend)")]
    assert verdict(checks, summary(cfg, facts)) == "ready (generator.backend=sglang on CPU)"


def test_sglang_that_does_not_import_fails_with_the_error_and_the_setup():
    broken = SGLangInstall(None, "ModuleNotFoundError: No module named 'sgl_kernel'", cpu_backend=True, seconds=3.0)
    checks = all_checks(with_sglang(cpu_machine(sglang=PACKAGE), broken), config("sglang"))
    assert details(checks, "generator.backend") == [(FAIL, (
        "generator.backend=sglang: sglang does not import here (CPU backend, SGLANG_USE_CPU_ENGINE=1): "
        "ModuleNotFoundError: No module named 'sgl_kernel'. Fix: make setup-sglang (SGLang's CPU backend in "
        ".venv-sglang, docs/engines.md)"))]


def test_sglang_missing_or_not_probed():
    missing = all_checks(cpu_machine(), config("sglang"))
    assert "needs the sglang package, which is not installed. Fix: make setup-sglang" in verdict(missing, "")
    on_gpu = all_checks(gpu_machine((9, 0)), config("sglang"))
    assert 'Fix: pip install -e ".[sglang]", or generator.backend=hf' in verdict(on_gpu, "")
    unprobed = all_checks(cpu_machine(sglang=PACKAGE), config("sglang"))
    assert statuses(unprobed, "generator.backend") == [NOT_CHECKED]


def test_another_release_than_0_5_warns():
    old = SGLangInstall("0.4.6", None, cpu_backend=False, seconds=5.0)
    checks = all_checks(with_sglang(gpu_machine((9, 0), sglang=Package("0.4.6", "sglang")), old), config("sglang"))
    assert statuses(checks, "generator.backend") == [OK] and statuses(checks, "sglang version") == [WARN]


@pytest.mark.parametrize("capability, fits", [((8, 0), "fa3"), ((9, 0), "fa3"), ((10, 0), "flashinfer"),
                                              ((12, 0), "flashinfer"), ((7, 5), "triton")])
def test_unset_attention_backend_shows_the_one_that_fits_the_gpu(capability, fits):
    checks = all_checks(with_sglang(gpu_machine(capability, sglang=PACKAGE), IMPORTS_ON_CUDA), config("sglang"))
    [(status, detail)] = details(checks, "attention backend")
    assert status == OK and detail.endswith(f"+generator.engine_init_kwargs.attention_backend={fits}")


def test_fa3_on_blackwell_fails_naming_the_capability():
    facts = with_sglang(gpu_machine((10, 0), sglang=PACKAGE), IMPORTS_ON_CUDA)
    checks = all_checks(facts, config("sglang", attention_backend="fa3"))
    assert statuses(checks, "generator.backend") == [OK]
    [attention] = [c for c in checks if c.name == "attention backend"]
    assert attention.status == FAIL and "10.0" in attention.detail
    assert "attention_backend=flashinfer" in verdict(checks, "")
    # the GPU line names the backend that fits
    assert "SM 10.0, attention backend: flashinfer" in next(c.detail for c in checks if c.name == "gpu 0")


def test_fa3_on_hopper_is_ready_and_on_a_cpu_fails():
    facts = with_sglang(gpu_machine((9, 0), sglang=PACKAGE), IMPORTS_ON_CUDA)
    checks = all_checks(facts, config("sglang", attention_backend="fa3"))
    assert not [c for c in checks if c.status == FAIL], checks
    assert verdict(checks, summary(config("sglang"), facts)) == "ready (generator.backend=sglang on 2x NVIDIA B200)"
    on_cpu = all_checks(with_sglang(cpu_machine(sglang=PACKAGE), IMPORTS_ON_CPU), config("sglang", attention_backend="fa3"))
    assert statuses(on_cpu, "attention backend") == [FAIL]


def test_ray_runtime_env_hook_warns(monkeypatch):
    monkeypatch.setenv("RAY_RUNTIME_ENV_HOOK", "ray._private.runtime_env.uv_runtime_env_hook.hook")
    checks = all_checks(with_sglang(cpu_machine(sglang=PACKAGE), IMPORTS_ON_CPU), config("sglang"))
    [(status, detail)] = details(checks, "RAY_RUNTIME_ENV_HOOK")
    assert status == WARN and detail.endswith("Fix: unset RAY_RUNTIME_ENV_HOOK")
    monkeypatch.delenv("RAY_RUNTIME_ENV_HOOK")
    assert not details(all_checks(cpu_machine(), config("sglang")), "RAY_RUNTIME_ENV_HOOK")
    monkeypatch.setenv("RAY_RUNTIME_ENV_HOOK", "x")  # other engines: not SGLang's problem
    assert not details(all_checks(cpu_machine(), config("hf")), "RAY_RUNTIME_ENV_HOOK")


@pytest.mark.parametrize("strategy, locally, warns", [("single", False, True), ("fsdp2", True, True),
                                                       ("single", True, False)])
def test_a_short_weight_sync_timeout_warns_where_weights_travel_over_a_group(strategy, locally, warns):
    cfg = config("sglang", strategy=strategy, locally=locally)
    cfg.generator.weight_sync_timeout = 60
    checks = all_checks(with_sglang(cpu_machine(sglang=PACKAGE, ray=Package("2.60.0", "ray")), IMPORTS_ON_CPU), cfg)
    found = details(checks, "weight sync timeout")
    assert bool(found) is warns
    if warns:
        assert found[0][0] == WARN
        assert found[0][1].endswith(f"Fix: generator.weight_sync_timeout={SGLANG_MIN_WEIGHT_SYNC_TIMEOUT_S:g}")
    cfg.generator.weight_sync_timeout = SGLANG_MIN_WEIGHT_SYNC_TIMEOUT_S
    assert not details(all_checks(cpu_machine(), cfg), "weight sync timeout")


def test_the_import_probe_reports_the_error_of_a_python_without_sglang():
    install = probe_sglang_install(cuda=False)  # this environment has no sglang
    assert install.version is None and install.cpu_backend
    assert install.error == "ModuleNotFoundError: No module named 'sglang'"
