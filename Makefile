# The two set-up commands of the README: `make demo` and `make test`. Each installs what it
# needs into .venv (torch 2.13 CPU wheel where this machine has it, else PyPI's).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# The demo's corpus cache (its --cache-dir default).
DEMO_CACHE ?= $(HOME)/.cache/cce_compile

.PHONY: install test test-gpu demo lint clean

# Each step says what it does: the torch download alone can take minutes, so pip shows its
# progress bar for it (and for the rest) instead of running quietly. One stamp per layer: the
# venv with torch, then cce_compile with each target's extras, so `make demo` installs only what
# the demo needs and a later `make test` adds the test tools. An editable install copies the
# start-up hook (the .pth file) into the venv, so a changed hook reinstalls too. The venv's pip
# is upgraded first: Python 3.11's bundled pip 23.2 spent 59-71 s resolving and installing the
# test extras where pip 26.3 took 34 s (the upgrade itself: 4 s; cold, 2 cores); an upgrade that
# fails (no index) leaves the bundled pip, which installs the same packages.
# pip byte-compiles what it installs on one core; installing without (--no-compile), then
# compiling with compileall on every core (it skips what is compiled already) took 10-15 s
# less for torch, and again for the test extras, on 2 cores. torch's layer (what its pip run
# installed, listed in .torch-layer) is compiled while the next layer's pip runs, which mostly
# waits on the package index and the disk (~5 s less again). As with pip, a file that does not
# compile (a package's Python 2 test data) stays source only. The demo's layer is cce_compile
# alone (the demo draws its figure as SVG with the standard library, so it needs no extra);
# Python compiles our own modules as the demo imports them, and the torch layer's compile is
# its long pole: it leaves out the packages' tests/ folders and pip (19 of its 93 MB of
# source, which the demo never imports; 31 s of CPU instead of 43). The test layer is not
# compiled up front: the tests import a small part of what it holds (transformers' 2,900
# modules, pandas' 1,400 through datasets), so the suite runs with bytecode writing on
# (whatever PYTHONDONTWRITEBYTECODE says) and Python compiles each module once, as it is first
# imported, pytest's rewritten test modules included. Compiling the layer took 32 s on 2 cores
# and the suite took as long without it (522 s against 528, cold).
PIP_INSTALL = $(PY) -m pip install --no-compile --progress-bar on
BYTE_COMPILE_TORCH = ($(PY) -m compileall -qq -j 0 -x '/tests/|/site-packages/pip/' \
	$$(cat $(VENV)/.torch-layer) || true)

$(VENV)/.installed-torch:
	@echo "[1/2] creating $(VENV)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip || echo "(pip not upgraded: installing with the venv's own)"
	@echo "[2/2] installing torch (a large download: ~1-3 minutes; progress below)"
	$(PIP_INSTALL) "torch==2.13.0" || $(PIP_INSTALL) "torch>=2.6"
	ls -d $(VENV)/lib/python*/site-packages/* > $(VENV)/.torch-layer
	touch $@

$(VENV)/.installed-demo: $(VENV)/.installed-torch pyproject.toml cce_compile_autoenable.pth
	@echo "installing cce_compile (editable), byte-compiling torch meanwhile"
	$(BYTE_COMPILE_TORCH) & $(PIP_INSTALL) -e . && wait
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-torch pyproject.toml cce_compile_autoenable.pth
	@echo "installing cce_compile with its test and dev extras (transformers, peft, trl, ...), byte-compiling torch meanwhile"
	$(BYTE_COMPILE_TORCH) & $(PIP_INSTALL) -e ".[test,dev]" && wait
	@echo "installed into $(VENV)"
	touch $@

# Everything: what `make test` and `make lint` use.
install: $(VENV)/.installed-test

# The suite on the CI's two cores, on two workers (one per core; a file's tests stay on one
# worker and share its compiles). The tests that start groups of processes (tests/distributed,
# marked multiprocess) run among the others: alone they kept 1.6 of the two cores busy, and the
# other worker's tests take the rest (one run 7 min 56 s, the two apart 6:42 + 1:58, cold).
test: install
	$(PY) -m ruff check cce_compile tests bench examples
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n 2 --dist loadfile $(PYTEST_ARGS)

# On a CUDA machine whose Python has torch and triton (the device machine; no venv): the tests
# marked gpu, then the Triton kernel and path tests, which carry no marker (CI runs them in
# Triton's interpreter) and run on the GPU only when named.
GPU_KERNEL_TESTS = tests/kernels tests/implementations/test_triton_path.py \
	tests/implementations/test_triton_fast.py tests/implementations/test_split_vocabulary.py \
	tests/op/test_compaction.py tests/test_row_metrics.py tests/test_filtering.py
test-gpu:
	$(PYTHON) -m pytest -q -p no:cacheprovider -m gpu tests $(PYTEST_ARGS)
	$(PYTHON) -m pytest -q -p no:cacheprovider $(GPU_KERNEL_TESTS) $(PYTEST_ARGS)

# The demo's venv has no numpy (nothing of the demo uses it); torch says so at import with a
# "Failed to initialize NumPy" warning, silenced here.
demo: $(VENV)/.installed-demo
	$(PY) -W "ignore:Failed to initialize NumPy:UserWarning" -m cce_compile.demo $(DEMO_ARGS)

lint: install
	$(PY) -m ruff check cce_compile tests bench examples
	$(PY) -m ruff format --check cce_compile

# What the targets above create: the venv, the tools' caches, the demo's results (demo_out/,
# its --out default) and its tokenised corpus.
clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .ruff_cache demo_out
	rm -f $(DEMO_CACHE)/stdlib-*.pt
	rmdir $(DEMO_CACHE) 2>/dev/null || true
