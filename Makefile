# deep-model-perf — the user interface. Every variable can be overridden: make train ARGS="train.max_steps=100"
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/cpu-tiny.yaml
ARGS ?=
PYTEST_ARGS ?=
# Scale-out (docs/scale-out.md): NPROC processes per node through torchrun; NNODES > 1 adds a static rendezvous
# at MASTER_ADDR:MASTER_PORT (run the same command on every node with its NODE_RANK). NPROC=1, NNODES=1: plain python.
NPROC ?= 1
NNODES ?= 1
NODE_RANK ?= 0
MASTER_ADDR ?= 127.0.0.1
MASTER_PORT ?= 29500
ifeq ($(NPROC)$(NNODES),11)
LAUNCH := $(PY) -m train
else ifeq ($(NNODES),1)
LAUNCH := $(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) -m train
else
LAUNCH := $(VENV)/bin/torchrun --nnodes=$(NNODES) --node_rank=$(NODE_RANK) --nproc_per_node=$(NPROC) \
	--master_addr=$(MASTER_ADDR) --master_port=$(MASTER_PORT) -m train
endif

.DEFAULT_GOAL := help
.PHONY: help setup data train smoke smoke-2node buckets test test-slow lint clean distclean

help: ## list the targets
	@grep -E '^[a-z][a-z0-9-]*:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(VENV)/.installed: requirements.txt requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

setup: $(VENV)/.installed ## create .venv and install the pinned dependencies (CPU torch)

data: setup ## make the WordNet database available (apt-get install wordnet-base when root)
	PY=$(PY) scripts/install_wordnet.sh

train: setup data ## train with CONFIG (default configs/cpu-tiny.yaml); ARGS="section.key=value ..." overrides; NPROC=2 for DDP
	$(LAUNCH) train --config $(CONFIG) $(ARGS)

smoke: setup data ## a <= 60 s CPU run on a subset; writes runs/smoke/report.json (NPROC=2: the same under DDP)
	$(LAUNCH) train --config configs/smoke.yaml $(ARGS)

smoke-2node: setup data ## the smoke run as two simulated nodes (two torchrun launches, loopback rendezvous) → runs/smoke-2node
	PY=$(PY) NPROC=$(NPROC) MASTER_PORT=$(MASTER_PORT) scripts/simulate_2node.sh --config configs/smoke.yaml train.run_id=smoke-2node $(ARGS)

buckets: setup data ## fit bucket boundaries offline and save them as JSON
	$(PY) -m train buckets --config $(CONFIG) $(ARGS)

test: setup ## unit + short end-to-end tests on CPU (excludes tests marked slow)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-slow: setup ## only the tests marked slow
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

lint: setup ## ruff
	$(VENV)/bin/ruff check .

clean: ## remove run outputs and caches (keeps .venv)
	rm -rf runs .cache .pytest_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean ## also remove .venv
	rm -rf $(VENV)
