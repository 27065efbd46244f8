# capbook: two commands for a newcomer (see README.md).
#   make book        regenerate the book (PROFILE=default|smoke, JOBS notebooks side by side, ONLY="chapters or steps")
#   make docs        build and open the docs site from the last book's kept notebooks (no training)
#   make test        lint, then the whole test suite (smoke book, docs site in a browser, DDP included)
#   make test-fast   lint, then everything but the slow end-to-end tests (under a minute)
#   make soak        the long fault and scale runs that make test leaves out (whole books killed at random)
# Both create .venv and install capbook into it first.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
PROFILE ?= default
JOBS ?= 2
STAMP := $(VENV)/.capbook-installed
# Python writes each module's bytecode the first time a process imports it, in every command below, where an
# environment that sets PYTHONDONTWRITEBYTECODE would have every process compile its imports from source again.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: book docs test test-fast soak lint hooks venv lock browser sync gpu-check gpu-book

venv: $(STAMP)

# Installed from requirements.lock (today's versions of every package, `make lock` to move them) by uv, from the
# indexes pip is configured with (tools/pip_indexes.py): about 25 s where pip's resolver and serial unpacking took 2-3
# minutes. Where uv cannot be had or fails (a proxy that only pip is set up for), pip installs the same pins.
LOCK := $(wildcard requirements.lock)
UV_FROM_PIP = $$($(BIN)/python tools/pip_indexes.py) --index-strategy unsafe-best-match

# Each module's bytecode is written when a process first imports it (above); the package and the libraries the test
# workers, kernels and site builds load are imported once when the venv is made, so that the first test run's workers
# and kernels do not all compile the same modules at once (about 15 s of CPU, once).
WARM := pytest xdist papermill ipykernel matplotlib.pyplot scipy.stats sphinx myst_nb jupyter_book

$(STAMP): pyproject.toml $(LOCK)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install -q 'uv==0.13.9' > /dev/null 2>&1 || true
	@{ test -x $(BIN)/uv && $(BIN)/uv pip install -q --python $(BIN)/python $(UV_FROM_PIP) $(if $(LOCK),-c $(LOCK)) -e '.[test]'; } \
	 || $(BIN)/pip install -q $(if $(LOCK),-c $(LOCK)) -e '.[test]'
	@# one process: the imports above, then the kernel config (no plain-TCP warning in the reader's papermill runs)
	@$(BIN)/python -c 'import importlib, pkgutil, capbook; [importlib.import_module(m) for m in [f"capbook.{i.name}" for i in pkgutil.iter_modules(capbook.__path__)] + "$(WARM)".split()]; capbook.book.write_kernel_config()'
	@touch $@

# requirements.lock from pyproject.toml's ranges, keeping every pin the ranges still allow (uv reads the old file).
lock: venv
	$(BIN)/uv pip compile pyproject.toml --extra test --python $(BIN)/python $(UV_FROM_PIP) --no-emit-find-links \
	  --no-emit-index-url --custom-compile-command 'make lock' -o requirements.lock

# Headless Chromium for the docs-site test (Debian package; needs root or sudo).
browser:
	@command -v chromium >/dev/null || { \
	  S=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$S apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$S apt-get install -y -qq chromium >/dev/null; }

book: venv
	$(BIN)/capbook book --profile $(PROFILE) -j $(JOBS) $(if $(ONLY),--only $(ONLY)) $(if $(FORCE),--force)

docs: venv
	$(BIN)/capbook docs --open

LINTED := capbook nbs/*.py tests tools

lint: venv
	$(BIN)/ruff check $(LINTED)

# Both cores: two pytest workers (pytest-xdist); the tests that read the one smoke book share a worker (xdist_group).
test: lint browser
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder --durations=20

test-fast: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder -m "not slow"

# The full-strength fault and scale runs: whole smoke books killed at random, the rehearsal at a larger scale.
soak: lint browser
	CAPBOOK_EVERY=1 $(BIN)/python -m pytest -q -n 2 -m "soak or sampled"

# nbdev's habits as git pre-commit hooks: clean notebooks, export, lint (.pre-commit-config.yaml).
hooks: venv
	$(BIN)/pip install -q pre-commit
	$(BIN)/pre-commit install

# After editing a notebook's paired .py (or the .ipynb): sync the pair, export, regenerate what is derived
# (the chapters' parameters cells from their dataclasses, the README's chapter table), clean.
sync: venv
	$(BIN)/jupytext --sync nbs/*.ipynb
	$(BIN)/nbdev_export
	$(BIN)/capbook params
	$(BIN)/capbook readme
	$(BIN)/jupytext --sync nbs/*.ipynb
	$(BIN)/nbdev_clean
	$(BIN)/nbdev_export

# On a machine with a CUDA GPU, with its own python3 and torch (no venv): every family's training speed alone, 32 seeds
# stacked eagerly and captured as one CUDA graph, the captured step against the eager one, and why a capture fails.
# Everything it prints, the JSON last, goes to $OUT/capture.log (OUT: the folder that comes back; runs/ otherwise).
gpu-check:
	mkdir -p $${OUT:-runs}; PYTHONUNBUFFERED=1 PYTHONPATH=.:$${PYTHONPATH} timeout $${GPU_CHECK_S:-500} python3 -c \
	  'import sys; from capbook.cli import main; sys.exit(main())' bench --device cuda --capture $${GPU_CHECK_ARGS:---stacked 1 4 32 --batches 8} 2>&1 | tee $${OUT:-runs}/capture.log

# On a machine lent with a CUDA GPU (its own python3 and torch, no venv, perhaps no Jupyter): `make gpu-check`'s
# throughput, then the default book's chapter runs bare, a row's seeds stacked, for BOOK_S seconds (tools/gpu_book.py);
# $OUT/gpu_book.json (wall time, share done, projected whole) and the finished runs' records (gpu_book-N.tar.gz) come back;
# here, `capbook book --device cuda --received gpu_book-*.tar.gz` scores and tabulates them.
gpu-book:
	OUT=$${OUT:-runs/gpu-book} python3 tools/gpu_book.py
