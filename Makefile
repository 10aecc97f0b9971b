# The two set-up commands of the README: `make demo` and `make test`. Each installs what it
# needs into .venv (torch 2.13 CPU wheel where this machine has it, else PyPI's).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# The demo's corpus cache (its --cache-dir default).
DEMO_CACHE ?= $(HOME)/.cache/cce_compile

.PHONY: install test demo lint clean

# Each step says what it does: the torch download alone can take minutes, so pip shows its
# progress bar for it (and for the rest) instead of running quietly.
$(VENV)/.installed: pyproject.toml
	@echo "[1/4] creating $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "[2/4] upgrading pip"
	$(PY) -m pip install -q --upgrade pip
	@echo "[3/4] installing torch (a large download: ~1-3 minutes; progress below)"
	$(PY) -m pip install --progress-bar on "torch==2.13.0" || $(PY) -m pip install --progress-bar on "torch>=2.6"
	@echo "[4/4] installing cce_compile and its test/demo/dev extras"
	$(PY) -m pip install --progress-bar on -e ".[test,demo,dev]"
	@echo "installed into $(VENV)"
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

# What the targets above create: the venv, the tools' caches, the demo's results (demo_out/,
# its --out default) and its tokenised corpus.
clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache demo_out
	rm -f $(DEMO_CACHE)/stdlib-*.pt
	rmdir $(DEMO_CACHE) 2>/dev/null || true
