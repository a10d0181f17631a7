# megatron_logra: `make demo` runs the CPU demo, `make test` the whole suite.
# Both create .venv (Python 3.11, pinned packages) on first use; `make setup` does only that.

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export OMP_NUM_THREADS ?= 1
# The demo and the tests run on CPU over gloo; never let them pick up a GPU by accident.
export CUDA_VISIBLE_DEVICES ?=

.PHONY: setup demo test lint clean

setup: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (Python 3.11) on PATH"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	# torch first and alone: pip then takes the CPU wheel of 2.13.0, not a multi-GB CUDA build.
	$(VENV)/bin/pip install --quiet torch==2.13.0
	$(VENV)/bin/pip install --quiet -r requirements.lock
	$(VENV)/bin/pip install --quiet --no-deps -e .
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) tools/demo_cpu.py

test: $(STAMP)
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) runs .data .pytest_cache
