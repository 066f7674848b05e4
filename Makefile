# `make demo` and `make test` are the two set-up commands of the README: each installs what it needs
# into a virtual environment in this folder (.venv), then runs.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU build of torch; a plain `pip install torch` would download a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo demo-minimal test test-fast test-floor lint typecheck clean vendor-wheels

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[test]"
	touch $@

install: $(VENV)/.installed

# The flagship example on the auto-detected backend, 2 processes, ZeRO-3: the guide's Trainer script
# (examples/qwen_finetune/finetune.py, `from xshard.trainer import Trainer, TrainingArguments`) with a tiny
# random Qwen2 and a tokenizer built offline, fine-tuned on the shipped synthetic Alpaca-format data (about
# a minute on 2 CPU cores; the Trainer logs a loss of about 5.7 at step 10, falling to about 2.3 at step 80).
DEMO_OUT ?= out/demo-qwen
demo: install
	rm -rf $(DEMO_OUT)
	$(BIN)/xshard launch --nproc 2 examples/qwen_finetune/finetune.py \
	    --deepspeed examples/qwen_finetune/ds_config_zero3.json --output_dir $(DEMO_OUT) \
	    --max_steps 80 --per_device_train_batch_size 4 --model_max_length 256 --learning_rate 3e-3 \
	    --warmup_ratio 0.03 --lr_scheduler_type cosine --logging_steps 10 --save_steps 40 --save_total_limit 1 \
	    --seed 1234

# The smallest script that runs unchanged on every backend.
demo-minimal: install
	$(BIN)/xshard launch --nproc 2 examples/minimal.py

# Everything: ruff, the whole suite in .venv (tests/README.md maps features to files), the Trainer's tests on the
# lowest transformers pyproject allows (test-floor), then the XLA tests.
# Each half runs on PYTEST_WORKERS pytest-xdist workers (tests/conftest.py keeps a file's tests on one worker
# and gives each worker's torchrun a port): on 2 cores the serial main half keeps the CPUs about 67% busy (its
# tests wait on the jobs they start), two workers about 92%; the XLA half compiles on one core at a time.
# PYTEST_WORKERS=0 runs each half in one process.
PYTEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadfile
test: install vendor-wheels
	$(BIN)/ruff check .
	$(MAKE) --no-print-directory typecheck
	$(VENDOR_ENV) $(BIN)/python -m pytest -q $(PYTEST_PARALLEL) --durations=25
	$(MAKE) --no-print-directory test-floor
	$(MAKE) --no-print-directory test-xla

# The Trainer's tests on the lowest transformers pyproject allows (5.6.0, also LLaMA-Factory's cap), while .venv
# holds the newest: that release and the hub and tokenizers it takes, installed beside .venv in .floor and put
# first on the path (everything else is .venv's). XSHARD_TRANSFORMERS_FLOOR makes the tests check the version.
# kernels: the newest transformers requires kernels 0.19, whose LayerRepository refuses the arguments 5.6.0
# builds its hub-kernel table with at import ("Either a revision or a version must be specified"); 5.6.0
# declares kernels >=0.12,<0.13.
FLOOR := .floor
FLOOR_PACKAGES := transformers==5.6.0 huggingface-hub==1.33.0 tokenizers==0.22.2 httpx==0.28.1 httpcore==1.0.9 \
    kernels==0.12.3
$(FLOOR)/.installed: $(VENV)/.installed
	rm -rf $(FLOOR)
	$(BIN)/pip install --quiet --no-deps --target $(FLOOR) $(FLOOR_PACKAGES)
	touch $@

test-floor: $(FLOOR)/.installed
	PYTHONPATH=$(FLOOR) XSHARD_TRANSFORMERS_FLOOR=5.6.0 $(BIN)/python -m pytest -q $(PYTEST_PARALLEL) tests/test_trainer.py \
	    tests/test_trainer_arguments.py tests/test_trainer_floor.py

# The single-process tests: everything but the tests marked `multiprocess` (they start jobs of several
# processes) and `xla` (they need torch_xla, see test-xla). For the edit-run loop; `make test` before a merge.
test-fast: install vendor-wheels
	$(VENDOR_ENV) $(BIN)/python -m pytest -q -m "not multiprocess and not xla"

lint: install
	$(BIN)/ruff check .
	$(MAKE) --no-print-directory typecheck

