# One venv for everything. TORCH_SPEC is installed first so that pip keeps it:
# torch==2.13.0 is a CPU wheel on our build machines; on a GPU machine use e.g.
#   make install TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu128"
# `make test-oldest` runs the tests of everything transformers touches (the model, generate, the
# pipeline, saved folders, Trainer/PEFT/export, the tokenizer, the metric) and of what Accelerate runs (launches,
# checkpoints) again in .venv-oldest, on the oldest transformers and accelerate that pyproject.toml allows (read
# from its "transformers>=X,<Y" and "accelerate>=X"); CI runs both, each printing the versions it resolved.
# `make test-gpu` runs the GPU tests (tests/gpu/test_gpu.py and the compiled static-cache test) on a CUDA machine with
# what is installed, without installing (a GPU machine may have no network): `make install TORCH_SPEC="torch
# --index-url https://download.pytorch.org/whl/cu130"` first where it has one. It uses $(VENV) if there is one,
# else GPU_PYTHON (default $(PYTHON)); without CUDA the tests skip. `python -m benchmarks.gpu_smoke` runs them
# and the GPU measurements in one go.
# Training tests pin their precision; the bf16 default follows the CPU's flags, which VANILLA_TRANSFORMER_CPU_BF16=1
# (or 0) overrides: `VANILLA_TRANSFORMER_CPU_BF16=1 make test-fast` runs the suite as on a CPU that computes bf16.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PIN ?=
TESTS ?=
TRANSFORMERS_TESTS = tests/modeling tests/test_onednn_decoding.py tests/export tests/test_hub.py tests/model_card tests/test_tokenizer.py tests/metrics
ACCELERATE_TESTS = tests/training/test_distributed.py tests/training/test_accelerate_configs.py tests/training/test_checkpoints.py
# The versions a run resolved, printed before its tests (the README's tested range is held to them: tests/test_readme.py).
VERSIONS = import importlib.metadata as m, platform; print('python', platform.python_version(), '|', ' | '.join(f'{p} {m.version(p)}' for p in ('torch', 'transformers', 'accelerate', 'datasets', 'tokenizers', 'peft', 'huggingface_hub')))
GPU_TESTS = tests/gpu/test_gpu.py tests/modeling/test_search.py::test_greedy_search_with_a_static_cache_compiles_the_decoder_step_into_one_graph
BIN = $(VENV)/bin
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
TRANSFORMERS_OLDEST := $(shell sed -n 's/^ *"transformers>=\([0-9.]*\),.*/\1/p' pyproject.toml)
ACCELERATE_OLDEST := $(shell sed -n 's/^ *"accelerate>=\([0-9.]*\)".*/\1/p' pyproject.toml)

.PHONY: install test test-fast test-gpu test-oldest demo bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q -e ".[test]" $(PIN)

test: install  # the whole suite, tests spread over up to 4 processes (pytest-xdist)
	@$(BIN)/python -c "$(VERSIONS)"
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n auto --maxprocesses 4 --durations=10 $(TESTS)

test-fast: install  # every unit test; no process started, no command run end to end
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not slow" --durations=10 $(TESTS)

test-gpu:  # no install: see above
	@$(GPU_PYTHON) -c "import torch, transformers; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '| GPU', torch.cuda.is_available() and torch.cuda.get_device_name(), '| transformers', transformers.__version__)"
	HF_HUB_OFFLINE=1 $(GPU_PYTHON) -m pytest -q --durations=10 $(GPU_TESTS)

test-oldest:
	@test -n "$(TRANSFORMERS_OLDEST)" || { echo 'no "transformers>=X,<Y" in pyproject.toml'; exit 1; }
	@test -n "$(ACCELERATE_OLDEST)" || { echo 'no "accelerate>=X" in pyproject.toml'; exit 1; }
	$(MAKE) test VENV=.venv-oldest PIN="transformers==$(TRANSFORMERS_OLDEST) accelerate==$(ACCELERATE_OLDEST)" \
		TESTS="$(TRANSFORMERS_TESTS) $(ACCELERATE_TESTS)"

demo: install
	HF_HUB_OFFLINE=1 $(BIN)/vanilla-transformer quickstart $(DEMO_ARGS)

bench: install
	$(BIN)/pip install -q -e ".[bench]"
	HF_HUB_OFFLINE=1 $(BIN)/python -m benchmarks $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .venv-oldest build *.egg-info .pytest_cache
