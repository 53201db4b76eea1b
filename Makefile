# Two commands on a fresh machine:  `make demo` (the main job)  and  `make test` (the fast tests).
# `make test-all` is what CI runs: every test, the slow ones and the end-to-end ones included (tests/e2e once per
# ComfyUI checkout in COMFYUI_DIRS, or against COMFYUI_DIR).
# Both create ./.venv first: `make demo` with the runtime and the images / video extras only, `make test` with the
# test extra (pytest, ruff, triton...). TORCH_SPEC pins the torch build (on the project's CI machines
# torch==2.13.0 resolves to a local CPU wheel; elsewhere set TORCH_SPEC to the build you want).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: venv demo test test-slow test-e2e test-all streamdiffusion lint format bench clean

# Two stamps, one per set of extras: the demo needs only the runtime and the output extras (PNG, MP4); the tests
# add the test extra (pytest, ruff, triton alone is about 1 GB, diffusers, transformers...). Each stamp records
# what its pip install brought in, so `make demo` on a fresh machine never downloads the test tools, and
# `make test` after `make demo` adds them to the same venv.
RUNTIME_STAMP := $(VENV)/.fewstep-runtime-installed
TEST_STAMP := $(VENV)/.fewstep-test-installed

venv: $(TEST_STAMP)

$(VENV)/.fewstep-torch-installed:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	touch $@

$(RUNTIME_STAMP): $(VENV)/.fewstep-torch-installed pyproject.toml setup.py
	$(BIN)/python -m pip install -q -e ".[images,video]"
	touch $@

$(TEST_STAMP): $(VENV)/.fewstep-torch-installed pyproject.toml setup.py
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

demo: $(RUNTIME_STAMP)
	$(BIN)/python -m fewstep demo --out out/demo

# The fast set: everything but the tests marked `slow` and the end-to-end ones (tests/e2e).
test: venv
	$(BIN)/python -m pytest -q -m "not slow" --ignore=tests/e2e

test-slow: venv
	$(BIN)/python -m pytest -q -m slow --ignore=tests/e2e

# tests/e2e against a real ComfyUI: once per checkout in COMFYUI_DIRS (space-separated), else against COMFYUI_DIR;
# with neither, every test there is skipped with that reason. One summary line per ComfyUI version
# (tests/e2e/run_suites.py), `== tests/e2e on ComfyUI 0.8.0 (618b803d): N passed, M skipped in S s`.
test-e2e: venv
	$(BIN)/python tests/e2e/run_suites.py --e2e-only

# What CI runs: one pytest run of every test but tests/e2e (the slow ones included), with StreamDiffusion's own
# code for the stream-batch cross-check when it could be installed, then tests/e2e as in test-e2e. Each run ends
# with its summary line and all of them are repeated at the end; it fails if any run failed.
test-all: venv streamdiffusion
	FEWSTEP_STREAMDIFFUSION_DIR="$(FEWSTEP_STREAMDIFFUSION_DIR)" $(BIN)/python tests/e2e/run_suites.py

# StreamDiffusion 0.1.1 (PyPI) pins diffusers==0.24.0 while the test extra pins diffusers==0.42.1, so it cannot
# be in the extra: pip refuses the pair. The cross-check only runs its pure-torch code (predict_x0_batch,
# SimilarImageFilter), which imports and runs with diffusers 0.42.1, so it goes into a folder of its own
# without its dependencies and tests/engine/stream_batch/test_stream_batch.py finds it through FEWSTEP_STREAMDIFFUSION_DIR.
# Offline, the install fails with a loud line and those tests skip with their reason.
FEWSTEP_STREAMDIFFUSION_DIR ?= $(abspath $(VENV))/streamdiffusion-0.1.1
streamdiffusion: venv
	test -f "$(FEWSTEP_STREAMDIFFUSION_DIR)/streamdiffusion/pipeline.py" || \
	  $(BIN)/python -m pip install -q --no-deps --target "$(FEWSTEP_STREAMDIFFUSION_DIR)" streamdiffusion==0.1.1 || \
	  echo "== streamdiffusion 0.1.1 did not install: its cross-checks in tests/engine/stream_batch/test_stream_batch.py will be skipped" >&2

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: venv
	$(BIN)/python bench/run_all

clean:
	rm -rf $(VENV) out .pytest_cache .ruff_cache *.egg-info
