# The two set-up commands of the README: `make demo` and `make test`. Each installs what it
# needs into .venv (torch 2.13 CPU wheel where this machine has it, else PyPI's).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install test demo lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0" || $(PY) -m pip install -q "torch>=2.6"
	$(PY) -m pip install -q -e ".[test,demo,dev]"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m ruff check cce_compile tests bench examples
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: install
	$(PY) -m cce_compile.demo $(DEMO_ARGS)

lint: install
	$(PY) -m ruff check cce_compile tests bench examples
	$(PY) -m ruff format --check cce_compile

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
