# capbook: two commands for a newcomer (see README.md).
#   make book   regenerate the book (PROFILE=default|smoke)
#   make test   run the test suite
# Both create .venv and install capbook into it first.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
PROFILE ?= default
STAMP := $(VENV)/.capbook-installed

.PHONY: book test venv browser sync

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test]'
	@touch $@

# Headless Chromium for the docs-site test (Debian package; needs root or sudo).
browser:
	@command -v chromium >/dev/null || { \
	  S=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$S apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$S apt-get install -y -qq chromium >/dev/null; }

book: venv
	$(BIN)/capbook book --profile $(PROFILE)

test: venv browser
	$(BIN)/python -m pytest -q

# After editing a notebook's paired .py (or the .ipynb): sync the pair, clean, export.
sync: venv
	$(BIN)/jupytext --sync nbs/*.ipynb
	$(BIN)/nbdev_clean
	$(BIN)/nbdev_export
