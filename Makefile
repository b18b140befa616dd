# Two commands do everything on a fresh machine with Python 3.11 and pip:
#   make demo   an embedding model trained with sparse_adam next to optax.adam (installs the library alone)
#   make test   lint, type check, the docs site, and the whole test suite (installs the test and docs extras)
#   make docs   the docs site, into docs/_build/html (warnings are errors)
#   make test-jax-range   the quick tests at the oldest and the newest supported jax (not part of `make test`)
#   make sanitize   the native kernels' tests under ASan and UBSan, on a copy built in build/sanitize (not part of `make test`)
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# The library and its dependencies (jax, jaxlib, optax): all that examples/demo.py needs.
RUNTIME := $(VENV)/.installed-runtime
# The library with the test and docs extras.
STAMP := $(VENV)/.installed
SOURCES := pyproject.toml setup.py $(wildcard optax_sparse_adam/csrc/*)

.PHONY: demo test lint docs browser bench clean test-jax-range

$(PY):
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "$(PYTHON) not found; set PYTHON=..."; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(RUNTIME): $(SOURCES) | $(PY)
	$(PY) -m pip install -q -e .
	touch $(RUNTIME)

$(STAMP): $(SOURCES) | $(PY)
	$(PY) -m pip install -q -e ".[test,docs]"
	touch $(STAMP) $(RUNTIME)

demo: $(RUNTIME)
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
	OPTAX_SPARSE_ADAM_REQUIRE_KERNELS=1 $(PY) -m pytest -n 2 --dist worksteal --durations=40

bench: $(STAMP)
	$(PY) benchmarks/run.py

# The supported range: pyproject.toml's floors and the newest jax tested (raise PINS_newest when a newer one passes).
# The floors are the oldest releases the quick tests pass on: jax 0.9 lacked an API the kernel dispatch used then
# (jax.extend.core.unsafe_get_axis_names_DO_NOT_USE; no longer used, 0.9 not retried since); on jax 0.10.0 and 0.10.1 a donated lazy_dense step copies the
# table, and on 0.10.0 results the tests compare bitwise (sharded against one device) differ by an ulp; optax 0.2.7
# does not import with jax 0.10, and with optax 0.2.6 inject_hyperparams fails the learning-rate check.
# Each end gets a venv of its own under build/ with the test extra, installed in editable mode as .venv is (the
# kernels are rebuilt in place, against the newest jaxlib's headers as any isolated build is), and runs
# `pytest -m "not slow"` with the kernels required. PYTHON=python3.X runs it at another Python.
PINS_oldest := jax==0.10.2 jaxlib==0.10.2 optax==0.2.8
PINS_newest := jax==0.10.2 jaxlib==0.10.2

build/jax-%/.installed: $(SOURCES)
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "$(PYTHON) not found; set PYTHON=..."; exit 1; }
	rm -rf build/jax-$*
	$(PYTHON) -m venv build/jax-$*
	build/jax-$*/bin/python -m pip install -q --upgrade pip
	build/jax-$*/bin/python -m pip install -q -e ".[test]" $(PINS_$*)
	touch $@

test-jax-range: build/jax-oldest/.installed build/jax-newest/.installed
	for end in oldest newest; do \
	  build/jax-$$end/bin/python -c 'import jax, jaxlib, optax, sys; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, "optax", optax.__version__, "python", sys.version.split()[0])' && \
	  OPTAX_SPARSE_ADAM_REQUIRE_KERNELS=1 build/jax-$$end/bin/python -m pytest -m "not slow" -n 2 || exit 1; \
	done

clean:
	rm -rf $(VENV) build/jax-oldest build/jax-newest .pytest_cache .mypy_cache .ruff_cache docs/_build docs/_generated docs/_autosummary

# tools/sanitize.sh: the working tree copied into build/sanitize/src, its kernels built there with
# -fsanitize=address,undefined, and the kernel tests run from the copy (the in-place _kernels.so is left alone,
# so this does not depend on $(STAMP), whose install would rebuild it; it needs .venv with the test extra).
.PHONY: sanitize
sanitize:
	PY=$(PY) tools/sanitize.sh
