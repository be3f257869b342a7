# specdec: two commands on a fresh machine, `make demo` and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install test demo bench llamacpp llamacpp-invariant

# A bare `torch` requirement on a machine without torch pulls several GB of CUDA
# packages; install the CPU build first when torch is not importable.
install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'

test: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q -x --timeout=900 tests

demo: install
	$(PYTHON) -m specdec.cli demo

bench: install
	$(PYTHON) -m specdec.cli bench

# llama.cpp, the CPU baseline of `specdec eval --methods llamacpp,llamacpp-spec:...`: built from the
# source that the llama-cpp-python sdist on the package index vendors (about 8 minutes on 2 cores).
LLAMACPP_VERSION := 0.3.36
LLAMACPP_HOME ?= $(or $(SPECDEC_HOME),$(HOME)/.cache/specdec)/llama.cpp
LLAMACPP_BUILD ?= build
LLAMACPP_FLAGS ?=
llamacpp:
	@mkdir -p $(LLAMACPP_HOME)
	cd $(LLAMACPP_HOME) && $(PIP) download --no-deps --no-binary llama-cpp-python -d . llama-cpp-python==$(LLAMACPP_VERSION) \
		&& tar xzf llama_cpp_python-$(LLAMACPP_VERSION).tar.gz
	$(PIP) install cmake ninja
	cmake -S $(LLAMACPP_HOME)/llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp -B $(LLAMACPP_HOME)/$(LLAMACPP_BUILD) \
		-G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF $(LLAMACPP_FLAGS)
	ninja -C $(LLAMACPP_HOME)/$(LLAMACPP_BUILD) llama-bench llama-completion llama-speculative-simple llama-server
	@echo "llama.cpp built in $(LLAMACPP_HOME)/$(LLAMACPP_BUILD)/bin"

# llama.cpp without its llamafile GEMMs (tinyBLAS), which it runs for forwards of 2+ tokens only: its
# speculative output then equals its plain output (benchmarks/llamacpp_export_check.py with
# SPECDEC_LLAMACPP=$(LLAMACPP_HOME)/build-invariant/bin); the speed baseline stays the default build.
llamacpp-invariant:
	$(MAKE) llamacpp LLAMACPP_BUILD=build-invariant LLAMACPP_FLAGS=-DGGML_LLAMAFILE=OFF