# The type checker, mypy, over xshard/ (backends/ through the xshard/backends link); its settings, and
# why mypy: [tool.mypy] in pyproject.toml.
typecheck: install
	$(BIN)/mypy

# The device check (benchmarks/README.md): xshard measured on one GPU (or NPU: DEVICE_CHECK_ARGS="--device npu";
# the CPU form: DEVICE_CHECK_ARGS="--device cpu --quick"); report.json and report.md in out/device-check/.
# It installs nothing: the project's venv where there is one, else $(PYTHON) (a device machine's own torch
# build, which a CPU-only venv would not replace offline).
DEVICE_CHECK_ARGS ?=
DEVICE_CHECK_PYTHON := $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
.PHONY: device-check
device-check:
	$(DEVICE_CHECK_PYTHON) benchmarks/device_check.py $(DEVICE_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(FLOOR) build *.egg-info .pytest_cache .mypy_cache

# Conformance (tests/test_vendor_conformance.py): the device layer's vendor calls and the test fakes are
# checked against the real wheel of the torch-npu release for this torch, read with ast (torch_npu cannot
# be imported without CANN), and of the torch-tpu release (TorchTPU; it cannot be imported without libtpu).
# Downloaded once (about 45 MB and 96 MB); the Python sources are the same in every platform's wheel, so
# one fixed platform keeps the file name stable. The tests fail, not skip, under make when a wheel is
# missing.
NPU_RELEASE   ?= 2.13.0
TPU_RELEASE   ?= 0.2.0
VENDOR_WHEELS := .cache/vendor-wheels
NPU_WHEEL     := $(VENDOR_WHEELS)/.torch-npu-$(NPU_RELEASE)
TPU_WHEEL     := $(VENDOR_WHEELS)/.torch-tpu-$(TPU_RELEASE)
VENDOR_ENV    := XSHARD_VENDOR_WHEELS=$(VENDOR_WHEELS) XSHARD_NPU_RELEASE=$(NPU_RELEASE) \
                 XSHARD_TPU_RELEASE=$(TPU_RELEASE) XSHARD_REQUIRE_VENDOR_WHEELS=1

$(NPU_WHEEL): | $(VENV)/.installed
	mkdir -p $(VENDOR_WHEELS)
	$(BIN)/pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
	    --platform manylinux_2_28_x86_64 --dest $(VENDOR_WHEELS) "torch-npu==$(NPU_RELEASE)"
	touch $@

$(TPU_WHEEL): | $(VENV)/.installed
	mkdir -p $(VENDOR_WHEELS)
	$(BIN)/pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
	    --platform manylinux_2_31_x86_64 --dest $(VENDOR_WHEELS) "torch-tpu==$(TPU_RELEASE)"
	touch $@

vendor-wheels: $(NPU_WHEEL) $(TPU_WHEEL)

# XLA: real torch_xla on the CPU (PJRT_DEVICE=CPU) in its own environment (.venv-xla), because
# torch_xla pins the torch release it was built for. Building it takes about 3 minutes and 7 GB.
XLA_VENV := .venv-xla
XLA_BIN  := $(XLA_VENV)/bin
XLA_SPEC ?= torch==2.9.0 torch-xla==2.9.0
# XLA_SPEC is named again when xshard is installed, so that its dependencies cannot replace torch.

.PHONY: install-xla test-xla clean-xla

$(XLA_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(XLA_VENV)
	$(XLA_BIN)/pip install --quiet --upgrade pip
	$(XLA_BIN)/pip install --quiet $(XLA_SPEC)
	$(XLA_BIN)/pip install --quiet -e ".[test]" $(XLA_SPEC)
	$(XLA_BIN)/python -c "import torch, torch_xla; print('torch', torch.__version__, 'torch_xla', torch_xla.__version__)"
	touch $@

install-xla: $(XLA_VENV)/.installed

# XSHARD_REQUIRE_XLA=1: an environment without torch_xla is an error here, not a run of skipped tests.
test-xla: install-xla
	PJRT_DEVICE=CPU XSHARD_REQUIRE_XLA=1 $(XLA_BIN)/python -m pytest -q $(PYTEST_PARALLEL) --durations=10 -m xla tests

clean-xla:
	rm -rf $(XLA_VENV)
