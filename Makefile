# deep-model-perf — the user interface. Every variable can be overridden: make train ARGS="train.max_steps=100"
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/cpu-tiny.yaml
ARGS ?=
PYTEST_ARGS ?=

.DEFAULT_GOAL := help

.PHONY: help setup data train smoke buckets bench bench-batching bench-precision profile profile-pyspy profile-nsys test test-slow lint clean distclean

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

train: setup data ## train with CONFIG (default configs/cpu-tiny.yaml); ARGS="section.key=value ..." overrides
	$(PY) -m train train --config $(CONFIG) $(ARGS)

smoke: setup data ## a <= 60 s CPU run on a subset; writes runs/smoke/report.json
	$(PY) -m train train --config configs/smoke.yaml $(ARGS)

buckets: setup data ## fit bucket boundaries offline and save them as JSON
	$(PY) -m train buckets --config $(CONFIG) $(ARGS)

BENCH_CONFIG ?= configs/bench-cpu.yaml
bench: setup data ## training + inference benchmark, naive vs optimized, in one run → runs/bench/bench/
	$(PY) -m train bench --config $(BENCH_CONFIG) $(ARGS)
bench-batching: setup data ## batching methods side by side (a few minutes on 2 cores) -> runs/<id>/bench-batching.{json,md,png}
	$(PY) -m train bench-batching --config $(CONFIG) $(ARGS)
profile: setup data ## profile real training steps: torch.profiler table + py-spy + nsys + GPU sampling (what is available) → runs/profile/profile/
	$(PY) -m train profile --config $(CONFIG) $(ARGS)

profile-pyspy: setup data ## py-spy flame graph + speedscope of the running job, with its measured overhead
	$(PY) -m train profile --tools pyspy --config $(CONFIG) $(ARGS)

profile-nsys: setup data ## Nsight Systems capture of a few steps (needs nsys on PATH and CUDA; else says why it skipped)
	$(PY) -m train profile --tools nsys --config $(CONFIG) $(ARGS)

bench-precision: setup data ## fp32 vs the auto precision (+ bf16/fp16 on CUDA) on the same batches; JSON + markdown in the run dir
	$(PY) -m train bench-precision --config $(CONFIG) $(ARGS)

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
