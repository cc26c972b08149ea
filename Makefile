# The README's two commands: `make demo` and `make test`. Each creates or refreshes the
# virtual environment at .venv/ with the project installed in editable mode; `make test` adds
# the dev extra (pytest, ruff, wandb, torchx), which the demo does not import.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
PURELIB = "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"

SGLANG_VENV := .venv-sglang

.PHONY: setup dev-setup sglang-env demo toy-demo test test-quick clean gpu-check gpu-wheels

setup: $(STAMP)

dev-setup: $(DEV_STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, by exact version, so pip takes the local CPU wheel and no dependency
	# resolution can pull a CUDA build. pip byte-compiles what it installs one file at a time
	# (about half the set-up's CPU time), so it is told not to and compileall does it on every
	# core; like pip it skips a file that does not compile (torch ships one for Python 3.12 only).
	$(PY) -m pip install --quiet --no-compile torch==2.13.0
	$(PY) -m pip install --quiet --no-compile -e .
	$(PY) -m compileall -qq -j 0 $(PURELIB) || true
	touch $(STAMP)

# compileall skips what the first pass compiled: only the dev packages cost time here
$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --no-compile -e '.[dev]'
	$(PY) -m compileall -qq -j 0 $(PURELIB) || true
	touch $(DEV_STAMP)

# SGLang's own environment for the rollout servers on GPU machines (python -m sorl_megatron.cluster
# launches them with its Python). SGLang pins exact torch and transformers versions, so it lives
# beside the trainer's .venv/, not in it; requirements-sglang.txt pins the SGLang release whose
# torch is the trainer's (the NCCL weight broadcast joins only peers of the same NCCL build).
sglang-env: $(SGLANG_VENV)/.installed

$(SGLANG_VENV)/.installed: requirements-sglang.txt $(STAMP)
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install --quiet -r requirements-sglang.txt || { \
	  echo "make sglang-env failed. SGLang 0.5.21 depends on cuda-tile, whose install step downloads from"; \
	  echo "NVIDIA's package index (pypi.nvidia.com): build this environment on a machine that reaches it (a GPU"; \
	  echo "node), or point python -m sorl_megatron.cluster at another SGLang with --server-python."; exit 1; } >&2
	# one NCCL in both environments (weight-update groups join ranks of each)
	$(PY) -m sorl_megatron.common.nccl_match $(SGLANG_VENV)/bin/python
	touch $@

# The CPU demo end to end: data, tokenizer and tiny MoE model, SFT, SO-GRPO RL, validation, plots.
# ARGS go to tools/demo.py: make demo ARGS="schedule.total_steps=20" (the demo's messages that
# suggest a command write it in this form, through SORL_MEGATRON_RERUN).
demo: setup
	SORL_MEGATRON_RERUN='make demo ARGS="{}"' $(PY) tools/demo.py $(ARGS)

# The algorithm core alone on a toy task (every loss, ~1 minute).
toy-demo: setup
	$(PY) -m sorl_megatron.toy_demo

# The whole suite, every test, on TEST_WORKERS pytest-xdist processes (default 2, one per core of
# the 2-core CI machine), each test file on one (--dist loadfile: a file's module fixtures are built
# once). Servers a test starts bind ports that another worker's process can take first: the
# trainer's embedded servers and the tests' own (tests/served.py) are launched again on a new port
# when that happens, and a world of one binds a port the system picks. pytest prints the 15 slowest
# tests and the wall time at the end (results/test-duration.md). test-quick leaves out the tests
# marked slow (multi-process and end-to-end); CI runs `make test`.
TEST_WORKERS ?= 2
PYTEST_ARGS = -q -n $(TEST_WORKERS) --dist loadfile --durations=15

test: dev-setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest $(PYTEST_ARGS) tests

test-quick: dev-setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest $(PYTEST_ARGS) -m "not slow" tests

# The first thing to run on a GPU machine (docs/how-to/gpu-check.md): environment, Triton kernels, the engine,
# FP8, one RL step per weight-sync transport. Not part of `make test` (tests/test_gpu_check.py
# runs its --device cpu half). Uses .venv's python when there is one, else the system python3
# (a GPU machine without network, with the wheels of `make gpu-wheels` installed).
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_PYTHON) tools/gpu_check.py $(ARGS)

# The wheels that GPU machine lacks (megatron-core, mbridge, this package, ...), into wheels/ (gitignored).
gpu-wheels:
	PYTHON=$(PY) tools/gpu_wheels.sh

clean:
	rm -rf $(VENV) $(SGLANG_VENV)
