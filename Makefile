# `make demo` and `make test` are the two set-up commands of the README: each installs what it needs
# into a virtual environment in this folder (.venv), then runs.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch; a plain `pip install torch` would download a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/torchrun --standalone --nproc_per_node 2 examples/minimal.py

test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
