# One venv for everything. TORCH_SPEC is installed first so that pip keeps it:
# torch==2.13.0 is a CPU wheel on our build machines; on a GPU machine use e.g.
#   make install TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN = $(VENV)/bin

.PHONY: install test demo bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q -e ".[test]"

test: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

demo: install
	HF_HUB_OFFLINE=1 $(BIN)/vanilla-transformer quickstart $(DEMO_ARGS)

bench: install
	$(BIN)/pip install -q -e ".[bench]"
	HF_HUB_OFFLINE=1 $(BIN)/python -m benchmarks $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
