# Set-up is part of every target: `make demo` and `make test` create or reuse .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# the example codec plugin (a separate package): installed beside dynamiq, its tests run with ours
PLUGIN := examples/dynamiq-nf4
# PyTorch's CPU build (on local disk on the project's machines) where no NVIDIA GPU is present;
# on a GPU machine pip resolves the range in pyproject.toml to a CUDA build.
TORCH_CPU := torch==2.13.0
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: demo test lint venv clean sanitize

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile $(PLUGIN)/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(HAS_GPU),)
	$(PY) -m pip install -q $(TORCH_CPU)
endif
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q -e $(PLUGIN)
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dynamiq demo

# pytest in two passes: the tests that start no torch.distributed processes on PYTEST_WORKERS
# processes (pytest-xdist), then those that do (marker `distributed`) one at a time, since their
# ranks and timeouts assume the cores to themselves. Both passes run; either failing fails.
PYTEST_WORKERS ?= 2
PYTEST = HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} $(PY) -m pytest -q
test: lint
	$(PYTEST) -n $(PYTEST_WORKERS) -m 'not slow and not distributed'; a=$$?; \
	$(PYTEST) -m 'distributed and not slow'; b=$$?; \
	test $$a -eq 0 && test $$b -eq 0

# the native CPU kernels' tests under AddressSanitizer: a debugging build of csrc/ (its own cache
# entry) in a process with the compiler's libasan preloaded; any out-of-bounds access aborts
# with a report (see docs/design.md, "Kernels")
ASAN_LIB = $(shell $${CXX:-g++} -print-file-name=libasan.so 2>/dev/null)
sanitize: $(STAMP)
	DYNAMIQ_CPU_SANITIZE=address LD_PRELOAD=$(ASAN_LIB) ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
	HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} \
	$(PY) -X faulthandler -m pytest -q -x -m 'not slow and not distributed' tests/kernels tests/codecs

lint: $(STAMP)
	$(VENV)/bin/ruff check dynamiq tests benchmarks examples
	$(VENV)/bin/ruff format --check dynamiq tests benchmarks examples
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build dist *.egg-info
