# specdec: two commands on a fresh machine, `make demo` and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install test demo bench

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
