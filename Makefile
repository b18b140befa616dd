# Two commands do everything on a fresh machine with Python 3.11 and pip:
#   make demo   an embedding model trained with sparse_adam next to optax.adam
#   make test   lint, type check, the docs site, and the whole test suite
#   make docs   the docs site, into docs/_build/html (warnings are errors)
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint docs browser bench clean

$(STAMP): pyproject.toml setup.py $(wildcard optax_sparse_adam/csrc/*)
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "$(PYTHON) not found; set PYTHON=..."; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,docs]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -n -q -b html docs docs/_build/html

# Debian's Chromium and ChromeDriver, which tests/test_docs.py drives to open every page of the built site.
browser:
	@if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then \
	  command -v apt-get >/dev/null 2>&1 || { echo "the docs test needs chromium and chromedriver on PATH"; exit 1; }; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium chromium-driver; \
	fi

test: lint docs browser
	OPTAX_SPARSE_ADAM_REQUIRE_KERNELS=1 $(PY) -m pytest -n 2

bench: $(STAMP)
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache docs/_build docs/_generated docs/_autosummary
