# deep-model-perf — the user interface. Every variable can be overridden: make train ARGS="train.max_steps=100"
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/cpu-tiny.yaml
ARGS ?=
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help setup data train smoke buckets test test-slow lint clean distclean warmup bench-compile

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

warmup: setup data ## compile + warm every batch shape of CONFIG's bucket plan into the shared cache; writes runs/<id>/warmup.json
	$(PY) -m train warmup --config $(CONFIG) compile.enabled=true $(ARGS)

bench-compile: setup data ## cold vs warm compile cache (separate processes), compiled vs eager steps; runs/<id>/bench-compile.json
	$(PY) -m train bench-compile --config $(CONFIG) $(ARGS)

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
